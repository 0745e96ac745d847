// Allreduce rounds of their own (the ones that share a body with reduce-scatter are in
// reduce_scatter.cuh, the ring's in schemes/ring.cuh):
//   staged   one-shot (push everything to everyone, reduce locally), two-shot (reduce-scatter, then
//            allgather the reduced chunks)
//   ll12     one-shot and two-shot in LL12 lines
#pragma once

#include "../comm/schemes/staged.cuh"
#include "../comm/schemes/ll.cuh"

namespace fluxrt {
namespace coll {

// One-shot allreduce of `count` elements: every rank pushes all of x into every peer's slot [rank]
// and reduces all n slots locally. Slots are `slot_bytes` apart in the workspace half.
template <class E, int OP>
__device__ void allreduce_oneshot(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 slot_bytes) {
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    u64 lo, hi;
    block_range(count, E::kPerVec, &lo, &hi);
    push_chunks<E>(t, x, 0, base, slot_bytes, lo, hi);                                   // stage push
    staged_signal(t, 0, e);                                                               // stage signal
    if (!staged_wait(t, 0, e)) return poison_elems(out, lo, hi);                          // stage wait
    reduce_slots<E, OP>(out, t.ws + base, slot_bytes, t.world, lo, hi);                 // stage consume
}

// Two-shot allreduce of n chunks of `chunk` elements (the last ones may be shorter: `count` in all):
// reduce-scatter into slots of the first quarter-half, then push the reduced chunk to every peer's
// slot [rank] of the second area and copy all chunks out. Each block keeps its slice in both phases.
template <class E, int OP>
__device__ void allreduce_twoshot(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 chunk,
                                  u64 slot_bytes) {
    typedef typename E::T T;
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    const u64 area2 = base + (u64)t.world * slot_bytes;
    u64 lo, hi;
    block_range(chunk, E::kPerVec, &lo, &hi);
    auto poison = [&] {  // this block's slice of every chunk of out
        for (u32 p = 0; p < t.world; ++p) {
            const u64 start = p * chunk;
            poison_elems(out, start + lo < count ? start + lo : count, start + hi < count ? start + hi : count);
        }
    };
    // stage push (phase 0): slice [lo, hi) of chunk q goes to q, clipped to the message.
    for (u32 s = 0; s < t.world; ++s) {
        const u32 q = (t.rank + 1 + s) % t.world;
        const u64 start = q * chunk;
        const u64 l = start + lo < count ? start + lo : count, h = start + hi < count ? start + hi : count;
        char* dst = t.peer_ws(q) + base + (u64)t.rank * slot_bytes + lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(x + l), (h - l) * sizeof(T), false);
    }
    staged_signal(t, 0, e);
    if (!staged_wait(t, 0, e)) return poison();
    // stage reduce: my chunk's slice, into my own area-2 slot (peers read nothing of mine: they get pushes).
    const u64 mine = (u64)t.rank * chunk;
    const u64 my_hi = mine + hi < count ? hi : (count > mine ? count - mine : 0);
    const u64 my_lo = lo < my_hi ? lo : my_hi;
    T* reduced = reinterpret_cast<T*>(t.ws + area2 + (u64)t.rank * slot_bytes);
    reduce_slots<E, OP>(reduced, t.ws + base, slot_bytes, t.world, my_lo, my_hi);
    __syncthreads();
    // stage push (phase 1): the reduced slice to every other peer's slot [rank] of area 2.
    for (u32 s = 1; s < t.world; ++s) {
        const u32 q = (t.rank + s) % t.world;
        char* dst = t.peer_ws(q) + area2 + (u64)t.rank * slot_bytes + my_lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(reduced + my_lo), (my_hi - my_lo) * sizeof(T), true);
    }
    staged_signal(t, 1, e);
    if (!staged_wait(t, 1, e)) return poison();
    // stage consume: every reduced chunk's slice into out.
    for (u32 p = 0; p < t.world; ++p) {
        const u64 start = p * chunk;
        const u64 l = start + lo < count ? start + lo : count, h = start + hi < count ? start + hi : count;
        const char* src = t.ws + area2 + (u64)p * slot_bytes + lo * sizeof(T);
        copy_block(reinterpret_cast<char*>(out + l), src, (h - l) * sizeof(T), true);
    }
}

// Allreduce of `count` elements in LL12 lines: every rank pushes all of x into every peer's LL slot [rank]
// and reduces the n contributions of each line in fp32 in rank order (every rank computes bitwise the
// same value). One thread owns line j of every pair (in place: out == x is fine, the thread reads its own
// line of x before it writes that line of out). Launch: any grid and block (blockDim >= 1); the host sizes
// it a thread per line (collectives_plan.ll12_grid).
template <class E, int OP>
__device__ void allreduce_ll12(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 slot_bytes) {
    typedef typename E::T T;
    static_assert(kLL12Data % sizeof(T) == 0 && sizeof(T) <= 4, "whole elements per line, in 32-bit words");
    __shared__ u64 s_peer[kMaxWorld];
    const char* src = reinterpret_cast<const char*>(x);
    const u64 bytes = count * sizeof(T), lines = lines12_of(bytes);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    u32 mine[3] = {0u, 0u, 0u};
    const u64 e = begin_round(                                                           // stage begin
        t.epoch, [&] { for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) s_peer[q] = t.ll_peers[q]; },
        [&] { if (first < lines) load12(src, bytes, first, mine); });
    const u64 f = ll12_flag(e), flag_bits = f << kLL12FlagShift;
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    for (u64 j = first; j < lines; j += stride) {                                       // stage push
        u32 w[3] = {mine[0], mine[1], mine[2]};
        if (j != first) load12(src, bytes, j, w);
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]), half, t.rank, slot_bytes, j), w, flag_bits);
        }
    }
    for (u64 j = first; j < lines; j += stride) {                                       // stage take
        u32 own[3] = {mine[0], mine[1], mine[2]};
        if (j != first) load12(src, bytes, j, own);
        u32 r[3];
        if (!reduce_line12<E, OP>(t, t.ll + half, slot_bytes, j, f, own, r))
            return poison_lines(reinterpret_cast<char*>(out), bytes, first, stride, kLL12Data);
        store12(reinterpret_cast<char*>(out), bytes, j, r);                              // stage store
    }
}

// ----------------------------------------------------------------------------------------- LL12 two-shot
// Allreduce for mid-size messages: a reduce-scatter and an allgather in LL12 lines, in one launch. Each
// rank sends 2 (n-1)/n of the message (times 4/3 for the flags) instead of one-shot's n - 1 times, at
// the price of a second NVLink trip. The message's `lines` LL12 lines are cut into n chunks of
// `chunk` = ceil(lines / n) lines (the last ones may be short or empty); rank q owns chunk q. Thread j
// owns line j of every chunk:
//   stage push     line j of chunk q of x to peer q's region 0, slot [rank]
//   stage reduce   line j of this rank's chunk: its own line and every peer's (taken from region 0, slot
//                  [p]) in fp32 in rank order, into out (every rank computes bitwise the same value)
//   stage forward  the reduced line to every peer's region 1, slot [rank]
//   stage gather   line j of chunk p from region 1, slot [p], into out
// The LL rounds' contract holds (data and flag in one 8-byte cell, lines zeroed when read, round e in
// LL half e & 1). An empty chunk still moves one marker line (j = 0) in both phases, so every pair
// exchanges lines in every round, which the halves argument needs. In place is fine: thread j reads
// line j of every chunk of x (push, reduce) before it writes any line of out.
// Region 0 holds n slots of `slot_bytes` from the half's start, region 1 n more (Layout of 'll12_twoshot').
template <class E, int OP>
__device__ void allreduce_ll12_twoshot(Team t, const typename E::T* x, typename E::T* out, u64 count,
                                       u64 slot_bytes) {
    typedef typename E::T T;
    __shared__ u64 s_peer[kMaxWorld];
    const char* src = reinterpret_cast<const char*>(x);
    const u64 bytes = count * sizeof(T), lines = lines12_of(bytes);
    const u64 chunk = (lines + t.world - 1) / t.world;
    // lines of chunk q: its length, at least one (a marker line past the end of the message)
    auto len = [&](u32 q) { const u64 at = (u64)q * chunk; return at < lines ? (lines - at < chunk ? lines - at : chunk) : 0ull; };
    auto moved = [&](u32 q) { const u64 n = len(q); return n ? n : 1ull; };
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    u32 mine[3] = {0u, 0u, 0u};  // this thread's first line of its own chunk
    const u64 e = begin_round(                                                           // stage begin
        t.epoch, [&] { for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) s_peer[q] = t.ll_peers[q]; },
        [&] { if (first < len(t.rank)) load12(src, bytes, t.rank * chunk + first, mine); });
    const u64 f = ll12_flag(e), flag_bits = f << kLL12FlagShift;
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    const u64 region1 = (u64)t.world * slot_bytes;
    auto poison = [&] {  // this thread's lines of every chunk of out
        for (u32 q = 0; q < t.world; ++q)
            for (u64 j = first; j < len(q); j += stride) {
                const u64 at = (q * chunk + j) * kLL12Data;
                poison_bytes(reinterpret_cast<char*>(out) + at, bytes - at < kLL12Data ? bytes - at : kLL12Data, 0, 1);
            }
    };
    for (u64 j = first; j < chunk; j += stride) {                                       // stage push
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            if (j >= moved(q)) continue;
            u32 w[3] = {0u, 0u, 0u};
            if (j < len(q)) load12(src, bytes, q * chunk + j, w);
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]), half, t.rank, slot_bytes, j), w, flag_bits);
        }
    }
    for (u64 j = first; j < moved(t.rank); j += stride) {                               // stage reduce
        u32 own[3] = {mine[0], mine[1], mine[2]};
        if (j != first && j < len(t.rank)) load12(src, bytes, t.rank * chunk + j, own);
        u32 r[3];
        if (!reduce_line12<E, OP>(t, t.ll + half, slot_bytes, j, f, own, r)) return poison();
        if (j < len(t.rank)) store12(reinterpret_cast<char*>(out), bytes, t.rank * chunk + j, r);
        for (u32 s = 1; s < t.world; ++s) {                                             // stage forward
            const u32 q = (t.rank + s) % t.world;
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]) + region1, half, t.rank, slot_bytes, j), r, flag_bits);
        }
    }
    for (u64 j = first; j < chunk; j += stride) {                                       // stage gather
        u32 peers = 0;
        for (u32 p = 0; p < t.world; ++p)
            if (p != t.rank && j < moved(p)) peers |= 1u << p;
        const u32 none[3] = {0u, 0u, 0u};
        const bool ok = take12(t, t.ll + half + region1, slot_bytes, j, f, peers, none,
                               [&](u32 p, const u32 (&w)[3]) {
                                   if (j < len(p)) store12(reinterpret_cast<char*>(out), bytes, p * chunk + j, w);
                               });
        if (!ok) return poison();
    }
}

}  // namespace coll
}  // namespace fluxrt
