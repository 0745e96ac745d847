// fluxrt device primitives for kernels that touch peers. kernels/comm/collectives.cu keeps block-scoped
// variants of put/signal/wait (copy_block, signal_peers, wait_peers) with its own fence placement: a
// change to the ordering here must be made there too.
//
//   put      16-byte vector stores from this GPU into a peer's symmetric buffer (NVLink, SM-driven)
//   signal   release a flag at system scope (set or add), after the data it guards
//   wait     acquire-spin on a local flag, bounded in time; on expiry record an ErrorRecord and return false
//   barrier  one block per rank meets every peer through a symmetric pad of epoch words
//
// Memory-ordering contract (DESIGN.md):
//   producer: data stores -> fence.acq_rel.sys -> st.release.sys / red.release.sys.add of the flag
//   consumer: ld.acquire.sys of the flag -> data loads (plus fence.proxy.async before TMA reads)
// Flags are never reset: every call compares against an epoch that only grows.
//
// Compiled with NVRTC (no standard library): only builtin integer types are used.
#pragma once

#ifdef FLUXRT_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace fluxrt {

typedef unsigned long long u64;
typedef unsigned int u32;

// ---------------------------------------------------------------------------------------------
// Error record: lives in host-mapped pinned memory so the host can read it without a device sync.
// The first waiter that times out claims it (status 0 -> 1), fills it, then publishes status 2.
// Layout mirrored by fluxrt/errors.py (ERROR_RECORD_WORDS).
struct ErrorRecord {
    u64 status;    // 0 ok, 1 being written, 2 timeout recorded
    u64 op;        // op id registered on the host (fluxrt.errors.op_id)
    u64 rank;      // rank that waited
    u64 peer;      // peer whose signal never came (or ~0ull when unknown)
    u64 expected;  // flag value waited for
    u64 observed;  // last value seen
};

constexpr u64 kNoPeer = ~0ull;
constexpr u32 kTimeCheckInterval = 64;  // spins between %globaltimer reads (a read costs ~100 ns)
// Time between reads of the error record, which lives in host memory: a read crosses PCIe, and
// thousands of waiting threads reading it every few spins queue behind each other for milliseconds
// (seen on 4x H200 with LL rounds, where every thread waits on its own line).
constexpr u64 kErrorCheckNs = 1ull << 20;  // ~1 ms

// ---------------------------------------------------------------------------------------------
// 16-bit floats -> fp32, for the reductions (collectives, GEMM+ReduceScatter's reduce kernel and hook 3).
__device__ __forceinline__ float bf16_to_f32(unsigned short v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ float f16_to_f32(unsigned short v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
// Element 0 (low half) and element 1 (high half) of a packed pair of bfloat16 (kBf16) or float16.
template <bool kBf16>
__device__ __forceinline__ float pair_lo(u32 v) {
    return kBf16 ? bf16_to_f32((unsigned short)(v & 0xFFFFu)) : f16_to_f32((unsigned short)(v & 0xFFFFu));
}
template <bool kBf16>
__device__ __forceinline__ float pair_hi(u32 v) {
    return kBf16 ? __uint_as_float(v & 0xFFFF0000u) : f16_to_f32((unsigned short)(v >> 16));
}

// ---------------------------------------------------------------------------------------------
// Scalar memory-model building blocks (PTX ISA 8.x, sm_70+).
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys_add(u64* p, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Orders generic-proxy accesses (the flag acquire) before async-proxy ones (TMA loads of the data).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------------------------
// Error reporting.
__device__ __forceinline__ bool error_raised(const ErrorRecord* err) {
    return ld_relaxed_sys(&err->status) != 0;
}
__device__ inline void raise_timeout(ErrorRecord* err, u32 op, u32 rank, u64 peer, u64 expected,
                                     u64 observed) {
    if (atomicCAS(&err->status, 0ull, 1ull) != 0ull) return;  // someone else reported first
    err->op = op;
    err->rank = rank;
    err->peer = peer;
    err->expected = expected;
    err->observed = observed;
    fence_acq_rel_sys();  // the fields above become visible to the host before the status word
    st_relaxed_sys(&err->status, 2ull);
}

// The bound of one spin-wait: construct it when the first poll failed, call expired() after every
// further failed poll. It reads the clock every kTimeCheckInterval spins; it is expired after
// timeout_ns (the timeout is then recorded with `observed`), or once another waiter has reported an
// error (no point waiting out a second bound; checked about every kErrorCheckNs).
struct SpinBound {
    u64 start, next_error_check;
    u32 spins;
    __device__ __forceinline__ SpinBound()
        : start(globaltimer_ns()), next_error_check(start + kErrorCheckNs), spins(0) {}
    __device__ __forceinline__ bool expired(ErrorRecord* err, u64 timeout_ns, u32 op, u32 rank, u64 peer,
                                            u64 expected, u64 observed) {
        if (++spins % kTimeCheckInterval != 0) return false;
        const u64 now = globaltimer_ns();
        if (now - start > timeout_ns) {
            raise_timeout(err, op, rank, peer, expected, observed);
            return true;
        }
        if (now >= next_error_check) {
            next_error_check = now + kErrorCheckNs;
            return error_raised(err);
        }
        return false;
    }
};

// Spin until *flag >= target (acquire, system scope). Returns false after timeout_ns, or soon after
// another waiter has reported an error.
__device__ inline bool wait_ge(const u64* flag, u64 target, u64 timeout_ns, ErrorRecord* err,
                               u32 op, u32 rank, u64 peer) {
    u64 v = ld_acquire_sys(flag);
    if (v >= target) return true;
    SpinBound bound;
    for (;;) {
        v = ld_acquire_sys(flag);
        if (v >= target) return true;
        if (bound.expired(err, timeout_ns, op, rank, peer, target, v)) return false;
    }
}

// ---------------------------------------------------------------------------------------------
// Signals. Call from one thread after the data it guards has been written. Data written by other
// threads needs each writer's own fence_acq_rel_sys() before the __syncthreads() that precedes this.
__device__ __forceinline__ void signal_set(u64* flag, u64 value) {
    fence_acq_rel_sys();  // cumulative: every write this thread has observed is ordered before the flag
    st_release_sys(flag, value);
}
__device__ __forceinline__ void signal_add(u64* flag, u64 value) {
    fence_acq_rel_sys();
    red_release_sys_add(flag, value);
}

// Grid-wide completion: each block arrives on a local counter; the last one to arrive releases the
// (remote) flag. The counter is reset by that last block, so the next launch on the stream starts at 0.
// Call with all threads of the block.
__device__ inline void grid_arrive_and_signal(u32* counter, u64* flag, u64 value, bool add) {
    // Every thread fences its own (peer) stores: thread 0's fence alone did not order the other
    // threads' NVLink stores before the flag (seen on 4x H200: the peer read poison after the flag).
    fence_acq_rel_sys();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 arrived = atomicAdd(counter, 1u) + 1u;
        if (arrived == gridDim.x * gridDim.y * gridDim.z) {
            __threadfence_system();  // acquire side: the other blocks' fenced stores are visible here
            *counter = 0u;
            if (add) signal_add(flag, value); else signal_set(flag, value);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Put: copy `bytes` from src (local) to dst (a peer pointer) with the threads of the whole grid.
// 16-byte vectors when both pointers share 16-byte alignment; bytes otherwise, and for the tail.
__device__ inline void put_grid(char* __restrict__ dst, const char* __restrict__ src, u64 bytes) {
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 nthreads = (u64)gridDim.x * blockDim.x;
    u64 head = 0;
    if (((reinterpret_cast<u64>(dst) ^ reinterpret_cast<u64>(src)) & 15ull) == 0) {
        head = (16ull - (reinterpret_cast<u64>(dst) & 15ull)) & 15ull;
        if (head > bytes) head = bytes;
        const u64 nvec = (bytes - head) / 16ull;
        const uint4* s = reinterpret_cast<const uint4*>(src + head);
        uint4* d = reinterpret_cast<uint4*>(dst + head);
        constexpr int kUnroll = 4;  // four 16-byte loads in flight per thread before the first store
        u64 i = tid;
        for (; i + (kUnroll - 1) * nthreads < nvec; i += kUnroll * nthreads) {
            uint4 r[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) r[u] = __ldg(s + i + u * nthreads);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) d[i + u * nthreads] = r[u];
        }
        for (; i < nvec; i += nthreads) d[i] = __ldg(s + i);
        const u64 tail_start = head + nvec * 16ull;
        for (u64 b = tail_start + tid; b < bytes; b += nthreads) dst[b] = src[b];
        for (u64 b = tid; b < head; b += nthreads) dst[b] = src[b];
    } else {
        for (u64 b = tid; b < bytes; b += nthreads) dst[b] = src[b];
    }
}

// ---------------------------------------------------------------------------------------------
// Barrier across ranks, executed by one block (blockDim.x >= world). pad is this rank's symmetric
// array of `world` epoch words; peer_pads[p] points at rank p's copy of it. Returns false on timeout.
__device__ inline bool barrier_block(u64* const* peer_pads, const u64* pad, u32 rank, u32 world,
                                     u64 epoch, u64 timeout_ns, ErrorRecord* err, u32 op) {
    fence_acq_rel_sys();  // each thread's prior (peer) writes before any release below
    __syncthreads();
    __shared__ int ok;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const u32 p = threadIdx.x;
    if (p < world) {
        signal_set(peer_pads[p] + rank, epoch);
        if (!wait_ge(pad + p, epoch, timeout_ns, err, op, rank, p)) ok = 0;
    }
    __syncthreads();
    return ok != 0;
}

#ifdef FLUXRT_WITH_NVSHMEM
// ---------------------------------------------------------------------------------------------
// NVSHMEM-API equivalents, for transports NVLink pointers cannot reach. Same bounded-wait contract.
__device__ __forceinline__ void nvshmem_put_signal_block(void* dst, const void* src, u64 bytes,
                                                         u64* sig, u64 value, int pe) {
    nvshmemx_putmem_signal_block(dst, src, bytes, reinterpret_cast<uint64_t*>(sig), value,
                                 NVSHMEM_SIGNAL_SET, pe);
}
__device__ inline bool nvshmem_wait_ge(u64* sig, u64 target, u64 timeout_ns, ErrorRecord* err,
                                       u32 op, u32 rank, u64 peer) {
    SpinBound bound;
    for (;;) {
        const u64 v = nvshmem_signal_fetch(reinterpret_cast<uint64_t*>(sig));
        if (v >= target) {
            fence_acq_rel_sys();
            return true;
        }
        if (bound.expired(err, timeout_ns, op, rank, peer, target, v)) return false;
    }
}
#endif

}  // namespace fluxrt
