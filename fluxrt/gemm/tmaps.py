"""TMA descriptors (CUtensorMap) of the GEMM's operands and the host-built tile-order tables, cached per
geometry: building a tensor map is a driver call, far more than a launch costs on the host."""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..errors import GemmArgumentError
from .plan import ITEMSIZE as _ITEMSIZE
from .plan import GemmPlan, hilbert_order

_lock = threading.Lock()
_order_tables: dict = {}
_tmaps: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_TMAP_CACHE_SIZE = 256
_TMAP_TYPES = {"bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
               "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
               # fp8: bytes to TMA (the tensor cores interpret them; CUDA 12's driver has no fp8 map type)
               "float8_e4m3fn": "CU_TENSOR_MAP_DATA_TYPE_UINT8", "float8_e5m2": "CU_TENSOR_MAP_DATA_TYPE_UINT8"}
_TMAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])  # CUtensorMap: 128 opaque bytes


def tensor_map(ptr: int, dtype: str, rows: int, cols: int, box_cols: int, box_rows: int, *, ld: int | None = None,
               bands: int | None = None, cache: bool = True) -> np.ndarray:
    """2-D row-major [rows, cols] tensor map (``ld`` elements per row, default cols), box {box_cols,
    box_rows}, 128B swizzle, zero OOB fill; with ``bands``, 3-D [bands][rows][cols] (consecutive bands of
    rows, box one band deep: RowBands). Returned as a size-1 array of one 128-byte record (passed by value
    to the kernel's __grid_constant__ parameters). cache=False: not kept in the launch cache."""
    ld = cols if ld is None else ld
    item = _ITEMSIZE[dtype]
    dims, strides, box = (cols, rows), (ld * item,), (box_cols, box_rows)
    if bands is not None:
        dims, strides, box = dims + (bands,), strides + (rows * ld * item,), box + (1,)
    return tensor_map_nd(ptr, dtype, dims, strides, box, cache=cache)


def tensor_map_nd(ptr: int, dtype: str, dims: tuple, strides: tuple, box: tuple, *, cache: bool = True) -> np.ndarray:
    """A tensor map of any rank: ``dims`` innermost first (elements), ``strides`` in bytes of dimensions 1..,
    ``box`` in elements; 128B swizzle, zero fill out of bounds."""
    key = (ptr, dtype, dims, strides, box)
    with _lock:
        hit = _tmaps.get(key) if cache else None
        if hit is not None:
            _tmaps.move_to_end(key)
            return hit
    from cuda.bindings import driver as drv

    err, tmap = drv.cuTensorMapEncodeTiled(
        getattr(drv.CUtensorMapDataType, _TMAP_TYPES[dtype]), len(dims), ptr,
        [drv.cuuint64_t(d) for d in dims], [drv.cuuint64_t(x) for x in strides],
        [drv.cuuint32_t(x) for x in box], [drv.cuuint32_t(1)] * len(dims),
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise GemmArgumentError(f"cuTensorMapEncodeTiled failed ({err}) for a {dtype} tensor at 0x{ptr:x}: dims "
                                f"{list(dims)} (innermost first), byte strides {list(strides)}, box {list(box)}")
    words = np.array([int(w) for w in tmap.opaque], dtype=np.uint64)
    arr = words.view(_TMAP_DTYPE).reshape((1,))  # size-1 structured array: by value
    if not cache:
        return arr
    with _lock:
        _tmaps[key] = arr
        while len(_tmaps) > _TMAP_CACHE_SIZE:
            _tmaps.popitem(last=False)
    return arr


NULL_TMAP = np.zeros((1,), dtype=_TMAP_DTYPE)


def fitted_c_tiles_map(ptr: int, dtype: str, m: int, n: int, block_n: int) -> np.ndarray:
    """Fitted tile widths, staged epilogue: C as [M][N / block_n][block_n] (FitArgs.tmap_c_tiles), so that a store
    into an inner tile column clips its last 128-byte slab at the tile's block_n columns."""
    isz = _ITEMSIZE[dtype]
    return tensor_map_nd(ptr, dtype, (block_n, max(1, n // block_n), m), (block_n * isz, n * isz), (128 // isz, 1, 64))


def order_table(plan: GemmPlan, m_tiles: int, n_tiles: int, device_id: int):
    """Hilbert order of the work items: [slot rows, slot columns], a slot row = plan.cluster tile rows, a slot
    column = plan.cluster_n tile columns."""
    if plan.order != "hilbert":
        return None
    m_tiles = -(-m_tiles // plan.cluster)
    n_tiles = -(-n_tiles // plan.cluster_n)
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

