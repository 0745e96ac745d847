"""The GEMM launch: checks, plan, kernel, tensor maps and arguments of one call, then the launch."""
from __future__ import annotations

import logging

from ..arrays import as_array
from ..dtypes import normalize_dtype
from ..errors import GemmArgumentError, GemmTypeError
from ..nvtx import annotate as _nvtx
from ..packed_launch import PackedLaunch
from ..streams import as_cupy_stream, stream_handle
from .checks import (WRITTEN, _band_stride, _check_bands_plan, _check_copy, _check_hooks, _check_reduce, _check_tail,
                     _ptr, _validate)
from .hooks import ArrivalWait, RowBands, ShardCopy, TileEpilogue, band_bits
from .launch_cache import MISS, LaunchCache, array_key
from .kernel import _kernel, _max_clusters, _num_sms, kernel_defines
from .params import gemm_params
from .plan import ITEMSIZE as _ITEMSIZE
from .plan import IN_DTYPES, SMEM_LIMIT_BYTES, GemmPlan, heuristic_plan, plan_gemm
from .split_k import check_split
from .split_k import load as load_split
from .split_k import prepare as prepare_split
from .stream_k import StreamKLaunch
from .stream_k import fill_params as fill_stream_k
from .tmaps import NULL_TMAP as _NULL_TMAP
from .tmaps import order_table as _order_table
from .tmaps import tensor_map as _tensor_map
from .tmaps import fitted_c_tiles_map

log = logging.getLogger("fluxrt.gemm")


def _as_device_array(x, name: str):
    """A cupy view of any CUDA array (fluxrt.arrays), ordered after its producer on the current stream."""
    return as_array(x, name=name, op="gemm", writable=name in WRITTEN, error=GemmArgumentError,
                    type_error=GemmTypeError)


def _stream_ptr(stream) -> int:
    try:
        return stream_handle(stream)
    except TypeError as e:
        raise GemmTypeError(f"gemm: {e}") from e


def _prepare(a, b, out, *, trans_b, plan, out_dtype, wait: ArrivalWait | None,
             epilogue: TileEpilogue | None, copy: ShardCopy | None = None, a_bands: RowBands | None = None,
             c_bands: RowBands | None = None, stream_ptr: int | None = None):
    """Check one call and build its launch: returns (launch, out, plan), where launch.launch(stream) enqueues
    it (a PackedLaunch, a split_k.SplitLaunch or a stream_k.StreamKLaunch). Makes no launch. stream_ptr: the stream the call will run
    on (split-K's partials buffer is per stream)."""
    stride = _band_stride(a_bands, c_bands, wait, epilogue)
    m, n, k, in_dt, out_dt = _validate(a, b, out, trans_b=trans_b, out_dtype=out_dtype, a_bands=a_bands,
                                       c_bands=c_bands, stride=stride)
    if plan is None and (wait or epilogue or copy or stride):
        plan = plan_gemm(m, n, k, in_dtype=in_dt, out_dtype=out_dt)
    elif plan is None:
        plan = _plain_plan(a, b, out, m, n, k, in_dt, out_dt, trans_b, out_dtype)
    plan.validate(out_dt, b_kmajor=trans_b)
    if plan.fitted_n and (in_dt not in IN_DTYPES or wait or epilogue or copy or stride):
        raise GemmArgumentError(f"gemm: plan block_n={plan.block_n} (not a multiple of 64) is for plain 16-bit GEMMs, "
                                f"got inputs {in_dt}"
                                f"{', hooks or row bands' if (wait or epilogue or copy or stride) else ''}")
    if plan.split_k > 1 and (wait or epilogue or copy or stride):
        raise GemmArgumentError("gemm: a split_k plan is for plain GEMMs (no hooks, no row bands)")
    if plan.cluster_n > 1 and (in_dt not in IN_DTYPES or wait or epilogue or copy or stride):
        raise GemmArgumentError(f"gemm: a cluster_n=2 plan is for plain 16-bit GEMMs, got inputs {in_dt}"
                                f"{', hooks or row bands' if (wait or epilogue or copy or stride) else ''}")
    if plan.stream_k and (wait or epilogue or copy or stride):
        raise GemmArgumentError("gemm: a stream_k plan is for plain GEMMs (no hooks, no row bands)")
    if plan.pingpong and (wait or epilogue or copy or stride):
        raise GemmArgumentError("gemm: a pingpong plan is for plain GEMMs (no hooks, no row bands)")
    if plan.row_blocks > 1 and (in_dt not in IN_DTYPES or wait or epilogue or copy or stride):
        raise GemmArgumentError(f"gemm: a plan of {plan.block_m}-row tiles ({plan.describe()}) is for plain 16-bit "
                                f"GEMMs, got M={m} N={n} K={k} with inputs {in_dt}"
                                f"{', hooks or row bands' if (wait or epilogue or copy or stride) else ''}")
    if plan.split_k > 1:
        check_split(plan, m, n, k)
    if stride:
        _check_bands_plan(a_bands, c_bands, stride, plan, epilogue, copy)
    _check_hooks(wait, epilogue, plan, m)
    red = epilogue.reduce if epilogue is not None else None
    if epilogue is not None:
        epilogue.destinations.check(m, n, epilogue.chunk_rows, out_dt)
    if red is not None:
        _check_reduce(red, wait, m, n, epilogue.chunk_rows, out_dt)
        _check_tail(red, epilogue, plan, m, n)
    if copy is not None:
        _check_copy(copy, wait, m, k, in_dt)
        if plan.smem_bytes(out_dt, shard_copy=True) > SMEM_LIMIT_BYTES:
            raise GemmArgumentError(f"gemm: ShardCopy needs {plan.smem_bytes(out_dt, shard_copy=True)} B of shared "
                                    f"memory with this plan (its copier's buffer), more than {SMEM_LIMIT_BYTES} B: "
                                    "use fewer stages or per-consumer C staging")
    if log.isEnabledFor(logging.INFO):   # a new launch only: the fast path of repeated calls never gets here
        hooks = [h for h, on in (("wait", wait), ("epilogue", epilogue), ("reduce", red), ("copy", copy),
                                 ("a_bands", a_bands), ("c_bands", c_bands)) if on is not None]
        log.info("gemm M=%d N=%d K=%d %s->%s trans_b=%s hooks=%s: %r", m, n, k, in_dt, out_dt, bool(trans_b),
                 ",".join(hooks) or "none", plan)

    import cupy

    # an operand seen only through __dlpack__ has its pointer once imported: check those then
    dlpack_only = any(x is not None and not isinstance(x, cupy.ndarray) and not hasattr(x, "__cuda_array_interface__")
                      for x in (a, b, out))
    a = _as_device_array(a, "A")
    b = _as_device_array(b, "B")
    if out is not None:
        out = _as_device_array(out, "out")
    red_out = _as_device_array(red.out, "ChunkReduce.out") if red is not None else None
    if red_out is not None and red_out.device.id != a.device.id:
        raise GemmArgumentError(f"gemm: ChunkReduce.out is on device {red_out.device.id} but A on device {a.device.id}")
    own = _as_device_array(copy.src, "ShardCopy.src") if copy is not None else None
    if own is not None and own.device.id != a.device.id:
        raise GemmArgumentError(f"gemm: ShardCopy.src is on device {own.device.id} but A on device {a.device.id}")
    if dlpack_only:
        _validate(a, b, out, trans_b=trans_b, out_dtype=out_dtype, a_bands=a_bands, c_bands=c_bands, stride=stride)
    dev = a.device.id
    if b.device.id != dev:
        raise GemmArgumentError(f"gemm: A is on device {dev} but B on device {b.device.id}")
    if out is None:
        if epilogue is None:
            with cupy.cuda.Device(dev):
                out = cupy.empty((m // stride * c_bands.rows if c_bands else m, n), dtype=normalize_dtype(out_dt))
    elif out.device.id != dev:
        raise GemmArgumentError(f"gemm: out is on device {out.device.id} but A on device {dev}")
    if plan.split_k > 1:
        with cupy.cuda.Device(dev):
            sptr = cupy.cuda.get_current_stream().ptr if stream_ptr is None else stream_ptr
            return prepare_split(a, b, out, plan, m, n, k, in_dt, out_dt, trans_b, dev, sptr), out, plan
    # without hooks the band height travels as chunk_rows (the kernel's band_rows())
    chunk_rows = wait.chunk_rows if wait else (epilogue.chunk_rows if epilogue else stride)
    bands = m // stride if stride else None   # bands of a banded operand's 3-D tensor map

    defines = kernel_defines(plan, in_dt, out_dt, trans_b, wait is not None, epilogue is not None,
                             red.hook_id if red is not None else 0,
                             copy is not None, band_bits(a_bands, c_bands))
    with cupy.cuda.Device(dev):
        smem = plan.smem_bytes(out_dt, shard_copy=copy is not None, b_kmajor=trans_b)
        kern = _kernel(defines, dev, smem)
        mt, nt = plan.tiles(m, n)
        # with a cluster along N each CTA loads (and multicasts) block_m / cluster_n rows of A
        tmap_a = _tensor_map(a.data.ptr, in_dt, a_bands.rows if a_bands else m, k, plan.block_k,
                             plan.block_m // plan.cluster_n, bands=bands if a_bands else None)
        tmap_own = (_tensor_map(own.data.ptr, in_dt, own.shape[0], k, plan.block_k, plan.block_m)
                    if own is not None else None)
        if trans_b:   # with a cluster each CTA loads (and multicasts) block_n / cluster rows of B
            tmap_b = _tensor_map(b.data.ptr, in_dt, n, k, plan.block_k, plan.block_n // plan.cluster)
        else:
            tmap_b = _tensor_map(b.data.ptr, in_dt, k, n, 64, plan.block_k)
        c_cols = 128 // _ITEMSIZE[out_dt]
        staged_out = out is not None and epilogue is None and plan.epilogue == "tma"
        tmap_c = (_tensor_map(out.data.ptr, out_dt, c_bands.rows if c_bands else m, n, c_cols, 64,
                              bands=bands if c_bands else None) if staged_out else _NULL_TMAP)
        if red is not None and red.where == "epilogue":   # hook 3: C is the reduced chunk's result
            tmap_c = _tensor_map(red_out.data.ptr, out_dt, red_out.shape[0], n, c_cols, 64)
        # fitted widths, staged: C as [M][N / block_n][block_n] for the inner tile columns (FitArgs)
        tmap_c_tiles = (fitted_c_tiles_map(out.data.ptr, out_dt, m, n, plan.block_n)
                        if staged_out and plan.fitted_n else None)
        c_direct = out.data.ptr if (out is not None and epilogue is None and plan.epilogue == "direct") else 0
        dst_tmaps = (epilogue.destinations.tensor_maps(m, n, epilogue.chunk_rows, dev, c_cols, 64)
                     if epilogue is not None else None)
        table = _order_table(plan, mt, nt, dev)
        grid = plan.grid(m, n, _num_sms(dev), _max_clusters(kern, plan, smem, dev))
        # one timeout report per kernel: hook 1's, else hook 3's (_check_reduce: equal when both)
        timed = wait if wait is not None else red
        params = gemm_params(tmap_a=tmap_a, tmap_b=tmap_b, tmap_c=tmap_c, order_table=_ptr(table), c_direct=c_direct,
                            m=m, n=n, k=k, group_m=plan.group_m, m_tile_offset=plan.m_tile_offset % mt,
                            chunk_rows=chunk_rows, chunks_per_peer=wait.chunks_per_peer if wait else 1)
        if tmap_c_tiles is not None:
            params["fit"]["tmap_c_tiles"] = tmap_c_tiles
        if timed is not None:
            t = params["timeout"]
            t["timeout_ns"], t["err"], t["rank"] = timed.timeout_ns, _ptr(timed.err), timed.rank
        if wait is not None:   # hook 1
            w = params["wait"]
            w["flags"], w["epoch"], w["op_id"] = _ptr(wait.flags), wait.epoch, wait.op_id
        if epilogue is not None:   # hook 2
            e = params["epilogue"]
            e["dst_tmaps"], e["flag_table"] = _ptr(dst_tmaps), _ptr(epilogue.flag_table)
            e["signal_value"], e["flag_group_n"] = epilogue.signal_value, epilogue.flag_group_n
            e["signal_add"] = 1 if epilogue.signal_add else 0
        if red is not None:   # hook 3
            r = params["reduce"]
            r["chunk"], r["partials"], r["source_bytes"], r["ld"] = red.chunk, _ptr(red.partials), red.source_bytes, red.ld
            r["sources"], r["flags"], r["flag_stride"], r["group_n"] = red.sources, _ptr(red.flags), red.flag_stride, \
                red.group_n
            r["epoch"], r["op_id"] = red.epoch, red.op_id
            if red.where == "tail":
                params["tail"]["out"], params["tail"]["counter"] = red_out.data.ptr, _ptr(red.counter)
        if copy is not None:   # hook 4
            c = params["copy"]
            c["tmap_a_own"], c["row0"], c["rows"], c["counters"] = tmap_own, copy.row0, own.shape[0], \
                _ptr(copy.counters)
        if plan.stream_k:   # the partials and counters of the call's stream
            sptr = cupy.cuda.get_current_stream().ptr if stream_ptr is None else stream_ptr
            ws = fill_stream_k(params, plan, m, n, k, grid, dev, sptr)
            return StreamKLaunch(PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem), ws), out, plan
    return PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem), out, plan


def _plain_plan(a, b, out, m, n, k, in_dt, out_dt, trans_b, out_dtype) -> GemmPlan:
    """A plain GEMM's plan: the autotune cache's, else the heuristic's; with FLUXRT_GEMM_AUTOTUNE=1 a problem
    not in the cache is tuned first (never inside a stream capture, which a tuning run would break)."""
    from .autotune import autotune, autotune_on, tuned_plan

    try:
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        sms = _num_sms(dev)
    except Exception:   # no usable GPU: the launch fails later with CUDA's own error
        return heuristic_plan(m, n, k, in_dtype=in_dt, out_dtype=out_dt, trans_b=trans_b)
    tuned = tuned_plan(m, n, k, in_dt, out_dt, trans_b, dev)
    if tuned is not None:
        return tuned
    if autotune_on() and not cupy.cuda.get_current_stream().is_capturing():
        return autotune(a, b, out, trans_b=trans_b, out_dtype=out_dtype).plan
    return heuristic_plan(m, n, k, in_dtype=in_dt, out_dtype=out_dt, trans_b=trans_b, num_sms=sms)


def _launch(a, b, out, *, stream, **kw):
    if stream is None:   # the current stream: the intake orders operands on it already
        packed, out, _ = _prepare(a, b, out, **kw)
        packed.launch(_stream_ptr(None))
        return out
    sptr = _stream_ptr(stream)
    # operands that come in through DLPack or CAI are ordered after their producers on the call's stream
    with as_cupy_stream(sptr):
        packed, out, _ = _prepare(a, b, out, stream_ptr=sptr, **kw)
    packed.launch(sptr)
    return out


# --- the fast path of repeated calls (fluxrt.gemm.launch_cache) ------------------------------------------------
_fast = LaunchCache(512)


def clear_launch_cache() -> None:
    """Forget every packed launch (after a plan cache changed, or to release their tensor maps)."""
    from . import fp8

    _fast.clear()
    fp8.clear_launch_cache()


def _fast_gemm(a, b, out, trans_b, stream, plan, out_dtype):
    """gemm() for CuPy arrays: a cached launch when this call was seen before, else a checked one kept."""
    import cupy

    if out is None:
        dt = out_dtype or a.dtype
        try:
            dt = normalize_dtype(dt)
        except (TypeError, ValueError) as e:
            raise GemmTypeError(f"gemm: out_dtype {out_dtype!r}: {e}") from e
        with cupy.cuda.Device(a.data.device_id):   # gemm() sends only 2-D operands here
            out = cupy.empty((a.shape[0], b.shape[0] if trans_b else b.shape[1]), dtype=dt)
    sptr = stream.ptr if type(stream) is cupy.cuda.Stream else _stream_ptr(stream)
    key = (array_key(a), array_key(b), array_key(out), cupy.cuda.runtime.getDevice(), trans_b, plan, out_dtype,
           sptr)
    packed = _fast.get(key)
    if packed is MISS:
        packed, out, _ = _prepare(a, b, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype, wait=None,
                                  epilogue=None, stream_ptr=sptr)
        _fast.put(key, packed)
    packed.launch(sptr)
    return out


@_nvtx("gemm")
def gemm(a, b, out=None, *, trans_b: bool = False, stream=None, plan: GemmPlan | None = None,
         out_dtype: str | None = None, fp8_format=None, scale_a=None, scale_b=None):
    """``out = a @ b`` (``b`` is [K, N]) or ``a @ b.T`` (``trans_b=True``, ``b`` is [N, K]).

    a: [M, K] bf16 or fp16, C-contiguous, on the current device (any __cuda_array_interface__ / DLPack
    array). out: optional [M, N] bf16/fp16/fp32 array (allocated with ``out_dtype`` -- default a's dtype --
    when None). Rows must be 16-byte aligned: K and N multiples of 8 (N of 4 for fp32 out).
    stream: cupy stream, raw cudaStream_t int, or None (current stream). plan: see fluxrt.gemm.plan.
    Returns ``out``.

    fp8: ``fp8_format`` ('e4m3', 'e5m2', or a pair for A and B) makes a and b uint8 arrays of fp8 bytes, b
    [N, K] with ``trans_b=True``; ``scale_a`` / ``scale_b`` (fp32 device arrays, per tensor or block scales)
    dequantise; out is bf16 (default) or fp16. See :mod:`fluxrt.gemm.fp8`.
    """
    import cupy

    if fp8_format is not None:
        from .fp8 import gemm_fp8

        return gemm_fp8(a, b, out, trans_b=trans_b, fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b,
                        stream=stream, plan=plan, out_dtype=out_dtype)
    if scale_a is not None or scale_b is not None:
        raise GemmArgumentError("gemm: scale_a / scale_b are for fp8 inputs: pass fp8_format='e4m3' or 'e5m2' too")

    if (type(a) is cupy.ndarray and type(b) is cupy.ndarray and (out is None or type(out) is cupy.ndarray)
            and a.ndim == 2 and b.ndim == 2):
        return _fast_gemm(a, b, out, trans_b, stream, plan, out_dtype)
    return _launch(a, b, out, trans_b=trans_b, stream=stream, plan=plan, out_dtype=out_dtype, wait=None,
                   epilogue=None)


def gemm_with_hooks(a, b, out=None, *, trans_b: bool = False, stream=None, plan: GemmPlan | None = None,
                    out_dtype: str | None = None, wait: ArrivalWait | None = None,
                    epilogue: TileEpilogue | None = None, copy: ShardCopy | None = None,
                    a_bands: RowBands | None = None, c_bands: RowBands | None = None):
    """Internal launch path of the fused ops: :func:`gemm` with hooks 1 (``wait``), 2 (``epilogue``, with 3 as
    its ``reduce``) and 4 (``copy``, needs ``wait``) compiled in, and A (``a_bands``) or C (``c_bands``) in
    :class:`RowBands`.

    With ``epilogue`` set, ``out`` is not written (tiles go to ``epilogue.destinations``); pass out=None and
    out_dtype for the element type of the destinations. Returns ``out`` (None with an epilogue and no out).
    """
    return _launch(a, b, out, trans_b=trans_b, stream=stream, plan=plan, out_dtype=out_dtype, wait=wait,
                   epilogue=epilogue, copy=copy, a_bands=a_bands, c_bands=c_bands)


def load_plain(plan: GemmPlan, in_dtype: str, out_dtype: str, trans_b: bool, device: int) -> None:
    """Load (compile on first use) every kernel a plain :func:`gemm` call under `plan` launches, without
    launching: with split-K the kernel of fp32 partials into banded C and the slices' reduction. For callers
    that must not compile between collectives (the fused ops' decomposed path)."""
    import cupy

    with cupy.cuda.Device(device):
        if plan.split_k > 1:
            load_split(plan, in_dtype, out_dtype, trans_b, device)
        else:
            _kernel(kernel_defines(plan, in_dtype, out_dtype, trans_b), device,
                    plan.smem_bytes(out_dtype, b_kmajor=trans_b))
