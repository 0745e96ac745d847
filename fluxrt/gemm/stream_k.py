"""Stream-K: a plain GEMM whose last one or two waves of tiles are cut into K ranges that fill the waves, for
problems whose tiles fill the SMs badly (a partial last wave, or fewer tiles than SMs with a long K).

One launch of the GEMM kernel (FLUXRT_GEMM_STREAM_K). The schedule's first ``dp_tiles`` tiles (whole waves) run
whole, round robin, as without stream-K; each other tile is cut into ``pieces`` K ranges, work units that continue
the round robin piece by piece, so the CTAs of a wave run the same K range of neighbouring tiles (kernels/gemm/
scheduler.cuh, ``StreamK``; the cut: :func:`fluxrt.gemm.plan.stream_k_geometry`). A cut tile's last piece
finishes it: its CTA waits (bounded) on the tile's counter until the other pieces' fp32 partials are in the
workspace, adds them in piece order and stores the tile; the order depends only on the problem and the grid, so
reruns give the same bits. The counters are zero before a launch and reset by the finishing CTAs, so repeated
calls and CUDA-graph replays need no host work.

Workspace, per (device, stream) like split-K's (calls on one stream run one after another): the counters
(zeroed when the buffer is made) and one fp32 tile per piece of a cut tile but its last. A timed-out wait fills a
host-mapped ErrorRecord; the next stream-K launch (or :func:`check_errors`) raises it as a
:class:`WaitTimeoutError` naming the op, until :func:`reset_errors`.
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import ErrorRecordView, op_id
from ..packed_launch import PackedLaunch
from .hooks import DEFAULT_TIMEOUT_NS
from .plan import GemmPlan, stream_k_geometry
from .split_k import workspace

OP_NAME = "gemm stream-K fixup"
MAX_CTAS = 1024          # the persistent grid is at most one CTA per SM

_lock = threading.Lock()
_errors: ErrorRecordView | None = None   # the process's stream-K record (made on the first stream-K call)


def items(plan: GemmPlan, m: int, n: int) -> int:
    """Schedule items of a call: tiles, or with a cluster of 2 along M the pairs' slots (two M tiles each)."""
    mt, nt = plan.tiles(m, n)
    return -(-mt // plan.cluster) * nt


def geometry(plan: GemmPlan, m: int, n: int, k: int, ctas: int) -> tuple[int, int, int]:
    """(dp_items, pieces, piece_blocks) of a call on a grid of ``ctas`` CTAs (:func:`fluxrt.gemm.plan.stream_k_geometry`
    over schedule items and clusters: a pair's CTAs run every unit together, on their two M tiles)."""
    return stream_k_geometry(items(plan, m, n), -(-k // plan.block_k), ctas // plan.cluster,
                             plan.cluster * plan.block_m * plan.block_n * 4)


def units(tiles: int, k_blocks: int, ctas: int, dp: int, pieces: int, piece_blocks: int) -> list[list[tuple]]:
    """Host mirror of the kernel's for_each_unit (scheduler.cuh): per CTA (with a cluster: per cluster, and
    ``tiles`` counts schedule items), its work units (schedule item, first K block, K blocks) in the order it runs
    them. For tests and tools."""
    cut = tiles - dp
    out = []
    for b in range(ctas):
        mine = [(t, 0, k_blocks) for t in range(b, dp, ctas)]
        for u in range(b, cut * pieces, ctas):
            piece, i = divmod(u, cut)
            kb0 = piece * piece_blocks
            mine.append((dp + i, kb0, min(piece_blocks, k_blocks - kb0)))
        out.append(mine)
    return out


def counter_bytes() -> int:
    """Bytes of the counters at the start of every stream-K workspace: one u64 per cut tile and consumer
    warpgroup, for any call (fewer than 2 x MAX_CTAS cut tiles: fewer than two waves of items are cut, an item has
    a tile per CTA of its cluster; 2 warpgroups), so that calls of different shapes sharing a stream's workspace
    never see another call's partials as counters."""
    return 2 * MAX_CTAS * 2 * 8


def partial_bytes(plan: GemmPlan, m: int, n: int, k: int, ctas: int) -> int:
    """Bytes of the fp32 partials: one tile per piece of a cut tile but its last (a cut item has a tile per CTA
    of its cluster, a phantom one's slot unused)."""
    dp, pieces, _ = geometry(plan, m, n, k, ctas)
    return (items(plan, m, n) - dp) * plan.cluster * (pieces - 1) * plan.block_m * plan.block_n * 4


def workspace_bytes(plan: GemmPlan, m: int, n: int, k: int, ctas: int) -> int:
    """Bytes of one call's workspace: the counters at the start, then the partials."""
    return counter_bytes() + partial_bytes(plan, m, n, k, ctas)


def _error_record() -> ErrorRecordView:
    """The stream-K fixup waits' record: one per process, as a plain GEMM belongs to no world."""
    global _errors
    with _lock:
        if _errors is None:
            _errors = ErrorRecordView(ErrorRecordView.allocate())
        return _errors


def check_errors() -> None:
    """Raise the timeout a stream-K fixup wait recorded (WaitTimeoutError naming the op and the CTA of the
    missing piece as its peer), if any. Does not synchronize; sticky until :func:`reset_errors`."""
    err = _errors.poll() if _errors is not None else None
    if err is not None:
        raise err.again()


def clear_record() -> None:
    """Clear a recorded timeout without touching any workspace: for a caller that drops the workspace of the
    stream whose launch timed out instead (the autotuner's private stream)."""
    with _lock:
        if _errors is not None:
            _errors.reset()


def reset_errors() -> None:
    """Clear a recorded timeout and zero the counters of every stream-K workspace (after a synchronize: a
    timed-out launch may have left counts behind)."""
    from .split_k import _lock as ws_lock
    from .split_k import _workspaces

    clear_record()
    with ws_lock:
        bufs = [b for key, lst in _workspaces.items() if key[2:] == (True,) for b in lst]
    for b in bufs:
        b.fill(0)


class StreamKLaunch:
    """The launch of one stream-K call: raises a recorded fixup timeout before enqueueing another."""

    __slots__ = ("gemm", "workspace")

    def __init__(self, gemm: PackedLaunch, ws):
        self.gemm, self.workspace = gemm, ws

    def launch(self, stream_ptr: int) -> None:
        if _errors is not None and (_errors.error is not None or _errors.status.value):
            check_errors()
        self.gemm.launch(stream_ptr)


def fill_params(params: np.ndarray, plan: GemmPlan, m: int, n: int, k: int, grid: int, dev: int, stream_ptr: int,
                timeout_ns: int = DEFAULT_TIMEOUT_NS):
    """Point a plain call's Params at a stream-K workspace of its stream; returns the workspace buffer."""
    if grid > MAX_CTAS:
        raise ValueError(f"stream-K: a grid of {grid} CTAs is more than {MAX_CTAS}")
    dp, pieces, piece_blocks = geometry(plan, m, n, k, grid)
    ws = workspace(dev, stream_ptr, workspace_bytes(plan, m, n, k, grid), zeroed=True)
    host = _error_record().host
    sk = params["stream_k"]
    sk["counters"] = ws.data.ptr
    sk["partials"] = ws.data.ptr + counter_bytes()
    sk["dp_tiles"], sk["pieces"], sk["piece_blocks"] = dp, pieces, piece_blocks
    sk["op_id"] = op_id(OP_NAME)
    t = params["timeout"]
    t["timeout_ns"], t["err"], t["rank"] = timeout_ns, host, 0
    return ws


__all__ = ["OP_NAME", "StreamKLaunch", "check_errors", "clear_record", "counter_bytes", "fill_params", "geometry",
           "items", "partial_bytes", "reset_errors", "units", "workspace_bytes"]
