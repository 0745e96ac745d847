// Consumer (math) warpgroups: wgmma over the smem ring, then the epilogue's consumer side.
#pragma once

#include "../gemm/config.cuh"
#include "../gemm/params.cuh"
#include "../gemm/scheduler.cuh"
#include "../gemm/wgmma_ops.cuh"

namespace fluxrt_sm90 {

// wgmma dispatch for the configured N and input types (A's, B's: 0 bf16, 1 fp16, 2 e4m3, 3 e5m2).
template <int N, int IN, int INB, int MN>
struct Mma;
#define FLUXRT_GEMM_MMA(NN, IN_ID, INB_ID, FN)                                                  \
    template <int MN>                                                                           \
    struct Mma<NN, IN_ID, INB_ID, MN> {                                                         \
        static __device__ __forceinline__ void run(float (&d)[NN / 2], u64 a, u64 b, int acc) { \
            FN<MN>(d, a, b, acc);                                                               \
        }                                                                                       \
    };
#define FLUXRT_GEMM_MMA_NS(IN_ID, INB_ID, T)                    \
    FLUXRT_GEMM_MMA(64, IN_ID, INB_ID, wgmma_m64n64##T)         \
    FLUXRT_GEMM_MMA(128, IN_ID, INB_ID, wgmma_m64n128##T)       \
    FLUXRT_GEMM_MMA(192, IN_ID, INB_ID, wgmma_m64n192##T)       \
    FLUXRT_GEMM_MMA(256, IN_ID, INB_ID, wgmma_m64n256##T)
// The widths between (tiles fitted to the waves; config.cuh): from 144 for every input type, below 144 16-bit only
// (wgmma_ops.cuh has no narrower fp8 ones).
#define FLUXRT_GEMM_MMA_NS_FIT(IN_ID, INB_ID, T)              \
    FLUXRT_GEMM_MMA(144, IN_ID, INB_ID, wgmma_m64n144##T)     \
    FLUXRT_GEMM_MMA(160, IN_ID, INB_ID, wgmma_m64n160##T)     \
    FLUXRT_GEMM_MMA(176, IN_ID, INB_ID, wgmma_m64n176##T)     \
    FLUXRT_GEMM_MMA(208, IN_ID, INB_ID, wgmma_m64n208##T)     \
    FLUXRT_GEMM_MMA(224, IN_ID, INB_ID, wgmma_m64n224##T)     \
    FLUXRT_GEMM_MMA(240, IN_ID, INB_ID, wgmma_m64n240##T)
#define FLUXRT_GEMM_MMA_NS_FIT16(IN_ID, T)                    \
    FLUXRT_GEMM_MMA(80, IN_ID, IN_ID, wgmma_m64n80##T)         \
    FLUXRT_GEMM_MMA(96, IN_ID, IN_ID, wgmma_m64n96##T)         \
    FLUXRT_GEMM_MMA(112, IN_ID, IN_ID, wgmma_m64n112##T)       \
    FLUXRT_GEMM_MMA_NS_FIT(IN_ID, IN_ID, T)
FLUXRT_GEMM_MMA_NS(0, 0, k16_bf16)
FLUXRT_GEMM_MMA_NS(1, 1, k16_f16)
FLUXRT_GEMM_MMA_NS_FIT16(0, k16_bf16)
FLUXRT_GEMM_MMA_NS_FIT16(1, k16_f16)
#undef FLUXRT_GEMM_MMA_NS_FIT16
FLUXRT_GEMM_MMA_NS(2, 2, k32_e4m3_e4m3)
FLUXRT_GEMM_MMA_NS(2, 3, k32_e4m3_e5m2)
FLUXRT_GEMM_MMA_NS(3, 2, k32_e5m2_e4m3)
FLUXRT_GEMM_MMA_NS(3, 3, k32_e5m2_e5m2)
FLUXRT_GEMM_MMA_NS_FIT(2, 2, k32_e4m3_e4m3)
FLUXRT_GEMM_MMA_NS_FIT(2, 3, k32_e4m3_e5m2)
FLUXRT_GEMM_MMA_NS_FIT(3, 2, k32_e5m2_e4m3)
FLUXRT_GEMM_MMA_NS_FIT(3, 3, k32_e5m2_e5m2)
#undef FLUXRT_GEMM_MMA_NS_FIT
#undef FLUXRT_GEMM_MMA_NS
#undef FLUXRT_GEMM_MMA
using TileMma = Mma<kBN, FLUXRT_GEMM_IN, FLUXRT_GEMM_IN_B, kBKMajor ? 0 : 1>;

// Stage s of the ring is free again: the consumers arrive on the empty[s] of every CTA whose TMA writes
// this CTA's stage s (itself, the CTAs sharing its B tile, those sharing its A tile), because each of those
// writes the shared memory of all the CTAs it multicasts to. Called by every thread of a consumer warpgroup;
// thread c arrives on one writer's barrier (one arrive per thread, in parallel, so no thread serialises
// remote arrives before the next wgmma).
__device__ __forceinline__ void release_stage(u32 bar_empty, int tid) {
    if constexpr (kClusterCtas == 1) {
        if (tid == 0) mbar_arrive(bar_empty);
    } else if constexpr (kClusterN == 1) {
        if (tid < kCluster) mbar_arrive_cluster(bar_empty, (u32)tid);
    } else {
        const int rank = (int)cluster_ctarank(), m_rank = rank % kCluster, n_rank = rank / kCluster;
        if (tid < kCluster) {                     // the CTAs of this N tile (B sharers, this CTA among them)
            mbar_arrive_cluster(bar_empty, (u32)(n_rank * kCluster + tid));
        } else if (tid < kStageWriters) {         // the other CTAs of this M tile (A sharers)
            const int j = tid - kCluster;
            mbar_arrive_cluster(bar_empty, (u32)(m_rank + kCluster * (j + (j >= n_rank))));
        }
    }
}

// fp8 dequantisation (FLUXRT_GEMM_SCALE), the consumer's part. Variants, as types run_consumer takes:
//   NoScale           C = A @ B
//   TensorScale       C = sa * sb * (A @ B): one multiply per accumulator after a tile's last MMA
//   GroupTensorScale  grouped GEMM: C = sa * sb[g] * (A @ B) with B's scale of the tile's group g
//   BlockScale        C = sum over K blocks kb of sa[row, kb] * sb[n / 128, kb] * (A @ B)[kb]: each K block's
//                     MMAs start from zero in their own registers, and once they retired the consumer adds
//                     them into the fp32 accumulators with the scales (the promotion of DeepSeek-V3's FP8
//                     GEMMs: the scale changes per K block, so it cannot wait for the end of the tile).
//                     Grouped: B's scales of the tile's group (sb + g * b_group_stride).
// kPerTile: begin_tile(first row of the consumer's rows, first column, group, tid) runs before each tile.
struct NoScale {
    static constexpr bool kPerTile = false;
    __device__ __forceinline__ void begin_tile(int, int, int, int) {}
    __device__ __forceinline__ void finish(float (&)[kAccRegs]) const {}
};

struct TensorScale {
    static constexpr bool kPerTile = false;
    float s;
    static __device__ __forceinline__ TensorScale of(const ScaleArgs& a) { return TensorScale{__ldg(a.a) * __ldg(a.b)}; }
    __device__ __forceinline__ void begin_tile(int, int, int, int) {}
    __device__ __forceinline__ void finish(float (&acc)[kAccRegs]) const {
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) acc[i] *= s;
    }
};

// B's scale is loaded when the tile begins and multiplied in only after its last MMA: the load's latency
// hides behind the main loop.
struct GroupTensorScale {
    static constexpr bool kPerTile = true;
    float sa;
    const float* b;
    int b_group_stride;
    float sb;

    static __device__ __forceinline__ GroupTensorScale of(const ScaleArgs& a) {
        return GroupTensorScale{__ldg(a.a), a.b, a.b_group_stride, 0.f};
    }
    __device__ __forceinline__ void begin_tile(int, int, int group, int) {
        sb = __ldg(b + (long long)group * b_group_stride);
    }
    __device__ __forceinline__ void finish(float (&acc)[kAccRegs]) const {
        const float s = sa * sb;
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) acc[i] *= s;
    }
};

// The thread's rows of the fragment (16w + l/4 and +8, clamped into A's rows: the tail rows of the last
// tile are computed on zeros and never stored; grouped, rows past the group's end read the next group's
// scales and are not stored either) and the tile's scale block of B (grouped: of the tile's group). A 192-wide
// tile (kTwoScaleCols) has two of B's scale blocks: its columns before `split` (128 - n0 % 128: 128 or 64) in the
// first, the rest in the second (clamped into B's blocks: columns past N are never stored).
struct BlockScale {
    static constexpr bool kPerTile = true;
    const float* a;
    const float* b;
    int k_blocks, m, n_blocks;
    int b_group_stride;    // grouped GEMM only
    const float* row0;     // this tile's scale rows of the thread
    const float* row1;
    const float* col;      // the tile's 128-column block of B
    const float* col2;     // kTwoScaleCols: the next one
    int split;             // kTwoScaleCols: the tile's first column in col2's block

    static __device__ __forceinline__ BlockScale of(const ScaleArgs& s, int m, int n) {
        return BlockScale{s.a, s.b, s.k_blocks, m, (n + kScaleBlock - 1) / kScaleBlock, s.b_group_stride,
                          nullptr, nullptr, nullptr, nullptr, 0};
    }
    __device__ __forceinline__ void begin_tile(int m0, int n0, int group, int tid) {
        const int r = m0 + (tid >> 5) * 16 + ((tid & 31) >> 2);
        row0 = a + (long long)min(r, m - 1) * k_blocks;
        row1 = a + (long long)min(r + 8, m - 1) * k_blocks;
        col = b + (long long)(n0 / kScaleBlock) * k_blocks;
        if constexpr (kGrouped) col += (long long)group * b_group_stride;
        if constexpr (kTwoScaleCols) {
            col2 = b + (long long)min(n0 / kScaleBlock + 1, n_blocks - 1) * k_blocks;
            if constexpr (kGrouped) col2 += (long long)group * b_group_stride;
            split = kScaleBlock - n0 % kScaleBlock;
        }
    }
    // A K block's scales of the thread's two rows and of the tile's columns, as loaded: they are multiplied
    // only in promote(), so that no instruction waits for the loads before the block's MMAs have retired.
    struct Loaded {
        float row0, row1, col, col2;
    };
    __device__ __forceinline__ Loaded load(int kb) const {
        return Loaded{__ldg(row0 + kb), __ldg(row1 + kb), __ldg(col + kb), kTwoScaleCols ? __ldg(col2 + kb) : 0.f};
    }
    // acc += part * sa[row] * sb; fragment registers 4g + {0,1} are the thread's first row, 4g + {2,3} its row + 8,
    // all of them in columns [8g, 8g + 8) of the tile. kSplitGroup: the first 8-column group in col2's block.
    template <int kSplitGroup>
    __device__ __forceinline__ static void promote_split(float (&acc)[kAccRegs], const float (&part)[kAccRegs],
                                                         float s0, float s1, float t0, float t1) {
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) {
            const bool second = (i >> 2) >= kSplitGroup;
            acc[i] = fmaf(part[i], (i & 2) ? (second ? t1 : s1) : (second ? t0 : s0), acc[i]);
        }
    }
    __device__ __forceinline__ void promote(float (&acc)[kAccRegs], const float (&part)[kAccRegs], Loaded s) const {
        const float s0 = s.row0 * s.col, s1 = s.row1 * s.col;
        if constexpr (kTwoScaleCols) {
            const float t0 = s.row0 * s.col2, t1 = s.row1 * s.col2;
            // one branch per K block, uniform across the warpgroup; the scale of every register is then static
            if (split == kScaleBlock) promote_split<kScaleBlock / 8>(acc, part, s0, s1, t0, t1);
            else promote_split<(kScaleBlock - kBN % kScaleBlock) / 8>(acc, part, s0, s1, t0, t1);
        } else {
            promote_split<kAccRegs / 4>(acc, part, s0, s1, s0, s1);   // every group in the first block
        }
    }
    __device__ __forceinline__ void finish(float (&)[kAccRegs]) const {}
};

using Scale = Select<kBlockScale, BlockScale,
                     Select<kTensorScale, Select<kGrouped, GroupTensorScale, TensorScale>::type, NoScale>::type>::type;

// The accumulators of wgmma row block rb (rows [64 rb, 64 rb + 64) of the consumer's rows): a view, no copy.
__device__ __forceinline__ float (&row_block(float (&acc)[kAccRegs], int rb))[kMmaAccRegs] {
    return *reinterpret_cast<float(*)[kMmaAccRegs]>(&acc[rb * kMmaAccRegs]);
}

// One K block's MMAs: the kBK / kWgmmaK wgmma steps of the stage at a_base / b_base into acc, each one wgmma per
// row block (ping-pong: two, sharing B's descriptor); the first of a tile (accumulate false) computes D = A*B, the
// rest D += A*B. The caller fences before and commits after.
__device__ __forceinline__ void mma_k_block(float (&acc)[kAccRegs], u32 a_base, u32 b_base, bool accumulate) {
    // The stage's descriptors once; each k16 step adds its byte offset >> 4 to the start-address field (no carry
    // out of it: shared memory ends below 256 KiB), one add instead of rebuilding the descriptor per wgmma.
    // A row block is 64 rows of 128 bytes further: whole 1024-byte swizzle atoms, so the same add applies.
    const u64 da0 = desc_kmajor(a_base);
    const u64 db0 = kBKMajor ? desc_kmajor(b_base) : desc_mnmajor(b_base, kBAtomBytes);
#pragma unroll
    for (int kk = 0; kk < kBK / kWgmmaK; ++kk) {
        const u64 da = da0 + desc_step(kk * kWgmmaK * kInBytes);
        const u64 db = db0 + desc_step(kBKMajor ? kk * kWgmmaK * kInBytes : kk * kWgmmaK * 128u);
#pragma unroll
        for (int rb = 0; rb < kRowBlocks; ++rb)
            TileMma::run(row_block(acc, rb), da + desc_step(rb * kMmaRows * kBK * kInBytes), db,
                         (accumulate || kk > 0) ? 1 : 0);
    }
}

// The smem and barriers a consumer warpgroup works with.
struct ConsumerSmem {
    u32 smem;             // 1024-byte aligned base (shared::cta address)
    char* generic;        // the same base, generic address (C staging writes)
    u32 bars_full, bars_empty;
    u32 bar_c_full, bar_c_empty;   // the pair of this consumer's storer turn (c_turn_of(wg))
};

// One K block of a consumer's main loop with one wgmma group kept in flight: wait for the stage's bytes, issue its
// MMAs into acc (the first K block of a tile overwrites), run `between` (the epilogue's per-K-block work), then, once
// the previous K block's group has retired, give that block's stage (prev_stage) back to the loader. The caller
// releases the tile's last stage after wgmma_wait<0>.
template <class Between>
__device__ __forceinline__ void mma_step(float (&acc)[kAccRegs], const ConsumerSmem& sm, int stage, u32 phase,
                                         int prev_stage, int kb, u32 a_rows_offset, int tid, Between between) {
    mbar_wait(sm.bars_full + 8 * stage, phase);  // acquire: TMA bytes of this stage have landed
    wgmma_fence();  // accumulator registers written before (epilogue reads, previous MMAs) -> wgmma
    mma_k_block(acc, sm.smem + kOffA + stage * kTileABytes + a_rows_offset, sm.smem + kOffB + stage * kTileBBytes,
                kb > 0);
    wgmma_commit();
    between();
    if (kb > 0) {   // the previous K block's group retired: its stage's smem is no longer read by the tensor cores
        wgmma_wait<1>();
        release_stage(sm.bars_empty + 8 * prev_stage, tid);
    }
}

// Per-tile scales (ScaleT::kPerTile) of tile t: its first row and group from the schedule (grouped: the table),
// the consumer's rows starting row_offset into the tile.
template <class ScaleT>
__device__ __forceinline__ void begin_tile_scale(ScaleT& scale, const Schedule& sched, int t, int row_offset, int tid) {
    int m_tile, n_tile;
    sched.tile(t, m_tile, n_tile);
    const GroupTile rows = sched.rows(m_tile);
    scale.begin_tile(rows.row0 + row_offset, n_tile * kBN, rows.group, tid);
}

// One consumer warpgroup computes rows [wg, wg + 1) * kRowsPerConsumer of each tile of the schedule, then hands
// the accumulators to the epilogue (Epilogue::store), which the mainloop calls back once per K block
// (Epilogue::after_k_block, for work that overlaps the MMAs).
// Split-K passes its KSlices last (`slices`: none or one); without it every tile has all of K's blocks.
template <class Epilogue, class ScaleT, class... KSlicesT>
__device__ __forceinline__ void run_consumer(const Schedule& sched, int K, int wg, const ConsumerSmem& sm,
                                             Epilogue& epilogue, ScaleT scale, KSlicesT... slices) {
    const int tid = threadIdx.x & 127;  // thread within the warpgroup
    const int k_blocks_all = (K + kBK - 1) / kBK;
    float acc[kAccRegs];
    int stage = 0;
    u32 phase = 0;
    typename Epilogue::ConsumerState es = epilogue.consumer_state(wg);
    const u32 a_rows_offset = (u32)wg * kRowsPerConsumer * kBK * kInBytes;  // 8 KiB per row block
#if FLUXRT_GEMM_TRACE
    int trace_idx = 0;   // K blocks consumed so far
    int trace_tile = 0;  // tiles finished so far
#endif
    for (int t = sched.first; t < sched.end(); t += sched.stride) {
        int prev_stage = 0;
        const typename Epilogue::Tile tile = epilogue.begin_tile(sched, t);
        // split-K: the K blocks of the slice of the tile's band, as the loader loads them
        const int k_blocks = item_k_blocks(k_blocks_all, sched, t, slices...);
        // Block scales: the scales of K blocks kb + 1 and kb + 2 are in flight while kb is computed (they come
        // from L2: the ring leaves little L1, and an L2 round trip is longer than one K block's MMAs).
        BlockScale::Loaded s_next{}, s_after{};
        if constexpr (ScaleT::kPerTile) begin_tile_scale(scale, sched, t, wg * kRowsPerConsumer, tid);
        if constexpr (kBlockScale) {
            s_next = scale.load(0);
            if (k_blocks > 1) s_after = scale.load(1);
#pragma unroll
            for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.f;
        }
        for (int kb = 0; kb < k_blocks; ++kb) {
            const BlockScale::Loaded s = s_next;
            if constexpr (kBlockScale) {
                s_next = s_after;
                if (kb + 2 < k_blocks) s_after = scale.load(kb + 2);
            }
            if constexpr (kBlockScale) {
                mbar_wait(sm.bars_full + 8 * stage, phase);  // acquire: TMA bytes of this stage have landed
                const u32 a_base = sm.smem + kOffA + stage * kTileABytes + a_rows_offset;
                const u32 b_base = sm.smem + kOffB + stage * kTileBBytes;
                // The K block's product in its own registers; once retired, its stage goes back to the
                // loader and the product is scaled into acc (the other consumer's MMAs run meanwhile).
                // Descriptors stepped per k32 as in mma_k_block (both operands K-major).
                float part[kAccRegs];
                const u64 da0 = desc_kmajor(a_base);
                const u64 db0 = desc_kmajor(b_base);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBK / kWgmmaK; ++kk)
                    TileMma::run(row_block(part, 0), da0 + desc_step(kk * kWgmmaK * kInBytes),
                                 db0 + desc_step(kk * kWgmmaK * kInBytes), kk > 0 ? 1 : 0);
                wgmma_commit();
                wgmma_wait<0>();
                reg_fence(part);
                release_stage(sm.bars_empty + 8 * stage, tid);
                scale.promote(acc, part, s);
            } else {
#if FLUXRT_GEMM_TRACE   // the stage's full wait timed here; mma_step's own wait then passes at once
                traced_wait(2 + 2 * wg, trace_idx++, tid == 0, [&] { mbar_wait(sm.bars_full + 8 * stage, phase); });
#endif
                mma_step(acc, sm, stage, phase, prev_stage, kb, a_rows_offset, tid,
                         [&] { epilogue.after_k_block(tile, kb, k_blocks, wg, tid); });
            }
            prev_stage = stage;
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
        if constexpr (!kBlockScale) {
            wgmma_wait<0>();  // all MMAs of the tile retired: accumulators final
            reg_fence(acc);
            if (k_blocks > 0) release_stage(sm.bars_empty + 8 * prev_stage, tid);
        }
#if FLUXRT_GEMM_TRACE
        trace_mark(3 * wg, trace_tile++, tid == 0);
#endif
        scale.finish(acc);
        epilogue.store(acc, sched, t, tile, wg, tid, sm, es);
    }
    epilogue.after_tiles(sched);
}

// Ping-pong consumer (FLUXRT_GEMM_PINGPONG): consumer wg computes whole tiles, this CTA's tiles i = wg, wg + 2, ...
// of the schedule. The loader fills the ring with every tile's K blocks in schedule order, so tile i's blocks
// occupy ring positions [i * k_blocks, (i + 1) * k_blocks): the consumer starts each tile at its position's stage
// and phase, skipping the other consumer's blocks, and releases only the stages it read (empty[s] expects one
// consumer per writing CTA). While one consumer stages its tile, the other's MMAs keep the tensor cores busy.
// Order barrier: consumer wg starts tile i's main loop only once the other consumer has passed every full-barrier
// wait of tile i - 1 (named barrier kPingPongBar + wg: the other arrives, wg syncs; an arrival only where the
// waiter has that tile, so none is left pending at exit). Two reasons:
//   1. correctness: a barrier's parity names its phase only within one phase. Skipping the other consumer's
//      blocks, wg could wait on a stage whose previous fill (the other's block) has not happened yet and read
//      that earlier phase as its own. Once every earlier ring position has been waited on, each stage wg waits
//      on is at most one phase from its own fill.
//   2. the MMAs of one tile are issued together, so the tile finishes (and its epilogue starts) as early as it can.
// Kept apart from run_consumer so that every other configuration compiles to the instructions it had.
template <class Epilogue, class ScaleT>
__device__ __forceinline__ void run_consumer_pingpong(const Schedule& sched, int K, int wg, const ConsumerSmem& sm,
                                                      Epilogue& epilogue, ScaleT scale) {
    static_assert(!kBlockScale, "ping-pong: no block scales");
    const int tid = threadIdx.x & 127;
    const int k_blocks = (K + kBK - 1) / kBK;
    float acc[kAccRegs];
    typename Epilogue::ConsumerState es = epilogue.consumer_state(wg);
    int i = wg;   // this CTA's tile index
    for (int t = sched.first + wg * sched.stride; t < sched.end(); t += kConsumers * sched.stride, i += kConsumers) {
        if (i > 0) named_bar_sync(kPingPongBar + wg, 256);   // the other consumer passed tile i - 1's waits
        if constexpr (ScaleT::kPerTile) begin_tile_scale(scale, sched, t, 0, tid);   // grouped fp8: the group's scale
        const u32 pos = (u32)i * (u32)k_blocks;   // ring position of the tile's first K block
        int stage = (int)(pos % kStages);
        u32 phase = (pos / kStages) & 1u;
        int prev_stage = 0;
        const typename Epilogue::Tile tile = epilogue.begin_tile(sched, t);
        for (int kb = 0; kb < k_blocks; ++kb) {
            mma_step(acc, sm, stage, phase, prev_stage, kb, 0u, tid,
                     [&] { epilogue.after_k_block(tile, kb, k_blocks, wg, tid); });
            prev_stage = stage;
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
        // tile i + 1 (the other consumer's) may start: every wait of tile i is behind us
        if (t + sched.stride < sched.end()) named_bar_arrive(kPingPongBar + (wg ^ 1), 256);
        wgmma_wait<0>();  // all MMAs of the tile retired: accumulators final
        reg_fence(acc);
        if (k_blocks > 0) release_stage(sm.bars_empty + 8 * prev_stage, tid);
        scale.finish(acc);
        epilogue.store(acc, sched, t, tile, wg, tid, sm, es);
    }
    epilogue.after_tiles(sched);
}

// Stream-K fixup, the consumer's part (FLUXRT_GEMM_STREAM_K; units in scheduler.cuh). Partials are fp32 in
// accumulator-fragment order: warpgroup wg's half of slot s is at partials + (s * kConsumers + wg) * 128 *
// kAccRegs floats, and thread tid's accumulators 4j .. 4j + 3 are the float4 at (j * 128 + tid) of it, so each
// warp stores and loads 512 contiguous bytes per instruction and the finishing thread reads exactly the values
// the same thread of the other CTA held. Counters are per cut tile and warpgroup: the two consumer warpgroups of
// a CTA finish their halves of a tile independently.
__device__ __forceinline__ float4* stream_k_slot(const StreamK& sk, int slot, int wg, int tid) {
    return reinterpret_cast<float4*>(sk.partials + ((long long)slot * kConsumers + wg) * (128 * kAccRegs)) + tid;
}

// After unit (t, kb0, kbs): returns true when acc is a finished tile for the epilogue (a whole tile, or a cut
// tile's last piece with the others added), false for another piece.
//   Other piece: store acc into its slot; every thread fences its own stores, the warpgroup meets (named
//     barrier), one thread adds 1 to the tile's counter (fence.acq_rel + red.release).
//   Last piece: one thread waits (bounded, acquire) until the counter holds every other piece, fences, the
//     warpgroup meets; then each thread adds the partials in piece order with ld.global.cg (L2, never a stale
//     L1 line); the waiter resets the counter for the next launch (stream order publishes it). On timeout the
//     ErrorRecord names the op and the CTA of the tile's first piece; the tile becomes NaN.
// The fixup's fences, release and acquire are at GPU scope: the pieces' CTAs, the partials and the counters are all on
// this GPU (a .sys fence would also wait for the stores to reach the system; docs/design.md has the cost). The
// timeout path's ErrorRecord, which the host reads, stays at .sys. The counter is the one flag that is reset (by its
// finisher, after the count it waited for): the next launch on the stream starts after this one has completed.
// With a cluster of 2 a phantom tile's pieces touch neither counter nor partials; its last piece returns true (the
// storer drops the staged tile).
__device__ __forceinline__ bool stream_k_fixup(float (&acc)[kAccRegs], const StreamK& sk, const Schedule& sched, int t,
                                               int kb0, int kbs, int wg, int tid) {
    if (kbs == sk.k_blocks) return true;   // a whole tile
    if constexpr (kCluster > 1) {
        int m_tile, n_tile;
        if (!sched.tile(t, m_tile, n_tile)) return kb0 + kbs == sk.k_blocks;
    }
    const int i = sk.cut_tile(t, sched);
    const int others = sk.pieces - 1;
    u64* counter = sk.counters + (long long)i * kConsumers + wg;
    if (kb0 + kbs < sk.k_blocks) {
        float4* slot = stream_k_slot(sk, i * others + kb0 / sk.piece_blocks, wg, tid);
#pragma unroll
        for (int j = 0; j < kAccRegs / 4; ++j)
            slot[j * 128] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        fluxrt::Gpu::fence_acq_rel();
        named_bar_sync(1 + wg, 128);
        if (tid == 0) fluxrt::signal_add<fluxrt::Gpu>(counter, 1);
        return false;
    }
    bool ok = true;
    // the peer: the CTA of the tile's first piece (with a cluster, the same rank of that unit's cluster)
    if (tid == 0)
        ok = fluxrt::acquire_for_block<fluxrt::Gpu>(counter, (u64)others, sk.watch,
                                       (u64)(sk.cta_of(t - sk.dp_tiles) * kCluster + sched.m_rank()));
    ok = named_bar_and(1 + wg, 128, ok);
    constexpr int kBatch = 8;   // float4 loads in flight per thread (32 registers beside the accumulators)
    for (int piece = 0; piece < others; ++piece) {
        const float4* slot = stream_k_slot(sk, i * others + piece, wg, tid);
#pragma unroll
        for (int j0 = 0; j0 < kAccRegs / 4; j0 += kBatch) {
            uint4 v[kBatch];
            // the last batch of a width whose kAccRegs / 4 is not a multiple of kBatch is partial (compile-time bound)
#pragma unroll
            for (int j = 0; j < kBatch; ++j)
                if (j0 + j < kAccRegs / 4) v[j] = ld_cg_v4(slot + (j0 + j) * 128);
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                if (j0 + j >= kAccRegs / 4) break;
                acc[4 * (j0 + j)] += __uint_as_float(v[j].x);
                acc[4 * (j0 + j) + 1] += __uint_as_float(v[j].y);
                acc[4 * (j0 + j) + 2] += __uint_as_float(v[j].z);
                acc[4 * (j0 + j) + 3] += __uint_as_float(v[j].w);
            }
        }
    }
    if (tid == 0 && ok) fluxrt::Gpu::st_relaxed(counter, 0);
    if (!ok) {
#pragma unroll
        for (int r = 0; r < kAccRegs; ++r) acc[r] = __int_as_float(0x7fffffff);   // stored as NaN
    }
    return true;
}

// Stream-K consumer (FLUXRT_GEMM_STREAM_K): run_consumer's main loop (16-bit inputs: no scales; written out rather
// than through mma_step, with which NVRTC schedules this loop differently) over this CTA's work units, then
// stream_k_fixup; a finished tile goes to the epilogue as in run_consumer. Kept apart from
// run_consumer so that every other configuration compiles to the instructions it had.
template <class Epilogue>
__device__ __forceinline__ void run_consumer_stream_k(const Schedule& sched, const StreamK& sk, int wg,
                                                      const ConsumerSmem& sm, Epilogue& epilogue) {
    const int tid = threadIdx.x & 127;
    float acc[kAccRegs];
    int stage = 0;
    u32 phase = 0;
    typename Epilogue::ConsumerState es = epilogue.consumer_state(wg);
    const u32 a_rows_offset = (u32)wg * kRowsPerConsumer * kBK * kInBytes;
    for_each_unit(sched, sk, [&](int t, int kb0, int kbs) {
        int prev_stage = 0;
        const typename Epilogue::Tile tile = epilogue.begin_tile(sched, t);
        for (int kb = 0; kb < kbs; ++kb) {
            mbar_wait(sm.bars_full + 8 * stage, phase);
            const u32 a_base = sm.smem + kOffA + stage * kTileABytes + a_rows_offset;
            const u32 b_base = sm.smem + kOffB + stage * kTileBBytes;
            wgmma_fence();
            mma_k_block(acc, a_base, b_base, kb > 0);
            wgmma_commit();
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
        wgmma_wait<0>();
        reg_fence(acc);
        release_stage(sm.bars_empty + 8 * prev_stage, tid);   // kbs >= 1: for_each_unit has no empty units
        if (stream_k_fixup(acc, sk, sched, t, kb0, kbs, wg, tid)) epilogue.store(acc, sched, t, tile, wg, tid, sm, es);
    });
}

}  // namespace fluxrt_sm90
