// Kernels of the fused tensor-parallel ops (fluxrt/ops): the small stream-ordered signal and wait
// steps of AllGather+GEMM, and the owner-side reduction of GEMM+ReduceScatter.
//
//   fluxrt_ops_signal_list  release a list of (local or peer) flags to one value
//   fluxrt_ops_wait_list    bounded acquire-wait until every flag of a list reaches a target
//   fluxrt_ops_delay        one thread spins for a given time (benchmarks, slow-peer tests)
//   fluxrt_rs_reduce        per tile: wait for every source's partial, sum them in fixed source order
//                           in fp32, store this rank's slice of the result
//
// Compile-time configuration of fluxrt_rs_reduce (-D, set by fluxrt/ops/gemm_rs.py):
//   FLUXRT_RS_PARTIAL  element type of the partials: 0 bf16, 1 fp16, 2 fp32      default 0
//   FLUXRT_RS_OUT      element type of the result:   0 bf16, 1 fp16              default 0
#include "fluxrt/comm.cuh"

#ifndef FLUXRT_RS_PARTIAL
#define FLUXRT_RS_PARTIAL 0
#endif
#ifndef FLUXRT_RS_OUT
#define FLUXRT_RS_OUT 0
#endif

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;

namespace {

constexpr int kVecElems = 8;                                   // elements per 16-byte output vector
constexpr int kPartialBytes = FLUXRT_RS_PARTIAL == 2 ? 4 : 2;   // bytes per partial element
constexpr int kPartialVecs = kVecElems * kPartialBytes / 16;    // 16-byte loads per 8 partial elements
constexpr int kMaxWorld = 64;                                   // flags checked per tile (one thread each)
constexpr u32 kLoadBatch = 4;                                   // sources whose partials are loaded together

__device__ __forceinline__ u32 pack_out(float lo, float hi) {
    u32 r;
#if FLUXRT_RS_OUT == 0
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// 8 partial elements (16 or 32 bytes). Plain (coherent) loads: the data was written by peers during
// this kernel's lifetime, so the non-coherent __ldg path is not allowed.
struct Partial8 {
    uint4 v[kPartialVecs];
};
__device__ __forceinline__ Partial8 load8(const char* p) {
    Partial8 r;
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) r.v[i] = reinterpret_cast<const uint4*>(p)[i];
    return r;
}

// acc[0..7] += x, element by element in fp32.
__device__ __forceinline__ void accumulate8(float (&acc)[kVecElems], const Partial8& x) {
#if FLUXRT_RS_PARTIAL == 2
#pragma unroll
    for (int i = 0; i < kPartialVecs; ++i) {
        acc[4 * i + 0] += __uint_as_float(x.v[i].x);
        acc[4 * i + 1] += __uint_as_float(x.v[i].y);
        acc[4 * i + 2] += __uint_as_float(x.v[i].z);
        acc[4 * i + 3] += __uint_as_float(x.v[i].w);
    }
#else
    const u32 w[4] = {x.v[0].x, x.v[0].y, x.v[0].z, x.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += fluxrt::pair_lo<FLUXRT_RS_PARTIAL == 0>(w[i]);
        acc[2 * i + 1] += fluxrt::pair_hi<FLUXRT_RS_PARTIAL == 0>(w[i]);
    }
#endif
}

}  // namespace

extern "C" {

// Thread i releases *ptrs[i] = value. Launched after the data the flags guard, on the same stream:
// the kernel boundary completes that data; signal_set adds the system-scope fence and release.
__global__ void fluxrt_ops_signal_list(u64* const* ptrs, u32 count, u64 value) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) fluxrt::signal_set(ptrs[i], value);
}

// Thread i waits (acquire.sys, bounded) until *ptrs[i] >= target; peers[i] is named on timeout.
// Work after this kernel on the stream observes what the signallers wrote before their release.
__global__ void fluxrt_ops_wait_list(const u64* const* ptrs, const u64* peers, u32 count, u64 target,
                                     u64 timeout_ns, ErrorRecord* err, u32 op, u32 rank) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) fluxrt::wait_ge(ptrs[i], target, timeout_ns, err, op, rank, peers[i]);
}

// One thread spins for `ns` nanoseconds of %globaltimer: holds a stream back so that the host can enqueue
// a whole op behind it before the GPU starts (benchmarks), or makes one rank late (slow-peer tests).
__global__ void fluxrt_ops_delay(u64 ns) {
    const u64 t0 = fluxrt::globaltimer_ns();
    while (fluxrt::globaltimer_ns() - t0 < ns) {
    }
}

// Owner-side reduction of GEMM+ReduceScatter.
//   partials   this call's receive buffer: source s's partial of this rank's rows starts at
//              partials + s * src_stride_bytes, row-major with `ld` elements per row
//   flags      this call's flags: source s's flag of tile (m, n) at flags[s * flag_stride + m * n_tiles + n]
//              (released to >= epoch by the source's GEMM epilogue after the tile's stores), or with
//              flag_group_n > 0 at flags[s * flag_stride + n / flag_group_n]: one flag per group of
//              flag_group_n tile columns, released after the copy engine delivered the group's partial
//   skip_source  a source whose partial is already complete in stream order (this rank's own, written
//              by the GEMM before this kernel): no flag; >= world for none
//   out        [rows, cols] result, `out_ld` elements per row
// One block per tile at a time (persistent over tiles); tile = block_m x block_n, the GEMM's tile.
__global__ void fluxrt_rs_reduce(const char* partials, long long src_stride_bytes, long long ld,
                                 char* out, long long out_ld, const u64* flags, long long flag_stride,
                                 int flag_group_n, u32 skip_source, int rows, int cols, int block_m, int block_n,
                                 int n_tiles, u32 world, u64 epoch, u64 timeout_ns, ErrorRecord* err, u32 op,
                                 u32 rank) {
    const int m_tiles = (rows + block_m - 1) / block_m;
    const int total = m_tiles * n_tiles;
    const int vecs_per_row = block_n / kVecElems;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const int m_tile = t / n_tiles, n_tile = t % n_tiles;
        const long long tile_flag = flag_group_n > 0 ? n_tile / flag_group_n : (long long)m_tile * n_tiles + n_tile;
        // Stage 1, wait: one thread per source spins on that source's flag (bounded; on timeout the
        // error record names the source and the tile is summed from whatever is there).
        if (threadIdx.x < world && threadIdx.x < kMaxWorld && threadIdx.x != skip_source)
            fluxrt::wait_ge(flags + threadIdx.x * flag_stride + tile_flag, epoch, timeout_ns, err, op, rank,
                            threadIdx.x);
        __syncthreads();
        // Every reader acquires the flags itself (they are already >= epoch, so no spin): its own
        // acquire orders its partial loads after the sources' releases, independent of the barrier.
        for (u32 s = 0; s < world; ++s)
            if (s != skip_source) (void)fluxrt::ld_acquire_sys(flags + s * flag_stride + tile_flag);
        // Stage 2, reduce: sources in fixed order 0..world-1 in fp32, so the result is bitwise the
        // same whatever order the partials arrived in.
        for (int v = threadIdx.x; v < block_m * vecs_per_row; v += blockDim.x) {
            const int row = m_tile * block_m + v / vecs_per_row;
            const int col = n_tile * block_n + (v % vecs_per_row) * kVecElems;
            if (row >= rows || col >= cols) continue;
            float acc[kVecElems];
#pragma unroll
            for (int e = 0; e < kVecElems; ++e) acc[e] = 0.f;
            const char* src = partials + ((long long)row * ld + col) * kPartialBytes;
            for (u32 s0 = 0; s0 < world; s0 += kLoadBatch) {
                // kLoadBatch sources' loads in flight at once, then the adds in source order.
                Partial8 x[kLoadBatch];
#pragma unroll
                for (u32 j = 0; j < kLoadBatch; ++j)
                    if (s0 + j < world) x[j] = load8(src + (s0 + j) * src_stride_bytes);
#pragma unroll
                for (u32 j = 0; j < kLoadBatch; ++j)
                    if (s0 + j < world) accumulate8(acc, x[j]);
            }
            uint4 o;
            o.x = pack_out(acc[0], acc[1]);
            o.y = pack_out(acc[2], acc[3]);
            o.z = pack_out(acc[4], acc[5]);
            o.w = pack_out(acc[6], acc[7]);
            *reinterpret_cast<uint4*>(out + ((long long)row * out_ld + col) * 2) = o;
        }
        __syncthreads();  // the flag-waiting threads of the next tile start after this tile's reads
    }
}

}  // extern "C"
