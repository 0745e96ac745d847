"""The GEMM kernel's one parameter, ``Params`` of kernels/gemm/params.cuh, as a numpy structured dtype.

Offsets follow the C layout rules (each field at a multiple of its alignment, a struct's alignment the
largest of its fields', its size a multiple of that); a tensor map is 128 opaque bytes aligned to 64. The
CPU test tests/cpu/test_gemm_params.py compiles the device struct's offsets and sizes and compares them
with this layout field by field. Change both together.
"""
from __future__ import annotations

import numpy as np

TMAP = ("tmap", np.dtype([("opaque", "<u8", (16,))]), 64)   # TmaDesc: __align__(64), 128 bytes
PTR, U64, I64, I32, U32 = "<u8", "<u8", "<i8", "<i4", "<u4"


def _struct(fields) -> tuple[np.dtype, int]:
    """A structured dtype laid out as C lays out ``struct { fields }``; returns (dtype, alignment).
    fields: (name, dtype) or (name, dtype, alignment) or (name, (dtype, alignment)) for nested structs."""
    names, formats, offsets = [], [], []
    off, align = 0, 1
    for f in fields:
        name, dt = f[0], f[1]
        if isinstance(dt, tuple):       # nested: (dtype, alignment)
            dt, a = dt
        else:
            dt = np.dtype(dt)
            a = f[2] if len(f) > 2 else dt.alignment
        off = -(-off // a) * a
        names.append(name)
        formats.append(dt)
        offsets.append(off)
        off += dt.itemsize
        align = max(align, a)
    size = -(-off // align) * align
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size}), align


GEMM_ARGS = _struct([
    ("tmap_a", TMAP[1], 64), ("tmap_b", TMAP[1], 64), ("tmap_c", TMAP[1], 64),
    ("order_table", PTR), ("c_direct", PTR),
    ("m", I32), ("n", I32), ("k", I32), ("group_m", I32), ("m_tile_offset", I32),
    ("chunk_rows", I32), ("chunks_per_peer", I32), ("k_slice", I32),
])
TIMEOUT_ARGS = _struct([("timeout_ns", U64), ("err", PTR), ("rank", U32)])
WAIT_ARGS = _struct([("flags", PTR), ("epoch", U64), ("op_id", U32)])
EPILOGUE_ARGS = _struct([("dst_tmaps", PTR), ("flag_table", PTR), ("signal_value", U64), ("flag_group_n", I32),
                         ("signal_add", I32)])
REDUCE_ARGS = _struct([("partials", PTR), ("source_bytes", I64), ("ld", I64), ("flags", PTR), ("flag_stride", I64),
                       ("epoch", U64), ("chunk", I32), ("sources", U32), ("group_n", I32), ("op_id", U32)])
TAIL_ARGS = _struct([("out", PTR), ("counter", PTR)])
SCALE_ARGS = _struct([("a", PTR), ("b", PTR), ("k_blocks", I32), ("b_group_stride", I32)])
GROUP_ARGS = _struct([("offsets", PTR), ("groups", I32), ("offsets_64", I32), ("arrival_epoch", PTR),
                      ("arrival_sources", U32), ("scatter_homes", U32), ("scatter_rows", PTR), ("scatter_dst", PTR),
                      ("scatter_flags", PTR), ("scatter_ld", I64), ("scatter_entries", I64)])
STREAM_K_ARGS = _struct([("counters", PTR), ("partials", PTR), ("dp_tiles", I32), ("op_id", U32), ("pieces", I32),
                         ("piece_blocks", I32)])
COPY_ARGS = _struct([("tmap_a_own", TMAP[1], 64), ("counters", PTR), ("row0", I32), ("rows", I32)])
FIT_ARGS = _struct([("tmap_c_tiles", TMAP[1], 64)])

PARAMS, _PARAMS_ALIGN = _struct([
    ("gemm", GEMM_ARGS), ("copy", COPY_ARGS), ("timeout", TIMEOUT_ARGS), ("wait", WAIT_ARGS),
    ("epilogue", EPILOGUE_ARGS), ("reduce", REDUCE_ARGS), ("tail", TAIL_ARGS), ("scale", SCALE_ARGS),
    ("group", GROUP_ARGS), ("stream_k", STREAM_K_ARGS), ("fit", FIT_ARGS),
])


def leaf_fields(dtype: np.dtype = PARAMS, prefix: str = "", base: int = 0):
    """(dotted name, offset, size) of every leaf field (a tensor map counts as one leaf), in order."""
    out = []
    for name in dtype.names:
        sub, off = dtype.fields[name][0], dtype.fields[name][1]
        if sub.names is not None and sub.names != ("opaque",):
            out.extend(leaf_fields(sub, f"{prefix}{name}.", base + off))
        else:
            out.append((prefix + name, base + off, sub.itemsize))
    return out


def new_params() -> np.ndarray:
    """A zeroed Params: a size-1 structured array, passed by value (PackedLaunch)."""
    return np.zeros((1,), dtype=PARAMS)


def gemm_params(**gemm) -> np.ndarray:
    """A Params with the given GemmArgs fields (tmap_a, m, n, k, ...), every hook off (zero) and no reduced
    chunk (reduce.chunk = -1): what a launch fills its hooks' fields into."""
    params = new_params()
    g = params["gemm"]
    for name, value in gemm.items():
        g[name] = value
    params["reduce"]["chunk"] = -1
    return params


__all__ = ["PARAMS", "GEMM_ARGS", "TIMEOUT_ARGS", "WAIT_ARGS", "EPILOGUE_ARGS", "REDUCE_ARGS", "TAIL_ARGS",
           "COPY_ARGS", "SCALE_ARGS", "GROUP_ARGS", "STREAM_K_ARGS", "FIT_ARGS", "gemm_params", "leaf_fields",
           "new_params"]
