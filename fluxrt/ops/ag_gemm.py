"""AllGather+GEMM (column-parallel linear): ``C = allgather(A) @ B`` with tile-granular overlap.

A is sharded on M: rank r holds ``a_shard [M/world, K]``, rows ``[r*M/world, (r+1)*M/world)`` of A.
Per call, on the caller's stream S and a fluxrt comm stream C:

1. S  (pull mode) wait until every peer acknowledged the previous call's pull of my shard
      (``done`` flags), so nothing below overwrites rows a peer is still reading.
2. S  pull mode: nothing to copy before the GEMM. Its loader reads my rows straight from ``a_shard`` and
      its copier warp stores them into my slot of the symmetric ``a_full`` from shared memory while the
      GEMM runs (GEMM hook 4), adding 1 per tile row to my ``copied`` counter of the chunk. When
      ``a_shard`` is that slot already (see :meth:`AllGatherGemm.shard_buffer`) the host sets the
      counters to the call's totals instead.
      Push mode: copy ``a_shard`` into my slot (unless it is the slot), then release my chunk flags.
3. C  (after an event on S) pull mode: for each peer p (rank+1, rank+2, ...) and chunk c: bounded wait
      until p's ``copied`` counter of c reached the call's total (polled over NVLink), copy-engine pull
      of the chunk, then release the local chunk flag (a local flag after a pull: the kernel after the
      copy on the same stream sees it complete) and, after the last chunk, p's ``done`` flag (the pull
      has finished reading p's memory).
      Push mode: for each peer p: bounded wait until p's GEMM finished reading what I pushed last call
      (``done``), then an SM kernel pushes each chunk into p's slot and releases p's chunk flag.
4. S  the GEMM over ``a_full[:M]`` starting at my own shard; its loader waits per tile for the flag of
      the chunk it reads (acquire.sys + fence.proxy.async before TMA), except for my own rows. It leaves
      ``plan.comm_sms`` SMs free, so step 3's kernels always find an SM while GEMM CTAs wait for them.
      (Steps 3 and 4 run concurrently: the GEMM is enqueued on S right after the event of step 3.)
5. S  waits for C (event): the op is stream-ordered for the caller.
6. S  with return_a in push mode, or for a padded call, copies the gathered rows out of ``a_full``
      (and, for a padded call with a GemmPlan override that has no storer warp, every rank's rows out of
      a padded output).
7. S  (push mode) release ``done`` on every peer: neither my GEMM nor my pushes (joined in step 5) read
      my buffer any more, so the peers may push their next call's rows into it.

Padded calls (a shard that is not whole ``128 * chunks_per_rank`` rows, :mod:`fluxrt.ops.plan`): every
slot of ``a_full`` and every band of the GEMM's rows is ``padded_shard`` rows long. Step 2 copies the
shard into the first rows of my slot (hook 4 only copies whole tiles); the GEMM covers the padded rows
and stores each band's first ``shard`` rows into ``out`` (banded C, :class:`fluxrt.gemm.RowBands`); the
rows past a shard (stale data, whatever the slot held) make rows that the TMA store clips.

Flags are compared with the call's epoch (one per call, growing in lockstep on every rank), the
``copied`` counters with their running total; nothing is reset between calls. Every wait is bounded:
``world.check_errors()`` after synchronizing raises WaitTimeoutError naming the op (``ag_gemm.copied``,
``ag_gemm.reuse``, ``ag_gemm.chunk``), the rank and the peer.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import p2p, signals
from ..errors import op_id
from ..nvtx import annotate as _nvtx
from ..gemm import BANDS_C, ArrivalWait, RowBands, ShardCopy, gemm_with_hooks
from ..gemm.plan import SMEM_LIMIT_BYTES
from ..streams import as_cupy_stream
from . import common, decomposed
from ..gemm.plan import FP8_SCALE_BLOCK
from .plan import AgGemmPlan, Fp8Options, OpsArgumentError, ag_gemm_plan, ag_pad_layout, check_rows, \
    plan_ag_gemm, pull_order

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OP = "AllGatherGemm"


class AllGatherGemm:
    """``forward(a_shard [M/world, K], b [K, N] or [N, K] with trans_b) -> C [M, N]``, C = allgather(A) @ B.

    Collective: every rank constructs it with the same arguments and calls ``forward`` with the same
    shapes in the same order. ``max_m`` bounds M (the gathered A lives in a symmetric buffer of
    ``capacity_m`` rows: max_m with every shard padded to whole tiles); N and K are fixed. M must be a
    multiple of world; shards of whole ``128 * plan.chunks_per_rank`` rows take the fast path, other
    shards are padded (the rule in :mod:`fluxrt.ops.plan`). Unless ``plan.path`` is 'fused', the op also holds
    the decomposed path's gathered A (max_m x K, device memory, not symmetric; :mod:`fluxrt.ops.decomposed`).

    fp8: :class:`fluxrt.ops.Fp8Options`: A and B are uint8 fp8 bytes (B [N, K], trans_b=True), ``dtype`` is
    the output's, ``forward`` takes ``scale_a`` (this rank's: one element, or block scales [M/world,
    ceil(K/128)]) and ``scale_b``; the op gathers the fp8 rows and their scales on the decomposed path
    (its only one) and holds no symmetric memory.
    """

    def __init__(self, world: World, max_m: int, n: int, k: int, dtype="bf16", *, trans_b: bool = False,
                 plan: AgGemmPlan | None = None, fp8: Fp8Options | None = None):
        import cupy

        w = world.size
        common.construct(self, world, OP, max_m, n, k, dtype, trans_b, plan, plan_ag_gemm, fp8)
        if self.fp8 is not None:
            scales = (w,) if self.fp8.scale == "tensor" else (self.max_m, -(-self.k // FP8_SCALE_BLOCK))
            common.setup_paths(self, world, self.k, self.in_dtype, scales)
            with world.device:
                self.comm_stream = cupy.cuda.Stream(non_blocking=True)
            return
        common.setup_paths(self, world, self.k)
        self.layout = ag_pad_layout(w, self.plan.chunks_per_rank)
        self.a_full = world.empty((self.capacity_m, self.k), self.dtype)
        self.pad = world.signal_pad(self.layout.slots)
        me, cpr, L, pad = world.rank, self.plan.chunks_per_rank, self.layout, self.pad
        peers = pull_order(me, w)
        pull = self.plan.comm_mode == "pull"
        with world.device:
            self.comm_stream = cupy.cuda.Stream(non_blocking=True)
            # step 2: push mode: my chunk flags; pull mode with no copy needed: my copied counters
            self._own_signal = signals.PointerList([pad.local_ptr(L.chunk(me, c)) for c in range(cpr)])
            self._own_copied = signals.PointerList([pad.local_ptr(L.copied(c)) for c in range(cpr)])
            # pull step 1 / push step 3: the peers' done acks of the previous call
            self._acks = {p: signals.PointerList([pad.local_ptr(L.done(p))], [p]) for p in peers}
            self._all_acks = signals.PointerList([pad.local_ptr(L.done(p)) for p in peers], peers)
            # pull step 3: peer p's copied counter of its chunk c
            self._copied = {(p, c): signals.PointerList([pad.peer_ptr(p, L.copied(c))], [p])
                            for p in peers for c in range(cpr)}
            # pull step 3: after pulling chunk c of p: my chunk flag, and p's done flag after the last chunk
            self._after_pull = {(p, c): signals.PointerList([pad.local_ptr(L.chunk(p, c))] +
                                                           ([pad.peer_ptr(p, L.done(me))] if c == cpr - 1 else []))
                                for p in peers for c in range(cpr)}
            # push step 5: I finished reading what every peer pushed into my buffer
            self._done_reading = signals.PointerList([pad.peer_ptr(p, L.done(me)) for p in peers])
            common.kernels(world)  # compile/load now, not inside the first timed call
            if not pull:
                p2p.state(world)   # the push kernel and its counters, likewise
        self._peers = peers
        self._copied_total = 0   # every rank's copied counters after the last call (the same everywhere)
        self._gplans: dict = {}
        self._op_chunk = op_id("ag_gemm.chunk", persistent_grid=True)

    # --- buffers ------------------------------------------------------------------------------------
    def shard_buffer(self, m: int, stream=None):
        """This rank's slot of the gathered A for an M-row call: write the shard there and pass the view
        to ``forward`` to skip the copy. Enqueues (on `stream`) the wait that makes the slot writable:
        peers have finished reading it in the previous call. Write after this call, on that stream."""
        self._no_fp8("shard_buffer")
        shard = check_rows(OP, m, self.world.size, self.max_m)
        pad, _ = common.padded_rows(self, shard)
        if self.plan.comm_mode == "pull" and self.pad.epoch > 0:
            signals.wait_list(self.world, self._all_acks, self.pad.epoch, "ag_gemm.reuse", as_cupy_stream(stream))
        me = self.world.rank
        return self.a_full[me * pad:me * pad + shard]

    def gathered(self, m: int, stream=None):
        """The gathered A [m, K] of the last call: a view of the symmetric buffer, or, for a padded call, a
        copy of its rows made on `stream`. Pull mode: valid on the caller's stream until this rank's next
        call. Push mode: a peer's rows may be overwritten as soon as that peer starts its next call; use
        ``forward(..., return_a=True)``, which copies them before the op lets the peers push again."""
        self._no_fp8("gathered")
        shard = check_rows(OP, m, self.world.size, self.max_m)
        pad, _ = common.padded_rows(self, shard)
        return self._gathered(m, shard, pad, as_cupy_stream(stream), copy=pad != shard)

    def _no_fp8(self, what: str) -> None:
        if self.fp8 is not None:
            raise OpsArgumentError(f"{OP}.{what}: an fp8 op has no symmetric gather buffer (it gathers on the "
                                   "decomposed path); use forward(..., return_a=True)")

    def _gathered(self, m: int, shard: int, pad: int, s, *, copy: bool):
        if not copy:
            return self.a_full[:m]
        a = common.alloc_on((m, self.k), self.dtype, self.world, s)
        with self.world.device:
            common.copy_bands(a, self.a_full, self.world.size, shard, pad, s)
        return a

    # --- the op -------------------------------------------------------------------------------------
    @_nvtx("ag_gemm.forward")
    def forward(self, a_shard, b, out=None, stream=None, *, return_a: bool = False, path: str | None = None,
                scale_a=None, scale_b=None):
        """C [M, N] = allgather(a_shard) @ b (b.T with trans_b). Stream-ordered on `stream`.

        path: None (the plan's: 'auto' lets fluxrt.ops.cost choose per M, see :meth:`path_choice`), 'fused' or
        'decomposed' for this call.

        out: optional [M, N] array of the input dtype. return_a: also return the gathered A [M, K]: in pull
        mode a view of the symmetric buffer (overwritten by this rank's next call; for a padded call a
        copy), in push mode a copy (peers push into that buffer once they start their next call).

        scale_a, scale_b: an fp8 op's scales (fp32 device arrays, see the class docstring); return_a then
        gives the gathered fp8 bytes [M, K] (uint8).
        """
        world, me = self.world, self.world.rank
        world.make_current()
        s = as_cupy_stream(stream)
        ops = common.forward_operands(self, OP, a_shard, b, out, s, sharded_a=True, scales=(scale_a, scale_b))
        a, b, out, shard, m = ops[:5]
        sa, sb = ops[5:] or (None, None)
        choice = common.choose_call_path(self, OP, "ag_gemm", m, s, path)
        if choice.path == "decomposed":
            if out is None:
                out = common.alloc_on((m, self.n), self.dtype, world, s)
            out, gathered = decomposed.ag_gemm(self, self._decomposed, a, b, out, shard, m, choice.chunks, s,
                                               return_a=return_a, scale_a=sa, scale_b=sb)
            return (out, gathered) if return_a else out
        pad, m_pad = common.padded_rows(self, shard)   # pad == shard: the fast path
        # a padded call's GEMM writes out in place: its rows are bands of `pad` with `shard` real ones
        c_bands = RowBands(shard, pad) if pad != shard and self._bands_fit() else None
        gplan = self._call_plan(m_pad, c_bands is not None)

        import cupy

        c = self.comm_stream
        cpr = self.plan.chunks_per_rank
        chunk_rows = pad // cpr
        row_bytes = self.k * self.a_full.itemsize
        pull = self.plan.comm_mode == "pull"
        with world.device:
            if out is None:
                out = common.alloc_on((m, self.n), self.dtype, world, s)
            # a padded call whose plan cannot band C writes padded rows; step 6 copies the real ones into out
            c_full = out if pad == shard or c_bands else common.alloc_on((m_pad, self.n), self.dtype, world, s)
            epoch = self.pad.next_epoch()
            slot = self.a_full[me * pad:me * pad + shard]
            in_slot = a.data.ptr == slot.data.ptr
            # 1. peers finished pulling my previous shard (pull mode; epoch - 1 = 0 is already true; a
            #    shard written into shard_buffer() has had this wait enqueued there already)
            if pull and epoch > 1 and not in_slot:
                signals.wait_list(world, self._all_acks, epoch - 1, "ag_gemm.reuse", s)
            # 2. my shard: pull mode: the GEMM copies it into my slot (hook 4; whole tiles only); else (push
            #    mode, a padded shard, a plan without room for hook 4's buffer) copy it first; then my chunk
            #    flags (and copied counters). A padded slot's extra rows are never read into out.
            self._copied_total += ShardCopy.pieces_per_chunk(chunk_rows, self.k)
            copy = None
            if pull and not in_slot and pad == shard and self._shard_copy_fits(gplan):
                copy = ShardCopy(src=a, row0=me * shard, counters=self.pad.local_ptr(self.layout.copied(0)))
            else:
                if not in_slot:
                    cupy.cuda.runtime.memcpyAsync(slot.data.ptr, a.data.ptr, shard * row_bytes,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
                if pull:
                    signals.signal_list(world, self._own_copied, self._copied_total, s)
                signals.signal_list(world, self._own_signal, epoch, s)
            # 3. the comm stream gathers the peers' shards (pushes are enqueued before the GEMM so that
            #    their blocks start first; pulls after it, so that the host enqueues their many small
            #    launches while the GEMM runs)
            common.join(c, s)
            if not pull:
                self._enqueue_pushes(epoch, pad, chunk_rows, c)
            # 4. the GEMM, own shard first, each peer tile after its chunk's flag
            # the GEMM's chunk waits are downstream of the comm stream's: twice the timeout, so that a
            # missing peer is reported by the wait on it (ag_gemm.copied / .reuse), not by a chunk of
            # another peer that the stalled comm stream would have pulled next
            wait = ArrivalWait(flags=self.pad.local_ptr(0), epoch=epoch, chunk_rows=chunk_rows,
                               err=world.error_record, chunks_per_peer=cpr, timeout_ns=2 * world.timeout_ns,
                               op_id=self._op_chunk, rank=me)
            gemm_with_hooks(self.a_full[:m_pad], b, c_full, trans_b=self.trans_b, stream=s, plan=gplan, wait=wait,
                            copy=copy, c_bands=c_bands)
            if pull:
                self._enqueue_pulls(epoch, pad, chunk_rows, row_bytes, c)
            # 5. the caller's stream includes the comm stream's work
            common.join(s, c)
            # 6. a padded call without banded C: every rank's rows out of its padded band
            if c_full is not out:
                common.copy_bands(out, c_full, world.size, shard, pad, s)
            gathered = None
            if return_a:   # push mode: copied while the peers' rows are still this call's (step 7)
                gathered = self._gathered(m, shard, pad, s, copy=not pull or pad != shard)
            # 7. push mode: neither my GEMM nor my pushes (joined in step 5) read my buffer any more; the
            #    peers may push their next call's rows into it
            if not pull:
                signals.signal_list(world, self._done_reading, epoch, s)
        if return_a:
            return out, gathered
        return out

    __call__ = forward

    def _enqueue_pulls(self, epoch: int, shard: int, chunk_rows: int, row_bytes: int, c) -> None:
        """Step 3, pull mode: per peer and chunk, wait for its copied counter, pull it, raise my flag."""
        import cupy

        for p in self._peers:
            src = self.a_full.peer_ptr(p)
            for ci in range(self.plan.chunks_per_rank):
                signals.wait_list(self.world, self._copied[(p, ci)], self._copied_total, "ag_gemm.copied", c)
                off = (p * shard + ci * chunk_rows) * row_bytes
                cupy.cuda.runtime.memcpyAsync(self.a_full.data.ptr + off, src + off, chunk_rows * row_bytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, c.ptr)
                signals.signal_list(self.world, self._after_pull[(p, ci)], epoch, c)

    def _enqueue_pushes(self, epoch: int, shard: int, chunk_rows: int, c) -> None:
        """Step 3, push mode: per peer, wait until it read my previous push, then push my chunks."""
        me = self.world.rank
        for p in self._peers:
            if epoch > 1:
                signals.wait_list(self.world, self._acks[p], epoch - 1, "ag_gemm.reuse", c)
            for ci in range(self.plan.chunks_per_rank):
                view = self.a_full[me * shard + ci * chunk_rows:me * shard + (ci + 1) * chunk_rows]
                p2p.put(self.world, view, view, p, mode="sm", stream=c,
                        flag_ptr=self.pad.peer_ptr(p, self.layout.chunk(me, ci)), flag_value=epoch,
                        blocks=self.plan.push_blocks)

    def path_choice(self, m: int, stream=None, path: str | None = None):
        """The :class:`fluxrt.ops.cost.PathChoice` of an M-row call on `stream` (fused or decomposed, and
        why). Collective on its first use per M (ranks agree on rank 0's choice)."""
        check_rows(OP, m, self.world.size, self.max_m)
        return common.choose_call_path(self, OP, "ag_gemm", m, as_cupy_stream(stream), path)

    def gemm_plan(self, m: int):
        """The GemmPlan an M-row call uses (over its padded rows; tile order starts at this rank's shard)."""
        shard = check_rows(OP, m, self.world.size, self.max_m)
        return self._gemm_plan(common.padded_rows(self, shard)[1])

    def _gemm_plan(self, m_pad: int):
        return ag_gemm_plan(self.plan, m_pad, self.n, self.k, self.world.rank, self.world.size, self.dtype, self._sms)

    def _shard_copy_fits(self, gplan) -> bool:
        return gplan.smem_bytes(self.dtype, shard_copy=True) <= SMEM_LIMIT_BYTES

    def _bands_fit(self) -> bool:
        """A padded call's GEMM can store C in row bands (the storer-warp epilogue, the default)."""
        return self.plan.gemm is None or self.plan.gemm.epilogue == "tma"

    def _call_plan(self, m: int, c_bands: bool = False):
        # pull mode: hook 4 copies the shard (when its buffer fits), except when it is passed in its slot or
        # the call is padded (hook 4 copies whole tiles only)
        pull = self.plan.comm_mode == "pull"
        if c_bands:
            return common.call_plan(self, m, self.dtype, wait_hook=True, epilogue_hook=False, bands=BANDS_C)
        return common.call_plan(self, m, self.dtype, wait_hook=True, epilogue_hook=False,
                                copy_hooks=lambda g: (True, False) if pull and self._shard_copy_fits(g) else (False,))

    def free(self) -> None:
        """Collective: return the symmetric buffers (the heap synchronizes the device first)."""
        if self.fp8 is not None:   # none: the decomposed path's buffers are plain device memory
            return
        self.pad.free()
        self.world.free(self.a_full)

    def __repr__(self) -> str:
        return (f"AllGatherGemm(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, "
                f"trans_b={self.trans_b}, world={self.world.size}, plan={self.plan}"
                + (f", fp8={self.fp8})" if self.fp8 is not None else ")"))
