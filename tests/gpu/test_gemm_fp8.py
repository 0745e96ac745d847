"""fp8 GEMM on a GPU (fluxrt.gemm.fp8): every fp8 format pairing, scale mode (none, per tensor, DeepSeek-style
block scales), output type, tile plan, tails and K shorter than one K block, against a float64 reference
computed from the dequantised inputs.

Run on an H100/H200: python3 -m pytest tests/gpu/test_gemm_fp8.py -q
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.hopper   # skipped off Hopper, with the reason (conftest.py)

from fluxrt.gemm import GemmArgumentError, GemmTypeError, autotune, gemm  # noqa: E402
from fluxrt.gemm.plan import FP8_BLOCK_SCALE_WIDTHS, GemmPlan, fp8_heuristic_plan  # noqa: E402

from gemm_checks import TOL, poisoned, rand_fp8  # noqa: E402


def reference(a8: np.ndarray, b8: np.ndarray, scale: str, sa: np.ndarray | None, sb: np.ndarray | None):
    """float64 C of A [M, K] @ B [N, K].T, dequantised by the scales."""
    a, b = a8.astype(np.float64), b8.astype(np.float64)
    if scale == "none":
        return a @ b.T
    if scale == "tensor":
        return float(sa.reshape(-1)[0]) * float(sb.reshape(-1)[0]) * (a @ b.T)
    m, k = a.shape
    n = b.shape[0]
    c = np.zeros((m, n))
    for kb in range(-(-k // 128)):
        ks = slice(128 * kb, min(k, 128 * kb + 128))
        part = a[:, ks] @ b[:, ks].T
        colscale = np.repeat(sb[:, kb].astype(np.float64), 128)[:n]
        c += part * sa[:, kb:kb + 1].astype(np.float64) * colscale[None, :]
    return c


def make_scales(rng, scale: str, m: int, n: int, k: int):
    if scale == "none":
        return None, None
    if scale == "tensor":
        return (rng.uniform(0.5, 2.0, size=(1,)).astype(np.float32),
                rng.uniform(0.5, 2.0, size=()).astype(np.float32))
    kbs = -(-k // 128)
    # per-block magnitudes over three decades: a K block scaled with a wrong block's scale shows
    sa = (rng.uniform(1.0, 2.0, size=(m, kbs)) * 10.0 ** rng.integers(-2, 1, size=(m, kbs))).astype(np.float32)
    sb = (rng.uniform(1.0, 2.0, size=(-(-n // 128), kbs)) * 10.0 ** rng.integers(-2, 1, size=(-(-n // 128), kbs)))
    return sa, sb.astype(np.float32)


def rel_err(c, ref: np.ndarray) -> float:
    c64 = cupy.asnumpy(c).astype(np.float64)
    assert not np.isnan(c64).any(), f"{np.isnan(c64).sum()} output elements never written (still NaN)"
    return float(np.linalg.norm(c64 - ref) / np.linalg.norm(ref))


def run_case(m, n, k, *, fmt="e4m3", scale="tensor", out_dtype="bfloat16", plan=None, seed=0, stream=None):
    rng = np.random.default_rng(seed)
    fa, fb = (fmt, fmt) if isinstance(fmt, str) else fmt
    a8, b8 = rand_fp8(rng, (m, k), fa), rand_fp8(rng, (n, k), fb)
    sa, sb = make_scales(rng, scale, m, n, k)
    da, db = cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8))
    dsa = cupy.asarray(sa) if sa is not None else None
    dsb = cupy.asarray(sb) if sb is not None else None
    out = poisoned((m, n), out_dtype)
    if stream is not None:
        cupy.cuda.Device().synchronize()
    res = gemm(da, db, out, trans_b=True, fp8_format=fmt, scale_a=dsa, scale_b=dsb, plan=plan, stream=stream)
    assert res is out
    cupy.cuda.Device().synchronize()
    ref = reference(a8, b8, scale, sa, sb)
    err = rel_err(out, ref)
    what = f"M={m} N={n} K={k} {fmt} scale={scale} -> {out_dtype} plan={plan.describe() if plan else None}"
    assert err < TOL[out_dtype], f"{what}: rel err {err:.3e}"
    return err


SHAPES = [(1024, 1024, 1024), (129, 264, 80), (257, 136, 48), (128, 256, 128), (1000, 1000, 1008),
          (64, 128, 16), (512, 384, 8192), (2048, 2048, 2048)]


@pytest.mark.parametrize("scale", ["none", "tensor", "block"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_e4m3_shapes(m, n, k, scale):
    run_case(m, n, k, scale=scale)


@pytest.mark.parametrize("scale", ["tensor", "block"])
@pytest.mark.parametrize("fmt", ["e5m2", ("e4m3", "e5m2"), ("e5m2", "e4m3")],
                         ids=["e5m2", "e4m3xe5m2", "e5m2xe4m3"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_formats_and_outputs(fmt, scale, out_dtype):
    run_case(1000, 520, 1008, fmt=fmt, scale=scale, out_dtype=out_dtype, seed=1)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_e4m3_fp16_out(out_dtype):
    run_case(777, 1032, 2064, scale="tensor", out_dtype=out_dtype, seed=2)


PLANS = [
    GemmPlan(block_m=128, block_n=256, block_k=128, stages=3),
    GemmPlan(block_m=128, block_n=128, block_k=128, stages=6),
    GemmPlan(block_m=128, block_n=64, block_k=128, stages=6),
    GemmPlan(block_m=128, block_n=192, block_k=128, stages=3),
    GemmPlan(block_m=64, block_n=256, block_k=128, consumers=1, stages=4),
    GemmPlan(block_m=64, block_n=128, block_k=128, consumers=1, stages=6),
    GemmPlan(block_m=64, block_n=64, block_k=128, consumers=1, stages=6),
    GemmPlan(block_k=128, order="hilbert", m_tile_offset=3),
    GemmPlan(block_k=128, cluster=2),
    GemmPlan(block_k=128, block_n=128, stages=6, cluster=2),
    GemmPlan(block_k=128, epilogue="direct", stages=4),
    GemmPlan(block_k=128, c_staging="shared", stages=4),
    GemmPlan(block_k=128, max_ctas=3),
    # ping-pong consumers (whole tiles alternating between the consumers), both stagings, a cluster; few CTAs, so
    # that each has several tiles (1000 x 776: 56 tiles of 128x128, 40 of 128x192, 28 pairs)
    GemmPlan(block_k=128, block_n=128, stages=5, pingpong=True, max_ctas=9),
    GemmPlan(block_k=128, block_n=192, stages=4, c_staging="shared", pingpong=True, max_ctas=7),
    GemmPlan(block_k=128, block_n=128, stages=5, cluster=2, pingpong=True, max_ctas=6),
    GemmPlan(block_k=128, block_n=64, stages=8, pingpong=True, max_ctas=3),
    # fitted widths: N = 776 leaves a part-filled last tile column (176: 4 x 176 + 72; 144: 5 x 144 + 56)
    GemmPlan(block_k=128, block_n=176, stages=4, c_staging="shared", pingpong=True),
    GemmPlan(block_k=128, block_n=144, stages=5, c_staging="shared", pingpong=True, max_ctas=5),
    GemmPlan(block_k=128, block_n=240, stages=3),
    # 192 wide with block scales: tiles start at column 0 or 64 of B's 128-column scale blocks (776: the last tile
    # 8 wide, its second scale block past N)
    GemmPlan(block_k=128, block_n=192, stages=4, cluster=2, max_ctas=6),
    GemmPlan(block_m=64, block_n=192, block_k=128, consumers=1, stages=5, max_ctas=7),
]


@pytest.mark.parametrize("plan", PLANS, ids=[p.describe().replace(" ", "_") for p in PLANS])
@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_plans(plan, scale):
    if scale == "block" and (plan.block_n not in FP8_BLOCK_SCALE_WIDTHS or plan.pingpong):
        with pytest.raises(GemmArgumentError,
                           match="pingpong" if plan.block_n in FP8_BLOCK_SCALE_WIDTHS else "block_n in"):
            run_case(136, 136, 256, scale=scale, plan=plan)
        return
    run_case(1000, 776, 1040, scale=scale, plan=plan, seed=3)


def test_large_once():
    run_case(4096, 7168, 8192, scale="tensor", seed=4)
    run_case(4096, 7168, 8192, scale="block", seed=5)


def test_heuristic_plans_run():
    for m, n, k in ((64, 4096, 4096), (8192, 1280, 8192), (4096, 14336, 4096)):
        for scale in ("tensor", "block"):
            plan = fp8_heuristic_plan(m, n, k, scale=scale)
            assert plan.block_k == 128
            run_case(m, n, k, scale=scale, plan=plan, seed=6)


def test_scales_are_read_at_run_time_and_launches_reused():
    """The cached launch of a repeated call reads the scales' current values (graph replays see updates)."""
    rng = np.random.default_rng(7)
    a8, b8 = rand_fp8(rng, (256, 256), "e4m3"), rand_fp8(rng, (384, 256), "e4m3")
    da, db = cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8))
    sa, sb = cupy.ones((1,), cupy.float32), cupy.ones((1,), cupy.float32)
    out = poisoned((256, 384), "bfloat16")
    gemm(da, db, out, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    first = cupy.asnumpy(out).astype(np.float64)
    sa.fill(0.5)
    sb.fill(4.0)
    gemm(da, db, out, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    cupy.cuda.Device().synchronize()
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float64), 2.0 * first, rtol=1e-2)
    assert rel_err(out, 2.0 * (a8.astype(np.float64) @ b8.astype(np.float64).T)) < TOL["bfloat16"]


def test_stream_and_default_out():
    s = cupy.cuda.Stream(non_blocking=True)
    run_case(300, 520, 400, scale="block", stream=s, seed=8)
    rng = np.random.default_rng(9)
    a8, b8 = rand_fp8(rng, (200, 160), "e5m2"), rand_fp8(rng, (72, 160), "e5m2")
    out = gemm(cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8)), trans_b=True, fp8_format="e5m2",
               out_dtype="float16")
    cupy.cuda.Device().synchronize()
    assert out.dtype == np.float16 and out.shape == (200, 72)
    assert rel_err(out, a8.astype(np.float64) @ b8.astype(np.float64).T) < TOL["float16"]


def test_b_kxn_is_refused_with_the_layout_named():
    a = cupy.zeros((128, 256), cupy.uint8)
    b = cupy.zeros((256, 128), cupy.uint8)
    with pytest.raises(GemmArgumentError, match=r"\[N, K\] with trans_b=True"):
        gemm(a, b, trans_b=False, fp8_format="e4m3")
    with pytest.raises(GemmTypeError, match="uint8"):
        gemm(a.astype(cupy.float16), b, trans_b=True, fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="fp8_format"):
        gemm(a, b.T.copy(), trans_b=True, scale_a=cupy.ones(1, cupy.float32), scale_b=cupy.ones(1, cupy.float32))


def test_autotune_fp8(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("FLUXRT_GEMM_TUNE_DIR", str(tmp_path))
    at = sys.modules["fluxrt.gemm.autotune"]   # (fluxrt.gemm.autotune the attribute is the function)
    monkeypatch.setattr(at, "_paths", {})
    monkeypatch.setattr(at, "_tables", {})
    rng = np.random.default_rng(10)
    a8, b8 = rand_fp8(rng, (512, 1024), "e4m3"), rand_fp8(rng, (768, 1024), "e4m3")
    da, db = cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8))
    sa, sb = make_scales(rng, "block", 512, 768, 1024)
    dsa, dsb = cupy.asarray(sa), cupy.asarray(sb)
    plans = [GemmPlan(block_k=128, block_n=128, stages=6), GemmPlan(block_k=128, block_n=64, stages=6)]
    res = autotune(da, db, trans_b=True, fp8_format="e4m3", scale_a=dsa, scale_b=dsb, plans=plans)
    assert res.plan in plans and res.us > 0
    again = autotune(da, db, trans_b=True, fp8_format="e4m3", scale_a=dsa, scale_b=dsb)
    assert again.cached and again.plan == res.plan
    from fluxrt.gemm.checks import validate_fp8_args
    from fluxrt.gemm.fp8 import plan_fp8

    prob = validate_fp8_args(da, db, trans_b=True, fp8_format="e4m3", scale_a=dsa, scale_b=dsb)
    assert plan_fp8(prob, 0) == res.plan
    out = gemm(da, db, trans_b=True, fp8_format="e4m3", scale_a=dsa, scale_b=dsb)
    cupy.cuda.Device().synchronize()
    assert rel_err(out, reference(a8, b8, "block", sa, sb)) < TOL["bfloat16"]


# Short K (3 K blocks) over many tiles per CTA: each consumer's ring positions skip the other's blocks across
# the ring's wrap, on every stage count; an odd number of tiles per CTA leaves consumer 1 one tile fewer.
@pytest.mark.parametrize("plan", [GemmPlan(block_k=128, block_n=128, stages=s, pingpong=True, max_ctas=c)
                                  for s, c in ((2, 3), (4, 5), (5, 2))] +
                         [GemmPlan(block_k=128, block_n=128, stages=6, c_staging="shared", pingpong=True, max_ctas=4),
                          GemmPlan(block_k=128, block_n=128, stages=5, cluster=2, pingpong=True, max_ctas=6)],
                         ids=lambda p: p.describe().replace(" ", "_") + f"_ctas{p.max_ctas}")
def test_pingpong_short_k_many_tiles_per_cta(plan):
    run_case(1400, 1160, 320, scale="tensor", plan=plan, seed=12)


# Small cases for compute-sanitizer (memcheck, racecheck): one per new kernel configuration.
@pytest.mark.parametrize("scale", ["none", "tensor", "block", "block-192", "tensor-pingpong", "tensor-pingpong-fitted"])
def test_sanitize_small(scale):
    if scale == "block-192":   # 3 x 3 tiles on 2 CTAs: scale splits at 128, 64, 128; the last tile's second block
        run_case(300, 400, 384, scale="block", seed=11,   # past N
                 plan=GemmPlan(block_k=128, block_n=192, stages=2, max_ctas=2))
        return
    if scale == "tensor-pingpong-fitted":   # 176 wide: 3 x 3 tiles on 2 CTAs, a 48-wide last column, K of 3
        # blocks on 2 stages
        run_case(300, 400, 384, scale="tensor", seed=11, plan=GemmPlan(block_k=128, block_n=176, stages=2,
                                                                       c_staging="shared", pingpong=True, max_ctas=2))
        return
    if scale == "tensor-pingpong":   # 3 x 2 tiles on one cluster pair: a phantom M tile, two items per consumer
        run_case(300, 192, 400, scale="tensor", seed=11, plan=GemmPlan(block_k=128, block_n=128, stages=2,
                                                                       cluster=2, pingpong=True, max_ctas=2))
        return
    run_case(200, 192, 272, scale=scale, plan=dataclasses.replace(
        fp8_heuristic_plan(200, 192, 272, scale=scale), max_ctas=2), seed=11)
