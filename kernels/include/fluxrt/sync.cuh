// Signal and wait between GPUs: the memory-ordering contract of fluxrt, written once, and every
// bounded spin-wait. Every kernel that raises or polls a flag uses these functions.
//
// Memory-ordering contract (docs/design.md):
//   producer  data stores -> fence.acq_rel.sys -> st.release.sys / red.release.sys.add of the flag.
//             Data written by several threads of a block: each writer fences its own stores, the block
//             meets (bar.sync), then one thread releases (block_publish, signal_peers). A thread's own
//             fence is needed: one thread's fence did not order the other threads' NVLink stores
//             (seen on 4x H200: the peer read poison after the flag).
//   consumer  ld.acquire.sys of the flag -> data loads. A block whose waiting threads are not its
//             readers: each waiter fences after its acquire, then the block meets (acquire_for_block);
//             readers that are not a whole block acquire every flag themselves once it is up
//             (wait_sources, acquire_sources). Data read by TMA after a flag poll also needs
//             fence.proxy.async after the acquire.
//   scope     .sys by default; flags and data that never leave one GPU (stream-K's partials) may pass
//             the Gpu scope type to signal_add, wait_ge and acquire_for_block (the same steps at .gpu, no
//             wait for system visibility). The ErrorRecord stays .sys whatever the scope.
//   epochs    flags are never reset: every wait compares with >= against a value that only grows.
//   bound     every spin is bounded in time (%globaltimer); on expiry the first waiter fills the
//             ErrorRecord (op, rank, peer, expected, observed) and waits return false, so the kernel
//             ends instead of hanging and the host raises an error naming op, rank and peer.
//
// Compiled with NVRTC (no standard library): only builtin integer types are used.
#pragma once

#include "fluxrt/types.cuh"

#ifdef FLUXRT_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace fluxrt {

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

// What a bounded wait reports on expiry, besides the peer and the values: bound, record, op, rank.
struct Watch {
    u64 timeout_ns;
    ErrorRecord* err;
    u32 op, rank;
};

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
// The scope a signal or wait is ordered at, as a type: Sys (the default; peers on other GPUs, the host) or
// Gpu, for flags whose writers and readers all run on this GPU and whose data never leaves it (stream-K's
// partials): a .sys fence also waits for the GPU's writes to become visible to the whole system.
struct Sys {
    static __device__ __forceinline__ u64 ld_acquire(const u64* p) { return ld_acquire_sys(p); }
    static __device__ __forceinline__ void red_release_add(u64* p, u64 v) { red_release_sys_add(p, v); }
    static __device__ __forceinline__ void st_relaxed(u64* p, u64 v) { st_relaxed_sys(p, v); }
    static __device__ __forceinline__ void fence_acq_rel() { fence_acq_rel_sys(); }
};
struct Gpu {
    static __device__ __forceinline__ u64 ld_acquire(const u64* p) {
        u64 v;
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
    }
    static __device__ __forceinline__ void red_release_add(u64* p, u64 v) {
        asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    }
    static __device__ __forceinline__ void st_relaxed(u64* p, u64 v) {
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    }
    static __device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
};

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
    __device__ __forceinline__ bool expired(const Watch& w, u64 peer, u64 expected, u64 observed) {
        return expired(w.err, w.timeout_ns, w.op, w.rank, peer, expected, observed);
    }
};

// Spin until *flag >= target (acquire, at Scope: system by default). Returns false after timeout_ns, or soon after
// another waiter has reported an error.
template <class Scope = Sys>
__device__ inline bool wait_ge(const u64* flag, u64 target, u64 timeout_ns, ErrorRecord* err,
                               u32 op, u32 rank, u64 peer) {
    u64 v = Scope::ld_acquire(flag);
    if (v >= target) return true;
    SpinBound bound;
    for (;;) {
        v = Scope::ld_acquire(flag);
        if (v >= target) return true;
        if (bound.expired(err, timeout_ns, op, rank, peer, target, v)) return false;
    }
}
template <class Scope = Sys>
__device__ __forceinline__ bool wait_ge(const u64* flag, u64 target, const Watch& w, u64 peer) {
    return wait_ge<Scope>(flag, target, w.timeout_ns, w.err, w.op, w.rank, peer);
}

// ---------------------------------------------------------------------------------------------
// Signals from one thread, after the data it guards has been written (by this thread, or by threads
// that fenced before a barrier with it).
__device__ __forceinline__ void signal_set(u64* flag, u64 value) {
    fence_acq_rel_sys();  // cumulative: every write this thread has observed is ordered before the flag
    st_release_sys(flag, value);
}
template <class Scope = Sys>
__device__ __forceinline__ void signal_add(u64* flag, u64 value) {
    Scope::fence_acq_rel();
    Scope::red_release_add(flag, value);
}

// ---------------------------------------------------------------------------------------------
// Block-level signal and wait. Peer sets are predicates `in(p)`; flag_of(p) is the flag word of p.

// Every thread orders its own prior stores (and reads) before any release that follows; the block
// meets. After this, any thread of the block may release a flag guarding the block's accesses.
__device__ __forceinline__ void block_publish() {
    fence_acq_rel_sys();
    __syncthreads();
}

// Thread q releases flag_of(q) = value for every q < n with in(q). No fence: call after block_publish
// (or after anything else that ordered the guarded accesses).
template <class In, class FlagOf>
__device__ __forceinline__ void release_peers(u32 n, In in, FlagOf flag_of, u64 value) {
    for (u32 q = threadIdx.x; q < n; q += blockDim.x)
        if (in(q)) st_release_sys(flag_of(q), value);
}

// After the block's stores to (or reads of) what the flags guard: publish, then release.
template <class In, class FlagOf>
__device__ __forceinline__ void signal_peers(u32 n, In in, FlagOf flag_of, u64 value) {
    block_publish();
    release_peers(n, in, flag_of, value);
}

// One waiting thread's part of a block-level wait: the bounded acquire, then a fence, so that the
// acquire covers the whole block's later accesses once the block meets (same SM, bar.sync).
template <class Scope = Sys>
__device__ __forceinline__ bool acquire_for_block(const u64* flag, u64 target, const Watch& w, u64 peer) {
    const bool ok = wait_ge<Scope>(flag, target, w, peer);
    Scope::fence_acq_rel();
    return ok;
}

// Thread p acquires flag_of(p) >= target for every p < n with in(p); the block meets. False (for the
// whole block) if any of these waits timed out.
template <class In, class FlagOf>
__device__ __forceinline__ bool wait_peers(const Watch& w, u32 n, In in, FlagOf flag_of, u64 target) {
    int ok = 1;
    for (u32 p = threadIdx.x; p < n; p += blockDim.x)
        if (in(p) && !acquire_for_block(flag_of(p), target, w, p)) ok = 0;
    return __syncthreads_and(ok) != 0;
}

__device__ __forceinline__ bool every_peer(u32) { return true; }

// Readers that are a warp or a warpgroup (or that should not wait for a fence): lanes `lane`,
// `lane + lanes`, ... wait (bounded) for source s's flag_of(s) >= target, s < n, s != skip; the caller
// then meets its readers (bar.sync, named barrier, __syncwarp) and every reader calls acquire_sources,
// whose own acquires order its loads after the sources' releases. On timeout the record names s.
// Returns false if one of this thread's waits gave up: a caller that votes on it across the readers
// (bar.red.and, __all_sync) can poison what it would have computed from the missing source.
template <class FlagOf>
__device__ __forceinline__ bool wait_sources(const Watch& w, u32 n, u32 skip, u32 lane, u32 lanes, FlagOf flag_of,
                                             u64 target) {
    bool ok = true;
    for (u32 s = lane; s < n; s += lanes)
        if (s != skip && !wait_ge(flag_of(s), target, w, s)) ok = false;
    return ok;
}
template <class FlagOf>
__device__ __forceinline__ void acquire_sources(u32 n, u32 skip, FlagOf flag_of) {
    for (u32 s = 0; s < n; ++s)
        if (s != skip) (void)ld_acquire_sys(flag_of(s));
}

// Barrier across ranks, executed by one block (blockDim.x >= world). pad is this rank's symmetric
// array of `world` epoch words; peer_pads[p] points at rank p's copy of it. Returns false on timeout.
__device__ inline bool barrier_block(u64* const* peer_pads, const u64* pad, u32 rank, u32 world,
                                     u64 epoch, const Watch& w) {
    signal_peers(world, every_peer, [&](u32 p) { return peer_pads[p] + rank; }, epoch);
    return wait_peers(w, world, every_peer, [&](u32 p) { return pad + p; }, epoch);
}

// Grid-wide completion: each block arrives on a local counter; the last one to arrive releases the
// (remote) flag. The counter is reset by that last block, so the next launch on the stream starts at 0.
// Call with all threads of the block.
__device__ inline void grid_arrive_and_signal(u32* counter, u64* flag, u64 value, bool add) {
    block_publish();
    if (threadIdx.x == 0) {
        const u32 arrived = atomicAdd(counter, 1u) + 1u;
        if (arrived == gridDim.x * gridDim.y * gridDim.z) {
            __threadfence_system();  // acquire side: the other blocks' fenced stores are visible here
            *counter = 0u;
            if (add) signal_add(flag, value); else signal_set(flag, value);
        }
    }
}

// A warp's part of block_publish: every lane orders its own prior stores before any release that follows;
// the warp meets. After this, one lane may arrive for the warp's writes (arrive_counted).
__device__ __forceinline__ void warp_publish() {
    fence_acq_rel_sys();
    __syncwarp();
}

// Counted completion, from one thread whose group published (block_publish / warp_publish): one of `count`
// contributions, in any order, arrives on a local counter; the one that completes it resets the counter to 0
// (the next round on the stream starts at 0) and releases flag = value (signal_set's fence, after observing
// the other arrivals, orders their published stores before the flag). Returns true for that contribution.
__device__ __forceinline__ bool arrive_counted(u32* counter, u32 count, u64* flag, u64 value) {
    if (atomicAdd(counter, 1u) + 1u != count) return false;
    *counter = 0u;
    signal_set(flag, value);
    return true;
}

#ifdef FLUXRT_WITH_NVSHMEM
// ---------------------------------------------------------------------------------------------
// NVSHMEM-API equivalents, for transports NVLink pointers cannot reach. Same bounded-wait contract.
__device__ __forceinline__ void nvshmem_put_signal_block(void* dst, const void* src, u64 bytes,
                                                         u64* sig, u64 value, int pe) {
    nvshmemx_putmem_signal_block(dst, src, bytes, reinterpret_cast<uint64_t*>(sig), value,
                                 NVSHMEM_SIGNAL_SET, pe);
}
__device__ inline bool nvshmem_wait_ge(u64* sig, u64 target, const Watch& w, u64 peer) {
    SpinBound bound;
    for (;;) {
        const u64 v = nvshmem_signal_fetch(reinterpret_cast<uint64_t*>(sig));
        if (v >= target) {
            fence_acq_rel_sys();
            return true;
        }
        if (bound.expired(w, peer, target, v)) return false;
    }
}
#endif

}  // namespace fluxrt
