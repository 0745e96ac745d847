// Staged scheme: a round pushes, signals, waits, then consumes, one flag per (phase, source, block).
//   stage push     each block copies its slice of the data this rank sends to peer q into q's workspace
//                  slot [rank] (16-byte vectors where alignment allows),
//   stage signal   every writer fences, then one thread per peer releases flag [phase][rank][block] on q,
//   stage wait     one thread per peer acquires flag [phase][p][block] locally (bounded),
//   stage consume  the block reduces or copies what the peers pushed into its slice of the output.
// Direct rounds (symmetric outputs) push into the peers' outputs instead, after a "ready" flag from each
// peer, and have no consume stage. Every rank (itself included) signals every rank: staged flags carry
// the plain epoch.
#pragma once

#include "../comm/team.cuh"

namespace fluxrt {
namespace coll {

__device__ __forceinline__ u64 flag_index(const Team& t, u32 phase, u32 src) {
    return ((u64)phase * t.world + src) * kMaxBlocks + blockIdx.x;
}

// After this block's pushes: the block publishes, then thread q releases this block's flag on peer q.
__device__ __forceinline__ void staged_signal(const Team& t, u32 phase, u64 e) {
    signal_peers(t.world, every_peer, [&](u32 q) { return t.peer_flag(q, flag_index(t, phase, t.rank)); }, e);
}

// Thread p acquires peer p's flag for this block; false (for the whole block) if any wait timed out.
__device__ __forceinline__ bool staged_wait(const Team& t, u32 phase, u64 e) {
    return wait_peers(t.watch(), t.world, every_peer, [&](u32 p) { return t.flags + flag_index(t, phase, p); }, e);
}

// The block's [lo, hi) of `total` units, in pieces of whole `align` units.
__device__ __forceinline__ void block_range(u64 total, u64 align, u64* lo, u64* hi) {
    split_range(total, align, gridDim.x, blockIdx.x, lo, hi);
}

// Push elements [lo, hi) of each peer's chunk: chunk q starts at src + q * src_stride elements and lands
// in q's slot [rank] at dst_off bytes into the workspace (slots `slot_bytes` apart). Peers are visited
// starting after this rank so that the ranks do not all write to the same peer at once.
template <class E>
__device__ void push_chunks(const Team& t, const typename E::T* src, u64 src_stride, u64 dst_off,
                            u64 slot_bytes, u64 lo, u64 hi) {
    typedef typename E::T T;
    for (u32 s = 0; s < t.world; ++s) {
        const u32 q = (t.rank + 1 + s) % t.world;
        char* dst = t.peer_ws(q) + dst_off + (u64)t.rank * slot_bytes + lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(src + q * src_stride + lo), (hi - lo) * sizeof(T), false);
    }
}

// out[i] = slot_0[i] op slot_1[i] op ... op slot_{n-1}[i] for i in [lo, hi), in fp32 in rank order.
// Slots are `slot_stride` bytes apart from `slots`.
template <class E, int OP>
__device__ void reduce_slots(typename E::T* out, const char* slots, u64 slot_stride, u32 n, u64 lo, u64 hi) {
    typedef typename E::T T;
    constexpr u32 V = E::kPerVec;
    const bool vec_ok = ((reinterpret_cast<u64>(out) | reinterpret_cast<u64>(slots) | slot_stride) & 15ull) == 0 &&
                        lo % V == 0;
    u64 i = lo;
    if (vec_ok) {
        const u64 nvec = (hi - lo) / V;
        reduce_block<E, OP>(
            n, nvec, [&](u32 p) { return reinterpret_cast<const uint4*>(slots + p * slot_stride) + lo / V; },
            [&](u64 v, const uint4& res) { reinterpret_cast<uint4*>(out)[lo / V + v] = res; });
        i = lo + nvec * V;
    }
    for (u64 j = i + threadIdx.x; j < hi; j += blockDim.x)
        out[j] = reduce_elem<E, OP>(
            n, [&](u32 p) { return reinterpret_cast<const volatile T*>(slots + p * slot_stride) + j; });
}

}  // namespace coll
}  // namespace fluxrt
