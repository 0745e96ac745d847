"""The decomposed path of the fused ops: fluxrt collectives and plain fluxrt GEMMs, overlapped by chunks.

What AllGatherGemm / GemmReduceScatter run where the fused kernel is predicted to lose, inside a CUDA-graph
capture, or on request (``path='decomposed'``; the choice is :func:`fluxrt.ops.cost.choose_path`). It is
also the "best decomposed overlap" baseline of ``fluxrt-perf ag_gemm / gemm_rs`` (no torch, no NCCL).

Each rank's shard (M/world rows) is cut into chunks (:func:`fluxrt.ops.cost.chunk_rows`: whole 128-row
tiles, the last one the rest). On the caller's stream S and the op's comm stream C:

AllGather+GEMM
    S: the GEMM of the rank's own rows, straight from the caller's shard. C: per chunk i, a fluxrt
    allgather of the shard's rows of chunk i into the op's gather buffer (world x rows, rank-major), then
    an event. S: per chunk, after its event, one GEMM per peer of that peer's rows of the chunk, written
    into their rows of the output.
GEMM+ReduceScatter
    S: per chunk i, one GEMM per owner (the rank's own rows last) of the owner's rows of chunk i, into the
    op's partial buffer (world x rows, rank-major), then an event. C: after the event, a fluxrt
    reduce_scatter of those partials into the chunk's rows of the output (fp32 sums in rank order,
    rounded once).

S waits for C before returning. With one chunk the path is sequential (allgather, then one GEMM of all M
rows; one GEMM, then one reduce_scatter) on S alone. With several, the GEMMs leave ``OpsRates.comm_sms``
SMs to the collectives (a persistent GEMM holds every SM it is given until it ends; without free SMs a
collective would wait for the GEMM and nothing would overlap).

Every step is a stream-ordered launch or event: the path can be captured in a CUDA graph and replayed
(the collectives keep their round counters on the device). The buffers are the op's own (allocated once,
sized for max_m), so a captured graph keeps pointing at live memory; the collectives' context is made
by the op's constructor, not inside a capture.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .. import collectives
from ..gemm import gemm
from ..gemm.autotune import plan_for
from . import common
from .cost import chunk_rows

if TYPE_CHECKING:
    from ..world import World

__all__ = ["DecomposedState", "ag_gemm", "gemm_rs"]


class DecomposedState:
    """The decomposed path's per-op state: a buffer of ``rows x cols`` (AllGather+GEMM: the gathered A
    [max_m, K]; GEMM+ReduceScatter: the partials [max_m, N]) and the GEMM plans of its pieces."""

    def __init__(self, world: World, rows: int, cols: int, dtype: str, comm_sms: int):
        import cupy

        from ..dtypes import normalize_dtype

        self.world = world
        with world.device:
            self.buffer = cupy.empty((rows, cols), dtype=normalize_dtype(dtype))
        collectives.context(world)   # made collectively now: never inside a capture or a timed call
        self.comm_sms = comm_sms
        self._plans: dict = {}

    def plan(self, m: int, n: int, k: int, dtype: str, trans_b: bool, capped: bool):
        """The GEMM plan of an m-row piece: the autotune cache's or the heuristic's; with `capped` (pieces
        that run beside a collective) a plain plan's grid leaves ``comm_sms`` SMs free."""
        key = (m, n, k, dtype, trans_b, capped)
        p = self._plans.get(key)
        if p is None:
            p = plan_for(m, n, k, in_dtype=dtype, out_dtype=dtype, trans_b=trans_b, device_id=self.world.device_id)
            if capped and p.split_k == 1 and p.cluster == 1:
                free = max(1, common.num_sms(self.world) - self.comm_sms)
                p = dataclasses.replace(p, max_ctas=min(free, p.max_ctas or free))
            self._plans[key] = p
        return p


def ag_gemm(op, st: DecomposedState, a, b, out, shard: int, m: int, chunks: int, s, *, return_a: bool = False):
    """C [M, N] = allgather(a [shard, K]) @ b on the caller's stream `s` (the module docstring's steps)."""
    world, w, me = op.world, op.world.size, op.world.rank
    rows = chunk_rows(shard, chunks)
    g = st.buffer
    n, k, dt, tb = op.n, op.k, op.dtype, op.trans_b
    gathered = None
    with world.device:
        if len(rows) == 1:
            collectives.allgather(world, a, out=g[:m], stream=s)
            gemm(g[:m], b, out, trans_b=tb, stream=s, plan=st.plan(m, n, k, dt, tb, False))
            if return_a:
                gathered = g[:m]
            return out, gathered
        c = op.comm_stream
        common.join(c, s)
        gemm(a, b, out[me * shard:(me + 1) * shard], trans_b=tb, stream=s, plan=st.plan(shard, n, k, dt, tb, True))
        off = 0
        for r in rows:
            piece = g[w * off:w * (off + r)]
            collectives.allgather(world, a[off:off + r], out=piece, stream=c)
            common.join(s, c)
            plan = st.plan(r, n, k, dt, tb, True)
            for d in range(1, w):
                p = (me + d) % w
                gemm(piece[p * r:(p + 1) * r], b, out[p * shard + off:p * shard + off + r], trans_b=tb, stream=s,
                     plan=plan)
            off += r
        if return_a:   # chunk-major in the buffer: rank-major rows for the caller
            gathered = common.alloc_on((m, k), dt, world, s)
            _unchunk(gathered, g, rows, w, shard, s)
    return out, gathered


def gemm_rs(op, st: DecomposedState, a, b, out, shard: int, m: int, chunks: int, s):
    """out [shard, N] = this rank's rows of sum over ranks of a [M, K] @ b, on the caller's stream `s`."""
    world, w, me = op.world, op.world.size, op.world.rank
    rows = chunk_rows(shard, chunks)
    part = st.buffer
    n, k, dt, tb = op.n, op.k, op.dtype, op.trans_b
    with world.device:
        if len(rows) == 1:
            gemm(a, b, part[:m], trans_b=tb, stream=s, plan=st.plan(m, n, k, dt, tb, False))
            collectives.reduce_scatter(world, part[:m], out=out, stream=s)
            return out
        c = op.comm_stream
        off = 0
        for r in rows:
            piece = part[w * off:w * (off + r)]
            plan = st.plan(r, n, k, dt, tb, True)
            for d in range(1, w + 1):
                p = (me + d) % w   # my own rows last, as the fused op
                gemm(a[p * shard + off:p * shard + off + r], b, piece[p * r:(p + 1) * r], trans_b=tb, stream=s,
                     plan=plan)
            common.join(c, s)
            collectives.reduce_scatter(world, piece, out=out[off:off + r], stream=c)
            off += r
        common.join(s, c)
    return out


def _unchunk(dst, src, rows: list[int], world: int, shard: int, s) -> None:
    """dst [M, K] rank-major from src's chunk-major rows: chunk i of rank p at src rows world * off + p * r."""
    import cupy

    rt = cupy.cuda.runtime
    row = dst.strides[0]
    off = 0
    for r in rows:
        # one 2-D copy per chunk: `world` runs of r rows, src pitch r rows, dst pitch one shard
        rt.memcpy2DAsync(dst.data.ptr + off * row, shard * row, src.data.ptr + world * off * row, r * row, r * row,
                         world, rt.memcpyDeviceToDevice, s.ptr)
        off += r
