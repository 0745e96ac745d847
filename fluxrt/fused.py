"""Allreduce fused with the residual add and RMSNorm of the next layer, in one launch.

    res = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, eps=1e-6)
    res.out, res.residual_out                      # [T, H] each, x's dtype (bf16 or fp16)
    q = fluxrt.fused.allreduce_rmsnorm(world, x, residual, weight, quant="per_block")
    q.out, q.scales                                # e4m3 codes [T, H] (uint8), fp32 scales [T, ceil(H / 128)]

For every row r of x [T, H] (tensor-parallel partial sums, one per rank):

    h[r]   = dtype(x_0[r] + ... + x_{n-1}[r] + residual[r])   fp32 in rank order, rounded once -> residual_out
    out[r] = dtype(h[r] / sqrt(mean(h[r]^2) + eps) * weight)   (fp32 arithmetic, rounded once)

With ``quant="per_token"`` (one scale a row) or ``"per_block"`` (one scale per 1 x 128 columns), out holds the
FP8 e4m3 codes of the fp32 normalised row divided by its scale (amax / 448), for the next GEMM; ``scales``
holds the scales (a code times its scale gives the value back).

Algorithms (``plan_allreduce_rmsnorm``, ``algo=`` forces one): 'll' for small messages (every rank pushes its
rows in LL lines to every peer and reduces and normalises every row itself: one NVLink trip, no flag word),
'twoshot' above (reduce-scatter of rows into the workspace, the owner adds the residual, the rows of h are
all-gathered and every rank normalises them). Both compute every value in the same order, so the result is
bitwise the same on every rank and under either algorithm. A call is one launch (a message larger than the
collectives workspace allows goes in several, one per group of rows) on the world's collectives context
(its epoch counter, workspace, LL buffer and flags; calls are ordered with the other collectives), and can
be captured in a CUDA graph. In place: ``out=x`` and ``residual_out=residual`` are allowed.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import collectives as _coll
from . import collectives_plan as plan
from .agreement import agree as _agree
from .agreement import local as _local
from .agreement import meet_after_load
from .arrays import as_array
from .dtypes import bfloat16, normalize_dtype
from .errors import CollectiveArgumentError, op_id
from .nvtx import annotate as _nvtx
from .packed_launch import PackedLaunch
from .topology import require_one_domain

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger(__name__)

KERNEL_SOURCE = "comm/fused.cu"
_KEY = "fluxrt.fused"  # the kernels of the world's fused collectives, in its registry
NORM_DTYPES = {bfloat16: "bf16", np.dtype(np.float16): "fp16"}
QUANT_MODES = {None: 0, "per_token": 1, "per_block": 2}  # kernels: NormQuant
QUANT_GROUP = 128  # columns per scale of "per_block" (kNormGroup)
LINE_BYTES = 8     # message bytes per LL line (kLLData); the twoshot's rows are padded to whole lines
NORM_ALGOS = ("ll", "twoshot")
# Threads of a block (one row a block): 256 keeps three blocks an SM (about 70 registers a thread), so the
# grids of every rank can be resident together also when ranks share a GPU (launch/mps-check.sh)
MAX_THREADS = 256
_u64, _u32 = np.uint64, np.uint32


class AllreduceNormResult(NamedTuple):
    out: object           # [T, H]: x's dtype, or e4m3 codes (uint8) with quant
    residual_out: object  # [T, H]: h
    scales: object        # None, or fp32 [T] (per_token) / [T, ceil(H / 128)] (per_block)


@dataclass(frozen=True)
class NormPiece:
    """One launch: rows [row, row + rows) of the message."""

    row: int
    rows: int
    grid: int


@dataclass(frozen=True)
class NormPlan:
    """How a call runs: the algorithm, its launches, the threads of a block (whole warps, one row a block),
    and the twoshot's geometry (rows of a chunk, bytes between slot rows, slot bytes; LL: slot bytes)."""

    algo: str
    pieces: tuple
    threads: int
    chunk_rows: int = 0
    row_pitch: int = 0
    slot_bytes: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def plan_allreduce_rmsnorm(rows: int, cols: int, world_size: int, itemsize: int, half_bytes: int,
                           ll_half_bytes: int, tuning: plan.Tuning, algo: str = "auto") -> NormPlan:
    """The plan of a call on [rows, cols] 16-bit rows (pure: every rank derives the same one).

    'll' when the message is at most ``tuning.ll_max_bytes`` and its lines fit an LL slot; 'twoshot'
    otherwise, in pieces of whole chunks that fit two areas of n slots in a workspace half."""
    if algo not in ("auto", *NORM_ALGOS):
        raise CollectiveArgumentError(f"allreduce_rmsnorm: algo {algo!r} not in {('auto',) + NORM_ALGOS}")
    lines = _ceil_div(cols * itemsize, LINE_BYTES)
    threads = min(MAX_THREADS, 32 * _ceil_div(lines, 32))
    ll_ok = world_size > 1 and tuning.ll_max_bytes > 0 and ll_half_bytes > 0
    ll_slot = plan.layout("allreduce", "ll", ll_half_bytes, world_size, itemsize).slot_bytes if ll_ok else 0
    fits_ll = ll_ok and rows * lines * plan.LL_LINE_BYTES <= ll_slot
    if algo == "auto":
        algo = "ll" if fits_ll and rows * cols * itemsize <= tuning.ll_max_bytes else "twoshot"
    if algo == "ll":
        if not fits_ll:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: {rows} x {cols} rows do not fit the LL buffer "
                                          f"({ll_slot} bytes a slot); use algo='twoshot'")
        grid = max(1, min(rows, tuning.ll_max_grid))
        return NormPlan("ll", (NormPiece(0, rows, grid),), threads, slot_bytes=ll_slot)
    row_pitch = lines * LINE_BYTES
    slot_cap = (half_bytes // (2 * world_size)) // plan.VEC_BYTES * plan.VEC_BYTES
    chunk_cap = slot_cap // row_pitch
    if chunk_cap < 1:
        raise CollectiveArgumentError(f"allreduce_rmsnorm: a row of {cols} elements does not fit the workspace "
                                      f"({half_bytes} bytes a half for {2 * world_size} slots); enlarge "
                                      "CollectivesOptions.workspace_bytes")
    per_launch = chunk_cap * world_size
    chunk_rows = min(chunk_cap, _ceil_div(rows, world_size))
    pieces = []
    for row in range(0, rows, per_launch):
        n = min(per_launch, rows - row)
        pieces.append(NormPiece(row, n, max(1, min(plan.MAX_BLOCKS, _ceil_div(n, world_size)))))
    slot = _ceil_div(chunk_rows * row_pitch, plan.VEC_BYTES) * plan.VEC_BYTES
    return NormPlan("twoshot", tuple(pieces), threads, chunk_rows=chunk_rows, row_pitch=row_pitch, slot_bytes=slot)


def piece_chunk_rows(p: NormPiece, world_size: int) -> int:
    """Rows of a chunk in one twoshot launch (the last piece may be shorter than the others)."""
    return _ceil_div(p.rows, world_size)


def scales_shape(rows: int, cols: int, quant: str | None) -> tuple | None:
    if quant is None:
        return None
    return (rows,) if quant == "per_token" else (rows, _ceil_div(cols, QUANT_GROUP))


def _overlaps(a, b) -> bool:
    return (a.nbytes > 0 and b.nbytes > 0 and a.data.ptr < b.data.ptr + b.nbytes
            and b.data.ptr < a.data.ptr + a.nbytes)


def check_aliasing(arrays: dict, allowed: set) -> None:
    """Arrays (name -> CuPy array) may overlap only as identical views in the pairs of `allowed`."""
    names = list(arrays)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = arrays[a], arrays[b]
            if not _overlaps(x, y):
                continue
            same = x.data.ptr == y.data.ptr and x.nbytes == y.nbytes
            if not (same and ((a, b) in allowed or (b, a) in allowed)):
                raise CollectiveArgumentError(f"allreduce_rmsnorm: {a} overlaps {b}; only out=x and "
                                              "residual_out=residual are allowed in place")


class _Kernels:
    """The fused-collective kernels of one world (module and functions, loaded on first use)."""

    def __init__(self):
        from .toolchain import load_module

        self.module = load_module(KERNEL_SOURCE)
        self._fns: dict = {}
        self.met = False   # the first collective call has met the other ranks

    def get(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self.module.get_function(name)
        return fn


def kernels(world: World, collective: bool = True) -> _Kernels:
    """The world's fused-collective kernels. collective: called by every rank at the same point of a collective
    call (after its agreement); the first such call meets the other ranks before launching, since one of them
    may have just compiled the module. add_rmsnorm, which is local, passes False."""
    k = world.registry.get_or_create(_KEY, _Kernels)
    if collective and not k.met:
        k.met = True
        meet_after_load(world, "fused collectives: first call")
    return k


def team(ctx, op: str) -> tuple:
    """The team arguments of `ctx` (a ``Collectives``) for kernels reporting timeouts as `op`."""
    return ctx._team_base + (_u32(op_id(op)),)


def _array(x, name: str, world: World, stream, writable: bool = False):
    return as_array(x, name=name, op="allreduce_rmsnorm", writable=writable, stream=stream, device=world.device_id,
                    contiguous=True, error=CollectiveArgumentError, type_error=CollectiveArgumentError)


@_nvtx("allreduce_rmsnorm")
def allreduce_rmsnorm(world: World, x, residual, weight, eps: float = 1e-6, *, out=None, residual_out=None,
                      quant: str | None = None, scales_out=None, stream=None, algo: str = "auto",
                      ctx=None) -> AllreduceNormResult:
    """Allreduce (sum) of x [T, H] over the ranks, plus residual [T, H], then RMSNorm with weight [H]; bf16 or
    fp16, every array of one dtype. Returns ``(out, residual_out, scales)``; outputs not given are
    allocated. quant: None, "per_token" or "per_block" (FP8 e4m3 codes in `out`, uint8 [T, H]; fp32 scales
    in `scales_out`, [T] or [T, ceil(H / 128)]). ctx: the ``Collectives`` context (default: the world's).
    Collective: every rank calls with the same shapes, dtype, eps and quant (checked across ranks unless
    the world's ``check_collective_args`` is off)."""
    if ctx is None:   # the world's context: on a world of several nodes, the hierarchical one has no fused kernels
        require_one_domain(world, "allreduce_rmsnorm", CollectiveArgumentError)
        ctx = _coll.context(world)
    elif not isinstance(ctx, _coll.Collectives):
        raise CollectiveArgumentError(f"allreduce_rmsnorm: ctx must be a fluxrt.Collectives (one NVLink domain), got "
                                      f"{type(ctx).__name__}")
    key = call_key(x, out, residual, weight, residual_out, scales_out, eps, quant, algo)
    result = (AllreduceNormResult(out, residual_out, scales_out) if key is not None else None)
    return ctx._call(key, lambda s: _plan_call(ctx, x, residual, weight, eps, out, residual_out, quant, scales_out,
                                               algo, s),
                     stream, False, result, (x, residual, weight))


def call_key(x, out, residual, weight, residual_out, scales_out, eps, quant, algo) -> tuple | None:
    """The key of a call's validated launches in the context's fast path (used when the world skips the
    cross-rank check): every array's address and layout and the options; None unless every array is a
    CuPy array and every output is given (an allocated output is new on each call)."""
    import cupy

    if out is None or residual_out is None or (quant is not None and scales_out is None):
        return None
    arrays = (x, out, residual, weight, residual_out) + (() if scales_out is None else (scales_out,))
    if not all(isinstance(a, cupy.ndarray) for a in arrays):
        return None
    return ("allreduce_rmsnorm", float(eps), quant, algo) + tuple(
        (a.data.ptr, a.shape, a.strides, a.dtype.str) for a in arrays)


def _plan_call(ctx, x, residual, weight, eps, out, residual_out, quant, scales_out, algo, stream):
    world = ctx.world
    n = world.size

    def prepare():
        if quant not in QUANT_MODES:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: quant {quant!r} not in {tuple(QUANT_MODES)}")
        if not float(eps) > 0.0 or not np.isfinite(float(eps)):
            raise CollectiveArgumentError(f"allreduce_rmsnorm: eps must be a positive finite number, got {eps}")
        a = _array(x, "x", world, stream)
        dt = normalize_dtype(a.dtype)
        if dt not in NORM_DTYPES:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: x must be bf16 or fp16, got {dt}")
        if a.ndim != 2 or a.shape[1] == 0:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: x must be [T, H] with H >= 1, got shape {a.shape}")
        rows, cols = a.shape
        if rows >= 2 ** 31 or cols >= 2 ** 31:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: shape {a.shape} too large")
        res = _array(residual, "residual", world, stream)
        w = _array(weight, "weight", world, stream)
        if res.shape != a.shape or res.dtype != a.dtype:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: residual is {res.dtype} {res.shape}, x {a.dtype} "
                                          f"{a.shape}")
        if w.shape != (cols,) or w.dtype != a.dtype:
            raise CollectiveArgumentError(f"allreduce_rmsnorm: weight must be {a.dtype} ({cols},), got {w.dtype} "
                                          f"{w.shape}")
        if quant is None:
            o = _out(out, "out", a.dtype, a.shape, world, stream)
        else:
            o = _out(out, "out", np.dtype(np.uint8), a.shape, world, stream, codes=True)
        ro = _out(residual_out, "residual_out", a.dtype, a.shape, world, stream)
        sc = None
        if quant is not None:
            sc = _out(scales_out, "scales_out", np.dtype(np.float32), scales_shape(rows, cols, quant), world, stream)
        arrays = {"x": a, "residual": res, "weight": w, "out": o, "residual_out": ro}
        if sc is not None:
            arrays["scales_out"] = sc
        check_aliasing(arrays, {("x", "out"), ("residual", "residual_out")})
        p = plan_allreduce_rmsnorm(rows, cols, n, a.itemsize, ctx.half_bytes, ctx.ll_half_bytes, ctx.tuning, algo)
        return a, res, w, o, ro, sc, p

    got, err = _local(prepare)
    sig = (("shape", None if got is None else tuple(got[0].shape)),
           ("dtype", None if got is None else got[0].dtype.str), ("eps", float(eps)), ("quant", quant),
           ("algo", None if got is None else got[6].algo))
    _agree(world, "allreduce_rmsnorm", sig, err)
    a, res, w, o, ro, sc, p = got
    rows, cols = a.shape
    name = f"fluxrt_allreduce_norm_{p.algo}_{NORM_DTYPES[normalize_dtype(a.dtype)]}"
    fn = kernels(world).get(name)
    tm = team(ctx, "allreduce_rmsnorm")
    rb, ob = cols * a.itemsize, cols * o.itemsize
    groups = 1 if quant == "per_token" else _ceil_div(cols, QUANT_GROUP)
    if log.isEnabledFor(logging.INFO):
        log.info("allreduce_rmsnorm: [%d, %d] %s on %d ranks -> algo %s (%s), %d launch(es), quant %s", rows, cols,
                 a.dtype, n, p.algo, "auto" if algo == "auto" else "forced", len(p.pieces), quant)
    launches = []
    for piece in p.pieces:
        io = (_u64(a.data.ptr + piece.row * rb), _u64(res.data.ptr + piece.row * rb), _u64(w.data.ptr),
              _u64(o.data.ptr + piece.row * ob), _u64(ro.data.ptr + piece.row * rb),
              _u64(0 if sc is None else sc.data.ptr + piece.row * groups * 4),
              _u32(piece.rows), _u32(cols), np.float32(eps), _u32(QUANT_MODES[quant]))
        if p.algo == "ll":
            tail = (_u64(p.slot_bytes),)
        else:
            tail = (_u64(piece_chunk_rows(piece, n)), _u64(p.row_pitch), _u64(p.slot_bytes))
        launches.append(PackedLaunch(fn, piece.grid, p.threads, tm + io + tail, pdl=bool(ctx.tuning.pdl)))
    return tuple(launches), AllreduceNormResult(o, ro, sc)


def add_rmsnorm(world: World, x, residual, weight, eps: float = 1e-6, *, out=None, residual_out=None, quant=None,
                scales_out=None, stream=None) -> AllreduceNormResult:
    """The residual add and RMSNorm of ``allreduce_rmsnorm`` alone, on this rank's (already reduced) x: the
    unfused baseline (an allreduce, then this kernel), with the same device code. Local, not collective."""
    from .streams import as_cupy_stream

    s = as_cupy_stream(stream)
    if quant not in QUANT_MODES:
        raise CollectiveArgumentError(f"add_rmsnorm: quant {quant!r} not in {tuple(QUANT_MODES)}")
    a = _array(x, "x", world, s)
    if normalize_dtype(a.dtype) not in NORM_DTYPES or a.ndim != 2:
        raise CollectiveArgumentError(f"add_rmsnorm: x must be bf16 or fp16 [T, H], got {a.dtype} {a.shape}")
    rows, cols = a.shape
    res, w = _array(residual, "residual", world, s), _array(weight, "weight", world, s)
    if res.shape != a.shape or res.dtype != a.dtype or w.shape != (cols,) or w.dtype != a.dtype:
        raise CollectiveArgumentError("add_rmsnorm: residual must match x, weight must be [H] of x's dtype")
    o = _out(out, "out", np.dtype(np.uint8) if quant else a.dtype, a.shape, world, s, codes=quant is not None)
    ro = _out(residual_out, "residual_out", a.dtype, a.shape, world, s)
    sc = None if quant is None else _out(scales_out, "scales_out", np.dtype(np.float32),
                                         scales_shape(rows, cols, quant), world, s)
    threads = min(MAX_THREADS, 32 * _ceil_div(_ceil_div(cols * a.itemsize, LINE_BYTES), 32))
    fn = kernels(world, collective=False).get(f"fluxrt_add_rmsnorm_{NORM_DTYPES[normalize_dtype(a.dtype)]}")
    args = (_u64(a.data.ptr), _u64(res.data.ptr), _u64(w.data.ptr), _u64(o.data.ptr), _u64(ro.data.ptr),
            _u64(0 if sc is None else sc.data.ptr), _u32(rows), _u32(cols), np.float32(eps),
            _u32(QUANT_MODES[quant]))
    if rows:
        PackedLaunch(fn, min(rows, 65535), threads, args).launch(s.ptr)
    return AllreduceNormResult(o, ro, sc)


def _out(arr, name: str, dtype, shape, world: World, stream, codes: bool = False):
    import cupy

    if arr is None:
        return cupy.empty(shape, dtype=dtype)
    o = _array(arr, name, world, stream, writable=True)
    ok = (o.dtype == np.uint8 or str(o.dtype) == "float8_e4m3fn") if codes else o.dtype == dtype
    if not ok:
        want = "uint8 or float8_e4m3fn (e4m3 codes)" if codes else str(dtype)
        raise CollectiveArgumentError(f"allreduce_rmsnorm: {name} must be {want}, got {o.dtype}")
    if tuple(o.shape) != tuple(shape):
        raise CollectiveArgumentError(f"allreduce_rmsnorm: {name} must have shape {tuple(shape)}, got {o.shape}")
    return o


__all__ = ["allreduce_rmsnorm", "add_rmsnorm", "AllreduceNormResult", "NormPlan", "NormPiece", "plan_allreduce_rmsnorm",
           "scales_shape", "QUANT_MODES"]
