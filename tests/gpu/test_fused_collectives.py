"""GPU tests of the fused allreduce + residual + RMSNorm and of the compressed collectives against float64
numpy references (mpirun -n 2|4 python -m pytest tests/gpu/test_fused_collectives.py).

Every rank runs the same tests in the same order; x differs per rank, residual and weight are the same on
every rank (replicated, as in tensor parallelism). Outputs are poisoned before each call."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multirank

_EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -10, "fp32": 2.0 ** -23}
SHAPES = [(1, 4096), (3, 4097), (7, 1000), (37, 515), (130, 2048), (5, 129)]


def _dtype(name):
    import fluxrt

    return fluxrt.normalize_dtype(name)


def _host(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def _normal(seed: int, shape, dtype: str, scale: float = 1.0):
    import cupy

    return (cupy.random.default_rng(seed).standard_normal(size=shape, dtype=np.float32) * scale).astype(_dtype(dtype))


def _inputs(world, seed: int, rows: int, cols: int, dtype: str):
    x = _normal(seed * 1009 + world.rank, (rows, cols), dtype)
    residual = _normal(seed * 7919 + 100003, (rows, cols), dtype)      # the same on every rank
    weight = _normal(seed * 31 + 7, (cols,), dtype, 0.5)
    return x, residual, weight


def _poison(shape, dtype):
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    if np.dtype(dtype).kind == "f" or str(np.dtype(dtype)) == "bfloat16":
        a.fill(np.nan)
    else:
        a.fill(0x7F)
    return a


def _fail(what: str, bad: np.ndarray, got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> None:
    i = np.unravel_index(int(np.argmax(bad)), bad.shape)
    pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} wrong; first at {i}: got {got[i]}, want {want[i]} "
                f"(bound {bound[i]:.3g})")


def _check_norm(world, x, residual, weight, eps, dtype, res, quant=None, what=""):
    """residual_out against the float64 sum; out against RMSNorm of the h that was stored (float64)."""
    xs = [a.astype(np.float64) for a in world.comm.allgather(_host(x))]
    n = len(xs)
    ref = np.sum(xs, axis=0) + _host(residual)
    magnitude = np.sum([np.abs(a) for a in xs], axis=0) + np.abs(_host(residual))
    h = _host(res.residual_out)
    bound = _EPS[dtype] * np.abs(ref) + (n + 1) * 2.0 ** -23 * magnitude + 1e-7
    bad = ~(np.abs(h - ref) <= bound)
    if bad.any():
        _fail(f"{what} residual_out", bad, h, ref, bound)
    w = _host(weight)
    rstd = 1.0 / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + eps)
    y = h * rstd * w
    if quant is None:
        got = _host(res.out)
        ybound = _EPS[dtype] * np.abs(y) + 1e-5 * np.abs(h * rstd * w).max(axis=1, keepdims=True) + 1e-6
    else:
        import ml_dtypes

        codes = np.asarray(res.out.get()).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        scales = _host(res.scales)
        rows, cols = y.shape
        if quant == "per_token":
            amax = np.abs(y).max(axis=1)
            full = np.repeat(scales[:, None], cols, axis=1)
        else:
            groups = -(-cols // 128)
            pad = np.zeros((rows, groups * 128))
            pad[:, :cols] = np.abs(y)
            amax = pad.reshape(rows, groups, 128).max(axis=2)
            full = np.repeat(scales, 128, axis=1)[:, :cols]
        sbad = ~(np.abs(scales - amax / 448.0) <= 1e-3 * amax / 448.0 + 1e-12)
        if sbad.any():
            _fail(f"{what} scales", sbad, scales, amax / 448.0, 1e-3 * amax / 448.0)
        got = codes * full
        # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals below 2^-6 (steps of 2^-9) of the scale
        ybound = 2.0 ** -4 * np.abs(y) * 1.01 + 2.0 ** -10 * full + 1e-3 * np.abs(y) + 1e-7
    bad = ~(np.abs(got - y) <= ybound)
    if bad.any():
        _fail(f"{what} out", bad, got, y, ybound)


def _same_on_every_rank(world, arrays, what: str) -> None:
    import cupy

    mine = [np.ascontiguousarray(cupy.asnumpy(a)).view(np.uint8).reshape(-1) for a in arrays if a is not None]
    every = world.comm.allgather(mine)
    for r, theirs in enumerate(every):
        for k, (a, b) in enumerate(zip(mine, theirs)):
            if not np.array_equal(a, b):
                pytest.fail(f"{what}: output {k} differs between rank {world.rank} and rank {r}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("algo", ["ll", "twoshot", "auto"])
def test_allreduce_rmsnorm(world, dtype, rows, cols, algo):
    import fluxrt.fused

    x, residual, weight = _inputs(world, rows * 131 + cols, rows, cols, dtype)
    out, ro = _poison((rows, cols), x.dtype), _poison((rows, cols), x.dtype)
    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, 1e-5, out=out, residual_out=ro, algo=algo)
    world.device.synchronize()
    world.check_errors()
    assert res.out is out and res.residual_out is ro and res.scales is None
    _check_norm(world, x, residual, weight, 1e-5, dtype, res, what=f"{algo} {dtype} {rows}x{cols}")
    _same_on_every_rank(world, [res.out, res.residual_out], f"{algo} {dtype} {rows}x{cols}")


@pytest.mark.parametrize("rows, cols", [(3, 4097), (37, 515), (64, 1024)])
def test_algorithms_give_the_same_bits(world, rows, cols):
    import fluxrt.fused

    x, residual, weight = _inputs(world, 5, rows, cols, "bf16")
    a = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, algo="ll")
    b = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, algo="twoshot")
    world.device.synchronize()
    for u, v, name in ((a.out, b.out, "out"), (a.residual_out, b.residual_out, "residual_out")):
        assert np.array_equal(u.get().view(np.uint16), v.get().view(np.uint16)), name


def test_unfused_baseline_agrees(world):
    """allreduce, then add_rmsnorm (the perf baseline): the same values up to the allreduce's own rounding."""
    import fluxrt
    import fluxrt.fused

    rows, cols = 17, 2000
    x, residual, weight = _inputs(world, 21, rows, cols, "bf16")
    fused = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight)
    reduced = fluxrt.allreduce(world, x)
    sep = fluxrt.fused.add_rmsnorm(world, reduced, residual, weight)
    world.device.synchronize()
    world.check_errors()
    a, b = _host(fused.out), _host(sep.out)
    assert np.abs(a - b).max() <= 4 * _EPS["bf16"] * np.abs(a).max()
    h, hs = _host(fused.residual_out), _host(sep.residual_out)
    assert np.abs(h - hs).max() <= 4 * _EPS["bf16"] * np.abs(h).max()


@pytest.mark.parametrize("quant", ["per_token", "per_block"])
@pytest.mark.parametrize("rows, cols", [(1, 4096), (5, 1000), (33, 300), (130, 2048)])
@pytest.mark.parametrize("algo", ["ll", "twoshot"])
def test_allreduce_rmsnorm_fp8(world, quant, rows, cols, algo):
    import fluxrt.fused

    x, residual, weight = _inputs(world, rows + 3 * cols, rows, cols, "bf16")
    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, 1e-6, quant=quant, algo=algo)
    world.device.synchronize()
    world.check_errors()
    assert res.out.dtype == np.uint8 and res.out.shape == (rows, cols)
    _check_norm(world, x, residual, weight, 1e-6, "bf16", res, quant=quant, what=f"{quant} {algo} {rows}x{cols}")
    _same_on_every_rank(world, [res.out, res.scales, res.residual_out], f"{quant} {algo}")


@pytest.mark.parametrize("algo", ["ll", "twoshot"])
def test_in_place(world, algo):
    import fluxrt.fused

    rows, cols = 9, 768
    x, residual, weight = _inputs(world, 11, rows, cols, "fp16")
    x0, r0 = x.copy(), residual.copy()
    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=x, residual_out=residual, algo=algo)
    world.device.synchronize()
    assert res.out is x and res.residual_out is residual
    _check_norm(world, x0, r0, weight, 1e-6, "fp16", res, what=f"in place {algo}")


def test_graph_replay(world):
    import cupy

    import fluxrt.fused

    s = cupy.cuda.Stream(non_blocking=True)
    cases = [(4, 4096, "ll"), (96, 1536, "twoshot")]
    bufs = []
    for rows, cols, algo in cases:
        x, residual, weight = _inputs(world, 0, rows, cols, "bf16")
        out, ro = _poison((rows, cols), x.dtype), _poison((rows, cols), x.dtype)
        codes, scales = cupy.empty((rows, cols), np.uint8), cupy.empty((rows, -(-cols // 128)), np.float32)
        bufs.append((x, residual, weight, out, ro, codes, scales, algo))
    world.device.synchronize()
    for x, residual, weight, out, ro, codes, scales, algo in bufs:  # eager first: compiles and plans
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=out, residual_out=ro, algo=algo, stream=s)
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=codes, residual_out=ro, algo=algo,
                                       quant="per_block", scales_out=scales, stream=s)
    s.synchronize()
    s.begin_capture()
    for x, residual, weight, out, ro, codes, scales, algo in bufs:
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=out, residual_out=ro, algo=algo, stream=s)
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=codes, residual_out=ro, algo=algo,
                                       quant="per_block", scales_out=scales, stream=s)
    graph = s.end_capture()
    for replay in range(3):
        for x, residual, weight, out, ro, codes, scales, algo in bufs:
            x[...] = _normal(replay * 101 + world.rank, x.shape, "bf16")
            out.fill(np.nan)
            ro.fill(np.nan)
        world.device.synchronize()
        graph.launch(s)
        s.synchronize()
        world.check_errors()
        for x, residual, weight, out, ro, codes, scales, algo in bufs:
            res = fluxrt.fused.AllreduceNormResult(out, ro, None)
            _check_norm(world, x, residual, weight, 1e-6, "bf16", res, what=f"replay {replay} {algo}")
            q = fluxrt.fused.AllreduceNormResult(codes, ro, scales)
            _check_norm(world, x, residual, weight, 1e-6, "bf16", q, quant="per_block", what=f"replay {replay} fp8")


@pytest.mark.parametrize("rows_per_rank, cols, n", [(64, 1024, 256), (37, 640, 200)])
def test_fp8_output_feeds_allgather_gemm(world, rows_per_rank, cols, n):
    """allreduce_rmsnorm's per_block FP8 codes and scales, each rank's row shard of them, into the block-scaled
    FP8 AllGather+GEMM (examples/norm_fp8_ag_gemm.py): the gathered GEMM against the float64 product of the
    dequantized codes (every rank holds all of them after the allreduce) and this rank's e4m3 weight."""
    import cupy
    import ml_dtypes

    import fluxrt.fused
    from fluxrt.ops import AllGatherGemm, Fp8Options

    w, me = world.size, world.rank
    rows = rows_per_rank * w
    x, residual, weight = _inputs(world, 17 + cols, rows, cols, "bf16")
    kb, nb = -(-cols // 128), -(-n // 128)
    codes, scales = _poison((rows, cols), np.uint8), _poison((rows, kb), np.float32)
    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, 1e-6, residual_out=_poison((rows, cols), x.dtype),
                                         out=codes, quant="per_block", scales_out=scales)
    rng = np.random.default_rng(1000 + me)
    b8 = (rng.standard_normal((n, cols)) * 8.0).astype(ml_dtypes.float8_e4m3fn)
    sb = rng.uniform(0.5, 2.0, size=(nb, kb)).astype(np.float32) / 64.0
    ag = AllGatherGemm(world, rows, n, cols, "bfloat16", trans_b=True, fp8=Fp8Options("e4m3", "block"))
    out = _poison((rows, n), _dtype("bf16"))
    mine = slice(me * rows_per_rank, (me + 1) * rows_per_rank)
    ag.forward(codes[mine], cupy.asarray(b8.view(np.uint8)), out=out, scale_a=scales[mine], scale_b=cupy.asarray(sb))
    world.device.synchronize()
    world.check_errors()
    _check_norm(world, x, residual, weight, 1e-6, "bf16", res, quant="per_block", what="chain input")
    a = codes.get().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.repeat(_host(scales), 128, 1)[:, :cols]
    b = b8.astype(np.float64) * np.repeat(np.repeat(sb.astype(np.float64), 128, 0), 128, 1)[:n, :cols]
    want = a @ b.T
    got = _host(out)
    # bf16 rounding of the output, plus the fp8 wgmma's accumulator inside each 128-K block, which keeps about
    # 14 bits (DeepSeek-V3 report, sec. 3.3.2) before the block's sum is scaled into fp32
    bound = 2.0 ** -8 * np.abs(want) + 2.0 ** -13 * (np.abs(a) @ np.abs(b).T) + 1e-6
    bad = ~(np.abs(got - want) <= bound)
    ag.free()
    if bad.any():
        _fail(f"AllGather+GEMM of the norm's fp8 output {rows}x{cols}x{n}", bad, got, want, bound)


def test_bad_arguments_raise_before_launch(world):
    import cupy

    import fluxrt
    import fluxrt.fused

    x, residual, weight = _inputs(world, 1, 4, 64, "bf16")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="weight"):
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight[:32])
    with pytest.raises(fluxrt.CollectiveArgumentError, match="bf16 or fp16"):
        fluxrt.fused.allreduce_rmsnorm(world, x.astype(np.float32), residual.astype(np.float32),
                                       weight.astype(np.float32))
    with pytest.raises(fluxrt.CollectiveArgumentError, match="quant"):
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, quant="fp4")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="overlaps"):
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=residual)
    with pytest.raises(fluxrt.CollectiveArgumentError, match="shape"):
        fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=cupy.empty((4, 63), x.dtype))
    # the world still works
    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight)
    world.device.synchronize()
    _check_norm(world, x, residual, weight, 1e-6, "bf16", res, what="after errors")


# ---------------------------------------------------------------------------------------------- compressed
_QMAX = {"fp8": 448.0, "int8": 127.0}
# ||err|| / ||ref|| on normal data (fluxrt.compressed's table, with headroom for 2^12-element samples)
_REL = {("fp8", 1): 0.032, ("fp8", 2): 0.045, ("int8", 1): 0.0085, ("int8", 2): 0.012}


def _quantized(v: np.ndarray, fmt: str) -> np.ndarray:
    """The kernels' arithmetic in numpy (fp32): groups of 128, scale amax / qmax, codes, decoded."""
    import ml_dtypes

    v = v.astype(np.float32)
    pad = (-v.size) % 128
    g = np.concatenate([v, np.zeros(pad, np.float32)]).reshape(-1, 128)
    amax = np.abs(g).max(axis=1, keepdims=True).astype(np.float32)
    scale = (amax / np.float32(_QMAX[fmt])).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(scale > 0, g / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    if fmt == "fp8":
        c = np.clip(s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        c = np.clip(np.rint(s), -127, 127).astype(np.float32)
    return (c * scale).astype(np.float32).reshape(-1)[:v.size]


def _rel(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("count", [1, 127, 1000, 4096 * 3 + 5])
def test_compressed_allreduce(world, fmt, dtype, count):
    import fluxrt

    n = world.size
    x = _normal(count * 3 + world.rank, (count,), dtype)
    out = _poison((count,), x.dtype)
    fluxrt.allreduce(world, x, out, compress=fmt)
    world.device.synchronize()
    world.check_errors()
    xs = [a.astype(np.float64) for a in world.comm.allgather(_host(x))]
    ref = np.sum(xs, axis=0)
    got = _host(out)
    assert np.isfinite(got).all()
    if count >= 1000:
        assert _rel(got, ref) <= _REL[(fmt, 2)], _rel(got, ref)
    # against a model of the kernels: chunks of ceil(ceil(count / n) / 128) * 128, per-chunk groups
    chunk = -(-(-(-count // n)) // 128) * 128
    model = np.zeros(count, np.float32)
    for q in range(n):
        lo, hi = q * chunk, min(count, (q + 1) * chunk)
        if lo >= hi:
            continue
        acc = np.zeros(hi - lo, np.float32)
        for p in range(n):
            acc = (acc + _quantized(xs[p][lo:hi], fmt)).astype(np.float32)
        model[lo:hi] = _quantized(acc, fmt)
    step = np.abs(model).max() * (2.0 ** -3 if fmt == "fp8" else 1.0 / 127) + 1e-6
    far = np.abs(got - model) > _EPS[dtype] * np.abs(model) + 1e-6
    assert far.mean() <= 2e-3 and (np.abs(got - model) <= step).all(), (far.sum(), count)
    _same_on_every_rank(world, [out], f"compressed allreduce {fmt} {dtype} {count}")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("per_rank", [1, 333, 4096])
def test_compressed_reduce_scatter_and_allgather(world, fmt, per_rank):
    import fluxrt

    n, r = world.size, world.rank
    x = _normal(per_rank + 17 * r, (n * per_rank,), "bf16")
    rs = _poison((per_rank,), x.dtype)
    fluxrt.reduce_scatter(world, x, rs, compress=fmt)
    y = _normal(per_rank + 29 * r, (per_rank,), "bf16")
    ag = _poison((n * per_rank,), y.dtype)
    fluxrt.allgather(world, y, ag, compress=fmt)
    world.device.synchronize()
    world.check_errors()
    xs = [a.astype(np.float64) for a in world.comm.allgather(_host(x))]
    ys = [a.astype(np.float64) for a in world.comm.allgather(_host(y))]
    mine = slice(r * per_rank, (r + 1) * per_rank)
    rs_ref = np.sum([a[mine] for a in xs], axis=0)
    rs_model = np.zeros(per_rank, np.float32)
    for p in range(n):
        rs_model = (rs_model + _quantized(xs[p][mine], fmt)).astype(np.float32)
    ag_model = np.concatenate([_quantized(a, fmt) for a in ys])
    for name, got, model, ref in (("reduce_scatter", _host(rs), rs_model, rs_ref),
                                  ("allgather", _host(ag), ag_model, np.concatenate(ys))):
        bound = _EPS["bf16"] * np.abs(model) + 1e-6
        bad = ~(np.abs(got - model) <= bound)
        if bad.any():
            _fail(f"{name} {fmt}", bad, got, model.astype(np.float64), bound)
        if per_rank >= 4096:
            assert _rel(got, ref) <= _REL[(fmt, 1)], (name, _rel(got, ref))
    _same_on_every_rank(world, [ag], f"compressed allgather {fmt}")


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_error_feedback(world, op):
    """After a call, what was sent plus the new error buffer is what there was to send: x + the old buffer."""
    import fluxrt

    n, r = world.size, world.rank
    count = 1000 * n
    x = _normal(7 + r, (count,), "fp32")
    ef = _normal(8 + r, (count,), "fp32", 0.01)
    ef0 = _host(ef)
    fn = getattr(fluxrt, op)
    fn(world, x, compress="int8", error_feedback=ef)
    world.device.synchronize()
    world.check_errors()
    sent = _host(x) + ef0
    if op == "allgather":
        expect = _quantized(sent, "int8")
    else:
        chunk = count // n if op == "reduce_scatter" else -(-(-(-count // n)) // 128) * 128
        expect = np.concatenate([_quantized(sent[q * chunk:(q + 1) * chunk], "int8") for q in range(-(-count // chunk))])
    got = _host(ef)
    assert np.allclose(got, sent - expect, rtol=0, atol=1e-5 * np.abs(sent).max()), np.abs(got - (sent - expect)).max()


def test_compressed_graph_replay_and_errors(world):
    import cupy

    import fluxrt

    count = 3000
    x = cupy.empty(count, dtype=fluxrt.bfloat16)
    out = _poison((count,), x.dtype)
    s = cupy.cuda.Stream(non_blocking=True)
    x[...] = _normal(world.rank, (count,), "bf16")
    world.device.synchronize()
    fluxrt.allreduce(world, x, out, compress="fp8", stream=s)
    s.synchronize()
    s.begin_capture()
    fluxrt.allreduce(world, x, out, compress="fp8", stream=s)
    graph = s.end_capture()
    for replay in range(3):
        x[...] = _normal(replay * 5 + world.rank, (count,), "bf16")
        out.fill(np.nan)
        world.device.synchronize()
        graph.launch(s)
        s.synchronize()
        world.check_errors()
        ref = np.sum([a.astype(np.float64) for a in world.comm.allgather(_host(x))], axis=0)
        assert _rel(_host(out), ref) <= _REL[("fp8", 2)]
        _same_on_every_rank(world, [out], f"compressed replay {replay}")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="compress"):
        fluxrt.allreduce(world, x, compress="fp4")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="sums"):
        fluxrt.allreduce(world, x, op="max", compress="int8")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="error_feedback"):
        fluxrt.allreduce(world, x, compress="int8", error_feedback=cupy.zeros(count, np.float16))


def test_messages_larger_than_the_workspace_go_in_pieces(world):
    """A small workspace: the twoshot norm and the compressed collectives take several launches, which must
    give the same result as one."""
    import fluxrt
    import fluxrt.compressed
    import fluxrt.fused

    ctx = fluxrt.Collectives(world, fluxrt.CollectivesOptions(workspace_bytes=1 << 20))
    try:
        rows, cols = 100, 4096
        p = fluxrt.fused.plan_allreduce_rmsnorm(rows, cols, world.size, 2, ctx.half_bytes, ctx.ll_half_bytes,
                                                ctx.tuning, "twoshot")
        assert len(p.pieces) > 1
        x, residual, weight = _inputs(world, 3, rows, cols, "bf16")
        small = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, algo="twoshot", ctx=ctx)
        q = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, algo="twoshot", quant="per_token", ctx=ctx)
        big = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, algo="twoshot")
        count = 300001
        assert len(fluxrt.compressed.compressed_pieces("allreduce", count, world.size, ctx.half_bytes)) > 1
        y = _normal(world.rank + 50, (count,), "bf16")
        ys = ctx.allreduce(y, compress="int8")
        yb = fluxrt.allreduce(world, y, compress="int8")
        world.device.synchronize()
        world.check_errors()
        assert np.array_equal(small.out.get().view(np.uint16), big.out.get().view(np.uint16))
        assert np.array_equal(small.residual_out.get().view(np.uint16), big.residual_out.get().view(np.uint16))
        _check_norm(world, x, residual, weight, 1e-6, "bf16", q, quant="per_token", what="pieces fp8")
        ref = np.sum([a.astype(np.float64) for a in world.comm.allgather(_host(y))], axis=0)
        assert _rel(_host(ys), ref) <= _REL[("int8", 2)] and _rel(_host(yb), ref) <= _REL[("int8", 2)]
        _same_on_every_rank(world, [ys], "compressed pieces")
    finally:
        ctx.free()


def test_fast_path_without_the_cross_rank_check(world, monkeypatch):
    """With check_collective_args off, repeated calls on the same arrays reuse their launches (fused norm and
    compressed ops): each call still computes its own inputs' result."""
    import dataclasses

    import fluxrt
    import fluxrt.fused

    monkeypatch.setattr(world, "options", dataclasses.replace(world.options, check_collective_args=False))
    rows, cols = 6, 1000
    x, residual, weight = _inputs(world, 40, rows, cols, "bf16")
    out, ro = _poison((rows, cols), x.dtype), _poison((rows, cols), x.dtype)
    y = _normal(world.rank + 60, (5000,), "bf16")
    yo = _poison((5000,), y.dtype)
    for step in range(3):
        x[...] = _normal(step * 10 + world.rank, (rows, cols), "bf16")
        y[...] = _normal(step * 10 + 5 + world.rank, (5000,), "bf16")
        out.fill(np.nan)
        yo.fill(np.nan)
        res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, out=out, residual_out=ro)
        fluxrt.allreduce(world, y, yo, compress="fp8")
        world.device.synchronize()
        world.check_errors()
        assert res.out is out and res.residual_out is ro
        _check_norm(world, x, residual, weight, 1e-6, "bf16", res, what=f"fast path step {step}")
        ref = np.sum([a.astype(np.float64) for a in world.comm.allgather(_host(y))], axis=0)
        assert _rel(_host(yo), ref) <= _REL[("fp8", 2)]
