// Hopper (sm_90a) building blocks for the fluxrt GEMM: mbarriers, TMA, wgmma control, descriptors.
//
// Each wrapper is one PTX instruction (or a short fixed sequence) with the memory-ordering role it plays
// spelled out, so the kernel reads as a list of named pipeline steps. Shared-memory addresses are
// 32-bit `shared::cta` addresses (from __cvta_generic_to_shared); tensor maps are passed by the generic
// address of a __grid_constant__ kernel parameter.
#pragma once

#include <fluxrt/types.cuh>

namespace fluxrt_sm90 {

using fluxrt::u32;
using fluxrt::u64;

// A CUtensorMap as the kernel sees it: 128 opaque bytes, 64-byte aligned (cuda.h is not needed).
struct __align__(64) TmaDesc {
    u64 words[16];
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------------
// mbarrier (shared-memory transaction barrier), phase-parity protocol:
//   a barrier completes a phase when `count` arrivals happened and the expected transaction bytes
//   (TMA) landed; waiters poll the parity bit of the phase they wait for.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the mbarrier.init writes visible to the async proxy (TMA complete_tx) and to other threads.
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arrive (release.cta semantics: this thread's prior shared-memory writes are visible to the waiter).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive and announce `bytes` of TMA traffic that must land before the phase can complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// Arrive on the mbarrier at the same offset in cluster CTA `cta` (possibly this one). Default semantics
// (release.cta): the only reads to order are the consumers' wgmma reads of the stage, which
// wgmma.wait_group has already completed, so no cluster-scope release is needed. A .release.cluster
// arrive costs the issuing thread a cluster-wide fence per K block, and that thread also issues the
// warpgroup's next wgmma: 2-CTA clusters ran at ~470 TFLOP/s with it, ~690 without (8192^3, H200).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(bar), "r"(cta)
        : "memory");
}
// Wait until the phase with parity `parity` has completed (acquire.cta: the data it guards -- TMA bytes
// or other threads' shared-memory writes -- is visible after this returns). try_wait suspends in hardware
// for a bounded time per call; intra-CTA barriers only, so the loop ends as long as the protocol is kept.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// ---------------------------------------------------------------------------------------------
// TMA (cp.async.bulk.tensor): async-proxy copies between global memory and shared memory.
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(desc)) : "memory");
}
// Global -> shared, box at element coordinates (x = innermost, y); completes `bytes` on mbarrier `bar`.
// Out-of-bounds elements of the box are zero-filled (and still counted in the transaction bytes).
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* desc, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<u64>(desc)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// Multicast load: the box lands at the same shared-memory offset `dst` in every CTA of the cluster named
// in `cta_mask`, and each of them gets the complete_tx of its bytes on its own mbarrier at offset `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TmaDesc* desc, int x, int y, u32 bar,
                                                      unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(dst), "l"(reinterpret_cast<u64>(desc)), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
        : "memory");
}
// Shared -> global, box at (x, y); elements outside the tensor are clipped (not written).
__device__ __forceinline__ void tma_store_2d(const TmaDesc* desc, u32 src, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(reinterpret_cast<u64>(desc)), "r"(x), "r"(y), "r"(src)
                 : "memory");
}
// 3-D forms, box at (x, y, z) (a box one element deep in z): the same fill and clipping per dimension.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* desc, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(reinterpret_cast<u64>(desc)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_store_3d(const TmaDesc* desc, u32 src, int x, int y, int z) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];"
                 ::"l"(reinterpret_cast<u64>(desc)), "r"(x), "r"(y), "r"(z), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until every committed store has finished READING shared memory (the buffer may be rewritten).
__device__ __forceinline__ void bulk_wait_read_all() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Wait until every committed store has completed (its writes are performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// 4 bytes of shared memory at a shared::cta address (the grouped GEMM's group table). Volatile: read again at
// every use instead of held in a register across the main loop.
__device__ __forceinline__ int ld_shared_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
// 16 bytes of shared memory at a shared::cta address (the grouped storer's row-masked stores read C staging).
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
// Generic-proxy shared-memory writes (st.shared) -> visible to async-proxy reads (TMA store, wgmma).
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma control.
// wgmma.fence: orders this warpgroup's prior register writes (accumulators) before wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Closes the group of wgmma.mma_async issued since the last commit.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are still in flight (their smem reads and register writes done).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma window.
template <int R>
__device__ __forceinline__ void reg_fence(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Register budget per warpgroup role (setmaxnreg: all warps of the warpgroup execute it).
template <int N>
__device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Thread block clusters: this CTA's rank in its cluster, and a barrier over every thread of the cluster
// (release/acquire: shared-memory writes and mbarrier inits before it are visible to the peers after it).
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));   // constant for the CTA's life: not volatile, so it is hoisted
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Bulk prefetch of `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2; nothing to wait for.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// Loads cached in L2 only (ld.global.cg), 4 and 16 bytes: for data other agents wrote during the kernel,
// read once.
// The intrinsic, not asm: the compiler keeps it after an acquire (a memory clobber) yet may batch a run
// of them before their first use.
__device__ __forceinline__ u32 ld_cg_u32(const void* p) { return __ldcg(reinterpret_cast<const unsigned int*>(p)); }
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// Named barrier among `threads` threads (ids 1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_bar_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrive on a named barrier without waiting (the waiters bar.sync it; `threads` counts both sides).
__device__ __forceinline__ void named_bar_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// bar.sync with an AND over the threads' predicates (bar.red.and.pred): the named barrier and a vote.
__device__ __forceinline__ bool named_bar_and(u32 id, u32 threads, bool pred) {
    u32 all;
    asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tbar.red.and.pred q, %2, %3, p;\n\t"
                 "selp.u32 %0, 1, 0, q;\n\t}"
                 : "=r"(all) : "r"((u32)pred), "r"(id), "r"(threads) : "memory");
    return all != 0;
}

// ---------------------------------------------------------------------------------------------
// wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), 128-byte swizzle:
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 62-63  swizzle mode (1 = 128B)
// Tiles are 1024-byte aligned (one swizzle atom = 8 rows x 128 bytes), so the base-offset field is 0.
constexpr u32 kSwizzleBytes = 128;            // one swizzled row
constexpr u32 kSwizzleAtomBytes = 8 * 128;    // 8 rows x 128 B

__device__ __forceinline__ u64 make_desc(u32 smem, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = 0;
    d |= (u64)((smem & 0x3FFFF) >> 4);
    d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;  // 128B swizzle
    return d;
}
// The start-address field of a descriptor `bytes` further on (an offset within one tile of the same swizzle).
__device__ __forceinline__ constexpr u64 desc_step(u32 bytes) { return (u64)(bytes >> 4); }
// K-major operand (rows of 64 16-bit K elements = 128 B): 8-row groups are 1024 B apart (SBO);
// LBO is unused with 128B swizzle. Step k16 inside the 64-wide K block by adding 32 B to the start.
__device__ __forceinline__ u64 desc_kmajor(u32 smem) { return make_desc(smem, 16, kSwizzleAtomBytes); }
// MN-major operand stored as [MN/64 atoms][K rows][64 MN elements]: atoms along MN are LBO apart,
// 8-row K groups are 1024 B apart (SBO). Step k16 by adding 16 rows * 128 B = 2048 B.
__device__ __forceinline__ u64 desc_mnmajor(u32 smem, u32 mn_atom_stride_bytes) {
    return make_desc(smem, mn_atom_stride_bytes, kSwizzleAtomBytes);
}

}  // namespace fluxrt_sm90
