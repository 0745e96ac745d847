"""Grouped GEMM for mixture-of-experts layers: G problems ``out[rows of g] = a[rows of g] @ b[g]`` in ONE
persistent launch of the Hopper GEMM (kernels/gemm/hopper_gemm.cu built with ``FLUXRT_GEMM_GROUPED``).

* ``a``       [M, K]: the tokens of every group one after another (sorted by expert), bf16 or fp16
* ``b``       [G, K, N] (``trans_b=False``) or [G, N, K] (``trans_b=True``): one weight matrix per group
* ``offsets`` [G + 1] int32 or int64 on the device: group g is rows ``offsets[g] .. offsets[g + 1]`` of ``a``
  and ``out`` (prefix sums, ``offsets[0] = 0``, ``offsets[G] = M``; groups may be empty)
* ``out``     [M, N]: bf16, fp16 or fp32

fp8 (``fp8_format`` 'e4m3', 'e5m2', or a pair for A and B, as :func:`fluxrt.gemm.gemm`): ``a`` [M, K] and ``b``
[G, N, K] are uint8 arrays of fp8 bytes (B only [G, N, K]: the tensor cores read 8-bit operands K-major), out
bf16 (default) or fp16, and fp32 scales on the device (read by the kernel: a graph replay sees their current
values) dequantise:

  none        out = a @ b[g].T
  tensor      scale_a of one element (shape () or (1,)); scale_b [G] (one per group) or of one element (the
              same for every group): out[rows of g] = scale_a * scale_b[g] * (a[rows of g] @ b[g].T)
  block       DeepSeek-V3 style: scale_a [M, ceil(K/128)] (1 x 128 per row of a), scale_b [G, ceil(N/128),
              ceil(K/128)] (128 x 128 of each group's weights): every 128-K block's product is added into the
              fp32 accumulators times scale_a[row, kb] * scale_b[g, col // 128, kb]

The mode follows from the scales' shapes (:func:`validate_grouped_args`).

The offsets are read by the kernel only, never by the host, so a call makes no host synchronisation and
can be captured in a CUDA graph (with ``out`` given it allocates nothing: the packed launch of a call on
the same arrays is reused). Each CTA builds a table of the groups' tile rows from the offsets in shared
memory and walks the grid of all groups' tiles; a tile that ends past its group's last row is stored
with row-masked stores, so no group writes another's rows. Rows of ``out`` outside every group are not
written. Offsets outside [0, M] are clamped and decreasing ones make empty groups: wrong offsets give
wrong rows, never accesses outside ``a``, ``b`` and ``out``.
"""
from __future__ import annotations

import dataclasses
import logging

from ..arrays import as_array
from ..dtypes import normalize_dtype
from ..errors import GemmArgumentError, GemmTypeError
from ..nvtx import annotate as _nvtx
from ..packed_launch import PackedLaunch
from ..streams import as_cupy_stream, stream_handle
from .checks import _check_matrix, _check_scale, _inspect, fp8_formats
from .launch_cache import MISS, LaunchCache, array_key
from .kernel import _kernel, _num_sms, kernel_defines
from .params import gemm_params
from .plan import (BLOCK_K, FP8_BLOCK_K, FP8_BLOCK_SCALE_WIDTHS, FP8_DTYPES, FP8_OUT_DTYPES, FP8_SCALE_BLOCK,
                   H100_H200_SMS, IN_DTYPES, ITEMSIZE, MAX_GROUPS, MAX_STAGES, OUT_DTYPES, SCALE_MODES,
                   SMEM_LIMIT_BYTES, TMA_ALIGN, GemmPlan)
from .hooks import GroupArrival, GroupScatter
from .tmaps import tensor_map, tensor_map_nd

log = logging.getLogger("fluxrt.gemm")

OFFSET_DTYPES = ("int32", "int64")
MAX_SCATTER_HOMES = 32   # GroupScatter: home ranks (fluxrt::kMaxWorld)


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
    """The checked shape of one grouped call."""

    m: int                # rows of a and out (all groups)
    n: int
    k: int
    groups: int
    in_dtype: str         # A's type (fp8: its ml_dtypes name)
    out_dtype: str
    offsets_dtype: str
    b_dtype: str = ""     # B's type when it differs from A's (fp8 only); "" = in_dtype
    scale: str = "none"   # fp8 dequantisation: none, tensor, block
    b_scale_stride: int = 0   # fp8: scale_b elements per group (tensor: 1, or 0 for one shared scale)

    @property
    def fp8(self) -> bool:
        return self.in_dtype in FP8_DTYPES

    @property
    def k_blocks(self) -> int:
        return -(-self.k // FP8_SCALE_BLOCK)


def grouped_plan(m: int, n: int, k: int, groups: int, *, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
                 num_sms: int = H100_H200_SMS, scale: str = "none") -> GemmPlan:
    """The plan of a grouped call (the host does not know the groups' sizes): 128 x 256 tiles, 128 x 128 when N
    is at most 128 or fp32 output leaves fewer than 3 stages beside the staging; the deepest ring that fits
    with the group table (at most 6 stages); bands of 16 tile rows (the tile rows of neighbouring groups
    share a wave, each group's B tiles are read by its rows' CTAs together). fp8 (in_dtype an fp8 type): the
    same with 128-element K blocks (the same 128-byte stage rows), and 128 x 192 tiles with block scales (the
    promotion's second accumulator set leaves room for 192 columns; 128 x 128 where N is at most 128)."""
    fp8 = in_dtype in FP8_DTYPES
    if in_dtype not in IN_DTYPES + FP8_DTYPES:
        raise GemmTypeError(f"grouped_gemm: unsupported input dtype {in_dtype!r} (expected one of "
                            f"{IN_DTYPES + FP8_DTYPES})")
    outs = FP8_OUT_DTYPES if fp8 else OUT_DTYPES
    if out_dtype not in outs:
        raise GemmTypeError(f"grouped_gemm: unsupported output dtype {out_dtype!r} (expected one of {outs})")
    if scale not in SCALE_MODES or (scale != "none" and not fp8):
        raise GemmArgumentError(f"grouped_gemm: scale mode {scale!r} needs fp8 inputs and one of {SCALE_MODES}")
    block_k = FP8_BLOCK_K if fp8 else BLOCK_K
    for bn in ((192, 128) if scale == "block" else (256, 128)):
        stages = grouped_max_stages(GemmPlan(block_n=bn), out_dtype)
        if (bn > 128 and n <= 128) or stages < 3:
            continue
        return GemmPlan(block_n=bn, block_k=block_k, stages=min(stages, 6), group_m=16)
    return GemmPlan(block_n=128, block_k=block_k, stages=min(grouped_max_stages(GemmPlan(block_n=128), out_dtype), 6),
                    group_m=16)


def grouped_max_stages(plan: GemmPlan, out_dtype: str) -> int:
    """Deepest ring of ``plan``'s tile that fits beside the C staging and the group table."""
    s = 0
    while s < MAX_STAGES and dataclasses.replace(plan, stages=s + 1).smem_bytes(out_dtype, grouped=True) \
            <= SMEM_LIMIT_BYTES:
        s += 1
    return s


def check_grouped_plan(plan: GemmPlan, out_dtype: str, in_dtype: str = "bfloat16", scale: str = "none") -> None:
    """Raise GemmArgumentError when the grouped kernel cannot run ``plan`` (fp8: in_dtype an fp8 type, scale the
    dequantisation mode)."""
    try:
        plan.validate(out_dtype)
    except ValueError as e:
        raise GemmArgumentError(f"grouped_gemm: {e}") from e
    if in_dtype in FP8_DTYPES and plan.block_k != FP8_BLOCK_K:
        raise GemmArgumentError(f"grouped_gemm: an fp8 plan has block_k={FP8_BLOCK_K} (one 128-byte row), got "
                                f"{plan.block_k} (grouped_plan(..., in_dtype=...) gives one)")
    if scale == "block" and plan.block_n not in FP8_BLOCK_SCALE_WIDTHS:
        raise GemmArgumentError(f"grouped_gemm: block-scaled fp8 needs block_n in {FP8_BLOCK_SCALE_WIDTHS} (a tile "
                                f"inside one {FP8_SCALE_BLOCK}-column scale block or spanning two, and room for the "
                                f"promotion's registers), got {plan.block_n}")
    if plan.cluster_ctas != 1 or plan.order != "grouped" or plan.epilogue != "tma" or plan.split_k != 1 \
            or plan.m_tile_offset != 0 or plan.stream_k or plan.fitted_n or plan.row_blocks > 1:
        raise GemmArgumentError(f"grouped_gemm: a grouped plan needs cluster=1, order='grouped', epilogue='tma', "
                                f"split_k=1, no stream_k, m_tile_offset=0, tiles of 64 or 128 rows and block_n one of "
                                f"64, 128, 192, 256 (no fitted width), got {plan.describe()} "
                                f"(m_tile_offset={plan.m_tile_offset})")
    if plan.pingpong and scale == "block":
        raise GemmArgumentError(f"grouped_gemm: ping-pong plans have no block scales, got {plan.describe()}")
    need = plan.smem_bytes(out_dtype, grouped=True)
    if need > SMEM_LIMIT_BYTES:
        raise GemmArgumentError(f"grouped_gemm: plan {plan.describe()} needs {need} B of shared memory with the "
                                f"group table, more than {SMEM_LIMIT_BYTES} B: use fewer stages")


def _check_fp8_bytes(info, fmt: str) -> None:
    if info.dtype in FP8_DTYPES:
        raise GemmTypeError(f"grouped_gemm: {info.name} has dtype {info.dtype}, which CuPy cannot hold; pass its "
                            "bytes as uint8 (torch: t.view(torch.uint8)) with fp8_format")
    if info.dtype != "uint8":
        raise GemmTypeError(f"grouped_gemm: an fp8 grouped GEMM reads {info.name} as uint8 bytes holding {fmt} "
                            f"values, got dtype {info.dtype}")


def _check_grouped_scales(scale_a, scale_b, m: int, n: int, k: int, g: int) -> tuple[str, int, set]:
    """The fp8 scales of a grouped call: returns (mode, scale_b elements per group, devices seen)."""
    if (scale_a is None) != (scale_b is None):
        raise GemmArgumentError("grouped_gemm: pass both scale_a and scale_b, or neither (unscaled fp8)")
    if scale_a is None:
        return "none", 0, set()
    sa, sb = _inspect(scale_a, "scale_a"), _inspect(scale_b, "scale_b")
    kbs, nbs = -(-k // FP8_SCALE_BLOCK), -(-n // FP8_SCALE_BLOCK)
    if sa.ndim <= 1 and sb.ndim <= 1:
        _check_scale(sa, (1,) * sa.ndim, "a per-tensor scale of A: one element")
        if sb.ndim == 0 or (sb.shape == (1,) and g > 1):
            _check_scale(sb, sb.shape, "one per-tensor scale of B for every group")
            mode, stride = "tensor", 0
        else:
            _check_scale(sb, (g,), "per-tensor scales of B: one per group, [G]")
            mode, stride = "tensor", 1
    elif sa.ndim == 2 and sb.ndim == 3:
        _check_scale(sa, (m, kbs), f"block scales of A: one per row and {FP8_SCALE_BLOCK} K, [M, ceil(K/128)]")
        _check_scale(sb, (g, nbs, kbs), f"block scales of B: one per {FP8_SCALE_BLOCK}x{FP8_SCALE_BLOCK} block of "
                                        "each group's weights, [G, ceil(N/128), ceil(K/128)]")
        mode, stride = "block", nbs * kbs
        if stride >= 1 << 31:
            raise GemmArgumentError(f"grouped_gemm: scale_b {sb.shape} has {stride} elements per group; at most 2^31 - 1")
    else:
        raise GemmArgumentError(f"grouped_gemm: scale_a {sa.shape} and scale_b {sb.shape} must both be per tensor "
                                "(scale_a one element, scale_b [G] or one element) or both block scales (scale_a "
                                "[M, ceil(K/128)], scale_b [G, ceil(N/128), ceil(K/128)])")
    return mode, stride, {i.device for i in (sa, sb) if i.device is not None}


def validate_grouped_args(a, b, offsets, out=None, *, trans_b: bool | None = None, out_dtype: str | None = None,
                          fp8_format=None, scale_a=None, scale_b=None) -> GroupedProblem:
    """Check the operands of :func:`grouped_gemm` without any CUDA call; raises GemmTypeError /
    GemmArgumentError naming the operand and shapes. trans_b None: False for 16-bit inputs, True for fp8
    (its only layout). fp8_format given: a and b are uint8 arrays of fp8 bytes, scales as the module says."""
    fp8 = fp8_format is not None
    if not fp8 and (scale_a is not None or scale_b is not None):
        raise GemmArgumentError("grouped_gemm: scale_a / scale_b are for fp8 inputs: pass fp8_format='e4m3' or "
                                "'e5m2' too")
    trans_b = fp8 if trans_b is None else bool(trans_b)
    ia, ib, io = _inspect(a, "A"), _inspect(b, "B"), _inspect(offsets, "offsets")
    if len(ia.shape) != 2:
        raise GemmArgumentError(f"grouped_gemm: A must be 2-D [M, K] (tokens of all groups), got shape {ia.shape}")
    if fp8:
        a_dt, b_dt = fp8_formats(fp8_format)
        if not trans_b:
            raise GemmArgumentError("grouped_gemm: fp8 weights must be [G, N, K] (trans_b=True): the tensor cores "
                                    "read 8-bit operands K-major only (as nn.Linear stores its weights)")
        _check_fp8_bytes(ia, a_dt)
        _check_fp8_bytes(ib, b_dt)
        ia_t = dataclasses.replace(ia, dtype=a_dt)
        allowed = (a_dt,)
    else:
        a_dt = b_dt = ia.dtype
        ia_t, allowed = ia, IN_DTYPES
    if ia.shape[0] > 0:
        _check_matrix(ia_t, allowed)
    elif ia_t.dtype not in allowed:
        raise GemmTypeError(f"grouped_gemm: A has dtype {ia.dtype}; supported: {', '.join(allowed)}")
    m, k = ia.shape
    if len(ib.shape) != 3:
        layout = "[G, N, K] (trans_b=True)" if trans_b else "[G, K, N] (trans_b=False)"
        raise GemmArgumentError(f"grouped_gemm: B must be 3-D {layout}, got shape {ib.shape}")
    if not fp8 and ib.dtype != ia.dtype:
        raise GemmTypeError(f"grouped_gemm: A is {ia.dtype} but B is {ib.dtype}; both must be the same 16-bit type")
    g = ib.shape[0]
    n, kb = (ib.shape[1], ib.shape[2]) if trans_b else (ib.shape[2], ib.shape[1])
    bdesc = f"B {ib.shape} ({'[G, N, K], trans_b=True' if trans_b else '[G, K, N], trans_b=False'})"
    if kb != k:
        raise GemmArgumentError(f"grouped_gemm: inner dimensions differ: A {ia.shape} is [M, K] with K={k}, {bdesc} "
                                f"has K={kb}")
    if not 1 <= g <= MAX_GROUPS:
        raise GemmArgumentError(f"grouped_gemm: {bdesc} has G={g} groups; supported 1..{MAX_GROUPS}")
    if n == 0 or k == 0:
        raise GemmArgumentError(f"grouped_gemm: empty problem N={n} K={k} ({bdesc})")
    if m >= 1 << 31 or n >= 1 << 31 or k >= 1 << 31:
        raise GemmArgumentError(f"grouped_gemm: dimensions must be < 2^31, got M={m} N={n} K={k}")
    item = ITEMSIZE[a_dt]
    if ib.strides is not None and ib.strides != (ib.shape[1] * ib.shape[2] * item, ib.shape[2] * item, item):
        raise GemmArgumentError(f"grouped_gemm: {bdesc} must be C-contiguous, got strides {ib.strides} bytes")
    if (ib.shape[2] * item) % TMA_ALIGN or (k * item) % TMA_ALIGN:
        raise GemmArgumentError(f"grouped_gemm: rows of A {ia.shape} and {bdesc} must be multiples of {TMA_ALIGN} "
                                f"bytes (K and N multiples of {TMA_ALIGN // item} for {a_dt})")
    if ib.ptr >= 0 and ib.ptr % TMA_ALIGN:
        raise GemmArgumentError(f"grouped_gemm: B starts at 0x{ib.ptr:x}, not {TMA_ALIGN}-byte aligned")
    if len(io.shape) != 1 or io.shape[0] != g + 1:
        raise GemmArgumentError(f"grouped_gemm: offsets must be 1-D [G + 1] = [{g + 1}] for {bdesc}, got shape "
                                f"{io.shape}")
    if io.dtype not in OFFSET_DTYPES:
        raise GemmTypeError(f"grouped_gemm: offsets has dtype {io.dtype}; supported: {', '.join(OFFSET_DTYPES)}")
    oitem = 4 if io.dtype == "int32" else 8
    if io.strides is not None and io.shape[0] > 1 and io.strides[0] != oitem:
        raise GemmArgumentError(f"grouped_gemm: offsets must be contiguous, got strides {io.strides} bytes")
    if io.ptr >= 0 and io.ptr % oitem:
        raise GemmArgumentError(f"grouped_gemm: offsets at 0x{io.ptr:x} is not {oitem}-byte aligned")
    devices = {i.device for i in (ia, ib, io) if i.device is not None}
    out_ids = FP8_OUT_DTYPES if fp8 else OUT_DTYPES
    what = "fp8 grouped GEMM output" if fp8 else "out_dtype"
    if out is not None:
        ic = _inspect(out, "out")
        if len(ic.shape) != 2 or ic.shape != (m, n):
            raise GemmArgumentError(f"grouped_gemm: out has shape {ic.shape}, expected (M, N) = ({m}, {n}) for A "
                                    f"{ia.shape} and {bdesc}")
        if ic.dtype not in out_ids:
            raise GemmTypeError(f"grouped_gemm: out has dtype {ic.dtype}; supported: {', '.join(out_ids)}")
        if out_dtype is not None and normalize_dtype(out_dtype).name != ic.dtype:
            raise GemmTypeError(f"grouped_gemm: out is {ic.dtype} but out_dtype={out_dtype}")
        if m > 0:
            _check_matrix(ic, out_ids)
        out_dt = ic.dtype
        if ic.device is not None:
            devices.add(ic.device)
        for other in (ia, ib, io):
            if other.ptr >= 0 and ic.ptr == other.ptr and m > 0:
                raise GemmArgumentError(f"grouped_gemm: out aliases {other.name}; in-place GEMM is not supported")
    else:
        try:
            out_dt = normalize_dtype(out_dtype).name if out_dtype is not None else ("bfloat16" if fp8 else ia.dtype)
        except (TypeError, ValueError) as e:
            raise GemmTypeError(f"grouped_gemm: out_dtype {out_dtype!r}: {e}") from e
        if out_dt not in out_ids:
            raise GemmTypeError(f"grouped_gemm: {what} {out_dt} not supported; use one of {', '.join(out_ids)}")
        if (n * ITEMSIZE[out_dt]) % TMA_ALIGN:
            raise GemmArgumentError(f"grouped_gemm: output rows would be {n * ITEMSIZE[out_dt]} bytes (N={n}); need "
                                    f"a multiple of {TMA_ALIGN}")
    scale, stride = "none", 0
    if fp8:
        scale, stride, scale_devices = _check_grouped_scales(scale_a, scale_b, m, n, k, g)
        devices |= scale_devices
    if len(devices) > 1:
        raise GemmArgumentError(f"grouped_gemm: operands live on different devices {sorted(devices)}")
    return GroupedProblem(m, n, k, g, a_dt, out_dt, io.dtype, b_dt if b_dt != a_dt else "", scale, stride)


def group_tiles(offsets, m: int, block_m: int) -> list[tuple[int, int, int]]:
    """Host mirror of the kernel's group table (GroupTable in kernels/gemm/scheduler.cuh), for tests and tools:
    (group, first row, row end) of every tile row of the grid, in grid order."""
    starts = [min(max(int(v), 0), m) for v in offsets]
    out = []
    for g in range(len(starts) - 1):
        end = max(starts[g], starts[g + 1])
        for r in range(-(-(end - starts[g]) // block_m)):
            out.append((g, starts[g] + r * block_m, end))
    return out


def grouped_grid(plan: GemmPlan, m: int, n: int, groups: int, num_sms: int) -> int:
    """Persistent CTAs: one per SM, fewer when even the most tile rows the groups can have (each group's
    partial tile row on top of M's whole ones) make fewer work items."""
    _, nt = plan.tiles(max(m, 1), n)
    items = (-(-m // plan.block_m) + groups) * nt
    cap = num_sms if plan.max_ctas is None else min(plan.max_ctas, num_sms)
    return max(1, min(cap, items))


def check_group_arrival(arrival, groups: int, fp8: bool = False) -> None:
    """Raise GemmArgumentError when ``arrival`` is not a usable :class:`GroupArrival` (no CUDA call)."""
    if arrival is None:
        return
    if fp8:
        raise GemmArgumentError("grouped_gemm: arrival waits are built for 16-bit inputs only, not with fp8_format")
    if not isinstance(arrival, GroupArrival):
        raise GemmArgumentError(f"grouped_gemm: arrival must be a fluxrt.gemm.GroupArrival, got "
                                f"{type(arrival).__name__}")
    for name in ("flags", "epoch_at", "err"):
        v = getattr(arrival, name)
        if not isinstance(v, int) or v <= 0 or v % 8:
            raise GemmArgumentError(f"grouped_gemm: arrival.{name} must be an 8-byte aligned device pointer, got "
                                    f"{v!r}")
    if not isinstance(arrival.sources, int) or not 1 <= arrival.sources <= 1 << 16:
        raise GemmArgumentError(f"grouped_gemm: arrival.sources={arrival.sources!r} must be 1 .. 65536 (flags per "
                                f"group; {groups} groups)")
    if arrival.timeout_ns <= 0:
        raise GemmArgumentError(f"grouped_gemm: arrival.timeout_ns={arrival.timeout_ns} must be positive")


def check_group_scatter(scatter, prob: GroupedProblem) -> None:
    """Raise GemmArgumentError when ``scatter`` is not a usable :class:`GroupScatter` for the call ``prob``
    (no CUDA call)."""
    if scatter is None:
        return
    if prob.fp8:
        raise GemmArgumentError("grouped_gemm: scatter is built for 16-bit inputs only, not with fp8_format")
    if not isinstance(scatter, GroupScatter):
        raise GemmArgumentError(f"grouped_gemm: scatter must be a fluxrt.gemm.GroupScatter, got "
                                f"{type(scatter).__name__}")
    for name, align in (("rows", 4), ("dsts", 8), ("flags", 8)):
        v = getattr(scatter, name)
        if not isinstance(v, int) or v <= 0 or v % align:
            raise GemmArgumentError(f"grouped_gemm: scatter.{name} must be a {align}-byte aligned device pointer, "
                                    f"got {v!r}")
    if not isinstance(scatter.homes, int) or not 1 <= scatter.homes <= MAX_SCATTER_HOMES:
        raise GemmArgumentError(f"grouped_gemm: scatter.homes={scatter.homes!r} must be 1 .. {MAX_SCATTER_HOMES}")
    item = ITEMSIZE[prob.out_dtype]
    if not isinstance(scatter.ld, int) or scatter.ld < prob.n or (scatter.ld * item) % 16:
        raise GemmArgumentError(f"grouped_gemm: scatter.ld={scatter.ld!r} must be >= N={prob.n} elements and make "
                                f"16-byte rows of {prob.out_dtype} (the storer writes 16-byte vectors)")
    if not isinstance(scatter.entries, int) or not 0 <= scatter.entries < 1 << 62:
        raise GemmArgumentError(f"grouped_gemm: scatter.entries={scatter.entries!r} must be a row count >= 0")


def _prepare(a, b, offsets, out, *, trans_b: bool | None, plan: GemmPlan | None, out_dtype: str | None,
             fp8_format=None, scale_a=None, scale_b=None, arrival: GroupArrival | None = None,
             scatter: GroupScatter | None = None):
    """Check one call and build its launch: (PackedLaunch or None for M = 0, out, plan)."""
    fp8_kw = dict(fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b)
    prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype, **fp8_kw)
    check_group_arrival(arrival, prob.groups, prob.fp8)
    check_group_scatter(scatter, prob)
    trans_b = prob.fp8 if trans_b is None else bool(trans_b)
    if plan is None:
        plan = grouped_plan(prob.m, prob.n, prob.k, prob.groups, in_dtype=prob.in_dtype, out_dtype=prob.out_dtype,
                            scale=prob.scale)
    check_grouped_plan(plan, prob.out_dtype, prob.in_dtype, prob.scale)
    import cupy

    kw = dict(op="grouped_gemm", error=GemmArgumentError, type_error=GemmTypeError)
    dlpack_only = any(not isinstance(x, cupy.ndarray) and not hasattr(x, "__cuda_array_interface__")
                      for x in (a, b, offsets, out, scale_a, scale_b) if x is not None)
    a = as_array(a, name="A", **kw)
    b = as_array(b, name="B", **kw)
    offsets = as_array(offsets, name="offsets", **kw)
    if out is not None:
        out = as_array(out, name="out", writable=True, **kw)
    sa = as_array(scale_a, name="scale_a", **kw) if scale_a is not None else None
    sb = as_array(scale_b, name="scale_b", **kw) if scale_b is not None else None
    if dlpack_only:   # pointers and strides are known once imported
        prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype,
                                     fp8_format=fp8_format, scale_a=sa, scale_b=sb)
    dev = a.device.id
    for x, name in ((b, "B"), (offsets, "offsets"), (sa, "scale_a"), (sb, "scale_b")):
        if x is not None and x.device.id != dev:
            raise GemmArgumentError(f"grouped_gemm: A is on device {dev} but {name} on device {x.device.id}")
    if out is None:
        with cupy.cuda.Device(dev):
            out = cupy.empty((prob.m, prob.n), dtype=normalize_dtype(prob.out_dtype))
    elif out.device.id != dev:
        raise GemmArgumentError(f"grouped_gemm: A is on device {dev} but out on device {out.device.id}")
    if log.isEnabledFor(logging.INFO):
        log.info("grouped_gemm M=%d N=%d K=%d G=%d %s%s->%s trans_b=%s scale=%s: %r", prob.m, prob.n, prob.k,
                 prob.groups, prob.in_dtype, f"x{prob.b_dtype}" if prob.b_dtype else "", prob.out_dtype, trans_b,
                 prob.scale, plan)
    if prob.m == 0:   # no rows in any group: nothing to launch
        return None, out, plan
    m, n, k, g, in_dt, out_dt = prob.m, prob.n, prob.k, prob.groups, prob.in_dtype, prob.out_dtype
    b_dt = prob.b_dtype or in_dt
    item = ITEMSIZE[in_dt]
    block_k = FP8_BLOCK_K if prob.fp8 else BLOCK_K
    defines = kernel_defines(plan, in_dt, out_dt, trans_b, hook_wait=arrival is not None,
                             hook_epilogue=scatter is not None, grouped=True, b_dtype=b_dt, scale=prob.scale)
    with cupy.cuda.Device(dev):
        smem = plan.smem_bytes(out_dt, grouped=True)
        kern = _kernel(defines, dev, smem)
        tmap_a = tensor_map(a.data.ptr, in_dt, m, k, block_k, plan.block_m)
        if trans_b:   # [G][N][K] as (k, n, group)
            tmap_b = tensor_map_nd(b.data.ptr, b_dt, (k, n, g), (k * item, n * k * item), (block_k, plan.block_n, 1))
        else:         # [G][K][N] as (n, k, group)
            tmap_b = tensor_map_nd(b.data.ptr, b_dt, (n, k, g), (n * item, k * n * item), (64, block_k, 1))
        tmap_c = tensor_map(out.data.ptr, out_dt, m, n, 128 // ITEMSIZE[out_dt], 64)
        params = gemm_params(tmap_a=tmap_a, tmap_b=tmap_b, tmap_c=tmap_c, order_table=0, c_direct=out.data.ptr,
                             m=m, n=n, k=k, group_m=plan.group_m, m_tile_offset=0, chunk_rows=0, chunks_per_peer=1)
        grp = params["group"]
        grp["offsets"], grp["groups"], grp["offsets_64"] = offsets.data.ptr, g, int(prob.offsets_dtype == "int64")
        if prob.scale != "none":
            sc = params["scale"]
            sc["a"], sc["b"], sc["k_blocks"] = sa.data.ptr, sb.data.ptr, prob.k_blocks
            sc["b_group_stride"] = prob.b_scale_stride
        if arrival is not None:   # hook 1 per group
            grp["arrival_epoch"], grp["arrival_sources"] = arrival.epoch_at, arrival.sources
            params["wait"]["flags"], params["wait"]["op_id"] = arrival.flags, arrival.op_id
            t = params["timeout"]
            t["timeout_ns"], t["err"], t["rank"] = arrival.timeout_ns, arrival.err, arrival.rank
        if scatter is not None:   # hook 2: every row to its home's buffer, counted there
            grp["scatter_homes"], grp["scatter_rows"] = scatter.homes, scatter.rows
            grp["scatter_dst"], grp["scatter_flags"] = scatter.dsts, scatter.flags
            grp["scatter_ld"], grp["scatter_entries"] = scatter.ld, scatter.entries
        grid = grouped_grid(plan, m, n, g, _num_sms(dev))
    return PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem), out, plan


_cache = LaunchCache(256)   # repeated calls (fluxrt.gemm.launch_cache); None: M = 0, nothing to launch


def clear_grouped_cache() -> None:
    """Forget every packed grouped launch."""
    _cache.clear()


@_nvtx("grouped_gemm")
def grouped_gemm(a, b, offsets, out=None, *, trans_b: bool | None = None, stream=None, plan: GemmPlan | None = None,
                 out_dtype: str | None = None, fp8_format=None, scale_a=None, scale_b=None,
                 arrival: GroupArrival | None = None, scatter: GroupScatter | None = None):
    """``out[offsets[g]:offsets[g+1]] = a[offsets[g]:offsets[g+1]] @ b[g]`` (``b`` [G, K, N]) or ``@ b[g].T``
    (``trans_b=True``, ``b`` [G, N, K]) for every group g, in one launch; ``offsets`` ([G + 1] int32/int64,
    G <= 256) is read on the device only. a: [M, K] bf16/fp16, C-contiguous; K and N multiples of 8.
    out: optional [M, N] bf16/fp16/fp32 (allocated with ``out_dtype``, default a's dtype, when None).
    trans_b: default False (16-bit) / True (fp8, its only layout).
    fp8: ``fp8_format`` ('e4m3', 'e5m2' or a pair for A and B) makes a [M, K] and b [G, N, K] uint8 arrays of fp8
    bytes (K a multiple of 16), out bf16 (default) or fp16; ``scale_a`` / ``scale_b`` (fp32 device arrays) per
    tensor (scale_a one element, scale_b [G] or one element) or block scales (scale_a [M, ceil(K/128)], scale_b
    [G, ceil(N/128), ceil(K/128)]); see this module's docstring.
    stream: cupy stream, raw cudaStream_t int, or None (current stream). plan: see :func:`grouped_plan`.
    arrival: optional :class:`GroupArrival`: each group's A rows are loaded only once its arrival flags are up
    (bounded waits), so the GEMM can run beside the launch that delivers them.
    scatter: optional :class:`GroupScatter`: the output rows go to their home ranks' buffers (counted there)
    instead of ``out``, which is then only checked, never written.
    Returns ``out`` (a CuPy array)."""
    import cupy

    fast = type(a) is cupy.ndarray and type(b) is cupy.ndarray and type(offsets) is cupy.ndarray \
        and type(out) is cupy.ndarray and all(x is None or type(x) is cupy.ndarray for x in (scale_a, scale_b))
    fp8_kw = dict(fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b)
    if not fast:   # before any CUDA call
        prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype, **fp8_kw)
        check_group_arrival(arrival, prob.groups, prob.fp8)
        check_group_scatter(scatter, prob)
    try:
        sptr = stream_handle(stream)
    except TypeError as e:
        raise GemmTypeError(f"grouped_gemm: {e}") from e
    if fast:
        fmt = fp8_format if fp8_format is None or isinstance(fp8_format, str) else tuple(fp8_format)
        key = (array_key(a), array_key(b), array_key(offsets), array_key(out), cupy.cuda.runtime.getDevice(),
               trans_b, plan, out_dtype, sptr, fmt, array_key(scale_a), array_key(scale_b), arrival, scatter)
        packed = _cache.get(key)
        if packed is MISS:
            packed, out, _ = _prepare(a, b, offsets, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype, **fp8_kw,
                                      arrival=arrival, scatter=scatter)
            _cache.put(key, packed)
    else:
        with as_cupy_stream(sptr):   # operands from DLPack / CAI are ordered after their producers on it
            packed, out, _ = _prepare(a, b, offsets, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype, **fp8_kw,
                                      arrival=arrival, scatter=scatter)
    if packed is not None:
        packed.launch(sptr)
    return out


__all__ = ["GroupedProblem", "GroupArrival", "GroupScatter", "check_group_arrival", "check_group_scatter",
           "grouped_gemm", "group_tiles", "grouped_plan",
           "grouped_max_stages", "grouped_grid", "validate_grouped_args", "check_grouped_plan", "clear_grouped_cache",
           "OFFSET_DTYPES"]
