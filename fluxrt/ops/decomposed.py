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

FP8 inputs (the ops' ``fp8=Fp8Options``; the only path they have): A's rows are uint8 fp8 bytes, so the
allgather moves half the bytes of bf16, and every GEMM is the fp8 GEMM (:mod:`fluxrt.gemm.fp8`) with the
rows' scales. AllGather+GEMM gathers the scales beside the rows: per tensor, every rank's one scale
(one allgather of world floats before the first chunk; each peer's rows are multiplied with their own
rank's scale, so ranks need not agree on one: with one chunk that is one GEMM per rank instead of one of
all M rows); block scales, each chunk's [rows, ceil(K/128)] scale rows with the chunk's rows. GEMM+
ReduceScatter's GEMMs read the caller's scales (block: the piece's scale rows) and write output-type
partials, which the reduce_scatter sums as in the 16-bit path.

Every step is a stream-ordered launch or event: the path can be captured in a CUDA graph and replayed
(the collectives keep their round counters on the device). The buffers are the op's own (allocated once,
sized for max_m), so a captured graph keeps pointing at live memory; the collectives' context is made
by the op's constructor, not inside a capture.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .. import collectives
from ..dtypes import dtype_name
from ..gemm import gemm
from ..gemm.autotune import plan_for
from . import common
from .cost import chunk_rows

if TYPE_CHECKING:
    from ..world import World

__all__ = ["DecomposedState", "ag_gemm", "gemm_rs"]


class DecomposedState:
    """The decomposed path's per-op state: a buffer of ``rows x cols`` (AllGather+GEMM: the gathered A
    [max_m, K]; GEMM+ReduceScatter: the partials [max_m, N]), with `scale_shape` an fp32 buffer of gathered
    fp8 scales (AllGather+GEMM: [world] per tensor, [max_m, ceil(K/128)] block), and the GEMM plans of its
    pieces."""

    def __init__(self, world: World, rows: int, cols: int, dtype: str, comm_sms: int, *,
                 scale_shape: tuple | None = None, num_sms: int | None = None):
        import cupy

        from ..dtypes import normalize_dtype

        self.world = world
        with world.device:
            self.buffer = cupy.empty((rows, cols), dtype=normalize_dtype(dtype))
            self.scales = cupy.empty(scale_shape, dtype=cupy.float32) if scale_shape else None
        collectives.context(world)   # made collectively now: never inside a capture or a timed call
        self.comm_sms = comm_sms
        self.num_sms = num_sms or common.num_sms(world)   # the op's share (plan.sm_count) or the context's
        self._plans: dict = {}
        self._loaded: set = set()   # (M, chunks) of the calls whose pieces' GEMMs are loaded and have met

    def plan(self, m: int, n: int, k: int, dtype: str, trans_b: bool, capped: bool):
        """The GEMM plan of an m-row piece: the autotune cache's or the heuristic's; with `capped` (pieces
        that run beside a collective) a plain plan's grid leaves ``comm_sms`` SMs free."""
        key = (m, n, k, dtype, trans_b, capped)
        p = self._plans.get(key)
        if p is None:
            p = plan_for(m, n, k, in_dtype=dtype, out_dtype=dtype, trans_b=trans_b, device_id=self.world.device_id)
            p = self._cap(p, capped)
            self._plans[key] = p
        return p

    def fp8_plan(self, prob, capped: bool):
        """The fp8 GEMM plan of a piece (`prob`: its fluxrt.gemm Fp8Problem), capped as :meth:`plan`'s."""
        from ..gemm.fp8 import plan_fp8

        key = (prob, capped)
        p = self._plans.get(key)
        if p is None:
            p = self._cap(plan_fp8(prob, self.world.device_id, self.num_sms), capped)
            self._plans[key] = p
        return p

    def load(self, op, m: int, chunks: int, pieces, out_dtype: str) -> None:
        """Before the first call with (m, chunks): load (perhaps compile) the GEMMs of its pieces ((rows, capped)
        pairs), then meet the other ranks. A GEMM compiled between the call's collectives would hold this
        rank back from them for as long as the compile takes, past the peers' bounded waits."""
        if (m, chunks) in self._loaded:
            return
        from .. import agreement
        from ..gemm.fp8 import load_kernel
        from ..gemm.launch import load_plain

        for rows, capped in sorted(set(pieces)):
            if op.fp8 is None:
                load_plain(self.plan(rows, op.n, op.k, op.dtype, op.trans_b, capped), op.dtype, out_dtype, op.trans_b,
                           self.world.device_id)
            else:
                prob = common.fp8_problem(op, rows, op.n, op.k)
                load_kernel(self.fp8_plan(prob, capped), prob, self.world.device_id)
        agreement.meet_after_load(self.world, f"{type(op).__name__} (decomposed): first call with {m} rows in "
                                              f"{chunks} chunk(s)")
        self._loaded.add((m, chunks))

    def _cap(self, p, capped: bool):
        # stream-K pairs too: their fixups wait for pieces of clusters that a collective holding SMs would delay
        if capped and p.split_k == 1 and (p.cluster_ctas == 1 or p.stream_k):
            free = max(1, self.num_sms - self.comm_sms)
            p = dataclasses.replace(p, max_ctas=min(free, p.max_ctas or free))
        return p


def _mm(op, st: DecomposedState, a, b, out, s, capped: bool, scale_a=None, scale_b=None) -> None:
    """out = a @ b (b.T with trans_b) of one piece: the 16-bit GEMM, or with an fp8 op the fp8 GEMM with the
    piece's scales."""
    rows = a.shape[0]
    if op.fp8 is None:
        gemm(a, b, out, trans_b=op.trans_b, stream=s, plan=st.plan(rows, op.n, op.k, op.dtype, op.trans_b, capped))
    else:
        gemm(a, b, out, trans_b=True, stream=s, fp8_format=op.fp8.format, scale_a=scale_a, scale_b=scale_b,
             plan=st.fp8_plan(common.fp8_problem(op, rows, op.n, op.k), capped))


def ag_gemm(op, st: DecomposedState, a, b, out, shard: int, m: int, chunks: int, s, *, return_a: bool = False,
            scale_a=None, scale_b=None):
    """C [M, N] = allgather(a [shard, K]) @ b on the caller's stream `s` (the module docstring's steps); an
    fp8 op passes its scales (block: scale_a [shard, ceil(K/128)])."""
    world, w, me = op.world, op.world.size, op.world.rank
    rows = chunk_rows(shard, chunks)
    g, sg = st.buffer, st.scales
    k = op.k
    tensor = op.fp8 is not None and op.fp8.scale == "tensor"
    block = op.fp8 is not None and op.fp8.scale == "block"
    gathered = None
    if len(rows) == 1:
        pieces = [(shard, False)] if tensor else [(m, False)]
    else:
        pieces = [(shard, True)] + [(r, True) for r in rows]
    st.load(op, m, chunks, pieces, dtype_name(out.dtype))
    with world.device:
        if len(rows) == 1:
            collectives.allgather(world, a, out=g[:m], stream=s)
            if tensor:   # every rank's rows with that rank's scale
                collectives.allgather(world, scale_a, out=sg[:w], stream=s)
                for p in range(w):
                    _mm(op, st, g[p * shard:(p + 1) * shard], b, out[p * shard:(p + 1) * shard], s, False,
                        sg[p:p + 1], scale_b)
            else:
                if block:
                    collectives.allgather(world, scale_a, out=sg[:m], stream=s)
                _mm(op, st, g[:m], b, out, s, False, sg[:m] if block else None, scale_b)
            if return_a:
                gathered = g[:m]
            return out, gathered
        c = op.comm_stream
        common.join(c, s)
        _mm(op, st, a, b, out[me * shard:(me + 1) * shard], s, True, scale_a, scale_b)
        if tensor:   # before the first chunk's event: every peer GEMM reads its rank's scale
            collectives.allgather(world, scale_a, out=sg[:w], stream=c)
        off = 0
        for r in rows:
            piece = g[w * off:w * (off + r)]
            collectives.allgather(world, a[off:off + r], out=piece, stream=c)
            if block:
                spiece = sg[w * off:w * (off + r)]
                collectives.allgather(world, scale_a[off:off + r], out=spiece, stream=c)
            common.join(s, c)
            for d in range(1, w):
                p = (me + d) % w
                sa = sg[p:p + 1] if tensor else spiece[p * r:(p + 1) * r] if block else None
                _mm(op, st, piece[p * r:(p + 1) * r], b, out[p * shard + off:p * shard + off + r], s, True, sa,
                    scale_b)
            off += r
        if return_a:   # chunk-major in the buffer: rank-major rows for the caller
            gathered = common.alloc_on((m, k), op.in_dtype, world, s)
            _unchunk(gathered, g, rows, w, shard, s)
    return out, gathered


def gemm_rs(op, st: DecomposedState, a, b, out, shard: int, m: int, chunks: int, s, *, scale_a=None, scale_b=None):
    """out [shard, N] = this rank's rows of sum over ranks of a [M, K] @ b, on the caller's stream `s`; an fp8
    op passes its scales (block: scale_a [M, ceil(K/128)])."""
    world, w, me = op.world, op.world.size, op.world.rank
    rows = chunk_rows(shard, chunks)
    part = st.buffer
    block = op.fp8 is not None and op.fp8.scale == "block"
    st.load(op, m, chunks, [(m, False)] if len(rows) == 1 else [(r, True) for r in rows], dtype_name(part.dtype))
    with world.device:
        if len(rows) == 1:
            _mm(op, st, a, b, part[:m], s, False, scale_a, scale_b)
            collectives.reduce_scatter(world, part[:m], out=out, stream=s)
            return out
        c = op.comm_stream
        off = 0
        for r in rows:
            piece = part[w * off:w * (off + r)]
            for d in range(1, w + 1):
                p = (me + d) % w   # my own rows last, as the fused op
                lo = p * shard + off
                _mm(op, st, a[lo:lo + r], b, piece[p * r:(p + 1) * r], s, True,
                    scale_a[lo:lo + r] if block else scale_a, scale_b)
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
