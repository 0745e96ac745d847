// The GEMM's compile-time configuration: the -D macros one instantiation is built from, and every size
// derived from them (tile, ring, C staging, shared-memory layout, register split).
//
// Compile-time configuration (the Python side passes these as -D macros; one module per config so
// that the kernel name `fluxrt_gemm` stays stable):
//   FLUXRT_GEMM_BN            tile N (64..256, multiple of 64)           default 256
//   FLUXRT_GEMM_CONSUMERS     consumer warpgroups; tile M = 64 * this * FLUXRT_GEMM_ROW_BLOCKS    default 2
//   FLUXRT_GEMM_ROW_BLOCKS    wgmma row blocks (64 rows each) per consumer: 2 makes 256-row tiles, two consumers of
//                             128 rows (a plain 16-bit GEMM or its stream-K form, clusters allowed; no
//                             ping-pong, hooks, bands, split-K, grouping; tile N <= 192)              default 1
//   FLUXRT_GEMM_STAGES        smem ring depth                            default 3
//   FLUXRT_GEMM_IN            A's type: 0 bf16, 1 fp16, 2 fp8 e4m3, 3 fp8 e5m2     default 0
//   FLUXRT_GEMM_IN_B          B's type when it differs from A's (fp8 only: 2 or 3)   default FLUXRT_GEMM_IN
//                             fp8: tile K = 128 (one 128-byte row, as 64 for 16-bit), m64nNk32 wgmma, B
//                             K-major only ([N, K]: PTX has no transposed fp8 operand)
//   FLUXRT_GEMM_SCALE         fp8 dequantisation: 0 none; 1 per tensor (C = sa * sb * A@B, sa, sb fp32 scalars
//                             in device memory); 2 block scales (DeepSeek-V3 style): A 1x128 per row and K
//                             block ([M, K/128] fp32), B 128x128 ([N/128, K/128] fp32); each K block's product
//                             is accumulated in fresh registers and added into the fp32 accumulators times
//                             sa[row, kb] * sb[n / 128, kb]. Needs kBN <= 128 or 192.           default 0
//   FLUXRT_GEMM_OUT           0 bf16, 1 fp16, 2 fp32                     default 0
//   FLUXRT_GEMM_B_KMAJOR      1: B is [N,K]; 0: B is [K,N]               default 0
//   FLUXRT_GEMM_HOOK_WAIT     1: hook 1 (arrival wait before A loads)    default 0
//   FLUXRT_GEMM_HOOK_EPILOGUE 1: hook 2 (per-chunk destination tensor map + tile flag) default 0
//   FLUXRT_GEMM_HOOK_REDUCE   1: hook 3 (needs hook 2; 16-bit C): the tiles of one chunk get the other
//                             sources' partials of their rows added in the consumers' epilogue (each
//                             waited for by its flag) and go to C (tmap_c, [chunk rows, N]) instead of
//                             the chunk's destination, without a flag                       default 0
//                             2: hook 3 "tail": the chunk's tiles go to their destination (= the chunk's
//                             own source slot of the partials) with a per-tile flag; then every consumer
//                             warp that has no tile left claims 16-row slabs of the chunk (schedule order)
//                             and sums all sources' partials into red_out. The reduce runs on the SMs
//                             the last wave of tiles leaves idle, beside it, instead of after the GEMM.
//   FLUXRT_GEMM_HOOK_COPY     1: hook 4 (needs hook 1): A's rows [own_row0, own_row0 + own_rows) are loaded
//                             from tmap_a_own instead of tmap_a (no arrival wait: they are local), and
//                             each CTA's copier warp copies its share of them into tmap_a's rows while
//                             the GEMM runs, adding the number of {kBK x kBM} pieces it stored to
//                             copy_counters[chunk of own rows] (a peer polls it)             default 0
//   FLUXRT_GEMM_EPI_DIRECT    1: consumers store C straight from registers (no staging, no storer;
//                             frees the staging smem for one more stage). Not with hook 2.  default 0
//   FLUXRT_GEMM_C_SHARED      1: the consumers share ONE consumer's C staging region and take turns
//                             (frees kCConsumerBytes, e.g. room for a 4th stage at 128x256 bf16).
//                             No effect with one consumer; not with FLUXRT_GEMM_EPI_DIRECT.  default 0
//   FLUXRT_GEMM_CLUSTER       CTAs of a cluster along M (1 or 2). With 2, the pair computes two M tiles of the
//                             same N tile, and each CTA loads half of the shared B tile and multicasts
//                             it to both: L2 -> SM traffic per tile drops from A+B to A+B/2.  default 1
//   FLUXRT_GEMM_CLUSTER_N     CTAs of a cluster along N (1 or 2; plain 16-bit GEMMs only). With 2, the
//                             cluster is FLUXRT_GEMM_CLUSTER x 2 CTAs (rank = m rank + FLUXRT_GEMM_CLUSTER
//                             * n rank) computing its M tiles times two neighbouring N tiles; the CTAs of one
//                             M tile share its A tile as the CTAs of one N tile share B: each loads
//                             1 / FLUXRT_GEMM_CLUSTER_N of A's rows and multicasts them.  default 1
//   FLUXRT_GEMM_BANDS         rows in bands (the fused ops' padded calls): the GEMM's M rows are bands of
//                             band_rows = chunk_rows * chunks_per_peer rows, of which an operand holds only
//                             the first `rows` (its 3-D tensor map [bands][rows][cols]); GEMM row y is row
//                             y % band_rows of band y / band_rows. Bit 0: A (rows past `rows` load as zeros,
//                             TMA's out-of-bounds fill); bit 1: C (rows past `rows` are not written, TMA
//                             clips them). A tile never straddles two bands (band_rows % kBM == 0). default 0
//   FLUXRT_GEMM_SPLIT_K       1: split-K (with banded C, fp32 out, no hooks, no cluster): the GEMM's M rows are
//                             `splits` bands of band_rows rows; band s multiplies K columns [s*ks,
//                             min((s+1)*ks, K)) (ks = GemmArgs::k_slice, whole K blocks; KSlices in
//                             scheduler.cuh) and stores its fp32 partial into band s of C. A and B are the
//                             plain 2-D maps, read at the slice's K offset. A separate kernel sums the
//                             partials in split order. default 0
//   FLUXRT_GEMM_STREAM_K      1: stream-K (plain GEMM: no hooks, no cluster along N, no bands, no split-K, 16-bit inputs,
//                             staged epilogue): the schedule's first StreamKArgs::dp_tiles items are whole
//                             tiles (round robin, as without it); each remaining tile is cut into `pieces`
//                             K ranges, units that continue the round robin so that the waves fill up. A cut
//                             tile's last piece waits for the others' fp32 partials and adds them in piece
//                             order (StreamK in scheduler.cuh, stream_k_fixup in consumer.cuh). With
//                             FLUXRT_GEMM_CLUSTER=2 the items and units are the pairs' (both CTAs of a pair
//                             run the same K range of their two M tiles and share B). default 0
//   FLUXRT_GEMM_PINGPONG      1: ping-pong consumers (plain or grouped GEMM: no hooks, bands, split-K, stream-K,
//                             block scales or cluster along N; 2 consumers, staged epilogue): each consumer
//                             warpgroup computes whole tiles (all kBM rows: kBM / 64 wgmma row blocks), the
//                             CTA's even tiles on consumer 0, odd ones on consumer 1. The ring holds the tiles'
//                             K blocks in order, so one consumer's MMAs run while the other stages its tile:
//                             the epilogue hides behind the other tile's main loop (short K).   default 0
//   FLUXRT_GEMM_GROUPED       1: grouped GEMM (MoE experts; hooks 1, 2 only; no cluster, bands; staged epilogue):
//                             G problems A[offsets[g]:offsets[g+1]] @ B[g], offsets read on the device
//                             (GroupArgs). The tile grid is the groups' tile rows one after another; B is a
//                             3-D map with the group as its outer coordinate; a tile that ends past its
//                             group's last row is stored by the storer warp with row-masked st.global
//                             instead of TMA (TMA clips only at the tensor's end). With fp8 the scales
//                             follow the tile's group: B's per group (ScaleArgs::b_group_stride), A's rows
//                             from the group table's first row. With FLUXRT_GEMM_HOOK_EPILOGUE=1 (16-bit
//                             inputs): no row goes to C; the storer scatters each row to the buffer of its
//                             home rank (GroupArgs::scatter_*) and counts the landed elements there. default 0
// With every hook 0 the hook code is not compiled (if constexpr), and the hook arguments are ignored.
#pragma once

#include "../gemm/sm90_primitives.cuh"

#ifndef FLUXRT_GEMM_BN
#define FLUXRT_GEMM_BN 256
#endif
#ifndef FLUXRT_GEMM_CONSUMERS
#define FLUXRT_GEMM_CONSUMERS 2
#endif
#ifndef FLUXRT_GEMM_ROW_BLOCKS
#define FLUXRT_GEMM_ROW_BLOCKS 1
#endif
#ifndef FLUXRT_GEMM_STAGES
#define FLUXRT_GEMM_STAGES 3
#endif
#ifndef FLUXRT_GEMM_IN
#define FLUXRT_GEMM_IN 0
#endif
#ifndef FLUXRT_GEMM_IN_B
#define FLUXRT_GEMM_IN_B FLUXRT_GEMM_IN
#endif
#ifndef FLUXRT_GEMM_SCALE
#define FLUXRT_GEMM_SCALE 0
#endif
#ifndef FLUXRT_GEMM_OUT
#define FLUXRT_GEMM_OUT 0
#endif
#ifndef FLUXRT_GEMM_B_KMAJOR
#define FLUXRT_GEMM_B_KMAJOR 0
#endif
#ifndef FLUXRT_GEMM_HOOK_WAIT
#define FLUXRT_GEMM_HOOK_WAIT 0
#endif
#ifndef FLUXRT_GEMM_HOOK_EPILOGUE
#define FLUXRT_GEMM_HOOK_EPILOGUE 0
#endif
#ifndef FLUXRT_GEMM_HOOK_REDUCE
#define FLUXRT_GEMM_HOOK_REDUCE 0
#endif
#ifndef FLUXRT_GEMM_HOOK_COPY
#define FLUXRT_GEMM_HOOK_COPY 0
#endif
#ifndef FLUXRT_GEMM_EPI_DIRECT
#define FLUXRT_GEMM_EPI_DIRECT 0
#endif
#ifndef FLUXRT_GEMM_CLUSTER
#define FLUXRT_GEMM_CLUSTER 1
#endif
#ifndef FLUXRT_GEMM_CLUSTER_N
#define FLUXRT_GEMM_CLUSTER_N 1
#endif
#ifndef FLUXRT_GEMM_SPLIT_K
#define FLUXRT_GEMM_SPLIT_K 0
#endif
#ifndef FLUXRT_GEMM_BANDS
#define FLUXRT_GEMM_BANDS 0
#endif
#ifndef FLUXRT_GEMM_C_SHARED
#define FLUXRT_GEMM_C_SHARED 0
#endif
#ifndef FLUXRT_GEMM_GROUPED
#define FLUXRT_GEMM_GROUPED 0
#endif
#ifndef FLUXRT_GEMM_STREAM_K
#define FLUXRT_GEMM_STREAM_K 0
#endif
#ifndef FLUXRT_GEMM_PINGPONG
#define FLUXRT_GEMM_PINGPONG 0
#endif
#ifndef FLUXRT_GEMM_TRACE
#define FLUXRT_GEMM_TRACE 0
#endif

#if FLUXRT_GEMM_TRACE
// Diagnostic build (FLUXRT_GEMM_TRACE=1; perf/gemm_trace.py reads it): CTA 0's clock64 before and after the
// loader's wait for a free slot (rows 0, 1), consumer 0's wait for a full stage (rows 2, 3) and consumer 1's
// (rows 4, 5; two-consumer plans), one column per K block in the CTA's order, the first 2048.
// The epilogue's hand-offs per tile (the CTA's first 256 tiles; rows in perf/gemm_trace.py EPI_ROW_NAMES):
// consumer wg's accumulators final (3 wg), its staging token (3 wg + 1), its c_full arrival (3 wg + 2), and the
// storer's turn k staged (6 + 2 k) and read by the TMA stores (7 + 2 k).
extern "C" {
__device__ long long fluxrt_gemm_trace[6][2048];
__device__ long long fluxrt_gemm_epi_trace[10][256];
}
#endif

namespace fluxrt_sm90 {

// ---------------------------------------------------------------------------------------------
// Configuration constants (sizes in elements unless the name says bytes).
constexpr int kConsumers = FLUXRT_GEMM_CONSUMERS;
constexpr bool kPingPong = FLUXRT_GEMM_PINGPONG != 0;
constexpr int kMmaRows = 64;                                // wgmma M
// Row blocks of a consumer's slice of a cooperative tile: one (64 rows), or two (256-row tiles).
constexpr int kCoopRowBlocks = FLUXRT_GEMM_ROW_BLOCKS;
constexpr bool kTallTile = kCoopRowBlocks > 1;
constexpr int kBM = kMmaRows * kConsumers * (kPingPong ? 1 : kCoopRowBlocks);   // tile rows
// Rows of a tile one consumer computes: its slice (cooperative: 64 rows, 128 in a 256-row tile), or the whole tile
// (ping-pong), in kRowBlocks wgmma row blocks.
constexpr int kRowBlocks = kPingPong ? kConsumers : kCoopRowBlocks;
constexpr int kRowsPerConsumer = kMmaRows * kRowBlocks;
constexpr int kBN = FLUXRT_GEMM_BN;                         // tile cols (= wgmma N)
constexpr bool kFp8 = FLUXRT_GEMM_IN >= 2;
constexpr int kInBytes = kFp8 ? 1 : 2;
constexpr int kBK = 128 / kInBytes;                         // one 128-byte swizzled row (64 x 2 B, 128 x 1 B)
constexpr int kStages = FLUXRT_GEMM_STAGES;
constexpr int kWgmmaK = 32 / kInBytes;                      // K per wgmma instruction: 32 bytes of a row
constexpr int kScaleMode = FLUXRT_GEMM_SCALE;
constexpr bool kTensorScale = kScaleMode == 1;
constexpr bool kBlockScale = kScaleMode == 2;
constexpr int kScaleBlock = 128;                            // block scales: 1 x 128 (A), 128 x 128 (B)
constexpr int kOutBytes = FLUXRT_GEMM_OUT == 2 ? 4 : 2;
constexpr bool kBKMajor = FLUXRT_GEMM_B_KMAJOR != 0;
constexpr bool kHookWait = FLUXRT_GEMM_HOOK_WAIT != 0;
constexpr bool kHookEpilogue = FLUXRT_GEMM_HOOK_EPILOGUE != 0;
constexpr bool kHookReduce = FLUXRT_GEMM_HOOK_REDUCE != 0;
constexpr bool kReduceEpilogue = FLUXRT_GEMM_HOOK_REDUCE == 1;   // hook 3 in the epilogue
constexpr bool kReduceTail = FLUXRT_GEMM_HOOK_REDUCE == 2;       // hook 3 after the tiles
constexpr bool kHookCopy = FLUXRT_GEMM_HOOK_COPY != 0;
constexpr bool kEpiDirect = FLUXRT_GEMM_EPI_DIRECT != 0;
constexpr int kCluster = FLUXRT_GEMM_CLUSTER;
static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
constexpr int kClusterN = FLUXRT_GEMM_CLUSTER_N;
constexpr int kClusterCtas = kCluster * kClusterN;
static_assert(kClusterN == 1 || kClusterN == 2, "clusters of 1 or 2 CTAs along N");
// The CTAs that share this CTA's B tile (its N rank's column of the cluster) and its A tile (its M rank's
// row), as multicast masks; rank = m rank + kCluster * n rank.
__host__ __device__ constexpr unsigned short b_sharers(int n_rank) {
    return (unsigned short)(((1u << kCluster) - 1) << (n_rank * kCluster));
}
__host__ __device__ constexpr unsigned short a_sharers(int m_rank) {
    return (unsigned short)(kClusterN == 1 ? 1u << m_rank : (1u << m_rank) | (1u << (m_rank + kCluster)));
}
// The CTAs that write this CTA's ring stages (itself, the B sharers, the A sharers), whose consumers all
// release a stage before its writer refills it.
constexpr int kStageWriters = kCluster + kClusterN - 1;
static_assert(!(kEpiDirect && kHookEpilogue), "hook 2 needs the staged (storer-warp) epilogue");
static_assert(!kHookReduce || (kHookEpilogue && FLUXRT_GEMM_OUT != 2), "hook 3 needs hook 2 and 16-bit partials");
static_assert(!kHookCopy || kHookWait, "hook 4 needs hook 1 (its chunk geometry)");
constexpr bool kBandsA = (FLUXRT_GEMM_BANDS & 1) != 0;
constexpr bool kBandsC = (FLUXRT_GEMM_BANDS & 2) != 0;
static_assert(!(kBandsA && kHookCopy), "hook 4 stores A's own rows through the 2-D map of A");
static_assert(!(kBandsC && (kHookEpilogue || kEpiDirect)), "banded C is C itself, stored by the storer warp");
constexpr bool kSplitK = FLUXRT_GEMM_SPLIT_K != 0;
static_assert(FLUXRT_GEMM_IN >= 0 && FLUXRT_GEMM_IN <= 3, "input type 0..3");
static_assert(kFp8 ? (FLUXRT_GEMM_IN_B == 2 || FLUXRT_GEMM_IN_B == 3) : FLUXRT_GEMM_IN_B == FLUXRT_GEMM_IN,
              "B's type: an fp8 format with fp8 A, else A's type");
static_assert(!kFp8 || kBKMajor, "fp8 wgmma reads B K-major only: B must be [N, K] (FLUXRT_GEMM_B_KMAJOR=1)");
static_assert(kScaleMode == 0 || kFp8, "scales are for fp8 inputs");
static_assert(kScaleMode >= 0 && kScaleMode <= 2, "scale mode 0..2");
// A 192-wide tile starts at column 0 or 64 of a 128-column scale block and so spans exactly two of them.
constexpr bool kTwoScaleCols = kBlockScale && kScaleBlock % kBN != 0;
static_assert(!kBlockScale || (kBK == kScaleBlock && (kScaleBlock % kBN == 0 || kBN == 192) && !kSplitK),
              "block scales: one scale block per K block, tiles inside one 128-column scale block or 192 wide "
              "(two of them), no split-K");
static_assert(!kSplitK || (kBandsC && !kBandsA && FLUXRT_GEMM_OUT == 2 && kCluster == 1 && !kHookWait &&
                           !kHookEpilogue), "split-K: fp32 partials into banded C, plain loads, no cluster");

constexpr bool kGrouped = FLUXRT_GEMM_GROUPED != 0;
constexpr int kMaxGroups = 256;
static_assert(!kGrouped || (!kHookReduce && !kHookCopy && kCluster == 1 && !kBandsA && !kBandsC && !kSplitK &&
                            !kEpiDirect),
              "grouped GEMM: plain loads (hook 1: per-group arrival waits), no cluster, C staged for the storer's "
              "row-masked boundary stores (hook 2: per-row scatter)");
static_assert(!kGrouped || !kFp8 || (!kHookWait && !kHookEpilogue),
              "grouped GEMM: per-group arrival waits and per-row scatter with 16-bit inputs only");
// Grouped GEMM with hook 2: every row of C goes to its home rank's buffer (GroupArgs::scatter_*), counted.
constexpr bool kGroupScatter = kGrouped && kHookEpilogue;
constexpr bool kStreamK = FLUXRT_GEMM_STREAM_K != 0;
static_assert(!kStreamK || (!kHookWait && !kHookEpilogue && !kHookCopy && kClusterN == 1 && !kBandsA && !kBandsC &&
                            !kSplitK && !kGrouped && !kEpiDirect && !kFp8),
              "stream-K: plain 16-bit GEMM (no hooks, cluster along N, bands, split-K, grouping), staged epilogue");

static_assert(!kPingPong || (kConsumers == 2 && !kHookWait && !kHookEpilogue && !kHookCopy && kClusterN == 1 &&
                             !kBandsA && !kBandsC && !kSplitK && !kStreamK && !kEpiDirect && !kBlockScale &&
                             (!kGrouped || kCluster == 1)),
              "ping-pong consumers: no hooks, bands, split-K, stream-K, block scales or cluster along N (grouped: no "
              "cluster), two consumers and the staged epilogue");

constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kMmaAccRegs = kBN / 2;                        // fp32 accumulators of one m64 row block per thread
constexpr int kAccRegs = kMmaAccRegs * kRowBlocks;          // fp32 accumulators per consumer thread
// Consumer warpgroups that read (and release) each ring stage: all (cooperative), or the tile's own (ping-pong).
constexpr int kStageReaders = kPingPong ? 1 : kConsumers;
// Ping-pong's order barriers: named barriers kPingPongBar + wg (1 + wg are the hook 3 warpgroup barriers).
constexpr u32 kPingPongBar = 3;

#if FLUXRT_GEMM_TRACE
// Diagnostic build: wait() between two clock64 reads, kept by CTA 0's `recorder` thread as trace rows `row` and
// `row + 1`, column `idx` (the call sites exist only in this build: every other one keeps its instructions).
template <class Wait>
__device__ __forceinline__ void traced_wait(int row, int idx, bool recorder, Wait&& wait) {
    const long long t0 = clock64();
    wait();
    const long long t1 = clock64();
    if (recorder && blockIdx.x == 0 && idx < 2048) {
        fluxrt_gemm_trace[row][idx] = t0;
        fluxrt_gemm_trace[row + 1][idx] = t1;
    }
}
// Diagnostic build: CTA 0's clock64 into fluxrt_gemm_epi_trace[row][idx] (one thread records).
__device__ __forceinline__ void trace_mark(int row, int idx, bool recorder) {
    if (recorder && blockIdx.x == 0 && idx < 256) fluxrt_gemm_epi_trace[row][idx] = clock64();
}
#endif

constexpr u32 kTileABytes = kBM * kBK * kInBytes;           // 16 KiB for BM = 128
constexpr u32 kBAtomBytes = 64 * kBK * kInBytes;            // MN-major B: one 64-column slab (8 KiB)
// MN-major B comes in whole 64-column slabs: a fitted width's last slab is loaded whole (the next tile's columns,
// or zeros past N) and its wgmma reads the first kBN % 64 columns of it.
constexpr int kBSlabs = (kBN + 63) / 64;
constexpr u32 kTileBBytes = kBKMajor ? kBN * kBK * kInBytes : kBSlabs * kBAtomBytes;   // 32 KiB for BN = 256
constexpr u32 kStageBytes = kTileABytes + kTileBBytes;      // TMA transaction bytes per stage

// C staging: per consumer, [kBN / kCCols column slabs][its rows][128 B], 128B-swizzled, so that the
// fragment writes from registers are bank-conflict free and the layout matches the TMA store box.
constexpr int kCCols = 128 / kOutBytes;                     // columns per 128-byte slab
constexpr u32 kCSlabBytes = kRowsPerConsumer * 128;         // 8 KiB (ping-pong: 16 KiB)
constexpr int kCSlabs = (kBN + kCCols - 1) / kCCols;         // the last one part-filled with a fitted width
constexpr u32 kCConsumerBytes = kCSlabs * kCSlabBytes;
// Shared C staging (FLUXRT_GEMM_C_SHARED=1 with 2 consumers): ONE consumer-sized region, which the
// consumers fill in turn and the storer drains once per consumer ("turn") per tile, each turn with its
// own c_full[turn] / c_empty[turn] pair. Otherwise: one region per consumer, one turn per tile covering
// every consumer, one barrier pair. With one consumer the two layouts are the same: the option is a no-op.
static_assert(!(FLUXRT_GEMM_C_SHARED && kEpiDirect), "shared C staging needs the staged (storer-warp) epilogue");
constexpr bool kCShared = FLUXRT_GEMM_C_SHARED != 0 && kConsumers > 1;
constexpr int kCSlots = kCShared ? 1 : kConsumers;            // consumer-sized staging regions
// Ping-pong: one barrier pair per consumer, one turn per tile (the tile's consumer's); with shared staging the
// token passes between the consumers tile by tile.
constexpr int kCTurns = (kCShared || kPingPong) ? kConsumers : 1;   // c_full/c_empty pairs (turns per tile)
constexpr int kConsumersPerTurn = kPingPong ? 1 : kConsumers / kCTurns;
constexpr int kTurnRows = kConsumersPerTurn * kRowsPerConsumer;
constexpr u32 kCBytes = kEpiDirect ? 0u : kCSlots * kCConsumerBytes;
// Consumer wg: its storer turn (index of its c_full / c_empty pair) and its staging region.
__host__ __device__ constexpr int c_turn_of(int wg) { return (kCShared || kPingPong) ? wg : 0; }
__host__ __device__ constexpr int c_slot_of(int wg) { return kCShared ? 0 : wg; }

// Register split (setmaxnreg): the producer warpgroup keeps few, the math warpgroups get the rest of
// the 64K-register file. Both must be multiples of 8.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegsRaw = (65536 - 128 * kProducerRegs) / (128 * kConsumers);
constexpr int kConsumerRegs = (kConsumerRegsRaw >= 240 ? 240 : kConsumerRegsRaw) / 8 * 8;
// With one consumer (256 threads) every warp can keep the compile-time maximum: no redistribution.
constexpr bool kRebalanceRegs = kConsumers == 2;

// Tile N: 64, 128, 192 or 256; or, fitted to the SMs' waves, any multiple of 16 in between (fp8: from 144, B K-major,
// one CTA per cluster), a plain GEMM (or its stream-K form). B K-major loads as one TMA box of kBN rows (with a pair,
// kBN / 2 rows each, whole 1 KiB swizzle atoms since kBN % 16 == 0), MN-major in whole 64-column slabs (kTileBBytes).
// The staged epilogue stores the part-filled last slab of an inner tile column through FitArgs' map (params.cuh).
constexpr bool kFitN = kBN % 64 != 0;
static_assert(kBN % 16 == 0 && kBN >= 64 && kBN <= 256, "tile N: a multiple of 16 from 64 to 256");
static_assert(!kFitN || ((kBKMajor || !kFp8) && !kBlockScale && (kCluster == 1 || !kFp8) && !kGrouped && !kSplitK &&
                         !kHookWait && !kHookEpilogue && !kHookCopy && !kBandsA && !kBandsC),
              "a tile N other than 64, 128, 192, 256 needs no block scales, 16-bit inputs for a cluster, and a plain "
              "GEMM (no grouping, split-K, hooks or bands)");
static_assert(!(kFp8 && kFitN) || kBN >= 144,
              "fp8 fitted widths start at 144 (wgmma_ops.cuh has no narrower fp8 ones)");
static_assert(kClusterN == 1 || (!kFp8 && !kGrouped && !kSplitK && !kStreamK && !kHookWait && !kHookEpilogue &&
                                  !kHookCopy && !kBandsA && !kBandsC),
              "a cluster along N needs 16-bit inputs and a plain GEMM (no grouping, split-K, stream-K, hooks or "
              "bands)");
static_assert(!kPingPong || kBN <= 192, "ping-pong consumers: kBN fp32 accumulators per thread, kBN <= 192 "
                                        "(256 spills and serialises the wgmma)");
static_assert(kConsumers == 1 || kConsumers == 2, "1 or 2 consumer warpgroups");
static_assert(kCoopRowBlocks == 1 || kCoopRowBlocks == 2, "1 or 2 row blocks per consumer");
static_assert(!kTallTile || (kConsumers == 2 && !kPingPong && !kFp8 && !kHookWait && !kHookEpilogue && !kHookCopy &&
                             !kBandsA && !kBandsC && !kSplitK && !kGrouped && kBN <= 192),
              "256-row tiles: two consumers, a plain 16-bit GEMM (or stream-K; no ping-pong, hooks, bands, split-K, "
              "grouping) and kBN <= 192 (kBN fp32 accumulators per thread)");
static_assert(kStages >= 2, "at least a double-buffered ring");
static_assert(kBN % kCCols == 0 || kFitN, "C staging slabs");

// Shared-memory layout, offsets from a 1024-byte aligned base (128B swizzle atoms need that).
constexpr u32 kOffA = 0;
constexpr u32 kOffB = kOffA + kStages * kTileABytes;
constexpr u32 kOffC = kOffB + kStages * kTileBBytes;
constexpr u32 kCopyBytes = kHookCopy ? kTileABytes : 0u;  // hook 4: the copier's buffer (one A piece)
constexpr u32 kOffCopy = kOffC + kCBytes;
constexpr u32 kOffBars = kOffCopy + kCopyBytes;
// full[], empty[], c_full[], c_empty[], then (hook 4) copy_full
constexpr u32 kNumBars = 2 * kStages + 2 * kCTurns + (kHookCopy ? 1 : 0);
// Grouped GEMM: the groups' first rows (clamped offsets) and the prefix sums of their tile rows, kMaxGroups + 1
// ints each, then the number of work items (and one int of padding).
constexpr u32 kOffGroups = kOffBars + kNumBars * 8;
constexpr u32 kGroupTableBytes = kGrouped ? (2u * (kMaxGroups + 1) + 2u) * 4u : 0u;
constexpr u32 kSmemBytes = kOffGroups + kGroupTableBytes;
constexpr u32 kSmemAlign = 1024;
static_assert(kSmemBytes + kSmemAlign <= 232448, "tile config exceeds 227 KiB of shared memory");

// Hook 3 prefetches the partials of a tile into L2 this many K blocks before the tile's last one: enough
// to cover a DRAM round trip (8 x 64 K at ~0.5 us per 128x256 block), late enough to stay resident.
constexpr int kReducePrefetchKBlocks = 8;
// Column groups of 8 whose partial loads are in flight together (2 registers each; the accumulators hold
// most of the 168 registers a thread may have: 16 and 32 groups spilled at 128x256, 8 did not).
constexpr int kReduceBatchG = kBN / 8 < 8 ? kBN / 8 : 8;
static_assert(!kHookReduce || (kBN / 8) % kReduceBatchG == 0, "reduce batches tile the fragment");
constexpr bool kOutBf16 = FLUXRT_GEMM_OUT == 0;

// Type selection at compile time (NVRTC has no <type_traits>).
template <bool C, class T, class F>
struct Select {
    using type = T;
};
template <class T, class F>
struct Select<false, T, F> {
    using type = F;
};

// The 16-bit element type of C (fluxrt/types.cuh): packs fp32 pairs for the 16-bit outputs, and is the
// element type of hook 3's partials (16-bit C only).
using Out16 = Select<kOutBf16, fluxrt::BF16, fluxrt::F16>::type;

}  // namespace fluxrt_sm90
