// The same point-to-point pattern through the NVSHMEM device API (put_signal / signal_fetch), for
// transports that NVLink peer pointers cannot reach. Built by the toolchain's NVSHMEM path.
#include "fluxrt/comm.cuh"

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;

extern "C" {

// One block moves `bytes` from src (any local memory) into dst (symmetric) on `pe`, then NVSHMEM sets
// the symmetric signal word there to `value` after the data is delivered.
__global__ void fluxrt_nvshmem_put_signal(void* dst, const void* src, u64 bytes, u64* sig, u64 value,
                                          int pe) {
    fluxrt::nvshmem_put_signal_block(dst, src, bytes, sig, value, pe);
}

// Bounded wait on a local symmetric signal word.
__global__ void fluxrt_nvshmem_wait(u64* sig, u64 target, u64 timeout_ns, ErrorRecord* err, u32 op,
                                    u32 rank, u64 peer) {
    if (threadIdx.x == 0) fluxrt::nvshmem_wait_ge(sig, target, fluxrt::Watch{timeout_ns, err, op, rank}, peer);
}

// Ping-pong through nvshmemx_signal_op, one thread each (see fluxrt_pingpong in p2p.cu).
__global__ void fluxrt_nvshmem_pingpong(u64* sig, u64 base, u32 iters, int initiator, int pe,
                                        u64 timeout_ns, ErrorRecord* err, u32 op, u32 rank,
                                        u64* elapsed_ns) {
    const fluxrt::Watch w{timeout_ns, err, op, rank};
    const u64 t0 = fluxrt::globaltimer_ns();
    for (u32 i = 1; i <= iters; ++i) {
        if (initiator) {
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sig), base + i, NVSHMEM_SIGNAL_SET, pe);
            if (!fluxrt::nvshmem_wait_ge(sig, base + i, w, pe)) return;
        } else {
            if (!fluxrt::nvshmem_wait_ge(sig, base + i, w, pe)) return;
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sig), base + i, NVSHMEM_SIGNAL_SET, pe);
        }
    }
    if (initiator) elapsed_ns[0] = fluxrt::globaltimer_ns() - t0;
}

}  // extern "C"
