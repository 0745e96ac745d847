"""GEMM+ReduceScatter (row-parallel linear): this rank's ``[M/world, N]`` slice of ``sum_r A_r @ B_r``.

Every rank computes the partial ``A @ B`` for all M rows (A [M, K_local], B [K_local, N] or [N, K_local]).
Per call, with epoch e and parity q = (e - 1) % 2, on the caller's stream S and a fluxrt comm stream C:

1. S  The GEMM walks the tiles starting at the rows of rank+1 and ending with its own. Its storer warp
      TMA-stores each finished tile of a peer o's rows:
      comm_mode 'ce': into its own symmetric ``part[q][o]`` and adds 1 to its counter of (o, column
      group) (stores complete, proxy fence, release.sys);
      'sm': into o's symmetric ``recv[q][me]`` over NVLink, then releases o's flag ``[q][me][tile]``.
      Own rows: reduce_mode 'epilogue' adds the peers' partials to each own tile's
      accumulators in the consumers' epilogue (step 3) and stores the result into ``out``; the other
      modes store the own partial into ``recv[q][me]`` (default 'tail': with a per-tile flag
      ``[q][me][tile]`` := e).
2. C  ('ce', joined to S before the GEMM so it runs beside it) for each source s, in the order the
      sources produce my rows (rank-1 first), and each column group g: bounded wait until s's counter of
      (me, g) reached the call's total, copy-engine pull of ``s.part[q][me][:, g's columns]`` into my
      ``recv[q][s]``, then my local flag ``[q][s][g]`` := e. Pulls, not pushes: after a copy-engine
      write into a peer, a flag released behind it was seen to reach the peer before the data (README,
      memory-ordering notes); a pull has finished only when the bytes are local.
3. The owner waits (bounded) per tile or column group for the other sources' flags and sums in fp32 in
   a fixed source order, so the result is bitwise independent of arrival order. 'epilogue': inside the
   GEMM (hook 3, :class:`fluxrt.gemm.ChunkReduce`), own accumulator first, then sources 0, 1, ...; the
   own tiles come last, by when the peers' partials have long been produced (each source makes my rows
   before its own) and pulled. 'after': a reduce kernel after the GEMM on S sums the world partials in
   order 0..world-1; 'tail' (default): the same sum inside the GEMM (hook 3 in the tail,
   :class:`fluxrt.gemm.ChunkReduce` with where='tail'): every consumer warp that has no tile left
   claims 16-row slabs of my rows, waits for the slab's flags (mine per tile, the sources' per group)
   and sums, on the SMs the GEMM's last wave leaves idle; 'concurrent' ('sm' only): the reduce kernel
   on C during the GEMM (which leaves ``reduce_blocks`` SMs free). S waits for C before returning.

Why two parities are enough (no ack): a partial for call i+2 lands in owner o's ``recv[q]`` ('sm'), or
overwrites source s's ``part[q]`` ('ce'), only after s's GEMM i+2 started, i.e. after s's reduce of
call i+1 (stream order on s; with 'epilogue' and 'tail' that reduce is inside GEMM i+1); that reduce waited for o's call-(i+1) partials, which exist only once o's
GEMM i+1 ran, after o's reduce of call i (stream order on o), and that reduce waited for o's pulls of
call i. So o has read ``recv[q]`` and pulled ``part[q]`` of call i first. Flags need no reset either: a
parity's flags only ever see that parity's epochs, which grow; the tile counters grow by a known
number of tiles per call.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np

from .. import signals
from ..errors import op_id
from ..nvtx import annotate as _nvtx
from ..gemm import BANDS_A, ChunkReduce, RowBands, TileDestinations, TileEpilogue, gemm_with_hooks, reduce_hook_id
from ..streams import as_cupy_stream
from . import common, decomposed
from .plan import MIN_TILE_COLS, Fp8Options, GemmRsPlan, PARITIES, TILE_ROWS, check_rows, plan_gemm_rs, \
    rs_ce_groups, rs_flag_layout, rs_gemm_plan, rs_reduce_grid

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OP = "GemmReduceScatter"
_REDUCE_THREADS = 256


class GemmReduceScatter:
    """``forward(a [M, K_local], b [K_local, N] or [N, K_local] with trans_b) -> [M/world, N]``: rank r
    gets rows ``[r*M/world, (r+1)*M/world)`` of the sum over ranks of ``a @ b``.

    Collective: every rank constructs it with the same arguments and calls ``forward`` with the same
    shapes in the same order. ``k`` is the local K. M must be a multiple of world and at most ``max_m``;
    shards of whole 128-row tiles take the fast path, other shards are padded (the rule in
    :mod:`fluxrt.ops.plan`). N is fixed. Symmetric memory: ``2 * capacity_m * N`` partial elements per
    rank (capacity_m: max_m with every shard padded to whole tiles), twice that with comm_mode 'ce' (the
    partials the owners pull, in two parities). Unless ``plan.path`` is 'fused', the op also holds the
    decomposed path's partials (max_m x N, device memory, not symmetric; :mod:`fluxrt.ops.decomposed`).

    fp8: :class:`fluxrt.ops.Fp8Options`: A and B are uint8 fp8 bytes (B [N, K_local], trans_b=True),
    ``dtype`` is the output's and the partials', ``forward`` takes ``scale_a`` (one element, or block scales
    [M, ceil(K_local/128)]) and ``scale_b``; the fp8 GEMMs' partials are reduce-scattered on the decomposed
    path (its only one) and the op holds no symmetric memory.
    """

    def __init__(self, world: World, max_m: int, n: int, k: int, dtype="bf16", *, trans_b: bool = False,
                 plan: GemmRsPlan | None = None, fp8: Fp8Options | None = None):
        import cupy

        w = world.size
        common.construct(self, world, OP, max_m, n, k, dtype, trans_b, plan, plan_gemm_rs, fp8)
        common.setup_paths(self, world, self.n)
        if self.fp8 is not None:
            self.partial_dtype = self.dtype
            with world.device:
                self.comm_stream = cupy.cuda.Stream(non_blocking=True)
            return
        self.partial_dtype = self.plan.partial_dtype or self.dtype
        self.max_shard = self.capacity_m // w
        self.layout = rs_flag_layout(self.capacity_m, self.n, w)
        self.recv = world.empty((PARITIES, w, self.max_shard, self.n), self.partial_dtype)
        self.pad = world.signal_pad(self.layout.slots)
        me = world.rank
        ce = self.plan.comm_mode == "ce"
        with world.device:
            self.comm_stream = cupy.cuda.Stream(non_blocking=True)
            if ce:
                # my partials of peers' rows, which the owners pull; own rows go straight to recv[q][me]
                self.part = world.empty((PARITIES, w, self.max_shard, self.n), self.partial_dtype)
                self._dst = [TileDestinations([self.recv[q, me].data.ptr if o == me else self.part[q, o].data.ptr
                                               for o in range(w)], self.n, self.partial_dtype) for q in range(PARITIES)]
                # per (owner, column group): tiles my GEMM finished, over all calls (owners poll them)
                self._groups_max = math.ceil(self.n / MIN_TILE_COLS)
                self.counters = world.signal_pad(w * self._groups_max)
                self._counted = np.zeros((w, self._groups_max), dtype=np.int64)   # (source, group) for my rows
                self._counter_table = cupy.asarray(np.asarray(
                    [self.counters.local_ptr(o * self._groups_max) for o in range(w)], dtype=np.uint64))
                # the comm stream's lists (one upload each, sliced per group): the sources' counters of my
                # rows, and my flags of pulled (source, group)s
                G = self._groups_max
                self._source_counters = signals.PointerList(
                    [self.counters.peer_ptr(src, me * G + g) for src in range(w) for g in range(G)],
                    [src for src in range(w) for g in range(G)])
                self._pulled = [signals.PointerList([self.pad.local_ptr(self.layout.base(q, src) + g)
                                                    for src in range(w) for g in range(G)]) for q in range(PARITIES)]
            else:
                # per parity: where my partial of owner o's rows goes, and o's flags for my tiles
                self._dst = [TileDestinations([self.recv[q, me].data.ptr if o == me else self.recv[q, me].peer_ptr(o)
                                               for o in range(w)], self.n, self.partial_dtype) for q in range(PARITIES)]
                self._flags = [cupy.asarray(np.asarray([self.pad.peer_ptr(o, self.layout.base(q, me))
                                                        for o in range(w)], dtype=np.uint64)) for q in range(PARITIES)]
            self._reduce = common.kernels(world).reduce(self.partial_dtype, self.dtype)
            # 'tail': the GEMM's reducers claim slabs with it; 0 between calls (each launch resets it)
            self._tail_counter = cupy.zeros(1, dtype=cupy.uint32) if self.plan.reduce_mode == "tail" else None
            # the tables above were uploaded on the current stream; the op's streams read them from now on
            cupy.cuda.get_current_stream().synchronize()
        self._gplans: dict = {}
        self._op_reduce = op_id("gemm_rs.reduce", persistent_grid=True)
        self._op_tiles = "gemm_rs.tiles"

    @_nvtx("gemm_rs.forward")
    def forward(self, a, b, out=None, stream=None, *, path: str | None = None, scale_a=None, scale_b=None):
        """This rank's [M/world, N] slice of sum over ranks of a @ b (b.T with trans_b), stream-ordered.
        path: None (the plan's), 'fused' or 'decomposed' for this call (see :meth:`path_choice`).
        scale_a, scale_b: an fp8 op's scales (fp32 device arrays, see the class docstring)."""
        world = self.world
        world.make_current()
        s = as_cupy_stream(stream)
        ops = common.forward_operands(self, OP, a, b, out, s, sharded_a=False, scales=(scale_a, scale_b))
        a, b, out, shard, m = ops[:5]
        sa, sb = ops[5:] or (None, None)
        choice = common.choose_call_path(self, OP, "gemm_rs", m, s, path)
        if choice.path == "decomposed":
            if out is None:
                out = common.alloc_on((shard, self.n), self.dtype, world, s)
            return decomposed.gemm_rs(self, self._decomposed, a, b, out, shard, m, choice.chunks, s, scale_a=sa,
                                      scale_b=sb)
        pad, m_pad = common.padded_rows(self, shard)   # pad == shard: the fast path
        gplan = self._call_plan(m_pad, pad != shard)

        c = self.comm_stream
        with world.device:
            if out is None:
                out = common.alloc_on((shard, self.n), self.dtype, world, s)
            result = out
            a_bands = None
            if pad != shard:
                # a padded call: the GEMM reads every owner's rows as a band of whole tiles, the rows past
                # them as zeros (TMA's fill), whose partials are zero and never leave the padded result
                a_bands = RowBands(shard, pad)
                shard = pad
                out = common.alloc_on((pad, self.n), self.dtype, world, s)
            epoch = self.pad.next_epoch()
            q = (epoch - 1) % PARITIES

            def gemm(epi):
                gemm_with_hooks(a, b, None, trans_b=self.trans_b, stream=s, plan=gplan, out_dtype=self.partial_dtype,
                                epilogue=epi, a_bands=a_bands)

            fused = reduce_hook_id(self.plan.reduce_mode) > 0   # the reduce runs inside the GEMM
            if self.plan.comm_mode == "ce":
                group_n, groups = rs_ce_groups(self.plan, self.n, gplan.block_n)
                common.join(c, s)   # C starts with the GEMM, not after it
                gemm(TileEpilogue(destinations=self._dst[q], chunk_rows=shard, flag_table=self._counter_table,
                                  signal_value=1, signal_add=True, flag_group_n=group_n,
                                  reduce=self._chunk_reduce(out, q, epoch, group_n) if fused else None))
                # 2. enqueued after the GEMM's launch: the host's many small launches overlap the GEMM
                self._enqueue_pulls(shard, gplan.block_n, group_n, groups, q, epoch, c)
                if not fused:
                    self._launch_reduce(out, shard, gplan.block_n, q, epoch, s, group_n=group_n, skip=world.rank)
                common.join(s, c)
            elif self.plan.reduce_mode == "concurrent":
                common.join(c, s)
                self._launch_reduce(out, shard, gplan.block_n, q, epoch, c)
                gemm(TileEpilogue(destinations=self._dst[q], chunk_rows=shard, flag_table=self._flags[q],
                                  signal_value=epoch))
                common.join(s, c)
            else:
                gemm(TileEpilogue(destinations=self._dst[q], chunk_rows=shard, flag_table=self._flags[q],
                                  signal_value=epoch, reduce=self._chunk_reduce(out, q, epoch, 0) if fused else None))
                if not fused:
                    self._launch_reduce(out, shard, gplan.block_n, q, epoch, s)
            if result is not out:   # a padded call: my rows out of my padded band
                common.copy_bands(result, out, 1, result.shape[0], shard, s)
        return result

    def _chunk_reduce(self, out, q: int, epoch: int, group_n: int) -> ChunkReduce:
        """Hook 3 of a call ('epilogue' or 'tail'): my rows (chunk `rank`) get the sources' partials of
        ``recv[q]``, each after its flag ``[q][source]`` (per tile, or per column group with group_n > 0;
        my own per tile in 'tail') reached the epoch."""
        world = self.world
        return ChunkReduce(chunk=world.rank, out=out, partials=self.recv[q, 0].data.ptr,
                           source_bytes=self.max_shard * self.n * self.recv.itemsize, ld=self.n, sources=world.size,
                           flags=self.pad.local_ptr(self.layout.base(q, 0)), flag_stride=self.layout.tiles_per_source,
                           epoch=epoch, err=world.error_record, group_n=group_n, timeout_ns=world.timeout_ns,
                           op_id=self._op_reduce, rank=world.rank, where=self.plan.reduce_mode,
                           counter=self._tail_counter.data.ptr if self._tail_counter is not None else 0)

    __call__ = forward

    def _enqueue_pulls(self, shard: int, block_n: int, group_n: int, groups: int, q: int, epoch: int, c) -> None:
        """Step 2 on the comm stream: per source (in the order the sources produce my rows) and column
        group, wait for the group's tiles on the source, pull them with the copy engine, raise my flag."""
        import cupy

        world, w, me = self.world, self.world.size, self.world.rank
        item = self.recv.itemsize
        row_bytes = self.n * item
        n_tiles = math.ceil(self.n / block_n)
        m_tiles = shard // TILE_ROWS
        for d in range(1, w):
            src = (me - d) % w   # source me-d reaches my rows after d-1 other owners' (rs_tile_offset)
            for g in range(groups):
                t0, t1 = g * group_n, min((g + 1) * group_n, n_tiles)
                self._counted[src, g] += m_tiles * (t1 - t0)
                at = src * self._groups_max + g
                signals.wait_list(world, self._source_counters.sub(at), int(self._counted[src, g]), self._op_tiles, c)
                c0, c1 = t0 * block_n, min(t1 * block_n, self.n)
                cupy.cuda.runtime.memcpy2DAsync(self.recv[q, src].data.ptr + c0 * item, row_bytes,
                                                self.part[q, me].peer_ptr(src) + c0 * item, row_bytes,
                                                (c1 - c0) * item, shard, cupy.cuda.runtime.memcpyDeviceToDevice, c.ptr)
                signals.signal_list(world, self._pulled[q].sub(at), epoch, c)

    def _launch_reduce(self, out, shard: int, block_n: int, q: int, epoch: int, stream, *, group_n: int = 0,
                       skip: int | None = None) -> None:
        world = self.world
        item = self.recv.itemsize
        n_tiles = math.ceil(self.n / block_n)
        grid = rs_reduce_grid(self.plan, shard, self.n, block_n, self._sms)
        args = (np.uint64(self.recv[q, 0].data.ptr), np.int64(self.max_shard * self.n * item), np.int64(self.n),
                np.uint64(out.data.ptr), np.int64(self.n), np.uint64(self.pad.local_ptr(self.layout.base(q, 0))),
                np.int64(self.layout.tiles_per_source), np.int32(group_n),
                np.uint32(world.size if skip is None else skip), np.int32(shard), np.int32(self.n),
                np.int32(TILE_ROWS), np.int32(block_n), np.int32(n_tiles), np.uint32(world.size), np.uint64(epoch),
                np.uint64(world.timeout_ns), np.uint64(world.error_record), np.uint32(self._op_reduce),
                np.uint32(world.rank))
        self._reduce((grid,), (_REDUCE_THREADS,), args, stream=stream)

    def path_choice(self, m: int, stream=None, path: str | None = None):
        """The :class:`fluxrt.ops.cost.PathChoice` of an M-row call on `stream` (fused or decomposed, and
        why). Collective on its first use per M (ranks agree on rank 0's choice)."""
        check_rows(OP, m, self.world.size, self.max_m)
        return common.choose_call_path(self, OP, "gemm_rs", m, as_cupy_stream(stream), path)

    def gemm_plan(self, m: int):
        """The GemmPlan an M-row call uses (over its padded rows; tile order starts at rank+1's rows, own
        rows last)."""
        shard = check_rows(OP, m, self.world.size, self.max_m)
        return self._gemm_plan(common.padded_rows(self, shard)[1])

    def _gemm_plan(self, m_pad: int):
        return rs_gemm_plan(self.plan, m_pad, self.n, self.k, self.world.rank, self.world.size, self.dtype, self._sms)

    def _call_plan(self, m: int, a_bands: bool = False):
        return common.call_plan(self, m, self.partial_dtype, wait_hook=False, epilogue_hook=True,
                                reduce_hook=reduce_hook_id(self.plan.reduce_mode), bands=BANDS_A if a_bands else 0)

    def free(self) -> None:
        """Collective: return the symmetric buffers (the heap synchronizes the device first)."""
        if self.fp8 is not None:   # none: the decomposed path's buffers are plain device memory
            return
        self.pad.free()
        self.world.free(self.recv)
        if self.plan.comm_mode == "ce":
            self.counters.free()
            self.world.free(self.part)

    def __repr__(self) -> str:
        return (f"GemmReduceScatter(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, "
                f"trans_b={self.trans_b}, world={self.world.size}, plan={self.plan}"
                + (f", fp8={self.fp8})" if self.fp8 is not None else ")"))
