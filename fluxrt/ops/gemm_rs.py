"""GEMM+ReduceScatter (row-parallel linear): this rank's ``[M/world, N]`` slice of ``sum_r A_r @ B_r``.

Every rank computes the partial ``A @ B`` for all M rows (A [M, K_local], B [K_local, N] or [N, K_local]).
Per call, with epoch e and parity q = (e - 1) % 2:

1. The GEMM (caller's stream) walks the tiles starting at the rows of rank+1 and ending with its own.
   Its epilogue (the storer warp) stores each finished tile of owner o's rows into o's symmetric
   ``recv[q][my_rank]`` (the own partial stays local, same layout) and releases o's flag
   ``[q][my_rank][tile]`` to e (TMA stores complete, proxy fence, then fence + release.sys).
2. The owner's reduce kernel waits (bounded) per tile for all world sources' flags, then sums the
   partials in fixed source order 0..world-1 in fp32 and stores the tile of ``out``: the result is
   bitwise independent of arrival order. 'after' mode runs it after the GEMM on the caller's stream;
   'concurrent' mode on a fluxrt stream during the GEMM (which leaves ``reduce_blocks`` SMs free), and
   the caller's stream waits for it before returning.

Why two parities are enough (no ack): the tiles source s writes into owner o's ``recv[q]`` in call
i+2 are produced by s's GEMM, which on s's stream follows s's reduce of call i+1; that reduce waited
for o's call-(i+1) tiles, which o's GEMM released after o's reduce of call i finished (stream order on
o: reduce i completes before GEMM i+1 starts, in both modes). So o has read ``recv[q]`` of call i
before any call-(i+2) tile lands there. Flags need no reset either: a parity's flags only ever see
that parity's epochs, which grow.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from ..errors import op_id
from ..gemm import TileDestinations, TileEpilogue, gemm_with_hooks
from ..streams import as_cupy_stream
from . import common
from .plan import GemmRsPlan, OpsArgumentError, PARITIES, TILE_ROWS, check_rows, plan_gemm_rs, \
    rs_flag_layout, rs_gemm_plan, rs_reduce_grid

log = logging.getLogger(__name__)

OP = "GemmReduceScatter"
_REDUCE_THREADS = 256


class GemmReduceScatter:
    """``forward(a [M, K_local], b [K_local, N] or [N, K_local] with trans_b) -> [M/world, N]``: rank r
    gets rows ``[r*M/world, (r+1)*M/world)`` of the sum over ranks of ``a @ b``.

    Collective: every rank constructs it with the same arguments and calls ``forward`` with the same
    shapes in the same order. ``k`` is the local K. M must be a multiple of ``world * 128`` and at most
    ``max_m``; N is fixed. Symmetric memory: ``2 * max_m * N`` partial elements per rank.
    """

    def __init__(self, world, max_m: int, n: int, k: int, dtype="bf16", *, trans_b: bool = False,
                 plan: GemmRsPlan | None = None):
        import cupy

        self.world = world
        w = world.size

        def local_checks():
            self.dtype = common.input_dtype(dtype, OP)
            self.max_m, self.n, self.k = common.check_problem(world, OP, max_m, n, k)
            self.trans_b = bool(trans_b)
            self.plan = (plan or plan_gemm_rs(self.max_m, self.n, self.k, w)).validate()
            check_rows(OP, self.max_m, w, self.plan.row_multiple)
            return None, {"max_m": self.max_m, "n": self.n, "k": self.k, "dtype": self.dtype,
                          "trans_b": self.trans_b, "plan": repr(self.plan)}

        common.checked_on_every_rank(world, f"{OP}()", local_checks)
        self.partial_dtype = self.plan.partial_dtype or self.dtype
        self.max_shard = self.max_m // w
        self.layout = rs_flag_layout(self.max_m, self.n, w)
        self.recv = world.empty((PARITIES, w, self.max_shard, self.n), self.partial_dtype)
        self.pad = world.signal_pad(self.layout.slots)
        self._sms = common.num_sms(world)
        me = world.rank
        with world.device:
            self.reduce_stream = cupy.cuda.Stream(non_blocking=True)
            # per parity: where my partial of owner o's rows goes, and o's flags for my tiles
            self._dst = [TileDestinations([self.recv[q, me].peer_ptr(o) for o in range(w)], self.n, self.partial_dtype)
                         for q in range(PARITIES)]
            self._flags = [cupy.asarray(np.asarray([self.pad.peer_ptr(o, self.layout.base(q, me)) for o in range(w)],
                                                   dtype=np.uint64)) for q in range(PARITIES)]
            self._reduce = common.kernels(world).reduce(self.partial_dtype, self.dtype)
        self._gplans: dict = {}
        self._op_reduce = op_id("gemm_rs.reduce")

    def forward(self, a, b, out=None, stream=None):
        """This rank's [M/world, N] slice of sum over ranks of a @ b (b.T with trans_b), stream-ordered."""
        world, w = self.world, self.world.size
        a_in, b_in, out_in = a, b, out

        def local_checks():
            a = common.as_device_array(a_in, "a", OP)
            b = common.as_device_array(b_in, "b", OP)
            if a.ndim != 2:
                raise OpsArgumentError(f"{OP}: a must be 2-D [M, K_local], got shape {tuple(a.shape)}")
            m = int(a.shape[0])
            shard = check_rows(OP, m, w, self.plan.row_multiple, self.max_m)
            common.check_matrix(a, "a", OP, (m, self.k), self.dtype, world)
            common.check_matrix(b, "b", OP, (self.n, self.k) if self.trans_b else (self.k, self.n), self.dtype,
                                world)
            out = None
            if out_in is not None:
                out = common.as_device_array(out_in, "out", OP)
                common.check_matrix(out, "out", OP, (shard, self.n), self.dtype, world)
            return (a, b, out, shard, m), {"m": m, "b": tuple(b.shape), "dtype": self.dtype}

        a, b, out, shard, m = common.checked_on_every_rank(world, f"{OP}.forward", local_checks)
        gplan = self._call_plan(m)

        s = as_cupy_stream(stream)
        with world.device:
            if out is None:
                out = common.alloc_on((shard, self.n), self.dtype, world, s)
            epoch = self.pad.next_epoch()
            q = (epoch - 1) % PARITIES
            epi = TileEpilogue(destinations=self._dst[q], chunk_rows=shard, flag_table=self._flags[q],
                               signal_value=epoch, signal_add=False)
            if self.plan.reduce_mode == "concurrent":
                r = self.reduce_stream
                common.join(r, s)
                self._launch_reduce(out, shard, gplan.block_n, q, epoch, r)
                gemm_with_hooks(a, b, None, trans_b=self.trans_b, stream=s, plan=gplan, out_dtype=self.partial_dtype,
                                epilogue=epi)
                common.join(s, r)
            else:
                gemm_with_hooks(a, b, None, trans_b=self.trans_b, stream=s, plan=gplan, out_dtype=self.partial_dtype,
                                epilogue=epi)
                self._launch_reduce(out, shard, gplan.block_n, q, epoch, s)
        return out

    __call__ = forward

    def _launch_reduce(self, out, shard: int, block_n: int, q: int, epoch: int, stream) -> None:
        world = self.world
        item = self.recv.itemsize
        n_tiles = math.ceil(self.n / block_n)
        grid = rs_reduce_grid(self.plan, shard, self.n, block_n, self._sms)
        args = (np.uint64(self.recv[q, 0].data.ptr), np.int64(self.max_shard * self.n * item), np.int64(self.n),
                np.uint64(out.data.ptr), np.int64(self.n), np.uint64(self.pad.local_ptr(self.layout.base(q, 0))),
                np.int64(self.layout.tiles_per_source), np.int32(shard), np.int32(self.n), np.int32(TILE_ROWS),
                np.int32(block_n), np.int32(n_tiles), np.uint32(world.size), np.uint64(epoch),
                np.uint64(world.timeout_ns), np.uint64(world.error_record), np.uint32(self._op_reduce),
                np.uint32(world.rank))
        self._reduce((grid,), (_REDUCE_THREADS,), args, stream=stream)

    def gemm_plan(self, m: int):
        """The GemmPlan an M-row call uses (tile order starts at rank+1's rows, own rows last)."""
        check_rows(OP, m, self.world.size, self.plan.row_multiple, self.max_m)
        return rs_gemm_plan(self.plan, m, self.n, self.k, self.world.rank, self.world.size, self.dtype, self._sms)

    def _call_plan(self, m: int):
        return common.call_plan(self, m, self.partial_dtype, wait_hook=False, epilogue_hook=True)

    def free(self) -> None:
        """Collective: return the symmetric buffers (the heap synchronizes the device first)."""
        self.pad.free()
        self.world.free(self.recv)

    def __repr__(self) -> str:
        return (f"GemmReduceScatter(max_m={self.max_m}, n={self.n}, k={self.k}, dtype={self.dtype}, "
                f"trans_b={self.trans_b}, world={self.world.size}, plan={self.plan})")
