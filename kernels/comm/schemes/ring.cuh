// Ring scheme: every rank pushes to the next rank only, through a ring of entries per slice, and the
// round's stage walk (reduce_ring) serves allreduce, reduce-scatter and allgather (algorithms choose the
// stages).
#pragma once

#include "../comm/schemes/pipelined.cuh"

namespace fluxrt {
namespace coll {

// Bulk reductions and allgathers along the ring rank -> rank + 1 (as NCCL's ring). Every rank pushes to
// one peer only: single-destination pushes reach a higher rate per GPU than all-to-all pushes, which the
// pipelined rounds use (figures: docs/tuning.md, "Device-code constants").
// The message is n chunks. Chunk c travels c+1 -> c+2 -> ... -> c, each rank adding its x, then, reduced,
// once more around the ring until every rank holds it. Rank r, stage s, chunk c = (r + 2n - 1 - s) mod n:
//   s = 0             send x[c]                                    (reduce-scatter stages: c = r - 1 - s)
//   0 < s < n - 1     receive, add x[c], send
//   s = n - 1         receive, add x[r], write out[r], send        (allgather stages: c = r - (s - n + 1))
//   n - 1 < s < 2n-2  receive, write out[c], send
//   s = 2n - 2        receive, write out[r + 1]
// allreduce runs stages 0 .. 2n-2; reduce_scatter 0 .. n-1 (out holds chunk r only: out_stride 0);
// allgather n - 1 .. 2n - 2, its first stage sending x (chunk r only: x_stride 0) without a receive.
// A stage with one source (allreduce's first and last n - 1 stages, every allgather stage) copies bits.
// Block b takes slice b of every chunk, in pieces of `substeps` steps of `step` elements, each piece
// through all stages before the next. What rank r sends to r + 1 is one sequence of entries per slice,
// u = (piece * sends + stage - first) * substeps + i for step i of a stage, held in a ring of `depth`
// entries of the receiver's workspace (half e & 1, as every round):
//   ready  [kReady0][slice] on r + 1: entry u is written          (rank r releases after its pushes)
//   credit [kCredit0][slice] on r: r + 1 has read entry u           (r refills it with u + depth)
// Why steps within a stage: the next rank's stage s + 1 step i needs only step i of this rank's stage s,
// so the ranks run in step, and each wait has substeps - 1 steps of copying to hide the previous
// rank's fence and flag latency (with one step per stage that latency adds to every stage; docs/tuning.md
// has the measurement). depth >= 2 substeps lets a rank send stage s + 1 while
// the next rank still reads stage s. Where a block's whole slice fits one entry the host passes
// substeps = 1 (collectives_plan.ring_geometry): each stage then pays one fence and one flag, which at
// 32-128 MiB costs less than hiding the flag latency behind a second, half-size step.
// Every stage of every slice moves at least one (maybe empty) step, so the workspace-halves argument
// holds: rank r's round e ends only after it received chunk r + 1 reduced by rank r + 1 in round e, so
// r + 1 had finished round e - 1 (and its reads of the other half).
// Sums are rounded to the dtype at each hop (as in NCCL's ring), not accumulated in fp32; a chunk is
// reduced once, by its owner, so every rank still gets the same bits.
// A ring round's flags have one source each (ready: the previous rank, credit: the next), so a phase's
// flags are indexed by slice alone, over all world x kMaxBlocks slots: up to kMaxRingBlocks slices.
constexpr u32 kMaxRingBlocks = 256;
static_assert(kMaxRingBlocks <= 2 * kMaxBlocks, "ring flags must fit world x kMaxBlocks slots for 2 ranks");

__device__ __forceinline__ u64 ring_flag(const Team& t, const Pipe& pp, u32 phase) {
    return (u64)phase * t.world * kMaxBlocks + pp.slice;
}

// Thread 0 acquires the ready flag of entry `ready` (from prev), thread 32 (another warp, so both spin
// at once) the credit of entry `credited` (from next); 0: no wait. False for the block on a timeout.
__device__ __forceinline__ bool ring_wait(const Team& t, const Pipe& pp, u32 prev, u64 ready, u32 next,
                                          u64 credited) {
    int ok = 1;
    if (threadIdx.x == 0 && ready)
        ok = acquire_for_block(t.flags + ring_flag(t, pp, kReady0), ready, t.watch(), prev);
    else if (threadIdx.x == 32 && credited)
        ok = acquire_for_block(t.flags + ring_flag(t, pp, kCredit0), credited, t.watch(), next);
    return __syncthreads_and(ok) != 0;
}

// After the block's pushes into next's entry us (send) and reads of its own entry ur (recv): the block
// publishes, then thread 0 releases next's ready flag and thread 32 prev's credit flag.
__device__ __forceinline__ void ring_signal(const Team& t, const Pipe& pp, u32 prev, bool recv, u64 ur, u32 next,
                                            bool send, u64 us) {
    block_publish();
    if (threadIdx.x == 0 && send) st_release_sys(t.peer_flag(next, ring_flag(t, pp, kReady0)), pipe_value(pp.e, us));
    else if (threadIdx.x == 32 && recv) st_release_sys(t.peer_flag(prev, ring_flag(t, pp, kCredit0)), pipe_value(pp.e, ur));
}

template <class E, int OP>
__device__ void reduce_ring(Team t, const typename E::T* x, u64 x_stride, typename E::T* out, u64 out_stride,
                            u64 count, u64 chunk, u64 step, u32 depth, u32 substeps, u32 first, u32 last) {
    typedef typename E::T T;
    __shared__ const char* srcs[2];
    __shared__ char* dsts[2];
    __shared__ u32 nsrc, ndst;
    const Pipe pp = begin_pipe(t, 1, 0, step * sizeof(T), depth);
    const u32 n = t.world, next = (t.rank + 1) % n, prev = (t.rank + n - 1) % n;
    u64 lo, hi;
    pp.range(chunk, kLineBytes / sizeof(T), &lo, &hi);
    const u64 sends = last - first;
    const u64 ring_at = pp.base + (u64)pp.slice * depth * pp.step;  // this slice's ring, same on every rank
    char* const ring_next = t.peer_ws(next) + ring_at;
    const char* const ring_mine = t.ws + ring_at;
    const u64 piece = step * substeps;
    for (u64 m = 0; m < steps_of(hi - lo, piece); ++m) {
        for (u32 s = first; s <= last; ++s) {
            const u32 c = (t.rank + 2 * n - 1 - s) % n;
            const u64 valid = count > c * chunk ? count - c * chunk : 0;  // chunk c clipped to the message
            const u64 end = hi < valid ? hi : valid;
            const bool recv = s > first, send = s < last;
            for (u32 i = 0; i < substeps; ++i) {
                const u64 at = lo + m * piece + i * step;  // element offset of the step within a chunk
                const u64 len = at < end ? (end - at < step ? end - at : step) : 0;
                const u64 us = (m * sends + (s - first)) * substeps + i;  // entry sent; received: us - substeps
                const u64 ur = us - substeps;
                if (!ring_wait(t, pp, prev, recv ? pipe_value(pp.e, ur) : 0, next,
                               send && us >= depth ? pipe_value(pp.e, us - depth) : 0)) {
                    // this block's slice of every chunk it writes out (no other block touches it)
                    for (u32 so = first > n - 1 ? first : n - 1; so <= last; ++so) {
                        const u32 co = (t.rank + 2 * n - 1 - so) % n;
                        const u64 vo = count > co * chunk ? count - co * chunk : 0;
                        poison_elems(out + co * out_stride, lo, hi < vo ? hi : vo);
                    }
                    return;
                }
                if (threadIdx.x == 0) {                                                    // stage reduce
                    u32 ns = 0, nd = 0;
                    if (recv) srcs[ns++] = ring_mine + (ur % depth) * pp.step;
                    if (s <= n - 1) srcs[ns++] = reinterpret_cast<const char*>(x + c * x_stride + at);
                    if (send) dsts[nd++] = ring_next + (us % depth) * pp.step;
                    char* const o = reinterpret_cast<char*>(out + c * out_stride + at);
                    if (s >= n - 1 && !(ns == 1 && srcs[0] == o)) dsts[nd++] = o;  // in place: already there
                    nsrc = ns, ndst = nd;
                }
                __syncthreads();
                reduce_step<E, OP>(dsts, ndst, srcs, nsrc, len);
                ring_signal(t, pp, prev, recv, ur, next, send, us);                        // stage ready, credit
            }
        }
    }
}

}  // namespace coll
}  // namespace fluxrt
