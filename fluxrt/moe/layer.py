"""The MoE layer: dispatch -> grouped GEMM (gate and up) -> SiLU-and-multiply -> grouped GEMM (down) ->
combine, sequential on one stream, or overlapped tile by tile on both sides of the experts
(``MoELayerOptions(overlap=True)``): the dispatch with the gate/up GEMM, the down GEMM with the combine.

    layer = fluxrt.moe.MoELayer(world, num_experts=256, hidden=7168, ffn_hidden=2048, max_tokens_per_rank=4096,
                                dtype="bf16", options=fluxrt.moe.MoELayerOptions(dispatch=DispatcherOptions(top_k=8)))
    layer.set_weights(w_gate_up=wgu, w_down=wd)      # this rank's experts: [E_local, 2 F, H], [E_local, H, F]
    y = layer.forward(x, topk_idx, topk_weights, stream=s)   # [T, H]

Weights are in ``[G, N, K]`` layout (``trans_b``, as nn.Linear stores them): expert i's gate/up projection is
``w_gate_up[i]`` [2 F, H] (gate rows first, then up rows) and its down projection ``w_down[i]`` [H, F]. The
layer holds them (``set_weights`` copies fused or separate gate and up weights in).

Per call, all stream-ordered, no host sync (the groups' rows stay on the device):

    x_recv, handle = Dispatcher.dispatch(x, ...)        receive buffer [R, H], R the worst case; rows
                                                        [offsets[i], offsets[i+1]) are local expert i's
    h   = grouped_gemm(x_recv, w_gate_up, offsets)      [R, 2 F]   kernels/gemm (FLUXRT_GEMM_GROUPED)
    act = silu(h[:, :F]) * h[:, F:]                     [R, F]     kernels/ops/mlp.cu, rows < offsets[E_local]
    y   = grouped_gemm(act, w_down, offsets)            [R, H]     written over the receive buffer
    out = Dispatcher.combine(y, handle)                 [T, H]     weighted sums in slot order

The GEMMs run over the whole buffer (M = R): the grouped GEMM makes tiles only for the rows its offsets give
to a group, so only the ``offsets[E_local]`` received rows are read and written; the rest of h, act and the
receive buffer is never touched. The down projection writes its rows over the receive buffer (its input was
the gate/up GEMM's, which has finished in stream order), so combine has nothing to copy.

Every buffer is allocated at construction (h, act, the default output [max_tokens_per_rank, H]), so after one
call that compiled the kernels, calls allocate nothing and can be captured in a CUDA graph (the dispatch's
round counter and the groups' offsets live on the device; a replay routes afresh).

Overlap (``overlap=True``): the Dispatcher raises per-expert arrival flags (``DispatcherOptions.arrivals``: each
source pushes its rows local expert by local expert and sets a flag per (expert, source) at the owner once its
last row to that expert has landed). Right after the dispatch's layout kernel (the offsets exist) a second
stream starts the gate/up grouped GEMM with ``fluxrt.gemm.GroupArrival``: its loader waits (bounded) for a
group's flags before loading the group's rows, so an expert's tiles start while later experts' rows are still
being pushed. The GEMM keeps ``blocks`` SMs free for the push (its grid is capped at SMs - push blocks: a
persistent GEMM holding every SM would starve the push it waits for). SiLU and the down projection follow on
that stream. The arrival waits compare with the round the layout kernel wrote on the device, so a captured graph
replays correctly.

The combine side (the Dispatcher's ``returns``): the push leaves at each owner, per received row, the row's home
rank and entry. The down projection's grouped GEMM stores no row locally: its epilogue
(``fluxrt.gemm.GroupScatter``) writes each finished tile's rows straight into the home ranks' return buffers
over NVLink and adds the elements it stored to the home's counter for this owner (a release after the stores).
The caller's stream runs ``Dispatcher.combine_returned`` right after the dispatch, beside the experts: each
token is summed as soon as the counters of its slots' owners reach this round's target (bounded waits), in the
same slot order and fp32 arithmetic as the sequential combine, so the output is the sequential layer's bit for
bit. The down GEMM's grid is capped like the gate/up GEMM's, leaving the combine's blocks their SMs; the
caller's stream then waits for the experts' stream, so the next call's dispatch cannot overwrite the receive
buffer under them (docs/moe.md).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import normalize_dtype, short_name
from ..errors import GemmArgumentError, op_id
from ..nvtx import annotate as _nvtx
from ..streams import as_cupy_stream
from ..topology import require_one_domain
from .dispatcher import (DispatchHandle, Dispatcher, DispatcherOptions, MoEArgumentError, MoEConfig,
                         _checked_on_every_rank, _intake, check_config)

if TYPE_CHECKING:
    from ..gemm.plan import GemmPlan
    from ..world import World

log = logging.getLogger(__name__)

OP = "MoELayer"
# push grid of an overlapped layer whose DispatcherOptions.blocks is 0 (the rest of the SMs run the gate/up GEMM)
OVERLAP_PUSH_BLOCKS = 24
OP_OVERLAP = "moe_layer"   # the op a timed-out arrival wait of the gate/up GEMM names (peer: the source rank)


@dataclass
class _OverlapState:
    """What an overlapped forward launches beside the caller's stream."""

    stream: object          # the experts' stream
    plan: object            # the gate/up GEMM's plan, grid capped
    arrival: object         # fluxrt.gemm.GroupArrival of the Dispatcher's flags
    layout_done: object     # event: the dispatch's layout kernel ended (offsets and round written)
    experts_done: object    # event: the down projection ended
    down_plan: object       # the down GEMM's plan, grid capped
    scatter: object         # fluxrt.gemm.GroupScatter: the down GEMM's rows to their home ranks


def overlap_dispatch_options(options: "MoELayerOptions") -> DispatcherOptions:
    """The Dispatcher's options of a layer: with overlap, arrival flags and returns on and the push grid
    ``OVERLAP_PUSH_BLOCKS`` where ``blocks`` is 0."""
    d = options.dispatch
    if not options.overlap:
        return d
    return dataclasses.replace(d, arrivals=True, returns=True, blocks=d.blocks or OVERLAP_PUSH_BLOCKS)


@dataclass(frozen=True)
class MoELayerOptions:
    """dispatch: the Dispatcher's options (top_k sizes the receive buffer; mode 'throughput' or 'low_latency').
    FP8 dispatch is refused: the layer's grouped GEMM takes 16-bit rows.
    gate_up_plan, down_plan: grouped GEMM plans of the two projections (None: ``fluxrt.gemm.grouped_plan`` of
    the buffer's shape).
    overlap: run the gate/up GEMM beside the dispatch's push, each expert's tiles once its rows have arrived, and
    the combine beside the down GEMM, whose epilogue stores each finished tile's rows into their home ranks'
    return buffers (throughput mode only; the Dispatcher then raises arrival flags and keeps return buffers:
    ``DispatcherOptions.arrivals`` and ``returns``). The push and combine grid is ``dispatch.blocks``, 0 meaning
    ``OVERLAP_PUSH_BLOCKS``; both GEMMs' grids are capped at the SMs left. The output is the sequential layer's
    bit for bit. False: every stage after the other on one stream (the sequential baseline)."""

    dispatch: DispatcherOptions = field(default_factory=DispatcherOptions)
    gate_up_plan: GemmPlan | None = None
    down_plan: GemmPlan | None = None
    overlap: bool = False


@dataclass(frozen=True)
class MoELayerConfig:
    """The sizes a MoELayer derives from its arguments (the same on every rank)."""

    moe: MoEConfig
    ffn: int

    @property
    def local_experts(self) -> int:
        return self.moe.local_experts

    @property
    def itemsize(self) -> int:
        return 2

    def weight_bytes(self) -> int:
        """Device bytes of this rank's expert weights (gate/up and down)."""
        return self.local_experts * 3 * self.ffn * self.moe.hidden * self.itemsize

    def intermediate_bytes(self) -> int:
        """Device bytes of h [R, 2 F], act [R, F] and the default output [max_tokens, H]."""
        return (self.moe.recv_rows * 3 * self.ffn + self.moe.max_tokens * self.moe.hidden) * self.itemsize

    def device_bytes(self) -> int:
        """Ordinary device memory the layer allocates (beside the Dispatcher's symmetric heap)."""
        return self.weight_bytes() + self.intermediate_bytes()

    def symmetric_bytes(self) -> int:
        return self.moe.symmetric_bytes()

    def expert_flops(self, rows: int) -> int:
        """Flops of the experts' GEMMs over `rows` received rows (2 F H for gate/up, F H for down, x2 each)."""
        return 6 * int(rows) * self.ffn * self.moe.hidden


def check_layer_config(world_size: int, num_experts: int, hidden: int, ffn_hidden: int, max_tokens_per_rank: int,
                       dtype, options: MoELayerOptions | None = None) -> MoELayerConfig:
    """Validate a MoELayer's arguments (no GPU needed); returns the derived sizes."""
    options = MoELayerOptions() if options is None else options
    if not isinstance(options, MoELayerOptions):
        raise MoEArgumentError(f"{OP}: options must be a MoELayerOptions, got {type(options).__name__}")
    if not isinstance(options.dispatch, DispatcherOptions):
        raise MoEArgumentError(f"{OP}: options.dispatch must be a DispatcherOptions, got "
                               f"{type(options.dispatch).__name__}")
    if options.dispatch.fp8:
        raise MoEArgumentError(f"{OP}: FP8 dispatch (fp8={options.dispatch.fp8!r}) is not supported: the layer's "
                               "grouped GEMM takes bf16/fp16 rows; use DispatcherOptions(fp8='')")
    if not isinstance(options.overlap, bool):
        raise MoEArgumentError(f"{OP}: options.overlap must be a bool, got {options.overlap!r}")
    if options.overlap and options.dispatch.mode != "throughput":
        raise MoEArgumentError(f"{OP}: overlap=True needs DispatcherOptions(mode='throughput') (the low-latency "
                               f"dispatch has no per-expert arrival flags), got mode={options.dispatch.mode!r}")
    cfg = check_config(world_size, num_experts, hidden, max_tokens_per_rank, dtype,
                       overlap_dispatch_options(options))
    if not isinstance(ffn_hidden, (int, np.integer)) or ffn_hidden <= 0 or ffn_hidden % 8:
        raise MoEArgumentError(f"{OP}: ffn_hidden={ffn_hidden!r} must be a positive multiple of 8 (16-byte rows for "
                               "the grouped GEMM's TMA)")
    from ..gemm.grouped import check_grouped_plan
    from ..gemm.plan import MAX_GROUPS, GemmPlan

    if cfg.local_experts > MAX_GROUPS:
        raise MoEArgumentError(f"{OP}: {cfg.local_experts} local experts exceed the grouped GEMM's {MAX_GROUPS} "
                               "groups")
    for name in ("gate_up_plan", "down_plan"):
        plan = getattr(options, name)
        if plan is None:
            continue
        if not isinstance(plan, GemmPlan):
            raise MoEArgumentError(f"{OP}: options.{name} must be a fluxrt.gemm.GemmPlan, got {type(plan).__name__}")
        try:
            check_grouped_plan(plan, cfg.dtype)
        except GemmArgumentError as e:
            raise MoEArgumentError(f"{OP}: options.{name}: {e}") from e
    return MoELayerConfig(moe=cfg, ffn=int(ffn_hidden))


class MoELayer:
    """``forward(x [T, H], topk_idx [T, k], topk_weights [T, k]) -> [T, H]``: this rank's share of an expert-
    parallel MoE layer (collective: every rank calls with its own tokens, in the same order)."""

    def __init__(self, world: World, num_experts: int, hidden: int, ffn_hidden: int, max_tokens_per_rank: int,
                 dtype="bfloat16", options: MoELayerOptions | None = None):
        import cupy

        from ..gemm.grouped import validate_grouped_args
        from ..ops.common import num_sms
        from ..ops.mlp import load_silu_mul, silu_mul_grid

        world.check_active()
        require_one_domain(world, f"{OP}()", MoEArgumentError)
        self.world = world
        self.options = MoELayerOptions() if options is None else options

        def local_checks():
            cfg = check_layer_config(world.size, num_experts, hidden, ffn_hidden, max_tokens_per_rank, dtype,
                                     self.options)
            return cfg, {"num_experts": num_experts, "hidden": hidden, "ffn_hidden": ffn_hidden,
                         "max_tokens_per_rank": max_tokens_per_rank, "dtype": cfg.moe.dtype,
                         "options": repr(self.options)}

        self.cfg = cfg = _checked_on_every_rank(world, f"{OP}()", local_checks)
        self.dispatcher = Dispatcher(world, num_experts, hidden, max_tokens_per_rank, cfg.moe.dtype,
                                     overlap_dispatch_options(self.options))
        d, el, f, h, r = self.dispatcher, cfg.local_experts, cfg.ffn, cfg.moe.hidden, cfg.moe.recv_rows

        def allocate():
            dt = normalize_dtype(cfg.moe.dtype)
            try:
                with world.device:
                    bufs = (cupy.zeros((el, 2 * f, h), dtype=dt), cupy.zeros((el, h, f), dtype=dt),
                            cupy.empty((r, 2 * f), dtype=dt), cupy.empty((r, f), dtype=dt),
                            cupy.empty((cfg.moe.max_tokens, h), dtype=dt))
                    world.device.synchronize()   # the zeroed weights, before set_weights on any stream
            except cupy.cuda.memory.OutOfMemoryError as e:
                raise MoEArgumentError(
                    f"{OP}: rank {world.rank} cannot allocate {cfg.device_bytes()} device bytes (weights "
                    f"{cfg.weight_bytes()}, intermediates {cfg.intermediate_bytes()} for {r} worst-case rows: "
                    f"max_tokens_per_rank x world x top_k): {e}; lower max_tokens_per_rank or top_k") from None
            return bufs, {}

        try:
            bufs = _checked_on_every_rank(world, f"{OP}() buffers", allocate)
        except BaseException:
            d.free()
            raise
        self.w_gate_up, self.w_down, self.h, self.act, self.out = bufs
        with world.device:
            # a plain CuPy view of the symmetric receive buffer: grouped_gemm reuses its packed launch (no host
            # work but the launch) for plain CuPy arrays only
            self._recv = cupy.ndarray(d.recv.shape, d.recv.dtype, d.recv.data)
            self._silu = load_silu_mul(cfg.moe.dtype, bounded=True)
        validate_grouped_args(self._recv, self.w_gate_up, d.offsets, self.h, trans_b=True)
        validate_grouped_args(self.act, self.w_down, d.offsets, self._recv, trans_b=True)
        self._act_grid = silu_mul_grid(r, f, num_sms(world))
        # the activation's row bound: offsets[E_local], the received rows (read on the device)
        self._row_end = np.uint64(d.offsets.data.ptr + 4 * el)
        self._overlap = None
        if self.options.overlap:
            from ..gemm.grouped import grouped_plan
            from ..gemm.hooks import GroupArrival, GroupScatter

            # the SMs the push and the combine need stay free: a GEMM that waits for rows (gate/up), or whose rows
            # a spinning combine waits for (down), must not hold them all
            cap = max(1, num_sms(world) - d.blocks)

            def capped(plan):
                return plan if plan.max_ctas is not None and plan.max_ctas <= cap else dataclasses.replace(
                    plan, max_ctas=cap)

            dt = cfg.moe.dtype
            plan = capped(self.options.gate_up_plan or grouped_plan(r, 2 * f, h, el, in_dtype=dt, out_dtype=dt))
            # the sequential layer's down plan (the grid cap changes no tile's bits)
            down = capped(self.options.down_plan or grouped_plan(r, h, f, el, in_dtype=dt, out_dtype=dt))
            arrival = GroupArrival(flags=d.arrival_flags, epoch_at=d.round_ptr, sources=world.size,
                                   err=int(world.error_record), timeout_ns=int(world.timeout_ns),
                                   op_id=op_id(OP_OVERLAP), rank=world.rank)
            dsts, counters = d.return_targets()
            scatter = GroupScatter(rows=d.home_rows, dsts=dsts.data.ptr, flags=counters.data.ptr, homes=world.size,
                                   ld=h, entries=cfg.moe.return_rows)
            with world.device:
                self._overlap = _OverlapState(cupy.cuda.Stream(non_blocking=True), plan, arrival,
                                              cupy.cuda.Event(disable_timing=True),
                                              cupy.cuda.Event(disable_timing=True), down, scatter)
        self._freed = False
        log.info("MoELayer on %d ranks: ffn %d, %d local experts, %d device bytes beside %d symmetric", world.size,
                 f, el, cfg.device_bytes(), cfg.symmetric_bytes())

    @property
    def local_experts(self) -> int:
        return self.cfg.local_experts

    # --- weights ----------------------------------------------------------------------------------
    def set_weights(self, w_gate_up=None, w_down=None, *, w_gate=None, w_up=None, stream=None) -> None:
        """Copy this rank's expert weights in (stream-ordered on `stream`; not collective): ``w_gate_up``
        [E_local, 2 F, H] (gate rows, then up rows), or ``w_gate`` and ``w_up`` [E_local, F, H] each; ``w_down``
        [E_local, H, F]. Any of them may be left out (that part keeps its weights). Everything is checked before
        anything is copied."""
        import cupy

        s = as_cupy_stream(stream)
        el, f, h, dt = self.cfg.local_experts, self.cfg.ffn, self.cfg.moe.hidden, self.cfg.moe.dtype
        self._check_live()
        if w_gate_up is not None and (w_gate is not None or w_up is not None):
            raise MoEArgumentError(f"{OP}.set_weights: give w_gate_up or w_gate and w_up, not both")
        if (w_gate is None) != (w_up is None):
            raise MoEArgumentError(f"{OP}.set_weights: w_gate and w_up go together")
        want = {"w_gate_up": (el, 2 * f, h), "w_gate": (el, f, h), "w_up": (el, f, h), "w_down": (el, h, f)}
        got = {}
        for name, value in (("w_gate_up", w_gate_up), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if value is None:
                continue
            a = _intake(value, name, f"{OP}.set_weights", self.world, s)
            if tuple(a.shape) != want[name] or a.dtype.name != dt:
                raise MoEArgumentError(f"{OP}.set_weights: {name} must be {short_name(dt)} {list(want[name])} "
                                       f"([E_local, N, K]: nn.Linear's layout per expert), got {short_name(a.dtype)} "
                                       f"{list(a.shape)}")
            got[name] = a
        with self.world.device, s:
            if "w_gate_up" in got:
                cupy.copyto(self.w_gate_up, got["w_gate_up"])
            if "w_gate" in got:
                cupy.copyto(self.w_gate_up[:, :f], got["w_gate"])
                cupy.copyto(self.w_gate_up[:, f:], got["w_up"])
            if "w_down" in got:
                cupy.copyto(self.w_down, got["w_down"])

    # --- the pipeline -----------------------------------------------------------------------------
    @_nvtx("moe_layer")
    def forward(self, x, topk_idx, topk_weights, *, out=None, stream=None, overlap: bool | None = None):
        """out [T, H] = sum over slots j of topk_weights[t, j] * FFN_{topk_idx[t, j]}(x[t]), FFN_e(v) =
        W_down[e] (silu(W_gate[e] v) * (W_up[e] v)). x [T, H] (T <= max_tokens_per_rank, may differ across
        ranks); topk_idx [T, k] int32/int64 (-1 masks a slot), topk_weights [T, k] float32, k <= top_k.
        out: optional [T, H]; without it the result is a view of the layer's output buffer, overwritten by the
        next call. Stream-ordered on `stream`, no host sync. overlap: None follows ``options.overlap``; False runs
        an overlapped layer's stages one after another (True needs a layer made with overlap)."""
        self.world.make_current()
        s = as_cupy_stream(stream)
        if overlap is None:
            overlap = self.options.overlap
        o = self._check_forward(x, out, s, bool(overlap))
        if not overlap:
            handle = self.dispatch(x, topk_idx, topk_weights, stream=s)
            self.experts(handle, stream=s)
            return self.combine(handle, out=o, stream=s)
        ov = self._overlap
        self._check_live()
        _, handle = self.dispatcher.dispatch(x, topk_idx, topk_weights, stream=s, layout_event=ov.layout_done)
        ov.stream.wait_event(ov.layout_done)   # the offsets and the round exist; the rows arrive meanwhile
        self._experts(ov.stream, arrival=ov.arrival, gate_up_plan=ov.plan, down_plan=ov.down_plan,
                      scatter=ov.scatter)
        ov.experts_done.record(ov.stream)
        # beside the experts: each token once its owners' down-projection rows have landed here
        o = self.dispatcher.combine_returned(handle, out=o, stream=s)
        # the next call's dispatch overwrites the receive buffer (and h, act): after this call's experts
        s.wait_event(ov.experts_done)
        return o

    __call__ = forward

    def dispatch(self, x, topk_idx, topk_weights, *, stream=None) -> DispatchHandle:
        """The first stage: the tokens to their experts' ranks (``Dispatcher.dispatch``); returns its handle."""
        self._check_live()
        _, handle = self.dispatcher.dispatch(x, topk_idx, topk_weights, stream=stream)
        return handle

    @_nvtx("moe_layer.experts")
    def experts(self, handle: DispatchHandle, *, stream=None) -> None:
        """The second stage: every local expert's FFN over its received rows, written over the receive buffer
        (grouped GEMM gate/up, SiLU-and-multiply, grouped GEMM down; local, not collective)."""
        s = as_cupy_stream(stream)
        self._check_live()
        self._check_handle(handle, "experts")
        self._experts(s, arrival=None, gate_up_plan=self.options.gate_up_plan, down_plan=self.options.down_plan)

    def _experts(self, s, *, arrival, gate_up_plan, down_plan, scatter=None) -> None:
        from ..gemm.grouped import grouped_gemm
        from ..ops.mlp import SILU_MUL_THREADS

        d = self.dispatcher
        grouped_gemm(self._recv, self.w_gate_up, d.offsets, out=self.h, trans_b=True, stream=s, plan=gate_up_plan,
                     arrival=arrival)
        with self.world.device:
            self._silu((self._act_grid,), (SILU_MUL_THREADS,),
                       (np.uint64(self.h.data.ptr), np.uint64(self.act.data.ptr), np.uint64(self.cfg.moe.recv_rows),
                        np.uint64(self.cfg.ffn // 8), self._row_end), stream=s)
        # with scatter the rows go to their home ranks' return buffers; out is then only checked
        grouped_gemm(self.act, self.w_down, d.offsets, out=self._recv, trans_b=True, stream=s, plan=down_plan,
                     scatter=scatter)

    def combine(self, handle: DispatchHandle, *, out=None, stream=None):
        """The last stage: the experts' rows back to their tokens, weighted and summed (``Dispatcher.combine``
        of the receive buffer in place). out: optional [T, H]; default a view of the layer's output buffer."""
        self._check_live()
        if out is None and isinstance(handle, DispatchHandle):
            out = self.out[:handle.tokens]
        return self.dispatcher.combine(self._recv, handle, out=out, stream=stream)

    # --- checks -------------------------------------------------------------------------------------
    def _check_forward(self, x, out, s, overlap: bool = False):
        """forward's own arguments (the output), agreed across ranks before the dispatch launches: a bad
        output must not leave a dispatch without its combine."""
        cfg = self.cfg.moe

        def local_checks():
            self._check_live()
            if overlap and self._overlap is None:
                raise MoEArgumentError(f"{OP}.forward: overlap=True needs a layer made with "
                                       "MoELayerOptions(overlap=True) (its Dispatcher raises the arrival flags)")
            a = _intake(x, "x", "moe_layer", self.world, s)
            if a.ndim != 2 or a.shape[1] != cfg.hidden:
                raise MoEArgumentError(f"moe_layer: x must be [T, {cfg.hidden}], got shape {tuple(a.shape)}")
            t = int(a.shape[0])
            if t > cfg.max_tokens:
                raise MoEArgumentError(f"moe_layer: {t} tokens exceed max_tokens_per_rank={cfg.max_tokens}")
            if out is None:
                return self.out[:t], {"hidden": cfg.hidden}
            o = _intake(out, "out", "moe_layer", self.world, s, writable=True)
            if tuple(o.shape) != (t, cfg.hidden) or o.dtype.name != cfg.dtype:
                raise MoEArgumentError(f"moe_layer: out must be {short_name(cfg.dtype)} [{t}, {cfg.hidden}], got "
                                       f"{short_name(o.dtype)} {tuple(o.shape)}")
            return o, {"hidden": cfg.hidden}

        return _checked_on_every_rank(self.world, "moe_layer", local_checks)

    def _check_handle(self, handle, stage: str) -> None:
        d = self.dispatcher
        if not isinstance(handle, DispatchHandle) or handle._d is not d:
            raise MoEArgumentError(f"{OP}.{stage}: handle must come from this layer's dispatch")
        if handle.seq != d._seq or handle.combined:
            raise MoEArgumentError(f"{OP}.{stage}: handle is not the latest uncombined dispatch (its rows are gone)")

    def _check_live(self) -> None:
        self.world.check_active()
        if self._freed:
            raise MoEArgumentError(f"this {OP} has been freed")
        self.world.check_errors()

    def free(self) -> None:
        """Collective: release the Dispatcher's symmetric buffers and the layer's own."""
        if not self._freed:
            self.dispatcher.free()
            self.w_gate_up = self.w_down = self.h = self.act = self.out = self._recv = self._overlap = None
        self._freed = True

    def __repr__(self) -> str:
        c = self.cfg.moe
        return (f"MoELayer(experts={c.num_experts}, hidden={c.hidden}, ffn_hidden={self.cfg.ffn}, "
                f"max_tokens_per_rank={c.max_tokens}, dtype={short_name(c.dtype)}, world={c.world})")
