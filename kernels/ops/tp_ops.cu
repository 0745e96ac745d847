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

typedef fluxrt::ElementOf<FLUXRT_RS_PARTIAL>::type Partial;
typedef fluxrt::ElementOf<FLUXRT_RS_OUT>::type Out;
constexpr u32 kVecElems = 8;                                   // elements per 16-byte output vector
constexpr u32 kPartialBytes = sizeof(Partial::T);              // bytes per partial element
constexpr u32 kPartialVecs = kVecElems / Partial::kPerVec;     // 16-byte loads per 8 partial elements
constexpr u32 kLoadBatch = 4;                                   // sources whose partials are loaded together
static_assert(sizeof(Out::T) == 2, "the result is bf16 or fp16");

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
    const fluxrt::Watch w{timeout_ns, err, op, rank};
    const int m_tiles = (rows + block_m - 1) / block_m;
    const int total = m_tiles * n_tiles;
    const int vecs_per_row = block_n / kVecElems;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const int m_tile = t / n_tiles, n_tile = t % n_tiles;
        const long long tile_flag = flag_group_n > 0 ? n_tile / flag_group_n : (long long)m_tile * n_tiles + n_tile;
        auto flag_of = [&](u32 s) { return flags + s * flag_stride + tile_flag; };
        // Stage 1, wait: one thread per source spins on that source's flag (bounded; on timeout the
        // error record names the source and the tile is written as all-ones, NaN, instead of a sum of
        // whatever was there).
        const bool waited = fluxrt::wait_sources(w, world, skip_source, threadIdx.x, blockDim.x, flag_of, epoch);
        const bool tile_ok = __syncthreads_and(waited) != 0;
        // Every reader acquires the flags itself (they are already >= epoch, so no spin): its own
        // acquire orders its partial loads after the sources' releases, independent of the barrier.
        fluxrt::acquire_sources(world, skip_source, flag_of);
        // Stage 2, reduce: sources in fixed order 0..world-1 in fp32, so the result is bitwise the
        // same whatever order the partials arrived in. Plain (coherent) loads: the data was written by
        // peers during this kernel's lifetime, so the non-coherent __ldg path is not allowed.
        for (int v = threadIdx.x; v < block_m * vecs_per_row; v += blockDim.x) {
            const int row = m_tile * block_m + v / vecs_per_row;
            const int col = n_tile * block_n + (v % vecs_per_row) * kVecElems;
            if (row >= rows || col >= cols) continue;
            float acc[kPartialVecs][Partial::kPerVec];
#pragma unroll
            for (u32 j = 0; j < kPartialVecs; ++j)
#pragma unroll
                for (u32 e = 0; e < Partial::kPerVec; ++e) acc[j][e] = 0.f;
            const char* src = partials + ((long long)row * ld + col) * kPartialBytes;
            // 16-bit partials unpacked a 32-bit word at a time: one AND for the high element, not a shift
            fluxrt::fold_sources<Partial, fluxrt::kSum, false, kPartialVecs, kLoadBatch,
                                 sizeof(typename Partial::T) == 2 ? fluxrt::kByWord : 0u>(
                acc, world, [&](u32 s, u32 j) { return reinterpret_cast<const uint4*>(src + s * src_stride_bytes)[j]; });
            auto el = [&](u32 k) { return acc[k / Partial::kPerVec][k % Partial::kPerVec]; };
            const uint4 o = make_uint4(Out::pack2(el(0), el(1)), Out::pack2(el(2), el(3)), Out::pack2(el(4), el(5)),
                                       Out::pack2(el(6), el(7)));
            *reinterpret_cast<uint4*>(out + ((long long)row * out_ld + col) * 2) =
                tile_ok ? o : make_uint4(~0u, ~0u, ~0u, ~0u);
        }
        __syncthreads();  // the flag-waiting threads of the next tile start after this tile's reads
    }
}

}  // extern "C"
