"""fp8 grouped GEMM (MoE experts with fp8 weights) on a GPU: every group against a float64 reference computed from
the dequantised inputs, for every scale mode (none, per tensor with one scale of B per group or one for all,
DeepSeek-style block scales), e4m3 / e5m2 and mixed, bf16 / fp16 out, M tails, empty groups, N and K tails (K
shorter than one 128-wide K block), rows outside every group left alone, and a CUDA-graph capture with offsets and
scales changed between replays.

Run on an H100/H200: python3 -m pytest tests/gpu/test_grouped_gemm_fp8.py -q
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.hopper   # skipped off Hopper, with the reason (conftest.py)

from fluxrt.gemm import GemmArgumentError, GemmTypeError, grouped_gemm  # noqa: E402
from fluxrt.gemm.grouped import grouped_plan  # noqa: E402
from fluxrt.gemm.plan import GemmPlan  # noqa: E402

from gemm_checks import BF16, NAN_BITS, TOL, poisoned, rand_fp8  # noqa: E402


def offsets_of(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def make_scales(rng, scale: str, m: int, n: int, k: int, g: int):
    """Host scales of a mode: 'tensor' (scale_b one per group), 'tensor1' (one scale_b for every group),
    'block'; magnitudes over decades, so that a wrong group's or block's scale shows."""
    if scale == "none":
        return None, None
    if scale == "tensor":
        return rng.uniform(0.5, 2.0, size=(1,)).astype(np.float32), \
            (rng.uniform(1.0, 2.0, size=(g,)) * 10.0 ** rng.integers(-2, 1, size=g)).astype(np.float32)
    if scale == "tensor1":
        return rng.uniform(0.5, 2.0, size=()).astype(np.float32), rng.uniform(0.5, 2.0, size=()).astype(np.float32)
    kbs, nbs = -(-k // 128), -(-n // 128)
    sa = rng.uniform(1.0, 2.0, size=(m, kbs)) * 10.0 ** rng.integers(-2, 1, size=(m, kbs))
    sb = rng.uniform(1.0, 2.0, size=(g, nbs, kbs)) * 10.0 ** rng.integers(-2, 1, size=(g, nbs, kbs))
    return sa.astype(np.float32), sb.astype(np.float32)


def reference_group(a8, b8, g: int, r0: int, r1: int, scale: str, sa, sb) -> np.ndarray:
    """float64 out[r0:r1] of group g: A's rows @ B[g].T, dequantised."""
    a = a8[r0:r1].astype(np.float64)
    b = b8[g].astype(np.float64)
    if scale == "none":
        return a @ b.T
    if scale in ("tensor", "tensor1"):
        sbg = sb.reshape(-1)[g] if sb.size > 1 else sb.reshape(-1)[0]
        return float(sa.reshape(-1)[0]) * float(sbg) * (a @ b.T)
    k, n = a.shape[1], b.shape[0]
    c = np.zeros((r1 - r0, n))
    for kb in range(-(-k // 128)):
        ks = slice(128 * kb, min(k, 128 * kb + 128))
        colscale = np.repeat(sb[g, :, kb].astype(np.float64), 128)[:n]
        c += (a[:, ks] @ b[:, ks].T) * sa[r0:r1, kb:kb + 1].astype(np.float64) * colscale[None, :]
    return c


def check_groups(out, a8, b8, offs, scale, sa, sb, out_dtype: str) -> None:
    """Every group's rows against the float64 reference (relative Frobenius error per group); rows past
    offsets[G] must still hold the poison."""
    c = cupy.asnumpy(out).astype(np.float64)
    for g in range(len(offs) - 1):
        r0, r1 = int(offs[g]), int(offs[g + 1])
        if r1 == r0:
            continue
        ref = reference_group(a8, b8, g, r0, r1, scale, sa, sb)
        got = c[r0:r1]
        assert not np.isnan(got).any(), f"group {g}: {np.isnan(got).sum()} elements never written"
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < TOL[out_dtype], f"group {g} rows [{r0}, {r1}) scale={scale}: relative error {err:.3g}"
    assert np.isnan(c[int(offs[-1]):]).all(), "rows outside every group were written"


def run_case(sizes, n, k, *, fmt="e4m3", scale="tensor", out_dtype="bfloat16", offsets_dtype="int32",
             extra_rows=0, plan=None, seed=0):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    offs = offsets_of(sizes)
    m = int(offs[-1]) + extra_rows
    fa, fb = (fmt, fmt) if isinstance(fmt, str) else fmt
    a8, b8 = rand_fp8(rng, (m, k), fa), rand_fp8(rng, (g, n, k), fb)
    sa, sb = make_scales(rng, scale, m, n, k, g)
    out = poisoned((m, n), out_dtype)
    dsa = cupy.asarray(sa) if sa is not None else None
    dsb = cupy.asarray(sb) if sb is not None else None
    res = grouped_gemm(cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8)),
                       cupy.asarray(offs.astype(offsets_dtype)), out, fp8_format=fmt, scale_a=dsa, scale_b=dsb,
                       plan=plan)
    assert res is out
    cupy.cuda.get_current_stream().synchronize()
    check_groups(out, a8, b8, offs, scale, sa, sb, out_dtype)


# tails of every kind: 1 row, 127, 128, 129, 300; empty groups first, between and last
UNEVEN = [0, 1, 127, 0, 128, 129, 0, 300, 5, 0]


@pytest.mark.parametrize("scale", ["none", "tensor", "tensor1", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_tails_and_empty_groups(fmt, scale):
    # N = 384 (3 tiles of 128, 1.5 of 256), K = 400: a K tail of 16 inside the last 128-wide K block
    run_case(UNEVEN, n=384, k=400, fmt=fmt, scale=scale)


@pytest.mark.parametrize("scale", ["none", "tensor", "block"])
def test_last_tiles_of_at_most_64_rows(scale):
    # last tiles with 1, 63, 64 rows (the second consumer's rows all past the group's end) and 65, 127; K = 1008
    # runs each tile over several rounds of the ring
    run_case([65, 64, 1, 0, 192, 193, 63, 127, 128, 320, 1, 64] * 2, n=384, k=1008, scale=scale, seed=5)


@pytest.mark.parametrize("scale", ["tensor", "block"])
@pytest.mark.parametrize("fmt", [("e4m3", "e5m2"), ("e5m2", "e4m3")], ids=["e4m3xe5m2", "e5m2xe4m3"])
def test_mixed_formats_fp16_out(fmt, scale):
    run_case([70, 0, 190, 3], n=256, k=256, fmt=fmt, scale=scale, out_dtype="float16", seed=1)


@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_k_shorter_than_one_block_and_n_tail(scale):
    # K = 80 < one 128-wide K block (zero-filled by TMA within the group's own B), N = 200: a partial N tile and a
    # partial 128-column scale block of B
    run_case([3, 200, 0, 64], n=200, k=80, scale=scale, seed=2)


@pytest.mark.parametrize("offsets_dtype", ["int32", "int64"])
def test_offsets_dtypes_and_rows_outside_groups(offsets_dtype):
    run_case([70, 0, 190], n=256, k=256, scale="block", offsets_dtype=offsets_dtype, extra_rows=77, seed=3)


@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_other_plans(scale):
    # one consumer (64-row tiles) and a 64-wide tile; 256-wide tiles with per-tensor scales
    run_case([5, 64, 65, 0, 200], n=256, k=256, scale=scale, seed=4,
             plan=GemmPlan(block_m=64, consumers=1, block_n=128, block_k=128, stages=6))
    run_case([131, 2, 0, 400], n=320, k=384, scale=scale, seed=5,
             plan=GemmPlan(block_n=64 if scale == "block" else 256, block_k=128, stages=3))
    # 192 wide: with block scales each tile spans two of B's 128-column scale blocks (N = 520: tiles at columns 0,
    # 192 and 384 of 5 blocks; N = 512: the tile at 384 starts a block and its second block is past N, clamped)
    for n in (520, 512):
        run_case([131, 2, 0, 400, 77], n=n, k=400, scale=scale, seed=6,
                 plan=GemmPlan(block_n=192, block_k=128, stages=4))
    # N within one scale block: grouped_plan's 128 x 128 plan
    run_case([131, 2, 0, 400], n=128, k=384, scale=scale, seed=7)


@pytest.mark.parametrize("scale", ["none", "tensor"])
def test_pingpong_plan(scale):
    # each consumer a whole tile, the group's scale of B read per tile; last tiles of 1, 64, 65 rows
    run_case([0, 1, 127, 0, 128, 129, 65, 64, 300], n=456, k=1008, scale=scale, seed=9,
             plan=GemmPlan(block_n=128, block_k=128, stages=5, c_staging="shared", pingpong=True))


def test_many_groups_skewed():
    rng = np.random.default_rng(7)
    sizes = (rng.zipf(1.6, size=256) - 1).clip(0, 700)   # G = 256, many empty, a few long
    sizes[:8] = 0
    run_case(list(sizes), n=256, k=384, scale="block", seed=6)
    run_case(list(sizes), n=256, k=384, scale="tensor", seed=8)


def test_no_rows_launches_nothing():
    a = cupy.empty((0, 128), dtype=cupy.uint8)
    b = cupy.zeros((3, 256, 128), dtype=cupy.uint8)
    out = grouped_gemm(a, b, cupy.zeros((4,), dtype=cupy.int32), fp8_format="e4m3",
                       scale_a=cupy.ones((0, 1), cupy.float32), scale_b=cupy.ones((3, 2, 1), cupy.float32))
    assert out.shape == (0, 256) and out.dtype == BF16


def test_graph_capture_reads_offsets_and_scales_on_device():
    """Captured once with out= given, replayed with other offsets and scales written into the same device
    arrays: the replay computes the new groups with the new scales (the host never read either)."""
    rng = np.random.default_rng(11)
    g, n, k, m = 8, 256, 256, 1024
    a8, b8 = rand_fp8(rng, (m, k), "e4m3"), rand_fp8(rng, (g, n, k), "e4m3")
    sa, sb = make_scales(rng, "block", m, n, k, g)
    da, db = cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8))
    dsa, dsb = cupy.asarray(sa), cupy.asarray(sb)
    offs_dev = cupy.asarray(offsets_of([128] * g).astype(np.int32))
    out = poisoned((m, n), "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    kw = dict(fp8_format="e4m3", scale_a=dsa, scale_b=dsb, stream=stream)
    with stream:
        grouped_gemm(da, db, offs_dev, out, **kw)   # first call builds the launch outside the capture
        stream.begin_capture()
        grouped_gemm(da, db, offs_dev, out, **kw)
        graph = stream.end_capture()
    for i, sizes in enumerate(([0, 500, 3, 0, 129, 128, 0, 264], [1024, 0, 0, 0, 0, 0, 0, 0], [0] * 7 + [1000])):
        offs = offsets_of(sizes)
        sa, sb = make_scales(np.random.default_rng(100 + i), "block", m, n, k, g)
        offs_dev.set(offs.astype(np.int32), stream=stream)
        dsa.set(sa, stream=stream)
        dsb.set(sb, stream=stream)
        out.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
        graph.launch(stream)
        stream.synchronize()
        check_groups(out, a8, b8, offs, "block", sa, sb, "bfloat16")


def test_bad_arguments_raise():
    a = cupy.zeros((64, 128), dtype=cupy.uint8)
    b = cupy.zeros((2, 256, 128), dtype=cupy.uint8)
    offs = cupy.zeros((3,), dtype=cupy.int32)
    sa, sb = cupy.ones((1,), cupy.float32), cupy.ones((2,), cupy.float32)
    with pytest.raises(GemmArgumentError, match="one per group"):
        grouped_gemm(a, b, offs, fp8_format="e4m3", scale_a=sa, scale_b=cupy.ones((3,), cupy.float32))
    with pytest.raises(GemmArgumentError, match=r"\[G, N, K\] \(trans_b=True\)"):
        grouped_gemm(a, b, offs, trans_b=False, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    with pytest.raises(GemmTypeError, match="uint8 bytes"):
        grouped_gemm(a.view(cupy.int8), b, offs, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    with pytest.raises(GemmArgumentError, match="block_n in"):
        grouped_gemm(a, b, offs, fp8_format="e4m3", scale_a=cupy.ones((64, 1), cupy.float32),
                     scale_b=cupy.ones((2, 2, 1), cupy.float32),
                     plan=dataclasses.replace(grouped_plan(64, 256, 128, 2, in_dtype="float8_e4m3fn"), block_n=256))


# Small case for compute-sanitizer (memcheck, racecheck): both scale variants of the grouped kernel, a group tail
# and an empty group; two CTAs sharing the tiles, or one CTA per tile. racecheck runs the second only: a CTA that
# stores a row-masked tile and then stages its next one hands the staging over through an mbarrier, which
# racecheck does not model (it reports the storer's reads against the consumers' next writes: NOTES).
@pytest.mark.parametrize("ctas", ["two_ctas", "one_tile_each"])
@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_sanitize_small(scale, ctas):
    groups, n, k = [100, 0, 200], 192, 272
    plan = grouped_plan(300, n, k, 3, in_dtype="float8_e4m3fn", scale=scale)
    tiles = sum(-(-g // plan.block_m) for g in groups) * -(-n // plan.block_n)
    plan = dataclasses.replace(plan, max_ctas=2 if ctas == "two_ctas" else tiles)
    run_case(groups, n=n, k=k, scale=scale, plan=plan, seed=12)
