// Pipelined scheme: bulk messages in one launch, without the push-then-consume stall of the staged
// rounds. The message is cut into `slices` (per pair, the same cut on both sides); each slice streams in
// steps of `step` bytes through a ring of `depth` entries in the receiver's workspace slot [sender].
// Each slice has one block per role, so pushing never waits for consuming (roles: algorithms/*.cuh).
// Roles interleave by block index (block = slice * roles + role), so any prefix of resident blocks holds
// whole slices. Flags, per (phase, peer, slice):
//   ready  [kReady*][src][slice] on the receiver: src has pushed step j of this round
//   credit [kCredit*][dst][slice] on the sender: dst has finished reading step j
// A sender refills ring entry j % depth only after the credit of step j - depth. Flag values
// pipe_value(e, j) = (e << kStepBits) + j + 1 grow across rounds, so nothing is reset and waits compare
// with >=; they have flag phases of their own (the staged rounds' flags carry plain epochs).
// Every (pair, slice) moves at least one step per round (an empty slice sends a marker step), so the
// workspace-halves argument (team.cuh) holds: a peer's first ready flag of round e + 1 means that its
// round-e kernel, and so its reads of the other half, completed.
#pragma once

#include "../comm/team.cuh"

namespace fluxrt {
namespace coll {

constexpr u32 kReady0 = 2, kReady1 = 3, kCredit0 = 4, kCredit1 = 5;  // flag phases (kFlagPhases in all)
// Rounds have 44 bits (begin_round), steps the other 20: values never wrap. Steps per (pair, slice) and
// round stay below 2^20 - 1 (the host checks; 4 GiB per slice with 4 KiB steps).
constexpr u64 kStepBits = 20;
constexpr u64 kLineBytes = 128;  // slices start on whole cache lines (full-line NVLink writes)
static_assert(kCredit1 < kFlagPhases, "the pipelined rounds' flag phases");
static_assert(kStepBits <= kRoundShift, "pipe_value(e, j): 64 - kRoundShift round bits + kStepBits must fit 64");

__device__ __forceinline__ u64 pipe_value(u64 e, u64 j) { return (e << kStepBits) + j + 1ull; }

// This block's part in a pipelined round.
struct Pipe {
    u64 e;           // round
    u32 role, slice, slices;
    u64 base;        // offset of ring 0 in the workspace (ring 1, allreduce: world - 1 slots further)
    u64 slot_bytes;  // per source rank and ring
    u64 step;        // bytes per ring entry
    u32 depth;       // entries per slice

    // Ring entry of step j that rank `src` fills in rank `owner`'s workspace (the same offset on both
    // sides of a pair). A rank never sends to itself, so a ring has world - 1 slots: src's slot is its
    // distance after the owner, minus one.
    __device__ __forceinline__ u64 entry(const Team& t, u32 ring, u32 owner, u32 src, u64 j) const {
        const u32 slot = (src + t.world - owner - 1) % t.world;
        return base + ((u64)ring * (t.world - 1) + slot) * slot_bytes + ((u64)slice * depth + j % depth) * step;
    }
    __device__ __forceinline__ u64 flag(const Team& t, u32 phase, u32 src) const {
        return ((u64)phase * t.world + src) * kMaxBlocks + slice;
    }
    // [lo, hi) of `total` units: this block's slice, in pieces of whole `align` units.
    __device__ __forceinline__ void range(u64 total, u64 align, u64* lo, u64* hi) const {
        split_range(total, align, slices, slice, lo, hi);
    }
};

__device__ __forceinline__ Pipe begin_pipe(const Team& t, u32 roles, u64 slot_bytes, u64 step, u32 depth) {
    Pipe pp;
    pp.e = begin_round(t.epoch);
    pp.role = blockIdx.x % roles;
    pp.slice = blockIdx.x / roles;
    pp.slices = gridDim.x / roles;
    pp.base = half_offset(t, pp.e);
    pp.slot_bytes = slot_bytes;
    pp.step = step;
    pp.depth = depth;
    return pp;
}

__device__ __forceinline__ u64 steps_of(u64 len, u64 step) { return len ? (len + step - 1) / step : 1; }

// Units of step j within a slice of `len` units (0 past its end: a marker step).
__device__ __forceinline__ u64 step_len(u64 len, u64 step, u64 j) {
    const u64 at = j * step;
    return at < len ? (len - at < step ? len - at : step) : 0;
}

// Thread p acquires flag [phase][p][slice] >= v for every peer p in `mask`; false (for the whole block)
// if any of these waits timed out.
__device__ __forceinline__ bool pipe_wait(const Team& t, const Pipe& pp, u32 phase, u64 v, u32 mask) {
    return wait_peers(t.watch(), t.world, InMask{mask}, [&](u32 p) { return t.flags + pp.flag(t, phase, p); }, v);
}

// Thread q releases flag [phase][rank][slice] = v on each peer q in `mask`, after the block's
// accesses of step j (signal: published first; release: the caller has published them already).
__device__ __forceinline__ void pipe_release(const Team& t, const Pipe& pp, u32 phase, u64 v, u32 mask) {
    release_peers(t.world, InMask{mask}, [&](u32 q) { return t.peer_flag(q, pp.flag(t, phase, t.rank)); }, v);
}
__device__ __forceinline__ void pipe_signal(const Team& t, const Pipe& pp, u32 phase, u64 v, u32 mask) {
    block_publish();
    pipe_release(t, pp, phase, v, mask);
}

// Peers (not this rank) whose slice of `len[q]` units has a step j.
__device__ __forceinline__ u32 peers_with_step(const Team& t, const u64* len, u64 step, u64 j) {
    u32 mask = 0;
    for (u32 q = 0; q < t.world; ++q)
        if (q != t.rank && j < steps_of(len[q], step)) mask |= 1u << q;
    return mask;
}

// One step's reduction from ring entries (and x) into ring entries (and out), the block's threads
// together: dst_d[k] = src_0[k] op ... op src_{n-1}[k] for k < count and every d < ndst, in fp32 in
// source order (the same bits on every rank); one source is copied as bits. Pointers in shared memory,
// set by the caller.
template <class E, int OP>
__device__ void reduce_step(char* const* dst, u32 ndst, const char* const* src, u32 n, u64 count) {
    typedef typename E::T T;
    if constexpr (!E::kArithmetic) {
        copy_fanout(dst, ndst, src[0], count * sizeof(T));
    } else if (n == 1) {
        copy_fanout(dst, ndst, src[0], count * sizeof(T));
    } else {
        constexpr u32 V = E::kPerVec;
        u64 any = 0;
        for (u32 p = 0; p < n; ++p) any |= reinterpret_cast<u64>(src[p]);
        for (u32 d = 0; d < ndst; ++d) any |= reinterpret_cast<u64>(dst[d]);
        const u64 nvec = (any & 15ull) == 0 ? count / V : 0;
        reduce_block<E, OP>(n, nvec, [&](u32 p) { return reinterpret_cast<const uint4*>(src[p]); },
                            [&](u64 v, const uint4& res) {
                                for (u32 d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dst[d])[v] = res;
                            });
        for (u64 k = nvec * V + threadIdx.x; k < count; k += blockDim.x) {
            const T r = reduce_elem<E, OP>(n, [&](u32 p) { return reinterpret_cast<const volatile T*>(src[p]) + k; });
            for (u32 d = 0; d < ndst; ++d) reinterpret_cast<T*>(dst[d])[k] = r;
        }
    }
}

}  // namespace coll
}  // namespace fluxrt
