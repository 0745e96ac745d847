"""fp8 GEMMs on Hopper: ``C = dequant(A) @ dequant(B).T`` with e4m3 / e5m2 inputs, fp32 accumulation and bf16 /
fp16 output, through the same kernel as the 16-bit GEMM (kernels/gemm: FLUXRT_GEMM_IN 2/3, m64nNk32 wgmma,
128-element K blocks, FLUXRT_GEMM_SCALE for the scales).

Operands: CuPy has no fp8 dtype, so A [M, K] and B [N, K] are uint8 arrays of fp8 bytes and ``fp8_format``
('e4m3', 'e5m2', or a pair for A and B) says how to read them (a torch fp8 tensor: ``t.view(torch.uint8)``).
B must be [N, K] (``trans_b=True``): wgmma reads 8-bit operands K-major only, the layout cuBLASLt calls "TN".
Scales are fp32 device arrays, read by the kernel (graph replays see their current values):

  none        C = A @ B.T
  tensor      scale_a, scale_b of one element: C = scale_a * scale_b * (A @ B.T), one multiply per output
  block       DeepSeek-V3 style: scale_a [M, ceil(K/128)] (1 x 128 per row), scale_b [ceil(N/128), ceil(K/128)]
              (128 x 128 of B); each 128-K block's product is summed in fresh registers and added into the fp32
              accumulators times scale_a[row, kb] * scale_b[col // 128, kb]

The mode follows from the scales' shapes (:func:`fluxrt.gemm.checks.validate_fp8_args`). Plans come from the
autotune cache (keyed by both fp8 types and the mode) or :func:`fluxrt.gemm.plan.fp8_heuristic_plan`.
"""
from __future__ import annotations

import logging

from ..arrays import as_array
from ..dtypes import normalize_dtype
from ..errors import GemmArgumentError, GemmTypeError
from ..packed_launch import PackedLaunch
from ..streams import as_cupy_stream, stream_handle
from .checks import Fp8Problem, _ptr, validate_fp8_args
from .launch_cache import MISS, LaunchCache, array_key
from .kernel import _kernel, _max_clusters, _num_sms, kernel_defines
from .params import gemm_params
from .plan import (FP8_BLOCK_K, FP8_BLOCK_SCALE_WIDTHS, FP8_FIT_WIDTHS, FP8_SCALE_BLOCK, ITEMSIZE, GemmPlan,
                   fp8_heuristic_plan)
from .tmaps import fitted_c_tiles_map, order_table, tensor_map

log = logging.getLogger("fluxrt.gemm")


def check_plan(plan: GemmPlan, prob: Fp8Problem) -> None:
    """A plan an fp8 call can run: 128-element K blocks, no split-K, block scales on tiles of
    FP8_BLOCK_SCALE_WIDTHS columns and no ping-pong with them."""
    plan.validate(prob.out_dtype)
    if plan.block_k != FP8_BLOCK_K:
        raise GemmArgumentError(f"gemm: an fp8 plan has block_k={FP8_BLOCK_K} (one 128-byte row), got {plan.block_k}"
                                " (fluxrt.gemm.plan.fp8_plans lists them)")
    if plan.split_k > 1 or plan.stream_k or plan.cluster_n > 1:
        raise GemmArgumentError(f"gemm: fp8 GEMMs have no split-K, stream-K or cluster_n=2 plans, got "
                                f"{plan.describe()}")
    if plan.fitted_n and plan.block_n not in FP8_FIT_WIDTHS:
        raise GemmArgumentError(f"gemm: fp8 fitted widths (block_n not a multiple of 64) are {FP8_FIT_WIDTHS}, got "
                                f"{plan.block_n}")
    if prob.scale == "block" and plan.block_n not in FP8_BLOCK_SCALE_WIDTHS:
        raise GemmArgumentError(f"gemm: block-scaled fp8 needs block_n in {FP8_BLOCK_SCALE_WIDTHS} (a tile inside one "
                                f"{FP8_SCALE_BLOCK}-column scale block or spanning two, and room for the promotion's "
                                f"registers), got {plan.block_n}")
    if prob.scale == "block" and plan.pingpong:
        raise GemmArgumentError("gemm: block-scaled fp8 has no pingpong plans (the promotion's second set of "
                                f"accumulators leaves no room for a whole tile per consumer), got {plan.describe()}")


def plan_fp8(prob: Fp8Problem, device_id: int | None = None, num_sms: int | None = None) -> GemmPlan:
    """The plan an fp8 call takes: the autotune cache's, else the heuristic's."""
    from .autotune import tuned_plan

    try:
        tuned = tuned_plan(prob.m, prob.n, prob.k, prob.key_dtype, prob.out_dtype, True, device_id)
    except Exception as e:   # no GPU to name the cache file
        log.debug("gemm tune cache not consulted: %s", e)
        tuned = None
    if tuned is not None:
        return tuned
    if num_sms is None and device_id is not None:
        num_sms = _num_sms(device_id)
    return fp8_heuristic_plan(prob.m, prob.n, prob.k, scale=prob.scale, out_dtype=prob.out_dtype,
                              **({"num_sms": num_sms} if num_sms else {}))


def _dev(x, name: str, writable: bool = False):
    return as_array(x, name=name, op="gemm", writable=writable, error=GemmArgumentError, type_error=GemmTypeError)


def load_kernel(plan: GemmPlan, prob: Fp8Problem, dev: int):
    """The fp8 GEMM kernel of `plan` for `prob` on device `dev`, compiled on first use (cached)."""
    import cupy

    defines = kernel_defines(plan, prob.a_dtype, prob.out_dtype, True, b_dtype=prob.b_dtype, scale=prob.scale)
    with cupy.cuda.Device(dev):
        return _kernel(defines, dev, plan.smem_bytes(prob.out_dtype))


def prepare(a, b, out, *, fp8_format, scale_a, scale_b, plan: GemmPlan | None, out_dtype: str | None):
    """Check one fp8 call and build its launch: returns (PackedLaunch, out, plan). Makes no launch."""
    import cupy

    prob = validate_fp8_args(a, b, out, trans_b=True, fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b,
                             out_dtype=out_dtype)
    a, b = _dev(a, "A"), _dev(b, "B")
    dev = a.device.id
    sa = _dev(scale_a, "scale_a") if scale_a is not None else None
    sb = _dev(scale_b, "scale_b") if scale_b is not None else None
    if out is not None:
        out = _dev(out, "out", writable=True)
    for name, x in (("B", b), ("out", out), ("scale_a", sa), ("scale_b", sb)):
        if x is not None and x.device.id != dev:
            raise GemmArgumentError(f"gemm: A is on device {dev} but {name} on device {x.device.id}")
    if plan is None:
        plan = plan_fp8(prob, dev)
    check_plan(plan, prob)
    m, n, k = prob.m, prob.n, prob.k
    if log.isEnabledFor(logging.INFO):
        log.info("gemm fp8 M=%d N=%d K=%d %s x %s -> %s scale=%s: %r", m, n, k, prob.a_dtype, prob.b_dtype,
                 prob.out_dtype, prob.scale, plan)
    with cupy.cuda.Device(dev):
        if out is None:
            out = cupy.empty((m, n), dtype=normalize_dtype(prob.out_dtype))
        smem = plan.smem_bytes(prob.out_dtype)
        kern = load_kernel(plan, prob, dev)
        mt, nt = plan.tiles(m, n)
        tmap_a = tensor_map(a.data.ptr, prob.a_dtype, m, k, plan.block_k, plan.block_m)
        tmap_b = tensor_map(b.data.ptr, prob.b_dtype, n, k, plan.block_k, plan.block_n // plan.cluster)
        c_cols = 128 // ITEMSIZE[prob.out_dtype]
        tmap_c = tensor_map(out.data.ptr, prob.out_dtype, m, n, c_cols, 64)
        c_direct = out.data.ptr if plan.epilogue == "direct" else 0
        table = order_table(plan, mt, nt, dev)
        grid = plan.grid(m, n, _num_sms(dev), _max_clusters(kern, plan, smem, dev))
        params = gemm_params(tmap_a=tmap_a, tmap_b=tmap_b, tmap_c=tmap_c, order_table=_ptr(table), c_direct=c_direct,
                             m=m, n=n, k=k, group_m=plan.group_m, m_tile_offset=plan.m_tile_offset % mt,
                             chunk_rows=0, chunks_per_peer=1)
        if plan.fitted_n and plan.epilogue == "tma":
            params["fit"]["tmap_c_tiles"] = fitted_c_tiles_map(out.data.ptr, prob.out_dtype, m, n, plan.block_n)
        s = params["scale"]
        s["a"], s["b"], s["k_blocks"] = _ptr(sa), _ptr(sb), prob.k_blocks
    return PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem), out, plan


_fast = LaunchCache(256)   # repeated calls (fluxrt.gemm.launch_cache), scales and formats in the key


def clear_launch_cache() -> None:
    _fast.clear()


def gemm_fp8(a, b, out=None, *, trans_b: bool = True, fp8_format="e4m3", scale_a=None, scale_b=None, stream=None,
             plan: GemmPlan | None = None, out_dtype: str | None = None):
    """The fp8 path of :func:`fluxrt.gemm.gemm` (see this module's docstring). Returns ``out``."""
    import cupy

    if not trans_b:   # the full message comes from the checks
        validate_fp8_args(a, b, out, trans_b=False, fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b,
                          out_dtype=out_dtype)
    try:
        sptr = stream_handle(stream)
    except TypeError as e:
        raise GemmTypeError(f"gemm: {e}") from e
    fmt = fp8_format if isinstance(fp8_format, str) else tuple(fp8_format)
    cupy_args = all(x is None or type(x) is cupy.ndarray for x in (a, b, out, scale_a, scale_b))
    key = None
    if cupy_args and out is not None:
        key = (array_key(a), array_key(b), array_key(out), array_key(scale_a), array_key(scale_b),
               cupy.cuda.runtime.getDevice(), fmt, plan, out_dtype, sptr)
        packed = _fast.get(key)
        if packed is not MISS:
            packed.launch(sptr)
            return out
    with as_cupy_stream(sptr):
        packed, out, _ = prepare(a, b, out, fp8_format=fmt, scale_a=scale_a, scale_b=scale_b, plan=plan,
                                 out_dtype=out_dtype)
    if key is not None:
        _fast.put(key, packed)
    packed.launch(sptr)
    return out
