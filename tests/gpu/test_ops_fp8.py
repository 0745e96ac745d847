"""GPU tests of the tensor-parallel ops with fp8 inputs (``fp8=Fp8Options``: fluxrt.ops.decomposed with the fp8
GEMM of fluxrt.gemm.fp8), under mpirun on 2 or 4 GPUs or 2 ranks on one GPU under MPS
(``MPS_FILES=ops_fp8 MPS_RANKS=2 bash launch/mps-check.sh``).

Random fp8 inputs and scales that differ per rank (a rank's rows multiplied with another rank's scale must
show), outputs poisoned with NaN, checked against a float64 numpy reference of the dequantised inputs of every
rank (gathered over MPI): per-tensor and block scales, padded shards, one and several chunks, both fp8
formats, bf16 and fp16 outputs, back-to-back calls of different M, and graph capture with replays.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from op_checks import Problems as _Problems, np_dtype as _np_dtype, poisoned as _poisoned  # tests/gpu/op_checks.py

pytestmark = [pytest.mark.multirank, pytest.mark.hopper]   # the fp8 GEMM is sm_90a (conftest.py skips elsewhere)

FMT = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


@pytest.fixture
def rng(request, world):
    return np.random.default_rng([zlib.crc32(request.node.name.encode()), world.rank])


def _fp8(rng, shape, fmt):
    """Random fp8 values of magnitudes 2^-3 .. 2^2 (numpy float8 array)."""
    import ml_dtypes

    mag = rng.uniform(1.0, 2.0, size=shape) * np.exp2(rng.integers(-3, 2, size=shape))
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.dtype(getattr(ml_dtypes, FMT[fmt])))


def _scales(rng, mode, rows, n, k):
    """(scale_a, scale_b) fp32: one element each, or block scales over three decades."""
    if mode == "tensor":
        return (rng.uniform(0.25, 4.0, size=(1,)).astype(np.float32),
                rng.uniform(0.5, 2.0, size=()).astype(np.float32))
    kbs, nbs = -(-k // 128), -(-n // 128)
    sa = rng.uniform(1.0, 2.0, size=(rows, kbs)) * 10.0 ** rng.integers(-2, 1, size=(rows, kbs))
    sb = rng.uniform(1.0, 2.0, size=(nbs, kbs)) * 10.0 ** rng.integers(-2, 1, size=(nbs, kbs))
    return sa.astype(np.float32), sb.astype(np.float32)


def _deq(x8, s, cols_per_scale_row):
    """float64 values of fp8 `x8` [rows, K] with scale `s`: one element, or [rows / cols_per_scale_row,
    ceil(K/128)] (one scale per row of A: 1; per 128 rows of B: 128)."""
    x = x8.astype(np.float64)
    s = np.asarray(s, dtype=np.float64)
    if s.size == 1:
        return x * float(s.reshape(-1)[0])
    rows, k = x.shape
    full = np.repeat(np.repeat(s, cols_per_scale_row, axis=0)[:rows], 128, axis=1)[:, :k]
    return x * full


def _dev(x):
    import cupy

    x = np.asarray(x)
    return cupy.asarray(x.view(np.uint8) if x.dtype.itemsize == 1 else x)   # fp8 values as their bytes


def _ag_ref(world, a8, sa, b8, sb):
    """allgather(dequant(A shards)) @ dequant(B).T from every rank's shard and scale."""
    parts = world.comm.allgather((a8.view(np.uint8), np.asarray(sa)))
    fmt = a8.dtype
    a_full = np.concatenate([_deq(x.view(fmt), s, 1) for x, s in parts], axis=0)
    return a_full @ _deq(b8, sb, 128).T


def _rs_ref(world, a8, sa, b8, sb, shard):
    parts = world.comm.allgather((a8.view(np.uint8), np.asarray(sa), b8.view(np.uint8), np.asarray(sb)))
    total = sum(_deq(x.view(a8.dtype), s, 1) @ _deq(y.view(b8.dtype), t, 128).T for x, s, y, t in parts)
    return total[world.rank * shard:(world.rank + 1) * shard]


CASES = [  # scale mode, rows per rank (200, 72: shards of partial tiles), chunks, fp8 format, output
    ("tensor", 256, 1, "e4m3", "bfloat16"),
    ("tensor", 384, 3, "e4m3", "bfloat16"),
    ("tensor", 200, 2, "e5m2", "float16"),
    ("block", 256, 1, "e4m3", "bfloat16"),
    ("block", 200, 2, "e4m3", "bfloat16"),
    ("block", 72, 4, "e4m3", "float16"),
]


@pytest.mark.parametrize("mode, shard, chunks, fmt, dtype", CASES)
def test_ag_gemm_fp8_matches_reference(world, rng, mode, shard, chunks, fmt, dtype):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm, Fp8Options

    n, k = 384, 320
    m = shard * world.size
    op = AllGatherGemm(world, m, n, k, dtype, trans_b=True, fp8=Fp8Options(fmt, mode),
                       plan=AgGemmPlan(decomposed_chunks=chunks))
    a8, b8 = _fp8(rng, (shard, k), fmt), _fp8(rng, (n, k), fmt)
    sa, sb = _scales(rng, mode, shard, n, k)
    out = _poisoned((m, n), dtype)
    choice = op.path_choice(m)
    got, gathered = op.forward(_dev(a8), _dev(b8), out=out, scale_a=_dev(sa), scale_b=_dev(sb), return_a=True)
    world.synchronize()
    assert (choice.path, choice.chunks) == ("decomposed", chunks) and "fp8" in choice.reason
    assert got is out
    full = np.concatenate([x for x in world.comm.allgather(a8.view(np.uint8))], axis=0)
    np.testing.assert_array_equal(gathered.get(), full)
    p = _Problems()
    p.check(got, _ag_ref(world, a8, sa, b8, sb), dtype, f"AG fp8 {mode} chunks={chunks} rank {world.rank}")
    p.assert_none()


@pytest.mark.parametrize("mode, shard, chunks, fmt, dtype", CASES)
def test_gemm_rs_fp8_matches_reference(world, rng, mode, shard, chunks, fmt, dtype):
    from fluxrt.ops import Fp8Options, GemmReduceScatter, GemmRsPlan

    n, k = 320, 256
    m = shard * world.size
    op = GemmReduceScatter(world, m, n, k, dtype, trans_b=True, fp8=Fp8Options(fmt, mode),
                           plan=GemmRsPlan(path="decomposed", decomposed_chunks=chunks))
    a8, b8 = _fp8(rng, (m, k), fmt), _fp8(rng, (n, k), fmt)
    sa, sb = _scales(rng, mode, m, n, k)
    out = _poisoned((shard, n), dtype)
    got = op.forward(_dev(a8), _dev(b8), out=out, scale_a=_dev(sa), scale_b=_dev(sb))
    world.synchronize()
    assert got is out and op.path_choice(m).path == "decomposed"
    p = _Problems()
    p.check(got, _rs_ref(world, a8, sa, b8, sb, shard), dtype, f"RS fp8 {mode} chunks={chunks} rank {world.rank}")
    p.assert_none()


def test_fp8_ops_back_to_back_calls_of_different_m(world, rng):
    """One op object, calls of several M (whole and partial tiles) in a row, per-tensor scales."""
    from fluxrt.ops import AllGatherGemm, Fp8Options, GemmReduceScatter

    n, k, w = 256, 256, world.size
    ag = AllGatherGemm(world, 512 * w, n, k, "bfloat16", trans_b=True, fp8=Fp8Options())
    rs = GemmReduceScatter(world, 512 * w, n, k, "bfloat16", trans_b=True, fp8=Fp8Options())
    b8 = _fp8(np.random.default_rng(3), (n, k), "e4m3")
    sb = np.float32([1.5])
    p = _Problems()
    for shard in (512, 136, 8, 384):
        m = shard * w
        a8 = _fp8(rng, (shard, k), "e4m3")
        sa = rng.uniform(0.25, 4.0, size=(1,)).astype(np.float32)
        c = ag.forward(_dev(a8), _dev(b8), scale_a=_dev(sa), scale_b=_dev(sb))
        a8r = _fp8(rng, (m, k), "e4m3")
        y = rs.forward(_dev(a8r), _dev(b8), scale_a=_dev(sa), scale_b=_dev(sb))
        world.synchronize()
        p.check(c, _ag_ref(world, a8, sa, b8, sb), "bfloat16", f"AG M={m}")
        p.check(y, _rs_ref(world, a8r, sa, b8, sb, shard), "bfloat16", f"RS M={m}")
    p.assert_none()


def test_fp8_ops_graph_capture_and_replay(world, rng):
    """AllGather+GEMM then GEMM+ReduceScatter with block scales captured in one CUDA graph; replays after new
    bytes and new scales are written into the captured inputs."""
    import cupy

    from fluxrt.ops import AllGatherGemm, Fp8Options, GemmReduceScatter

    n, k, shard, w = 256, 384, 200, world.size
    m = shard * w
    fp8 = Fp8Options("e4m3", "block")
    ag = AllGatherGemm(world, m, n, k, "bfloat16", trans_b=True, fp8=fp8)
    rs = GemmReduceScatter(world, m, k, n, "bfloat16", trans_b=True, fp8=fp8)
    s = cupy.cuda.Stream(non_blocking=True)
    b_ag8, b_rs8 = _fp8(np.random.default_rng(4), (n, k), "e4m3"), _fp8(rng, (k, n), "e4m3")
    sb_ag = _scales(np.random.default_rng(5), "block", 1, n, k)[1]
    sa_rs_shape, sb_rs = (m, -(-n // 128)), _scales(rng, "block", 1, k, n)[1]
    x, sx = cupy.empty((shard, k), dtype=cupy.uint8), cupy.empty((shard, -(-k // 128)), dtype=cupy.float32)
    h, sh = cupy.empty((m, n), dtype=cupy.uint8), cupy.empty(sa_rs_shape, dtype=cupy.float32)
    c, y = _poisoned((m, n), "bfloat16"), _poisoned((shard, k), "bfloat16")
    dev = {name: _dev(v) for name, v in (("b_ag", b_ag8), ("sb_ag", sb_ag), ("b_rs", b_rs8), ("sb_rs", sb_rs))}

    def step():
        ag.forward(x, dev["b_ag"], out=c, stream=s, scale_a=sx, scale_b=dev["sb_ag"])
        rs.forward(h, dev["b_rs"], out=y, stream=s, scale_a=sh, scale_b=dev["sb_rs"])

    def new_inputs():
        a8, sa = _fp8(rng, (shard, k), "e4m3"), _scales(rng, "block", shard, n, k)[0]
        h8, shh = _fp8(rng, (m, n), "e4m3"), _scales(rng, "block", m, k, n)[0]
        x.set(a8.view(np.uint8)), sx.set(sa), h.set(h8.view(np.uint8)), sh.set(shh)
        c.view(np.uint16).fill(0x7FC0), y.view(np.uint16).fill(0x7FC0)
        world.device.synchronize()
        return a8, sa, h8, shh

    new_inputs()
    with s:
        step()   # plans, kernels, launch caches and path choices made outside the capture
    s.synchronize()
    s.begin_capture()
    step()
    graph = s.end_capture()
    captured = (ag._paths[(m, True, None)], rs._paths[(m, True, None)])
    p = _Problems()
    for replay in range(3):
        a8, sa, h8, shh = new_inputs()
        for _ in range(1 + 9 * (replay == 0)):
            graph.launch(s)
        s.synchronize()
        world.check_errors()
        p.check(c, _ag_ref(world, a8, sa, b_ag8, sb_ag), "bfloat16", f"AG replay {replay}")
        p.check(y, _rs_ref(world, h8, shh, b_rs8, sb_rs, shard), "bfloat16", f"RS replay {replay}")
    p.assert_none()
    assert all(ch.path == "decomposed" for ch in captured), captured


def test_fp8_ops_reject_bad_calls_on_every_rank(world, rng):
    from fluxrt.ops import AgGemmPlan, AllGatherGemm, Fp8Options, GemmReduceScatter, OpsArgumentError

    n, k, shard = 256, 256, 128
    m = shard * world.size
    with pytest.raises(OpsArgumentError, match="no fp8 hooks"):
        AllGatherGemm(world, m, n, k, trans_b=True, fp8=Fp8Options(), plan=AgGemmPlan(path="fused"))
    ag = AllGatherGemm(world, m, n, k, trans_b=True, fp8=Fp8Options())
    rs = GemmReduceScatter(world, m, n, k, trans_b=True, fp8=Fp8Options("e4m3", "block"))
    a, b = _dev(_fp8(rng, (shard, k), "e4m3")), _dev(_fp8(rng, (n, k), "e4m3"))
    one = _dev(np.float32([1.0]))
    with pytest.raises(OpsArgumentError, match="no fp8 hooks"):
        ag.forward(a, b, scale_a=one, scale_b=one, path="fused")
    with pytest.raises(OpsArgumentError, match="need scale_a and scale_b"):
        ag.forward(a, b)
    with pytest.raises(OpsArgumentError, match="scale_a has shape"):
        ag.forward(a, b, scale_a=_dev(np.ones((shard, 2), np.float32)), scale_b=one)
    with pytest.raises(OpsArgumentError, match="expected fp32"):
        ag.forward(a, b, scale_a=_dev(np.ones(1, np.float64)), scale_b=one)
    with pytest.raises(OpsArgumentError, match="a_shard is bf16, expected uint8|a_shard is bfloat16"):
        ag.forward(_dev(np.zeros((shard, k), _np_dtype("bfloat16"))), b, scale_a=one, scale_b=one)
    with pytest.raises(OpsArgumentError, match="no symmetric gather buffer"):
        ag.shard_buffer(m)
    with pytest.raises(OpsArgumentError, match="block scales"):
        rs.forward(_dev(_fp8(rng, (m, k), "e4m3")), b, scale_a=one, scale_b=one)
    world.check_errors()
