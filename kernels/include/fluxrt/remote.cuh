// Moving data to peers that NVLink pointers do not reach: NVSHMEM's device API (IBGDA, IBRC and its
// proxy, or its P2P transport), with the same contract as sync.cuh: a signal is raised only after the
// data it guards is delivered, every wait is bounded and reports into the ErrorRecord.
//
//   put_signal_nbi_block   the block's threads put `bytes`, then the peer's signal word is set to `value`
//                          behind the data (non-blocking: the source stays in use until quiet)
//   put_nbi_block          a put without a signal (ordered before a later signal by fence or quiet)
//   quiet                  completes every put this PE issued (sources reusable, data delivered)
//   wait_signals           the block waits for n local signal words >= target (bounded, sync.cuh's
//                          nvshmem_wait_ge per word), then meets; false if any wait ran out
//
// Only for kernels built through the NVSHMEM toolchain path (sources named nvshmem_*.cu).
#pragma once

#include "fluxrt/sync.cuh"

#ifndef FLUXRT_WITH_NVSHMEM
#error "fluxrt/remote.cuh needs the NVSHMEM device API: build the kernel as kernels/comm/nvshmem_*.cu"
#endif

namespace fluxrt {
namespace remote {

constexpr u32 kMaxRailNodes = 64;   // members of one rail (ranks with the same local index, one per node)
constexpr u32 kMaxRailBlocks = 32;  // blocks (signal words) per (source, buffer half) of a rail round

// Composed from a block put, the contract's publish and one signal rather than
// nvshmemx_putmem_signal_nbi_block: over the P2P transport that call copies with every thread, meets, and
// fences in thread 0 alone before the signal, and one thread's fence did not order the other threads'
// NVLink stores on 4x H200 (sync.cuh). Here every thread fences its own stores (block_publish), then
// nvshmem_fence orders the put before the signal on every transport (IB: same PE, delivery order).
__device__ __forceinline__ void put_signal_nbi_block(void* dst, const void* src, u64 bytes, u64* sig, u64 value,
                                                     int pe) {
    nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
    block_publish();
    if (threadIdx.x == 0) {
        nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sig), value, NVSHMEM_SIGNAL_SET, pe);
    }
}

__device__ __forceinline__ void put_nbi_block(void* dst, const void* src, u64 bytes, int pe) {
    nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
}

__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

// Threads take words i = threadIdx.x, + blockDim.x, ... < n; sig_of(i) is word i, peer_of(i) the rank named
// when it never comes. nvshmem_wait_ge fences after its acquire, so after the meeting every thread of the
// block may read what the signals guard.
template <class SigOf, class PeerOf>
__device__ inline bool wait_signals(const Watch& w, u32 n, SigOf sig_of, PeerOf peer_of, u64 target) {
    int ok = 1;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x)
        if (ok && !nvshmem_wait_ge(sig_of(i), target, w, peer_of(i))) ok = 0;
    return __syncthreads_and(ok) != 0;
}

}  // namespace remote
}  // namespace fluxrt
