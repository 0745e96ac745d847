// fluxrt Hopper GEMM (sm_90a): C[M,N] = A[M,K] @ B, fp32 accumulate.
//
//   A  row-major [M, K] (K-major), bf16 or fp16
//   B  row-major [K, N] (MN-major, FLUXRT_GEMM_B_KMAJOR=0) or [N, K] ("trans_b", K-major, =1)
//   C  row-major [M, N], bf16 / fp16 / fp32
//
// One CTA = 1 producer warpgroup + FLUXRT_GEMM_CONSUMERS consumer warpgroups, persistent over tiles:
//
//   producer WG, warp 0, lane 0  "loader":  [hook 1: wait for A's chunk flag]  TMA A,B -> smem ring
//   producer WG, warp 2, lane 0  "copier":  [hook 4 only] copies A's own rows from their source into A,
//                                           16 KiB at a time through its own smem buffer (not the ring)
//   producer WG, warp 1, lane 0  "storer":  C staging smem -> global by TMA store: into C, or with hook 2
//                                           into the tile's chunk destination (a peer's buffer), then
//                                           a per-tile flag
//   consumer WG c                "math":    wgmma on rows [64c, 64c+64) of the tile, [hook 3: + other
//                                           sources' partials of the tile], then registers -> C staging smem;
//                                           [hook 3 tail: after its last tile, each warp reduces 16-row
//                                           slabs of the reduced chunk, claimed one at a time]
//
// Pipeline objects (all in shared memory):
//   full[s]   loader -> math    stage s holds A,B of one K block   (1 arrival + TMA transaction bytes)
//   empty[s]  math -> loader    stage s may be overwritten         (1 arrival per consumer WG)
//   c_full    math -> storer    C staging holds a finished tile     (every consumer thread arrives)
//   c_empty   storer -> math    C staging may be overwritten        (1 arrival, storer lane 0)
//   With FLUXRT_GEMM_C_SHARED=1 the consumers share one staging region and take turns: one c_full[c] /
//   c_empty[c] pair per consumer c, passing a single token (see kCTurns and the consumer's epilogue).
// Every barrier follows the phase-parity protocol: the k-th completion of a barrier flips its phase;
// a waiter for "completion number k" waits on parity (k & 1). Producers of a free slot start by waiting
// on parity 1, which a freshly initialised barrier reports as already complete.
//
// Compile-time configuration (the Python side passes these as -D macros; one module per config so
// that the kernel name `fluxrt_gemm` stays stable):
//   FLUXRT_GEMM_BN            tile N (64..256, multiple of 64)           default 256
//   FLUXRT_GEMM_CONSUMERS     consumer warpgroups; tile M = 64 * this    default 2
//   FLUXRT_GEMM_STAGES        smem ring depth                            default 3
//   FLUXRT_GEMM_IN            0 bf16, 1 fp16                             default 0
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
//   FLUXRT_GEMM_CLUSTER       CTAs per cluster (1 or 2). With 2, the pair computes two M tiles of the
//                             same N tile, and each CTA loads half of the shared B tile and multicasts
//                             it to both: L2 -> SM traffic per tile drops from A+B to A+B/2.  default 1
//   FLUXRT_GEMM_BANDS         rows in bands (the fused ops' padded calls): the GEMM's M rows are bands of
//                             band_rows = chunk_rows * chunks_per_peer rows, of which an operand holds only
//                             the first `rows` (its 3-D tensor map [bands][rows][cols]); GEMM row y is row
//                             y % band_rows of band y / band_rows. Bit 0: A (rows past `rows` load as zeros,
//                             TMA's out-of-bounds fill); bit 1: C (rows past `rows` are not written, TMA
//                             clips them). A tile never straddles two bands (band_rows % kBM == 0). default 0
// With both hooks 0 the hook code is not compiled (if constexpr), and the hook arguments are ignored.
#include <fluxrt/comm.cuh>

// Spelled relative to kernels/include (always on the include path) so that NVRTC, which compiles the
// source from memory without its directory, finds them too. The cubin cache key covers the headers
// beside a source (fluxrt.toolchain), so edits of these change it.
#include "../gemm/sm90_primitives.cuh"
#include "../gemm/wgmma_ops.cuh"

#ifndef FLUXRT_GEMM_BN
#define FLUXRT_GEMM_BN 256
#endif
#ifndef FLUXRT_GEMM_CONSUMERS
#define FLUXRT_GEMM_CONSUMERS 2
#endif
#ifndef FLUXRT_GEMM_STAGES
#define FLUXRT_GEMM_STAGES 3
#endif
#ifndef FLUXRT_GEMM_IN
#define FLUXRT_GEMM_IN 0
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
#ifndef FLUXRT_GEMM_BANDS
#define FLUXRT_GEMM_BANDS 0
#endif
#ifndef FLUXRT_GEMM_C_SHARED
#define FLUXRT_GEMM_C_SHARED 0
#endif

namespace fluxrt_sm90 {

// ---------------------------------------------------------------------------------------------
// Configuration constants (sizes in elements unless the name says bytes).
constexpr int kConsumers = FLUXRT_GEMM_CONSUMERS;
constexpr int kRowsPerConsumer = 64;                       // wgmma M
constexpr int kBM = kRowsPerConsumer * kConsumers;          // tile rows
constexpr int kBN = FLUXRT_GEMM_BN;                         // tile cols (= wgmma N)
constexpr int kBK = 64;                                     // 64 x 2 B = one 128-byte swizzled row
constexpr int kStages = FLUXRT_GEMM_STAGES;
constexpr int kWgmmaK = 16;                                 // K per wgmma instruction (16-bit inputs)
constexpr int kInBytes = 2;
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
constexpr unsigned short kClusterMask = (1u << kCluster) - 1;  // multicast to every CTA of the cluster
static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
static_assert(!(kEpiDirect && kHookEpilogue), "hook 2 needs the staged (storer-warp) epilogue");
static_assert(!kHookReduce || (kHookEpilogue && FLUXRT_GEMM_OUT != 2), "hook 3 needs hook 2 and 16-bit partials");
static_assert(!kHookCopy || kHookWait, "hook 4 needs hook 1 (its chunk geometry)");
constexpr bool kBandsA = (FLUXRT_GEMM_BANDS & 1) != 0;
constexpr bool kBandsC = (FLUXRT_GEMM_BANDS & 2) != 0;
static_assert(!(kBandsA && kHookCopy), "hook 4 stores A's own rows through the 2-D map of A");
static_assert(!(kBandsC && (kHookEpilogue || kEpiDirect)), "banded C is C itself, stored by the storer warp");

constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kAccRegs = kBN / 2;                           // fp32 accumulators per consumer thread

constexpr u32 kTileABytes = kBM * kBK * kInBytes;           // 16 KiB for BM = 128
constexpr u32 kTileBBytes = kBN * kBK * kInBytes;           // 32 KiB for BN = 256
constexpr u32 kStageBytes = kTileABytes + kTileBBytes;      // TMA transaction bytes per stage
constexpr u32 kBAtomBytes = 64 * kBK * kInBytes;            // MN-major B: one 64-column slab (8 KiB)

// C staging: per consumer, [kBN / kCCols column slabs][64 rows][128 B], 128B-swizzled, so that the
// fragment writes from registers are bank-conflict free and the layout matches the TMA store box.
constexpr int kCCols = 128 / kOutBytes;                     // columns per 128-byte slab
constexpr u32 kCSlabBytes = kRowsPerConsumer * 128;         // 8 KiB
constexpr u32 kCConsumerBytes = (kBN / kCCols) * kCSlabBytes;
// Shared C staging (FLUXRT_GEMM_C_SHARED=1 with 2 consumers): ONE consumer-sized region, which the
// consumers fill in turn and the storer drains once per consumer ("turn") per tile, each turn with its
// own c_full[turn] / c_empty[turn] pair. Otherwise: one region per consumer, one turn per tile covering
// every consumer, one barrier pair. With one consumer the two layouts are the same: the option is a no-op.
static_assert(!(FLUXRT_GEMM_C_SHARED && kEpiDirect), "shared C staging needs the staged (storer-warp) epilogue");
constexpr bool kCShared = FLUXRT_GEMM_C_SHARED != 0 && kConsumers > 1;
constexpr int kCSlots = kCShared ? 1 : kConsumers;            // consumer-sized staging regions
constexpr int kCTurns = kCShared ? kConsumers : 1;            // storer turns per tile = c_full/c_empty pairs
constexpr int kConsumersPerTurn = kConsumers / kCTurns;
constexpr int kTurnRows = kConsumersPerTurn * kRowsPerConsumer;
constexpr u32 kCBytes = kEpiDirect ? 0u : kCSlots * kCConsumerBytes;
// Consumer wg: its storer turn (index of its c_full / c_empty pair) and its staging region.
__host__ __device__ constexpr int c_turn_of(int wg) { return kCShared ? wg : 0; }
__host__ __device__ constexpr int c_slot_of(int wg) { return kCShared ? 0 : wg; }

// Register split (setmaxnreg): the producer warpgroup keeps few, the math warpgroups get the rest of
// the 64K-register file. Both must be multiples of 8.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegsRaw = (65536 - 128 * kProducerRegs) / (128 * kConsumers);
constexpr int kConsumerRegs = (kConsumerRegsRaw >= 240 ? 240 : kConsumerRegsRaw) / 8 * 8;
// With one consumer (256 threads) every warp can keep the compile-time maximum: no redistribution.
constexpr bool kRebalanceRegs = kConsumers == 2;

static_assert(kBN % 64 == 0 && kBN >= 64 && kBN <= 256, "tile N must be 64, 128, 192 or 256");
static_assert(kConsumers == 1 || kConsumers == 2, "1 or 2 consumer warpgroups");
static_assert(kStages >= 2, "at least a double-buffered ring");
static_assert(kBN % kCCols == 0, "C staging slabs");

// Shared-memory layout, offsets from a 1024-byte aligned base (128B swizzle atoms need that).
constexpr u32 kOffA = 0;
constexpr u32 kOffB = kOffA + kStages * kTileABytes;
constexpr u32 kOffC = kOffB + kStages * kTileBBytes;
constexpr u32 kCopyBytes = kHookCopy ? kTileABytes : 0u;  // hook 4: the copier's buffer (one A piece)
constexpr u32 kOffCopy = kOffC + kCBytes;
constexpr u32 kOffBars = kOffCopy + kCopyBytes;
// full[], empty[], c_full[], c_empty[], then (hook 4) copy_full
constexpr u32 kNumBars = 2 * kStages + 2 * kCTurns + (kHookCopy ? 1 : 0);
constexpr u32 kSmemBytes = kOffBars + kNumBars * 8;
constexpr u32 kSmemAlign = 1024;
static_assert(kSmemBytes + kSmemAlign <= 232448, "tile config exceeds 227 KiB of shared memory");

// ---------------------------------------------------------------------------------------------
// Tile scheduler. Work items are (slot row, n_tile) of a [m_slots, n_tiles] grid, one slot row = kCluster
// consecutive M tiles (one per CTA of a cluster, which share the B tile). A cluster takes items
// t = cluster id, + number of clusters, ...; item t -> (slot row, n_tile):
//   order_table != nullptr: packed (row << 16 | n) per t (Hilbert curve, computed on the host);
//   otherwise grouped order: bands of `group_m` slot rows, column by column inside a band.
// The CTA's tile is m_tile = row * kCluster + cluster rank; then the rank offset rotates the rows:
// m_tile = (m_tile + m_tile_offset) % m_tiles, so a rank starts at its own shard of A (AllGather+GEMM)
// or at the rows the next peer owns (GEMM+ReduceScatter).
struct Schedule {
    int m_tiles, n_tiles, m_slots, total;
    int group_m, m_tile_offset;
    int first, stride;          // this cluster's first item, number of clusters
    int cta_rank;               // rank in the cluster
    const u32* order_table;

    // Returns false for the phantom tile of an odd m_tiles (cluster of 2, last slot row): that CTA still
    // runs the pipeline on a real tile's rows, so that its half of B reaches the peer, but stores nothing.
    __device__ __forceinline__ bool tile(int t, int& m_tile, int& n_tile) const {
        int row, n;
        if (order_table != nullptr) {
            const u32 packed = __ldg(order_table + t);
            row = (int)(packed >> 16);
            n = (int)(packed & 0xFFFFu);
        } else {
            const int per_group = group_m * n_tiles;
            const int g = t / per_group;
            const int first_row = g * group_m;
            const int rows = min(m_slots - first_row, group_m);
            const int r = t - g * per_group;
            row = first_row + r % rows;
            n = r / rows;
        }
        int m = row * kCluster + cta_rank;
        const bool real = m < m_tiles;
        if (!real) m = row * kCluster;
        m += m_tile_offset;
        if (m >= m_tiles) m -= m_tiles;
        m_tile = m;
        n_tile = n;
        return real;
    }
};

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

// Hook arguments (ignored unless the matching FLUXRT_GEMM_HOOK_* is 1).
struct HookArgs {
    // hook 1: arrival wait
    const u64* arrival_flags;   // one word per chunk of `chunk_rows` rows of A
    u64 epoch;                  // wait until flag >= epoch
    int chunk_rows;             // rows per chunk (a multiple of the tile M)
    int chunks_per_peer;        // chunk / chunks_per_peer = the peer reported on timeout
    u64 timeout_ns;
    fluxrt::ErrorRecord* err;
    u32 op_id, rank;
    // hook 2: tile epilogue
    const TmaDesc* dst_tmaps;   // per chunk: tensor map of its destination, row 0 = the chunk's first row
                                //   (global memory, 64-byte aligned; box as tmap_c's)
    u64* const* flag_table;     // per chunk: one flag word per tile (local_m_tile * n_tiles + n), or with
    int flag_group_n;           //   flag_group_n > 0 one per group of that many n tiles (n / flag_group_n): a
                                //   counter of the group's finished tiles across the chunk's rows (signal_add)
    u64 signal_value;
    int signal_add;             // 0: flag = signal_value (release store); 1: flag += signal_value
    // hook 3: reduce chunk `red_chunk` in the epilogue (timeouts use timeout_ns, err and rank above)
    int red_chunk;              // the chunk reduced here; source red_chunk is this GEMM (the accumulator)
    const char* red_partials;   // source s's partial of the chunk's rows at + s * red_source_bytes,
    long long red_source_bytes; //   row-major, red_ld elements per row, C's element type
    long long red_ld;
    u32 red_sources;            // sources 0 .. red_sources - 1 (at most 128: one waiting thread each)
    u64* red_flags;             // source s's flags at + s * red_flag_stride: per tile (local_m_tile *
    long long red_flag_stride;  //   n_tiles + n) or with red_group_n > 0 per group of n tiles (n / red_group_n)
    int red_group_n;
    u64 red_epoch;              // a partial is in place once its flag >= red_epoch
    u32 red_op_id;
    char* red_out;              // tail mode: the reduced chunk, [chunk rows, N] row-major, C's type
    u32* red_counter;           // tail mode: slab claims; 0 before the launch, reset to 0 by the last claim
    // hook 4: own rows of A from a separate source, copied into A during the GEMM
    const TmaDesc* tmap_a_own;  // [own_rows, K], row 0 = A's row own_row0 (box as tmap_a's)
    int own_row0, own_rows;     // whole chunks of chunk_rows
    u64* copy_counters;         // one per own chunk: += pieces of it stored into A (chunk_rows / kBM x
                                //   K blocks in all per call)

    // FLUXRT_GEMM_BANDS: rows per band
    __device__ __forceinline__ int band_rows() const { return chunk_rows * chunks_per_peer; }

    __device__ __forceinline__ bool own_rows_of(int m0) const {
        return kHookCopy && m0 >= own_row0 && m0 < own_row0 + own_rows;
    }
};

// Hook 3 prefetches the partials of a tile into L2 this many K blocks before the tile's last one: enough
// to cover a DRAM round trip (8 x 64 K at ~0.5 us per 128x256 block), late enough to stay resident.
constexpr int kReducePrefetchKBlocks = 8;
// Column groups of 8 whose partial loads are in flight together (2 registers each; the accumulators hold
// most of the 168 registers a thread may have: 16 and 32 groups spilled at 128x256, 8 did not).
constexpr int kReduceBatchG = kBN / 8 < 8 ? kBN / 8 : 8;
static_assert((kBN / 8) % kReduceBatchG == 0, "reduce batches tile the fragment");

// ---------------------------------------------------------------------------------------------
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

// Byte offset of element (row, col) of one consumer's C staging (128B swizzle: the 16-byte unit index
// inside a 128-byte row is XORed with row % 8, matching CU_TENSOR_MAP_SWIZZLE_128B).
__device__ __forceinline__ u32 c_stage_offset(int row, int col) {
    const u32 slab = (u32)(col / kCCols);
    const u32 byte_in_row = (u32)(col % kCCols) * kOutBytes;
    const u32 unit = (byte_in_row >> 4) ^ (u32)(row & 7);
    return slab * kCSlabBytes + (u32)row * 128u + (unit << 4) + (byte_in_row & 15u);
}

// ---------------------------------------------------------------------------------------------
// Hook 3 (reduce one chunk in the epilogue). Partials are C's element type.
constexpr bool kOutBf16 = FLUXRT_GEMM_OUT == 0;

// Row of the partials (chunk-local) where consumer wg's 64 rows of global m tile m_tile start.
__device__ __forceinline__ long long reduce_row0(const HookArgs& h, int m_tile, int wg) {
    return (long long)m_tile * kBM - (long long)h.red_chunk * h.chunk_rows + wg * kRowsPerConsumer;
}

// Ahead of the epilogue: bring this consumer's rows of every other source's partial of the tile into L2
// (bulk prefetch: no registers, nothing to wait for). Safe before the partial's flag is up: L2 is the
// point of coherence of this GPU's memory, so a copy engine or peer writing the bytes later updates the
// prefetched lines; it only saves the DRAM latency of the loads in reduce_into_acc.
__device__ __forceinline__ void reduce_prefetch(const HookArgs& h, int m_tile, int n_tile, int N, int wg, int tid) {
    const int n0 = n_tile * kBN;
    const u32 bytes = (u32)(min(kBN, N - n0) * kOutBytes);   // N * kOutBytes % 16 == 0 (TMA rule): so is this
    const long long row0 = reduce_row0(h, m_tile, wg);
    for (int i = tid; i < kRowsPerConsumer * (int)h.red_sources; i += 128) {
        const int s = i / kRowsPerConsumer, r = i % kRowsPerConsumer;
        if (s != h.red_chunk)
            prefetch_l2(h.red_partials + s * h.red_source_bytes + ((row0 + r) * h.red_ld + n0) * kOutBytes, bytes);
    }
}

// In the epilogue: acc += every other source's partial of this thread's fragment (rows 16w + l/4 (+8),
// column pairs 8g + 2(l%4), as in the staging writes).
//   Stage 1, wait: thread s of the warpgroup spins (bounded, acquire.sys) on source s's flag of the tile;
//     on timeout the error record names the source and the sum uses whatever is there (no hang).
//   Stage 2, sum: each thread acquires the flags itself (already up: no spin), which orders its loads
//     after the sources' releases independently of the barrier; then it adds the sources in fixed order
//     0, 1, ... (its own accumulator first) in fp32: the same bits whatever order the partials arrived in.
__device__ __forceinline__ void reduce_into_acc(float (&acc)[kAccRegs], const HookArgs& h, int m_tile, int n_tile,
                                                int n_tiles, int N, int wg, int tid) {
    const int local_m_tile = m_tile - h.red_chunk * (h.chunk_rows / kBM);
    const long long flag = h.red_group_n > 0 ? n_tile / h.red_group_n : (long long)local_m_tile * n_tiles + n_tile;
    if (tid < (int)h.red_sources && tid != h.red_chunk)
        fluxrt::wait_ge(h.red_flags + tid * h.red_flag_stride + flag, h.red_epoch, h.timeout_ns, h.err, h.red_op_id,
                        h.rank, (u64)tid);
    named_bar_sync(1 + wg, 128);   // this consumer warpgroup only (ids 1, 2; 0 is __syncthreads)
    const int warp = tid >> 5, lane = tid & 31;
    const long long row = reduce_row0(h, m_tile, wg) + warp * 16 + (lane >> 2);
    const int col = n_tile * kBN + (lane & 3) * 2;
    for (u32 s = 0; s < h.red_sources; ++s) {
        if ((int)s == h.red_chunk) continue;
        (void)fluxrt::ld_acquire_sys(h.red_flags + s * h.red_flag_stride + flag);
        // rows r and r + 8 of the fragment; column group g is 8 * g elements further (an immediate offset)
        const char* rows[2] = {h.red_partials + s * h.red_source_bytes + (row * h.red_ld + col) * kOutBytes,
                               h.red_partials + s * h.red_source_bytes + ((row + 8) * h.red_ld + col) * kOutBytes};
#pragma unroll
        for (int g0 = 0; g0 < kBN / 8; g0 += kReduceBatchG) {
            u32 v[kReduceBatchG][2];   // a batch of loads in flight at once, then its adds
#pragma unroll
            for (int g = 0; g < kReduceBatchG; ++g)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    v[g][hh] = col + 8 * (g0 + g) < N ? ld_cg_u32(rows[hh] + 8 * (g0 + g) * kOutBytes) : 0u;
#pragma unroll
            for (int g = 0; g < kReduceBatchG; ++g)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    acc[4 * (g0 + g) + 2 * hh] += fluxrt::pair_lo<kOutBf16>(v[g][hh]);
                    acc[4 * (g0 + g) + 2 * hh + 1] += fluxrt::pair_hi<kOutBf16>(v[g][hh]);
                }
        }
    }
}

// Hook 3, tail mode: after its last tile, every consumer warp reduces slabs of kTailSlabRows rows x kBN
// columns of chunk red_chunk. A slab's tile is done by some CTA of this GEMM (its storer stored it into
// source red_chunk's slot of the partials and released that source's per-tile flag); the other sources'
// partials were delivered beside the GEMM (flags per tile, or per group of red_group_n tile columns).
// Slabs are numbered in schedule order of their tiles (the chunk's tiles are one contiguous run of the
// schedule; the host checks), so warps that run out of tiles first take the slabs of the earliest tiles.
//   Claim: lane 0 takes the next slab number (atomicAdd on red_counter). Every warp claims until it draws
//     a number past the last slab, once: the claims of a launch are slabs + claimers, and the warp that
//     draws the very last number knows every other claim is done and resets the counter for the next
//     launch (stream order publishes the reset).
//   Wait: lane s spins (bounded, acquire.sys) on source s's flag of the slab's tile; on timeout the error
//     record names the source and the slab is summed from whatever is there (no hang).
//   Sum: each lane acquires every flag itself (already up), then adds the sources in fixed order 0, 1, ...
//     in fp32 (own source included, read back from memory): bitwise the same result as a reduce kernel
//     after the GEMM, whatever order the partials arrived in.
constexpr int kTailSlabRows = 16;                              // rows per claimed slab
constexpr int kTailSlabs = kBM / kTailSlabRows;                // slabs per tile
constexpr int kTailRowVecs = kBN / 8;                          // 16-byte vectors (8 elements) per tile row
constexpr int kTailVecBatch = 4;                               // vectors per lane whose loads fly together
constexpr int kTailSrcBatch = 4;                               // ... times this many sources (16 x 16 B)
static_assert(kBM % kTailSlabRows == 0 && (kTailSlabRows * kTailRowVecs) % (32 * kTailVecBatch) == 0,
              "tail slabs split evenly over a warp");

__device__ __forceinline__ void run_tail_reduce(const Schedule& sched, int M, int N, const HookArgs& h) {
    const int lane = threadIdx.x & 31;
    const int chunk_tiles = h.chunk_rows / kBM;
    const int first_tile = h.red_chunk * chunk_tiles;
    const int rows = min(h.chunk_rows, M - h.red_chunk * h.chunk_rows);   // the chunk's rows inside C
    const u32 slabs = (u32)(((rows + kBM - 1) / kBM) * sched.n_tiles * kTailSlabs);
    const u32 claimers = gridDim.x * kConsumers * 4;                       // consumer warps of the grid
    // schedule position of the chunk's first tile: rotated row (m_tile_offset) times the row's n tiles
    int first_row = first_tile - sched.m_tile_offset;
    if (first_row < 0) first_row += sched.m_tiles;
    const int t0 = first_row * sched.n_tiles;
    for (;;) {
        u32 slab = 0;
        if (lane == 0) slab = atomicAdd(h.red_counter, 1u);
        slab = __shfl_sync(~0u, slab, 0);
        if (slab >= slabs) {
            if (lane == 0 && slab == slabs + claimers - 1) *h.red_counter = 0u;   // the launch's last claim
            return;
        }
        int m_tile, n_tile;
        sched.tile(t0 + (int)(slab / kTailSlabs), m_tile, n_tile);
        const int local_m_tile = m_tile - first_tile;
        const long long tile_flag = (long long)local_m_tile * sched.n_tiles + n_tile;
        const long long group_flag = h.red_group_n > 0 ? n_tile / h.red_group_n : tile_flag;
        auto flag_of = [&](u32 s) {
            return h.red_flags + s * h.red_flag_stride + ((int)s == h.red_chunk ? tile_flag : group_flag);
        };
        for (u32 s = lane; s < h.red_sources; s += 32)                                  // wait
            fluxrt::wait_ge(flag_of(s), h.red_epoch, h.timeout_ns, h.err, h.red_op_id, h.rank, (u64)s);
        __syncwarp();
        for (u32 s = 0; s < h.red_sources; ++s) (void)fluxrt::ld_acquire_sys(flag_of(s));
        const int row0 = local_m_tile * kBM + (int)(slab % kTailSlabs) * kTailSlabRows;   // chunk-local
        const int n0 = n_tile * kBN;
#pragma unroll 1
        for (int v0 = 0; v0 < kTailSlabRows * kTailRowVecs; v0 += 32 * kTailVecBatch) {   // sum
            float acc[kTailVecBatch][8];
            int row[kTailVecBatch], col[kTailVecBatch];   // chunk-local row, column of the lane's vector j
            bool in_c[kTailVecBatch];                     // N % 8 == 0 (TMA rule): a vector is in or out whole
#pragma unroll
            for (int j = 0; j < kTailVecBatch; ++j) {
                const int v = v0 + lane + 32 * j;   // a warp's 32 lanes read 512 contiguous bytes of one row
                row[j] = row0 + v / kTailRowVecs;
                col[j] = n0 + (v % kTailRowVecs) * 8;
                in_c[j] = row[j] < rows && col[j] < N;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
            }
#pragma unroll 1
            for (u32 s0 = 0; s0 < h.red_sources; s0 += kTailSrcBatch) {
                uint4 x[kTailSrcBatch][kTailVecBatch];   // a batch of loads in flight, then the adds in order
#pragma unroll
                for (int i = 0; i < kTailSrcBatch; ++i)
#pragma unroll
                    for (int j = 0; j < kTailVecBatch; ++j)
                        x[i][j] = s0 + i < h.red_sources && in_c[j]
                                      ? ld_cg_v4(h.red_partials + (s0 + i) * h.red_source_bytes +
                                                 ((long long)row[j] * h.red_ld + col[j]) * kOutBytes)
                                      : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int i = 0; i < kTailSrcBatch; ++i)
#pragma unroll
                    for (int j = 0; j < kTailVecBatch; ++j) {
                        const u32 w[4] = {x[i][j].x, x[i][j].y, x[i][j].z, x[i][j].w};
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            acc[j][2 * e] += fluxrt::pair_lo<kOutBf16>(w[e]);
                            acc[j][2 * e + 1] += fluxrt::pair_hi<kOutBf16>(w[e]);
                        }
                    }
            }
#pragma unroll
            for (int j = 0; j < kTailVecBatch; ++j) {
                if (!in_c[j]) continue;
                u32 o[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    o[e] = kOutBf16 ? pack_bf16x2(acc[j][2 * e], acc[j][2 * e + 1])
                                    : pack_f16x2(acc[j][2 * e], acc[j][2 * e + 1]);
                *reinterpret_cast<uint4*>(h.red_out + ((long long)row[j] * N + col[j]) * kOutBytes) =
                    make_uint4(o[0], o[1], o[2], o[3]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Roles.

// Loader: one thread streams A and B K blocks for this CTA's tiles into the ring.
__device__ __forceinline__ void run_loader(const Schedule& sched, int K, const TmaDesc* tmap_a,
                                           const TmaDesc* tmap_b, u32 smem, u32 bars_full,
                                           u32 bars_empty, const HookArgs& hooks) {
    const int k_blocks = (K + kBK - 1) / kBK;
    int stage = 0;
    u32 phase = 0;
    int waited_chunk = -1;
    for (int t = sched.first; t < sched.total; t += sched.stride) {
        int m_tile, n_tile;
        sched.tile(t, m_tile, n_tile);
        const int m0 = m_tile * kBM, n0 = n_tile * kBN;
        if constexpr (kHookWait) {
            // Hook 1: rows [m0, m0 + kBM) of A come from chunk m0 / chunk_rows, written by a peer (or a
            // copy engine). Acquire its flag at system scope (bounded; on timeout the error record is
            // filled and the tile is computed on whatever is there, so the CTA never hangs), then
            // fence.proxy.async so the TMA (async proxy) reads below observe the data the flag guards.
            const int chunk = m0 / hooks.chunk_rows;
            if (chunk != waited_chunk && !hooks.own_rows_of(m0)) {   // hook 4's own rows are local
                fluxrt::wait_ge(hooks.arrival_flags + chunk, hooks.epoch, hooks.timeout_ns, hooks.err,
                                hooks.op_id, hooks.rank, (u64)(chunk / hooks.chunks_per_peer));
                fluxrt::fence_proxy_async();
                waited_chunk = chunk;
            }
        }
        // hook 4: own rows come from their own source, counted from its row 0
        const bool own = hooks.own_rows_of(m0);
        const TmaDesc* a_map = own ? hooks.tmap_a_own : tmap_a;
        const int a_row = own ? m0 - hooks.own_row0 : m0;
        // banded A: the tile's rows are rows [a_row % band_rows, + kBM) of band a_row / band_rows
        const int a_band = kBandsA ? a_row / hooks.band_rows() : 0;
        const int a_band_row = kBandsA ? a_row - a_band * hooks.band_rows() : a_row;
        for (int kb = 0; kb < k_blocks; ++kb) {
            const u32 full = bars_full + 8 * stage, empty = bars_empty + 8 * stage;
            mbar_wait(empty, phase ^ 1);  // every consumer released this slot (parity protocol above)
            mbar_arrive_expect_tx(full, kStageBytes);
            const int k0 = kb * kBK;
            if constexpr (kBandsA)
                tma_load_3d(smem + kOffA + stage * kTileABytes, a_map, k0, a_band_row, a_band, full);
            else
                tma_load_2d(smem + kOffA + stage * kTileABytes, a_map, k0, a_row, full);
            const u32 b_dst = smem + kOffB + stage * kTileBBytes;
            if constexpr (kBKMajor) {
                // box {64 K, kBN / kCluster rows of N}: with a cluster, this CTA's share of the rows
                if constexpr (kCluster == 1) {
                    tma_load_2d(b_dst, tmap_b, k0, n0, full);
                } else {
                    const int part = (int)sched.cta_rank;
                    tma_load_2d_multicast(b_dst + part * (kTileBBytes / kCluster), tmap_b, k0,
                                          n0 + part * (kBN / kCluster), full, kClusterMask);
                }
            } else {
#pragma unroll
                for (int j = 0; j < kBN / 64; ++j) {  // boxes {64 N, 64 K}: one 128-byte wide slab each
                    if constexpr (kCluster == 1)
                        tma_load_2d(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full);
                    else if (j % kCluster == (int)sched.cta_rank)   // slab j comes from CTA j % kCluster
                        tma_load_2d_multicast(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full,
                                              kClusterMask);
                }
            }
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

// Copier (hook 4): copies A's own rows from their source (tmap_a_own) into A (tmap_a) beside the GEMM,
// through a buffer of its own, so that the ring and the math never wait for it. The rows are cut into
// {kBK x kBM} pieces, numbered chunk by chunk (m tile, then K block); CTA b copies pieces b, b + G, ...
// (G CTAs), so every CTA takes part and chunk 0 is complete first. Per piece:
//   1. arrive.expect_tx(copy_full) + TMA load into the buffer; wait copy_full: the bytes landed
//   2. TMA store of the buffer into A; cp.async.bulk.wait_group.read 0: the buffer may be reloaded
// When the next piece is in another chunk (or none is left): cp.async.bulk.wait_group 0 (the rows are
// written) -> fence.proxy.async -> signal_add (fence.acq_rel.sys + red.release.sys) of this CTA's count
// of pieces to the chunk's counter: a peer that acquires the counter at its total sees the chunk.
__device__ __forceinline__ void run_copier(int K, const TmaDesc* tmap_a, u32 buf, u32 bar, const HookArgs& hooks) {
    const int k_blocks = (K + kBK - 1) / kBK;
    const int pieces_per_chunk = hooks.chunk_rows / kBM * k_blocks;
    const int pieces = hooks.own_rows / kBM * k_blocks;
    u32 phase = 0;
    int count = 0;   // pieces of the current chunk stored by this CTA, not yet signalled
    for (int i = (int)blockIdx.x; i < pieces; i += (int)gridDim.x) {
        const int m0 = i / k_blocks * kBM, k0 = i % k_blocks * kBK;
        mbar_arrive_expect_tx(bar, kTileABytes);                                       // 1
        tma_load_2d(buf, hooks.tmap_a_own, k0, m0, bar);
        mbar_wait(bar, phase);
        phase ^= 1;
        tma_store_2d(tmap_a, buf, k0, hooks.own_row0 + m0);                            // 2
        bulk_commit();
        bulk_wait_read_all();
        ++count;
        const int next = i + (int)gridDim.x;
        if (next >= pieces || next / pieces_per_chunk != i / pieces_per_chunk) {
            bulk_wait_all();
            fluxrt::fence_proxy_async();
            fluxrt::signal_add(hooks.copy_counters + i / pieces_per_chunk, (u64)count);
            count = 0;
        }
    }
}

// Storer: moves finished tiles from C staging to global memory, in kCTurns turns per tile (turn k drains
// the staging of consumers [k * kConsumersPerTurn, (k + 1) * kConsumersPerTurn), i.e. tile rows
// [k * kTurnRows, (k + 1) * kTurnRows)), then hands the staging to the next turn's consumers: c_empty of
// turn k + 1, or of turn 0 (the next tile) after the last turn. One turn: today's single handshake.
__device__ __forceinline__ void run_storer(const Schedule& sched, const TmaDesc* tmap_c, u32 smem, u32 bar_c_full,
                                           u32 bar_c_empty, const HookArgs& hooks) {
    const int lane = threadIdx.x & 31;
    u32 phase = 0;
    for (int t = sched.first; t < sched.total; t += sched.stride) {
        int m_tile, n_tile;
        const bool real = sched.tile(t, m_tile, n_tile);
        const int m0 = m_tile * kBM, n0 = n_tile * kBN;
#pragma unroll
        for (int turn = 0; turn < kCTurns; ++turn) {
            const bool last_turn = turn == kCTurns - 1;
            const u32 bar_next_empty = bar_c_empty + 8 * ((turn + 1) % kCTurns);
            const int row0 = turn * kTurnRows;     // first tile row of this turn
            mbar_wait(bar_c_full + 8 * turn, phase);  // acquire: this turn's staging writes are visible
            if (!real) {                   // phantom tile (see Schedule): nothing to store or signal
                if (lane == 0) mbar_arrive(bar_next_empty);
                __syncwarp();
                continue;
            }
            // Where this turn's rows go: C itself, or (hook 2) the destination of the tile's chunk of rows
            // (e.g. the symmetric buffer of the peer that owns them), whose tensor map counts rows from
            // the chunk's first row. TMA writes peer memory like local memory; it clips rows and columns
            // outside the map, so tails need no code here.
            const TmaDesc* dst = tmap_c;
            int y0 = m0 + row0;
            int chunk = 0;
            bool reduced = false;   // hook 3's chunk: the reduced result goes to C, and no flag
            if constexpr (kHookEpilogue) {
                chunk = m0 / hooks.chunk_rows;
                dst = hooks.dst_tmaps + chunk;
                y0 = m0 - chunk * hooks.chunk_rows + row0;
                if constexpr (kHookReduce) {
                    reduced = chunk == hooks.red_chunk;
                    if (reduced && kReduceEpilogue) dst = tmap_c;   // tail mode: to the chunk's destination
                }
            }
            if (lane == 0) {
                // One box per (consumer, 128-byte column slab). The consumers issued
                // fence.proxy.async.shared::cta after writing the staging, before arriving on c_full.
#pragma unroll
                for (int c = 0; c < kConsumersPerTurn; ++c)
#pragma unroll
                    for (int j = 0; j < kBN / kCCols; ++j) {
                        if constexpr (kBandsC)   // GEMM row y: row y % band_rows of band y / band_rows (TMA clips the rest)
                            tma_store_3d(dst, smem + kOffC + c * kCConsumerBytes + j * kCSlabBytes, n0 + j * kCCols,
                                         (y0 + c * kRowsPerConsumer) % hooks.band_rows(),
                                         (y0 + c * kRowsPerConsumer) / hooks.band_rows());
                        else
                            tma_store_2d(dst, smem + kOffC + c * kCConsumerBytes + j * kCSlabBytes, n0 + j * kCCols,
                                         y0 + c * kRowsPerConsumer);
                    }
                bulk_commit();
                bulk_wait_read_all();   // staging has been read: the next turn's consumers may overwrite it
                mbar_arrive(bar_next_empty);
                if constexpr (kHookEpilogue) {
                    // Per-tile release, after the last turn (the flag covers every row of the tile): the
                    // chunk's flag table, or in hook 3's tail mode for the reduced chunk its own source's
                    // per-tile flag (the tail reducers wait for it); the epilogue-reduced chunk has none.
                    const int local_m_tile = (m0 - chunk * hooks.chunk_rows) / kBM;
                    const long long tile_idx = (long long)local_m_tile * sched.n_tiles + n_tile;
                    u64* flag = nullptr;
                    if (reduced) {
                        if (kReduceTail) flag = hooks.red_flags + chunk * hooks.red_flag_stride + tile_idx;
                    } else if (hooks.flag_table != nullptr) {
                        flag = hooks.flag_table[chunk] + (hooks.flag_group_n > 0 ? n_tile / hooks.flag_group_n : tile_idx);
                    }
                    if (last_turn && flag != nullptr) {
                        bulk_wait_all();              // 1. every turn's stores of this tile have completed
                        fluxrt::fence_proxy_async();  // 2. those async-proxy writes before generic ops below
                        // 3. fence.acq_rel.sys + release store: a reader that acquires the flag sees the tile
                        if (reduced) fluxrt::signal_set(flag, hooks.red_epoch);
                        else if (hooks.signal_add) fluxrt::signal_add(flag, hooks.signal_value);
                        else fluxrt::signal_set(flag, hooks.signal_value);
                    }
                }
            }
            __syncwarp();
        }
        phase ^= 1;
    }
    if (lane == 0) bulk_wait_all();  // the last stores are complete before the CTA retires
}

// Math: one consumer warpgroup computes rows [64 * wg, 64 * wg + 64) of each tile. bar_c_full / bar_c_empty:
// the pair of its storer turn (c_turn_of(wg)).
__device__ __forceinline__ void run_consumer(const Schedule& sched, int M, int N, int K, int wg, u32 smem,
                                             char* smem_generic, u32 bars_full, u32 bars_empty,
                                             u32 bar_c_full, u32 bar_c_empty, char* c_direct,
                                             const HookArgs& hooks) {
    const int tid = threadIdx.x & 127;  // thread within the warpgroup
    const int k_blocks = (K + kBK - 1) / kBK;
    float acc[kAccRegs];
    int stage = 0;
    u32 phase = 0;
    u32 c_phase = c_turn_of(wg) == 0 ? 0u : 1u;   // see the parities at the epilogue below
    const u32 a_rows_offset = (u32)wg * kRowsPerConsumer * kBK * kInBytes;  // 8 KiB per consumer
    const int prefetch_kb = k_blocks > kReducePrefetchKBlocks ? k_blocks - kReducePrefetchKBlocks : 0;
    for (int t = sched.first; t < sched.total; t += sched.stride) {
        int prev_stage = 0;
        int m_tile = 0, n_tile = 0;
        bool reduce_tile = false;   // hook 3 (epilogue mode): the tile belongs to the reduced chunk
        if constexpr (kReduceEpilogue)
            reduce_tile = sched.tile(t, m_tile, n_tile) && m_tile * kBM / hooks.chunk_rows == hooks.red_chunk;
        for (int kb = 0; kb < k_blocks; ++kb) {
            mbar_wait(bars_full + 8 * stage, phase);  // acquire: TMA bytes of this stage have landed
            const u32 a_base = smem + kOffA + stage * kTileABytes + a_rows_offset;
            const u32 b_base = smem + kOffB + stage * kTileBBytes;
            wgmma_fence();  // accumulator registers written before (epilogue reads, previous MMAs) -> wgmma
#pragma unroll
            for (int kk = 0; kk < kBK / kWgmmaK; ++kk) {
                const u64 da = desc_kmajor(a_base + kk * kWgmmaK * kInBytes);
                const u64 db = kBKMajor ? desc_kmajor(b_base + kk * kWgmmaK * kInBytes)
                                        : desc_mnmajor(b_base + kk * kWgmmaK * 128u, kBAtomBytes);
                TileMma::run(acc, da, db, (kb > 0 || kk > 0) ? 1 : 0);  // first MMA of a tile: D = A*B
            }
            wgmma_commit();
            if constexpr (kReduceEpilogue) {
                if (reduce_tile && kb == prefetch_kb) reduce_prefetch(hooks, m_tile, n_tile, N, wg, tid);
            }
            // Keep one group in flight: when the previous K block's group has retired, its stage's
            // smem is no longer read by the tensor cores and goes back to the loader.
            if (kb > 0) {
                wgmma_wait<1>();
                release_stage(bars_empty + 8 * prev_stage, tid);
            }
            prev_stage = stage;
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
        wgmma_wait<0>();  // all MMAs of the tile retired: accumulators final
        reg_fence(acc);
        if (k_blocks > 0) release_stage(bars_empty + 8 * prev_stage, tid);

        // Fragment layout of m64nNk16 f32: thread (warp w, lane l) holds rows 16w + l/4 (+8) and
        // column pairs 8g + 2(l%4), g < N/8.
        const int warp = tid >> 5, lane = tid & 31;
        if constexpr (kEpiDirect) {
            // Registers -> global, pairs of adjacent columns; two consecutive g fill a 32-byte sector.
            int m_tile, n_tile;
            const bool real = sched.tile(t, m_tile, n_tile);
            const int row0 = m_tile * kBM + wg * kRowsPerConsumer + warp * 16 + (lane >> 2);
            const int col0 = n_tile * kBN + (lane & 3) * 2;
#pragma unroll
            for (int g = 0; g < kBN / 8; ++g) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row0 + 8 * h, col = col0 + 8 * g;
                    if (real && row < M && col < N) {   // N is even: the pair is in or out as a whole
                        const float v0 = acc[4 * g + 2 * h], v1 = acc[4 * g + 2 * h + 1];
                        char* p = c_direct + ((long long)row * N + col) * kOutBytes;
                        if constexpr (FLUXRT_GEMM_OUT == 2) *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
                        else if constexpr (FLUXRT_GEMM_OUT == 1) *reinterpret_cast<u32*>(p) = pack_f16x2(v0, v1);
                        else *reinterpret_cast<u32*>(p) = pack_bf16x2(v0, v1);
                    }
                }
            }
            continue;
        }
        // Epilogue: registers -> C staging (this consumer's 64 rows), in storer turn k = c_turn_of(wg).
        // Parities, for this CTA's i-th tile (i = 0, 1, ...; protocol at the top of the file):
        //   c_full[k] completes once per tile (completion i: turn k's consumers wrote tile i);
        //   c_empty[k] completes once per tile when the storer has drained the turn BEFORE k (turn k - 1 of
        //   tile i, or for k = 0 the last turn of tile i - 1): it passes the staging token to turn k.
        //   Turn 0 writes tile i after completion i - 1 of c_empty[0]: parity (i - 1) & 1 = (i & 1) ^ 1;
        //   for i = 0 that is parity 1, which a fresh barrier reports complete (turn 0 starts with the token).
        //   Turn k > 0 (shared staging only) writes tile i after completion i of c_empty[k]: parity i & 1;
        //   for i = 0 parity 0, which a fresh barrier does NOT report: it waits until turn k - 1 is drained.
        //   Hence c_phase starts at 0 for turn 0 and at 1 for turns > 0, and the wait is on c_phase ^ 1.
        //   No barrier runs two phases ahead of its waiter: the token is single, and each completion of the
        //   ring c_empty[0] -> c_full[0] -> c_empty[1] -> c_full[1] -> c_empty[0] (next tile) needs the
        //   previous one.
        // With one turn (per-consumer staging) this is the single c_full / c_empty handshake.
        // Hook 3 first: its loads overlap the storer draining the previous tile.
        if constexpr (kReduceEpilogue) {
            if (reduce_tile) reduce_into_acc(acc, hooks, m_tile, n_tile, sched.n_tiles, N, wg, tid);
        }
        mbar_wait(bar_c_empty, c_phase ^ 1);  // the storer finished reading the staging (token passed)
        c_phase ^= 1;
        char* c_base = smem_generic + kOffC + c_slot_of(wg) * kCConsumerBytes;
#pragma unroll
        for (int g = 0; g < kBN / 8; ++g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp * 16 + (lane >> 2) + 8 * h;
                const int col = g * 8 + (lane & 3) * 2;
                const float v0 = acc[4 * g + 2 * h], v1 = acc[4 * g + 2 * h + 1];
                char* p = c_base + c_stage_offset(row, col);
                if constexpr (FLUXRT_GEMM_OUT == 2) {
                    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
                } else if constexpr (FLUXRT_GEMM_OUT == 1) {
                    *reinterpret_cast<u32*>(p) = pack_f16x2(v0, v1);
                } else {
                    *reinterpret_cast<u32*>(p) = pack_bf16x2(v0, v1);
                }
            }
        }
        fence_proxy_async_smem();  // generic st.shared above -> visible to the TMA store (async proxy)
        mbar_arrive(bar_c_full);  // release.cta: staging writes visible to the storer after its wait
    }
    if constexpr (kReduceTail) run_tail_reduce(sched, M, N, hooks);
}

}  // namespace fluxrt_sm90

using namespace fluxrt_sm90;

// ---------------------------------------------------------------------------------------------
// Entry point. Launch with gridDim.x = kCluster * min(co-resident clusters, work items) (persistent),
// blockDim.x = fluxrt_gemm_threads,
// dynamic shared memory = fluxrt_gemm_smem_bytes (see the constants exported below).
#if FLUXRT_GEMM_CLUSTER > 1
#define FLUXRT_GEMM_CLUSTER_DIMS __cluster_dims__(FLUXRT_GEMM_CLUSTER, 1, 1)
#else
#define FLUXRT_GEMM_CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(kThreads, 1) FLUXRT_GEMM_CLUSTER_DIMS
fluxrt_gemm(const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b,
            const __grid_constant__ TmaDesc tmap_c, int M, int N, int K,
            const u32* order_table, int group_m, int m_tile_offset,
            const u64* arrival_flags, u64 epoch, int chunk_rows, int chunks_per_peer, u64 timeout_ns,
            fluxrt::ErrorRecord* err, u32 op_id, u32 rank,
            const TmaDesc* dst_tmaps, u64* const* flag_table, int flag_group_n, u64 signal_value,
            int signal_add, void* c_direct,
            int red_chunk, const char* red_partials, long long red_source_bytes, long long red_ld, u32 red_sources,
            u64* red_flags, long long red_flag_stride, int red_group_n, u64 red_epoch, u32 red_op_id,
            const __grid_constant__ TmaDesc tmap_a_own, int own_row0, int own_rows, u64* copy_counters,
            char* red_out, u32* red_counter) {
    extern __shared__ char smem_raw[];
    // Align the dynamic smem base to 1024 B (128B-swizzle atoms; the host adds kSmemAlign bytes).
    const u32 raw = smem_addr(smem_raw);
    const u32 pad = (kSmemAlign - (raw & (kSmemAlign - 1))) & (kSmemAlign - 1);
    char* smem_generic = smem_raw + pad;
    const u32 smem = raw + pad;
    const u32 bars_full = smem + kOffBars;
    const u32 bars_empty = bars_full + 8 * kStages;
    const u32 bar_c_full = bars_empty + 8 * kStages;     // c_full[kCTurns]
    const u32 bar_c_empty = bar_c_full + 8 * kCTurns;    // c_empty[kCTurns]

    Schedule sched;
    sched.m_tiles = (M + kBM - 1) / kBM;
    sched.n_tiles = (N + kBN - 1) / kBN;
    sched.m_slots = (sched.m_tiles + kCluster - 1) / kCluster;
    sched.total = sched.m_slots * sched.n_tiles;
    sched.group_m = group_m >= kCluster ? group_m / kCluster : 1;   // group_m counts tile rows
    sched.m_tile_offset = m_tile_offset % sched.m_tiles;
    sched.first = (int)(blockIdx.x / kCluster);
    sched.stride = (int)(gridDim.x / kCluster);
    sched.cta_rank = kCluster > 1 ? (int)cluster_ctarank() : 0;
    sched.order_table = order_table;

    HookArgs hooks;
    hooks.arrival_flags = arrival_flags;
    hooks.epoch = epoch;
    hooks.chunk_rows = chunk_rows > 0 ? chunk_rows : M;
    hooks.chunks_per_peer = chunks_per_peer > 0 ? chunks_per_peer : 1;
    hooks.timeout_ns = timeout_ns;
    hooks.err = err;
    hooks.op_id = op_id;
    hooks.rank = rank;
    hooks.dst_tmaps = dst_tmaps;
    hooks.flag_table = flag_table;
    hooks.flag_group_n = flag_group_n;
    hooks.signal_value = signal_value;
    hooks.signal_add = signal_add;
    hooks.red_chunk = red_chunk;
    hooks.red_partials = red_partials;
    hooks.red_source_bytes = red_source_bytes;
    hooks.red_ld = red_ld;
    hooks.red_sources = red_sources;
    hooks.red_flags = red_flags;
    hooks.red_flag_stride = red_flag_stride;
    hooks.red_group_n = red_group_n;
    hooks.red_epoch = red_epoch;
    hooks.red_op_id = red_op_id;
    hooks.red_out = red_out;
    hooks.red_counter = red_counter;
    hooks.tmap_a_own = &tmap_a_own;
    hooks.own_row0 = own_row0;
    hooks.own_rows = kHookCopy ? own_rows : 0;
    hooks.copy_counters = copy_counters;

    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(bars_full + 8 * s, 1);               // the loader's arrive.expect_tx
            mbar_init(bars_empty + 8 * s, kConsumers * kCluster);  // per consumer WG of the cluster
        }
        for (int k = 0; k < kCTurns; ++k) {
            mbar_init(bar_c_full + 8 * k, 128 * kConsumersPerTurn);  // every thread of the turn's consumers
            mbar_init(bar_c_empty + 8 * k, 1);                       // storer lane 0
        }
        if constexpr (kHookCopy) mbar_init(bar_c_empty + 8 * kCTurns, 1);   // copy_full: the copier's expect_tx
        fence_mbar_init();                                 // inits visible to TMA (async proxy)
        tma_prefetch_desc(&tmap_a);
        tma_prefetch_desc(&tmap_b);
        if constexpr (kHookCopy) tma_prefetch_desc(&tmap_a_own);
        if constexpr ((!kHookEpilogue || kReduceEpilogue) && !kEpiDirect) tma_prefetch_desc(&tmap_c);
    }
    // Barriers initialised before anyone (in this CTA or, with a cluster, the peer CTA's TMA multicasts
    // and stage releases) waits on or arrives at them.
    if constexpr (kCluster > 1) cluster_sync(); else __syncthreads();

    if (warpgroup == 0) {
        if constexpr (kRebalanceRegs) regs_dealloc<kProducerRegs>();
        const int warp = threadIdx.x / 32;
        if (warp == 0) {
            if (threadIdx.x == 0)
                run_loader(sched, K, &tmap_a, &tmap_b, smem, bars_full, bars_empty, hooks);
        } else if (warp == 1 && !kEpiDirect) {
            run_storer(sched, &tmap_c, smem, bar_c_full, bar_c_empty, hooks);
        } else if (warp == 2 && kHookCopy) {
            if (threadIdx.x == 64) run_copier(K, &tmap_a, smem + kOffCopy, bar_c_empty + 8 * kCTurns, hooks);
        }
        // warp 3 of the producer warpgroup (and warp 2 without hook 4) has no role.
    } else {
        if constexpr (kRebalanceRegs) regs_alloc<kConsumerRegs>();
        const int wg = warpgroup - 1;
        run_consumer(sched, M, N, K, wg, smem, smem_generic, bars_full, bars_empty, bar_c_full + 8 * c_turn_of(wg),
                     bar_c_empty + 8 * c_turn_of(wg), static_cast<char*>(c_direct), hooks);
    }
    // With a cluster, no CTA may exit while its peer can still multicast into its shared memory or
    // arrive on its barriers: every thread of both CTAs meets here once all work is done.
    if constexpr (kCluster > 1) {
        __syncwarp();
        cluster_sync();
    }
}

// Host-visible configuration (read through cupy.RawModule.get_global to cross-check the planner).
extern "C" __device__ const unsigned int fluxrt_gemm_threads = kThreads;
extern "C" __device__ const unsigned int fluxrt_gemm_smem_bytes = kSmemBytes + kSmemAlign;
extern "C" __device__ const unsigned int fluxrt_gemm_block_m = kBM;
extern "C" __device__ const unsigned int fluxrt_gemm_block_n = kBN;
