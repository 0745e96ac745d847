"""Argument checks of a GEMM launch: operands, hooks and row bands, all before the first CUDA call (they
run on machines without a GPU and name the operand and shapes at fault)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..arrays import ArrayInfo as _Info
from ..arrays import check_writable
from ..arrays import inspect as _inspect_array
from ..errors import GemmArgumentError, GemmTypeError
from .hooks import REDUCE_WHERE, ArrivalWait, ChunkReduce, RowBands, ShardCopy, TileDestinations, TileEpilogue
from .plan import IN_DTYPES as IN_IDS
from .plan import ITEMSIZE as _ITEMSIZE
from .plan import OUT_DTYPES as OUT_IDS
from .plan import FP8_FORMATS, FP8_OUT_DTYPES, FP8_SCALE_BLOCK, TMA_ALIGN, GemmPlan

WRITTEN = ("out", "ChunkReduce.out")   # operands the kernel stores into: they must be writable


def _inspect(x, name: str) -> _Info:
    """Shape/dtype/strides/pointer/device of a CUDA array without touching the device (fluxrt.arrays);
    an operand the kernel writes must be writable."""
    info = _inspect_array(x, name=name, op="gemm", error=GemmArgumentError, type_error=GemmTypeError)
    if name in WRITTEN:
        check_writable(info, "gemm", GemmArgumentError)
    return info


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
    if (cols * item) % TMA_ALIGN:
        raise GemmArgumentError(f"gemm: rows of {info.name} {info.shape} are {cols * item} bytes; TMA needs a "
                                f"multiple of {TMA_ALIGN} (the last dimension must be a multiple of "
                                f"{TMA_ALIGN // item} for {info.dtype})")
    if info.ptr >= 0 and info.ptr % TMA_ALIGN:
        raise GemmArgumentError(f"gemm: {info.name} {info.shape} starts at 0x{info.ptr:x}, not "
                                f"{TMA_ALIGN}-byte aligned")


def _check_problem(ia: _Info, ib: _Info, out, m: int, n: int, k: int, kb: int, bdesc: str, *,
                   out_ids: tuple[str, ...], default_out: str, out_dtype: str | None, what: str = "out_dtype",
                   out_rows: int | None = None, out_rows_note: str = "") -> tuple[str, set]:
    """The checks every GEMM flavour shares: inner dimensions, sizes, the output (given: layout, shape, dtype,
    device, no aliasing; allocated: a supported dtype with 16-byte rows). Returns (out dtype, devices seen)."""
    if kb != k:
        raise GemmArgumentError(f"gemm: inner dimensions differ: A {ia.shape} is [M, K] with K={k}, "
                                f"{bdesc} has shape {ib.shape} (K={kb})")
    if m == 0 or n == 0 or k == 0:
        raise GemmArgumentError(f"gemm: empty problem M={m} N={n} K={k} (A {ia.shape}, B {ib.shape})")
    if m >= 1 << 31 or n >= 1 << 31 or k >= 1 << 31:
        raise GemmArgumentError(f"gemm: dimensions must be < 2^31, got M={m} N={n} K={k}")
    devices = {i.device for i in (ia, ib) if i.device is not None}
    if out is None:
        out_dt = out_dtype or default_out
        if out_dt not in out_ids:
            raise GemmTypeError(f"gemm: {what} {out_dt} not supported; use one of {', '.join(out_ids)}")
        if (n * _ITEMSIZE[out_dt]) % TMA_ALIGN:
            raise GemmArgumentError(f"gemm: output rows would be {n * _ITEMSIZE[out_dt]} bytes (N={n}); "
                                    f"need a multiple of {TMA_ALIGN}")
        return out_dt, devices
    io = _inspect(out, "out")
    _check_matrix(io, out_ids)
    if out_rows is not None and io.shape != (out_rows, n):
        raise GemmArgumentError(f"gemm: out has shape {io.shape}, expected ({out_rows}, {n}) ({out_rows_note})")
    if out_rows is None and io.shape != (m, n):
        raise GemmArgumentError(f"gemm: out has shape {io.shape}, expected (M, N) = ({m}, {n}) for "
                                f"A {ia.shape} and {bdesc} {ib.shape}")
    if out_dtype is not None and out_dtype != io.dtype:
        raise GemmTypeError(f"gemm: out is {io.dtype} but out_dtype={out_dtype}")
    if io.device is not None:
        devices.add(io.device)
    for other in (ia, ib):
        if other.ptr >= 0 and io.ptr == other.ptr:
            raise GemmArgumentError(f"gemm: out aliases {other.name}; in-place GEMM is not supported")
    return io.dtype, devices


def validate_gemm_args(a, b, out=None, *, trans_b: bool = False, out_dtype: str | None = None,
                       out_rows: int | None = None,
                       out_rows_note: str = "") -> tuple[int, int, int, str, str]:
    """Check operands of C = A @ B (B [K, N]) or A @ B.T (trans_b, B [N, K]); returns (M, N, K, in, out).
    out_rows: the rows out must have when they are not A's (RowBands; out_rows_note says why).

    Raises GemmTypeError / GemmArgumentError naming the offending operand and shapes. Makes no CUDA call.
    """
    ia, ib = _inspect(a, "A"), _inspect(b, "B")
    _check_matrix(ia, tuple(IN_IDS))
    _check_matrix(ib, tuple(IN_IDS))
    if ia.dtype != ib.dtype:
        raise GemmTypeError(f"gemm: A is {ia.dtype} but B is {ib.dtype}; both must be the same 16-bit type")
    m, k = ia.shape
    if trans_b:
        n, kb = ib.shape
        bdesc = "B [N, K] (trans_b=True)"
    else:
        kb, n = ib.shape
        bdesc = "B [K, N] (trans_b=False)"
    out_dt, devices = _check_problem(ia, ib, out, m, n, k, kb, bdesc, out_ids=tuple(OUT_IDS), default_out=ia.dtype,
                                     out_dtype=out_dtype, out_rows=out_rows, out_rows_note=out_rows_note)
    if len(devices) > 1:
        raise GemmArgumentError(f"gemm: operands live on different devices {sorted(devices)}")
    return m, n, k, ia.dtype, out_dt




@dataclass(frozen=True)
class Fp8Problem:
    """An fp8 GEMM call after its checks: sizes, the fp8 types of A and B (ml_dtypes names), the output type
    and the scale mode (``none``, ``tensor``, ``block``)."""
    m: int
    n: int
    k: int
    a_dtype: str
    b_dtype: str
    out_dtype: str
    scale: str

    @property
    def k_blocks(self) -> int:
        return -(-self.k // FP8_SCALE_BLOCK)

    @property
    def key_dtype(self) -> str:
        """The input part of a plan-cache key: both types and the scale mode."""
        b = "" if self.b_dtype == self.a_dtype else f"x{self.b_dtype}"
        return f"{self.a_dtype}{b}/{self.scale}"


def fp8_formats(fp8_format) -> tuple[str, str]:
    """('e4m3' | 'e5m2') or a pair (A's, B's) -> the ml_dtypes names of A's and B's types."""
    pair = (fp8_format, fp8_format) if isinstance(fp8_format, str) else tuple(fp8_format or ())
    if len(pair) != 2 or any(f not in FP8_FORMATS for f in pair):
        raise GemmTypeError(f"gemm: fp8_format must be one of {', '.join(map(repr, FP8_FORMATS))} or a pair "
                            f"(A's, B's) of them, got {fp8_format!r}")
    return FP8_FORMATS[pair[0]], FP8_FORMATS[pair[1]]


def _check_fp8_operand(info: _Info, fmt: str) -> None:
    if info.dtype in FP8_FORMATS.values():
        raise GemmTypeError(f"gemm: {info.name} has dtype {info.dtype}, which CuPy cannot hold; pass its bytes as "
                            "uint8 (torch: t.view(torch.uint8)) with fp8_format")
    if info.dtype != "uint8":
        raise GemmTypeError(f"gemm: an fp8 GEMM reads {info.name} as uint8 bytes holding {fmt} values, got dtype "
                            f"{info.dtype}")
    _check_matrix(dataclasses.replace(info, dtype=fmt), (fmt,))


def _c_contiguous(shape: tuple, strides: tuple, item: int) -> bool:
    """Whether an array of ``shape`` with byte ``strides`` is laid out row-major without gaps (dimensions of
    one element have no stride that matters; an empty array is)."""
    if 0 in shape:
        return True
    expect = item
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim > 1 and stride != expect:
            return False
        expect *= dim
    return True


def _check_scale(info: _Info, shape: tuple, what: str) -> None:
    if info.dtype != "float32":
        raise GemmTypeError(f"gemm: {info.name} must be float32, got {info.dtype}")
    if info.shape != shape:
        raise GemmArgumentError(f"gemm: {info.name} must have shape {shape} ({what}), got {info.shape}")
    if info.strides is not None and not _c_contiguous(shape, info.strides, 4):
        raise GemmArgumentError(f"gemm: {info.name} {shape} must be C-contiguous (row-major), got strides "
                                f"{info.strides} bytes")
    if info.ptr >= 0 and info.ptr % 4:
        raise GemmArgumentError(f"gemm: {info.name} at 0x{info.ptr:x} is not 4-byte aligned")


def validate_fp8_args(a, b, out=None, *, trans_b: bool = True, fp8_format="e4m3", scale_a=None, scale_b=None,
                      out_dtype: str | None = None) -> Fp8Problem:
    """Check the operands of an fp8 GEMM ``C = (A @ B.T)`` dequantised by the scales; makes no CUDA call.

    A [M, K] and B [N, K] (``trans_b=True``: the only fp8 layout, both operands K-major as the tensor cores
    read fp8) are uint8 arrays of fp8 bytes in ``fp8_format`` ('e4m3', 'e5m2', or a pair for A and B).
    Scales (fp32 device arrays; both or neither):
      per tensor  scale_a, scale_b of one element (shape () or (1,)): C = scale_a * scale_b * A @ B.T
      block       scale_a [M, ceil(K/128)] (one per row and 128 K), scale_b [ceil(N/128), ceil(K/128)]
                  (one per 128 x 128 block of B): C[i, j] = sum_kb scale_a[i, kb] * scale_b[j // 128, kb] *
                  (A[i, kb-block] @ B[j, kb-block])
    out: bf16 or fp16 [M, N] (out_dtype, default bf16, when None).
    """
    fa, fb = fp8_formats(fp8_format)
    ia, ib = _inspect(a, "A"), _inspect(b, "B")
    if not trans_b:
        raise GemmArgumentError("gemm: fp8 GEMMs need B as [N, K] with trans_b=True (both operands K-major: the "
                                "tensor cores read fp8 only that way, as cuBLASLt's 'TN'); transpose B once "
                                "when it is made (weights usually are [N, K])")
    _check_fp8_operand(ia, fa)
    _check_fp8_operand(ib, fb)
    m, k = ia.shape
    n, kb = ib.shape
    out_dt, devices = _check_problem(ia, ib, out, m, n, k, kb, "B [N, K] (trans_b=True)", out_ids=FP8_OUT_DTYPES,
                                     default_out="bfloat16", out_dtype=out_dtype, what="fp8 GEMM output")
    if (scale_a is None) != (scale_b is None):
        raise GemmArgumentError("gemm: pass both scale_a and scale_b, or neither (unscaled fp8)")
    scale = "none"
    if scale_a is not None:
        sa, sb = _inspect(scale_a, "scale_a"), _inspect(scale_b, "scale_b")
        if (sa.ndim <= 1) != (sb.ndim <= 1) or max(sa.ndim, sb.ndim) > 2:
            raise GemmArgumentError(f"gemm: scale_a {sa.shape} and scale_b {sb.shape} must both be per tensor "
                                    "(one element, shape () or (1,)) or both block scales (2-D)")
        kbs = -(-k // FP8_SCALE_BLOCK)
        if sa.ndim <= 1:
            scale = "tensor"
            _check_scale(sa, (1,) * sa.ndim, "a per-tensor scale: one element")
            _check_scale(sb, (1,) * sb.ndim, "a per-tensor scale: one element")
        else:
            scale = "block"
            _check_scale(sa, (m, kbs), f"block scales of A: one per row and {FP8_SCALE_BLOCK} K, [M, ceil(K/128)]")
            _check_scale(sb, (-(-n // FP8_SCALE_BLOCK), kbs),
                         f"block scales of B: one per {FP8_SCALE_BLOCK}x{FP8_SCALE_BLOCK} block, "
                         "[ceil(N/128), ceil(K/128)]")
        devices |= {i.device for i in (sa, sb) if i.device is not None}
    if len(devices) > 1:
        raise GemmArgumentError(f"gemm: operands live on different devices {sorted(devices)}")
    return Fp8Problem(m, n, k, fa, fb, out_dt, scale)


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
        if int(v) % TMA_ALIGN:
            raise GemmArgumentError(f"gemm: ChunkReduce {what}={int(v)} must be a multiple of {TMA_ALIGN} bytes "
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
    if o.ptr % TMA_ALIGN:
        raise GemmArgumentError(f"gemm: ChunkReduce.out at 0x{o.ptr:x} must be {TMA_ALIGN}-byte aligned (TMA)")


def _check_tail(red: ChunkReduce, epilogue: TileEpilogue, plan: GemmPlan, m: int, n: int) -> None:
    """Hook 3 in the tail: the schedule and the chunk's destination fit the tail reducers."""
    if red.where not in REDUCE_WHERE:
        raise GemmArgumentError(f"gemm: ChunkReduce.where must be one of {REDUCE_WHERE}, got {red.where!r}")
    if red.where != "tail":
        return
    if _ptr(red.counter) == 0 or _ptr(red.counter) % 4:
        raise GemmArgumentError("gemm: ChunkReduce(where='tail') needs counter: a non-null, 4-byte aligned device "
                                "pointer of a uint32 that is 0 (the tail reducers claim slabs with it)")
    if plan.cluster_ctas != 1 or plan.order != "grouped":
        raise GemmArgumentError(f"gemm: ChunkReduce(where='tail') needs a cluster-1 plan in grouped order, got "
                                f"cluster={plan.cluster}x{plan.cluster_n}, order={plan.order!r}")
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
    if s.ptr % TMA_ALIGN:
        raise GemmArgumentError(f"gemm: ShardCopy.src at 0x{s.ptr:x} must be {TMA_ALIGN}-byte aligned (TMA)")
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

