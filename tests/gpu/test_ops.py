"""GPU tests of the fused ops (AllGather+GEMM, GEMM+ReduceScatter) under mpirun on 2 or 4 GPUs.

Random bf16/fp16 inputs that differ per rank, outputs poisoned with NaN, checked against a float64
numpy reference built from every rank's inputs (gathered over MPI). Every rank runs the same tests in
the same order; shapes are small (M = a few hundred rows per rank) so the module stays well under a
minute on 4 ranks, apart from the one deliberate timeout (WorldOptions.timeout_s of the fixture).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from op_checks import (  # tests/gpu/op_checks.py: the float64 checks these tests share
    Problems as _Problems, f64 as _f64, np_dtype as _np_dtype, poisoned as _poisoned, problem as _problem)

pytestmark = pytest.mark.multirank


@pytest.fixture(autouse=True)
def _fused_kernels_only(monkeypatch):
    """This module tests the fused kernels: the path choice (fluxrt.ops.cost), which would run some of its
    small shapes on the decomposed path, never leaves them here (test_ops_decomposed.py tests that path)."""
    import dataclasses

    from fluxrt.ops import cost

    rates = {k: dataclasses.replace(v, margin=float("inf")) for k, v in cost.OPS_RATES.items()}
    monkeypatch.setattr(cost, "OPS_RATES", rates)


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(_np_dtype(dtype))


def _dev(x):
    import cupy

    return cupy.asarray(x)


def _check(got, ref, dtype, what):
    problem = _problem(got, ref, dtype, what)
    assert problem is None, problem


def _allgather(world, x):
    return world.comm.allgather(np.ascontiguousarray(x))


# --- AllGather+GEMM ---------------------------------------------------------------------------------

AG_CASES = [  # dtype, rows per rank, chunks per rank, comm mode, trans_b
    ("bfloat16", 256, 1, "pull", False),
    ("bfloat16", 256, 2, "pull", True),
    ("float16", 384, 1, "push", False),
    ("bfloat16", 512, 2, "push", True),
]


def _ag_reference(world, a_shard, b, trans_b):
    a_full = np.concatenate([_f64(x) for x in _allgather(world, a_shard)], axis=0)
    bb = _f64(b)
    return a_full, a_full @ (bb.T if trans_b else bb)


@pytest.mark.parametrize("dtype, shard, cpr, mode, trans_b", AG_CASES)
def test_ag_gemm_matches_reference(world, rng, dtype, shard, cpr, mode, trans_b):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k = 384, 320
    m = shard * world.size
    plan = AgGemmPlan(chunks_per_rank=cpr, comm_mode=mode)
    op = AllGatherGemm(world, m, n, k, dtype, trans_b=trans_b, plan=plan)
    try:
        a = _rand(rng, (shard, k), dtype)
        b = _rand(rng, (n, k) if trans_b else (k, n), dtype)
        out = _poisoned((m, n), dtype)
        got, gathered = op.forward(_dev(a), _dev(b), out=out, return_a=True)
        world.synchronize()
        a_full, ref = _ag_reference(world, a, b, trans_b)
        assert got is out
        np.testing.assert_array_equal(_f64(gathered), a_full)
        _check(got, ref, dtype, f"AG {mode} cpr={cpr} rank {world.rank}")
    finally:
        op.free()


def test_ag_gemm_zero_copy_shard_buffer(world, rng):
    from fluxrt.ops import AllGatherGemm

    n, k, shard = 256, 256, 256
    m = shard * world.size
    op = AllGatherGemm(world, m, n, k, "bf16")
    try:
        problems = _Problems()
        for it in range(5):   # zero-copy calls between ordinary ones (whose shard the GEMM copies)
            a = _rand(rng, (shard, k), "bfloat16")
            b = _rand(rng, (k, n), "bfloat16")
            if it % 2 == 0:
                slot = op.shard_buffer(m)
                slot[...] = _dev(a)
            else:
                slot = _dev(a)
            got, gathered = op.forward(slot, _dev(b), return_a=True)
            world.synchronize()
            a_full, ref = _ag_reference(world, a, b, False)
            np.testing.assert_array_equal(_f64(gathered), a_full)
            problems.check(got, ref, "bfloat16", f"AG {'zero-copy' if it % 2 == 0 else 'ordinary'} call {it}")
        problems.assert_none()
    finally:
        op.free()


def _repeated(world, rng, op, make_inputs, reference, calls, dtype, what):
    """`calls` forward calls cycling through a few input sets (data changes every call); every output
    kept and checked at the end against the reference of its set."""
    sets = [make_inputs() for _ in range(4)]
    refs = [reference(*s) for s in sets]
    dev = [tuple(_dev(x) for x in s) for s in sets]
    outs = [op.forward(*dev[i % len(dev)]) for i in range(calls)]
    world.synchronize()
    problems = _Problems()
    for i, o in enumerate(outs):
        problems.check(o, refs[i % len(refs)], dtype, f"{what} call {i}")
    problems.assert_none()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ag_gemm_repeated_calls(world, rng, mode):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k, shard = 256, 192, 256
    m = shard * world.size
    op = AllGatherGemm(world, m, n, k, "bf16", plan=AgGemmPlan(chunks_per_rank=2, comm_mode=mode))
    try:
        _repeated(world, rng, op, lambda: (_rand(rng, (shard, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")),
                  lambda a, b: _ag_reference(world, a, b, False)[1], 120, "bfloat16", f"AG {mode}")
    finally:
        op.free()


def test_ag_gemm_varying_m(world, rng):
    from fluxrt.ops import AllGatherGemm

    n, k = 256, 128
    op = AllGatherGemm(world, 512 * world.size, n, k, "fp16")
    try:
        problems = _Problems()
        for shard in (512, 128, 384):
            a, b = _rand(rng, (shard, k), "float16"), _rand(rng, (k, n), "float16")
            got = op.forward(_dev(a), _dev(b))
            world.synchronize()
            problems.check(got, _ag_reference(world, a, b, False)[1], "float16", f"AG M={shard * world.size}")
        problems.assert_none()
    finally:
        op.free()


def _be_late(world, late: str, stream=None) -> None:
    """Make this rank late: the host sleeps, or its stream is held back on the GPU."""
    from fluxrt.ops import common

    if late == "host":
        time.sleep(0.5)
    else:
        import cupy

        common.delay(world, 0.3, stream or cupy.cuda.get_current_stream())


@pytest.mark.parametrize("mode, late", [("pull", "host"), ("push", "host"), ("pull", "gpu"), ("push", "gpu")])
def test_ag_gemm_slow_peer(world, rng, mode, late):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k, shard = 256, 256, 256
    m = shard * world.size
    op = AllGatherGemm(world, m, n, k, "bf16", plan=AgGemmPlan(comm_mode=mode))
    try:
        a, b = _rand(rng, (shard, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
        world.synchronize()
        world.comm.Barrier()
        if world.rank == world.size - 1:
            _be_late(world, late)   # the others' GEMMs start on their own rows and wait for this rank's chunks
        got = op.forward(_dev(a), _dev(b))
        world.synchronize()
        _check(got, _ag_reference(world, a, b, False)[1], "bfloat16", f"AG slow peer ({mode}, late on {late})")
    finally:
        op.free()


# --- GEMM+ReduceScatter -----------------------------------------------------------------------------

RS_CASES = [  # dtype, rows per rank, (comm mode, reduce mode, column groups), trans_b, partial dtype
    ("bfloat16", 256, ("ce", "epilogue", 4), False, None),
    ("float16", 384, ("ce", "epilogue", 3), True, None),
    ("bfloat16", 128, ("ce", "epilogue", 1), False, None),
    ("float16", 256, ("sm", "epilogue", 1), True, None),
    ("bfloat16", 256, ("ce", "after", 4), False, None),
    ("float16", 128, ("ce", "after", 2), True, None),
    ("bfloat16", 384, ("ce", "after", 3), True, "float32"),
    ("bfloat16", 256, ("sm", "after", 1), False, None),
    ("float16", 128, ("sm", "concurrent", 1), True, None),
    ("bfloat16", 384, ("sm", "after", 1), True, "float32"),
    ("bfloat16", 256, ("sm", "concurrent", 1), False, None),
    ("bfloat16", 256, ("ce", "tail", 4), False, None),
    ("float16", 384, ("ce", "tail", 3), True, None),
    ("bfloat16", 128, ("sm", "tail", 1), True, None),
]
RS_MODES = [("ce", "epilogue"), ("sm", "epilogue"), ("ce", "after"), ("sm", "after"), ("sm", "concurrent"),
            ("ce", "tail"), ("sm", "tail")]


def _rs_reference(world, a, b, trans_b):
    parts = zip(_allgather(world, a), _allgather(world, b))
    total = sum(_f64(x) @ (_f64(y).T if trans_b else _f64(y)) for x, y in parts)
    shard = total.shape[0] // world.size
    return total[world.rank * shard:(world.rank + 1) * shard]


@pytest.mark.parametrize("dtype, shard, mode, trans_b, partial", RS_CASES)
def test_gemm_rs_matches_reference(world, rng, dtype, shard, mode, trans_b, partial):
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k = 320, 192
    m = shard * world.size
    comm, reduce, groups = mode
    op = GemmReduceScatter(world, m, n, k, dtype, trans_b=trans_b,
                           plan=GemmRsPlan(comm_mode=comm, ce_groups=groups, reduce_mode=reduce, reduce_blocks=4,
                                           partial_dtype=partial))
    try:
        a = _rand(rng, (m, k), dtype)
        b = _rand(rng, (n, k) if trans_b else (k, n), dtype)
        out = _poisoned((shard, n), dtype)
        got = op.forward(_dev(a), _dev(b), out=out)
        world.synchronize()
        assert got is out
        _check(got, _rs_reference(world, a, b, trans_b), dtype, f"RS {mode} partial={partial} rank {world.rank}")
    finally:
        op.free()


@pytest.mark.parametrize("mode", RS_MODES, ids=["-".join(x) for x in RS_MODES])
def test_gemm_rs_repeated_calls_and_determinism(world, rng, mode):
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k, shard = 256, 128, 256
    m = shard * world.size
    op = GemmReduceScatter(world, m, n, k, "bf16", plan=GemmRsPlan(comm_mode=mode[0], ce_groups=2,
                                                                   reduce_mode=mode[1], reduce_blocks=4))
    try:
        _repeated(world, rng, op, lambda: (_rand(rng, (m, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")),
                  lambda a, b: _rs_reference(world, a, b, False), 120, "bfloat16", f"RS {mode}")
        # deterministic: the same inputs give bitwise the same result, whatever the arrival order
        a, b = _dev(_rand(rng, (m, k), "bfloat16")), _dev(_rand(rng, (k, n), "bfloat16"))
        first = op.forward(a, b).copy()
        again = [op.forward(a, b).copy() for _ in range(5)]
        world.synchronize()
        for x in again:
            assert (x.view(np.uint16) == first.view(np.uint16)).all()
    finally:
        op.free()


@pytest.mark.parametrize("comm", ["ce", "sm"])
def test_gemm_rs_tail_reduce_is_bitwise_the_reduce_kernel(world, rng, comm):
    # both sum the world's partials in rank order in fp32: the reduce inside the GEMM's tail and the kernel
    # after it must agree to the bit
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k, shard = 776, 256, 384
    m = shard * world.size
    ops = [GemmReduceScatter(world, m, n, k, "bf16", plan=GemmRsPlan(comm_mode=comm, ce_groups=2, reduce_mode=mode))
           for mode in ("after", "tail")]
    try:
        a, b = _rand(rng, (m, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
        after, tail = (op.forward(_dev(a), _dev(b)) for op in ops)
        world.synchronize()
        _check(tail, _rs_reference(world, a, b, False), "bfloat16", f"RS tail {comm} rank {world.rank}")
        assert (tail.get().view(np.uint16) == after.get().view(np.uint16)).all()
    finally:
        for op in ops:
            op.free()


def test_gemm_rs_varying_m(world, rng):
    # 'ce' counts finished tiles per (owner, column group) over all calls: calls of different M add
    # different numbers of tiles, and each call's waits must target its own total
    from fluxrt.ops import GemmReduceScatter

    n, k = 1024, 128
    op = GemmReduceScatter(world, 1024 * world.size, n, k, "bf16")
    try:
        problems = _Problems()
        for shard in (1024, 128, 512, 128, 1024):
            m = shard * world.size
            a, b = _rand(rng, (m, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
            got = op.forward(_dev(a), _dev(b))
            world.synchronize()
            problems.check(got, _rs_reference(world, a, b, False), "bfloat16", f"RS M={m}")
        problems.assert_none()
    finally:
        op.free()


@pytest.mark.parametrize("late", ["host", "gpu"])
def test_gemm_rs_slow_peer(world, rng, late):
    from fluxrt.ops import GemmReduceScatter

    n, k, shard = 256, 256, 256
    m = shard * world.size
    op = GemmReduceScatter(world, m, n, k, "bf16")
    try:
        a, b = _rand(rng, (m, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
        world.synchronize()
        world.comm.Barrier()
        if world.rank == 0:
            _be_late(world, late)
        got = op.forward(_dev(a), _dev(b))
        world.synchronize()
        _check(got, _rs_reference(world, a, b, False), "bfloat16", f"RS slow peer (late on {late})")
    finally:
        op.free()


# --- both ops in one stream sequence ----------------------------------------------------------------

def test_mlp_block_ag_gemm_then_gemm_rs(world, rng):
    """Column-parallel then row-parallel linear on one stream: y = (allgather(x) @ W1_r) summed over
    ranks after @ W2_r, reduce-scattered on M."""
    import cupy

    from fluxrt.ops import AllGatherGemm, GemmReduceScatter

    h, f_local, shard = 256, 384, 256
    m = shard * world.size
    ag = AllGatherGemm(world, m, f_local, h, "bf16")
    rs = GemmReduceScatter(world, m, h, f_local, "bf16")
    stream = cupy.cuda.Stream(non_blocking=True)
    problems = _Problems()
    try:
        for it in range(5):
            x = _rand(rng, (shard, h), "bfloat16")
            w1 = (_rand(rng, (h, f_local), "bfloat16").astype(np.float32) / 16).astype(_np_dtype("bfloat16"))
            w2 = (_rand(rng, (f_local, h), "bfloat16").astype(np.float32) / 16).astype(_np_dtype("bfloat16"))
            with stream:
                xd, w1d, w2d = _dev(x), _dev(w1), _dev(w2)
            hid = ag.forward(xd, w1d, stream=stream)
            y = rs.forward(hid, w2d, stream=stream)
            stream.synchronize()
            world.check_errors()
            # every collective step of the reference first, so that a failed check cannot strand a peer
            x_full = np.concatenate([_f64(v) for v in _allgather(world, x)], axis=0)
            hid_ref = (x_full @ _f64(w1)).astype(np.float32).astype(_np_dtype("bfloat16"))  # the op's bf16 hidden
            parts = world.comm.allgather(_f64(hid_ref) @ _f64(w2))
            ref = sum(parts)[world.rank * shard:(world.rank + 1) * shard]
            problems.check(hid, _f64(hid_ref), "bfloat16", f"MLP hidden, step {it}")
            problems.check(y, ref, "bfloat16", f"MLP output, step {it}")
        problems.assert_none()
    finally:
        stream.synchronize()
        rs.free()
        ag.free()


# --- shards that are not whole tiles (padded inside the op) -------------------------------------------

@pytest.mark.parametrize("cpr, mode", [(1, "pull"), (2, "push")])
def test_ag_gemm_padded_shards(world, rng, cpr, mode):
    """Shards of any row count: padded ones (200, 72, 300 rows) between whole-tile ones (256) on one op,
    out given and allocated, the gathered A returned, a padded shard written into shard_buffer()."""
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k = 384, 320
    op = AllGatherGemm(world, 300 * world.size, n, k, "bf16", plan=AgGemmPlan(chunks_per_rank=cpr, comm_mode=mode))
    try:
        problems = _Problems()
        for i, shard in enumerate((200, 256, 72, 300, 200)):
            m = shard * world.size
            a, b = _rand(rng, (shard, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
            out = _poisoned((m, n), "bfloat16") if i % 2 == 0 else None
            if i == 4:
                src = op.shard_buffer(m)
                src[...] = _dev(a)
            else:
                src = _dev(a)
            got, gathered = op.forward(src, _dev(b), out=out, return_a=True)
            world.synchronize()
            a_full, ref = _ag_reference(world, a, b, False)
            assert got.shape == (m, n) and gathered.shape == (m, k)
            if not np.array_equal(_f64(gathered), a_full):
                problems.append(f"AG shard={shard}: gathered A differs")
            problems.check(got, ref, "bfloat16", f"AG {mode} cpr={cpr} shard={shard} call {i}")
        problems.assert_none()
    finally:
        op.free()


@pytest.mark.parametrize("mode", [("ce", "tail"), ("sm", "after"), ("ce", "epilogue")], ids=["ce-tail", "sm-after",
                                                                                           "ce-epilogue"])
def test_gemm_rs_padded_shards(world, rng, mode):
    """Shards of any row count: padded ones (200, 72, 300 rows) between whole-tile ones (256) on one op,
    against the float64 reference, out given and allocated."""
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k = 384, 256
    comm, reduce = mode
    op = GemmReduceScatter(world, 300 * world.size, n, k, "bf16", plan=GemmRsPlan(comm_mode=comm, reduce_mode=reduce))
    try:
        problems = _Problems()
        for i, shard in enumerate((200, 256, 72, 300)):
            m = shard * world.size
            a, b = _rand(rng, (m, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
            out = _poisoned((shard, n), "bfloat16") if i % 2 == 0 else None
            got = op.forward(_dev(a), _dev(b), out=out)
            world.synchronize()
            assert got.shape == (shard, n) and (out is None or got is out)
            problems.check(got, _rs_reference(world, a, b, False), "bfloat16", f"RS {mode} shard={shard} call {i}")
        problems.assert_none()
    finally:
        op.free()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ag_gemm_back_to_back_varying_shards(world, rng, mode):
    """Calls whose shards change size (padded and whole-tile) enqueued back to back, no host
    synchronization between them: the slots move from call to call, so a rank that let its peers pull or
    push too early would corrupt rows. Every output is checked afterwards, and every gathered A that is
    a copy (push mode, padded calls; a pull-mode view only for the last call)."""
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k = 256, 192
    shards = (200, 256, 72, 384, 130, 256)
    op = AllGatherGemm(world, 384 * world.size, n, k, "bf16", plan=AgGemmPlan(comm_mode=mode))
    try:
        sets = [(_rand(rng, (shard, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")) for shard in shards]
        refs = [_ag_reference(world, a, b, False) for a, b in sets]   # host allgathers before any call
        dev = [(_dev(a), _dev(b)) for a, b in sets]
        results = [op.forward(a, b, return_a=True) for a, b in dev]
        world.synchronize()
        problems = _Problems()
        for i, ((got, gathered), (a_full, ref), shard) in enumerate(zip(results, refs, shards)):
            problems.check(got, ref, "bfloat16", f"AG {mode} back-to-back call {i} shard={shard}")
            if (mode == "push" or shard % 128 or i == len(shards) - 1) and not np.array_equal(_f64(gathered), a_full):
                problems.append(f"AG {mode} back-to-back call {i} shard={shard}: gathered A differs")
        problems.assert_none()
    finally:
        op.free()


@pytest.mark.parametrize("mode", [("sm", "concurrent", None), ("ce", "after", "float32"), ("ce", "tail", None)],
                         ids=["sm-concurrent", "ce-after-fp32", "ce-tail"])
def test_gemm_rs_back_to_back_varying_shards(world, rng, mode):
    """GEMM+RS calls whose shards change size (padded and whole-tile), back to back with no host
    synchronization, in the modes whose scratch output is written on the comm stream ('concurrent') or
    whose partials are fp32; every output checked afterwards against the float64 reference."""
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k = 256, 192
    comm, reduce, partial = mode
    shards = (200, 256, 72, 384, 130)
    op = GemmReduceScatter(world, 384 * world.size, n, k, "bf16",
                           plan=GemmRsPlan(comm_mode=comm, reduce_mode=reduce, reduce_blocks=4, partial_dtype=partial))
    try:
        sets = [(_rand(rng, (shard * world.size, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")) for shard in shards]
        refs = [_rs_reference(world, a, b, False) for a, b in sets]
        dev = [(_dev(a), _dev(b)) for a, b in sets]
        outs = [op.forward(a, b) for a, b in dev]
        world.synchronize()
        problems = _Problems()
        for i, (got, ref, shard) in enumerate(zip(outs, refs, shards)):
            problems.check(got, ref, "bfloat16", f"RS {mode} back-to-back call {i} shard={shard}")
        problems.assert_none()
    finally:
        op.free()


# --- errors -----------------------------------------------------------------------------------------

def test_shape_mismatch_across_ranks_raises_everywhere(world, rng):
    from fluxrt import CollectiveMismatchError
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter

    n, k = 256, 128
    ag = AllGatherGemm(world, 256 * world.size, n, k, "bf16")
    rs = GemmReduceScatter(world, 256 * world.size, n, k, "bf16")
    try:
        shard = 256 if world.rank == 0 else 128
        with pytest.raises(CollectiveMismatchError, match="rank 0: .*m=") as err:
            ag.forward(_dev(_rand(rng, (shard, k), "bfloat16")), _dev(_rand(rng, (k, n), "bfloat16")))
        assert "AllGatherGemm.forward" in str(err.value)
        with pytest.raises(CollectiveMismatchError, match="GemmReduceScatter.forward"):
            rs.forward(_dev(_rand(rng, (shard * world.size, k), "bfloat16")), _dev(_rand(rng, (k, n), "bfloat16")))
        # still usable afterwards: nothing was launched
        a, b = _rand(rng, (256, k), "bfloat16"), _rand(rng, (k, n), "bfloat16")
        got = ag.forward(_dev(a), _dev(b))
        world.synchronize()
        _check(got, _ag_reference(world, a, b, False)[1], "bfloat16", "AG after a rejected call")
    finally:
        rs.free()
        ag.free()


def test_constructor_mismatch_and_bad_m(world, rng):
    from fluxrt import CollectiveMismatchError
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter, OpsArgumentError

    with pytest.raises(CollectiveMismatchError, match="AllGatherGemm"):
        AllGatherGemm(world, 256 * world.size, 256 + 8 * world.rank, 128, "bf16")
    rs = GemmReduceScatter(world, 256 * world.size, 256, 128, "bf16")
    try:
        m = 128 * world.size + 1   # not a multiple of world: rejected on every rank, before any launch
        with pytest.raises(OpsArgumentError, match="must be a multiple of world"):
            rs.forward(_dev(_rand(rng, (m, 128), "bfloat16")), _dev(_rand(rng, (128, 256), "bfloat16")))
        with pytest.raises(OpsArgumentError, match="exceeds max_m"):
            rs.forward(_dev(_rand(rng, (257 * world.size, 128), "bfloat16")), _dev(_rand(rng, (128, 256), "bfloat16")))
    finally:
        rs.free()


def test_ag_gemm_missing_peer_times_out_naming_it(world, rng, monkeypatch):
    """Rank 0 skips the call: every other rank gets a WaitTimeoutError naming an ag_gemm wait and peer 0
    after the world's timeout (5 s in these tests) instead of hanging."""
    import dataclasses

    from fluxrt import WaitTimeoutError
    from fluxrt.ops import AllGatherGemm

    n, k, shard = 256, 128, 128
    op = AllGatherGemm(world, shard * world.size, n, k, "bf16")
    try:
        a, b = _dev(_rand(rng, (shard, k), "bfloat16")), _dev(_rand(rng, (k, n), "bfloat16"))
        # The first call with an M is collective on the host (path choice, then a meeting after the GEMMs'
        # load, bounded by FLUXRT_LOAD_WAIT_S): every rank makes it, so that only the device wait is under test.
        op.forward(a, b)
        world.synchronize()
        # the host-side argument check is an MPI collective that rank 0 would never join
        monkeypatch.setattr(world, "options", dataclasses.replace(world.options, check_collective_args=False))
        world.comm.Barrier()
        if world.rank != 0:
            op.forward(a, b)
            with pytest.raises(WaitTimeoutError) as err:
                world.synchronize()
            assert err.value.peer == 0 and err.value.op.startswith("ag_gemm"), str(err.value)
            assert err.value.rank == world.rank
            world.reset_error()   # sticky otherwise: the module's later tests share this world
        world.comm.Barrier()
    finally:
        op.free()


@pytest.mark.parametrize("mode", ["after", "tail", "epilogue"])
def test_gemm_rs_missing_peer_leaves_nan_and_a_sticky_error(world, rng, monkeypatch, mode):
    """Rank 0 skips the call: on every other rank the reduce's wait for rank 0's partial times out, and
    every row of the output (each one sums rank 0's partial) reads NaN instead of a sum of whatever was
    in the receive buffer; the next call raises the same error before it launches anything. comm_mode
    'sm': the reduce itself waits for rank 0's tiles (with 'ce' the copy-engine pull waits, and its
    flag is raised after the pull whatever came of the wait: docs/design.md, "How errors surface")."""
    import dataclasses

    import cupy

    from fluxrt import WaitTimeoutError
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k, shard = 256, 128, 256
    m = shard * world.size
    plan = GemmRsPlan(reduce_mode=mode, comm_mode="sm")
    op = GemmReduceScatter(world, m, n, k, "bf16", plan=plan.validate())
    try:
        a, b = _dev(_rand(rng, (m, k), "bfloat16")), _dev(_rand(rng, (k, n), "bfloat16"))
        # the first call with an M is collective on the host (path choice, the meeting after the GEMMs' load):
        # every rank makes it, before rank 0 skips the next one
        op.forward(a, b)
        out = cupy.zeros((shard, n), dtype=a.dtype)   # finite: any NaN is the kernels'
        world.synchronize()
        monkeypatch.setattr(world, "options", dataclasses.replace(world.options, check_collective_args=False))
        world.comm.Barrier()
        if world.rank != 0:
            op.forward(a, b, out=out)
            with pytest.raises(WaitTimeoutError) as err:
                world.synchronize()
            assert err.value.peer == 0, str(err.value)
            got = cupy.asnumpy(out).astype(np.float32)
            assert np.isnan(got).all(), f"{mode}: {int((~np.isnan(got)).sum())} of {got.size} outputs not NaN"
            with pytest.raises(WaitTimeoutError):
                op.forward(a, b, out=out)
            world.reset_error()
        world.comm.Barrier()
    finally:
        world.reset_error()
        op.free()
