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


def _same_on_every_rank(world, host, what):
    digest = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()
    every = world.comm.allgather(digest)
    assert len(set(every)) == 1, f"{what}: results differ across ranks"


def _assert_reduced(got, inputs, op, dtype, what):
    xs = np.stack([x.astype(np.float64) for x in inputs])
    ref = {"sum": xs.sum(0), "max": xs.max(0), "min": xs.min(0)}[op]
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{what}: non-finite values (poison left)"
    eps = _EPS[dtype]
    bound = (len(inputs) + 1) * 2 ** -23 * np.abs(xs).sum(0) + eps * np.abs(ref) + 1e-30
    bad = np.abs(g - ref) > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {g.size} elements off, first at {int(np.argmax(bad))}: "
                           f"{g[np.argmax(bad)]} vs {ref[np.argmax(bad)]}")


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
    _assert_reduced(got, inputs, "sum", dtype, f"hierarchical allreduce {count} x {dtype}")
    _same_on_every_rank(world, got, "allreduce")


@pytest.mark.parametrize("op", ("max", "min"))
def test_allreduce_max_min(world, hier, op):
    import fluxrt

    inputs = _inputs(7, world.size, 33333, "fp32")
    out = fluxrt.allreduce(world, _device(inputs[world.rank]), op=op)
    world.synchronize()
    got = _host(out)
    _assert_reduced(got, inputs, op, "fp32", f"hierarchical allreduce {op}")
    _same_on_every_rank(world, got, op)


def test_allreduce_several_rail_rounds_in_place_and_async(world, hier):
    """A message larger than a rail slot (several rounds, both buffer halves), in place, then async."""
    import fluxrt

    count = (hier.slot_bytes * hier.ranks_per_node * 5) // 2 // 4 + 5   # 2.5 slots per shard, fp32
    inputs = _inputs(3, world.size, count, "fp32")
    x = _device(inputs[world.rank])
    fluxrt.allreduce(world, x, x)
    world.synchronize()
    got = _host(x)
    _assert_reduced(got, inputs, "sum", "fp32", "hierarchical allreduce, several rounds, in place")
    _same_on_every_rank(world, got, "in place")
    y = _device(inputs[world.rank])
    h = fluxrt.allreduce(world, y, async_op=True)
    res = h.wait()
    world.synchronize()
    assert np.array_equal(_host(res), got), "async allreduce differs from the in-place one"


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
    _assert_reduced(_host(out), mine, "sum", dtype, f"hierarchical reduce_scatter {chunk} x {dtype}")
    full = _poisoned(n * chunk, dtype)
    fluxrt.allgather(world, out, full)   # every rank's chunk, to compare bits across ranks
    world.synchronize()
    _same_on_every_rank(world, _host(full), "reduce_scatter + allgather")


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
    assert np.array_equal(got.view(np.uint8), np.concatenate(inputs).view(np.uint8)), "allgather differs"
    _same_on_every_rank(world, got, "allgather")


def test_allgather_in_place(world, hier):
    import fluxrt

    n, chunk = world.size, 4099
    inputs = _inputs(17, n, chunk, "fp32")
    out = _poisoned(n * chunk, "fp32")
    out[world.rank * chunk:(world.rank + 1) * chunk] = _device(inputs[world.rank])
    fluxrt.allgather(world, out[world.rank * chunk:(world.rank + 1) * chunk], out)
    world.synchronize()
    assert np.array_equal(_host(out), np.concatenate(inputs))


def test_unsupported_op_names_the_path(world, hier):
    import fluxrt

    with pytest.raises(fluxrt.CollectiveArgumentError, match="across nodes"):
        fluxrt.alltoall(world, _device(np.zeros(world.size, np.float32)))


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
    world.comm.Barrier()


def test_rail_reduce_scatter_then_allgather(world, hier):
    """The rail allreduce in two rounds (reduce-scatter, all-gather), forced on a second context: same
    reference, same bits on every rank."""
    import fluxrt
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
            _assert_reduced(got, inputs, "sum", dtype, f"rail reduce-scatter + all-gather {count} x {dtype}")
            _same_on_every_rank(world, got, "rs_ag")
    finally:
        ctx.free()
