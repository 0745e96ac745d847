"""GPU tests of the fused ops' decomposed path (fluxrt.ops.decomposed), the path choice and the MLP block
(fluxrt.ops.TPMLP), under mpirun on 2 or 4 GPUs (or 2 ranks on one GPU under MPS: launch/mps-check.sh).

Random bf16/fp16 inputs that differ per rank, outputs poisoned with NaN, checked against a float64 numpy
reference built from every rank's inputs (gathered over MPI). Shapes are small. The cases that run the
fused kernel (path 'auto' on a shape that keeps it, the interleaving test) use grids of a few CTAs, so
they fit beside each other when the ranks share one GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from op_checks import (  # tests/gpu/op_checks.py: the float64 checks these tests share
    Problems as _Problems, f64 as _f64, np_dtype as _np_dtype, poisoned as _poisoned)

pytestmark = pytest.mark.multirank


@pytest.fixture
def rng(request, world):
    """Inputs differ per rank (a rank's rows landing in another rank's place must show)."""
    import zlib

    return np.random.default_rng([zlib.crc32(request.node.name.encode()), world.rank])


def _rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32).astype(_np_dtype(dtype))


def _dev(x):
    import cupy

    return cupy.asarray(x)


def _gathered(world, x):
    return np.concatenate([_f64(y) for y in world.comm.allgather(np.ascontiguousarray(x))], axis=0)


def _ag_ref(world, a_shard, b, trans_b):
    a_full = _gathered(world, a_shard)
    bb = _f64(b)
    return a_full, a_full @ (bb.T if trans_b else bb)


def _rs_ref(world, a, b, trans_b, shard):
    parts = world.comm.allgather((np.ascontiguousarray(a), np.ascontiguousarray(b)))
    total = sum(_f64(x) @ (_f64(y).T if trans_b else _f64(y)) for x, y in parts)
    return total[world.rank * shard:(world.rank + 1) * shard]


# --- the decomposed path ----------------------------------------------------------------------------------

DEC_CASES = [  # dtype, rows per rank (200, 72: padded shards for the fused op), chunks, trans_b
    ("bfloat16", 256, 1, False),
    ("bfloat16", 384, 3, True),
    ("float16", 200, 2, False),
    ("bfloat16", 72, 4, True),
]


@pytest.mark.parametrize("dtype, shard, chunks, trans_b", DEC_CASES)
def test_ag_gemm_decomposed_matches_reference(world, rng, dtype, shard, chunks, trans_b):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm

    n, k = 384, 320
    m = shard * world.size
    op = AllGatherGemm(world, m, n, k, dtype, trans_b=trans_b,
                       plan=AgGemmPlan(path="decomposed", decomposed_chunks=chunks))
    try:
        a = _rand(rng, (shard, k), dtype)
        b = _rand(rng, (n, k) if trans_b else (k, n), dtype)
        out = _poisoned((m, n), dtype)
        choice = op.path_choice(m)
        got, gathered = op.forward(_dev(a), _dev(b), out=out, return_a=True)
        world.synchronize()
        a_full, ref = _ag_ref(world, a, b, trans_b)
        assert (choice.path, choice.chunks) == ("decomposed", chunks)
        assert got is out
        np.testing.assert_array_equal(_f64(gathered), a_full)
        p = _Problems()
        p.check(got, ref, dtype, f"AG decomposed chunks={chunks} rank {world.rank}")
        p.assert_none()
    finally:
        op.free()


@pytest.mark.parametrize("dtype, shard, chunks, trans_b", DEC_CASES)
def test_gemm_rs_decomposed_matches_reference(world, rng, dtype, shard, chunks, trans_b):
    from fluxrt.ops import GemmReduceScatter, GemmRsPlan

    n, k = 320, 256
    m = shard * world.size
    op = GemmReduceScatter(world, m, n, k, dtype, trans_b=trans_b,
                           plan=GemmRsPlan(path="decomposed", decomposed_chunks=chunks))
    try:
        a = _rand(rng, (m, k), dtype)
        b = _rand(rng, (n, k) if trans_b else (k, n), dtype)
        out = _poisoned((shard, n), dtype)
        got = op.forward(_dev(a), _dev(b), out=out)
        world.synchronize()
        p = _Problems()
        p.check(got, _rs_ref(world, a, b, trans_b, shard), dtype, f"RS decomposed chunks={chunks} rank {world.rank}")
        p.assert_none()
        assert got is out
    finally:
        op.free()


def test_back_to_back_calls_of_different_m_and_paths(world, rng):
    """One op per kind, called back to back without a host sync: different M (padded and whole-tile
    shards), decomposed with different chunk counts and the fused kernel interleaved, each call's output
    checked after the run."""
    import cupy

    from fluxrt.ops import AllGatherGemm, GemmReduceScatter

    dtype, n, k = "bfloat16", 256, 192
    w = world.size
    calls = [(256, "decomposed"), (72, "decomposed"), (128, "fused"), (200, "decomposed"), (256, "fused"),
             (128, "decomposed")]
    max_m = 256 * w
    ag = AllGatherGemm(world, max_m, n, k, dtype)
    rs = GemmReduceScatter(world, max_m, k, n, dtype)
    s = cupy.cuda.Stream(non_blocking=True)
    try:
        b_ag = _rand(rng, (k, n), dtype)
        b_rs = _rand(rng, (n, k), dtype)
        outs = []
        for shard, path in calls:
            a = _rand(rng, (shard, k), dtype)
            ag_out = _poisoned((shard * w, n), dtype)
            rs_out = _poisoned((shard, k), dtype)
            with s:
                h = ag.forward(_dev(a), _dev(b_ag), out=ag_out, stream=s, path=path)
                rs.forward(h, _dev(b_rs), out=rs_out, stream=s, path=path)
            outs.append((a, ag_out, rs_out, shard, path))
        s.synchronize()
        world.check_errors()
        p = _Problems()
        for a, ag_out, rs_out, shard, path in outs:
            _, h_ref = _ag_ref(world, a, b_ag, False)
            # the reduce-scatter's reference starts from the op's own (rounded) AllGather+GEMM output
            h_got = _f64(ag_out)
            p.check(ag_out, h_ref, dtype, f"AG M={shard * w} {path} rank {world.rank}")
            p.check(rs_out, _rs_ref(world, h_got.astype(np.float32).astype(_np_dtype(dtype)), b_rs, False, shard),
                    dtype, f"RS M={shard * w} {path} rank {world.rank}")
        p.assert_none()
    finally:
        ag.free()
        rs.free()


def test_auto_falls_back_to_decomposed_where_fused_loses(world, rng):
    """A shard of 8 rows pads to a whole 128-row tile in the fused op (16x the GEMM's rows) on a large N x K:
    the cost model picks the decomposed path, says why, and the result is right."""
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter

    dtype, n, k = "bfloat16", 8192, 8192
    shard = 8
    m = shard * world.size
    ag = AllGatherGemm(world, m, n, k, dtype)
    rs = GemmReduceScatter(world, m, n, k, dtype)
    try:
        choices = (ag.path_choice(m), rs.path_choice(m))
        a = _rand(rng, (shard, k), dtype, 0.05)
        b = _rand(rng, (k, n), dtype, 0.05)
        ag_out = _poisoned((m, n), dtype)
        got = ag.forward(_dev(a), _dev(b), out=ag_out)
        a_rs = _rand(rng, (m, k), dtype, 0.05)
        rs_out = _poisoned((shard, n), dtype)
        got_rs = rs.forward(_dev(a_rs), _dev(b), out=rs_out)
        world.synchronize()
        p = _Problems()
        p.check(got, _ag_ref(world, a, b, False)[1], dtype, f"AG auto rank {world.rank}")
        p.check(got_rs, _rs_ref(world, a_rs, b, False, shard), dtype, f"RS auto rank {world.rank}")
        p.assert_none()
        for c in choices:
            assert c.path == "decomposed", str(c)
            assert "predicted" in c.reason and c.fused_us > c.decomposed_us
    finally:
        ag.free()
        rs.free()


# --- the MLP block ---------------------------------------------------------------------------------------

def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp_ref(world, x_shard, w_gu, w_down, ffn, dtype):
    """float64 reference of the block; the intermediate is rounded to the dtype, as the block stores it."""
    x = _gathered(world, x_shard)
    h = x @ _f64(w_gu)
    act = (_silu(h[:, :ffn]) * h[:, ffn:]).astype(np.float32).astype(_np_dtype(dtype)).astype(np.float64)
    parts = world.comm.allgather(act @ _f64(w_down))
    total = sum(parts)
    shard = x_shard.shape[0]
    return total[world.rank * shard:(world.rank + 1) * shard]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mlp_block_matches_reference_eager(world, rng, dtype):
    from fluxrt.ops import TPMLP

    hidden, ffn = 256, 192
    shards = (128, 72)   # whole tiles, then a padded shard on the same block
    mlp = TPMLP(world, max(shards) * world.size, hidden, ffn, dtype)
    try:
        w_gu = _rand(rng, (hidden, 2 * ffn), dtype, 0.1)
        w_down = _rand(rng, (ffn, hidden), dtype, 0.1)
        p = _Problems()
        for shard in shards:
            x = _rand(rng, (shard, hidden), dtype)
            out = _poisoned((shard, hidden), dtype)
            got = mlp.forward(_dev(x), _dev(w_gu), _dev(w_down), out=out)
            world.synchronize()
            p.check(got, _mlp_ref(world, x, w_gu, w_down, ffn, dtype), dtype, f"MLP eager shard {shard}")
        p.assert_none()
    finally:
        mlp.free()


def test_mlp_block_graph_capture_and_1000_replays(world, rng):
    """The block captured in a CUDA graph (both ops take the decomposed path inside the capture) and replayed
    1000 times back to back, then with new inputs written into the captured input buffer between replays."""
    import cupy

    from fluxrt.ops import TPMLP

    dtype, hidden, ffn, shard = "bfloat16", 256, 192, 128
    mlp = TPMLP(world, shard * world.size, hidden, ffn, dtype)
    s = cupy.cuda.Stream(non_blocking=True)
    try:
        w_gu = _dev(_rand(rng, (hidden, 2 * ffn), dtype, 0.1))
        w_down = _dev(_rand(rng, (ffn, hidden), dtype, 0.1))
        x = cupy.empty((shard, hidden), dtype=_np_dtype(dtype))
        x0 = _rand(rng, (shard, hidden), dtype)
        x.set(x0)
        out = _poisoned((shard, hidden), dtype)
        with s:
            mlp.forward(x, w_gu, w_down, out=out, stream=s, path="decomposed")   # compile and load outside
        s.synchronize()
        choices = (mlp.ag.path_choice(shard * world.size, s), mlp.rs.path_choice(shard * world.size, s))
        s.begin_capture()
        mlp.forward(x, w_gu, w_down, out=out, stream=s)
        graph = s.end_capture()
        m = shard * world.size
        captured = (mlp.ag._paths[(m, True, None)], mlp.rs._paths[(m, True, None)])
        out.view(np.uint16).fill(0x7FC0)
        world.device.synchronize()
        for _ in range(1000):
            graph.launch(s)
        s.synchronize()
        world.check_errors()
        p = _Problems()
        w_gu_h, w_down_h = w_gu.get(), w_down.get()
        p.check(out, _mlp_ref(world, x0, w_gu_h, w_down_h, ffn, dtype), dtype, "MLP after 1000 replays")
        for replay in range(3):
            xr = _rand(rng, (shard, hidden), dtype)
            x.set(xr)
            out.view(np.uint16).fill(0x7FC0)
            world.device.synchronize()
            graph.launch(s)
            s.synchronize()
            world.check_errors()
            p.check(out, _mlp_ref(world, xr, w_gu_h, w_down_h, ffn, dtype), dtype, f"MLP replay with new x {replay}")
        p.assert_none()
        assert all(c.path in ("fused", "decomposed") for c in choices)
        assert all(c.path == "decomposed" and "capture" in c.reason for c in captured), captured
    finally:
        mlp.free()
