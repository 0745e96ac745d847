// Reduce-scatter rounds, and the allreduce rounds that share their body:
//   staged      reduce_scatter_round
//   ll          reduce_ll (allreduce: chunk_stride 0, every peer gets all of x)
//   pipelined   reduce_pipe (allreduce: two_phase, the owner pushes its reduced chunk on)
#pragma once

#include "../comm/schemes/staged.cuh"
#include "../comm/schemes/ll.cuh"
#include "../comm/schemes/pipelined.cuh"

namespace fluxrt {
namespace coll {

// Reduce-scatter of n chunks of `chunk` elements (chunk q of x starts at q * chunk_stride): rank r ends
// with the reduction of every rank's chunk r in out[0, chunk).
template <class E, int OP>
__device__ void reduce_scatter_round(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out,
                                     u64 chunk, u64 slot_bytes) {
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    u64 lo, hi;
    block_range(chunk, E::kPerVec, &lo, &hi);
    push_chunks<E>(t, x, chunk_stride, base, slot_bytes, lo, hi);                        // stage push
    staged_signal(t, 0, e);                                                               // stage signal
    if (!staged_wait(t, 0, e)) return poison_elems(out, lo, hi);                          // stage wait
    reduce_slots<E, OP>(out, t.ws + base, slot_bytes, t.world, lo, hi);                 // stage consume
}

// LL reduction round: rank r contributes the `bytes` at src_of(q) to the reduction that rank q keeps;
// the reduction of every rank's contribution for this rank lands in out. Accumulated in fp32 in rank
// order, as the other reductions (every rank computes bitwise the same value).
// allreduce: src_of(q) = x for every q; reduce-scatter: src_of(q) = chunk q of x.
template <class E, int OP>
__device__ void reduce_ll(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out, u64 count,
                          u64 slot_bytes) {
    typedef typename E::T T;
    constexpr u32 V = kLLData / sizeof(T);  // elements per line
    const u64 e = begin_round(t.epoch);
    const u32 f = ll_flag(e);
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    const u64 bytes = count * sizeof(T), lines = lines_of(bytes);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    const bool one_source = chunk_stride == 0;  // allreduce: every peer gets the same line
    for (u64 j = first; j < lines; j += stride) {                                       // stage push
        const u64 shared = one_source ? load_line(reinterpret_cast<const char*>(x), bytes, j) : 0;
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            const u64 v = one_source ? shared : load_line(reinterpret_cast<const char*>(x + q * chunk_stride), bytes, j);
            ll_put(ll_line(t.peer_ll(q), half, t.rank, slot_bytes, j), v, f);
        }
    }
    const char* own = reinterpret_cast<const char*>(x + t.rank * chunk_stride);
    for (u64 j = first; j < lines; j += stride) {                                       // stage take
        typename E::Acc acc[V];
        for (u32 p = 0; p < t.world; ++p) {
            u64 v;
            if (p == t.rank) v = load_line(own, bytes, j);
            else if (!ll_take(t, ll_line(t.ll, half, p, slot_bytes, j), f, p, &v))
                return poison_lines(reinterpret_cast<char*>(out), bytes, first, stride, kLLData);
            accumulate_line<E, OP, V>(acc, v, p);
        }
        store_line(reinterpret_cast<char*>(out), bytes, j, pack_line<E, V>(acc));     // stage store
    }
}

// Pipelined reduction round, `step` elements per ring entry.
//   reduce-scatter (two_phase false; roles sender, reducer): rank r pushes the slice steps of chunk q of
//     x (at q * chunk_stride) to q; each rank reduces its own chunk into out[0, chunk) (count == chunk).
//   allreduce (two_phase true; roles sender, reducer, receiver): chunk q = x[q * chunk, ...) clipped to
//     count; its owner reduces it into out and pushes the result into every peer's ring 1 in the same
//     pass; the receivers copy the other chunks out.
template <class E, int OP>
__device__ void reduce_pipe(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out, u64 count,
                            u64 chunk, u64 slot_bytes, u64 step, u32 depth, bool two_phase) {
    typedef typename E::T T;
    __shared__ const char* srcs[kMaxWorld];
    __shared__ char* dsts[kMaxWorld];
    const Pipe pp = begin_pipe(t, two_phase ? 3 : 2, slot_bytes, step * sizeof(T), depth);
    u64 lo, hi;
    pp.range(chunk, kLineBytes / sizeof(T), &lo, &hi);
    u64 len[kMaxWorld];  // elements of chunk q in this slice
    u64 steps = 1;
    for (u32 q = 0; q < t.world; ++q) {
        u64 n = hi - lo;
        if (two_phase) {  // clip to the message: the last chunks may be short or empty
            const u64 valid = count > q * chunk ? count - q * chunk : 0;
            const u64 h = hi < valid ? hi : valid;
            n = lo < h ? h - lo : 0;
        }
        len[q] = n;
        const u64 s = steps_of(n, step);
        steps = s > steps ? s : steps;
    }
    const u32 peers = t.peers();
    if (pp.role == 0) {                                                                 // sender
        for (u64 j = 0; j < steps; ++j) {
            const u32 mask = peers_with_step(t, len, step, j);
            if (j >= depth && !pipe_wait(t, pp, kCredit0, pipe_value(pp.e, j - depth), mask)) return;
            for (u32 s = 1; s < t.world; ++s) {
                const u32 q = (t.rank + s) % t.world;
                if (!((mask >> q) & 1u)) continue;
                const u64 src = (two_phase ? q * chunk : q * chunk_stride) + lo + j * step;
                copy_block(t.peer_ws(q) + pp.entry(t, 0, q, t.rank, j), reinterpret_cast<const char*>(x + src),
                           step_len(len[q], step, j) * sizeof(T), false);
            }
            pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), mask);
        }
    } else if (pp.role == 1) {                                                          // reducer
        T* my_out = (two_phase ? out + t.rank * chunk : out) + lo;
        const u64 own = (two_phase ? t.rank * chunk : t.rank * chunk_stride) + lo;
        for (u64 j = 0; j < steps_of(len[t.rank], step); ++j) {
            // its chunk of out: only this role writes it, and no role of this rank reads it
            if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), peers)) return poison_elems(my_out, 0, len[t.rank]);
            if (two_phase && j >= depth && !pipe_wait(t, pp, kCredit1, pipe_value(pp.e, j - depth), peers))
                return poison_elems(my_out, 0, len[t.rank]);
            const u32 p = threadIdx.x;
            if (p < t.world) {
                srcs[p] = p == t.rank ? reinterpret_cast<const char*>(x + own + j * step) : t.ws + pp.entry(t, 0, t.rank, p, j);
                // destination 0: this rank's out; 1..n-1 (two-phase): the peers' ring 1
                if (p == 0) dsts[0] = reinterpret_cast<char*>(my_out + j * step);
                else if (two_phase) {
                    const u32 q = (t.rank + p) % t.world;
                    dsts[p] = t.peer_ws(q) + pp.entry(t, 1, q, t.rank, j);
                }
            }
            __syncthreads();
            reduce_step<E, OP>(dsts, two_phase ? t.world : 1u, srcs, t.world, step_len(len[t.rank], step, j));
            pipe_signal(t, pp, kCredit0, pipe_value(pp.e, j), peers);                  // ring-0 reads done
            if (two_phase)  // pipe_signal's publish also ordered this block's ring-1 pushes
                pipe_release(t, pp, kReady1, pipe_value(pp.e, j), peers);
        }
    } else {                                                                            // receiver (allreduce)
        for (u64 j = 0; j < steps; ++j) {
            const u32 mask = peers_with_step(t, len, step, j);
            if (!pipe_wait(t, pp, kReady1, pipe_value(pp.e, j), mask)) {
                // the other chunks of out; in place (x == out) this rank's sender may still read them
                if (reinterpret_cast<const void*>(x) != reinterpret_cast<const void*>(out))
                    for (u32 p = 0; p < t.world; ++p)
                        if (p != t.rank) poison_elems(out + p * chunk + lo, 0, len[p]);
                return;
            }
            for (u32 p = 0; p < t.world; ++p) {
                if (!((mask >> p) & 1u)) continue;
                copy_block(reinterpret_cast<char*>(out + p * chunk + lo + j * step), t.ws + pp.entry(t, 1, t.rank, p, j),
                           step_len(len[p], step, j) * sizeof(T), true);
            }
            pipe_signal(t, pp, kCredit1, pipe_value(pp.e, j), mask);
        }
    }
}

}  // namespace coll
}  // namespace fluxrt
