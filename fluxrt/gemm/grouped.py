"""Grouped GEMM for mixture-of-experts layers: G problems ``out[rows of g] = a[rows of g] @ b[g]`` in ONE
persistent launch of the Hopper GEMM (kernels/gemm/hopper_gemm.cu built with ``FLUXRT_GEMM_GROUPED``).

* ``a``       [M, K]: the tokens of every group one after another (sorted by expert), bf16 or fp16
* ``b``       [G, K, N] (``trans_b=False``) or [G, N, K] (``trans_b=True``): one weight matrix per group
* ``offsets`` [G + 1] int32 or int64 on the device: group g is rows ``offsets[g] .. offsets[g + 1]`` of ``a``
  and ``out`` (prefix sums, ``offsets[0] = 0``, ``offsets[G] = M``; groups may be empty)
* ``out``     [M, N]: bf16, fp16 or fp32

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
import threading
from collections import OrderedDict

from ..arrays import as_array
from ..dtypes import normalize_dtype
from ..errors import GemmArgumentError, GemmTypeError
from ..nvtx import annotate as _nvtx
from ..packed_launch import PackedLaunch
from ..streams import as_cupy_stream, stream_handle
from .checks import _check_matrix, _inspect
from .kernel import _kernel, _num_sms, kernel_defines
from .params import gemm_params
from .plan import (BLOCK_K, H100_H200_SMS, IN_DTYPES, ITEMSIZE, MAX_GROUPS, MAX_STAGES, OUT_DTYPES,
                   SMEM_LIMIT_BYTES, TMA_ALIGN, GemmPlan)
from .hooks import GroupArrival
from .tmaps import tensor_map, tensor_map_nd

log = logging.getLogger("fluxrt.gemm")

OFFSET_DTYPES = ("int32", "int64")


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
    """The checked shape of one grouped call."""

    m: int                # rows of a and out (all groups)
    n: int
    k: int
    groups: int
    in_dtype: str
    out_dtype: str
    offsets_dtype: str


def grouped_plan(m: int, n: int, k: int, groups: int, *, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
                 num_sms: int = H100_H200_SMS) -> GemmPlan:
    """The plan of a grouped call (the host does not know the groups' sizes): 128 x 256 tiles, 128 x 128 when N
    is at most 128 or fp32 output leaves fewer than 3 stages beside the staging; the deepest ring that fits
    with the group table (at most 6 stages); bands of 16 tile rows (the tile rows of neighbouring groups
    share a wave, each group's B tiles are read by its rows' CTAs together)."""
    if in_dtype not in IN_DTYPES:
        raise GemmTypeError(f"grouped_gemm: unsupported input dtype {in_dtype!r} (expected one of {IN_DTYPES})")
    if out_dtype not in OUT_DTYPES:
        raise GemmTypeError(f"grouped_gemm: unsupported output dtype {out_dtype!r} (expected one of {OUT_DTYPES})")
    for bn in (256, 128):
        stages = grouped_max_stages(GemmPlan(block_n=bn), out_dtype)
        if (bn == 256 and n <= 128) or stages < 3:
            continue
        return GemmPlan(block_n=bn, stages=min(stages, 6), group_m=16)
    return GemmPlan(block_n=128, stages=min(grouped_max_stages(GemmPlan(block_n=128), out_dtype), 6), group_m=16)


def grouped_max_stages(plan: GemmPlan, out_dtype: str) -> int:
    """Deepest ring of ``plan``'s tile that fits beside the C staging and the group table."""
    s = 0
    while s < MAX_STAGES and dataclasses.replace(plan, stages=s + 1).smem_bytes(out_dtype, grouped=True) \
            <= SMEM_LIMIT_BYTES:
        s += 1
    return s


def check_grouped_plan(plan: GemmPlan, out_dtype: str) -> None:
    """Raise GemmArgumentError when the grouped kernel cannot run ``plan``."""
    try:
        plan.validate(out_dtype)
    except ValueError as e:
        raise GemmArgumentError(f"grouped_gemm: {e}") from e
    if plan.cluster != 1 or plan.order != "grouped" or plan.epilogue != "tma" or plan.split_k != 1 \
            or plan.m_tile_offset != 0:
        raise GemmArgumentError(f"grouped_gemm: a grouped plan needs cluster=1, order='grouped', epilogue='tma', "
                                f"split_k=1 and m_tile_offset=0, got {plan.describe()} (m_tile_offset="
                                f"{plan.m_tile_offset})")
    need = plan.smem_bytes(out_dtype, grouped=True)
    if need > SMEM_LIMIT_BYTES:
        raise GemmArgumentError(f"grouped_gemm: plan {plan.describe()} needs {need} B of shared memory with the "
                                f"group table, more than {SMEM_LIMIT_BYTES} B: use fewer stages")


def validate_grouped_args(a, b, offsets, out=None, *, trans_b: bool = False,
                          out_dtype: str | None = None) -> GroupedProblem:
    """Check the operands of :func:`grouped_gemm` without any CUDA call; raises GemmTypeError /
    GemmArgumentError naming the operand and shapes."""
    ia, ib, io = _inspect(a, "A"), _inspect(b, "B"), _inspect(offsets, "offsets")
    if len(ia.shape) != 2:
        raise GemmArgumentError(f"grouped_gemm: A must be 2-D [M, K] (tokens of all groups), got shape {ia.shape}")
    if ia.shape[0] > 0:
        _check_matrix(ia, IN_DTYPES)
    elif ia.dtype not in IN_DTYPES:
        raise GemmTypeError(f"grouped_gemm: A has dtype {ia.dtype}; supported: {', '.join(IN_DTYPES)}")
    m, k = ia.shape
    if len(ib.shape) != 3:
        layout = "[G, N, K] (trans_b=True)" if trans_b else "[G, K, N] (trans_b=False)"
        raise GemmArgumentError(f"grouped_gemm: B must be 3-D {layout}, got shape {ib.shape}")
    if ib.dtype != ia.dtype:
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
    item = ITEMSIZE[ia.dtype]
    if ib.strides is not None and ib.strides != (ib.shape[1] * ib.shape[2] * item, ib.shape[2] * item, item):
        raise GemmArgumentError(f"grouped_gemm: {bdesc} must be C-contiguous, got strides {ib.strides} bytes")
    if (ib.shape[2] * item) % TMA_ALIGN or (k * item) % TMA_ALIGN:
        raise GemmArgumentError(f"grouped_gemm: rows of A {ia.shape} and {bdesc} must be multiples of {TMA_ALIGN} "
                                f"bytes (K and N multiples of {TMA_ALIGN // item} for {ia.dtype})")
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
    if out is not None:
        ic = _inspect(out, "out")
        if len(ic.shape) != 2 or ic.shape != (m, n):
            raise GemmArgumentError(f"grouped_gemm: out has shape {ic.shape}, expected (M, N) = ({m}, {n}) for A "
                                    f"{ia.shape} and {bdesc}")
        if ic.dtype not in OUT_DTYPES:
            raise GemmTypeError(f"grouped_gemm: out has dtype {ic.dtype}; supported: {', '.join(OUT_DTYPES)}")
        if out_dtype is not None and normalize_dtype(out_dtype).name != ic.dtype:
            raise GemmTypeError(f"grouped_gemm: out is {ic.dtype} but out_dtype={out_dtype}")
        if m > 0:
            _check_matrix(ic, OUT_DTYPES)
        out_dt = ic.dtype
        if ic.device is not None:
            devices.add(ic.device)
        for other in (ia, ib, io):
            if other.ptr >= 0 and ic.ptr == other.ptr and m > 0:
                raise GemmArgumentError(f"grouped_gemm: out aliases {other.name}; in-place GEMM is not supported")
    else:
        try:
            out_dt = normalize_dtype(out_dtype).name if out_dtype is not None else ia.dtype
        except (TypeError, ValueError) as e:
            raise GemmTypeError(f"grouped_gemm: out_dtype {out_dtype!r}: {e}") from e
        if out_dt not in OUT_DTYPES:
            raise GemmTypeError(f"grouped_gemm: out_dtype {out_dt} not supported; use one of {', '.join(OUT_DTYPES)}")
        if (n * ITEMSIZE[out_dt]) % TMA_ALIGN:
            raise GemmArgumentError(f"grouped_gemm: output rows would be {n * ITEMSIZE[out_dt]} bytes (N={n}); need "
                                    f"a multiple of {TMA_ALIGN}")
    if len(devices) > 1:
        raise GemmArgumentError(f"grouped_gemm: operands live on different devices {sorted(devices)}")
    return GroupedProblem(m, n, k, g, ia.dtype, out_dt, io.dtype)


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


def check_group_arrival(arrival, groups: int) -> None:
    """Raise GemmArgumentError when ``arrival`` is not a usable :class:`GroupArrival` (no CUDA call)."""
    if arrival is None:
        return
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


def _prepare(a, b, offsets, out, *, trans_b: bool, plan: GemmPlan | None, out_dtype: str | None,
             arrival: GroupArrival | None = None):
    """Check one call and build its launch: (PackedLaunch or None for M = 0, out, plan)."""
    prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype)
    check_group_arrival(arrival, prob.groups)
    if plan is None:
        plan = grouped_plan(prob.m, prob.n, prob.k, prob.groups, in_dtype=prob.in_dtype, out_dtype=prob.out_dtype)
    check_grouped_plan(plan, prob.out_dtype)
    import cupy

    kw = dict(op="grouped_gemm", error=GemmArgumentError, type_error=GemmTypeError)
    dlpack_only = any(not isinstance(x, cupy.ndarray) and not hasattr(x, "__cuda_array_interface__")
                      for x in (a, b, offsets, out) if x is not None)
    a = as_array(a, name="A", **kw)
    b = as_array(b, name="B", **kw)
    offsets = as_array(offsets, name="offsets", **kw)
    if out is not None:
        out = as_array(out, name="out", writable=True, **kw)
    if dlpack_only:   # pointers and strides are known once imported
        prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype)
    dev = a.device.id
    for x, name in ((b, "B"), (offsets, "offsets")):
        if x.device.id != dev:
            raise GemmArgumentError(f"grouped_gemm: A is on device {dev} but {name} on device {x.device.id}")
    if out is None:
        with cupy.cuda.Device(dev):
            out = cupy.empty((prob.m, prob.n), dtype=normalize_dtype(prob.out_dtype))
    elif out.device.id != dev:
        raise GemmArgumentError(f"grouped_gemm: A is on device {dev} but out on device {out.device.id}")
    if log.isEnabledFor(logging.INFO):
        log.info("grouped_gemm M=%d N=%d K=%d G=%d %s->%s trans_b=%s: %r", prob.m, prob.n, prob.k, prob.groups,
                 prob.in_dtype, prob.out_dtype, bool(trans_b), plan)
    if prob.m == 0:   # no rows in any group: nothing to launch
        return None, out, plan
    m, n, k, g, in_dt, out_dt = prob.m, prob.n, prob.k, prob.groups, prob.in_dtype, prob.out_dtype
    item = ITEMSIZE[in_dt]
    defines = kernel_defines(plan, in_dt, out_dt, trans_b, hook_wait=arrival is not None, grouped=True)
    with cupy.cuda.Device(dev):
        smem = plan.smem_bytes(out_dt, grouped=True)
        kern = _kernel(defines, dev, smem)
        tmap_a = tensor_map(a.data.ptr, in_dt, m, k, BLOCK_K, plan.block_m)
        if trans_b:   # [G][N][K] as (k, n, group)
            tmap_b = tensor_map_nd(b.data.ptr, in_dt, (k, n, g), (k * item, n * k * item), (BLOCK_K, plan.block_n, 1))
        else:         # [G][K][N] as (n, k, group)
            tmap_b = tensor_map_nd(b.data.ptr, in_dt, (n, k, g), (n * item, k * n * item), (64, BLOCK_K, 1))
        tmap_c = tensor_map(out.data.ptr, out_dt, m, n, 128 // ITEMSIZE[out_dt], 64)
        params = gemm_params(tmap_a=tmap_a, tmap_b=tmap_b, tmap_c=tmap_c, order_table=0, c_direct=out.data.ptr,
                             m=m, n=n, k=k, group_m=plan.group_m, m_tile_offset=0, chunk_rows=0, chunks_per_peer=1)
        grp = params["group"]
        grp["offsets"], grp["groups"], grp["offsets_64"] = offsets.data.ptr, g, int(prob.offsets_dtype == "int64")
        if arrival is not None:   # hook 1 per group
            grp["arrival_epoch"], grp["arrival_sources"] = arrival.epoch_at, arrival.sources
            params["wait"]["flags"], params["wait"]["op_id"] = arrival.flags, arrival.op_id
            t = params["timeout"]
            t["timeout_ns"], t["err"], t["rank"] = arrival.timeout_ns, arrival.err, arrival.rank
        grid = grouped_grid(plan, m, n, g, _num_sms(dev))
    return PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem), out, plan


# --- repeated calls: a call on the same CuPy arrays, options and stream reuses its packed launch ---------------
_CACHE_SIZE = 256
_cache: "OrderedDict[tuple, PackedLaunch | None]" = OrderedDict()
_cache_lock = threading.Lock()


def clear_grouped_cache() -> None:
    """Forget every packed grouped launch."""
    with _cache_lock:
        _cache.clear()


def _key(x):
    return (x.data.ptr, x.shape, x.strides, x.dtype.char, x.data.device_id)


@_nvtx("grouped_gemm")
def grouped_gemm(a, b, offsets, out=None, *, trans_b: bool = False, stream=None, plan: GemmPlan | None = None,
                 out_dtype: str | None = None, arrival: GroupArrival | None = None):
    """``out[offsets[g]:offsets[g+1]] = a[offsets[g]:offsets[g+1]] @ b[g]`` (``b`` [G, K, N]) or ``@ b[g].T``
    (``trans_b=True``, ``b`` [G, N, K]) for every group g, in one launch; ``offsets`` ([G + 1] int32/int64,
    G <= 256) is read on the device only. a: [M, K] bf16/fp16, C-contiguous; K and N multiples of 8.
    out: optional [M, N] bf16/fp16/fp32 (allocated with ``out_dtype``, default a's dtype, when None).
    stream: cupy stream, raw cudaStream_t int, or None (current stream). plan: see :func:`grouped_plan`.
    arrival: optional :class:`GroupArrival`: each group's A rows are loaded only once its arrival flags are up
    (bounded waits), so the GEMM can run beside the launch that delivers them.
    Returns ``out`` (a CuPy array)."""
    import cupy

    fast = type(a) is cupy.ndarray and type(b) is cupy.ndarray and type(offsets) is cupy.ndarray \
        and type(out) is cupy.ndarray
    if not fast:
        prob = validate_grouped_args(a, b, offsets, out, trans_b=trans_b, out_dtype=out_dtype)   # before any CUDA call
        check_group_arrival(arrival, prob.groups)
    try:
        sptr = stream_handle(stream)
    except TypeError as e:
        raise GemmTypeError(f"grouped_gemm: {e}") from e
    if fast:
        key = (_key(a), _key(b), _key(offsets), _key(out), cupy.cuda.runtime.getDevice(), bool(trans_b), plan,
               out_dtype, sptr, arrival)
        with _cache_lock:
            hit = key in _cache
            packed = _cache.get(key)
        if not hit:
            packed, out, _ = _prepare(a, b, offsets, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype,
                                      arrival=arrival)
            with _cache_lock:
                _cache[key] = packed
                while len(_cache) > _CACHE_SIZE:
                    _cache.popitem(last=False)
    else:
        with as_cupy_stream(sptr):   # operands from DLPack / CAI are ordered after their producers on it
            packed, out, _ = _prepare(a, b, offsets, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype,
                                      arrival=arrival)
    if packed is not None:
        packed.launch(sptr)
    return out


__all__ = ["GroupedProblem", "GroupArrival", "check_group_arrival", "grouped_gemm", "group_tiles", "grouped_plan",
           "grouped_max_stages", "grouped_grid", "validate_grouped_args", "check_grouped_plan", "clear_grouped_cache",
           "OFFSET_DTYPES"]
