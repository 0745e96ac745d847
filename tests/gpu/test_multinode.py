"""Hierarchical collectives (node team over NVLink, rails over the NVSHMEM device API), checked on one node
with FLUXRT_TOPOLOGY=virtual:NxG: e.g. `FLUXRT_TOPOLOGY=virtual:2x1 fluxrt-run -n 2 -- python -m pytest
tests/gpu/test_multinode.py`, virtual:2x2 on 4 ranks (or all ranks on one GPU under MPS: launch/mps-check.sh).

Results are compared with a float64 numpy reference of every rank's input (each rank makes all inputs from
seeds) and must be bitwise equal on every rank.
"""
import hashlib
import os

import numpy as np
import pytest

pytestmark = pytest.mark.multirank

_EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -10, "fp32": 2.0 ** -23}
_NEEDS = ("needs several (virtual) nodes: FLUXRT_TOPOLOGY=virtual:2x1 on 2 ranks or virtual:2x2 on 4 "
          "(or a multi-node job)")


@pytest.fixture(scope="module")
def hier(world):
    if not world.topology.hierarchical:
        pytest.skip(_NEEDS)
    import fluxrt.collectives as coll

    ctx = coll.context(world)
    from fluxrt.collectives_hier import HierarchicalCollectives

    assert isinstance(ctx, HierarchicalCollectives)
    return ctx


def _np_dtype(name):
    import fluxrt

    return fluxrt.normalize_dtype(name)


def _inputs(seed, n, count, dtype):
    """Every rank's input (host, already rounded to `dtype`), the same on every rank."""
    out = []
    for r in range(n):
        rng = np.random.default_rng(seed * 1000 + r)
        x = rng.standard_normal(count).astype(np.float32)
        if dtype == "int32":
            x = rng.integers(-1000, 1000, count).astype(np.int32)
        out.append(x.astype(_np_dtype(dtype)))
    return out


def _device(host):
    import cupy

    return cupy.asarray(host)


def _poisoned(count, dtype):
    import cupy

    return cupy.full(count, np.nan if dtype != "int32" else -7, dtype=_np_dtype(dtype))


def _host(a):
    return a.get()


def _digests(world, host) -> list:
    """Every rank's sha256 of `host` (a collective call: made before any assertion, so that a failing rank
    does not leave the others' later calls out of step)."""
    return world.comm.allgather(hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest())


def _bound(inputs, op, dtype):
    """Sums: fp32 accumulation rounded to the dtype at every stage that stores a partial (the node's ring
    hops, the node team's shard, the rail's result), each off by at most EPS times the sum of magnitudes."""
    xs = np.stack([x.astype(np.float64) for x in inputs])
    ref = {"sum": xs.sum(0), "max": xs.max(0), "min": xs.min(0)}[op]
    if op != "sum":
        return ref, np.zeros_like(ref)   # max/min of representable values is exact
    eps = _EPS[dtype]
    magnitude = np.abs(xs).sum(0)
    return ref, eps * np.abs(ref) + (len(inputs) * eps + len(inputs) * 2.0 ** -23) * magnitude + 1e-7


def _check(world, got, inputs, op, dtype, what):
    """got against the float64 reference of `inputs`, and the same bits on every rank."""
    every = _digests(world, got)
    ref, bound = _bound(inputs, op, dtype)
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{what}: non-finite values (poison left)"
    bad = np.abs(g - ref) > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {g.size} elements off, first at {int(np.argmax(bad))}: "
                           f"{g[np.argmax(bad)]} vs {ref[np.argmax(bad)]}")
    assert len(set(every)) == 1, f"{what}: results differ across ranks"


def test_topology_is_virtual_nodes(world):
    setting = os.environ.get("FLUXRT_TOPOLOGY", "")
    if not setting.startswith("virtual:"):
        pytest.skip(_NEEDS)
    n_nodes, g = (int(v) for v in setting.split(":")[1].lower().split("x"))
    t = world.topology
    assert t.virtual and t.num_nodes == n_nodes and len(t.local_ranks) == g
    assert t.local_ranks == tuple(range(t.node * g, (t.node + 1) * g))
    assert set(t.nvshmem_peers()) == set(range(world.size)) - set(t.local_ranks)
    assert t.rail() == tuple(k * g + world.rank % g for k in range(n_nodes))


@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("count", (1, 1001, 4096, (1 << 20) + 3))
def test_allreduce(world, hier, dtype, count):
    inputs = _inputs(count % 97 + len(dtype), world.size, count, dtype)
    import fluxrt

    out = _poisoned(count, dtype)
    fluxrt.allreduce(world, _device(inputs[world.rank]), out)
    world.synchronize()
    got = _host(out)
    _check(world, got, inputs, "sum", dtype, f"hierarchical allreduce {count} x {dtype}")


@pytest.mark.parametrize("op", ("max", "min"))
def test_allreduce_max_min(world, hier, op):
    import fluxrt

    inputs = _inputs(7, world.size, 33333, "fp32")
    out = fluxrt.allreduce(world, _device(inputs[world.rank]), op=op)
    world.synchronize()
    got = _host(out)
    _check(world, got, inputs, op, "fp32", f"hierarchical allreduce {op}")


def test_allreduce_several_rail_rounds_in_place_and_async(world, hier):
    """A message larger than a rail slot (several rounds, both buffer halves), in place, then async."""
    import fluxrt

    count = (hier.slot_bytes * hier.ranks_per_node * 5) // 2 // 4 + 5   # 2.5 slots per shard, fp32
    inputs = _inputs(3, world.size, count, "fp32")
    x = _device(inputs[world.rank])
    fluxrt.allreduce(world, x, x)
    world.synchronize()
    got = _host(x)
    y = _device(inputs[world.rank])
    h = fluxrt.allreduce(world, y, async_op=True)
    res = h.wait()
    world.synchronize()
    same = np.array_equal(_host(res), got)
    _check(world, got, inputs, "sum", "fp32", "hierarchical allreduce, several rounds, in place")
    assert same, "async allreduce differs from the in-place one"


@pytest.mark.parametrize("dtype", ("bf16", "fp32"))
@pytest.mark.parametrize("chunk", (1, 777, (1 << 18) + 8))
def test_reduce_scatter(world, hier, dtype, chunk):
    import fluxrt

    n = world.size
    inputs = _inputs(chunk % 89 + 11, n, n * chunk, dtype)
    out = _poisoned(chunk, dtype)
    fluxrt.reduce_scatter(world, _device(inputs[world.rank]), out)
    world.synchronize()
    mine = [x[world.rank * chunk:(world.rank + 1) * chunk] for x in inputs]
    ref, bound = _bound(mine, "sum", dtype)
    g = _host(out).astype(np.float64)
    bad = ~(np.abs(g - ref) <= bound)
    every = world.comm.allgather(int(bad.sum()))
    assert not any(every), (f"hierarchical reduce_scatter {chunk} x {dtype}: elements off per rank {every}, "
                            f"first here at {int(np.argmax(bad))}")


@pytest.mark.parametrize("dtype", ("bf16", "int32", "fp32"))
@pytest.mark.parametrize("chunk", (1, 1001, (1 << 20) + 1))
def test_allgather(world, hier, dtype, chunk):
    import fluxrt

    n = world.size
    inputs = _inputs(chunk % 83 + 5, n, chunk, dtype)
    out = _poisoned(n * chunk, dtype)
    fluxrt.allgather(world, _device(inputs[world.rank]), out)
    world.synchronize()
    got = _host(out)
    every = _digests(world, got)
    assert np.array_equal(got.view(np.uint8), np.concatenate(inputs).view(np.uint8)), "allgather differs"
    assert len(set(every)) == 1


def test_allgather_in_place(world, hier):
    import fluxrt

    n, chunk = world.size, 4099
    inputs = _inputs(17, n, chunk, "fp32")
    out = _poisoned(n * chunk, "fp32")
    out[world.rank * chunk:(world.rank + 1) * chunk] = _device(inputs[world.rank])
    fluxrt.allgather(world, out[world.rank * chunk:(world.rank + 1) * chunk], out)
    world.synchronize()
    ok = world.comm.allgather(bool(np.array_equal(_host(out), np.concatenate(inputs))))
    assert all(ok), f"in-place allgather per rank: {ok}"


@pytest.mark.parametrize("count", ((1 << 24) + 32, (1 << 24) + 5))
def test_stages_of_a_large_allreduce(world, hier, count):
    """Each stage of a large hierarchical allreduce against its own reference (node reduce-scatter on the node
    team, rail allreduce, node all-gather), whole shards and padded; reports the first stage that fails."""
    import cupy

    from fluxrt.collectives_hier import shard_elems

    g, k, li = hier.ranks_per_node, hier.node_index, world.topology.local_index
    inputs = _inputs(count % 61 + 9, world.size, count, "fp32")
    shard = shard_elems(count, g, 4, hier.nodes)
    padded = [np.concatenate([x.astype(np.float64), np.zeros(shard * g - count)]) for x in inputs]
    xin = cupy.zeros(shard * g, np.float32)
    xin[:count] = _device(inputs[world.rank])
    mine = cupy.full(shard, np.nan, np.float32)
    status = {}
    members = world.topology.local_ranks
    if hier.node is not None:
        hier.node.reduce_scatter(xin, mine)
    else:
        mine[...] = xin
    world.synchronize()
    want = sum(padded[r][li * shard:(li + 1) * shard] for r in members)
    status["node_rs"] = int((~(np.abs(_host(mine) - want) <= 1e-4 * (1 + np.abs(want)))).sum())
    hier._rail_allreduce(mine, "fp32", "sum", cupy.cuda.get_current_stream(), "hier.allreduce")
    world.synchronize()
    want = sum(p[li * shard:(li + 1) * shard] for p in padded)
    status["rail"] = int((~(np.abs(_host(mine) - want) <= 1e-4 * (1 + np.abs(want)))).sum())
    full = cupy.full(shard * g, np.nan, np.float32)
    if hier.node is not None:
        hier.node.allgather(mine, full)
    else:
        full[...] = mine
    world.synchronize()
    want = sum(padded)
    status["node_ag"] = int((~(np.abs(_host(full) - want) <= 1e-4 * (1 + np.abs(want)))).sum())
    every = world.comm.allgather((k, li, status))
    assert all(not any(st.values()) for _, _, st in every), f"elements off per stage, (node, local, stages): {every}"


def test_unsupported_op_names_the_path(world, hier):
    import fluxrt

    with pytest.raises(fluxrt.CollectiveArgumentError, match="across nodes"):
        fluxrt.allreduce(world, _device(np.zeros(world.size, np.float32)), compress="fp8")


def _alltoallv_case(n, seed, scale, dtype, pad):
    """The count matrix ([p][q]: elements p sends to q; zeros, and rank n - 1 sends nothing), every rank's
    send displacements (`pad` elements of gap after each block) and input, the same on every rank."""
    rng = np.random.default_rng(seed)
    m = rng.integers(0, scale, size=(n, n))
    m[rng.random((n, n)) < 0.25] = 0
    m[n - 1] = 0
    displs = [np.concatenate(([0], np.cumsum(m[p] + pad)[:-1])) for p in range(n)]
    inputs = [_inputs(seed * 7 + p, n, int(m[p].sum() + pad * n), dtype)[p] for p in range(n)]
    return m, displs, inputs


def _alltoallv_ok(got, m, displs, inputs, rank, rd, pad, dtype) -> bool:
    """out's block from every rank p equals p's data for this rank bitwise; the gaps keep their poison."""
    poison = _host(_poisoned(1, dtype)).view(np.uint8)
    for p in range(m.shape[0]):
        c = int(m[p][rank])
        want = inputs[p][displs[p][rank]:displs[p][rank] + c]
        if not np.array_equal(got[rd[p]:rd[p] + c].view(np.uint8), want.view(np.uint8)):
            return False
        gap = got[rd[p] + c:rd[p] + c + pad]
        if not np.array_equal(gap.view(np.uint8), np.tile(poison, gap.size)):
            return False
    return True


@pytest.mark.parametrize("dtype", ("bf16", "int32"))
@pytest.mark.parametrize("seed, scale, given_recv, pad", [(1, 7, True, 0), (2, 5000, False, 3), (3, 300_000, True, 0)])
def test_alltoallv(world, hier, dtype, seed, scale, given_recv, pad):
    """Two phases (node all-to-all-v of the blocks regrouped by destination local index, then one put per
    remote node sized to that pair): uneven counts, zero pairs, a rank sending nothing, gaps between blocks
    (they keep the poison), against the flat definition, bitwise."""
    import fluxrt

    n, r = world.size, world.rank
    m, displs, inputs = _alltoallv_case(n, seed, scale, dtype, pad)
    rc = m[:, r]
    rd = np.concatenate(([0], np.cumsum(rc + pad)[:-1]))
    out = _poisoned(int(rc.sum() + pad * n), dtype)
    fluxrt.alltoallv(world, _device(inputs[r]), m[r], rc if given_recv else None, out,
                     send_displs=displs[r] if pad else None, recv_displs=rd if pad else None)
    world.synchronize()
    ok = world.comm.allgather(_alltoallv_ok(_host(out), m, displs, inputs, r, rd, pad, dtype))
    assert all(ok), f"hierarchical alltoallv seed={seed} {dtype}: correct per rank {ok}"


def test_alltoallv_in_several_rail_rounds_and_async(world, hier):
    """Small rail slots: pairs of several slots (several rounds, both buffer halves, rounds where some pairs
    are done and put the signal alone), out=None, then async on the same context."""
    from fluxrt.collectives import CollectivesOptions
    from fluxrt.collectives_hier import HierarchicalCollectives, HierarchicalOptions

    n, r = world.size, world.rank
    ctx = HierarchicalCollectives(world, HierarchicalOptions(rail_bytes=1 << 18,
                                                             node=CollectivesOptions(workspace_bytes=32 << 20)))
    try:
        results = []
        for seed, scale in ((11, 70_001), (12, 3)):
            m, displs, inputs = _alltoallv_case(n, seed, scale, "fp32", 0)
            rd = np.concatenate(([0], np.cumsum(m[:, r])[:-1]))
            out = ctx.alltoallv(_device(inputs[r]), m[r])
            res = ctx.alltoallv(_device(inputs[r]), m[r], m[:, r], async_op=True).wait()
            world.synchronize()
            results.append((_alltoallv_ok(_host(out), m, displs, inputs, r, rd, 0, "fp32"),
                            _alltoallv_ok(_host(res), m, displs, inputs, r, rd, 0, "fp32")))
        every = world.comm.allgather(results)
        assert all(a and b for per in every for a, b in per), f"alltoallv (plain, async) per rank: {every}"
    finally:
        ctx.free()


def test_alltoallv_bad_counts_fail_on_every_rank_before_launch(world, hier):
    import fluxrt

    n, r = world.size, world.rank
    send, recv = np.full(n, 4), np.full(n, 4)
    if r == 0:
        recv[n - 1] = 5
    x = _device(np.zeros(4 * n, np.int32))
    with pytest.raises(fluxrt.CollectiveMismatchError, match=f"rank {n - 1} sends 4 to rank 0, which expects 5"):
        fluxrt.alltoallv(world, x, send, recv, _poisoned(5 * n, "int32"))
    bad = np.full(n, 4)
    if r == n - 1:
        bad[0] = -1
    with pytest.raises(fluxrt.CollectiveArgumentError):
        fluxrt.alltoallv(world, x, bad)
    with pytest.raises(fluxrt.CollectiveArgumentError, match="out too small"):
        fluxrt.alltoallv(world, x, send, None, _poisoned(4 * n - 1, "int32"))
    out = fluxrt.alltoallv(world, x, send)   # the context still works after the refusals
    world.synchronize()
    assert world.comm.allgather(bool((_host(out) == 0).all())) == [True] * n


def _alltoall_reference(inputs, rank, n):
    c = inputs[0].size // n
    return np.concatenate([x[rank * c:(rank + 1) * c] for x in inputs])


@pytest.mark.parametrize("dtype", ("bf16", "int32", "fp32"))
@pytest.mark.parametrize("chunk", (1, 1001, (1 << 18) + 3))
def test_alltoall(world, hier, dtype, chunk):
    """Two phases (node all-to-all, rail exchange): out's chunk p is rank p's chunk for this rank, bitwise."""
    import fluxrt

    n = world.size
    inputs = _inputs(chunk % 79 + 13, n, n * chunk, dtype)
    out = _poisoned(n * chunk, dtype)
    fluxrt.alltoall(world, _device(inputs[world.rank]), out)
    world.synchronize()
    got = _host(out)
    ok = world.comm.allgather(bool(np.array_equal(got.view(np.uint8),
                                                  _alltoall_reference(inputs, world.rank, n).view(np.uint8))))
    assert all(ok), f"hierarchical alltoall {chunk} x {dtype}: correct per rank {ok}"


def test_alltoall_in_place_and_async(world, hier):
    import fluxrt

    n, chunk = world.size, 3001
    inputs = _inputs(29, n, n * chunk, "fp32")
    x = _device(inputs[world.rank])
    fluxrt.alltoall(world, x, x)
    y = _device(inputs[world.rank])
    res = fluxrt.alltoall(world, y, async_op=True).wait()
    world.synchronize()
    want = _alltoall_reference(inputs, world.rank, n)
    ok = world.comm.allgather((bool(np.array_equal(_host(x), want)), bool(np.array_equal(_host(res), want))))
    assert all(a and b for a, b in ok), f"in-place / async alltoall per rank: {ok}"


@pytest.mark.parametrize("dtype", ("bf16", "int32"))
@pytest.mark.parametrize("count", (1, 4097, (1 << 20) + 7))
def test_broadcast(world, hier, dtype, count):
    """Every root (its rail over NVSHMEM, then each node over NVLink), out of place and in place."""
    import fluxrt

    n = world.size
    inputs = _inputs(count % 67 + 21, n, count, dtype)
    results = []
    for root in sorted({0, n - 1, n // 2}):
        out = _poisoned(count, dtype)
        fluxrt.broadcast(world, _device(inputs[world.rank]), out, root=root)
        x = _device(inputs[world.rank])
        fluxrt.broadcast(world, x, root=root)
        world.synchronize()
        want = inputs[root].view(np.uint8)
        results.append((root, bool(np.array_equal(_host(out).view(np.uint8), want)),
                        bool(np.array_equal(_host(x).view(np.uint8), want))))
    every = world.comm.allgather(results)
    assert all(a and b for per in every for _, a, b in per), f"broadcast (root, out, in place) per rank: {every}"


def test_alltoall_and_broadcast_in_several_rail_rounds(world, hier):
    """Small rail slots (several rounds per call, both buffer halves, broadcasts whose rounds have one sender)
    on a second context."""
    from fluxrt.collectives import CollectivesOptions
    from fluxrt.collectives_hier import HierarchicalCollectives, HierarchicalOptions

    n = world.size
    ctx = HierarchicalCollectives(world, HierarchicalOptions(rail_bytes=1 << 18,
                                                             node=CollectivesOptions(workspace_bytes=32 << 20)))
    try:
        results = []
        for chunk in (5, 70001):
            inputs = _inputs(chunk % 37 + 41, n, n * chunk, "fp32")
            out = _poisoned(n * chunk, "fp32")
            ctx.alltoall(_device(inputs[world.rank]), out)
            world.synchronize()
            results.append(bool(np.array_equal(_host(out), _alltoall_reference(inputs, world.rank, n))))
            for root in (0, n - 1):
                b = _poisoned(n * chunk, "fp32")
                ctx.broadcast(_device(inputs[world.rank]), b, root=root)
                world.synchronize()
                results.append(bool(np.array_equal(_host(b), inputs[root])))
        every = world.comm.allgather(results)
        assert all(all(r) for r in every), f"alltoall/broadcast in several rounds per rank: {every}"
    finally:
        ctx.free()


def test_remote_rate_bench_moves_the_bytes(world, hier):
    """fluxrt-perf remote_rate's two paths (rail rounds through the NVSHMEM device API, SM pushes over NVLink
    pointers) with its byte checks, at small sizes; under MPS the times mean nothing."""
    from fluxrt.perf.remote_rate import rate_rows
    from fluxrt.perf.sweep import SweepOptions

    opts = SweepOptions(minbytes=3 << 14, maxbytes=3 << 20, stepfactor=8, iters=2, warmup_iters=1, check=1,
                        progress=False, datatype="int32")
    rows = rate_rows(world, opts, 1 << 20, [8])
    assert {r["path"] for r in rows} == {"nvlink_pointer", "nvshmem_api"}
    assert all(r["wrong"] == 0 for r in rows), rows
    assert max(r["pieces"] for r in rows) >= 3


def test_remote_wait_is_bounded(world, hier):
    """A rail wait whose puts never come ends at the world's bound and names the op and the rail peer."""
    import fluxrt
    from fluxrt.collectives_hier import THREADS
    from fluxrt.packed_launch import PackedLaunch

    if world.rank == 0:
        import cupy

        fn = hier.module.get_function("fluxrt_rail_reduce_fp32_sum")
        out = cupy.zeros(16, np.float32)
        never = np.uint64(hier.epoch + 1001)   # an epoch no rank has sent
        args = (hier._pes, np.uint32(hier.nodes), np.uint32(1), np.uint64(hier.recv.data.ptr),
                np.uint64(hier.half_bytes), np.uint64(hier.slot_bytes), np.uint64(hier.sig.data.ptr), never,
                np.uint64(out.data.ptr), np.uint64(16)) + hier._watch("hier.allreduce")
        PackedLaunch(fn, 1, THREADS, args).launch(cupy.cuda.get_current_stream().ptr)
        with pytest.raises(fluxrt.WaitTimeoutError) as info:
            world.synchronize()
        assert info.value.rank == 0 and info.value.peer in hier.rail
        assert "hier.allreduce" in str(info.value)
        world.reset_error()   # sticky otherwise: the module's later tests share this world
    world.comm.Barrier()


def test_rail_reduce_scatter_then_allgather(world, hier):
    """The rail allreduce in two rounds (reduce-scatter, all-gather), forced on a second context: same
    reference, same bits on every rank."""
    from fluxrt.collectives import CollectivesOptions
    from fluxrt.collectives_hier import HierarchicalCollectives, HierarchicalOptions

    ctx = HierarchicalCollectives(world, HierarchicalOptions(rail_bytes=1 << 20, oneshot_bytes=0,
                                                             node=CollectivesOptions(workspace_bytes=32 << 20)))
    try:
        for dtype, count in (("fp32", 5), ("bf16", 70001), ("fp32", (1 << 20) + 9)):   # last: several rounds
            inputs = _inputs(count % 71 + 3, world.size, count, dtype)
            out = _poisoned(count, dtype)
            ctx.allreduce(_device(inputs[world.rank]), out)
            world.synchronize()
            got = _host(out)
            _check(world, got, inputs, "sum", dtype, f"rail reduce-scatter + all-gather {count} x {dtype}")
    finally:
        ctx.free()


def test_tp_inside_the_node_dp_across_nodes(world, hier):
    """The recipe of docs/multinode.md: tp, dp = tp_dp_split(world); AllGather+GEMM and GEMM+ReduceScatter on
    the node's ranks, a hierarchical allreduce over the ranks with the same TP index; float64 references built
    from every rank's seeded inputs. The fused ops refuse the whole (cross-node) world first."""
    import fluxrt
    from fluxrt.collectives_hier import HierarchicalCollectives
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter, OpsArgumentError
    from fluxrt.topology import tp_dp_split

    from op_checks import f64, np_dtype, poisoned, problem

    with pytest.raises(OpsArgumentError, match="tp_dp_split"):
        AllGatherGemm(world, 256 * world.size, 384, 320, "bf16")
    topo = world.topology
    tp_ranks, dp_ranks = topo.tp_dp_groups()
    tp, dp = tp_dp_split(world)
    problems = []
    try:
        assert tp.size == len(topo.local_ranks) and dp.size == topo.num_nodes
        assert not tp.topology.hierarchical and dp.topology.hierarchical
        import fluxrt.collectives as coll

        assert isinstance(coll.context(dp), HierarchicalCollectives)
        dt, shard, n, k = "bfloat16", 256, 384, 320
        w = tp.size

        def rand(seed, shape):
            return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(np_dtype(dt))

        group = tp_ranks[0]
        # AllGather+GEMM: A shards of every TP member, B shared by the group
        a = {r: rand(100 + r, (shard, k)) for r in tp_ranks}
        b = rand(500 + group, (k, n))
        ag = AllGatherGemm(tp, shard * w, n, k, dt)
        try:
            out = poisoned((shard * w, n), dt)
            ag.forward(_device(a[world.rank]), _device(b), out=out)
            tp.synchronize()
            ref = np.concatenate([f64(a[r]) for r in tp_ranks]) @ f64(b)
            p = problem(out, ref, dt, f"AllGather+GEMM on TP group {tp_ranks}")
            if p:
                problems.append(p)
        finally:
            ag.free()
        # GEMM+ReduceScatter: A [M, K/w] and B [K/w, N] per member, out: this member's rows of the sum
        kl = k // 2 if w > 1 else k
        a2 = {r: rand(200 + r, (shard * w, kl)) for r in tp_ranks}
        b2 = {r: rand(300 + r, (kl, n)) for r in tp_ranks}
        rs = GemmReduceScatter(tp, shard * w, n, kl, dt)
        try:
            out2 = poisoned((shard, n), dt)
            rs.forward(_device(a2[world.rank]), _device(b2[world.rank]), out=out2)
            tp.synchronize()
            full = sum(f64(a2[r]) @ f64(b2[r]) for r in tp_ranks)
            p = problem(out2, full[tp.rank * shard:(tp.rank + 1) * shard], dt,
                        f"GEMM+ReduceScatter on TP group {tp_ranks}")
            if p:
                problems.append(p)
        finally:
            rs.free()
        # data parallel: the gradient-like allreduce over the DP group (hierarchical: one rank per node)
        count = 300007
        g = {r: np.random.default_rng(700 + r).standard_normal(count).astype(np.float32) for r in dp_ranks}
        got = fluxrt.allreduce(dp, _device(g[world.rank]))
        dp.synchronize()
        host = _host(got)
        ref, bound = _bound([g[r] for r in dp_ranks], "sum", "fp32")
        if not (np.abs(host.astype(np.float64) - ref) <= bound).all():
            problems.append(f"DP allreduce over {dp_ranks}: off the float64 reference")
        digests = dp.comm.allgather(hashlib.sha256(host.tobytes()).hexdigest())
        if len(set(digests)) != 1:
            problems.append(f"DP allreduce over {dp_ranks}: results differ across the group")
    finally:
        dp.finalize()
        tp.finalize()
    every = world.comm.allgather(problems)
    assert not any(every), f"problems per rank: {every}"
