"""MoE dispatch and combine over NVLink: tokens go to the ranks that own their experts, grouped by local
expert, and the experts' outputs come back weighted and summed (kernels/moe/dispatch.cu).

Layout on the GPU, no host sync: a one-block kernel ranks this rank's routing entries per expert, sends its
per-expert counts to every rank through symmetric memory and a flag, and from every rank's counts computes
where each of its rows goes in the owners' receive buffers, and as an owner the per-local-expert offsets
(int32 [E_local + 1], what a grouped GEMM takes) and counts. A grid then pushes each (token, slot) row into
its owner's buffer over NVLink; its last block raises a flag at every rank and waits for every rank's, so the
dispatch is complete on this rank when the kernel ends. The calls are stream-ordered and capturable in a CUDA
graph (the round's flag value lives on the device). The host reads the number of received rows only when
asked (``DispatchHandle.num_recv``).

Combine copies the expert outputs into the receive buffer (nothing to copy when they were computed in place),
raises a ready flag at every rank, then every token pulls its k rows from their owners and sums them weighted
in slot order in fp32: the same bits on every call, whatever the timing.

With ``DispatcherOptions(returns=True)`` (MoELayer's overlap) the owners push the expert outputs back instead:
the push leaves each row's home and entry at its owner, the owner's down-projection GEMM stores each output row
into its home's return buffer and counts the elements there, and ``combine_returned`` sums each token as soon
as its owners' counts are in, with the same bits as combine.

Nothing is dropped: each rank's receive buffer holds the worst case, ``max_tokens_per_rank * world * top_k``
rows, checked against the symmetric heap before anything is allocated (HeapExhaustedError says how much to
ask for). The receive buffer is the dispatch's output: valid until the next dispatch (or combine, which
overwrites it with y). One combine per dispatch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import agreement
from ..arrays import as_array
from ..dtypes import normalize_dtype, short_name
from ..errors import FluxrtError, HeapExhaustedError, op_id
from ..nvtx import annotate as _nvtx
from ..streams import as_cupy_stream
from ..topology import require_one_domain

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

KERNEL_SOURCE = "moe/dispatch.cu"
MAX_EXPERTS = 256      # kernels/moe/dispatch.cu kMaxExperts (the layout block's shared count table)
MAX_TOP_K = 32         # kMaxTopK: a token's slots are held by the lanes of one warp in combine
MAX_WORLD = 32         # fluxrt::kMaxWorld
LAYOUT_THREADS = 1024  # 32 warps: one per chunk of entries (kChunks)
CHUNKS = 32
FLAG_KINDS = 3         # notify, data, ready
DTYPES = ("bfloat16", "float16")
INDEX_DTYPES = {"int32": "i32", "int64": "i64"}
FP8_MODES = ("", "token", "block")
MODES = ("throughput", "low_latency")
_u32, _u64 = np.uint32, np.uint64


class MoEArgumentError(FluxrtError, ValueError):
    """A Dispatcher was made or called with shapes, dtypes or options it cannot run."""


@dataclass(frozen=True)
class DispatcherOptions:
    """top_k: the most slots per token of any call; receive buffers hold max_tokens_per_rank * world * top_k
    rows (the worst case: nothing is ever dropped).
    blocks: grid of the push, stage and combine kernels (0: one per SM).
    threads: threads per block of those kernels (a multiple of 32).
    fp8: "" (16-bit rows), "token" or "block": FP8 dispatch, x quantized to e4m3 with one fp32 scale per token or
    per 1x128 block (scale = amax / 448) and sent as such: dispatch returns (rows e4m3 [max rows, hidden],
    scales fp32 [max rows, 1 or hidden / 128]); combine stays 16-bit.
    mode: "throughput" (counts exchanged first, rows pushed straight into the grouped layout: two flag round
    trips) or "low_latency" (rows pushed into fixed slots per (source, expert) with their counts: one round
    trip, then a local compaction; a staging buffer of num_experts * max_tokens_per_rank rows; every dispatch
    must be combined before the next; 16-bit only).
    arrivals: raise per-expert arrival flags (throughput mode; MoELayer's overlap sets it): the push sends
    this rank's rows local expert by local expert (every owner's expert 0 first) and, once its last row to an
    expert has landed, sets that expert's word for this source in the owner's arrival array ([E_local, world]
    u64, ``Dispatcher.arrival_flags``) to the round (``Dispatcher.round_ptr``), so that a grouped GEMM with
    ``fluxrt.gemm.GroupArrival`` starts an expert's tiles while later experts' rows are still on their way.
    dedupe: send a token once per destination rank instead of once per top-k slot (as DeepEP does): the row of
    its first slot on that rank crosses NVLink, its other slots there get a local copy on the owner (an expand
    kernel in throughput mode, the compaction in low-latency mode). The output layout, offsets, counts and
    combine are the same as without it (bit for bit); ``DispatchHandle.rows_sent()`` counts the rows moved.
    With arrival flags, an expert that receives copied rows from a source is flagged by the owner after its
    copies (after the whole push), the others as without dedupe.
    returns: the rows come back pushed by their owners (throughput mode; MoELayer's overlap sets it): the push
    also leaves at each owner, per receive row, its home and entry (``Dispatcher.home_rows``: int32, entry *
    world + source rank), so that the owner's down-projection GEMM (``fluxrt.gemm.GroupScatter``) stores each
    output row straight into row `entry` of its home's return buffer (``Dispatcher.returned``: [max_tokens_per_rank
    * top_k, hidden]) and counts the landed elements in the home's counter for that owner; ``combine_returned``
    then waits (bounded) for each owner's rows and sums them as ``combine`` does, bit for bit."""

    top_k: int = 8
    blocks: int = 0
    threads: int = 512
    fp8: str = ""
    mode: str = "throughput"
    arrivals: bool = False
    dedupe: bool = False
    returns: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """The sizes a Dispatcher derives from its arguments (the same on every rank)."""

    world: int
    num_experts: int
    local_experts: int
    hidden: int
    max_tokens: int
    top_k: int
    dtype: str
    recv_rows: int          # rows of each rank's receive buffer
    row_bytes: int
    fp8: str = ""
    scale_row: int = 0      # fp32 scales per FP8 row (0: no FP8)
    mode: str = "throughput"
    arrivals: bool = False  # per-expert arrival flags ([E_local, world] u64 per rank)
    dedupe: bool = False    # a token once per destination rank (copy descriptors: int32 per receive/staging row)
    returns: bool = False   # rows pushed back by their owners (home descriptors, return buffer, landed counters)

    @property
    def wire_row_bytes(self) -> int:
        """Bytes of one pushed row on NVLink (FP8: e4m3 values and their fp32 scales)."""
        return self.hidden + 4 * self.scale_row if self.fp8 else self.row_bytes

    @property
    def staging_rows(self) -> int:
        """Rows of the low-latency staging buffer: a slot of max_tokens rows per (source rank, local expert)."""
        return self.num_experts * self.max_tokens if self.mode == "low_latency" else 0

    @property
    def recv_bytes(self) -> int:
        return self.recv_rows * self.row_bytes

    def symmetric_bytes(self) -> int:
        """Symmetric heap bytes a Dispatcher takes per rank (receive buffers, count matrix, flags)."""
        fp8 = self.recv_rows * (self.hidden + 4 * self.scale_row) if self.fp8 else 0
        arrivals = self.local_experts * self.world * 8 if self.arrivals else 0
        return (self.recv_bytes + fp8 + self.staging_rows * self.row_bytes + self.world * self.num_experts * 4
                + FLAG_KINDS * self.world * 8 + arrivals + 4 * self.descriptor_rows + self.returns_bytes)

    @property
    def return_rows(self) -> int:
        """Rows of the return buffer (returns): one per (token, slot) of this rank's largest call."""
        return self.max_tokens * self.top_k if self.returns else 0

    @property
    def returns_bytes(self) -> int:
        """Symmetric bytes of returns: home descriptors (int32 per receive row), return buffer, landed counters."""
        return 4 * self.recv_rows + self.return_rows * self.row_bytes + 8 * self.world if self.returns else 0

    @property
    def descriptor_rows(self) -> int:
        """Dedupe's copy descriptors (int32 source row per receive row, or per staging slot in low latency)."""
        if not self.dedupe:
            return 0
        return self.staging_rows if self.mode == "low_latency" else self.recv_rows


def check_config(world_size: int, num_experts: int, hidden: int, max_tokens_per_rank: int, dtype,
                 options: DispatcherOptions | None = None) -> MoEConfig:
    """Validate a Dispatcher's arguments (no GPU needed); returns the derived sizes."""
    options = options or DispatcherOptions()
    try:
        name = normalize_dtype(dtype).name
    except (TypeError, ValueError) as e:
        raise MoEArgumentError(f"Dispatcher: dtype {dtype!r} not understood ({e}); use bf16 or fp16") from None
    if name not in DTYPES:
        raise MoEArgumentError(f"Dispatcher: dtype {short_name(name)} not supported; use bf16 or fp16")
    if not 1 <= world_size <= MAX_WORLD:
        raise MoEArgumentError(f"Dispatcher: at most {MAX_WORLD} ranks, got {world_size}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise MoEArgumentError(f"Dispatcher: num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if num_experts % world_size:
        raise MoEArgumentError(f"Dispatcher: num_experts={num_experts} is not a multiple of the {world_size} ranks "
                               "(experts are spread evenly: rank r owns experts [r E/world, (r + 1) E/world))")
    if hidden <= 0 or hidden % 8:
        raise MoEArgumentError(f"Dispatcher: hidden={hidden} must be a positive multiple of 8 (16-byte rows)")
    if max_tokens_per_rank <= 0:
        raise MoEArgumentError(f"Dispatcher: max_tokens_per_rank must be positive, got {max_tokens_per_rank}")
    if not 1 <= options.top_k <= MAX_TOP_K:
        raise MoEArgumentError(f"Dispatcher: top_k must be in [1, {MAX_TOP_K}], got {options.top_k}")
    if options.threads <= 0 or options.threads % 32 or options.threads > 1024:
        raise MoEArgumentError(f"Dispatcher: threads={options.threads} must be a multiple of 32 up to 1024")
    if options.fp8 not in FP8_MODES:
        raise MoEArgumentError(f"Dispatcher: fp8={options.fp8!r} not in {FP8_MODES} ('' is 16-bit dispatch)")
    if options.fp8 and hidden % (128 if options.fp8 == "block" else 16):
        raise MoEArgumentError(f"Dispatcher: FP8 dispatch with {options.fp8} scales needs hidden a multiple of "
                               f"{128 if options.fp8 == 'block' else 16}, got {hidden}")
    if options.mode not in MODES:
        raise MoEArgumentError(f"Dispatcher: mode={options.mode!r} not in {MODES}")
    if options.mode == "low_latency" and options.fp8:
        raise MoEArgumentError("Dispatcher: FP8 dispatch is for mode='throughput' only")
    if not isinstance(options.arrivals, bool):
        raise MoEArgumentError(f"Dispatcher: arrivals must be a bool, got {options.arrivals!r}")
    if options.arrivals and options.mode != "throughput":
        raise MoEArgumentError("Dispatcher: arrival flags (arrivals=True) are for mode='throughput' only (the "
                               "low-latency push lands rows in staging slots, compacted after the last one)")
    if not isinstance(options.dedupe, bool):
        raise MoEArgumentError(f"Dispatcher: dedupe must be a bool, got {options.dedupe!r}")
    if not isinstance(options.returns, bool):
        raise MoEArgumentError(f"Dispatcher: returns must be a bool, got {options.returns!r}")
    if options.returns and options.mode != "throughput":
        raise MoEArgumentError("Dispatcher: rows pushed back (returns=True) are for mode='throughput' only (the "
                               "low-latency push leaves no home descriptors at the owners)")
    if options.blocks < 0:
        raise MoEArgumentError(f"Dispatcher: blocks must be >= 0 (0: one per SM), got {options.blocks}")
    rows = int(max_tokens_per_rank) * world_size * options.top_k
    if rows >= 2 ** 31:
        raise MoEArgumentError(f"Dispatcher: {rows} receive rows overflow the int32 offsets; lower "
                               "max_tokens_per_rank or top_k")
    return MoEConfig(world=world_size, num_experts=int(num_experts), local_experts=num_experts // world_size,
                     hidden=int(hidden), max_tokens=int(max_tokens_per_rank), top_k=options.top_k, dtype=name,
                     recv_rows=rows, row_bytes=int(hidden) * 2, fp8=options.fp8,
                     scale_row={"": 0, "token": 1, "block": int(hidden) // 128}[options.fp8], mode=options.mode,
                     arrivals=options.arrivals, dedupe=options.dedupe, returns=options.returns)


def check_heap(cfg: MoEConfig, capacity: int, used: int, rank: int) -> None:
    """Raise HeapExhaustedError, saying how much heap to ask for, when the buffers do not fit."""
    # each allocation may take 512 bytes more
    need = cfg.symmetric_bytes() + (FLAG_KINDS + cfg.arrivals + cfg.dedupe + 3 * cfg.returns) * 512
    if used + need > capacity:
        gib = -(-(used + need) * 5 // 4 // (1 << 30))
        raise HeapExhaustedError(
            f"Dispatcher: rank {rank} needs {need} symmetric bytes ({cfg.recv_rows} receive rows of {cfg.row_bytes} "
            f"bytes: max_tokens_per_rank {cfg.max_tokens} x {cfg.world} ranks x top_k {cfg.top_k}, the worst case) "
            f"but {capacity - used} of {capacity} heap bytes are free. Set WorldOptions(heap_size='{gib}G') "
            "(NVSHMEM_SYMMETRIC_SIZE), or lower max_tokens_per_rank or DispatcherOptions.top_k")


class DispatchHandle:
    """What combine needs of one dispatch, and the layout of what this rank received.

    offsets: int32 [E_local + 1] on the device, rows [offsets[i], offsets[i+1]) of the receive buffer are
    local expert i's; counts: int32 [E_local] on the device. ``num_recv()`` and ``counts_host()`` read them
    (a sync)."""

    def __init__(self, dispatcher: "Dispatcher", seq: int, tokens: int, k: int, idx, weights, index_kind: str, stream):
        self._d, self.seq, self.tokens, self.k = dispatcher, seq, tokens, k
        self.topk_idx, self.topk_weights, self._index_kind = idx, weights, index_kind
        self.offsets, self.counts = dispatcher.offsets, dispatcher.counts
        self.moved = dispatcher.moved   # int32 [world] on the device: rows this rank pushed to each rank
        self._stream = stream
        self.combined = False

    def rows_sent(self) -> np.ndarray:
        """Rows this dispatch pushed from this rank to each rank ([world], its own rank included; a sync): one
        per (token, slot), with dedupe one per (token, destination rank). Valid until the next dispatch."""
        self._stream.synchronize()
        self._d.world.check_errors()
        return self.moved.get().astype(np.int64)

    def bytes_sent(self, *, include_self: bool = False) -> int:
        """Bytes this dispatch pushed over NVLink from this rank (rows_sent() times the bytes of a row on the
        wire, FP8 scales included); include_self adds the rows to its own experts (a local copy)."""
        rows = self.rows_sent()
        if not include_self:
            rows[self._d.world.rank] = 0
        return int(rows.sum()) * self._d.cfg.wire_row_bytes

    def num_recv(self) -> int:
        """Rows this rank received (waits for the dispatch; raises a recorded device timeout)."""
        self._stream.synchronize()
        self._d.world.check_errors()
        return int(self.offsets[-1].get())

    def counts_host(self) -> np.ndarray:
        self._stream.synchronize()
        self._d.world.check_errors()
        return self.counts.get()

    def recv_tokens(self):
        """The received rows, [num_recv(), hidden] (a view of the receive buffer; a sync); with FP8 dispatch
        (e4m3 rows, their scales)."""
        n, d = self.num_recv(), self._d
        return (d.recv_fp8[:n], d.recv_scales[:n]) if d.cfg.fp8 else d.recv[:n]


class Dispatcher:
    """Dispatch and combine of one MoE layer's tokens over the ranks of `world` (collective to create)."""

    def __init__(self, world: World, num_experts: int, hidden: int, max_tokens_per_rank: int, dtype="bfloat16",
                 options: DispatcherOptions | None = None):
        import cupy

        from ..toolchain import load_module

        world.check_active()
        require_one_domain(world, "Dispatcher()", MoEArgumentError)
        self.world = world
        self.options = options or DispatcherOptions()

        def local_checks():
            cfg = check_config(world.size, num_experts, hidden, max_tokens_per_rank, dtype, self.options)
            return cfg, {"num_experts": num_experts, "hidden": hidden, "max_tokens_per_rank": max_tokens_per_rank,
                         "dtype": cfg.dtype, "options": repr(self.options)}

        self.cfg = _checked_on_every_rank(world, "Dispatcher()", local_checks)
        cfg = self.cfg
        n = world.size
        try:
            check_heap(cfg, world.heap.capacity, world.heap.used, world.rank)
            short = None
        except HeapExhaustedError as e:
            short = str(e)
        # every rank raises when one rank's heap is short (an allocation on the others alone would hang)
        every = agreement.exchange(world, "Dispatcher() heap", short)
        if any(every):
            raise HeapExhaustedError(short or next(m for m in every if m))
        with world.device:
            self.module = load_module(KERNEL_SOURCE)
            self._fn = {name: self.module.get_function(name) for name in self._kernel_names()}
            # a rank that compiled the kernels on a cold cache is behind: meet before the bounded allocations
            agreement.meet_after_load(world, "Dispatcher(): kernels loaded")
            self.recv = world.empty((cfg.recv_rows, cfg.hidden), cfg.dtype)
            self.recv_fp8 = self.recv_scales = self.staging = None
            if cfg.staging_rows:
                self.staging = world.empty((cfg.staging_rows, cfg.hidden), cfg.dtype)
            if cfg.fp8:   # e4m3 rows and their scales, pushed instead of the 16-bit rows
                self.recv_fp8 = world.empty((cfg.recv_rows, cfg.hidden), "float8_e4m3fn")
                self.recv_scales = world.empty((cfg.recv_rows, cfg.scale_row), np.float32)
                self.x_fp8 = cupy.empty((cfg.max_tokens, cfg.hidden), dtype=np.uint8)
                self.x_scales = cupy.empty((cfg.max_tokens, cfg.scale_row), dtype=np.float32)
            self.count_matrix = world.zeros((n, cfg.num_experts), np.int32)
            self.flags = world.zeros((FLAG_KINDS * n,), np.uint64)   # never reset: compared with growing epochs
            # arrival flags [E_local, world]: word [l, s] = the round once source s's rows to local expert l landed
            self.arrive = world.zeros((cfg.local_experts * n,), np.uint64) if cfg.arrivals else None
            # dedupe: per receive row (low latency: per staging slot) the row it copies, or -1 (pushed itself)
            self.src_of = world.zeros((cfg.descriptor_rows,), np.int32) if cfg.dedupe else None
            # returns: per receive row its home (entry * world + source), written by the source's push; this rank's
            # return buffer (row i: the output of its entry i); per owner the elements of it landed so far (never
            # reset: it only grows) and what had landed at the end of the previous combine_returned
            self.home_of = self.returned = self.landed = self.landed_base = None
            if cfg.returns:
                self.home_of = world.zeros((cfg.recv_rows,), np.int32)
                self.returned = world.empty((cfg.return_rows, cfg.hidden), cfg.dtype)
                self.landed = world.zeros((n,), np.uint64)
                self.landed_base = cupy.zeros(n, dtype=np.uint64)
            self.epoch = cupy.zeros(2, dtype=np.uint64)                # [counter, this dispatch's round]
            # last-block counters: push, stage, expand, combine_returned
            self.done = cupy.zeros(4, dtype=np.uint32)
            self.pos = cupy.zeros(max(1, cfg.max_tokens * cfg.top_k), dtype=np.int32)
            self.chunk_base = cupy.zeros(CHUNKS * cfg.num_experts, dtype=np.int32)
            self.dst_base = cupy.zeros(cfg.num_experts, dtype=np.int32)
            self.offsets = cupy.zeros(cfg.local_experts + 1, dtype=np.int32)
            self.counts = cupy.zeros(cfg.local_experts, dtype=np.int32)
            self.moved = cupy.zeros(n, dtype=np.int32)
            # dedupe (throughput): the rows combine reads, apart from pos (the push reads other entries' pos)
            self.rows = (cupy.zeros(max(1, cfg.max_tokens * cfg.top_k), dtype=np.int32)
                         if cfg.dedupe and cfg.mode == "throughput" else self.pos)
            self.dups = cupy.zeros(cfg.num_experts, dtype=np.int32) if cfg.dedupe and cfg.arrivals else None
            # arrival flags: the push order of this rank's entries, and its per-expert counters of landed rows
            self.order = cupy.zeros(max(1, cfg.max_tokens * cfg.top_k), dtype=np.int32) if cfg.arrivals else None
            self.sent = cupy.zeros(cfg.num_experts, dtype=np.uint32) if cfg.arrivals else None
            from ..gemm.kernel import _num_sms

            self.blocks = self.options.blocks or _num_sms(world.device_id)
            self._tables = (self.recv.peer_table, self.count_matrix.peer_table, self.flags.peer_table)
            self._fp8_tables = (self.recv_fp8.peer_table, self.recv_scales.peer_table) if cfg.fp8 else None
            self._staging_table = self.staging.peer_table if self.staging is not None else None
            null = _u64(0)
            self._layout_arrivals = (self.order, self.sent) if cfg.arrivals else (null, null)
            self._push_arrivals = ((self.order, self.count_matrix, self.arrive.peer_table, self.sent) if cfg.arrivals
                                   else (null, null, null, null))
            self._src_table = self.src_of.peer_table if cfg.dedupe else null
            self._layout_dedupe = (np.int32(cfg.dedupe), self.moved, self.dups if self.dups is not None else null)
            self._push_dedupe = (self.rows, self._src_table, self.dups if self.dups is not None else null,
                                 self.home_of.peer_table if cfg.returns else null)
            world.device.synchronize()
        self._team = {name: (_u32(world.rank), _u32(n), _u64(world.timeout_ns), _u64(world.error_record),
                             _u32(op_id(name))) for name in ("moe_dispatch", "moe_combine")}
        self._seq = 0
        self._return_targets = None
        self._last = None   # the latest dispatch's handle (low latency: it must be combined first)
        self._freed = False
        log.info("Dispatcher on %d ranks: %s (%d receive bytes per rank)", n, cfg, cfg.recv_bytes)

    @staticmethod
    def _kernel_names():
        names = ["fluxrt_moe_stage", "fluxrt_moe_expand", "fluxrt_moe_quantize_bf16", "fluxrt_moe_quantize_fp16"]
        for ix in INDEX_DTYPES.values():
            names += [f"fluxrt_moe_layout_{ix}", f"fluxrt_moe_push_{ix}", f"fluxrt_moe_ll_push_{ix}",
                      f"fluxrt_moe_ll_compact_{ix}", f"fluxrt_moe_combine_bf16_{ix}",
                      f"fluxrt_moe_combine_fp16_{ix}", f"fluxrt_moe_combine_returned_bf16_{ix}",
                      f"fluxrt_moe_combine_returned_fp16_{ix}"]
        return names

    @property
    def local_experts(self) -> int:
        return self.cfg.local_experts

    @property
    def arrival_flags(self) -> int:
        """Device pointer of this rank's arrival flags ([E_local, world] u64; arrivals=True only)."""
        if self.arrive is None:
            raise MoEArgumentError("Dispatcher: no arrival flags (DispatcherOptions(arrivals=True) makes them)")
        return self.arrive.data.ptr

    @property
    def round_ptr(self) -> int:
        """Device pointer of the current dispatch's round (u64, written by its layout kernel): the value the
        arrival flags of that dispatch reach."""
        return self.epoch.data.ptr + self.epoch.itemsize

    @property
    def home_rows(self) -> int:
        """Device pointer of this rank's home descriptors (int32 per receive row: entry * world + source rank;
        returns=True only): written by the sources' pushes of the current dispatch."""
        self._need_returns("home_rows")
        return self.home_of.data.ptr

    def return_targets(self) -> tuple:
        """(buffers, counters): device arrays of `world` uint64 each, for ``fluxrt.gemm.GroupScatter`` on this
        rank: rank h's return buffer, and the address of h's counter of rows landed from this rank (returns=True
        only). Made once."""
        self._need_returns("return_targets")
        if self._return_targets is None:
            import cupy

            counters = [self.landed.peer_ptr(h) + 8 * self.world.rank for h in range(self.world.size)]
            with self.world.device:
                self._return_targets = (self.returned.peer_table, cupy.asarray(np.array(counters, np.uint64)))
                cupy.cuda.get_current_stream().synchronize()   # the upload, before any stream's kernel reads it
        return self._return_targets

    def _need_returns(self, what: str) -> None:
        if not self.cfg.returns:
            raise MoEArgumentError(f"Dispatcher: no {what} (DispatcherOptions(returns=True) makes them)")

    def free(self) -> None:
        """Collective: release the symmetric buffers (the world's finalize does it otherwise)."""
        if self.world.active and not self._freed:
            for a in (self.landed, self.returned, self.home_of, self.src_of, self.arrive, self.staging,
                      self.recv_scales, self.recv_fp8, self.flags, self.count_matrix, self.recv):
                if a is not None:
                    self.world.free(a)
        self._freed = True

    # --- dispatch ---------------------------------------------------------------------------------
    @_nvtx("moe_dispatch")
    def dispatch(self, x, topk_idx, topk_weights, *, stream=None, layout_event=None):
        """x [T, hidden] (T <= max_tokens_per_rank; T may differ across ranks), topk_idx [T, k] int32 or int64
        (expert ids; -1 masks a slot), topk_weights [T, k] float32. Returns (x_recv, handle): x_recv is the
        receive buffer [max rows, hidden], whose rows [0, handle.offsets[E_local]) are the tokens this rank's
        experts received, grouped by local expert (inside an expert by source rank, then token and slot).
        With FP8 dispatch x_recv is (e4m3 rows, fp32 scales) in the same layout; combine then takes 16-bit y.
        layout_event: a CuPy event recorded on `stream` between the layout kernel and the push (throughput
        mode): work on another stream that waits for it may read the offsets (and, with arrival flags, each
        expert's rows once its flags are up) while the push runs."""
        s = as_cupy_stream(stream)
        cfg = self.cfg

        def local_checks():
            self._check_live()
            if layout_event is not None and cfg.mode != "throughput":
                raise MoEArgumentError("dispatch: layout_event is for mode='throughput' (the low-latency dispatch "
                                       "knows its layout only after its push)")
            if cfg.mode == "low_latency" and self._last is not None and not self._last.combined:
                raise MoEArgumentError("dispatch: low-latency mode needs the previous dispatch combined first (its "
                                       "staging slots are reused without a handshake)")
            a = _intake(x, "x", "dispatch", self.world, s)
            if a.ndim != 2 or a.shape[1] != cfg.hidden:
                raise MoEArgumentError(f"dispatch: x must be [T, {cfg.hidden}], got shape {tuple(a.shape)}")
            if a.dtype.name != cfg.dtype:
                raise MoEArgumentError(f"dispatch: x is {short_name(a.dtype)}, the Dispatcher {short_name(cfg.dtype)}")
            t = int(a.shape[0])
            if t > cfg.max_tokens:
                raise MoEArgumentError(f"dispatch: {t} tokens exceed max_tokens_per_rank={cfg.max_tokens}")
            idx = _intake(topk_idx, "topk_idx", "dispatch", self.world, s)
            if idx.ndim != 2 or idx.shape[0] != t:
                raise MoEArgumentError(f"dispatch: topk_idx must be [{t}, k], got shape {tuple(idx.shape)}")
            k = int(idx.shape[1])
            if not 1 <= k <= cfg.top_k:
                raise MoEArgumentError(f"dispatch: k={k} outside [1, top_k={cfg.top_k}] (DispatcherOptions.top_k "
                                       "sizes the receive buffers)")
            if idx.dtype.name not in INDEX_DTYPES:
                raise MoEArgumentError(f"dispatch: topk_idx is {idx.dtype}, expected int32 or int64")
            w = _intake(topk_weights, "topk_weights", "dispatch", self.world, s)
            if w.shape != idx.shape or w.dtype != np.float32:
                raise MoEArgumentError(f"dispatch: topk_weights must be float32 {tuple(idx.shape)}, got "
                                       f"{w.dtype} {tuple(w.shape)}")
            return (a, idx, w, t, k), {"hidden": cfg.hidden, "dtype": cfg.dtype}

        a, idx, w, t, k = _checked_on_every_rank(self.world, "moe_dispatch", local_checks)
        ix = INDEX_DTYPES[idx.dtype.name]
        team = self._team["moe_dispatch"]
        recv_t, count_t, flag_t = self._tables
        common = (_u32(t), _u32(k), _u32(cfg.num_experts), _u32(cfg.local_experts))
        if cfg.mode == "low_latency":
            return self._dispatch_low_latency(a, idx, w, t, k, ix, team, common, s)
        self._fn[f"fluxrt_moe_layout_{ix}"](
            (1,), (LAYOUT_THREADS,),
            team + (self.epoch, idx) + common + (count_t, self.count_matrix, flag_t, self.flags, self.pos,
                                                 self.chunk_base, self.dst_base, self.offsets, self.counts)
            + self._layout_arrivals + self._layout_dedupe,
            stream=s)
        if layout_event is not None:
            layout_event.record(s)
        warps = self.options.threads // 32
        if cfg.fp8:
            kind = "bf16" if cfg.dtype == "bfloat16" else "fp16"
            self._fn[f"fluxrt_moe_quantize_{kind}"](
                (max(1, min(self.blocks, -(-t // warps))),), (self.options.threads,),
                (a, _u32(t), _u32(cfg.hidden), np.int32(cfg.fp8 == "block"), self.x_fp8, self.x_scales), stream=s)
            rows = (self.x_fp8, _u64(cfg.hidden), _u32(cfg.recv_rows), self._fp8_tables[0], self.x_scales,
                    _u32(cfg.scale_row), self._fp8_tables[1])
        else:
            rows = (a, _u64(cfg.row_bytes), _u32(cfg.recv_rows), recv_t, _u64(0), _u32(0), _u64(0))
        grid = max(1, min(self.blocks, -(-t * k // warps)))
        self._fn[f"fluxrt_moe_push_{ix}"](
            (grid,), (self.options.threads,),
            team + (self.epoch, idx) + common + rows + (self.pos, self.chunk_base, self.dst_base, flag_t, self.flags,
                                                        self.done) + self._push_arrivals + self._push_dedupe,
            stream=s)
        if cfg.dedupe:   # the owner's copies of its rows that came as one row per (token, rank)
            if cfg.fp8:
                rows = (self.recv_fp8, _u64(cfg.hidden), self.recv_scales, _u32(cfg.scale_row))
            else:
                rows = (self.recv, _u64(cfg.row_bytes), _u64(0), _u32(0))
            self._fn["fluxrt_moe_expand"](
                (self.blocks,), (self.options.threads,),
                team + (self.epoch, self.src_of, self.offsets, _u32(cfg.local_experts), _u32(cfg.recv_rows)) + rows
                + (self.arrive if cfg.arrivals else _u64(0), self.done[2:]),
                stream=s)
        self._seq += 1
        out = (self.recv_fp8, self.recv_scales) if cfg.fp8 else self.recv
        self._last = DispatchHandle(self, self._seq, t, k, idx, w, ix, s)
        return out, self._last

    def _dispatch_low_latency(self, a, idx, w, t, k, ix, team, common, s):
        cfg = self.cfg
        _, count_t, flag_t = self._tables
        warps = self.options.threads // 32
        self._fn[f"fluxrt_moe_ll_push_{ix}"](
            (max(1, min(self.blocks, -(-t * k // warps))),), (self.options.threads,),
            team + (self.epoch, idx) + common + (a, _u64(cfg.row_bytes), _u32(cfg.max_tokens), self._staging_table,
                                                 count_t, self.pos, flag_t, self.flags, self.done, self._src_table,
                                                 self.moved),
            stream=s)
        items = cfg.world * cfg.local_experts * cfg.max_tokens
        self._fn[f"fluxrt_moe_ll_compact_{ix}"](
            (max(1, min(self.blocks, -(-items // warps))),), (self.options.threads,),
            team + (idx,) + common + (self.count_matrix, self.staging, _u32(cfg.max_tokens), self.recv,
                                      _u64(cfg.row_bytes), self.pos, self.offsets, self.counts,
                                      self.src_of if cfg.dedupe else _u64(0)),
            stream=s)
        self._seq += 1
        self._last = DispatchHandle(self, self._seq, t, k, idx, w, ix, s)
        return self.recv, self._last

    # --- combine ----------------------------------------------------------------------------------
    @_nvtx("moe_combine")
    def combine(self, y, handle: DispatchHandle, *, out=None, stream=None):
        """y [rows, hidden]: the experts' outputs in the layout dispatch delivered (rows >= the received count;
        y may be the receive buffer itself, then nothing is copied). Returns out [T, hidden]: for each token,
        sum over its slots j (in order) of topk_weights[t, j] * its expert's output row, in fp32."""
        s = as_cupy_stream(stream)
        cfg = self.cfg

        def local_checks():
            self._check_live()
            self._check_handle(handle, "combine")
            b = _intake(y, "y", "combine", self.world, s)
            if b.ndim != 2 or b.shape[1] != cfg.hidden or b.dtype.name != cfg.dtype:
                raise MoEArgumentError(f"combine: y must be {short_name(cfg.dtype)} [rows, {cfg.hidden}], got "
                                       f"{short_name(b.dtype)} {tuple(b.shape)}")
            if b.shape[0] > cfg.recv_rows:
                raise MoEArgumentError(f"combine: y has {b.shape[0]} rows, the receive buffer {cfg.recv_rows}")
            return (b, self._combine_out_checked(out, handle, "combine", s)), {"hidden": cfg.hidden}

        b, o = _checked_on_every_rank(self.world, "moe_combine", local_checks)
        o = self._combine_out(o, handle, s)
        team = self._team["moe_combine"]
        recv_t, _, flag_t = self._tables
        same = b.data.ptr == self.recv.data.ptr
        grid = 1 if same else self.blocks
        self._fn["fluxrt_moe_stage"](
            (grid,), (self.options.threads,),
            team + (self.epoch, b, _u64(b.shape[0]), self.recv, _u64(cfg.row_bytes), self.offsets,
                    _u32(cfg.local_experts), flag_t, self.flags, self.done[1:]),
            stream=s)
        warps = self.options.threads // 32
        grid = max(1, min(self.blocks, -(-handle.tokens // warps)))
        kind = "bf16" if cfg.dtype == "bfloat16" else "fp16"
        self._fn[f"fluxrt_moe_combine_{kind}_{handle._index_kind}"](
            (grid,), (self.options.threads,),
            (handle.topk_idx, handle.topk_weights, _u32(handle.tokens), _u32(handle.k), _u32(cfg.num_experts),
             _u32(cfg.local_experts), self.rows, recv_t, _u64(cfg.row_bytes), o),
            stream=s)
        handle.combined = True
        return o

    def _combine_out_checked(self, out, handle: DispatchHandle, op: str, s):
        """``out`` of a combine taken in and checked ([T, hidden] of the layer's dtype), or None."""
        if out is None:
            return None
        cfg = self.cfg
        o = _intake(out, "out", op, self.world, s, writable=True)
        if o.shape != (handle.tokens, cfg.hidden) or o.dtype.name != cfg.dtype:
            raise MoEArgumentError(f"{op}: out must be {short_name(cfg.dtype)} [{handle.tokens}, {cfg.hidden}], "
                                   f"got {short_name(o.dtype)} {tuple(o.shape)}")
        return o

    def _combine_out(self, o, handle: DispatchHandle, s):
        """The checked ``out``, or a new [T, hidden] array on the world's device (made in stream order)."""
        if o is not None:
            return o
        import cupy

        with self.world.device, s:
            return cupy.empty((handle.tokens, self.cfg.hidden), dtype=normalize_dtype(self.cfg.dtype))

    @_nvtx("moe_combine")
    def combine_returned(self, handle: DispatchHandle, *, out=None, stream=None):
        """Combine of rows pushed back (returns=True): the owners' down projection (``fluxrt.gemm.GroupScatter``
        with ``home_rows`` and ``return_targets``) stored the output row of each of this rank's entries into its
        return buffer. Waits (bounded, per owner: a token is summed once its owners' rows are in) and returns out
        [T, hidden] with the same weighted sums in slot order as ``combine``, bit for bit. A wait that runs out
        names op 'moe_combine', this rank and the owner; the tokens it guarded come out NaN."""
        s = as_cupy_stream(stream)
        cfg = self.cfg

        def local_checks():
            self._check_live()
            self._need_returns("combine_returned")
            self._check_handle(handle, "combine_returned")
            return self._combine_out_checked(out, handle, "combine_returned", s), {"hidden": cfg.hidden}

        o = _checked_on_every_rank(self.world, "moe_combine", local_checks)
        o = self._combine_out(o, handle, s)
        warps = self.options.threads // 32
        grid = max(1, min(self.blocks, -(-handle.tokens // warps)))
        kind = "bf16" if cfg.dtype == "bfloat16" else "fp16"
        self._fn[f"fluxrt_moe_combine_returned_{kind}_{handle._index_kind}"](
            (grid,), (self.options.threads,),
            self._team["moe_combine"] + (handle.topk_idx, handle.topk_weights, _u32(handle.tokens), _u32(handle.k),
                                         _u32(cfg.num_experts), _u32(cfg.local_experts), self.returned,
                                         _u64(cfg.row_bytes), _u32(cfg.hidden), self.count_matrix, self.landed,
                                         self.landed_base, self.done[3:], o),
            stream=s)
        handle.combined = True
        return o

    def _check_handle(self, handle, op: str) -> None:
        if not isinstance(handle, DispatchHandle) or handle._d is not self:
            raise MoEArgumentError(f"{op}: handle must come from this Dispatcher's dispatch")
        if handle.seq != self._seq:
            raise MoEArgumentError(f"{op}: handle is from an earlier dispatch (its rows have been overwritten)")
        if handle.combined:
            raise MoEArgumentError(f"{op}: this dispatch was combined already (one combine per dispatch)")

    def _check_live(self) -> None:
        self.world.check_active()
        if self._freed:
            raise MoEArgumentError("this Dispatcher has been freed")
        self.world.check_errors()


def _intake(x, name: str, op: str, world: World, stream, writable: bool = False):
    a = as_array(x, name=name, op=op, writable=writable, stream=stream, device=world.device_id, contiguous=True,
                 error=MoEArgumentError, type_error=MoEArgumentError)
    if a.data.ptr % 16:
        raise MoEArgumentError(f"{op}: {name} starts at 0x{a.data.ptr:x}, not 16-byte aligned")
    return a


def _checked_on_every_rank(world: World, op: str, local_checks):
    """This rank's checks, ``local_checks() -> (result, signature dict)``, agreed across ranks: a rank whose
    checks failed makes every rank raise before any launch."""
    got, error = agreement.local(local_checks)
    result, what = got if got is not None else (None, {})
    agreement.agree(world, op, tuple(sorted(what.items())), error, rejected=MoEArgumentError, by_rank=True)
    return result
