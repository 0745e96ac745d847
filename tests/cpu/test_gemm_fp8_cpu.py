"""fp8 GEMM without a GPU: argument checks (layout, dtypes, scale shapes), plans, cache keys, kernel macros,
and sm_90a compiles of the fp8 configurations (spill-free where cuobjdump is available)."""
from __future__ import annotations

import numpy as np
import pytest

from fluxrt.gemm import (Fp8Problem, GemmArgumentError, GemmTypeError, compile_options, fp8_heuristic_plan,
                         fp8_plans, gemm, kernel_defines, validate_fp8_args)
from fluxrt.gemm.autotune import problem_key
from fluxrt.gemm.plan import FP8_BLOCK_K, GemmPlan, heuristic_plan

from test_gemm_cpu import BF16, _cubin_u32, _nvrtc_available, arr

U8 = np.uint8
F32 = np.float32


def fp8_args(m=256, n=384, k=512, *, scale="tensor", out=None):
    a, b = arr((m, k), U8, ptr=1 << 32), arr((n, k), U8, ptr=1 << 33)
    if scale == "tensor":
        sa, sb = arr((1,), F32, ptr=1 << 34), arr((), F32, ptr=1 << 35)
    elif scale == "block":
        sa, sb = arr((m, -(-k // 128)), F32, ptr=1 << 34), arr((-(-n // 128), -(-k // 128)), F32, ptr=1 << 35)
    else:
        sa = sb = None
    return a, b, sa, sb


@pytest.mark.parametrize("scale", ["none", "tensor", "block"])
def test_scale_mode_follows_from_shapes(scale):
    a, b, sa, sb = fp8_args(1000, 520, 1008, scale=scale)
    p = validate_fp8_args(a, b, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    assert p == Fp8Problem(1000, 520, 1008, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", scale)
    assert p.k_blocks == 8


def test_formats_and_output_types():
    a, b, sa, sb = fp8_args()
    p = validate_fp8_args(a, b, trans_b=True, fp8_format=("e4m3", "e5m2"), scale_a=sa, scale_b=sb,
                          out_dtype="float16")
    assert (p.a_dtype, p.b_dtype, p.out_dtype) == ("float8_e4m3fn", "float8_e5m2", "float16")
    assert p.key_dtype == "float8_e4m3fnxfloat8_e5m2/tensor"
    out = arr((256, 384), np.float16, ptr=1 << 36)
    assert validate_fp8_args(a, b, out, fp8_format="e5m2", scale_a=sa, scale_b=sb).out_dtype == "float16"
    with pytest.raises(GemmTypeError, match="fp8_format"):
        validate_fp8_args(a, b, fp8_format="e4m3fn")
    with pytest.raises(GemmTypeError, match="fp8 GEMM output float32"):
        validate_fp8_args(a, b, fp8_format="e4m3", out_dtype="float32")
    with pytest.raises(GemmTypeError, match="bfloat16, float16"):
        validate_fp8_args(a, b, arr((256, 384), np.float32, ptr=1 << 36), fp8_format="e4m3")


def test_b_kxn_is_refused_naming_the_layout():
    a, _, sa, sb = fp8_args()
    b_kn = arr((512, 384), U8, ptr=1 << 33)
    with pytest.raises(GemmArgumentError, match=r"B as \[N, K\] with trans_b=True"):
        validate_fp8_args(a, b_kn, trans_b=False, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    with pytest.raises(GemmArgumentError, match=r"B as \[N, K\] with trans_b=True"):
        gemm(a, b_kn, trans_b=False, fp8_format="e4m3", scale_a=sa, scale_b=sb)


def test_operand_checks():
    a, b, sa, sb = fp8_args()
    with pytest.raises(GemmTypeError, match="uint8 bytes"):
        validate_fp8_args(arr((256, 512), BF16), b, fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="multiple of 16"):   # 16-byte rows: K % 16
        validate_fp8_args(arr((256, 520), U8), arr((384, 520), U8), fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="inner dimensions"):
        validate_fp8_args(a, arr((384, 256), U8), fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="C-contiguous"):
        validate_fp8_args(arr((256, 512), U8, strides=(1024, 1)), b, fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="out has shape"):
        validate_fp8_args(a, b, arr((256, 256), BF16), fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="output rows"):   # bf16 rows of N=4 are 8 bytes
        validate_fp8_args(arr((256, 512), U8), arr((4, 512), U8), fp8_format="e4m3")
    with pytest.raises(GemmArgumentError, match="out aliases A"):   # as the 16-bit GEMM: no in-place
        validate_fp8_args(a, b, arr((256, 384), BF16, ptr=1 << 32), fp8_format="e4m3")


def test_scale_checks():
    a, b, sa, sb = fp8_args(scale="block")
    with pytest.raises(GemmArgumentError, match="both scale_a and scale_b"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa)
    with pytest.raises(GemmArgumentError, match="both be per tensor"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa, scale_b=arr((1,), F32))
    with pytest.raises(GemmArgumentError, match=r"\(256, 4\)"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=arr((256, 3), F32), scale_b=sb)
    with pytest.raises(GemmArgumentError, match=r"\(3, 4\)"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa, scale_b=arr((4, 4), F32))
    with pytest.raises(GemmTypeError, match="float32"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=arr((256, 4), np.float16), scale_b=sb)
    with pytest.raises(GemmArgumentError, match="one element"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=arr((2,), F32), scale_b=arr((1,), F32))
    with pytest.raises(GemmArgumentError, match="C-contiguous"):
        validate_fp8_args(a, b, fp8_format="e4m3", scale_a=arr((256, 4), F32, strides=(4, 1024)), scale_b=sb)
    with pytest.raises(GemmArgumentError, match="fp8_format"):   # scales without fp8
        gemm(arr((256, 512), BF16), arr((384, 512), BF16), trans_b=True, scale_a=sa, scale_b=sb)


def test_fp8_plans():
    for scale in ("none", "tensor", "block"):
        plans = fp8_plans(4096, scale)
        assert plans and all(p.block_k == FP8_BLOCK_K and p.split_k == 1 for p in plans)
        # the same 128-byte rows as 16-bit plans: the same shared memory
        assert all(p.smem_bytes() == GemmPlan(**{**p.__dict__, "block_k": 64}).smem_bytes() for p in plans)
    assert {p.block_n for p in fp8_plans(4096, "block")} == {64, 128, 192}
    big = fp8_heuristic_plan(8192, 8192, 8192, scale="none")
    assert (big.block_m, big.block_k, big.pingpong) == (128, 128, True)
    assert fp8_heuristic_plan(8192, 8192, 8192, scale="block").block_n == 192   # two scale blocks per tile
    # an fp8 K block holds twice the elements: the 16-bit model at K/2
    hp = heuristic_plan(512, 4096, 4096)
    fp = fp8_heuristic_plan(512, 4096, 8192)   # 128 tiles of 128 x 128: less than a wave, the cooperative model
    assert (fp.block_m, fp.block_n, fp.cluster) == (hp.block_m, hp.block_n, hp.cluster)
    with pytest.raises(ValueError, match="block_k"):
        GemmPlan(block_k=32).validate()


def test_cache_keys_name_fp8_types_and_mode():
    a, b, sa, sb = fp8_args(scale="block")
    p = validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    assert problem_key(p.m, p.n, p.k, p.key_dtype, p.out_dtype, True) == \
        "256x384x512:float8_e4m3fn/block:bfloat16:NK"


def test_kernel_defines():
    plan = fp8_heuristic_plan(4096, 4096, 4096)
    d = dict(kernel_defines(plan, "float8_e4m3fn", "bfloat16", True, b_dtype="float8_e5m2", scale="block"))
    assert (d["FLUXRT_GEMM_IN"], d["FLUXRT_GEMM_IN_B"], d["FLUXRT_GEMM_SCALE"], d["FLUXRT_GEMM_B_KMAJOR"]) == \
        ("2", "3", "2", "1")
    # 16-bit configurations keep their macros (and compile cache keys)
    d16 = dict(kernel_defines(plan, "bfloat16", "bfloat16", True))
    assert "FLUXRT_GEMM_IN_B" not in d16 and "FLUXRT_GEMM_SCALE" not in d16


FP8_COMPILE = [
    (fp8_heuristic_plan(8192, 8192, 8192), "float8_e4m3fn", None, "bfloat16", "tensor"),
    (fp8_heuristic_plan(8192, 8192, 8192), "float8_e5m2", "float8_e4m3fn", "float16", "none"),
    (fp8_heuristic_plan(8192, 8192, 8192, scale="block"), "float8_e4m3fn", None, "bfloat16", "block"),
    (GemmPlan(block_m=64, consumers=1, block_n=128, block_k=128, stages=6), "float8_e4m3fn", "float8_e5m2",
     "bfloat16", "block"),
    (GemmPlan(block_n=64, block_k=128, stages=6, cluster=2), "float8_e5m2", None, "float16", "block"),
    # 192-wide block-scaled tiles: B's scales of two 128-column blocks per tile
    (GemmPlan(block_n=192, block_k=128, stages=4), "float8_e4m3fn", None, "bfloat16", "block"),
    (GemmPlan(block_n=192, block_k=128, stages=4, cluster=2), "float8_e4m3fn", "float8_e5m2", "float16", "block"),
    (GemmPlan(block_k=128, stages=4, c_staging="shared", cluster=2), "float8_e4m3fn", None, "bfloat16", "tensor"),
    (GemmPlan(block_k=128, stages=4, epilogue="direct"), "float8_e4m3fn", None, "float16", "tensor"),
    (GemmPlan(block_n=128, block_k=128, stages=5, pingpong=True), "float8_e4m3fn", None, "bfloat16", "tensor"),
    (GemmPlan(block_n=192, block_k=128, stages=4, c_staging="shared", cluster=2, pingpong=True), "float8_e4m3fn",
     "float8_e5m2", "float16", "none"),
    # fitted widths (cuBLASLt's 128 x 176 ping-pong tile; the cooperative form too)
    (GemmPlan(block_n=176, block_k=128, stages=4, c_staging="shared", pingpong=True), "float8_e4m3fn", None,
     "bfloat16", "tensor"),
    (GemmPlan(block_n=144, block_k=128, stages=5, c_staging="shared", pingpong=True), "float8_e5m2", "float8_e4m3fn",
     "float16", "none"),
    (GemmPlan(block_n=240, block_k=128, stages=3), "float8_e4m3fn", None, "bfloat16", "tensor"),
]


@pytest.mark.parametrize("cfg", FP8_COMPILE, ids=lambda c: f"{c[0].describe().replace(' ', '_')}-{c[1]}-{c[2]}-"
                                                           f"{c[3]}-{c[4]}")
def test_fp8_kernel_compiles_sm90a(cfg, tmp_path, monkeypatch):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.gemm.params import PARAMS
    from fluxrt.toolchain import WGMMA_SERIALIZED, compile_cubin, compile_log

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan, a_dt, b_dt, out_dt, scale = cfg
    cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(
        kernel_defines(plan, a_dt, out_dt, True, b_dtype=b_dt, scale=scale), arch="sm_90a"))
    assert WGMMA_SERIALIZED not in compile_log(cubin), compile_log(cubin)   # a wait after every wgmma
    from test_gemm_cpu import _assert_no_spills

    _assert_no_spills(cubin)
    data = cubin.read_bytes()
    assert _cubin_u32(data, "fluxrt_gemm_smem_bytes") == plan.smem_bytes(out_dt)
    assert (_cubin_u32(data, "fluxrt_gemm_block_m"), _cubin_u32(data, "fluxrt_gemm_block_n")) == \
        (plan.block_m, plan.block_n)
    assert _cubin_u32(data, "fluxrt_gemm_block_k") == plan.block_k
    assert _cubin_u32(data, "fluxrt_gemm_params_bytes") == PARAMS.itemsize


def test_fp8_needs_b_kmajor_at_compile_time(tmp_path, monkeypatch):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.toolchain import compile_cubin

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan = fp8_heuristic_plan(4096, 4096, 4096)
    with pytest.raises(Exception, match="K-major"):
        compile_cubin("gemm/hopper_gemm.cu", compile_options(
            kernel_defines(plan, "float8_e4m3fn", "bfloat16", False, scale="tensor"), arch="sm_90a"))


def test_pingpong_plans_of_the_fp8_heuristic():
    """Block scales refuse a ping-pong plan before any launch and their heuristic never returns one; per tensor, the
    heuristic takes a ping-pong plan (cluster 1, shared staging) for a wave of 128 x 128 tiles or more with B's rows
    on whole 32-byte sectors, the width of least whole waves x width / FP8_PINGPONG_RATE, else a cooperative plan."""
    from fluxrt.gemm.fp8 import check_plan
    from fluxrt.gemm.plan import FP8_PINGPONG_RATE

    a, b, sa, sb = fp8_args(scale="block")
    prob = validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    with pytest.raises(GemmArgumentError, match="pingpong"):
        check_plan(GemmPlan(block_n=128, block_k=128, stages=5, pingpong=True), prob)
    for m, n, k in ((16384, 8192, 1024), (4096, 12288, 1536), (1024, 1024, 1024), (8192, 8192, 8192)):
        assert not fp8_heuristic_plan(m, n, k, scale="block").pingpong
    assert any(p.pingpong for p in fp8_plans(4096, "tensor")) and not any(p.pingpong for p in fp8_plans(4096, "block"))
    # 16384 x 8192 on 132 SMs: 128 tile rows x (64, 57, 52, 47, 43) columns of 128 / 144 / 160 / 176 / 192 make 63,
    # 56, 51, 46, 42 waves; x width: 8064, 8064, 8160, 8096, 8064; over the rates (144: 1.031, 176: 1.010) 144 least
    p = fp8_heuristic_plan(16384, 8192, 1024)
    assert p.pingpong and p.cluster == 1 and p.c_staging == "shared" and p.block_n == 144
    assert set(FP8_PINGPONG_RATE) == {q.block_n for q in fp8_plans(4096, "tensor") if q.pingpong}
    assert not fp8_heuristic_plan(1024, 1024, 1024).pingpong     # 64 tiles: less than a wave
    assert not fp8_heuristic_plan(4096, 8192, 3696).pingpong     # 3696-byte rows: off the sectors
    assert fp8_heuristic_plan(4096, 8192, 3712).pingpong         # 3712 = 116 x 32
    # one 64-row block (no ping-pong plans), or N narrower than a ping-pong tile: the cooperative model
    for m, n, k, sms in ((64, 32768, 4096, 132), (48, 16384, 4096, 100), (64, 8192, 4096, 60), (32768, 64, 4096, 132)):
        q = fp8_heuristic_plan(m, n, k, num_sms=sms)
        assert not q.pingpong and q.block_n <= max(64, n), (m, n, k, q.describe())


def test_fp8_fitted_widths_are_planned_and_checked():
    """fp8 plans include the fitted ping-pong tiles (not with block scales); fitted widths without an fp8 wgmma are
    refused before any launch."""
    from fluxrt.gemm.fp8 import check_plan
    from fluxrt.gemm.plan import FP8_FIT_WIDTHS, FP8_PINGPONG_FIT_TILES, fp8_plans

    widths = {p.block_n for p in fp8_plans(4096, "tensor") if p.fitted_n}
    assert widths == set(FP8_PINGPONG_FIT_TILES) and widths <= set(FP8_FIT_WIDTHS)
    assert all(p.pingpong and p.c_staging == "shared" for p in fp8_plans(4096, "tensor") if p.fitted_n)
    assert not any(p.fitted_n or p.pingpong for p in fp8_plans(4096, "block"))
    a, b, sa, sb = fp8_args(scale="tensor")
    prob = validate_fp8_args(a, b, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    check_plan(GemmPlan(block_n=176, block_k=128, stages=4, c_staging="shared", pingpong=True), prob)
    with pytest.raises(GemmArgumentError, match="fp8 fitted widths"):
        check_plan(GemmPlan(block_n=112, block_k=128, stages=5), prob)
