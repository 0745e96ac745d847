"""Hopper GEMM: ``C = A @ B`` (or ``A @ B.T``) with a main loop fluxrt owns (kernels/gemm/hopper_gemm.cu).

Public entry point: :func:`gemm`. The fused ops (AllGather+GEMM, GEMM+ReduceScatter) use
:func:`gemm_with_hooks`, which compiles the two hooks into the kernel:

* :class:`ArrivalWait`   -- before loading A for a tile, the producer waits (bounded, acquire.sys, then
  fence.proxy.async) until ``flags[m_block_start // chunk_rows] >= epoch``.
* :class:`TileEpilogue`  -- finished tiles of chunk ``row // chunk_rows`` go by TMA store to that chunk's
  destination (:class:`TileDestinations`: row ``row - chunk*chunk_rows`` of a row-major array, e.g. a
  peer's symmetric buffer) and, when ``flag_table`` is given, raise
  ``flag_table[chunk][local_m_tile * n_tiles + n_tile]`` (set to / add ``signal_value``, release.sys),
  issued from the storer warp of the producer warpgroup.
* :class:`ChunkReduce`   -- (with TileEpilogue) the tiles of one chunk instead get the other sources'
  partials of their rows added in the consumers' epilogue, each after its flag, and go to ``out``:
  the reduce of GEMM+ReduceScatter fused into the GEMM that makes the last partial.
* :class:`RowBands`      -- A or C holds the GEMM's rows in bands with padding rows left out: the fused
  ops' padded calls read A in place (TMA fills the padding rows with zeros) or write C in place (TMA
  clips them), instead of copying through a padded buffer.

Every argument is validated before the first CUDA call (so mistakes surface as exceptions that name
the shapes, and the checks run on CPU-only machines).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import FluxrtError
from .dtypes import normalize_dtype
from .gemm_plan import ITEMSIZE as _ITEMSIZE
from .gemm_plan import SMEM_LIMIT_BYTES, GemmPlan, hilbert_order, plan_gemm

log = logging.getLogger(__name__)

__all__ = ["gemm", "gemm_with_hooks", "ArrivalWait", "TileEpilogue", "TileDestinations", "ChunkReduce",
           "ShardCopy", "RowBands", "GemmArgumentError",
           "GemmTypeError",
           "validate_gemm_args", "kernel_defines"]

KERNEL_SOURCE = "gemm/hopper_gemm.cu"
KERNEL_NAME = "fluxrt_gemm"
_IN_IDS = {"bfloat16": 0, "float16": 1}
_OUT_IDS = {"bfloat16": 0, "float16": 1, "float32": 2}
_TMA_ALIGN = 16   # bytes: TMA global addresses and row strides must be multiples of 16
DEFAULT_TIMEOUT_NS = 10_000_000_000


class GemmArgumentError(FluxrtError, ValueError):
    """A GEMM operand has the wrong shape, layout, alignment or device."""


class GemmTypeError(FluxrtError, TypeError):
    """A GEMM operand has an unsupported type or dtype."""


# --- hooks -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArrivalWait:
    """Hook 1: producer waits for ``flags[chunk] >= epoch`` before loading A rows of that chunk.

    flags: device pointer (int) or array of uint64, one word per chunk of ``chunk_rows`` rows of A.
    err: device/host-mapped pointer of a fluxrt ErrorRecord (6 uint64 words) filled on timeout.
    """
    flags: object
    epoch: int
    chunk_rows: int
    err: object
    chunks_per_peer: int = 1
    timeout_ns: int = DEFAULT_TIMEOUT_NS
    op_id: int = 0
    rank: int = 0


class TileDestinations:
    """Hook 2's per-chunk destinations: the tiles of chunk c (rows ``[c*chunk_rows, (c+1)*chunk_rows)`` of
    C) go to the row-major array at ``ptrs[c]`` (row 0 = the chunk's first row, ``ld`` elements per row,
    element type ``dtype``): local memory or a peer's symmetric buffer alike.

    The kernel stores through one TMA descriptor per chunk, which this object builds per call geometry
    (M, N, chunk_rows: each map holds exactly the rows and columns the call writes, so the TMA clips the
    tails) and keeps in device memory for as long as it lives: build it once, reuse it for every call.
    """

    def __init__(self, ptrs, ld: int, dtype):
        self.ptrs = tuple(int(p) for p in ptrs)
        self.ld = int(ld)
        self.dtype = normalize_dtype(dtype).name
        if not self.ptrs:
            raise GemmArgumentError("gemm: TileDestinations needs at least one destination")
        if self.dtype not in _OUT_IDS:
            raise GemmArgumentError(f"gemm: TileDestinations dtype {self.dtype} is not an output type "
                                    f"({', '.join(_OUT_IDS)})")
        for c, p in enumerate(self.ptrs):
            if p == 0 or p % _TMA_ALIGN:
                raise GemmArgumentError(f"gemm: TileDestinations destination {c} at 0x{p:x} must be non-null and "
                                        f"{_TMA_ALIGN}-byte aligned (TMA)")
        if self.ld <= 0 or (self.ld * _ITEMSIZE[self.dtype]) % _TMA_ALIGN:
            raise GemmArgumentError(f"gemm: TileDestinations rows of ld={self.ld} {self.dtype} elements must be a "
                                    f"positive multiple of {_TMA_ALIGN} bytes (TMA)")
        self._tables: dict = {}

    def check(self, m: int, n: int, chunk_rows: int, out_dtype: str) -> None:
        """The call (M, N, chunk_rows, output type) fits these destinations; before any launch."""
        chunks = -(-m // chunk_rows)
        if chunks > len(self.ptrs):
            raise GemmArgumentError(f"gemm: M={m} in chunks of {chunk_rows} rows needs {chunks} destinations, "
                                    f"TileDestinations has {len(self.ptrs)}")
        if n > self.ld:
            raise GemmArgumentError(f"gemm: N={n} exceeds the destinations' row length ld={self.ld}")
        if out_dtype != self.dtype:
            raise GemmArgumentError(f"gemm: the GEMM writes {out_dtype}, the destinations hold {self.dtype}")

    def tensor_maps(self, m: int, n: int, chunk_rows: int, device_id: int, box_cols: int, box_rows: int):
        """Device array of the call's per-chunk tensor maps (one 128-byte CUtensorMap each), cached."""
        key = (m, n, chunk_rows, device_id, box_cols, box_rows)
        table = self._tables.get(key)
        if table is None:
            import cupy

            maps = [_tensor_map(p, self.dtype, min(chunk_rows, m - c * chunk_rows), n, box_cols, box_rows, ld=self.ld,
                                cache=False)
                    for c, p in enumerate(self.ptrs[:-(-m // chunk_rows)])]
            with cupy.cuda.Device(device_id):
                table = cupy.asarray(np.concatenate(maps).view(np.uint64))   # 256-byte aligned allocation
                # the upload is ordered on the current stream, the kernels that read it may run on any
                cupy.cuda.get_current_stream().synchronize()
            self._tables[key] = table
        return table


@dataclass(frozen=True)
class ChunkReduce:
    """Hook 3: chunk ``chunk``'s tiles are summed with the other sources' partials of the same rows in the
    consumers' epilogue and TMA-stored to ``out`` ([rows of the chunk, N], C's type), with no flag.

    partials: device pointer of source 0's partial of the chunk's rows (row-major, ``ld`` elements per
        row, C's element type); source s's at ``partials + s * source_bytes``. Source ``chunk`` is this
        GEMM itself (its accumulator): never waited for nor read.
    flags: device pointer of source 0's flags (uint64); source s's at ``flags + 8 * s * flag_stride``:
        one per tile (``local_m_tile * n_tiles + n_tile``), or with ``group_n > 0`` one per group of that
        many tile columns (``n_tile // group_n``). A partial is read once its flag is >= ``epoch``
        (bounded wait; on timeout ``err`` names ``op_id``, ``rank`` and the source).
    Sources are added in fixed order 0, 1, ... in fp32 after the accumulator: deterministic.

    where: 'epilogue' (above) or 'tail': the chunk's tiles are stored like the others, into their
        destination, which must be source ``chunk``'s slot of the partials, and each raises source
        ``chunk``'s per-tile flag to ``epoch``. Every consumer warp that has no tile left then claims
        16-row slabs of the chunk (in the order the schedule made their tiles) and sums all sources,
        source ``chunk`` included, in order 0, 1, ... in fp32 into ``out``. The reduce then runs on the
        SMs that the last wave of tiles leaves idle instead of after the GEMM. Needs ``counter``: the
        device pointer of a uint32 that is 0 before the launch (the launch leaves it 0 again), one per
        stream-ordered sequence of launches; and a cluster-1 plan in grouped order whose schedule makes
        the chunk's tiles in one run (its first tile row after ``m_tile_offset`` a multiple of group_m).
    """
    chunk: int
    out: object
    partials: int
    source_bytes: int
    ld: int
    sources: int
    flags: int
    flag_stride: int
    epoch: int
    err: object
    group_n: int = 0
    timeout_ns: int = DEFAULT_TIMEOUT_NS
    op_id: int = 0
    rank: int = 0
    where: str = "epilogue"
    counter: int = 0

    @property
    def hook_id(self) -> int:
        """FLUXRT_GEMM_HOOK_REDUCE of this reduce: 1 in the epilogue, 2 in the tail."""
        return reduce_hook_id(self.where)


REDUCE_WHERE = ("epilogue", "tail")


def reduce_hook_id(where: str | None) -> int:
    """FLUXRT_GEMM_HOOK_REDUCE for a hook-3 reduce at `where` ('epilogue' 1, 'tail' 2; anything else 0)."""
    return REDUCE_WHERE.index(where) + 1 if where in REDUCE_WHERE else 0


@dataclass(frozen=True)
class ShardCopy:
    """Hook 4 (with hook 1): A's rows ``[row0, row0 + rows)`` are read from ``src`` ([rows, K], A's type,
    C-contiguous) instead of A, and the GEMM copies them into A while it runs: a copier warp in every CTA
    moves its share of {64 K x block_m rows} pieces from ``src`` into A by TMA, through a 16 KiB buffer
    of its own (the GEMM's ring never waits for it), then adds the number it stored (release at system
    scope, after the stores completed) to ``counters[chunk]``, chunk = the piece's rows' chunk of
    ``chunk_rows`` counted from row0. Those rows need no arrival flag (hook 1 skips their chunks).

    The fused AllGather+GEMM uses it for the rank's own shard: no copy into the gathered buffer before the
    GEMM starts, and peers learn that a chunk of it is in place by polling its counter, which grows by
    :meth:`pieces_per_chunk` per call.
    row0 and rows: whole chunks (multiples of ``ArrivalWait.chunk_rows``). counters: device pointer of
    uint64 words, one per chunk of these rows.
    """
    src: object
    row0: int
    counters: int

    @staticmethod
    def pieces_per_chunk(chunk_rows: int, k: int, block_m: int = 128, block_k: int = 64) -> int:
        """What a call adds to each chunk's counter: its {block_k x block_m} pieces."""
        return chunk_rows // block_m * -(-k // block_k)


@dataclass(frozen=True)
class TileEpilogue:
    """Hook 2: per-chunk destination + per-tile release flag, written by the storer warp.

    destinations: :class:`TileDestinations` (chunk c's tiles go to its c-th array). flag_table: device
    array (uint64) of per-chunk flag-array pointers (or None for no signal); tile (local_m_tile, n_tile)
    of chunk c raises ``flag_table[c][local_m_tile * n_tiles + n_tile]`` once the tile is stored, or with
    ``flag_group_n > 0`` ``flag_table[c][n_tile // flag_group_n]``: one counter per group of that many
    n tiles, which every tile of the group in the chunk's rows raises (use ``signal_add``).
    reduce: optional :class:`ChunkReduce` (hook 3) for one chunk, whose tiles then skip their destination
    and flag.
    """
    destinations: TileDestinations
    chunk_rows: int
    flag_table: object = None
    signal_value: int = 1
    signal_add: bool = False
    flag_group_n: int = 0
    reduce: ChunkReduce | None = None


@dataclass(frozen=True)
class RowBands:
    """An operand that holds the GEMM's M rows in bands of ``stride`` rows, of which only the first ``rows``
    are in the array: GEMM row y is array row ``(y // stride) * rows + y % stride`` when ``y % stride <
    rows``, else a padding row. As A ([bands * rows, K]) padding rows read as zeros (TMA's out-of-bounds
    fill); as C ([bands * rows, N]) they are not written (TMA clips them). The kernel takes the band height
    from the hooks' chunk geometry, so ``stride`` must be ``ArrivalWait.chunk_rows * chunks_per_peer`` with
    hook 1, ``TileEpilogue.chunk_rows`` with hook 2, and a multiple of the plan's block_m (no tile
    straddles two bands)."""
    rows: int
    stride: int


BANDS_A, BANDS_C = 1, 2   # FLUXRT_GEMM_BANDS bits: banded A, banded C


def band_bits(a_bands: RowBands | None, c_bands: RowBands | None) -> int:
    """FLUXRT_GEMM_BANDS of a launch."""
    return (BANDS_A if a_bands is not None else 0) | (BANDS_C if c_bands is not None else 0)


# --- argument inspection (no CUDA calls) -------------------------------------------------------------

@dataclass(frozen=True)
class _Info:
    shape: tuple
    dtype: str
    strides: tuple | None   # bytes; None = C-contiguous
    ptr: int
    device: int | None
    name: str


def _dtype_name(dt) -> str:
    try:
        return np.dtype(dt).name
    except TypeError:
        return str(getattr(dt, "name", dt))


def _inspect(x, name: str) -> _Info:
    """Shape/dtype/strides/pointer/device of a CUDA array without touching the device."""
    if x is None:
        raise GemmTypeError(f"gemm: {name} is None")
    if isinstance(x, np.ndarray):
        raise GemmTypeError(f"gemm: {name} is a host numpy array {x.shape}; pass a device array (cupy.asarray)")
    try:
        import cupy
        if isinstance(x, cupy.ndarray):
            return _Info(tuple(x.shape), _dtype_name(x.dtype), tuple(x.strides), int(x.data.ptr),
                         int(x.data.device_id), name)
    except ImportError:  # pragma: no cover - cupy is a hard dependency, but keep validation importable
        pass
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        dt = getattr(x, "dtype", None)
        dtype = _dtype_name(dt) if dt is not None else _dtype_name(np.dtype(cai["typestr"]))
        strides = cai.get("strides")
        return _Info(shape, dtype, tuple(strides) if strides is not None else None, int(cai["data"][0]),
                     None, name)
    if hasattr(x, "__dlpack__"):
        shape = tuple(getattr(x, "shape", ()))
        dtype = _dtype_name(getattr(x, "dtype", "?"))
        return _Info(shape, dtype, None, -1, None, name)   # pointer known after cupy.from_dlpack
    raise GemmTypeError(f"gemm: {name} of type {type(x).__name__} is not a CUDA array "
                        f"(needs __cuda_array_interface__ or __dlpack__)")


def _check_matrix(info: _Info, allowed: tuple[str, ...]) -> None:
    if len(info.shape) != 2:
        raise GemmArgumentError(f"gemm: {info.name} must be 2-D, got shape {info.shape}")
    if info.dtype not in allowed:
        raise GemmTypeError(f"gemm: {info.name} has dtype {info.dtype}; supported: {', '.join(allowed)}")
    rows, cols = info.shape
    item = _ITEMSIZE[info.dtype]
    if info.strides is not None and rows > 0 and cols > 0:
        ok_col = cols == 1 or info.strides[1] == item
        ok_row = rows == 1 or info.strides[0] == cols * item
        if not (ok_col and ok_row):
            raise GemmArgumentError(f"gemm: {info.name} {info.shape} must be C-contiguous (row-major), "
                                    f"got strides {info.strides} bytes; use cupy.ascontiguousarray")
    if (cols * item) % _TMA_ALIGN:
        raise GemmArgumentError(f"gemm: rows of {info.name} {info.shape} are {cols * item} bytes; TMA needs a "
                                f"multiple of {_TMA_ALIGN} (the last dimension must be a multiple of "
                                f"{_TMA_ALIGN // item} for {info.dtype})")
    if info.ptr >= 0 and info.ptr % _TMA_ALIGN:
        raise GemmArgumentError(f"gemm: {info.name} {info.shape} starts at 0x{info.ptr:x}, not "
                                f"{_TMA_ALIGN}-byte aligned")


def validate_gemm_args(a, b, out=None, *, trans_b: bool = False, out_dtype: str | None = None,
                       out_rows: int | None = None,
                       out_rows_note: str = "") -> tuple[int, int, int, str, str]:
    """Check operands of C = A @ B (B [K, N]) or A @ B.T (trans_b, B [N, K]); returns (M, N, K, in, out).
    out_rows: the rows out must have when they are not A's (RowBands; out_rows_note says why).

    Raises GemmTypeError / GemmArgumentError naming the offending operand and shapes. Makes no CUDA call.
    """
    ia, ib = _inspect(a, "A"), _inspect(b, "B")
    _check_matrix(ia, tuple(_IN_IDS))
    _check_matrix(ib, tuple(_IN_IDS))
    if ia.dtype != ib.dtype:
        raise GemmTypeError(f"gemm: A is {ia.dtype} but B is {ib.dtype}; both must be the same 16-bit type")
    m, k = ia.shape
    if trans_b:
        n, kb = ib.shape
        bdesc = "B [N, K] (trans_b=True)"
    else:
        kb, n = ib.shape
        bdesc = "B [K, N] (trans_b=False)"
    if kb != k:
        raise GemmArgumentError(f"gemm: inner dimensions differ: A {ia.shape} is [M, K] with K={k}, "
                                f"{bdesc} has shape {ib.shape} (K={kb})")
    if m == 0 or n == 0 or k == 0:
        raise GemmArgumentError(f"gemm: empty problem M={m} N={n} K={k} (A {ia.shape}, B {ib.shape})")
    if m >= 1 << 31 or n >= 1 << 31 or k >= 1 << 31:
        raise GemmArgumentError(f"gemm: dimensions must be < 2^31, got M={m} N={n} K={k}")
    devices = {i.device for i in (ia, ib) if i.device is not None}
    if out is not None:
        io = _inspect(out, "out")
        _check_matrix(io, tuple(_OUT_IDS))
        if out_rows is not None and io.shape != (out_rows, n):
            raise GemmArgumentError(f"gemm: out has shape {io.shape}, expected ({out_rows}, {n}) ({out_rows_note})")
        if out_rows is None and io.shape != (m, n):
            raise GemmArgumentError(f"gemm: out has shape {io.shape}, expected (M, N) = ({m}, {n}) for "
                                    f"A {ia.shape} and {bdesc} {ib.shape}")
        if out_dtype is not None and out_dtype != io.dtype:
            raise GemmTypeError(f"gemm: out is {io.dtype} but out_dtype={out_dtype}")
        out_dt = io.dtype
        if io.device is not None:
            devices.add(io.device)
        for other in (ia, ib):
            if other.ptr >= 0 and io.ptr == other.ptr:
                raise GemmArgumentError(f"gemm: out aliases {other.name}; in-place GEMM is not supported")
    else:
        out_dt = out_dtype or ia.dtype
        if out_dt not in _OUT_IDS:
            raise GemmTypeError(f"gemm: out_dtype {out_dt} not supported; use one of {', '.join(_OUT_IDS)}")
        if (n * _ITEMSIZE[out_dt]) % _TMA_ALIGN:
            raise GemmArgumentError(f"gemm: output rows would be {n * _ITEMSIZE[out_dt]} bytes (N={n}); "
                                    f"need a multiple of {_TMA_ALIGN}")
    if len(devices) > 1:
        raise GemmArgumentError(f"gemm: operands live on different devices {sorted(devices)}")
    return m, n, k, ia.dtype, out_dt


def kernel_defines(plan: GemmPlan, in_dtype: str, out_dtype: str, trans_b: bool, hook_wait: bool = False,
                   hook_epilogue: bool = False, hook_reduce: int = 0,
                   hook_copy: bool = False, bands: int = 0) -> tuple[tuple[str, str], ...]:
    """-D macros that instantiate hopper_gemm.cu for one configuration. hook_reduce: 0 none, 1 (or True)
    hook 3 in the epilogue, 2 hook 3 in the tail (:attr:`ChunkReduce.hook_id`). bands: which operands are
    :class:`RowBands` (:func:`band_bits`)."""
    # hook 4 and bands only when on: every configuration without them keeps its earlier macros (and cache key)
    return (("FLUXRT_GEMM_BANDS", str(bands)),) * (bands > 0) + (("FLUXRT_GEMM_HOOK_COPY", "1"),) * hook_copy + (("FLUXRT_GEMM_BN", str(plan.block_n)), ("FLUXRT_GEMM_CONSUMERS", str(plan.consumers)),
            ("FLUXRT_GEMM_STAGES", str(plan.stages)), ("FLUXRT_GEMM_IN", str(_IN_IDS[in_dtype])),
            ("FLUXRT_GEMM_OUT", str(_OUT_IDS[out_dtype])), ("FLUXRT_GEMM_B_KMAJOR", "1" if trans_b else "0"),
            ("FLUXRT_GEMM_HOOK_WAIT", "1" if hook_wait else "0"),
            ("FLUXRT_GEMM_HOOK_EPILOGUE", "1" if hook_epilogue else "0"),
            ("FLUXRT_GEMM_HOOK_REDUCE", str(int(hook_reduce))),
            ("FLUXRT_GEMM_EPI_DIRECT", "1" if plan.epilogue == "direct" else "0"),
            ("FLUXRT_GEMM_CLUSTER", str(plan.cluster)),
            # 1 only where it changes the kernel (2 consumers): one consumer's plans share one module
            ("FLUXRT_GEMM_C_SHARED", "1" if plan.c_turns > 1 else "0"))


def compile_options(defines, arch: str | None = None):
    from .toolchain import CompileOptions

    return CompileOptions(arch=arch, defines=tuple(defines))


# --- device-side helpers (CUDA from here on) ---------------------------------------------------------

_lock = threading.Lock()
_modules: dict = {}
_order_tables: dict = {}
_tmaps: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_TMAP_CACHE_SIZE = 256
_TMAP_TYPES = {"bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
               "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"}
_TMAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])  # CUtensorMap: 128 opaque bytes


def _kernel(defines, device_id: int, smem_bytes: int):
    """The loaded kernel for one configuration, with its dynamic shared memory limit raised once."""
    key = (defines, device_id)
    with _lock:
        k = _modules.get(key)
    if k is None:
        from .toolchain import load_module

        mod = load_module(KERNEL_SOURCE, compile_options(defines))
        k = mod.get_function(KERNEL_NAME)
        k.max_dynamic_shared_size_bytes = smem_bytes   # > 48 KiB needs the opt-in attribute
        with _lock:
            _modules[key] = k
    return k


def _tensor_map(ptr: int, dtype: str, rows: int, cols: int, box_cols: int, box_rows: int, *, ld: int | None = None,
                bands: int | None = None, cache: bool = True) -> np.ndarray:
    """2-D row-major [rows, cols] tensor map (``ld`` elements per row, default cols), box {box_cols,
    box_rows}, 128B swizzle, zero OOB fill; with ``bands``, 3-D [bands][rows][cols] (consecutive bands of
    rows, box one band deep: RowBands). Returned as a size-1 array of one 128-byte record (CuPy passes it
    by value to the __grid_constant__ TmaDesc). cache=False: not kept in the launch cache."""
    ld = cols if ld is None else ld
    key = (ptr, dtype, rows, cols, box_cols, box_rows, ld, bands)
    with _lock:
        hit = _tmaps.get(key) if cache else None
        if hit is not None:
            _tmaps.move_to_end(key)
            return hit
    from cuda.bindings import driver as drv

    item = _ITEMSIZE[dtype]
    dims, strides, box = [cols, rows], [ld * item], [box_cols, box_rows]
    if bands is not None:
        dims, strides, box = dims + [bands], strides + [rows * ld * item], box + [1]
    err, tmap = drv.cuTensorMapEncodeTiled(
        getattr(drv.CUtensorMapDataType, _TMAP_TYPES[dtype]), len(dims), ptr,
        [drv.cuuint64_t(d) for d in dims], [drv.cuuint64_t(x) for x in strides],
        [drv.cuuint32_t(x) for x in box], [drv.cuuint32_t(1)] * len(dims),
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise GemmArgumentError(f"cuTensorMapEncodeTiled failed ({err}) for a {dtype} "
                                f"[{'' if bands is None else f'{bands}, '}{rows}, {cols}] tensor at 0x{ptr:x}, "
                                f"box [{box_rows}, {box_cols}]")
    words = np.array([int(w) for w in tmap.opaque], dtype=np.uint64)
    arr = words.view(_TMAP_DTYPE).reshape((1,))  # size-1 structured array: by value
    if not cache:
        return arr
    with _lock:
        _tmaps[key] = arr
        while len(_tmaps) > _TMAP_CACHE_SIZE:
            _tmaps.popitem(last=False)
    return arr


_NULL_TMAP = np.zeros((1,), dtype=_TMAP_DTYPE)


def _order_table(plan: GemmPlan, m_tiles: int, n_tiles: int, device_id: int):
    """Hilbert order of the work items: [slot rows, n_tiles], a slot row = plan.cluster tile rows."""
    if plan.order != "hilbert":
        return None
    m_tiles = -(-m_tiles // plan.cluster)
    key = (m_tiles, n_tiles, device_id)
    with _lock:
        t = _order_tables.get(key)
    if t is None:
        import cupy

        if m_tiles >= 1 << 16 or n_tiles >= 1 << 16:
            raise GemmArgumentError(f"gemm: hilbert order supports < 65536 tiles per side, got {m_tiles}x{n_tiles}")
        packed = np.array([(mm << 16) | nn for mm, nn in hilbert_order(m_tiles, n_tiles)], dtype=np.uint32)
        t = cupy.asarray(packed)
        cupy.cuda.get_current_stream().synchronize()   # shared by launches on every stream
        with _lock:
            _order_tables[key] = t
    return t


def _as_device_array(x, name: str):
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    raise GemmTypeError(f"gemm: {name} is not a CUDA array")


def _stream(stream):
    from .streams import as_cupy_stream

    try:
        return as_cupy_stream(stream)
    except TypeError as e:
        raise GemmTypeError(f"gemm: {e}") from e


def _ptr(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (int, np.integer)):
        return int(x)
    if hasattr(x, "data") and hasattr(x.data, "ptr"):
        return int(x.data.ptr)
    if hasattr(x, "__cuda_array_interface__"):
        return int(x.__cuda_array_interface__["data"][0])
    raise GemmTypeError(f"gemm: cannot take a device pointer of {type(x).__name__}")


_sms: dict = {}


def _num_sms(device_id: int) -> int:
    n = _sms.get(device_id)
    if n is None:
        from cupy.cuda import runtime

        n = _sms[device_id] = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id))
    return n


_cluster_caps: dict = {}


def _max_clusters(kern, plan: GemmPlan, smem_bytes: int, device_id: int) -> int | None:
    """How many clusters of plan.cluster CTAs can be resident at once (GPCs may leave SMs unpaired);
    None for plan.cluster == 1 or when the driver cannot say."""
    if plan.cluster == 1:
        return None
    func = kern.kernel.ptr   # cupy.RawKernel -> its loaded CUfunction
    key = (func, device_id)
    if key not in _cluster_caps:
        from cuda.bindings import driver as drv

        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = plan.cluster * _num_sms(device_id), 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = plan.threads, 1, 1
        cfg.sharedMemBytes = smem_bytes
        err, n = drv.cuOccupancyMaxActiveClusters(drv.CUfunction(func), cfg)
        if err != drv.CUresult.CUDA_SUCCESS or n <= 0:
            log.warning("cuOccupancyMaxActiveClusters failed (%s); assuming every SM pairs up", err)
        _cluster_caps[key] = int(n) if err == drv.CUresult.CUDA_SUCCESS and n > 0 else None
    return _cluster_caps[key]


def _check_hooks(wait: ArrivalWait | None, epilogue: TileEpilogue | None, plan: GemmPlan, m: int) -> None:
    for hook, what in ((wait, "ArrivalWait"), (epilogue, "TileEpilogue")):
        if hook is None:
            continue
        if hook.chunk_rows <= 0 or hook.chunk_rows % plan.block_m:
            raise GemmArgumentError(f"gemm: {what}.chunk_rows={hook.chunk_rows} must be a positive multiple of "
                                    f"the tile height block_m={plan.block_m} (a tile must not straddle chunks)")
    if wait is not None:
        if wait.err is None:
            raise GemmArgumentError("gemm: ArrivalWait needs an ErrorRecord pointer (err) for timeouts")
        if wait.chunks_per_peer < 1:
            raise GemmArgumentError(f"gemm: ArrivalWait.chunks_per_peer must be >= 1, got {wait.chunks_per_peer}")
    if epilogue is not None and plan.epilogue != "tma":
        raise GemmArgumentError("gemm: TileEpilogue needs GemmPlan.epilogue='tma' (the storer-warp epilogue)")
    if epilogue is not None and epilogue.flag_group_n < 0:
        raise GemmArgumentError(f"gemm: TileEpilogue.flag_group_n must be >= 0, got {epilogue.flag_group_n}")
    if epilogue is not None and not isinstance(epilogue.destinations, TileDestinations):
        raise GemmArgumentError("gemm: TileEpilogue.destinations must be a TileDestinations, got "
                                f"{type(epilogue.destinations).__name__}")
    if wait is not None and epilogue is not None and wait.chunk_rows != epilogue.chunk_rows:
        raise GemmArgumentError(f"gemm: ArrivalWait.chunk_rows={wait.chunk_rows} and TileEpilogue.chunk_rows="
                                f"{epilogue.chunk_rows} must be equal (the kernel has one chunk size)")
    if wait is not None and 0 in (_ptr(wait.flags), _ptr(wait.err)):
        raise GemmArgumentError(f"gemm: ArrivalWait (op_id={wait.op_id}, rank={wait.rank}) needs non-null flags "
                                "and err: the kernel writes its timeout report through err")


def _check_reduce(red: ChunkReduce, wait: ArrivalWait | None, m: int, n: int, chunk_rows: int, out_dt: str) -> None:
    """Hook 3's arguments, before any CUDA call."""
    if out_dt not in ("bfloat16", "float16"):
        raise GemmArgumentError(f"gemm: ChunkReduce needs 16-bit partials and output (bfloat16, float16), got {out_dt}")
    chunks = -(-m // chunk_rows)
    if not 0 <= red.chunk < chunks:
        raise GemmArgumentError(f"gemm: ChunkReduce.chunk={red.chunk} is not one of the call's {chunks} chunks")
    if not 1 <= red.sources <= 128:
        raise GemmArgumentError(f"gemm: ChunkReduce.sources={red.sources} must be 1..128 (one waiting thread each)")
    if red.group_n < 0 or red.flag_stride < 0:
        raise GemmArgumentError("gemm: ChunkReduce.group_n and flag_stride must be >= 0")
    item = _ITEMSIZE[out_dt]
    for what, v in (("partials", red.partials), ("source_bytes", red.source_bytes), ("ld * itemsize", red.ld * item)):
        if int(v) % _TMA_ALIGN:
            raise GemmArgumentError(f"gemm: ChunkReduce {what}={int(v)} must be a multiple of {_TMA_ALIGN} bytes "
                                    "(bulk L2 prefetch of partial rows)")
    if red.ld < n:
        raise GemmArgumentError(f"gemm: ChunkReduce.ld={red.ld} is shorter than N={n}")
    if 0 in (_ptr(red.partials), _ptr(red.flags), _ptr(red.err)):
        raise GemmArgumentError(f"gemm: ChunkReduce (op_id={red.op_id}, rank={red.rank}) needs non-null partials, "
                                "flags and err: the kernel writes its timeout report through err")
    if wait is not None and (_ptr(wait.err), wait.timeout_ns, wait.rank) != (_ptr(red.err), red.timeout_ns, red.rank):
        raise GemmArgumentError("gemm: ArrivalWait and ChunkReduce must share err, timeout_ns and rank "
                                "(the kernel has one timeout report)")
    rows = min(chunk_rows, m - red.chunk * chunk_rows)
    o = _inspect(red.out, "ChunkReduce.out")
    if o.shape != (rows, n):
        raise GemmArgumentError(f"gemm: ChunkReduce.out must be [{rows}, {n}] (chunk {red.chunk}'s rows), "
                                f"got {list(o.shape)}")
    if o.dtype != out_dt:
        raise GemmTypeError(f"gemm: ChunkReduce.out is {o.dtype}, the GEMM writes {out_dt}")
    if o.strides is not None and o.strides != (n * item, item):
        raise GemmArgumentError(f"gemm: ChunkReduce.out must be C-contiguous, got strides {o.strides}")
    if o.ptr % _TMA_ALIGN:
        raise GemmArgumentError(f"gemm: ChunkReduce.out at 0x{o.ptr:x} must be {_TMA_ALIGN}-byte aligned (TMA)")


def _check_tail(red: ChunkReduce, epilogue: TileEpilogue, plan: GemmPlan, m: int, n: int) -> None:
    """Hook 3 in the tail: the schedule and the chunk's destination fit the tail reducers."""
    if red.where not in REDUCE_WHERE:
        raise GemmArgumentError(f"gemm: ChunkReduce.where must be one of {REDUCE_WHERE}, got {red.where!r}")
    if red.where != "tail":
        return
    if _ptr(red.counter) == 0 or _ptr(red.counter) % 4:
        raise GemmArgumentError("gemm: ChunkReduce(where='tail') needs counter: a non-null, 4-byte aligned device "
                                "pointer of a uint32 that is 0 (the tail reducers claim slabs with it)")
    if plan.cluster != 1 or plan.order != "grouped":
        raise GemmArgumentError(f"gemm: ChunkReduce(where='tail') needs a cluster-1 plan in grouped order, got "
                                f"cluster={plan.cluster}, order={plan.order!r}")
    mt, _ = plan.tiles(m, n)
    chunk_tiles = epilogue.chunk_rows // plan.block_m
    tiles = -(-min(epilogue.chunk_rows, m - red.chunk * epilogue.chunk_rows) // plan.block_m)
    first = (red.chunk * chunk_tiles - plan.m_tile_offset) % mt    # the chunk's first tile row in schedule order
    gm = max(1, plan.group_m)
    if first % gm or first + tiles > mt or (tiles % gm and first + tiles != mt):
        raise GemmArgumentError(f"gemm: ChunkReduce(where='tail'): chunk {red.chunk}'s tile rows are not one run of "
                                f"the schedule (first row {first} after m_tile_offset={plan.m_tile_offset}, "
                                f"{tiles} rows, group_m={gm}, {mt} tile rows)")
    own = red.partials + red.chunk * red.source_bytes
    if epilogue.destinations.ptrs[red.chunk] != own or epilogue.destinations.ld != red.ld:
        raise GemmArgumentError(f"gemm: ChunkReduce(where='tail'): chunk {red.chunk}'s destination must be its own "
                                f"source's slot of the partials (0x{own:x}, ld={red.ld}), got "
                                f"0x{epilogue.destinations.ptrs[red.chunk]:x}, ld={epilogue.destinations.ld}")


def _check_copy(copy: ShardCopy, wait: ArrivalWait | None, m: int, k: int, in_dt: str) -> None:
    """Hook 4's arguments, before any CUDA call."""
    if wait is None:
        raise GemmArgumentError("gemm: ShardCopy needs an ArrivalWait (hook 1): its chunk_rows sizes the counters")
    rows_per_chunk = wait.chunk_rows
    s = _inspect(copy.src, "ShardCopy.src")
    rows = s.shape[0] if len(s.shape) == 2 else -1
    if len(s.shape) != 2 or s.shape[1] != k or rows <= 0:
        raise GemmArgumentError(f"gemm: ShardCopy.src must be [rows, K={k}], got {list(s.shape)}")
    if copy.row0 < 0 or copy.row0 % rows_per_chunk or rows % rows_per_chunk or copy.row0 + rows > m:
        raise GemmArgumentError(f"gemm: ShardCopy rows [{copy.row0}, {copy.row0 + rows}) must be whole chunks of "
                                f"{rows_per_chunk} rows inside A's {m} rows")
    if s.dtype != in_dt:
        raise GemmTypeError(f"gemm: ShardCopy.src is {s.dtype}, A is {in_dt}")
    if s.strides is not None and s.strides != (k * _ITEMSIZE[in_dt], _ITEMSIZE[in_dt]):
        raise GemmArgumentError(f"gemm: ShardCopy.src must be C-contiguous, got strides {s.strides}")
    if s.ptr % _TMA_ALIGN:
        raise GemmArgumentError(f"gemm: ShardCopy.src at 0x{s.ptr:x} must be {_TMA_ALIGN}-byte aligned (TMA)")
    if _ptr(copy.counters) == 0 or _ptr(copy.counters) % 8:
        raise GemmArgumentError("gemm: ShardCopy.counters must be a non-null, 8-byte aligned device pointer")


def _band_stride(a_bands: RowBands | None, c_bands: RowBands | None, wait: ArrivalWait | None,
                 epilogue: TileEpilogue | None) -> int:
    """The band height of a banded launch (0: none), checked against the hooks' chunk geometry."""
    given = [(name, x) for name, x in (("A", a_bands), ("C", c_bands)) if x is not None]
    for name, x in given:
        if not isinstance(x, RowBands):
            raise GemmTypeError(f"gemm: bands of {name} must be a RowBands, got {type(x).__name__}")
        if not 1 <= x.rows <= x.stride:
            raise GemmArgumentError(f"gemm: RowBands of {name}: rows={x.rows} must be in [1, stride={x.stride}]")
    if not given:
        return 0
    stride = given[0][1].stride
    if any(x.stride != stride for _, x in given):
        raise GemmArgumentError(f"gemm: A and C bands have strides {a_bands.stride} and {c_bands.stride}; the "
                                "kernel has one band height")
    hooks = (wait.chunk_rows * wait.chunks_per_peer if wait is not None
             else epilogue.chunk_rows if epilogue is not None else stride)
    if stride != hooks:
        raise GemmArgumentError(f"gemm: RowBands.stride={stride} must equal the hooks' chunk geometry ({hooks} rows: "
                                "ArrivalWait.chunk_rows * chunks_per_peer, else TileEpilogue.chunk_rows)")
    return stride


def _validate_banded(a, b, out, *, trans_b, out_dtype, a_bands, c_bands, stride):
    """validate_gemm_args for a launch with RowBands: (M, N, K, in, out) with M the GEMM's padded rows."""
    rows = _inspect(a, "A").shape[0]
    if a_bands is not None:
        if rows % a_bands.rows:
            raise GemmArgumentError(f"gemm: A has {rows} rows, not whole bands of RowBands.rows={a_bands.rows}")
        m = rows // a_bands.rows * stride
    elif rows % stride:
        raise GemmArgumentError(f"gemm: A has {rows} rows, not whole bands of {stride}")
    else:
        m = rows
    if c_bands is not None:
        out_rows, note = m // stride * c_bands.rows, f"{m // stride} bands of {c_bands.rows} rows"
    else:
        out_rows, note = m, f"the GEMM's M={m}: {m // stride} bands of {stride} rows"
    _, n, k, in_dt, out_dt = validate_gemm_args(a, b, out, trans_b=trans_b, out_dtype=out_dtype, out_rows=out_rows,
                                                out_rows_note=note)
    return m, n, k, in_dt, out_dt


def _check_bands_plan(a_bands, c_bands, stride: int, plan: GemmPlan, epilogue, copy) -> None:
    if stride % plan.block_m:
        raise GemmArgumentError(f"gemm: RowBands.stride={stride} must be a multiple of block_m={plan.block_m} "
                                "(a tile never straddles two bands)")
    if a_bands is not None and copy is not None:
        raise GemmArgumentError("gemm: banded A cannot take ShardCopy (hook 4 stores through A's 2-D map)")
    if c_bands is not None and (epilogue is not None or plan.epilogue != "tma"):
        raise GemmArgumentError("gemm: banded C is stored by the storer warp: no TileEpilogue, "
                                "GemmPlan.epilogue='tma'")


def _validate(a, b, out, *, trans_b, out_dtype, a_bands, c_bands, stride):
    if stride:
        return _validate_banded(a, b, out, trans_b=trans_b, out_dtype=out_dtype, a_bands=a_bands, c_bands=c_bands,
                                stride=stride)
    return validate_gemm_args(a, b, out, trans_b=trans_b, out_dtype=out_dtype)


def _launch(a, b, out, *, trans_b, stream, plan, out_dtype, wait: ArrivalWait | None,
            epilogue: TileEpilogue | None, copy: ShardCopy | None = None, a_bands: RowBands | None = None,
            c_bands: RowBands | None = None):
    stride = _band_stride(a_bands, c_bands, wait, epilogue)
    m, n, k, in_dt, out_dt = _validate(a, b, out, trans_b=trans_b, out_dtype=out_dtype, a_bands=a_bands,
                                       c_bands=c_bands, stride=stride)
    if plan is None:
        plan = plan_gemm(m, n, k, in_dtype=in_dt, out_dtype=out_dt)
    plan.validate(out_dt)
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
    # without hooks the band height travels as chunk_rows (the kernel's band_rows())
    chunk_rows = wait.chunk_rows if wait else (epilogue.chunk_rows if epilogue else stride)
    bands = m // stride if stride else None   # bands of a banded operand's 3-D tensor map

    defines = kernel_defines(plan, in_dt, out_dt, trans_b, wait is not None, epilogue is not None,
                             red.hook_id if red is not None else 0,
                             copy is not None, band_bits(a_bands, c_bands))
    with cupy.cuda.Device(dev):
        smem = plan.smem_bytes(out_dt, shard_copy=copy is not None)
        kern = _kernel(defines, dev, smem)
        mt, nt = plan.tiles(m, n)
        tmap_a = _tensor_map(a.data.ptr, in_dt, a_bands.rows if a_bands else m, k, plan.block_k, plan.block_m,
                             bands=bands if a_bands else None)
        tmap_own = (_tensor_map(own.data.ptr, in_dt, own.shape[0], k, plan.block_k, plan.block_m)
                    if own is not None else _NULL_TMAP)
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
        c_direct = out.data.ptr if (out is not None and epilogue is None and plan.epilogue == "direct") else 0
        dst_tmaps = (epilogue.destinations.tensor_maps(m, n, epilogue.chunk_rows, dev, c_cols, 64)
                     if epilogue is not None else None)
        table = _order_table(plan, mt, nt, dev)
        grid = plan.grid(m, n, _num_sms(dev), _max_clusters(kern, plan, smem, dev))
        # one timeout report per kernel: hook 1's, else hook 3's (_check_reduce: equal when both)
        timed = wait if wait is not None else red
        args = (
            tmap_a, tmap_b, tmap_c, np.int32(m), np.int32(n), np.int32(k),
            np.uint64(_ptr(table)), np.int32(plan.group_m), np.int32(plan.m_tile_offset % mt),
            # hook 1
            np.uint64(_ptr(wait.flags) if wait else 0), np.uint64(wait.epoch if wait else 0),
            np.int32(chunk_rows), np.int32(wait.chunks_per_peer if wait else 1),
            np.uint64(timed.timeout_ns if timed else 0), np.uint64(_ptr(timed.err) if timed else 0),
            np.uint32(wait.op_id if wait else 0), np.uint32(timed.rank if timed else 0),
            # hook 2
            np.uint64(_ptr(dst_tmaps)), np.uint64(_ptr(epilogue.flag_table) if epilogue else 0),
            np.int32(epilogue.flag_group_n if epilogue else 0),
            np.uint64(epilogue.signal_value if epilogue else 0), np.int32(1 if epilogue and epilogue.signal_add else 0),
            np.uint64(c_direct),
            # hook 3
            np.int32(red.chunk if red else -1), np.uint64(_ptr(red.partials) if red else 0),
            np.int64(red.source_bytes if red else 0), np.int64(red.ld if red else 0),
            np.uint32(red.sources if red else 0), np.uint64(_ptr(red.flags) if red else 0),
            np.int64(red.flag_stride if red else 0), np.int32(red.group_n if red else 0),
            np.uint64(red.epoch if red else 0), np.uint32(red.op_id if red else 0),
            # hook 4
            tmap_own, np.int32(copy.row0 if copy else 0), np.int32(own.shape[0] if copy else 0),
            np.uint64(_ptr(copy.counters) if copy else 0),
            # hook 3 in the tail
            np.uint64(red_out.data.ptr if red is not None and red.where == "tail" else 0),
            np.uint64(_ptr(red.counter) if red is not None and red.where == "tail" else 0),
        )
        with _stream(stream):
            kern((grid,), (plan.threads,), args, shared_mem=smem)
    return out


def gemm(a, b, out=None, *, trans_b: bool = False, stream=None, plan: GemmPlan | None = None,
         out_dtype: str | None = None):
    """``out = a @ b`` (``b`` is [K, N]) or ``a @ b.T`` (``trans_b=True``, ``b`` is [N, K]).

    a: [M, K] bf16 or fp16, C-contiguous, on the current device (any __cuda_array_interface__ / DLPack
    array). out: optional [M, N] bf16/fp16/fp32 array (allocated with ``out_dtype`` -- default a's dtype --
    when None). Rows must be 16-byte aligned: K and N multiples of 8 (N of 4 for fp32 out).
    stream: cupy stream, raw cudaStream_t int, or None (current stream). plan: see fluxrt.gemm_plan.
    Returns ``out``.
    """
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
