// The between-nodes stage of the hierarchical collectives (fluxrt/collectives_hier.py): rail rounds over
// NVSHMEM's device API. A rail is the ranks with the same local index, one per node; rail member d is the
// rank of node d. Round e of a rail:
//
//   fluxrt_rail_put      blocks x nodes blocks: block (b, d) = d * blocks + b puts part b of block d of the source
//                        (src + d * src_stride, `bytes` each) into member d's receive buffer, half e & 1, slot `me`,
//                        and sets member d's signal word [e & 1][me][b] to e (put-with-signal, non-blocking, then
//                        quiet so the source may be reused once the kernel ends). Members whose bit is clear in
//                        `put_mask` get the signal alone (no bytes): every member signals every member in every
//                        round, which keeps the buffer-half argument below for rounds with one sender (broadcast)
//                        or without a piece for oneself (all-gather, all-to-all)
//   fluxrt_rail_reduce_* every block waits (bounded) for all nodes x blocks signal words of the round, then
//                        reduces its share of the slots in node order 0, 1, ... in fp32: every member of the
//                        rail computes the same bits
//   fluxrt_rail_gather   waits likewise, then copies slot p to out + p * out_stride for every p whose bit is set in
//                        `copy_mask` (0: the wait alone)
//   fluxrt_rail_putv     as fluxrt_rail_put with a byte count per member (0: the signal alone); the round's blocks
//                        come from the largest piece of the whole rail, so every member waits for as many words
//   fluxrt_rail_gather_segments  waits likewise, then copies a table of segments out of the slots (alltoallv: each
//                        member's piece holds parts of several senders' data, bound for scattered places)
//   fluxrt_copy_segments the same table copy without a wait (packing before the node stage and into the send buffer)
//
// Buffer halves: a member writes half h in round e + 2 only after round e + 1 completed on it, which needed
// every member's round-(e + 1) signals, sent after that member's round-e kernels (its reads of half h) ended.
// Signal words are per half, so a round-(e + 1) signal never stands in for a missing round-e one.
#include "fluxrt/comm.cuh"
#include "fluxrt/remote.cuh"

using fluxrt::BF16;
using fluxrt::ErrorRecord;
using fluxrt::F16;
using fluxrt::F32;
using fluxrt::kMax;
using fluxrt::kMin;
using fluxrt::kSum;
using fluxrt::u32;
using fluxrt::u64;
using fluxrt::Watch;
namespace remote = fluxrt::remote;

struct RailPes {
    int pe[remote::kMaxRailNodes];  // NVSHMEM PE of rail member d (by value: no upload)
};

__device__ __forceinline__ u64* rail_signal(u64* sig, u32 half, u32 src, u32 block) {
    return sig + ((u64)half * remote::kMaxRailNodes + src) * remote::kMaxRailBlocks + block;
}

// The round's signal words (nodes x blocks) of this half, waited for by every block.
__device__ __forceinline__ bool rail_wait(const RailPes& pes, u32 nodes, u32 blocks, u64* sig, u64 epoch,
                                          const Watch& w) {
    const u32 half = epoch & 1;
    return remote::wait_signals(
        w, nodes * blocks, [&](u32 i) { return rail_signal(sig, half, i / blocks, i % blocks); },
        [&](u32 i) { return (u64)pes.pe[i / blocks]; }, epoch);
}

struct RailBytes {
    u64 n[remote::kMaxRailNodes];  // bytes to rail member d in this round (by value)
};

// Block (b, d) of a round's grid: part b of `bytes` from src to member d's slot `me`, and its signal word.
__device__ __forceinline__ void rail_put_part(const RailPes& pes, u32 me, u32 blocks, const char* src, u64 bytes,
                                              char* recv, u64 half_bytes, u64 slot_bytes, u64* sig, u64 epoch) {
    const u32 d = blockIdx.x / blocks, b = blockIdx.x % blocks, half = epoch & 1;
    u64 lo, hi;
    fluxrt::split_range(bytes, fluxrt::kVecBytes, blocks, b, &lo, &hi);
    char* dst = recv + half * half_bytes + me * slot_bytes + lo;
    remote::put_signal_nbi_block(dst, src + lo, hi - lo, rail_signal(sig, half, me, b), epoch, pes.pe[d]);
    __syncthreads();
    if (threadIdx.x == 0) remote::quiet();
}

extern "C" __global__ void fluxrt_rail_put(RailPes pes, u32 me, u32 blocks, const char* src, u64 src_stride,
                                           u64 bytes, char* recv, u64 half_bytes, u64 slot_bytes, u64* sig,
                                           u64 epoch, u64 put_mask) {
    const u32 d = blockIdx.x / blocks;
    rail_put_part(pes, me, blocks, src + d * src_stride, (put_mask >> d) & 1 ? bytes : 0, recv, half_bytes,
                  slot_bytes, sig, epoch);
}

extern "C" __global__ void fluxrt_rail_putv(RailPes pes, u32 me, u32 blocks, const char* src, u64 src_stride,
                                            RailBytes bytes, char* recv, u64 half_bytes, u64 slot_bytes, u64* sig,
                                            u64 epoch) {
    const u32 d = blockIdx.x / blocks;
    rail_put_part(pes, me, blocks, src + d * src_stride, bytes.n[d], recv, half_bytes, slot_bytes, sig, epoch);
}

template <class E, int OP>
__device__ __forceinline__ void rail_reduce(const RailPes& pes, u32 nodes, u32 put_blocks, const char* recv,
                                            u64 half_bytes, u64 slot_bytes, u64* sig, u64 epoch,
                                            typename E::T* out, u64 count, const Watch& w) {
    if (!rail_wait(pes, nodes, put_blocks, sig, epoch, w)) return;
    const char* h = recv + (epoch & 1) * half_bytes;
    const u64 nvec = count / E::kPerVec;
    u64 lo, hi;
    fluxrt::split_range(nvec, 1, gridDim.x, blockIdx.x, &lo, &hi);
    fluxrt::reduce_block<E, OP>(
        nodes, hi - lo, [&](u32 p) { return reinterpret_cast<const uint4*>(h + p * slot_bytes) + lo; },
        [&](u64 v, uint4 r) { reinterpret_cast<uint4*>(out)[lo + v] = r; });
    if (blockIdx.x == gridDim.x - 1)
        for (u64 e = nvec * E::kPerVec + threadIdx.x; e < count; e += blockDim.x)
            out[e] = fluxrt::reduce_elem<E, OP>(
                nodes, [&](u32 p) { return reinterpret_cast<const typename E::T*>(h + p * slot_bytes) + e; });
}

#define FLUXRT_RAIL_REDUCE(NAME, E, OP)                                                                      \
    extern "C" __global__ void fluxrt_rail_reduce_##NAME(RailPes pes, u32 nodes, u32 put_blocks,            \
                                                          const char* recv, u64 half_bytes, u64 slot_bytes, \
                                                          u64* sig, u64 epoch, E::T* out, u64 count,        \
                                                          u64 timeout_ns, ErrorRecord* err, u32 op,         \
                                                          u32 rank) {                                       \
        rail_reduce<E, OP>(pes, nodes, put_blocks, recv, half_bytes, slot_bytes, sig, epoch, out, count,    \
                           Watch{timeout_ns, err, op, rank});                                               \
    }

FLUXRT_BASE_REDUCTIONS(FLUXRT_RAIL_REDUCE)

extern "C" __global__ void fluxrt_rail_gather(RailPes pes, u32 nodes, u32 put_blocks, const char* recv,
                                              u64 half_bytes, u64 slot_bytes, u64* sig, u64 epoch, char* out,
                                              u64 out_stride, u64 bytes, u64 copy_mask, u64 timeout_ns,
                                              ErrorRecord* err, u32 op, u32 rank) {
    if (!rail_wait(pes, nodes, put_blocks, sig, epoch, Watch{timeout_ns, err, op, rank})) return;
    const char* h = recv + (epoch & 1) * half_bytes;
    u64 lo, hi;
    fluxrt::split_range(bytes, fluxrt::kVecBytes, gridDim.x, blockIdx.x, &lo, &hi);
    for (u32 p = 0; p < nodes; ++p)
        if ((copy_mask >> p) & 1) fluxrt::copy_block(out + p * out_stride + lo, h + p * slot_bytes + lo, hi - lo, true);
}

extern "C" __global__ void fluxrt_rail_gather_segments(RailPes pes, u32 nodes, u32 put_blocks, u64* sig, u64 epoch,
                                                       const u64* table, u64 n, u64 timeout_ns, ErrorRecord* err,
                                                       u32 op, u32 rank) {
    if (!rail_wait(pes, nodes, put_blocks, sig, epoch, Watch{timeout_ns, err, op, rank})) return;
    fluxrt::copy_segments(table, n, true);
}

extern "C" __global__ void fluxrt_copy_segments(const u64* table, u64 n) { fluxrt::copy_segments(table, n, false); }
