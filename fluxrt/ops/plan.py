"""Planners of the fused tensor-parallel ops: row rules, chunk and flag layout, tile order, comm mode.

Pure Python, no CUDA: every choice an op makes is a frozen dataclass you can print, and a plan passed
to the op's constructor overrides the default one.

AllGather+GEMM (:class:`AgGemmPlan`)
    A is gathered into a symmetric buffer ``a_full [M, K]``; rank r's shard is rows
    ``[r * M/world, (r+1) * M/world)``, cut into ``chunks_per_rank`` chunks of ``chunk_rows`` rows, each
    with one arrival flag. ``comm_mode='pull'``: a fluxrt stream pulls each peer's chunks with the copy
    engine (nearest peers first, starting at rank+1) and raises the local chunk flag after each pull.
    ``comm_mode='push'``: every rank pushes its chunks into every peer's buffer with SM kernels
    (``push_blocks`` CTAs) and releases the peer's chunk flag. The GEMM starts at the rank's own shard
    (``m_tile_offset``) and waits per tile for the chunk it needs.

GEMM+ReduceScatter (:class:`GemmRsPlan`)
    Each rank computes the partial ``A @ B`` for all M rows, starting with the rows of rank+1 and
    ending with its own; the partials of owner o's rows reach o's symmetric receive buffer
    ``recv[parity][source]``. ``comm_mode='ce'``: the GEMM stores tiles in its own symmetric buffer and
    counts them per (owner, group of ``ce_groups`` tile columns); each owner's fluxrt stream waits for a
    source's count, pulls the group with the copy engine and raises its own flag per (source, group). ``'sm'``: the GEMM's
    storer stores each tile straight into the owner's buffer and releases one flag per (source, tile).
    The owner sums the world partials in fixed source order in fp32 (deterministic).
    ``reduce_mode='epilogue'``: the owner's GEMM, which makes its own rows last, adds the peers'
    partials to those tiles' accumulators in its epilogue (waiting per tile or group for each) and
    stores the sum: no reduce kernel, no own partial in memory. ``'after'``: a reduce kernel after the
    GEMM on the caller's stream; ``'concurrent'`` (comm_mode 'sm'): a reduce kernel on a second stream
    during the GEMM, which then leaves ``reduce_blocks`` SMs free. Buffers alternate between two parities so that a call's partials never
    land in the buffer the owner may still be reducing (see gemm_rs.py for why two suffice).

Row rule (both ops): ``M`` must be a multiple of ``world`` (every rank holds M/world rows) and at most
``max_m``. A shard of whole ``row_multiple`` rows (128, times ``chunks_per_rank`` for AllGather+GEMM)
takes the fast path. Other shards are padded inside the op to the next multiple (``padded_shard``), so
that no GEMM tile straddles two ranks' rows or chunks. The GEMM runs over the padded rows and sees the
caller's arrays as bands (:class:`fluxrt.gemm.RowBands`): AllGather+GEMM gathers into padded slots and
its GEMM writes the real rows of each band straight into the output (TMA clips the padding rows);
GEMM+ReduceScatter's GEMM reads A in place, the padding rows as zeros (TMA's fill), and its slice is
copied out of a padded one. What the padded path still moves through memory: AllGather+GEMM the shard
into its slot (hook 4 copies whole tiles only), plus M x K with return_a; GEMM+ReduceScatter the
M/world x N slice. The buffers are sized for padded shards (``capacity_rows``). AllGather+GEMM pads to
whole chunks: with chunks_per_rank 2 a small shard may leave a chunk of padding only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import FluxrtError
from ..gemm.plan import GemmPlan, H100_H200_SMS, plan_gemm

__all__ = ["AgGemmPlan", "GemmRsPlan", "OpsArgumentError", "AG_COMM_MODES", "RS_REDUCE_MODES", "TILE_ROWS",
           "MAX_WORLD", "plan_ag_gemm", "plan_gemm_rs", "check_rows", "padded_shard", "capacity_rows", "pull_order",
           "ag_pad_layout",
           "ag_gemm_plan", "rs_gemm_plan", "aligned_group_m", "rs_flag_layout", "rs_tile_offset", "ag_tile_offset",
           "rs_reduce_grid", "rs_ce_groups", "RS_COMM_MODES", "PATHS", "Fp8Options", "FP8_OP_SCALES", "op_sms"]

TILE_ROWS = 128              # GEMM tile height (GemmPlan.block_m with two consumer warpgroups)
MIN_TILE_COLS = 64           # narrowest GEMM tile: flag pads are sized for it
MAX_WORLD = 64               # ranks a reduce block waits on (one thread per source)
AG_COMM_MODES = ("pull", "push")
RS_COMM_MODES = ("ce", "sm")
RS_REDUCE_MODES = ("after", "tail", "epilogue", "concurrent")
PARITIES = 2                 # GEMM+RS receive buffers alternate between two parities
REDUCE_BLOCKS_PER_SM = 4     # 'after' reduce: 4 x 256 threads per SM keep enough loads in flight for HBM


class OpsArgumentError(FluxrtError, ValueError):
    """A fused op was called with shapes, dtypes or options it cannot run."""


@dataclass(frozen=True)
class AgGemmPlan:
    """How AllGather+GEMM moves A and orders its tiles.

    chunks_per_rank: arrival flags per rank shard (finer chunks let the GEMM start on a peer's rows
        before the whole shard has arrived).
    comm_mode: 'pull' (copy engine, no SMs) or 'push' (SM kernels on a fluxrt stream).
    comm_sms: SMs the GEMM leaves free for the comm stream's kernels: pull mode's one-thread wait and
        signal kernels, or push mode's push kernels. The GEMM's CTAs wait for flags these kernels
        release, so they must always find a free SM. None: 1 for 'pull', push_blocks for 'push'.
    push_blocks: CTAs of each push kernel (comm_mode='push').
    gemm: a GemmPlan to use instead of planning per call (m_tile_offset and max_ctas are set per call).
    path: 'auto' (the cost model of fluxrt.ops.cost picks per M: the fused kernel, or the decomposed
        path where the fused one is predicted to lose, and always inside a CUDA-graph capture),
        'fused' or 'decomposed'.
    decomposed_chunks: chunks of the decomposed path (None: the cost model's choice).
    sm_count: SMs the op may occupy at once, comm_sms included (None: all that this process's context may
        use, :func:`fluxrt.gemm.context_sms`: the device's, or its share under CUDA MPS with an active thread
        percentage or in a green context). The fused GEMM's grid is sized by it, because its CTAs wait for
        flags that need all of them and the comm kernels resident at once (the decomposed path's GEMMs
        beside its collectives are capped by it too): set it lower when other kernels run beside the op on
        the same GPU, or when it shares the GPU with other processes through MPS (docs/design.md,
        "Testing"). More than the context may use is an error.
    """
    chunks_per_rank: int = 1
    comm_mode: str = "pull"
    comm_sms: int | None = None
    push_blocks: int = 8
    gemm: GemmPlan | None = None
    path: str = "auto"
    decomposed_chunks: int | None = None
    sm_count: int | None = None

    def validate(self) -> "AgGemmPlan":
        _check_path(self)
        _check_sm_count(self)
        if self.chunks_per_rank < 1:
            raise OpsArgumentError(f"AgGemmPlan.chunks_per_rank must be >= 1, got {self.chunks_per_rank}")
        if self.comm_mode not in AG_COMM_MODES:
            raise OpsArgumentError(f"AgGemmPlan.comm_mode must be one of {AG_COMM_MODES}, got {self.comm_mode!r}")
        if self.push_blocks < 1:
            raise OpsArgumentError(f"AgGemmPlan.push_blocks must be >= 1, got {self.push_blocks}")
        need = self.push_blocks if self.comm_mode == "push" else 1
        if self.reserved_sms < need:
            raise OpsArgumentError(f"AgGemmPlan.comm_sms={self.comm_sms} leaves too few SMs for the comm stream: "
                                   f"comm_mode={self.comm_mode!r} needs >= {need} (a GEMM CTA waiting for a "
                                   "chunk would otherwise hold the SM its producer needs)")
        _check_gemm_override(self.gemm)
        return self

    @property
    def reserved_sms(self) -> int:
        """SMs the GEMM leaves to the comm stream (comm_sms resolved)."""
        if self.comm_sms is not None:
            return self.comm_sms
        return self.push_blocks if self.comm_mode == "push" else 1

    @property
    def row_multiple(self) -> int:
        """M per rank must be a multiple of this."""
        return TILE_ROWS * self.chunks_per_rank


@dataclass(frozen=True)
class GemmRsPlan:
    """How GEMM+ReduceScatter orders tiles and reduces.

    comm_mode: 'ce' (the GEMM stores partials in its own symmetric buffer; each owner pulls every
        finished group of columns with the copy engine; the GEMM leaves 1 SM for the comm stream's wait
        kernels) or 'sm' (the GEMM's storer writes each tile into the owner's buffer over NVLink).
    ce_groups: column groups per source in 'ce' mode (finer groups arrive sooner, at 3 small launches
        per group and source).
    reduce_mode: 'after' (reduce kernel after the GEMM on the caller's stream), 'tail' (inside the GEMM:
        every consumer warp that has no tile left sums slabs of the own rows, whose tiles come last, on
        the SMs the last wave leaves idle; input-type partials only), 'epilogue' (the GEMM's consumers
        add the peers' partials to the own rows' tiles in their epilogue and store the result:
        input-type partials only) or 'concurrent' (comm_mode 'sm' only: reduce kernel on a fluxrt
        stream during the GEMM, which leaves reduce_blocks SMs free).
    reduce_blocks: CTAs of the reduce kernel in 'concurrent' mode ('after' uses every SM).
    partial_dtype: element type of the partials sent to owners: None (the input type) or 'float32'
        (twice the traffic, no intermediate rounding).
    gemm: a GemmPlan to use instead of planning per call (m_tile_offset and max_ctas are set per call).
    path, decomposed_chunks: as :class:`AgGemmPlan` (the decomposed path reduces in the collectives' fp32
        and ignores partial_dtype).
    sm_count: as :class:`AgGemmPlan` (the SMs reduce_mode 'concurrent' and comm_mode 'ce' leave free count
        within it): the tail and epilogue reduces wait for tiles of other CTAs of the same grid.
    """
    comm_mode: str = "ce"
    ce_groups: int = 4
    reduce_mode: str = "tail"
    reduce_blocks: int = 8
    partial_dtype: str | None = None
    gemm: GemmPlan | None = None
    path: str = "auto"
    decomposed_chunks: int | None = None
    sm_count: int | None = None

    def validate(self) -> "GemmRsPlan":
        _check_path(self)
        _check_sm_count(self)
        if self.comm_mode not in RS_COMM_MODES:
            raise OpsArgumentError(f"GemmRsPlan.comm_mode must be one of {RS_COMM_MODES}, got {self.comm_mode!r}")
        if self.ce_groups < 1:
            raise OpsArgumentError(f"GemmRsPlan.ce_groups must be >= 1, got {self.ce_groups}")
        if self.reduce_mode not in RS_REDUCE_MODES:
            raise OpsArgumentError(f"GemmRsPlan.reduce_mode must be one of {RS_REDUCE_MODES}, "
                                   f"got {self.reduce_mode!r}")
        if self.comm_mode == "ce" and self.reduce_mode == "concurrent":
            raise OpsArgumentError("GemmRsPlan: reduce_mode='concurrent' needs comm_mode='sm' (a reduce beside "
                                   "the GEMM waits per tile, and 'ce' signals per group of columns after the GEMM's "
                                   "tiles of that group are all done)")
        if self.reduce_blocks < 1:
            raise OpsArgumentError(f"GemmRsPlan.reduce_blocks must be >= 1, got {self.reduce_blocks}")
        if self.reduce_mode in ("epilogue", "tail") and self.partial_dtype is not None:
            raise OpsArgumentError(f"GemmRsPlan: reduce_mode={self.reduce_mode!r} adds partials of the input type "
                                   f"inside the GEMM; partial_dtype={self.partial_dtype!r} needs reduce_mode='after'")
        if self.reduce_mode == "tail" and self.gemm is not None and (self.gemm.cluster_ctas != 1
                                                                     or self.gemm.order != "grouped"):
            raise OpsArgumentError("GemmRsPlan: reduce_mode='tail' needs a cluster-1 GEMM plan in grouped order "
                                   f"(got cluster={self.gemm.cluster}x{self.gemm.cluster_n}, "
                                   f"order={self.gemm.order!r})")
        if self.partial_dtype not in (None, "float32"):
            raise OpsArgumentError(f"GemmRsPlan.partial_dtype must be None (input type) or 'float32', "
                                   f"got {self.partial_dtype!r}")
        _check_gemm_override(self.gemm)
        return self

    @property
    def row_multiple(self) -> int:
        return TILE_ROWS

    @property
    def reserved_sms(self) -> int:
        """SMs the GEMM leaves free: the concurrent reduce's, or one for the 'ce' comm stream's waits."""
        if self.reduce_mode == "concurrent":
            return self.reduce_blocks
        return 1 if self.comm_mode == "ce" else 0


PATHS = ("auto", "fused", "decomposed")
FP8_OP_SCALES = ("tensor", "block")   # the fp8 scale modes of the tensor-parallel ops


@dataclass(frozen=True)
class Fp8Options:
    """FP8 inputs of AllGatherGemm / GemmReduceScatter (the ops' ``fp8=`` option): A and B are uint8 arrays of
    fp8 bytes read as ``format``, the op's ``dtype`` is the output (bf16 or fp16), B is [N, K] (trans_b=True),
    and ``forward`` takes fp32 ``scale_a`` / ``scale_b`` device arrays (:mod:`fluxrt.gemm.fp8`).

    format: 'e4m3', 'e5m2', or a pair (A's, B's).
    scale: 'tensor' (scale_a and scale_b of one element each; scale_a may differ between ranks: AllGather+GEMM
        gathers every rank's and multiplies each rank's rows with its own) or 'block' (scale_a [rows of A,
        ceil(K/128)] per row and 128 K, gathered with A's rows; scale_b [ceil(N/128), ceil(K/128)]).

    Such calls always take the decomposed path (the fused kernels have no fp8 hooks): AllGather+GEMM gathers
    the fp8 bytes (half the bytes of bf16) and the scales, GEMM+ReduceScatter reduce-scatters the output-type
    partials of its fp8 GEMMs.
    """
    format: str | tuple = "e4m3"
    scale: str = "tensor"

    def validate(self) -> "Fp8Options":
        from ..gemm.checks import fp8_formats

        try:
            fp8_formats(self.format)
        except Exception as e:
            raise OpsArgumentError(f"Fp8Options.format: {e}") from None
        if self.scale not in FP8_OP_SCALES:
            raise OpsArgumentError(f"Fp8Options.scale must be one of {FP8_OP_SCALES}, got {self.scale!r}")
        return self


def _check_path(plan) -> None:
    name = type(plan).__name__
    if plan.path not in PATHS:
        raise OpsArgumentError(f"{name}.path must be one of {PATHS}, got {plan.path!r}")
    c = plan.decomposed_chunks
    if c is not None and (not isinstance(c, int) or c < 1):
        raise OpsArgumentError(f"{name}.decomposed_chunks must be None or an int >= 1, got {c!r}")


def _check_sm_count(plan) -> None:
    c = plan.sm_count
    if c is None:
        return
    if not isinstance(c, int) or isinstance(c, bool) or c <= plan.reserved_sms:
        raise OpsArgumentError(f"{type(plan).__name__}.sm_count must be None or an int above the "
                               f"{plan.reserved_sms} SM(s) the GEMM leaves to its comm kernels, got {c!r}")


def op_sms(plan, context_sms: int, op: str) -> int:
    """SMs an op sizes its grids for: plan.sm_count, or the `context_sms` this process's context may use.
    An sm_count above that raises: the GEMM's CTAs, which wait for each other's flags, could not all be
    resident."""
    if plan.sm_count is None:
        return context_sms
    if plan.sm_count > context_sms:
        raise OpsArgumentError(f"{op}: plan.sm_count={plan.sm_count} exceeds the {context_sms} SMs this process's "
                               "context may use (fluxrt.gemm.context_sms: under CUDA MPS or in a green context, "
                               "its share of the GPU): the GEMM's CTAs could not all be resident at once")
    return plan.sm_count


def _check_gemm_override(plan: GemmPlan | None) -> None:
    if plan is None:
        return
    if plan.block_m != TILE_ROWS:
        raise OpsArgumentError(f"the fused ops need GEMM tiles of {TILE_ROWS} rows (two consumers), "
                               f"got block_m={plan.block_m}")
    if plan.epilogue != "tma":
        raise OpsArgumentError("the fused ops need GemmPlan.epilogue='tma' (the storer-warp epilogue)")
    if plan.cluster_n != 1:
        raise OpsArgumentError(f"the fused ops' GEMM runs with hooks, which clusters along N do not support, got "
                               f"cluster_n={plan.cluster_n}")


def plan_ag_gemm(max_m: int, n: int, k: int, world: int, *, num_sms: int = H100_H200_SMS) -> AgGemmPlan:
    """Default AllGather+GEMM plan.

    Heuristic: copy-engine pulls (no SMs taken from the GEMM; push mode is the alternative to
    measure). Two chunks per rank once a shard holds >= 8 tile rows (>= 1024 rows): the first tiles of
    a peer's rows can start after half of its shard has arrived, at one extra flag per chunk.
    """
    shard = max_m // max(world, 1)
    cpr = 2 if shard >= 8 * TILE_ROWS and shard % (2 * TILE_ROWS) == 0 else 1
    return AgGemmPlan(chunks_per_rank=cpr, comm_mode="pull").validate()


def plan_gemm_rs(max_m: int, n: int, k: int, world: int, *, num_sms: int = H100_H200_SMS) -> GemmRsPlan:
    """Default GEMM+ReduceScatter plan: partials in the input type, pulled by their owners with the copy
    engine per group of columns during the GEMM, then summed in the GEMM's tail. Measured on 4x H200: SM
    stores to peers slowed the GEMM by 5-11 %, copy-engine transfers of the same bytes beside it by
    1-2 %; the reduce kernel after the GEMM beat the epilogue reduce by 2.3-3.2 % at TP=4 and tied with
    it at TP=2; the tail reduce beat the kernel after by 2.1-2.3 % at TP=4 (timed in turns, same jobs)."""
    return GemmRsPlan(comm_mode="ce", reduce_mode="tail").validate()


# --- rules and layouts ----------------------------------------------------------------------------

def check_rows(op: str, m: int, world: int, max_m: int | None = None) -> int:
    """Rows per rank of an M-row problem; raises OpsArgumentError naming the rule."""
    if m <= 0:
        raise OpsArgumentError(f"{op}: M must be positive, got {m}")
    if max_m is not None and m > max_m:
        raise OpsArgumentError(f"{op}: M={m} exceeds max_m={max_m} given at construction")
    if m % world:
        raise OpsArgumentError(f"{op}: M={m} must be a multiple of world = {world} (every rank holds M/world "
                               "rows); pad M")
    return m // world


def padded_shard(shard: int, row_multiple: int) -> int:
    """Rows a rank's shard takes inside the op: whole `row_multiple`s (GEMM tiles, times chunks), so that a
    tile never straddles two ranks' rows or chunks. Equal to `shard` on the fast path."""
    return -(-shard // row_multiple) * row_multiple


def capacity_rows(max_m: int, world: int, row_multiple: int) -> int:
    """Rows the op's buffers hold: every M <= max_m that is a multiple of world, each shard padded
    (max_m >= world: the constructor checks it)."""
    return world * padded_shard(max_m // world, row_multiple)


def pull_order(rank: int, world: int) -> list[int]:
    """Peers in the order their shards are pulled: rank+1, rank+2, ... (nearest first, wrapping), so
    that no two ranks start by reading the same peer."""
    return [(rank + d) % world for d in range(1, world)]


@dataclass(frozen=True)
class AgPadLayout:
    """Slots of the AllGather+GEMM signal pad (one pad per op).

    chunk(r, c): local arrival flag of chunk c of rank r's shard (raised by this rank's comm stream in
        pull mode, by rank r's push kernel in push mode); the GEMM waits on these. Values: call epochs.
    copied(c): chunk c of MY shard is in my slot of the gathered buffer, as a count that grows by the
        chunk's ``ShardCopy.pieces_per_chunk`` every call (pull mode): the GEMM adds the pieces it copied
        there (hook 4), or the host sets the call's total after its own copy or when the shard needed none.
        Peers poll it before pulling.
    done(r): rank r finished reading the slot it reads of mine (pull: r pulled my shard; push: r's GEMM
        read the slot I pushed into), so my next call may overwrite it. Values: call epochs.
    """
    world: int
    chunks_per_rank: int

    @property
    def chunks(self) -> int:
        return self.world * self.chunks_per_rank

    @property
    def slots(self) -> int:
        return self.chunks + self.chunks_per_rank + self.world

    def chunk(self, rank: int, c: int) -> int:
        return rank * self.chunks_per_rank + c

    def copied(self, c: int) -> int:
        return self.chunks + c

    def done(self, rank: int) -> int:
        return self.chunks + self.chunks_per_rank + rank


def ag_pad_layout(world: int, chunks_per_rank: int) -> AgPadLayout:
    return AgPadLayout(world, chunks_per_rank)


def ag_tile_offset(rank: int, shard_rows: int) -> int:
    """First m tile of AllGather+GEMM: the rank's own shard (present before any transfer)."""
    return rank * shard_rows // TILE_ROWS


def rs_tile_offset(rank: int, world: int, shard_rows: int) -> int:
    """First m tile of GEMM+ReduceScatter: the rows of rank+1, so the rank's own rows come last and the
    partials for peers leave first."""
    return ((rank + 1) % world) * shard_rows // TILE_ROWS


def aligned_group_m(group_m: int, band_tiles: int) -> int:
    """The largest group_m <= `group_m` that divides `band_tiles`: grouped bands then never straddle two
    chunks (AllGather+GEMM) or two owners (GEMM+ReduceScatter), so the own rows are strictly first/last."""
    for g in range(max(1, min(group_m, band_tiles)), 0, -1):
        if band_tiles % g == 0:
            return g
    return 1


def _per_call_gemm(base: GemmPlan | None, m: int, n: int, k: int, dtype: str, out_dtype: str, offset: int,
                   free_sms: int, num_sms: int, band_rows: int) -> GemmPlan:
    if base is None:
        plan = plan_gemm(m, n, k, in_dtype=dtype, out_dtype=out_dtype, num_sms=num_sms)
        plan = dataclasses.replace(plan, group_m=aligned_group_m(plan.group_m, band_rows // TILE_ROWS))
    else:
        plan = base
    cap = max(1, num_sms - free_sms) if free_sms else plan.max_ctas
    if plan.max_ctas is not None and cap is not None:
        cap = min(cap, plan.max_ctas)
    plan = dataclasses.replace(plan, m_tile_offset=offset, max_ctas=cap)
    _check_gemm_override(plan)
    return plan.validate(out_dtype)


def ag_gemm_plan(plan: AgGemmPlan, m: int, n: int, k: int, rank: int, world: int, dtype: str,
                 num_sms: int = H100_H200_SMS) -> GemmPlan:
    """The GemmPlan of one AllGather+GEMM call: own shard first, comm_sms SMs left free."""
    shard = m // world
    return _per_call_gemm(plan.gemm, m, n, k, dtype, dtype, ag_tile_offset(rank, shard), plan.reserved_sms, num_sms,
                          shard // plan.chunks_per_rank)


def rs_gemm_plan(plan: GemmRsPlan, m: int, n: int, k: int, rank: int, world: int, dtype: str,
                 num_sms: int = H100_H200_SMS) -> GemmPlan:
    """The GemmPlan of one GEMM+ReduceScatter call: rank+1's rows first, own rows last."""
    shard = m // world
    free = plan.reserved_sms
    out_dtype = plan.partial_dtype or dtype
    return _per_call_gemm(plan.gemm, m, n, k, dtype, out_dtype, rs_tile_offset(rank, world, shard), free, num_sms,
                          shard)


@dataclass(frozen=True)
class RsFlagLayout:
    """Flags of GEMM+ReduceScatter on the owner: ``[parity][source][i]``, ``tiles_per_source`` slots per
    source, sized for the largest shard and the narrowest tile. comm_mode 'sm': ``i = local_m_tile *
    n_tiles + n_tile`` (the GEMM epilogue's index); 'ce': ``i`` = the column group."""
    world: int
    tiles_per_source: int

    @property
    def slots(self) -> int:
        return PARITIES * self.world * self.tiles_per_source

    def base(self, parity: int, source: int) -> int:
        return (parity * self.world + source) * self.tiles_per_source

    def slot(self, parity: int, source: int, local_m_tile: int, n_tile: int, n_tiles: int) -> int:
        idx = local_m_tile * n_tiles + n_tile
        if not 0 <= idx < self.tiles_per_source:
            raise IndexError(f"tile ({local_m_tile}, {n_tile}) outside {self.tiles_per_source} flags per source")
        return self.base(parity, source) + idx


def rs_flag_layout(max_m: int, n: int, world: int) -> RsFlagLayout:
    shard = max_m // world
    return RsFlagLayout(world, math.ceil(shard / TILE_ROWS) * math.ceil(n / MIN_TILE_COLS))


def rs_ce_groups(plan: GemmRsPlan, n: int, block_n: int) -> tuple[int, int]:
    """'ce' mode: (n tiles per column group, groups) for an N-column call with block_n-wide tiles."""
    n_tiles = math.ceil(n / block_n)
    group_n = math.ceil(n_tiles / min(plan.ce_groups, n_tiles))
    return group_n, math.ceil(n_tiles / group_n)


def rs_reduce_grid(plan: GemmRsPlan, shard_rows: int, n: int, block_n: int, num_sms: int = H100_H200_SMS) -> int:
    """CTAs of the reduce kernel: every SM after the GEMM, reduce_blocks beside it."""
    tiles = math.ceil(shard_rows / TILE_ROWS) * math.ceil(n / block_n)
    cap = plan.reduce_blocks if plan.reduce_mode == "concurrent" else REDUCE_BLOCKS_PER_SM * num_sms
    return max(1, min(tiles, cap))
