"""Grouped GEMM without a GPU: argument checks, plan, the host mirror of the kernel's group table, and the
grouped kernel compiled for sm_90a (its layout constants against the planner's)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fluxrt.gemm import GemmArgumentError, GemmTypeError, compile_options, grouped_gemm, kernel_defines
from fluxrt.gemm.grouped import (check_grouped_plan, group_tiles, grouped_grid, grouped_max_stages, grouped_plan,
                                 validate_grouped_args)
from fluxrt.gemm.plan import MAX_GROUPS, SMEM_LIMIT_BYTES, GemmPlan

from test_gemm_cpu import _assert_uniform_descriptors, _cubin_u32, _nvrtc_available, arr


def args(m=300, k=128, n=256, g=4, trans_b=False, odt=np.int32, **kw):
    b = arr((g, n, k) if trans_b else (g, k, n))
    return dict(a=arr((m, k)), b=b, offsets=arr((g + 1,), odt), trans_b=trans_b, **kw)


def test_valid_args_describe_the_problem():
    p = validate_grouped_args(**args())
    assert (p.m, p.n, p.k, p.groups, p.in_dtype, p.out_dtype, p.offsets_dtype) == \
        (300, 256, 128, 4, "bfloat16", "bfloat16", "int32")
    p = validate_grouped_args(**args(trans_b=True, odt=np.int64, out_dtype="float32"))
    assert (p.n, p.k, p.out_dtype, p.offsets_dtype) == (256, 128, "float32", "int64")
    assert validate_grouped_args(**args(m=0)).m == 0   # a rank that received no tokens


@pytest.mark.parametrize("change, err, match", [
    (dict(a=arr((300, 64))), GemmArgumentError, "inner dimensions"),
    (dict(b=arr((4, 128))), GemmArgumentError, "3-D"),
    (dict(a=arr((300, 128), np.float16)), GemmTypeError, "same 16-bit type"),
    (dict(a=arr((300, 128), np.float32), b=arr((4, 128, 256), np.float32)), GemmTypeError, "supported"),
    (dict(offsets=arr((4,), np.int32)), GemmArgumentError, r"\[G \+ 1\]"),
    (dict(offsets=arr((5,), np.float32)), GemmTypeError, "int32, int64"),
    (dict(offsets=arr((5,), np.int32, strides=(8,))), GemmArgumentError, "contiguous"),
    (dict(offsets=arr((5,), np.int64, ptr=(1 << 32) + 4)), GemmArgumentError, "8-byte aligned"),
    (dict(b=arr((4, 128, 256), strides=(2 * 128 * 256 * 2, 256 * 2, 2))), GemmArgumentError, "C-contiguous"),
    (dict(b=arr((4, 128, 100)), out=None), GemmArgumentError, "multiples of 16"),
    (dict(out=arr((299, 256))), GemmArgumentError, r"expected \(M, N\)"),
    (dict(out=arr((300, 256), np.int8)), GemmTypeError, "supported"),
    (dict(out=arr((300, 256)), out_dtype="float32"), GemmTypeError, "out_dtype"),
])
def test_bad_arguments_raise_before_any_cuda_call(change, err, match):
    kw = args()
    kw.update(change)
    with pytest.raises(err, match=match):
        validate_grouped_args(**kw)


def test_group_count_limits():
    with pytest.raises(GemmArgumentError, match=f"1..{MAX_GROUPS}"):
        validate_grouped_args(**args(g=MAX_GROUPS + 1))
    with pytest.raises(GemmArgumentError, match=f"1..{MAX_GROUPS}"):
        validate_grouped_args(a=arr((8, 128)), b=arr((0, 128, 256)), offsets=arr((1,), np.int32))
    assert validate_grouped_args(**args(g=MAX_GROUPS)).groups == MAX_GROUPS


def test_grouped_gemm_checks_before_cupy():
    """Fake arrays never reach CuPy: the checks raise first (on machines without a GPU too)."""
    kw = args()
    kw["offsets"] = arr((3,), np.int32)
    with pytest.raises(GemmArgumentError):
        grouped_gemm(**kw)


def test_plans_fit_with_the_group_table():
    for out in ("bfloat16", "float16", "float32"):
        p = grouped_plan(8192, 2048, 7168, 64, out_dtype=out)
        check_grouped_plan(p, out)
        assert p.smem_bytes(out, grouped=True) <= SMEM_LIMIT_BYTES
        assert p.stages >= 3 and p.stages == min(grouped_max_stages(p, out), 6)
    assert grouped_plan(8192, 2048, 7168, 64).block_n == 256
    assert grouped_plan(8192, 128, 7168, 64).block_n == 128
    with pytest.raises(GemmArgumentError, match="cluster=1"):
        check_grouped_plan(GemmPlan(cluster=2), "bfloat16")
    with pytest.raises(GemmArgumentError, match="no stream_k"):   # the kernel has no grouped stream-K
        check_grouped_plan(GemmPlan(block_n=128, stages=4, stream_k=True), "bfloat16")
    with pytest.raises(GemmArgumentError, match="no fitted width"):   # the kernel static_asserts it
        check_grouped_plan(GemmPlan(block_n=160, stages=4), "bfloat16")
    check_grouped_plan(GemmPlan(block_n=128, stages=5, c_staging="shared", pingpong=True), "bfloat16")
    with pytest.raises(GemmArgumentError, match="no block scales"):
        check_grouped_plan(GemmPlan(block_n=128, block_k=128, stages=4, pingpong=True), "bfloat16", "float8_e4m3fn",
                           "block")
    with pytest.raises(GemmArgumentError, match="group table"):   # 4 shared-staging stages leave no room
        check_grouped_plan(GemmPlan(stages=4, c_staging="shared"), "bfloat16")


def test_grid_counts_every_possible_tile_row():
    p = GemmPlan()
    assert grouped_grid(p, 300, 256, 4, 132) == (3 + 4) * 1
    assert grouped_grid(p, 1 << 20, 7168, 64, 132) == 132


@pytest.mark.parametrize("seed", range(6))
def test_group_table_covers_every_row_once(seed):
    """The host mirror of the kernel's table: every row of every group in exactly one tile row of its own
    group, tiles never start outside their group, and offsets out of range or decreasing stay inside [0, M)."""
    rng = np.random.default_rng(seed)
    g = int(rng.integers(1, MAX_GROUPS + 1))
    sizes = rng.integers(0, 300, size=g) * (rng.random(g) < 0.7)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    m = int(offs[-1])
    tiles = group_tiles(offs, m, 128)
    covered = np.zeros(m, dtype=int)
    for grp, r0, end in tiles:
        assert offs[grp] <= r0 < end == offs[grp + 1]
        covered[r0:min(r0 + 128, end)] += 1
    assert (covered == 1).all()
    assert len(tiles) == sum(-(-int(s) // 128) for s in sizes)
    bad = rng.integers(-50, m + 50, size=g + 1)   # garbage offsets: rows stay in [0, M)
    for grp, r0, end in group_tiles(bad, m, 128):
        assert 0 <= r0 < end <= m


def test_group_arrival_is_checked_before_any_cuda_call():
    from fluxrt.gemm import GroupArrival
    from fluxrt.gemm.grouped import check_group_arrival

    good = GroupArrival(flags=4096, epoch_at=8192, sources=2, err=1 << 20)
    check_group_arrival(good, 4)
    check_group_arrival(None, 4)
    for bad, match in ((dict(flags=0), "arrival.flags"), (dict(epoch_at=4099), "arrival.epoch_at"),
                       (dict(sources=0), "arrival.sources"), (dict(timeout_ns=0), "timeout_ns")):
        with pytest.raises(GemmArgumentError, match=match):
            check_group_arrival(dataclasses.replace(good, **bad), 4)
    with pytest.raises(GemmArgumentError, match="must be a fluxrt.gemm.GroupArrival"):
        check_group_arrival(object(), 4)
    plan = grouped_plan(8192, 2048, 7168, 64)
    assert dict(kernel_defines(plan, "bfloat16", "bfloat16", True, hook_wait=True,
                               grouped=True))["FLUXRT_GEMM_HOOK_WAIT"] == "1"


def test_group_scatter_is_checked_before_any_cuda_call():
    from fluxrt.gemm import GroupScatter
    from fluxrt.gemm.grouped import check_group_scatter

    prob = validate_grouped_args(**args(n=384))   # N = 384 bf16
    good = GroupScatter(rows=4096, dsts=8192, flags=1 << 20, homes=4, ld=384, entries=1000)
    check_group_scatter(good, prob)
    check_group_scatter(None, prob)
    for bad, match in ((dict(rows=0), "scatter.rows"), (dict(rows=4098), "scatter.rows"),
                       (dict(dsts=8196), "scatter.dsts"), (dict(flags=-8), "scatter.flags"),
                       (dict(homes=0), "scatter.homes"), (dict(homes=33), "scatter.homes"),
                       (dict(ld=376), "scatter.ld"), (dict(ld=388), "16-byte rows"),
                       (dict(entries=-1), "scatter.entries")):
        with pytest.raises(GemmArgumentError, match=match):
            check_group_scatter(dataclasses.replace(good, **bad), prob)
    with pytest.raises(GemmArgumentError, match="must be a fluxrt.gemm.GroupScatter"):
        check_group_scatter(object(), prob)
    with pytest.raises(GemmArgumentError, match="16-bit inputs only"):
        check_group_scatter(good, validate_grouped_args(**fp8_args()))
    plan = grouped_plan(8192, 7168, 2048, 64)
    defines = dict(kernel_defines(plan, "bfloat16", "bfloat16", True, hook_epilogue=True, grouped=True))
    assert defines["FLUXRT_GEMM_HOOK_EPILOGUE"] == "1" and defines["FLUXRT_GEMM_GROUPED"] == "1"


def test_kernel_defines_grouped_only_when_on():
    plan = grouped_plan(8192, 2048, 7168, 64)
    assert dict(kernel_defines(plan, "bfloat16", "bfloat16", True, grouped=True))["FLUXRT_GEMM_GROUPED"] == "1"
    assert "FLUXRT_GEMM_GROUPED" not in dict(kernel_defines(plan, "bfloat16", "bfloat16", True))


GROUPED_CONFIGS = [
    (grouped_plan(8192, 2048, 7168, 64), "bfloat16", "bfloat16", False),
    (grouped_plan(8192, 2048, 7168, 64), "bfloat16", "bfloat16", True),
    (grouped_plan(8192, 2048, 7168, 64, in_dtype="float16", out_dtype="float16"), "float16", "float16", True),
    (grouped_plan(8192, 2048, 7168, 64, out_dtype="float32"), "bfloat16", "float32", False),
    (GemmPlan(block_n=128, stages=4), "bfloat16", "bfloat16", False),
    (GemmPlan(block_m=64, consumers=1, stages=4), "bfloat16", "bfloat16", False),
    (GemmPlan(block_n=128, stages=5, c_staging="shared", pingpong=True), "bfloat16", "bfloat16", True),
    (GemmPlan(block_n=128, stages=4, pingpong=True), "float16", "float16", False),
    (GemmPlan(block_n=192, stages=3, c_staging="shared", pingpong=True), "bfloat16", "float32", True),
]


GROUPED_CONFIGS += [   # hook 1 per group (GroupArrival: the MoE layer's overlapped gate/up GEMM)
    (grouped_plan(8192, 4096, 7168, 64), "bfloat16", "bfloat16", True, "arrival"),
    (GemmPlan(block_n=128, stages=4, max_ctas=100), "float16", "float16", True, "arrival"),
]
GROUPED_CONFIGS += [   # hook 2 per row (GroupScatter: the MoE layer's overlapped down GEMM)
    (grouped_plan(8192, 7168, 2048, 64), "bfloat16", "bfloat16", True, "scatter"),
    (GemmPlan(block_n=128, stages=4, c_staging="shared", max_ctas=100), "float16", "float16", True, "scatter"),
]


@pytest.mark.parametrize("cfg", GROUPED_CONFIGS, ids=lambda c: f"{c[0].describe()}-{c[1]}-{c[2]}-tb{int(c[3])}"
                         f"{'-' + c[4] if len(c) > 4 else ''}".replace(" ", "_"))
def test_grouped_kernel_compiles_sm90a(cfg, tmp_path, monkeypatch):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.gemm.params import PARAMS
    from fluxrt.toolchain import WGMMA_SERIALIZED, compile_cubin, compile_log

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan, in_dt, out_dt, tb = cfg[:4]
    hook = cfg[4] if len(cfg) > 4 else ""
    defines = kernel_defines(plan, in_dt, out_dt, tb, hook_wait=hook == "arrival", hook_epilogue=hook == "scatter",
                             grouped=True)
    cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(defines, arch="sm_90a"))
    assert WGMMA_SERIALIZED not in compile_log(cubin), compile_log(cubin)   # a wait after every wgmma
    data = cubin.read_bytes()
    assert _cubin_u32(data, "fluxrt_gemm_smem_bytes") == plan.smem_bytes(out_dt, grouped=True)
    assert _cubin_u32(data, "fluxrt_gemm_threads") == plan.threads
    assert _cubin_u32(data, "fluxrt_gemm_params_bytes") == PARAMS.itemsize
    _assert_uniform_descriptors(cubin)


# --- fp8 ------------------------------------------------------------------------------------------------------

U8, F32 = np.uint8, np.float32


def fp8_args(m=300, k=400, n=384, g=4, scale="tensor", **kw):
    kbs, nbs = -(-k // 128), -(-n // 128)
    scales = {"none": (None, None), "tensor": (arr((1,), F32, ptr=1 << 34), arr((g,), F32, ptr=1 << 35)),
              "tensor1": (arr((), F32, ptr=1 << 34), arr((), F32, ptr=1 << 35)),
              "block": (arr((m, kbs), F32, ptr=1 << 34), arr((g, nbs, kbs), F32, ptr=1 << 35))}[scale]
    out = dict(a=arr((m, k), U8, ptr=1 << 32), b=arr((g, n, k), U8, ptr=1 << 33), offsets=arr((g + 1,), np.int32),
               fp8_format="e4m3", scale_a=scales[0], scale_b=scales[1])
    out.update(kw)
    return out


@pytest.mark.parametrize("scale, mode, stride", [("none", "none", 0), ("tensor", "tensor", 1), ("tensor1", "tensor", 0),
                                                 ("block", "block", 3 * 4)])
def test_fp8_args_describe_the_problem(scale, mode, stride):
    p = validate_grouped_args(**fp8_args(scale=scale))
    assert (p.m, p.n, p.k, p.groups, p.in_dtype, p.b_dtype, p.out_dtype) == \
        (300, 384, 400, 4, "float8_e4m3fn", "", "bfloat16")
    assert (p.scale, p.b_scale_stride, p.fp8, p.k_blocks) == (mode, stride, True, 4)
    p = validate_grouped_args(**fp8_args(fp8_format=("e5m2", "e4m3"), out_dtype="float16", trans_b=True))
    assert (p.in_dtype, p.b_dtype, p.out_dtype) == ("float8_e5m2", "float8_e4m3fn", "float16")
    assert validate_grouped_args(**fp8_args(m=0, scale="block")).m == 0
    # a 16-bit call is unchanged: trans_b defaults to False, no scales
    p16 = validate_grouped_args(**args())
    assert (p16.fp8, p16.scale, p16.b_dtype) == (False, "none", "")


@pytest.mark.parametrize("change, err, match", [
    (dict(a=arr((300, 400))), GemmTypeError, "uint8 bytes"),
    (dict(b=arr((4, 384, 400), np.int8)), GemmTypeError, "uint8 bytes"),
    (dict(trans_b=False), GemmArgumentError, r"\[G, N, K\] \(trans_b=True\)"),
    (dict(fp8_format="e4m3fn"), GemmTypeError, "fp8_format"),
    (dict(a=arr((300, 392), U8), b=arr((4, 384, 392), U8)), GemmArgumentError, "multiple of 16"),
    (dict(b=arr((4, 384, 384), U8)), GemmArgumentError, "inner dimensions"),
    (dict(out_dtype="float32"), GemmTypeError, "fp8 grouped GEMM output float32"),
    (dict(out=arr((300, 384), F32)), GemmTypeError, "bfloat16, float16"),
    (dict(scale_b=None), GemmArgumentError, "both scale_a and scale_b"),
    (dict(scale_a=arr((2,), F32)), GemmArgumentError, "one element"),
    (dict(scale_b=arr((5,), F32)), GemmArgumentError, "one per group"),
    (dict(scale_b=arr((4, 3, 4), F32)), GemmArgumentError, "both be per tensor"),
    (dict(scale_a=arr((1,), np.float16)), GemmTypeError, "float32"),
])
def test_fp8_bad_arguments_raise_before_any_cuda_call(change, err, match):
    kw = fp8_args()
    kw.update(change)
    with pytest.raises(err, match=match):
        validate_grouped_args(**kw)


@pytest.mark.parametrize("change, err, match", [
    (dict(scale_a=arr((300, 3), F32)), GemmArgumentError, r"\(300, 4\)"),
    (dict(scale_b=arr((4, 4), F32)), GemmArgumentError, "both be per tensor"),
    (dict(scale_b=arr((3, 3, 4), F32)), GemmArgumentError, r"\(4, 3, 4\)"),
    (dict(scale_b=arr((4, 3, 4), F32, strides=(48, 4, 12))), GemmArgumentError, "C-contiguous"),
])
def test_fp8_block_scale_checks(change, err, match):
    kw = fp8_args(scale="block")
    kw.update(change)
    with pytest.raises(err, match=match):
        validate_grouped_args(**kw)


def test_scales_need_fp8_and_checks_run_before_cupy():
    with pytest.raises(GemmArgumentError, match="fp8_format"):
        validate_grouped_args(**args(scale_a=arr((1,), F32), scale_b=arr((4,), F32)))
    kw = fp8_args()
    kw["scale_b"] = arr((3,), F32)
    with pytest.raises(GemmArgumentError, match="one per group"):
        grouped_gemm(**kw)


def test_fp8_plans():
    e4 = "float8_e4m3fn"
    for scale in ("none", "tensor"):
        p = grouped_plan(8192, 2048, 7168, 64, in_dtype=e4, scale=scale)
        assert (p.block_m, p.block_n, p.block_k) == (128, 256, 128)
        check_grouped_plan(p, "bfloat16", e4, scale)
    p = grouped_plan(8192, 2048, 7168, 64, in_dtype=e4, scale="block")
    assert (p.block_n, p.block_k) == (192, 128) and p.stages >= 3   # two of B's scale blocks per tile
    check_grouped_plan(p, "float16", e4, "block")
    narrow = grouped_plan(8192, 128, 7168, 64, in_dtype=e4, scale="block")   # N within one scale block
    assert narrow.block_n == 128
    check_grouped_plan(narrow, "bfloat16", e4, "block")
    # the same 128-byte stage rows as the 16-bit plan: the same stages fit
    assert grouped_plan(8192, 2048, 7168, 64).stages == grouped_plan(8192, 2048, 7168, 64, in_dtype=e4).stages
    with pytest.raises(GemmArgumentError, match="block_k=128"):
        check_grouped_plan(grouped_plan(8192, 2048, 7168, 64), "bfloat16", e4, "tensor")
    with pytest.raises(GemmArgumentError, match="block_n in"):
        check_grouped_plan(grouped_plan(8192, 2048, 7168, 64, in_dtype=e4), "bfloat16", e4, "block")
    with pytest.raises(GemmTypeError, match="output dtype"):
        grouped_plan(8192, 2048, 7168, 64, in_dtype=e4, out_dtype="float32")
    with pytest.raises(GemmArgumentError, match="fp8 inputs"):
        grouped_plan(8192, 2048, 7168, 64, scale="block")


def test_fp8_kernel_defines():
    plan = grouped_plan(8192, 2048, 7168, 64, in_dtype="float8_e4m3fn", scale="block")
    d = dict(kernel_defines(plan, "float8_e4m3fn", "bfloat16", True, grouped=True, b_dtype="float8_e5m2",
                            scale="block"))
    assert (d["FLUXRT_GEMM_GROUPED"], d["FLUXRT_GEMM_IN"], d["FLUXRT_GEMM_IN_B"], d["FLUXRT_GEMM_SCALE"],
            d["FLUXRT_GEMM_B_KMAJOR"]) == ("1", "2", "3", "2", "1")


FP8_GROUPED_CONFIGS = [
    (grouped_plan(8192, 2048, 7168, 64, in_dtype="float8_e4m3fn"), "float8_e4m3fn", None, "bfloat16", "tensor"),
    (grouped_plan(8192, 2048, 7168, 64, in_dtype="float8_e4m3fn", scale="block"), "float8_e4m3fn", "float8_e5m2",
     "float16", "block"),
    (GemmPlan(block_m=64, consumers=1, block_n=128, block_k=128, stages=6), "float8_e5m2", None, "bfloat16", "block"),
    (GemmPlan(block_n=64, block_k=128, stages=6), "float8_e4m3fn", None, "bfloat16", "block"),
    (GemmPlan(block_n=128, block_k=128, stages=5), "float8_e5m2", "float8_e4m3fn", "float16", "none"),
    (GemmPlan(block_n=128, block_k=128, stages=5, c_staging="shared", pingpong=True), "float8_e4m3fn", None,
     "bfloat16", "tensor"),
]


@pytest.mark.parametrize("cfg", FP8_GROUPED_CONFIGS, ids=lambda c: f"{c[0].describe()}-{c[1]}-{c[2]}-{c[3]}-{c[4]}"
                                                                     .replace(" ", "_"))
def test_fp8_grouped_kernel_compiles_sm90a(cfg, tmp_path, monkeypatch):
    """Every fp8 grouped configuration compiles for sm_90a with the planner's layout constants, and (where
    cuobjdump is found) keeps everything in registers: no local memory, no stack."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    import re
    import subprocess

    from fluxrt.gemm.params import PARAMS
    from fluxrt.toolchain import WGMMA_SERIALIZED, compile_cubin, compile_log

    from test_toolchain import _cuobjdump

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan, a_dt, b_dt, out_dt, scale = cfg
    check_grouped_plan(plan, out_dt, a_dt, scale)
    cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(
        kernel_defines(plan, a_dt, out_dt, True, grouped=True, b_dtype=b_dt, scale=scale), arch="sm_90a"))
    assert WGMMA_SERIALIZED not in compile_log(cubin), compile_log(cubin)   # a wait after every wgmma
    data = cubin.read_bytes()
    assert _cubin_u32(data, "fluxrt_gemm_smem_bytes") == plan.smem_bytes(out_dt, grouped=True)
    assert _cubin_u32(data, "fluxrt_gemm_block_k") == 128
    assert _cubin_u32(data, "fluxrt_gemm_params_bytes") == PARAMS.itemsize
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    stack, local = re.search(r"STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", res).groups()
    assert (stack, local) == ("0", "0"), res


def test_grouped_gemm_refuses_256_row_tiles():
    with pytest.raises(GemmArgumentError, match="64 or 128 rows"):
        check_grouped_plan(GemmPlan(block_m=256, block_n=128, stages=2), "bfloat16")
