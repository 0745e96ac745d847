"""Size -> algorithm, pieces and grid for the collectives (pure Python: no GPU, testable anywhere).

Every rank derives the same plan from the same (agreed) arguments, which is what keeps the kernels'
per-block flag slots and workspace slices consistent across ranks.

Algorithms:
  ll        small messages: data and flag travel together in 8-byte cells (no fence, one NVLink trip per
            round, twice the bytes on the wire), through a dedicated zeroed LL buffer;
  ll12      allreduce, the same with 6 data bytes and a 16-bit flag per cell: 12 message bytes per 16-byte
            line, 4/3 of the message on the wire (allreduce's LL rounds from ``Tuning.ll12_min_bytes``);
  ll12_twoshot  allreduce from 256 KiB to 4 MiB: reduce-scatter then allgather, both in LL12 lines, in one
            launch (2 (n-1)/n of the message on the wire, times 4/3, for one more NVLink trip);
  oneshot   allreduce: every rank pushes the whole message to every peer, reduces locally;
  twoshot   allreduce: reduce-scatter then allgather of the reduced chunks;
  push      the other ops, staged through the workspace;
  pipe      bulk messages in one launch: each block streams its slice through a ring of steps in the
            peers' workspace slots, pushes of one step overlapping the consumption of earlier ones
            (allreduce: reduce-scatter and allgather phases in the same pass);
  direct    allgather / alltoall / broadcast into symmetric outputs: pushes straight into the peers' outputs.
  ring      allreduce, reduce_scatter, allgather: chunks travel the ring rank -> rank + 1 (reduced on the
            way, as NCCL's ring), each block streaming its slice through a ring of steps in the next rank's
            workspace. Every rank pushes to one peer only, which the fabric carries faster than all-to-all
            pushes; sums are rounded to the dtype at each hop.
The thresholds and grid sizes are a ``Tuning`` (``CollectivesOptions.tuning``), to be set from measured
crossover points (``fluxrt-perf allreduce --algo ll`` vs ``--algo oneshot`` ..., ``--tune key=value``).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

from . import tuning_tables

_log = logging.getLogger("fluxrt.collectives")

# Mirrors of kernels/comm/collectives.cu.
MAX_BLOCKS = 128      # kMaxBlocks: flag slots per (phase, source rank)
MAX_RING_BLOCKS = 256 # kMaxRingBlocks: a ring round's flags are per slice only (world x MAX_BLOCKS slots)
MAX_WORLD = 32        # kMaxWorld: ranks an exchange table describes
VEC_BYTES = 16        # kVecBytes
THREADS = 512
FLAG_PHASES = 6       # kFlagPhases: flag arrays per (source rank, block)
PIPE_STEP_BITS = 20   # kStepBits: steps per (pair, slice) and round stay below 2**20 - 1
PIPE_LINE_BYTES = 128 # kLineBytes: slices of a pipelined round start on whole lines

LL_DATA_BYTES = 8     # kLLData: message bytes per LL line
LL_LINE_BYTES = 16    # kLLLine: bytes of a line on the wire
LL12_DATA_BYTES = 12  # kLL12Data: message bytes per line of the LL12 allreduce
LL_ALGOS = ("ll", "ll12", "ll12_twoshot")  # algorithms that run through the LL buffer
PIPE_ALGOS = ("pipe", "pairwise")  # pipelined rounds (pairwise: the exchange's pairwise phases)
LL12_MAX_THREADS = 512  # the LL12 kernels' registers (84 and 112 on sm_90a) allow at most 512 threads a block

PIPE_STEP_ALIGN = 4 << 10  # pipelined entries are whole 4 KiB pages where they can be

_D = tuning_tables.table(tuning_tables.DEFAULT_KIND)
# The default values under module-level names, for tests and tools that compare against them.
LL_MAX_BYTES = _D["ll_max_bytes"]
ONESHOT_MAX_BYTES = _D["oneshot_max_bytes"]
ONESHOT_MAX_GRID = _D["oneshot_max_grid"]
BULK_MAX_GRID = _D["bulk_max_grid"]
TWOSHOT_MAX_GRID = _D["twoshot_max_grid"]
LL_MAX_GRID = _D["ll_max_grid"]
DIRECT_MIN_BYTES = _D["direct_min_bytes"]
PIPE_MIN_BYTES = _D["pipe_min_bytes"]
PIPE_MAX_GRID = _D["pipe_max_grid"]
PIPE_DEPTH = _D["pipe_depth"]
PIPE_MAX_STEP = _D["pipe_max_step"]
LL12_TWOSHOT_MIN_BYTES = _D["ll12_twoshot_min_bytes"]
LL12_TWOSHOT_MAX_BYTES = _D["ll12_twoshot_max_bytes"]
RING_MIN_BYTES = _D["ring_min_bytes"]


@dataclass(frozen=True)
class Tuning:
    """Size thresholds and grid sizes of the collectives (the same on every rank of a context).

    Defaults: the Hopper NVLink table of ``fluxrt.tuning_tables`` (``Tuning.for_machine`` takes another
    machine's), measured with that module's ``TUNED_WORKSPACE_BYTES`` workspace; docs/tuning.md gives the
    measurements behind every number. Message sizes are nccl-tests sizes in bytes; a threshold of 0
    turns its algorithm off. "A block per X bytes, up to G blocks": grid = min(G, ceil(bytes / X))."""

    # LL while a pair exchanges at most this (see pair_bytes); sizes the LL buffer
    ll_max_bytes: int = _D["ll_max_bytes"]
    # allreduce one-shot up to here (above LL), two-shot above
    oneshot_max_bytes: int = _D["oneshot_max_bytes"]
    # one-shot: a block per this many bytes
    oneshot_bytes_per_block: int = _D["oneshot_bytes_per_block"]
    # one-shot: at most this many blocks
    oneshot_max_grid: int = _D["oneshot_max_grid"]
    # staged push / two-shot: a block per this per peer
    bulk_bytes_per_block: int = _D["bulk_bytes_per_block"]
    # staged push: at most this many blocks
    bulk_max_grid: int = _D["bulk_max_grid"]
    # two-shot allreduce: at most this many blocks
    twoshot_max_grid: int = _D["twoshot_max_grid"]
    # LL: a thread per 8 bytes of the largest pair, up to this many blocks
    ll_max_grid: int = _D["ll_max_grid"]
    # into a symmetric output, push straight into it from here
    direct_min_bytes: int = _D["direct_min_bytes"]
    # pipelined rounds from here (allreduce: above one-shot); 0: never
    pipe_min_bytes: int = _D["pipe_min_bytes"]
    # pipelined / ring: a slice (block) per this many bytes
    pipe_bytes_per_block: int = _D["pipe_bytes_per_block"]
    # pipelined: at most this many slices
    pipe_max_grid: int = _D["pipe_max_grid"]
    # pipelined: ring entries per slice (>= 2)
    pipe_depth: int = _D["pipe_depth"]
    # pipelined exchange ops: cap on an entry's bytes; 0: workspace-sized
    pipe_max_step: int = _D["pipe_max_step"]
    # pipelined allreduce: cap on an entry's bytes; 0: uncapped
    allreduce_pipe_max_step: int = _D["allreduce_pipe_max_step"]
    # allreduce LL rounds from here use 12-byte LL12 lines; 0: never
    ll12_min_bytes: int = _D["ll12_min_bytes"]
    # LL12: threads per block (a thread per line; multiple of 32)
    ll12_threads: int = _D["ll12_threads"]
    # LL12: at most this many blocks
    ll12_max_grid: int = _D["ll12_max_grid"]
    # allreduce: the LL12 two-shot from this many bytes ...
    ll12_twoshot_min_bytes: int = _D["ll12_twoshot_min_bytes"]
    # ... up to this many (0: never); also sizes the LL buffer
    ll12_twoshot_max_bytes: int = _D["ll12_twoshot_max_bytes"]
    # LL12 two-shot: threads per block (a thread per line)
    ll12_twoshot_threads: int = _D["ll12_twoshot_threads"]
    # LL12 two-shot: at most this many blocks
    ll12_twoshot_max_grid: int = _D["ll12_twoshot_max_grid"]
    # allreduce on >= 3 ranks: the ring from here; 0: never
    ring_min_bytes: int = _D["ring_min_bytes"]
    # allreduce, reduce_scatter on 2 ranks: ring from here
    two_rank_ring_min_bytes: int = _D["two_rank_ring_min_bytes"]
    # reduce_scatter, >= 3 ranks: ring from here
    reduce_scatter_ring_min_bytes: int = _D["reduce_scatter_ring_min_bytes"]
    # allgather, >= 3 ranks: ring from here (output bytes)
    allgather_ring_min_bytes: int = _D["allgather_ring_min_bytes"]
    # allgather, 2 ranks: ring from here
    two_rank_allgather_ring_min_bytes: int = _D["two_rank_allgather_ring_min_bytes"]
    # symmetric output: direct below, ring from here
    direct_allgather_ring_min_bytes: int = _D["direct_allgather_ring_min_bytes"]
    # ring: at most this many blocks (slices of a chunk)
    ring_max_grid: int = _D["ring_max_grid"]
    # ring: threads per block (>= 2 warps: they wait on two flags)
    ring_threads: int = _D["ring_threads"]
    # ring: at most this many bytes per entry
    ring_step: int = _D["ring_step"]
    # ring: entries per block in a workspace half (>= 2 ring_substeps)
    ring_depth: int = _D["ring_depth"]
    # ring: entries per stage where a slice spans several entries
    ring_substeps: int = _D["ring_substeps"]
    # ring: blocks tried first for one entry per stage; 0: never
    ring_one_step_max_grid: int = _D["ring_one_step_max_grid"]
    # alltoall (output apart from input), allgather below its ring, >= 3 ranks: pairwise phases from here
    pairwise_min_bytes: int = _D["pairwise_min_bytes"]
    # pairwise: cap on an entry's bytes
    pairwise_max_step: int = _D["pairwise_max_step"]
    # pairwise: 'auto' skips it where entries would be smaller
    pairwise_min_step: int = _D["pairwise_min_step"]
    # pairwise: entries per slice (>= 2)
    pairwise_depth: int = _D["pairwise_depth"]
    # 1: launch rounds with programmatic dependent launch; 0: plain launches
    pdl: int = _D["pdl"]

    @classmethod
    def for_machine(cls, kind: str, **changes) -> "Tuning":
        """The defaults of machine `kind` (a ``tuning_tables.TABLES`` key, see ``machine_kind``), then `changes`."""
        return cls(**{**tuning_tables.table(kind), **changes})

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Tuning.{f.name} must be a non-negative int, got {v!r}")
        for name in ("oneshot_max_grid", "bulk_max_grid", "twoshot_max_grid", "ll_max_grid", "ll12_max_grid",
                     "ll12_twoshot_max_grid", "pipe_max_grid"):
            if not 1 <= getattr(self, name) <= MAX_BLOCKS:
                raise ValueError(f"Tuning.{name} must be in [1, {MAX_BLOCKS}], got {getattr(self, name)}")
        if not 1 <= self.ring_max_grid <= MAX_RING_BLOCKS:
            raise ValueError(f"Tuning.ring_max_grid must be in [1, {MAX_RING_BLOCKS}], got {self.ring_max_grid}")
        if self.ring_one_step_max_grid > MAX_RING_BLOCKS:
            raise ValueError(f"Tuning.ring_one_step_max_grid must be in [0, {MAX_RING_BLOCKS}], got "
                             f"{self.ring_one_step_max_grid}")
        if not 64 <= self.ring_threads <= THREADS or self.ring_threads % 32:
            raise ValueError(f"Tuning.ring_threads must be a multiple of 32 in [64, {THREADS}], got {self.ring_threads}")
        for name in ("ll12_threads", "ll12_twoshot_threads"):
            v = getattr(self, name)
            if not 32 <= v <= LL12_MAX_THREADS or v % 32:
                raise ValueError(f"Tuning.{name} must be a multiple of 32 in [32, {LL12_MAX_THREADS}], got {v}")
        if self.pdl not in (0, 1):
            raise ValueError(f"Tuning.pdl must be 0 or 1, got {self.pdl}")
        if self.ring_substeps < 1 or self.ring_depth < 2 * self.ring_substeps:
            raise ValueError(f"Tuning.ring_depth must be >= 2 x ring_substeps >= 2 (a rank sends stage s + 1 "
                             f"while the next rank reads stage s), got ring_depth={self.ring_depth}, "
                             f"ring_substeps={self.ring_substeps}")
        if self.ring_step < VEC_BYTES:
            raise ValueError(f"Tuning.ring_step must be >= {VEC_BYTES}, got {self.ring_step}")
        for name in ("pipe_depth", "pairwise_depth"):
            if getattr(self, name) < 2:
                raise ValueError(f"Tuning.{name} must be >= 2 (a block sends step j while step j - 1 is "
                                 f"consumed), got {getattr(self, name)}")
        for name in ("oneshot_bytes_per_block", "bulk_bytes_per_block", "pipe_bytes_per_block"):
            if getattr(self, name) < VEC_BYTES:
                raise ValueError(f"Tuning.{name} must be >= {VEC_BYTES}, got {getattr(self, name)}")

    def ll_buffer_bytes(self, world_size: int) -> int:
        """LL buffer per rank: two halves of a slot per source rank, each slot holding ll_max_bytes of data
        (at least one line); with the LL12 two-shot on, a half also holds its two regions of a slot per
        source rank for a 1/n chunk of ll12_twoshot_max_bytes."""
        slot = max(LL_LINE_BYTES, _ceil_div(self.ll_max_bytes, LL_DATA_BYTES) * LL_LINE_BYTES)
        half = world_size * slot
        if self.ll_max_bytes and self.ll12_twoshot_max_bytes and world_size > 1:
            chunk_lines = _ceil_div(_ceil_div(self.ll12_twoshot_max_bytes, LL12_DATA_BYTES), world_size)
            half = max(half, 2 * world_size * chunk_lines * LL_LINE_BYTES)
        return 2 * half

    @classmethod
    def parse(cls, items, base: "Tuning | None" = None) -> "Tuning":
        """Tuning from 'key=value' strings (values in bytes accept K/M/G suffixes), over `base`."""
        from .symmetric import parse_bytes

        names = {f.name for f in dataclasses.fields(cls)}
        changes = {}
        for item in items:
            key, sep, value = str(item).partition("=")
            if not sep or key not in names:
                raise ValueError(f"tuning {item!r}: expected key=value with key one of {', '.join(sorted(names))}")
            changes[key] = int(parse_bytes(value))
        return dataclasses.replace(base or cls(), **changes)


DEFAULT_TUNING = Tuning()

REDUCE_OPS = ("sum", "prod", "max", "min", "avg")  # avg: floats only (the sum divided by the ranks)
RING_OPS = ("allreduce", "reduce_scatter", "allgather")  # the ops with a ring round
PAIRWISE_OPS = ("alltoall", "allgather")  # the ops with pairwise phases
ALGOS = {
    "allreduce": ("ll", "oneshot", "twoshot", "pipe", "ll12", "ll12_twoshot", "ring"),
    "reduce_scatter": ("ll", "push", "pipe", "ring"),
    "allgather": ("ll", "push", "direct", "pipe", "ring", "pairwise"),
    "alltoall": ("ll", "push", "direct", "pipe", "pairwise"),
    "alltoallv": ("ll", "push", "pipe"),
    "broadcast": ("ll", "push", "direct", "pipe"),
}


# An algorithm name is a (scheme, algorithm) pair (kernels/comm/collectives.cu's table): the transfer scheme
# (staged, ll, ll12, pipelined, ring) and what it runs, "<kernel collective>[: <variant>]" where the kernel
# collective is the table's column (allreduce, reduce-scatter, exchange, allgather). The flat names above
# stay the API (algo=, --algo); the pairs are for logs and the perf JSON.
_EXCHANGE_PAIRS = {"ll": ("ll", "exchange"), "push": ("staged", "exchange: push"),
                   "direct": ("staged", "exchange: direct"), "pipe": ("pipelined", "exchange: pipe"),
                   "pairwise": ("pipelined", "exchange: pairwise")}
ALGO_PAIRS: dict[tuple[str, str], tuple[str, str]] = {
    ("allreduce", "ll"): ("ll", "allreduce: one-shot"),
    ("allreduce", "oneshot"): ("staged", "allreduce: one-shot"),
    ("allreduce", "twoshot"): ("staged", "allreduce: reduce-scatter+allgather"),
    ("allreduce", "pipe"): ("pipelined", "allreduce: reduce-scatter+allgather"),
    ("allreduce", "ll12"): ("ll12", "allreduce: one-shot"),
    ("allreduce", "ll12_twoshot"): ("ll12", "allreduce: reduce-scatter+allgather"),
    ("allreduce", "ring"): ("ring", "allreduce: reduce-scatter+allgather"),
    ("reduce_scatter", "ll"): ("ll", "reduce-scatter"),
    ("reduce_scatter", "push"): ("staged", "reduce-scatter"),
    ("reduce_scatter", "pipe"): ("pipelined", "reduce-scatter"),
    ("reduce_scatter", "ring"): ("ring", "reduce-scatter"),
    ("allgather", "ring"): ("ring", "allgather"),
    **{(op, a): _EXCHANGE_PAIRS[a] for op in ("allgather", "alltoall", "alltoallv", "broadcast")
       for a in ALGOS[op] if a in _EXCHANGE_PAIRS},
}


def algo_pair(op: str, algo: str) -> tuple[str, str]:
    """(scheme, algorithm) of `op` run with the algorithm named `algo` (a name choose_algo returns)."""
    try:
        return ALGO_PAIRS[(op, algo)]
    except KeyError:
        raise ValueError(f"{op}: no (scheme, algorithm) pair for algo {algo!r}") from None


def _floor(x: int, unit: int) -> int:
    return x - x % unit


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def choose_algo(op: str, nbytes: int, world_size: int, algo: str = "auto", direct_ok: bool = False,
                tuning: Tuning = DEFAULT_TUNING, overlaps: bool = False, half_bytes: int | None = None,
                itemsize: int = 1) -> str:
    """The algorithm `op` uses for an `nbytes` message of `itemsize`-byte elements; see :func:`_choose_algo`.
    Logged at INFO (FLUXRT_DEBUG=INFO) with the sizes it was chosen for."""
    chosen = _choose_algo(op, nbytes, world_size, algo, direct_ok, tuning, overlaps, half_bytes, itemsize)
    if _log.isEnabledFor(logging.INFO):
        _log.info("%s: %d bytes on %d ranks (%d per pair) -> algo %s (%s%s%s)", op, nbytes, world_size,
                  pair_bytes(op, nbytes, world_size), chosen, "auto" if algo == "auto" else "forced",
                  ", symmetric output" if direct_ok else "", ", in place" if overlaps else "")
    return chosen


def ll12_fits(itemsize: int) -> bool:
    """Whether an LL12 line (12 message bytes) holds whole elements of `itemsize` bytes: the LL12 reductions
    combine the elements of one line (fp64 and int64 have no LL12 round)."""
    return LL12_DATA_BYTES % max(1, itemsize) == 0


def _choose_algo(op: str, nbytes: int, world_size: int, algo: str = "auto", direct_ok: bool = False,
                 tuning: Tuning = DEFAULT_TUNING, overlaps: bool = False, half_bytes: int | None = None,
                 itemsize: int = 1) -> str:
    """The algorithm `op` uses for an `nbytes` message (`algo` forces one, for measurement).

    'push' stages through the workspace; 'direct' pushes straight into the peers' outputs and needs
    `direct_ok`: the output is a symmetric array (at the same offset on every rank) that the op may write
    while this rank still reads its input. 'll' needs a context with an LL buffer (tuning.ll_max_bytes > 0).
    'pairwise' needs an output that does not `overlap` the input; given the workspace `half_bytes`, 'auto'
    takes it only where its entries reach tuning.pairwise_min_step."""
    if op not in ALGOS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(ALGOS)}")
    if algo != "auto":
        if algo not in ALGOS[op]:
            raise ValueError(f"{op}: algo {algo!r} not in {ALGOS[op] + ('auto',)}")
        if algo == "direct" and not direct_ok:
            raise ValueError(f"{op}: algo 'direct' needs a symmetric output (world.empty) that does not "
                             "overlap the input")
        if algo in LL_ALGOS and tuning.ll_max_bytes == 0:
            raise ValueError(f"{op}: algo {algo!r} needs an LL buffer (Tuning.ll_max_bytes > 0)")
        if algo in ("ll12", "ll12_twoshot") and not ll12_fits(itemsize):
            raise ValueError(f"{op}: algo {algo!r} needs elements that divide a 12-byte line, not {itemsize}-byte ones")
        if algo == "pairwise" and overlaps:
            raise ValueError(f"{op} of {nbytes} bytes: algo 'pairwise' needs an output apart from the input "
                             "(in place, use 'pipe' or 'auto')")
        return algo
    ll12_ok = ll12_fits(itemsize)
    if (op == "allreduce" and world_size > 1 and tuning.ll_max_bytes > 0 and ll12_ok
            and tuning.ll12_twoshot_min_bytes <= nbytes <= tuning.ll12_twoshot_max_bytes):
        return "ll12_twoshot"
    if world_size > 1 and pair_bytes(op, nbytes, world_size) <= tuning.ll_max_bytes:
        ll12 = op == "allreduce" and ll12_ok and tuning.ll12_min_bytes > 0 and nbytes >= tuning.ll12_min_bytes
        return "ll12" if ll12 else "ll"
    if op == "allgather":
        ring_min = tuning.two_rank_allgather_ring_min_bytes if world_size == 2 else tuning.allgather_ring_min_bytes
        if direct_ok and ring_min:  # a symmetric output: direct pushes need no staging copy
            ring_min = max(ring_min, tuning.direct_allgather_ring_min_bytes)
    elif world_size == 2:
        ring_min = tuning.two_rank_ring_min_bytes
    else:
        ring_min = tuning.reduce_scatter_ring_min_bytes if op == "reduce_scatter" else tuning.ring_min_bytes
    if op in RING_OPS and world_size > 1 and 0 < ring_min <= nbytes:
        return "ring"
    pipe = world_size > 1 and tuning.pipe_min_bytes > 0 and nbytes >= tuning.pipe_min_bytes
    if op == "allreduce":
        if nbytes <= tuning.oneshot_max_bytes or world_size == 1:
            return "oneshot"
        return "pipe" if pipe else "twoshot"
    if direct_ok and "direct" in ALGOS[op] and nbytes >= tuning.direct_min_bytes:
        return "direct"
    if (op in PAIRWISE_OPS and world_size > 2 and not overlaps and 0 < tuning.pairwise_min_bytes <= nbytes
            and (half_bytes is None or pairwise_step(nbytes, world_size, half_bytes, tuning) >= tuning.pairwise_min_step)):
        return "pairwise"
    return "pipe" if pipe else "push"


def pair_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one pair of ranks exchanges for an nccl-tests size of `nbytes` (alltoallv: pass the largest
    pair times world_size)."""
    return nbytes if op in ("allreduce", "broadcast") else -(-nbytes // world_size)


def oneshot_grid(piece_bytes: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    return max(1, min(tuning.oneshot_max_grid, _ceil_div(piece_bytes, tuning.oneshot_bytes_per_block)))


def bulk_grid(bytes_per_peer: int, tuning: Tuning = DEFAULT_TUNING, max_grid: int = 0) -> int:
    return max(1, min(max_grid or tuning.bulk_max_grid, _ceil_div(bytes_per_peer, tuning.bulk_bytes_per_block)))


def pipe_roles(op: str) -> int:
    """Blocks per slice of a pipelined round (kernel: sender, [reducer,] receiver)."""
    return 3 if op == "allreduce" else 2


def pipe_slices(bytes_per_peer: int, roles: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    return max(1, min(tuning.pipe_max_grid, MAX_BLOCKS // roles, _ceil_div(bytes_per_peer, tuning.pipe_bytes_per_block)))


def pipe_step(slot_bytes: int, slices: int, depth: int, slice_bytes: int, max_step: int = 0) -> int:
    """Bytes per ring entry of a pipelined round: a slot holds `depth` entries for each of `slices`
    slices (16-byte multiples), at most `max_step` (if > 0). `slice_bytes`: the largest slice of one pair."""
    step = slot_bytes // (slices * depth)
    if max_step > 0:
        step = min(step, max_step)
    # whole 4 KiB pages where it can (with 128-byte slice starts every entry and copy is line-aligned)
    step = _floor(step, PIPE_STEP_ALIGN) if step >= PIPE_STEP_ALIGN else _floor(step, VEC_BYTES)
    if step < VEC_BYTES:
        raise ValueError(f"workspace slot of {slot_bytes} bytes is too small for {slices} slices x {depth} "
                         "pipelined steps")
    if _ceil_div(slice_bytes, step) >= (1 << PIPE_STEP_BITS) - 1:
        raise ValueError(f"a block slice of {slice_bytes} bytes needs 2**{PIPE_STEP_BITS} - 1 steps or more of "
                         f"{step} bytes: enlarge the workspace")
    return step


@functools.lru_cache(maxsize=256)
def pairwise_step(nbytes: int, world_size: int, half_bytes: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Bytes per ring entry of a pairwise alltoall of `nbytes` (0 where the workspace half is too small).
    Cached: choose_algo asks on every eager alltoall call from pairwise_min_bytes."""
    pair = _ceil_div(nbytes, world_size)
    try:
        return _pipe_piece("alltoall", 0, pair, pair, layout("alltoall", "pairwise", half_bytes, world_size, 1),
                           tuning, pairwise=True).step
    except ValueError:
        return 0


def ring_slices(chunk_bytes: int, tuning: Tuning = DEFAULT_TUNING, max_grid: int = 0) -> int:
    """Blocks of a ring round: one per slice of a chunk (at most `max_grid`, default tuning.ring_max_grid)."""
    return max(1, min(max_grid or tuning.ring_max_grid, _ceil_div(chunk_bytes, tuning.pipe_bytes_per_block)))


def _ring_slice_bytes(chunk_bytes: int, slices: int) -> int:
    """Bytes of a block's slice (kernels: pipe_range, whole 128-byte lines)."""
    return _ceil_div(_ceil_div(chunk_bytes, slices), PIPE_LINE_BYTES) * PIPE_LINE_BYTES


def ring_step(half_bytes: int, slices: int, world_size: int, chunk_bytes: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Bytes per ring entry of a ring round: at most tuning.ring_step, and the workspace half holds
    ring_depth entries per slice; the entries one rank sends per slice and round (2 (n - 1) stages of
    ring_substeps entries for every piece of a slice, allreduce) stay below 2**PIPE_STEP_BITS - 1."""
    slice_bytes = _ring_slice_bytes(chunk_bytes, slices)
    # every step of a stage carries data where the slice allows (an empty step hides no latency)
    per_step = _ceil_div(_ceil_div(slice_bytes, tuning.ring_substeps), PIPE_STEP_ALIGN) * PIPE_STEP_ALIGN
    step = min(tuning.ring_step, half_bytes // (slices * tuning.ring_depth), per_step)
    step = _floor(step, PIPE_STEP_ALIGN) if step >= PIPE_STEP_ALIGN else _floor(step, VEC_BYTES)
    if step < VEC_BYTES:
        raise ValueError(f"workspace half of {half_bytes} bytes is too small for {slices} slices x "
                         f"{tuning.ring_depth} ring entries")
    piece = step * tuning.ring_substeps
    if _ceil_div(slice_bytes, piece) * tuning.ring_substeps * 2 * max(1, world_size - 1) >= (1 << PIPE_STEP_BITS) - 1:
        raise ValueError(f"a block slice of {slice_bytes} bytes needs 2**{PIPE_STEP_BITS} - 1 ring entries or "
                         f"more of {step} bytes: enlarge the workspace")
    return step


@dataclass(frozen=True)
class RingGeometry:
    """A ring round's launch: `slices` blocks, entries of `step` bytes, `depth` of them per block,
    `substeps` per stage."""

    slices: int
    step: int
    depth: int
    substeps: int


def ring_geometry(half_bytes: int, world_size: int, chunk_bytes: int, tuning: Tuning = DEFAULT_TUNING) -> RingGeometry:
    """One step per stage where a block's slice fits one entry (whole 4 KiB pages, at most ring_step, at
    least two per block in the half), on at most ring_one_step_max_grid blocks, else ring_max_grid: each
    stage then costs a block one fence and one flag. Otherwise ring_substeps entries per stage of each
    piece of a slice, ring_depth entries per block (ring_step)."""
    grids = (tuning.ring_one_step_max_grid, tuning.ring_max_grid) if tuning.ring_one_step_max_grid else ()
    for grid in grids:
        slices = ring_slices(chunk_bytes, tuning, min(grid, tuning.ring_max_grid))
        step = _ceil_div(_ring_slice_bytes(chunk_bytes, slices), PIPE_STEP_ALIGN) * PIPE_STEP_ALIGN
        fits = half_bytes // (slices * step)
        if step <= tuning.ring_step and fits >= 2:
            return RingGeometry(slices, step, min(tuning.ring_depth, fits), 1)
    slices = ring_slices(chunk_bytes, tuning)
    return RingGeometry(slices, ring_step(half_bytes, slices, world_size, chunk_bytes, tuning), tuning.ring_depth,
                        tuning.ring_substeps)


def ll_grid(bytes_per_peer: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """One thread per LL line of the largest pair."""
    return max(1, min(tuning.ll_max_grid, _ceil_div(_ceil_div(bytes_per_peer, LL_DATA_BYTES), THREADS)))


def ll12_grid(nbytes: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """One thread per LL12 line of the message."""
    return max(1, min(tuning.ll12_max_grid, _ceil_div(_ceil_div(nbytes, LL12_DATA_BYTES), tuning.ll12_threads)))


def ll12_twoshot_chunk(nbytes: int, world_size: int) -> int:
    """LL12 lines of each rank's chunk in the two-shot (the kernel's `chunk`; the last chunks may be short)."""
    return _ceil_div(_ceil_div(nbytes, LL12_DATA_BYTES), world_size)


def ll12_twoshot_grid(nbytes: int, world_size: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """One thread per LL12 line of a chunk."""
    return max(1, min(tuning.ll12_twoshot_max_grid,
                      _ceil_div(ll12_twoshot_chunk(nbytes, world_size), tuning.ll12_twoshot_threads)))


def block_threads(algo: str, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Threads per block of a launch of `algo`."""
    return {"ll12": tuning.ll12_threads, "ll12_twoshot": tuning.ll12_twoshot_threads,
            "ring": tuning.ring_threads}.get(algo, THREADS)


def _grid(algo: str, bytes_per_peer: int, tuning: Tuning) -> int:
    return ll_grid(bytes_per_peer, tuning) if algo == "ll" else bulk_grid(bytes_per_peer, tuning)


@dataclass(frozen=True)
class Piece:
    """One kernel launch: elements [start, start + count) of the message (per peer chunk for chunked ops)."""

    start: int
    count: int
    grid: int
    chunk: int = 0       # two-shot, pipe allreduce: elements per rank's chunk (a multiple of 16 bytes)
    step: int = 0        # pipe, ring: bytes per ring entry
    depth: int = 0       # pipe, ring: ring entries per slice
    substeps: int = 0    # ring: entries per stage of a piece


@dataclass(frozen=True)
class Layout:
    """How a workspace half is cut for one algorithm: `slot_bytes` per source rank."""

    slot_bytes: int
    max_elems: int       # elements per piece (allreduce: of the message; chunked ops: per peer)


def layout(op: str, algo: str, half_bytes: int, world_size: int, itemsize: int) -> Layout:
    """Slots of one workspace half (LL: of one LL buffer half): n slots for one-shot / chunked ops / LL,
    2n for two-shot (two phases), n - 1 per ring for pipe (allreduce: two rings). An LL slot carries half
    its bytes as data, in whole 8-byte lines."""
    slots = 2 * world_size if algo in ("twoshot", "ll12_twoshot") else world_size
    if algo in PIPE_ALGOS:  # no rank sends to itself: world - 1 slots per ring (allreduce: two rings)
        slots = max(1, world_size - 1) * (2 if op == "allreduce" else 1)
    slot = _floor(half_bytes // slots, VEC_BYTES)
    if algo in PIPE_ALGOS and slot >= PIPE_STEP_ALIGN:  # every slot, and so every entry, starts on a page
        slot = _floor(slot, PIPE_STEP_ALIGN)
    if slot < VEC_BYTES:
        raise ValueError(f"workspace half of {half_bytes} bytes is too small for {slots} slots")
    if algo == "ll12_twoshot":  # a slot holds one line per line of a chunk: n chunks of 12 bytes a line
        lines = slot // LL_LINE_BYTES
        return Layout(slot_bytes=slot, max_elems=max(1, lines * world_size * LL12_DATA_BYTES // itemsize))
    if algo in LL_ALGOS:  # ll12 lines carry 12 bytes: slots sized for 8 a line hold its pieces too
        return Layout(slot_bytes=slot, max_elems=max(1, _floor(slot // 2, LL_DATA_BYTES) // itemsize))
    if algo in PIPE_ALGOS:  # the ring recycles its entries: one launch moves any size
        return Layout(slot_bytes=slot, max_elems=1 << 62)
    if algo == "ring":  # one ring per block, from the previous rank only: the whole half is one slot
        return Layout(slot_bytes=_floor(half_bytes, VEC_BYTES), max_elems=1 << 62)
    per_slot = slot // itemsize
    max_elems = per_slot * world_size if algo == "twoshot" else per_slot
    return Layout(slot_bytes=slot, max_elems=max_elems)


def allreduce_pieces(count: int, itemsize: int, world_size: int, algo: str, lay: Layout,
                     tuning: Tuning = DEFAULT_TUNING) -> list[Piece]:
    """Launches of an allreduce of `count` elements (an empty list for count 0)."""
    vec = VEC_BYTES // itemsize
    out = []
    for start in range(0, count, lay.max_elems):
        n = min(lay.max_elems, count - start)
        if algo == "oneshot":
            out.append(Piece(start, n, oneshot_grid(n * itemsize, tuning)))
        elif algo == "ll":
            out.append(Piece(start, n, ll_grid(n * itemsize, tuning)))
        elif algo == "ll12":
            out.append(Piece(start, n, ll12_grid(n * itemsize, tuning)))
        elif algo == "ll12_twoshot":
            out.append(Piece(start, n, ll12_twoshot_grid(n * itemsize, world_size, tuning)))
        else:  # two-shot, pipe and ring: a chunk per rank, whole 16-byte vectors
            chunk = _ceil_div(_ceil_div(n, world_size), vec) * vec
            if algo == "ring":
                out.append(_ring_piece("allreduce", start, n, chunk, itemsize, world_size, lay, tuning))
                continue
            out.append(_pipe_piece("allreduce", start, n, chunk * itemsize, lay, tuning, chunk) if algo == "pipe"
                       else Piece(start, n, bulk_grid(chunk * itemsize, tuning, tuning.twoshot_max_grid), chunk))
    return out


def _pipe_piece(op: str, start: int, count: int, pair_bytes: int, lay: Layout, tuning: Tuning,
                chunk: int = 0, pairwise: bool = False) -> Piece:
    """One pipelined launch: `roles` blocks per slice (grid = roles x slices)."""
    roles = pipe_roles(op)
    slices = pipe_slices(pair_bytes, roles, tuning)
    slice_bytes = _ceil_div(_ceil_div(pair_bytes, slices), PIPE_LINE_BYTES) * PIPE_LINE_BYTES
    if pairwise:
        depth, cap = tuning.pairwise_depth, tuning.pairwise_max_step
    else:
        depth, cap = tuning.pipe_depth, tuning.allreduce_pipe_max_step if op == "allreduce" else tuning.pipe_max_step
    try:
        step = pipe_step(lay.slot_bytes, slices, depth, slice_bytes, cap)
    except ValueError as e:
        raise ValueError(f"{op} of {count} elements ({pair_bytes} bytes per pair), pipelined: {e}") from None
    return Piece(start, count, roles * slices, chunk, step, depth)


def _ring_piece(op: str, start: int, count: int, chunk: int, itemsize: int, world_size: int, lay: Layout,
                tuning: Tuning) -> Piece:
    """The one launch of a ring round: a block per slice of a chunk of `chunk` elements."""
    try:
        g = ring_geometry(lay.slot_bytes, world_size, chunk * itemsize, tuning)
    except ValueError as e:
        raise ValueError(f"{op} of {count} elements, ring: {e}") from None
    return Piece(start, count, g.slices, chunk, g.step, g.depth, g.substeps)


def direct_pieces(per_peer: int, itemsize: int, tuning: Tuning = DEFAULT_TUNING) -> list[Piece]:
    """Direct rounds need no workspace: the whole message in one launch."""
    return [Piece(0, per_peer, bulk_grid(per_peer * itemsize, tuning))] if per_peer else []


def chunked_pieces(per_peer: int, itemsize: int, lay: Layout, algo: str = "push",
                   tuning: Tuning = DEFAULT_TUNING) -> list[Piece]:
    """Launches of a chunked op moving `per_peer` elements between each pair of ranks."""
    return [Piece(s, min(lay.max_elems, per_peer - s), _grid(algo, min(lay.max_elems, per_peer - s) * itemsize, tuning))
            for s in range(0, per_peer, lay.max_elems)]


def alltoallv_pieces(max_pair_count: int, itemsize: int, lay: Layout, algo: str = "push",
                     tuning: Tuning = DEFAULT_TUNING) -> list[Piece]:
    """Launches of an alltoallv whose largest pair (over all ranks) moves `max_pair_count` elements: at
    least one (every rank takes part in every round, even with nothing to send)."""
    if max_pair_count == 0:
        return [Piece(0, 0, 1)]
    return [Piece(s, lay.max_elems, _grid(algo, min(lay.max_elems, max_pair_count - s) * itemsize, tuning))
            for s in range(0, max_pair_count, lay.max_elems)]


def check_world(world_size: int) -> None:
    if world_size > MAX_WORLD:
        raise ValueError(f"collectives support up to {MAX_WORLD} ranks (one NVLink domain), got {world_size}")


def pieces(op: str, algo: str, count: int, itemsize: int, world_size: int, lay: Layout,
           tuning: Tuning = DEFAULT_TUNING) -> list:
    """The launches of one call. `count`: elements of the message (allreduce) or per peer (alltoallv:
    the largest pair of all ranks)."""
    if op == "allreduce":
        return allreduce_pieces(count, itemsize, world_size, algo, lay, tuning)
    if algo == "direct":
        return direct_pieces(count, itemsize, tuning)
    if algo == "ring":  # reduce_scatter: `count` elements per rank's chunk
        return [_ring_piece(op, 0, count, count, itemsize, world_size, lay, tuning)] if count else []
    if algo in PIPE_ALGOS:  # alltoallv: `count` is the largest pair (0: marker steps only)
        return ([_pipe_piece(op, 0, count, count * itemsize, lay, tuning, pairwise=algo == "pairwise")]
                if count or op == "alltoallv" else [])
    if op == "alltoallv":
        return alltoallv_pieces(count, itemsize, lay, algo, tuning)
    return chunked_pieces(count, itemsize, lay, algo, tuning)


def choose_path(topology) -> tuple[str, str]:
    """('flat', why) where every pair of ranks has NVLink pointers (one NVLink domain: the algorithms above),
    ('hierarchical', why) otherwise: NVLink collectives inside each node, NVSHMEM's device API between nodes
    (``fluxrt.collectives_hier``). `topology`: a ``fluxrt.topology.Topology`` (None: one node)."""
    if topology is None or not topology.hierarchical:
        return "flat", "every pair of ranks has NVLink pointers"
    kind = "virtual " if topology.virtual else ""
    sizes = sorted({len(n) for n in topology.nodes})
    per = f"{sizes[0]} ranks" if len(sizes) == 1 else f"{sizes} ranks"
    return "hierarchical", (f"{topology.num_nodes} {kind}nodes of {per}: node team over NVLink, "
                            "between nodes over the NVSHMEM device API")


def describe(op: str, count: int, itemsize: int, world_size: int, half_bytes: int, algo: str = "auto",
             direct_ok: bool = False, nbytes: int | None = None, tuning: Tuning = DEFAULT_TUNING) -> dict:
    """What a call would run, for logs and the perf table: algo, launches, grid of the first launch.
    `count`: elements of the message (allreduce) or per peer (the others); `nbytes`: the size the
    algorithm is chosen by (default count * itemsize); `half_bytes`: the workspace half (the LL buffer
    half follows from `tuning`)."""
    a = choose_algo(op, count * itemsize if nbytes is None else nbytes, world_size, algo, direct_ok, tuning,
                    half_bytes=half_bytes, itemsize=itemsize)
    half = tuning.ll_buffer_bytes(world_size) // 2 if a in LL_ALGOS else half_bytes
    lay = layout(op, a, half, world_size, itemsize)
    ps = pieces(op, a, count, itemsize, world_size, lay, tuning)
    scheme, algorithm = algo_pair(op, a)
    return {"algo": a, "scheme": scheme, "algorithm": algorithm, "launches": len(ps),
            "grid": ps[0].grid if ps else 0, "slot_bytes": lay.slot_bytes}


__all__ = ["choose_path", "ALGOS", "ALGO_PAIRS", "algo_pair", "PIPE_ALGOS", "REDUCE_OPS", "DEFAULT_TUNING", "Layout", "Piece", "Tuning", "allreduce_pieces",
           "alltoallv_pieces", "chunked_pieces", "direct_pieces", "pieces", "choose_algo", "ll12_fits", "layout", "describe",
           "bulk_grid", "ring_slices", "ring_step", "ring_geometry", "RingGeometry", "ll_grid", "ll12_grid", "ll12_twoshot_chunk", "ll12_twoshot_grid", "block_threads", "oneshot_grid", "pipe_roles", "pipe_slices", "pipe_step", "pair_bytes", "check_world", "MAX_WORLD"]