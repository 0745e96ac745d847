"""Size -> algorithm, pieces and grid for the collectives (pure Python: no GPU, testable anywhere).

Every rank derives the same plan from the same (agreed) arguments, which is what keeps the kernels'
per-block flag slots and workspace slices consistent across ranks.

The thresholds below are provisional: they are to be set from the measured crossover points of
``fluxrt-perf allreduce --algo oneshot`` vs ``--algo twoshot`` (and the grid sizes likewise).
"""
from __future__ import annotations

from dataclasses import dataclass

# Mirrors of kernels/comm/collectives.cu.
MAX_BLOCKS = 128      # kMaxBlocks: flag slots per (phase, source rank)
MAX_WORLD = 32        # kMaxWorld: ranks an exchange table describes
VEC_BYTES = 16        # kVecBytes
THREADS = 512

# Provisional, to be set from measurement (see module docstring).
ONESHOT_MAX_BYTES = 256 << 10        # allreduce: one-shot up to here, two-shot above
ONESHOT_BYTES_PER_BLOCK = 8 << 10    # one-shot grid: a block per this many message bytes ...
ONESHOT_MAX_GRID = 32                # ... up to this many blocks
BULK_BYTES_PER_BLOCK = 16 << 10      # two-shot / reduce-scatter / exchange: a block per this many bytes per peer
BULK_MAX_GRID = 64                   # ... up to this many blocks
DIRECT_MIN_BYTES = 1 << 20           # exchange ops with a symmetric output: direct pushes from here up

REDUCE_OPS = ("sum", "max", "min")
ALGOS = {
    "allreduce": ("oneshot", "twoshot"),
    "reduce_scatter": ("push",),
    "allgather": ("push", "direct"),
    "alltoall": ("push", "direct"),
    "alltoallv": ("push",),
    "broadcast": ("push", "direct"),
}


def _floor(x: int, unit: int) -> int:
    return x - x % unit


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def choose_algo(op: str, nbytes: int, world_size: int, algo: str = "auto", direct_ok: bool = False) -> str:
    """The algorithm `op` uses for an `nbytes` message (`algo` forces one, for measurement).

    'push' stages through the workspace; 'direct' pushes straight into the peers' outputs and needs
    `direct_ok`: the output is a symmetric array (at the same offset on every rank) that the op may write
    while this rank still reads its input."""
    if op not in ALGOS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(ALGOS)}")
    if algo != "auto":
        if algo not in ALGOS[op]:
            raise ValueError(f"{op}: algo {algo!r} not in {ALGOS[op] + ('auto',)}")
        if algo == "direct" and not direct_ok:
            raise ValueError(f"{op}: algo 'direct' needs a symmetric output (world.empty) that does not "
                             "overlap the input")
        return algo
    if op == "allreduce":
        return "oneshot" if nbytes <= ONESHOT_MAX_BYTES or world_size == 1 else "twoshot"
    if direct_ok and "direct" in ALGOS[op] and nbytes >= DIRECT_MIN_BYTES:
        return "direct"
    return ALGOS[op][0]


def oneshot_grid(piece_bytes: int) -> int:
    return max(1, min(ONESHOT_MAX_GRID, _ceil_div(piece_bytes, ONESHOT_BYTES_PER_BLOCK)))


def bulk_grid(bytes_per_peer: int) -> int:
    return max(1, min(BULK_MAX_GRID, _ceil_div(bytes_per_peer, BULK_BYTES_PER_BLOCK)))


@dataclass(frozen=True)
class Piece:
    """One kernel launch: elements [start, start + count) of the message (per peer chunk for chunked ops)."""

    start: int
    count: int
    grid: int
    chunk: int = 0       # two-shot: elements per rank's chunk of this piece (a multiple of 16 bytes)


@dataclass(frozen=True)
class Layout:
    """How a workspace half is cut for one algorithm: `slot_bytes` per source rank."""

    slot_bytes: int
    max_elems: int       # elements per piece (allreduce: of the message; chunked ops: per peer)


def layout(op: str, algo: str, half_bytes: int, world_size: int, itemsize: int) -> Layout:
    """Slots of one workspace half: n slots for one-shot / chunked ops, 2n for two-shot (two phases)."""
    slots = 2 * world_size if algo == "twoshot" else world_size
    slot = _floor(half_bytes // slots, VEC_BYTES)
    if slot < VEC_BYTES:
        raise ValueError(f"workspace half of {half_bytes} bytes is too small for {slots} slots")
    per_slot = slot // itemsize
    max_elems = per_slot * world_size if algo == "twoshot" else per_slot
    return Layout(slot_bytes=slot, max_elems=max_elems)


def allreduce_pieces(count: int, itemsize: int, world_size: int, algo: str, lay: Layout) -> list[Piece]:
    """Launches of an allreduce of `count` elements (an empty list for count 0)."""
    vec = VEC_BYTES // itemsize
    out = []
    for start in range(0, count, lay.max_elems):
        n = min(lay.max_elems, count - start)
        if algo == "oneshot":
            out.append(Piece(start, n, oneshot_grid(n * itemsize)))
        else:
            chunk = _ceil_div(_ceil_div(n, world_size), vec) * vec
            out.append(Piece(start, n, bulk_grid(chunk * itemsize), chunk))
    return out


def direct_pieces(per_peer: int, itemsize: int) -> list[Piece]:
    """Direct rounds need no workspace: the whole message in one launch."""
    return [Piece(0, per_peer, bulk_grid(per_peer * itemsize))] if per_peer else []


def chunked_pieces(per_peer: int, itemsize: int, lay: Layout) -> list[Piece]:
    """Launches of a chunked op moving `per_peer` elements between each pair of ranks."""
    return [Piece(s, min(lay.max_elems, per_peer - s), bulk_grid(min(lay.max_elems, per_peer - s) * itemsize))
            for s in range(0, per_peer, lay.max_elems)]


def alltoallv_pieces(max_pair_count: int, itemsize: int, lay: Layout) -> list[Piece]:
    """Launches of an alltoallv whose largest pair (over all ranks) moves `max_pair_count` elements: at
    least one (every rank takes part in every round, even with nothing to send)."""
    if max_pair_count == 0:
        return [Piece(0, 0, 1)]
    return [Piece(s, lay.max_elems, bulk_grid(min(lay.max_elems, max_pair_count - s) * itemsize))
            for s in range(0, max_pair_count, lay.max_elems)]


def check_world(world_size: int) -> None:
    if world_size > MAX_WORLD:
        raise ValueError(f"collectives support up to {MAX_WORLD} ranks (one NVLink domain), got {world_size}")


def pieces(op: str, algo: str, count: int, itemsize: int, world_size: int, lay: Layout) -> list:
    """The launches of one call. `count`: elements of the message (allreduce) or per peer (alltoallv:
    the largest pair of all ranks)."""
    if op == "allreduce":
        return allreduce_pieces(count, itemsize, world_size, algo, lay)
    if algo == "direct":
        return direct_pieces(count, itemsize)
    if op == "alltoallv":
        return alltoallv_pieces(count, itemsize, lay)
    return chunked_pieces(count, itemsize, lay)


def describe(op: str, count: int, itemsize: int, world_size: int, half_bytes: int, algo: str = "auto",
             direct_ok: bool = False, nbytes: int | None = None) -> dict:
    """What a call would run, for logs and the perf table: algo, launches, grid of the first launch.
    `count`: elements of the message (allreduce) or per peer (the others); `nbytes`: the size the
    algorithm is chosen by (default count * itemsize)."""
    a = choose_algo(op, count * itemsize if nbytes is None else nbytes, world_size, algo, direct_ok)
    lay = layout(op, a, half_bytes, world_size, itemsize)
    ps = pieces(op, a, count, itemsize, world_size, lay)
    return {"algo": a, "launches": len(ps), "grid": ps[0].grid if ps else 0, "slot_bytes": lay.slot_bytes}


__all__ = ["ALGOS", "REDUCE_OPS", "Layout", "Piece", "allreduce_pieces", "alltoallv_pieces", "chunked_pieces",
           "direct_pieces", "pieces",
           "choose_algo", "layout", "describe", "bulk_grid", "oneshot_grid", "check_world", "MAX_WORLD"]