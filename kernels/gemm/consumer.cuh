// Consumer (math) warpgroups: wgmma over the smem ring, then the epilogue's consumer side.
#pragma once

#include "../gemm/config.cuh"
#include "../gemm/scheduler.cuh"
#include "../gemm/wgmma_ops.cuh"

namespace fluxrt_sm90 {

// wgmma dispatch for the configured N and input type.
template <int N, int IN, int MN>
struct Mma;
#define FLUXRT_GEMM_MMA(NN, IN_ID, FN)                                                          \
    template <int MN>                                                                           \
    struct Mma<NN, IN_ID, MN> {                                                                 \
        static __device__ __forceinline__ void run(float (&d)[NN / 2], u64 a, u64 b, int acc) { \
            FN<MN>(d, a, b, acc);                                                               \
        }                                                                                       \
    };
FLUXRT_GEMM_MMA(64, 0, wgmma_m64n64k16_bf16)
FLUXRT_GEMM_MMA(128, 0, wgmma_m64n128k16_bf16)
FLUXRT_GEMM_MMA(192, 0, wgmma_m64n192k16_bf16)
FLUXRT_GEMM_MMA(256, 0, wgmma_m64n256k16_bf16)
FLUXRT_GEMM_MMA(64, 1, wgmma_m64n64k16_f16)
FLUXRT_GEMM_MMA(128, 1, wgmma_m64n128k16_f16)
FLUXRT_GEMM_MMA(192, 1, wgmma_m64n192k16_f16)
FLUXRT_GEMM_MMA(256, 1, wgmma_m64n256k16_f16)
#undef FLUXRT_GEMM_MMA
using TileMma = Mma<kBN, FLUXRT_GEMM_IN, kBKMajor ? 0 : 1>;

// Stage s of the ring is free again: every consumer warpgroup of every CTA of the cluster arrives,
// because the next TMA into stage s (B multicast) writes the shared memory of all of them. Called by
// every thread of a consumer warpgroup; thread c arrives on CTA c's barrier (one arrive per thread, in
// parallel, so no thread serialises remote arrives before the next wgmma).
__device__ __forceinline__ void release_stage(u32 bar_empty, int tid) {
    if constexpr (kCluster == 1) {
        if (tid == 0) mbar_arrive(bar_empty);
    } else {
        if (tid < kCluster) mbar_arrive_cluster(bar_empty, (u32)tid);
    }
}

// The smem and barriers a consumer warpgroup works with.
struct ConsumerSmem {
    u32 smem;             // 1024-byte aligned base (shared::cta address)
    char* generic;        // the same base, generic address (C staging writes)
    u32 bars_full, bars_empty;
    u32 bar_c_full, bar_c_empty;   // the pair of this consumer's storer turn (c_turn_of(wg))
};

// One consumer warpgroup computes rows [64 * wg, 64 * wg + 64) of each tile of the schedule, then hands
// the accumulators to the epilogue (Epilogue::store), which the mainloop calls back once per K block
// (Epilogue::after_k_block, for work that overlaps the MMAs).
template <class Epilogue>
__device__ __forceinline__ void run_consumer(const Schedule& sched, int K, int wg, const ConsumerSmem& sm,
                                             Epilogue& epilogue) {
    const int tid = threadIdx.x & 127;  // thread within the warpgroup
    const int k_blocks = (K + kBK - 1) / kBK;
    float acc[kAccRegs];
    int stage = 0;
    u32 phase = 0;
    typename Epilogue::ConsumerState es = epilogue.consumer_state(wg);
    const u32 a_rows_offset = (u32)wg * kRowsPerConsumer * kBK * kInBytes;  // 8 KiB per consumer
    for (int t = sched.first; t < sched.total; t += sched.stride) {
        int prev_stage = 0;
        const typename Epilogue::Tile tile = epilogue.begin_tile(sched, t);
        for (int kb = 0; kb < k_blocks; ++kb) {
            mbar_wait(sm.bars_full + 8 * stage, phase);  // acquire: TMA bytes of this stage have landed
            const u32 a_base = sm.smem + kOffA + stage * kTileABytes + a_rows_offset;
            const u32 b_base = sm.smem + kOffB + stage * kTileBBytes;
            wgmma_fence();  // accumulator registers written before (epilogue reads, previous MMAs) -> wgmma
#pragma unroll
            for (int kk = 0; kk < kBK / kWgmmaK; ++kk) {
                const u64 da = desc_kmajor(a_base + kk * kWgmmaK * kInBytes);
                const u64 db = kBKMajor ? desc_kmajor(b_base + kk * kWgmmaK * kInBytes)
                                        : desc_mnmajor(b_base + kk * kWgmmaK * 128u, kBAtomBytes);
                TileMma::run(acc, da, db, (kb > 0 || kk > 0) ? 1 : 0);  // first MMA of a tile: D = A*B
            }
            wgmma_commit();
            epilogue.after_k_block(tile, kb, k_blocks, wg, tid);
            // Keep one group in flight: when the previous K block's group has retired, its stage's
            // smem is no longer read by the tensor cores and goes back to the loader.
            if (kb > 0) {
                wgmma_wait<1>();
                release_stage(sm.bars_empty + 8 * prev_stage, tid);
            }
            prev_stage = stage;
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
        wgmma_wait<0>();  // all MMAs of the tile retired: accumulators final
        reg_fence(acc);
        if (k_blocks > 0) release_stage(sm.bars_empty + 8 * prev_stage, tid);
        epilogue.store(acc, sched, t, tile, wg, tid, sm, es);
    }
    epilogue.after_tiles(sched);
}

}  // namespace fluxrt_sm90
