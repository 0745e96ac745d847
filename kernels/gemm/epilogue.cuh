// Epilogue: how a finished tile leaves the CTA. Variants, as types the consumers and the storer are
// instantiated with:
//   DirectEpilogue        consumers store C straight from registers (no staging, no storer)
//   TmaStoreEpilogue      consumers -> C staging smem -> storer warp -> TMA store into C
//   GroupedStoreEpilogue  grouped GEMM: TMA store, row-masked st.global for a tile that ends past its group
//   GroupedScatterEpilogue grouped GEMM with hook 2: each row to its home rank's buffer, counted there
//   PeerStoreEpilogue     hook 2: as TmaStore, into the destination of the tile's chunk of rows (often a
//                         peer's buffer), then a per-tile flag
//   ChunkReduceEpilogue   hook 3 in the epilogue: as PeerStore; the tiles of the reduced chunk get the other
//                         sources' partials added in the consumers and go to C, without a flag
//   TailReduceEpilogue    hook 3 in the tail: as PeerStore (the reduced chunk's tiles raise its own source's
//                         flags); after their last tile the consumer warps reduce the chunk in slabs
// Every variant has the consumer side (consumer_state, begin_tile, after_k_block, store, after_tiles: see
// run_consumer); the staged ones also the storer side (target, tile_flag: see run_storer).
// The sums of partials (hook 3) live together in the "Reduction of partials" section below.
#pragma once

#include <fluxrt/comm.cuh>

#include "../gemm/config.cuh"
#include "../gemm/consumer.cuh"
#include "../gemm/params.cuh"
#include "../gemm/scheduler.cuh"

namespace fluxrt_sm90 {

// Byte offset of element (row, col) of one consumer's C staging (128B swizzle: the 16-byte unit index
// inside a 128-byte row is XORed with row % 8, matching CU_TENSOR_MAP_SWIZZLE_128B).
__device__ __forceinline__ u32 c_stage_offset(int row, int col) {
    const u32 slab = (u32)(col / kCCols);
    const u32 byte_in_row = (u32)(col % kCCols) * kOutBytes;
    const u32 unit = (byte_in_row >> 4) ^ (u32)(row & 7);
    return slab * kCSlabBytes + (u32)row * 128u + (unit << 4) + (byte_in_row & 15u);
}

// ---------------------------------------------------------------------------------------------
// Reduction of partials (hook 3), in the epilogue (reduce_prefetch, reduce_into_acc) and in the tail
// (run_tail_reduce). Partials are C's element type; sums in fp32, sources in fixed order.

// Row of the partials (chunk-local) where consumer wg's rows of global m tile m_tile start.
__device__ __forceinline__ long long reduce_row0(const ReduceArgs& r, int chunk_rows, int m_tile, int wg) {
    return (long long)m_tile * kBM - (long long)r.chunk * chunk_rows + wg * kRowsPerConsumer;
}

// Ahead of the epilogue: bring this consumer's rows of every other source's partial of the tile into L2
// (bulk prefetch: no registers, nothing to wait for). Safe before the partial's flag is up: L2 is the
// point of coherence of this GPU's memory, so a copy engine or peer writing the bytes later updates the
// prefetched lines; it only saves the DRAM latency of the loads in reduce_into_acc.
__device__ __forceinline__ void reduce_prefetch(const ReduceArgs& r, int chunk_rows, int m_tile, int n_tile, int N,
                                                int wg, int tid) {
    const int n0 = n_tile * kBN;
    const u32 bytes = (u32)(min(kBN, N - n0) * kOutBytes);   // N * kOutBytes % 16 == 0 (TMA rule): so is this
    const long long row0 = reduce_row0(r, chunk_rows, m_tile, wg);
    for (int i = tid; i < kRowsPerConsumer * (int)r.sources; i += 128) {
        const int s = i / kRowsPerConsumer, row = i % kRowsPerConsumer;
        if (s != r.chunk)
            prefetch_l2(r.partials + s * r.source_bytes + ((row0 + row) * r.ld + n0) * kOutBytes, bytes);
    }
}

// In the epilogue: acc += every other source's partial of this thread's fragment (rows 16w + l/4 (+8),
// column pairs 8g + 2(l%4), as in the staging writes).
//   Stage 1, wait: thread s of the warpgroup spins (bounded, acquire.sys) on source s's flag of the tile;
//     on timeout the error record names the source and the fragment becomes NaN (no hang, and no sum
//     of whatever was there).
//   Stage 2, sum: each thread acquires the flags itself (already up: no spin), which orders its loads
//     after the sources' releases independently of the barrier; then it adds the sources in fixed order
//     0, 1, ... (its own accumulator first) in fp32: the same bits whatever order the partials arrived in.
__device__ __forceinline__ void reduce_into_acc(float (&acc)[kAccRegs], const ReduceArgs& r,
                                                const TimeoutArgs& to, int chunk_rows, int m_tile, int n_tile,
                                                int n_tiles, int N, int wg, int tid) {
    const int local_m_tile = m_tile - r.chunk * (chunk_rows / kBM);
    const long long flag = r.group_n > 0 ? n_tile / r.group_n : (long long)local_m_tile * n_tiles + n_tile;
    const fluxrt::Watch w{to.timeout_ns, to.err, r.op_id, to.rank};
    auto flag_of = [&](u32 s) { return r.flags + s * r.flag_stride + flag; };
    const bool waited = fluxrt::wait_sources(w, r.sources, (u32)r.chunk, (u32)tid, 128u, flag_of, r.epoch);
    const bool ok = named_bar_and(1 + wg, 128, waited);   // this consumer warpgroup only (ids 1, 2; 0 is __syncthreads)
    fluxrt::acquire_sources(r.sources, (u32)r.chunk, flag_of);
    const int warp = tid >> 5, lane = tid & 31;
    const long long row = reduce_row0(r, chunk_rows, m_tile, wg) + warp * 16 + (lane >> 2);
    const int col = n_tile * kBN + (lane & 3) * 2;
    for (u32 s = 0; s < r.sources; ++s) {
        if ((int)s == r.chunk) continue;
        // rows r and r + 8 of the fragment; column group g is 8 * g elements further (an immediate offset)
        const char* rows[2] = {r.partials + s * r.source_bytes + (row * r.ld + col) * kOutBytes,
                               r.partials + s * r.source_bytes + ((row + 8) * r.ld + col) * kOutBytes};
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
                    acc[4 * (g0 + g) + 2 * hh] += Out16::lo(v[g][hh]);
                    acc[4 * (g0 + g) + 2 * hh + 1] += Out16::hi(v[g][hh]);
                }
        }
    }
    if (!ok) {
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) acc[i] = __int_as_float(0x7fffffff);   // stored as NaN
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
static_assert(kHookReduce != 2 ||
                  (kBM % kTailSlabRows == 0 && (kTailSlabRows * kTailRowVecs) % (32 * kTailVecBatch) == 0),
              "tail slabs split evenly over a warp");

__device__ __forceinline__ void run_tail_reduce(const Schedule& sched, int M, int N, const ReduceArgs& r,
                                                const TailArgs& tail, const TimeoutArgs& to, int chunk_rows) {
    const int lane = threadIdx.x & 31;
    const fluxrt::Watch w{to.timeout_ns, to.err, r.op_id, to.rank};
    const int chunk_tiles = chunk_rows / kBM;
    const int first_tile = r.chunk * chunk_tiles;
    const int rows = min(chunk_rows, M - r.chunk * chunk_rows);   // the chunk's rows inside C
    const u32 slabs = (u32)(((rows + kBM - 1) / kBM) * sched.n_tiles * kTailSlabs);
    const u32 claimers = gridDim.x * kConsumers * 4;                       // consumer warps of the grid
    // schedule position of the chunk's first tile: rotated row (m_tile_offset) times the row's n tiles
    int first_row = first_tile - sched.m_tile_offset;
    if (first_row < 0) first_row += sched.m_tiles;
    const int t0 = first_row * sched.n_tiles;
    for (;;) {
        u32 slab = 0;
        if (lane == 0) slab = atomicAdd(tail.counter, 1u);
        slab = __shfl_sync(~0u, slab, 0);
        if (slab >= slabs) {
            if (lane == 0 && slab == slabs + claimers - 1) *tail.counter = 0u;   // the launch's last claim
            return;
        }
        int m_tile, n_tile;
        sched.tile(t0 + (int)(slab / kTailSlabs), m_tile, n_tile);
        const int local_m_tile = m_tile - first_tile;
        const long long tile_flag = (long long)local_m_tile * sched.n_tiles + n_tile;
        const long long group_flag = r.group_n > 0 ? n_tile / r.group_n : tile_flag;
        auto flag_of = [&](u32 s) {
            return r.flags + s * r.flag_stride + ((int)s == r.chunk ? tile_flag : group_flag);
        };
        const bool waited = fluxrt::wait_sources(w, r.sources, ~0u, (u32)lane, 32u, flag_of, r.epoch);   // wait
        __syncwarp();
        const bool slab_ok = __all_sync(~0u, waited) != 0;   // else the slab is written as all-ones (NaN)
        fluxrt::acquire_sources(r.sources, ~0u, flag_of);
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
            fluxrt::fold_sources<Out16, fluxrt::kSum, /*kFirst=*/false, kTailVecBatch, kTailSrcBatch,
                                 fluxrt::kPastAsZero | fluxrt::kByWord>(
                acc, r.sources, [&](u32 s, u32 j) {
                    return in_c[j] ? ld_cg_v4(r.partials + s * r.source_bytes +
                                              ((long long)row[j] * r.ld + col[j]) * kOutBytes)
                                   : make_uint4(0u, 0u, 0u, 0u);
                });
#pragma unroll
            for (int j = 0; j < kTailVecBatch; ++j) {
                if (!in_c[j]) continue;
                u32 o[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) o[e] = Out16::pack2(acc[j][2 * e], acc[j][2 * e + 1]);
                *reinterpret_cast<uint4*>(tail.out + ((long long)row[j] * N + col[j]) * kOutBytes) =
                    slab_ok ? make_uint4(o[0], o[1], o[2], o[3]) : make_uint4(~0u, ~0u, ~0u, ~0u);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Consumer side of the staged epilogues: registers -> C staging (this consumer's rows), in storer turn
// k = c_turn_of(wg). Parities, for this CTA's i-th tile (i = 0, 1, ...; protocol in hopper_gemm.cu):
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
// Fragment layout of m64nNk16 f32: thread (warp w, lane l) holds rows 16w + l/4 (+8) and column pairs
// 8g + 2(l%4), g < N/8.
struct StagingState {
    u32 c_phase;
#if FLUXRT_GEMM_TRACE
    int trace_tile;   // the diagnostic build's column: tiles this consumer staged so far
#endif
};
__device__ __forceinline__ void stage_tile(const float (&acc)[kAccRegs], int wg, int tid, const ConsumerSmem& sm,
                                           StagingState& st) {
    const int warp = tid >> 5, lane = tid & 31;
    mbar_wait(sm.bar_c_empty, st.c_phase ^ 1);  // the storer finished reading the staging (token passed)
    st.c_phase ^= 1;
#if FLUXRT_GEMM_TRACE
    trace_mark(3 * wg + 1, st.trace_tile, tid == 0);
#endif
    char* c_base = sm.generic + kOffC + c_slot_of(wg) * kCConsumerBytes;
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb) {   // ping-pong: the tile's two row blocks
#pragma unroll
        for (int g = 0; g < kBN / 8; ++g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = rb * kMmaRows + warp * 16 + (lane >> 2) + 8 * h;
                const int col = g * 8 + (lane & 3) * 2;
                const float v0 = acc[rb * kMmaAccRegs + 4 * g + 2 * h], v1 = acc[rb * kMmaAccRegs + 4 * g + 2 * h + 1];
                char* p = c_base + c_stage_offset(row, col);
                if constexpr (FLUXRT_GEMM_OUT == 2) *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
                else *reinterpret_cast<u32*>(p) = Out16::pack2(v0, v1);
            }
        }
    }
    fence_proxy_async_smem();  // generic st.shared above -> visible to the TMA store (async proxy)
    mbar_arrive(sm.bar_c_full);  // release.cta: staging writes visible to the storer after its wait
#if FLUXRT_GEMM_TRACE
    trace_mark(3 * wg + 2, st.trace_tile++, tid == 0);
#endif
}

// Where the storer sends a turn's rows: a tensor map (TMA writes peer memory like local memory and clips
// rows and columns outside the map, so tails need no code) and its row; the tile's chunk of rows.
struct StoreTarget {
    const TmaDesc* map;
    int y0;
    int chunk;
    bool reduced;   // hook 3's chunk
};

// Fitted widths (kFitN): one staged box of tile column n_tile at column `col` of the tile and row y. An inner tile
// column goes through the tiles' view C[M][N / kBN][kBN] (it clips the last slab at the tile's kBN columns), the
// last one through C's own map (it clips at N).
__device__ __forceinline__ void store_fitted_box(const TmaDesc* c, const TmaDesc* tiles, u32 src, int n_tile,
                                                 int n_tiles, int col, int y) {
    if (n_tile + 1 < n_tiles)
        tma_store_3d(tiles, src, col, n_tile, y);
    else
        tma_store_2d(c, src, n_tile * kBN + col, y);
}

// The per-tile release of a staged epilogue with flags, after the tile's last turn (the flag covers every
// row of the tile): set or add `value` to `flag`; no flag (null): nothing to release.
struct TileFlag {
    u64* flag;
    u64 value;
    bool add;
};
__device__ __forceinline__ void signal_tile(const TileFlag& f) {
    bulk_wait_all();              // 1. every turn's stores of this tile have completed
    fluxrt::fence_proxy_async();  // 2. those async-proxy writes before generic ops below
    // 3. fence.acq_rel.sys + release store / add: a reader that acquires the flag sees the tile
    if (f.add) fluxrt::signal_add(f.flag, f.value);
    else fluxrt::signal_set(f.flag, f.value);
}

struct NoTile {};

// The consumer side that every staged epilogue shares; derived types replace what they change.
struct StagedEpilogue {
    using ConsumerState = StagingState;
    using Tile = NoTile;
    RowChunks chunks;

    __device__ __forceinline__ ConsumerState consumer_state(int wg) const {
        // see the parities at stage_tile; ping-pong with a staging region per consumer: each its own pair, no token
        return ConsumerState{kCShared && c_turn_of(wg) != 0 ? 1u : 0u};
    }
    __device__ __forceinline__ Tile begin_tile(const Schedule&, int) const { return Tile{}; }
    __device__ __forceinline__ void after_k_block(const Tile&, int, int, int, int) const {}
    __device__ __forceinline__ void store(const float (&acc)[kAccRegs], const Schedule&, int, const Tile&, int wg,
                                          int tid, const ConsumerSmem& sm, ConsumerState& st) const {
        stage_tile(acc, wg, tid, sm, st);
    }
    __device__ __forceinline__ void after_tiles(const Schedule&) const {}
};

// C itself (banded C too: the storer splits the row into band and row).
struct TmaStoreEpilogue : StagedEpilogue {
    const TmaDesc* tmap_c;
    const TmaDesc* tmap_c_tiles;   // fitted widths: C as [M][N / kBN][kBN] (FitArgs)

    __device__ __forceinline__ StoreTarget target(int m0, int row0) const {
        return StoreTarget{tmap_c, m0 + row0, 0, false};
    }
    __device__ __forceinline__ TileFlag tile_flag(const StoreTarget&, int, int, int) const {
        return TileFlag{nullptr, 0, false};
    }
};

// Grouped GEMM: tiles that end inside their group go to C by TMA store as with TmaStoreEpilogue; a tile whose
// rows run past its group's end (into the next group's rows, which another tile owns) is stored by the storer
// warp's 32 lanes with 16-byte st.global of its rows before the end only (store_rows).
struct GroupedStoreEpilogue : TmaStoreEpilogue {
    char* c;    // C, row-major [M, N]
    int n;

    // Staging of consumers [0, kConsumersPerTurn) of the turn (at smem + kOffC) -> C rows [y0, y0 + 64 per
    // consumer) below row_end, columns [n0, n0 + kBN) below N (N * kOutBytes % 16 == 0: a 16-byte unit is in
    // or out whole). Consecutive lanes take consecutive 16-byte units of a row (the staging's 128B swizzle
    // undone per row), so a warp writes 512 contiguous bytes of C per instruction at 128x256 bf16.
    __device__ __forceinline__ void store_rows(u32 smem, int y0, int row_end, int n0, int lane) const {
        constexpr int kUnitsPerRow = kBN * kOutBytes / 16;
        constexpr int kUnitCols = 16 / kOutBytes;
#pragma unroll 1
        for (int w = 0; w < kConsumersPerTurn; ++w) {
            const int y = y0 + w * kRowsPerConsumer;
            const int valid = min(kRowsPerConsumer, row_end - y);
            const u32 src = smem + kOffC + w * kCConsumerBytes;
#pragma unroll 1   // the storer has 40 registers (setmaxnreg)
            for (int i = lane; i < valid * kUnitsPerRow; i += 32) {
                const int r = i / kUnitsPerRow, q = i % kUnitsPerRow;
                const int slab = q / 8, unit = q % 8;
                const int col = n0 + slab * kCCols + unit * kUnitCols;
                if (col < n) {
                    const uint4 v = ld_shared_v4(src + slab * kCSlabBytes + r * 128u + ((unit ^ (r & 7)) << 4));
                    *reinterpret_cast<uint4*>(c_ptr(y + r, col)) = v;
                }
            }
        }
    }
    // store_rows, then the staging goes back (bar_empty) once every lane's reads of it are done.
    __device__ __forceinline__ void store_rows_and_release(u32 smem, int y0, int row_end, int n0, int lane,
                                                           u32 bar_empty) const {
        store_rows(smem, y0, row_end, n0, lane);
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_empty);
        __syncwarp();
    }
    __device__ __forceinline__ char* c_ptr(int row, int col) const {
        return c + ((long long)row * n + col) * kOutBytes;
    }
};

// Grouped GEMM with hook 2 (the MoE layer's down projection): no row goes to C. Row y of C is expert output row
// y of the receive buffer, whose token lives at home rank h = rows[y] % homes as entry e = rows[y] / homes
// (written there by the dispatch's push): the storer writes it into row e of h's buffer (dst[h], a peer's
// symmetric memory over NVLink, or this rank's own) and, once a turn's rows are stored, adds (rows x columns) of
// h's rows in the turn to h's counter *flags[h], which h's combine waits on (bounded) before it reads.
//   1. stores: 16-byte st.global per unit, consecutive lanes along a row (as store_rows); the row's descriptor
//      by ld.global.cg (written by the sources before this launch, read-only during it).
//   2. the staging has been read: the next turn's consumers get it before the release (no remote latency on
//      their path).
//   3. every lane fences its own stores (fence.acq_rel.sys, warp_publish): one lane's fence does not order
//      another lane's NVLink stores; the warp meets.
//   4. per group of 32 rows, the lowest lane of each home's rows releases their count (red.release.sys.add):
//      a home that acquires counter >= its expected elements sees every row counted into it.
struct GroupedScatterEpilogue : GroupedStoreEpilogue {
    GroupArgs g;

    __device__ __forceinline__ void scatter_rows(u32 smem, int y0, int row_end, int n0, int lane,
                                                 u32 bar_next_empty) const {
        constexpr int kUnitsPerRow = kBN * kOutBytes / 16;
        constexpr int kUnitCols = 16 / kOutBytes;
        const int y_end = min(y0 + kTurnRows, row_end);
#pragma unroll 1
        for (int w = 0; w < kConsumersPerTurn; ++w) {   // 1. stores
            const int y = y0 + w * kRowsPerConsumer;
            const int valid = min(kRowsPerConsumer, y_end - y);
            const u32 src = smem + kOffC + w * kCConsumerBytes;
#pragma unroll 1   // the storer has 40 registers (setmaxnreg)
            for (int i = lane; i < valid * kUnitsPerRow; i += 32) {
                const int r = i / kUnitsPerRow, q = i % kUnitsPerRow;
                const int slab = q / 8, unit = q % 8;
                const int col = n0 + slab * kCCols + unit * kUnitCols;
                const u32 desc = (u32)__ldcg(g.scatter_rows + y + r);
                const long long entry = desc / g.scatter_homes;
                if (col < n && entry < g.scatter_entries) {   // a bad entry is neither stored nor counted (4.)
                    const uint4 v = ld_shared_v4(src + slab * kCSlabBytes + r * 128u + ((unit ^ (r & 7)) << 4));
                    char* base = reinterpret_cast<char*>(g.scatter_dst[desc % g.scatter_homes]);
                    *reinterpret_cast<uint4*>(base + (entry * g.scatter_ld + col) * kOutBytes) = v;
                }
            }
        }
        __syncwarp();                                   // 2. every lane's staging reads are done
        if (lane == 0) mbar_arrive(bar_next_empty);
        fluxrt::warp_publish();                         // 3.
        const u64 cols = (u64)min(kBN, n - n0);
#pragma unroll 1
        for (int y = y0; y < y_end; y += 32) {          // 4. (a uniform trip count: match_any needs every lane)
            const u32 desc = y + lane < y_end ? (u32)__ldcg(g.scatter_rows + y + lane) : ~0u;
            const bool in = y + lane < y_end && desc / g.scatter_homes < (u64)g.scatter_entries;   // as stored
            const u32 home = in ? desc % g.scatter_homes : ~0u;
            const u32 same = __match_any_sync(~0u, home);
            if (in && (same & ((1u << lane) - 1u)) == 0)
                fluxrt::red_release_sys_add(g.scatter_flags[home], (u64)__popc(same) * cols);
        }
    }
};

// Hook 2: destination row r of a tile -> row r - chunk * chunk_rows of dst_tmaps[chunk]; then the flag of
// the tile in the chunk's flag table (or of its group of tile columns).
struct PeerStoreEpilogue : StagedEpilogue {
    EpilogueArgs epi;

    __device__ __forceinline__ StoreTarget target(int m0, int row0) const {
        const int chunk = m0 / chunks.rows;
        return StoreTarget{epi.dst_tmaps + chunk, m0 - chunk * chunks.rows + row0, chunk, false};
    }
    __device__ __forceinline__ long long tile_index(const StoreTarget& d, int m0, int n_tile, int n_tiles) const {
        const int local_m_tile = (m0 - d.chunk * chunks.rows) / kBM;
        return (long long)local_m_tile * n_tiles + n_tile;
    }
    __device__ __forceinline__ TileFlag tile_flag(const StoreTarget& d, int m0, int n_tile, int n_tiles) const {
        u64* flag = nullptr;
        if (epi.flag_table != nullptr)
            flag = epi.flag_table[d.chunk] +
                   (epi.flag_group_n > 0 ? n_tile / epi.flag_group_n : tile_index(d, m0, n_tile, n_tiles));
        return TileFlag{flag, epi.signal_value, epi.signal_add != 0};
    }
};

// Hook 3 in the epilogue: the reduced chunk's tiles get the other sources' partials added before the
// staging writes (loads overlap the storer draining the previous tile) and go to C (tmap_c, [chunk rows,
// N]) without a flag; the other chunks' tiles as with hook 2.
struct ChunkReduceEpilogue : PeerStoreEpilogue {
    ReduceArgs red;
    TimeoutArgs timeout;
    const TmaDesc* tmap_c;
    int n;

    struct Tile {
        int m_tile, n_tile;
        bool reduce;   // the tile belongs to the reduced chunk
    };
    __device__ __forceinline__ Tile begin_tile(const Schedule& sched, int t) const {
        Tile tile{0, 0, false};
        tile.reduce = sched.tile(t, tile.m_tile, tile.n_tile) && tile.m_tile * kBM / chunks.rows == red.chunk;
        return tile;
    }
    __device__ __forceinline__ void after_k_block(const Tile& tile, int kb, int k_blocks, int wg, int tid) const {
        const int prefetch_kb = k_blocks > kReducePrefetchKBlocks ? k_blocks - kReducePrefetchKBlocks : 0;
        if (tile.reduce && kb == prefetch_kb) reduce_prefetch(red, chunks.rows, tile.m_tile, tile.n_tile, n, wg, tid);
    }
    __device__ __forceinline__ void store(float (&acc)[kAccRegs], const Schedule& sched, int, const Tile& tile,
                                          int wg, int tid, const ConsumerSmem& sm, ConsumerState& st) const {
        if (tile.reduce)
            reduce_into_acc(acc, red, timeout, chunks.rows, tile.m_tile, tile.n_tile, sched.n_tiles, n, wg, tid);
        stage_tile(acc, wg, tid, sm, st);
    }
    __device__ __forceinline__ StoreTarget target(int m0, int row0) const {
        StoreTarget d = PeerStoreEpilogue::target(m0, row0);
        d.reduced = d.chunk == red.chunk;
        if (d.reduced) d.map = tmap_c;   // the chunk-local row stays: tmap_c holds the chunk's rows
        return d;
    }
    __device__ __forceinline__ TileFlag tile_flag(const StoreTarget& d, int m0, int n_tile, int n_tiles) const {
        if (d.reduced) return TileFlag{nullptr, 0, false};
        return PeerStoreEpilogue::tile_flag(d, m0, n_tile, n_tiles);
    }
};

// Hook 3 in the tail: every tile as with hook 2, but the reduced chunk's tiles (in its own source's slot
// of the partials) release that source's per-tile flag with the reduce epoch, which the tail reducers
// wait for; after the consumer's last tile, its warps reduce the chunk in slabs (run_tail_reduce).
struct TailReduceEpilogue : PeerStoreEpilogue {
    ReduceArgs red;
    TailArgs tail;
    TimeoutArgs timeout;
    int m, n;

    __device__ __forceinline__ StoreTarget target(int m0, int row0) const {
        StoreTarget d = PeerStoreEpilogue::target(m0, row0);
        d.reduced = d.chunk == red.chunk;
        return d;
    }
    __device__ __forceinline__ TileFlag tile_flag(const StoreTarget& d, int m0, int n_tile, int n_tiles) const {
        if (d.reduced)
            return TileFlag{red.flags + d.chunk * red.flag_stride + tile_index(d, m0, n_tile, n_tiles), red.epoch,
                            false};
        return PeerStoreEpilogue::tile_flag(d, m0, n_tile, n_tiles);
    }
    __device__ __forceinline__ void after_tiles(const Schedule& sched) const {
        run_tail_reduce(sched, m, n, red, tail, timeout, chunks.rows);
    }
};

// Registers -> global, pairs of adjacent columns; two consecutive g fill a 32-byte sector. The consumers
// stall while issuing the stores; nothing is staged.
struct DirectEpilogue {
    struct ConsumerState {};
    using Tile = NoTile;
    char* c;
    int m, n;

    __device__ __forceinline__ ConsumerState consumer_state(int) const { return ConsumerState{}; }
    __device__ __forceinline__ Tile begin_tile(const Schedule&, int) const { return Tile{}; }
    __device__ __forceinline__ void after_k_block(const Tile&, int, int, int, int) const {}
    __device__ __forceinline__ void store(const float (&acc)[kAccRegs], const Schedule& sched, int t, const Tile&,
                                          int wg, int tid, const ConsumerSmem&, ConsumerState&) const {
        const int warp = tid >> 5, lane = tid & 31;
        int m_tile, n_tile;
        const bool real = sched.tile(t, m_tile, n_tile);
        const int row0 = m_tile * kBM + wg * kRowsPerConsumer + warp * 16 + (lane >> 2);
        const int col0 = n_tile * kBN + (lane & 3) * 2;
#pragma unroll
        for (int rb = 0; rb < kRowBlocks; ++rb) {   // 256-row tiles: the consumer's two row blocks
#pragma unroll
            for (int g = 0; g < kBN / 8; ++g) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row0 + rb * kMmaRows + 8 * h, col = col0 + 8 * g;
                    if (real && row < m && col < n) {   // N is even: the pair is in or out as a whole
                        const float v0 = acc[rb * kMmaAccRegs + 4 * g + 2 * h];
                        const float v1 = acc[rb * kMmaAccRegs + 4 * g + 2 * h + 1];
                        char* p = c + ((long long)row * n + col) * kOutBytes;
                        if constexpr (FLUXRT_GEMM_OUT == 2) *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
                        else *reinterpret_cast<u32*>(p) = Out16::pack2(v0, v1);
                    }
                }
            }
        }
    }
    __device__ __forceinline__ void after_tiles(const Schedule&) const {}
};

// The storer's TMA stores of one turn of a staged tile: one 64-row box per (consumer of the turn, 128-byte column
// slab, row block) from the staging at smem + kOffC to d's map. The consumers issued fence.proxy.async.shared::cta
// after writing the staging, before arriving on c_full. Lane 0 only; the caller commits.
template <class Epilogue>
__device__ __forceinline__ void store_turn_boxes(const Epilogue& epilogue, const StoreTarget& d, u32 smem, int n0,
                                                 int n_tile, int n_tiles) {
#pragma unroll
    for (int c = 0; c < kConsumersPerTurn; ++c)
#pragma unroll
        for (int j = 0; j < kCSlabs; ++j)
#pragma unroll
            for (int rb = 0; rb < kRowBlocks; ++rb) {
                const u32 src = smem + kOffC + c * kCConsumerBytes + j * kCSlabBytes + rb * kMmaRows * 128u;
                const int y = d.y0 + c * kRowsPerConsumer + rb * kMmaRows;
                // banded C: GEMM row y is row y % band_rows of band y / band_rows (TMA clips the rest)
                if constexpr (kBandsC)
                    tma_store_3d(d.map, src, n0 + j * kCCols, y % epilogue.chunks.band_rows(),
                                 y / epilogue.chunks.band_rows());
                else if constexpr (kFitN)
                    store_fitted_box(d.map, epilogue.tmap_c_tiles, src, n_tile, n_tiles, j * kCCols, y);
                else
                    tma_store_2d(d.map, src, n0 + j * kCCols, y);
            }
}

// ---------------------------------------------------------------------------------------------
// Storer (warp 1 of the producer warpgroup, staged epilogues): moves finished tiles from C staging to their
// target, in kCTurns turns per tile (turn k drains the staging of consumers [k * kConsumersPerTurn,
// (k + 1) * kConsumersPerTurn), i.e. tile rows [k * kTurnRows, (k + 1) * kTurnRows)), then hands the staging
// to the next turn's consumers: c_empty of turn k + 1, or of turn 0 (the next tile) after the last turn.
// After the last turn of a tile, the epilogue's per-tile release (tile_flag).
template <class Epilogue>
__device__ __forceinline__ void run_storer(const Schedule& sched, const Epilogue& epilogue, u32 smem, u32 bar_c_full,
                                           u32 bar_c_empty) {
    const int lane = threadIdx.x & 31;
    u32 phase = 0;
#if FLUXRT_GEMM_TRACE
    int trace_i = 0;   // tiles stored so far
#endif
    for (int t = sched.first; t < sched.end(); t += sched.stride) {
        int m_tile, n_tile;
        const bool real = sched.tile(t, m_tile, n_tile);
        GroupTile rows{0, 0, 0};
        if constexpr (kGrouped) rows = sched.rows(m_tile);
        const int m0 = kGrouped ? rows.row0 : m_tile * kBM, n0 = n_tile * kBN;
#pragma unroll
        for (int turn = 0; turn < kCTurns; ++turn) {
            const bool last_turn = turn == kCTurns - 1;
            const u32 bar_next_empty = bar_c_empty + 8 * ((turn + 1) % kCTurns);
            const int row0 = turn * kTurnRows;     // first tile row of this turn
            mbar_wait(bar_c_full + 8 * turn, phase);  // acquire: this turn's staging writes are visible
#if FLUXRT_GEMM_TRACE
            trace_mark(6 + 2 * turn, trace_i, lane == 0);
#endif
            if (!real) {                   // phantom tile (see Schedule): nothing to store or signal
                if (lane == 0) mbar_arrive(bar_next_empty);
                __syncwarp();
                continue;
            }
            if constexpr (kGroupScatter) {   // every row to its home rank, counted there
                epilogue.scatter_rows(smem, m0 + row0, rows.row_end, n0, lane, bar_next_empty);
                __syncwarp();
                continue;
            } else if constexpr (kGrouped) {
                const int row_end = rows.row_end;
                if (m0 + kBM > row_end) {   // the tile ends past its group: row-masked stores
                    epilogue.store_rows_and_release(smem, m0 + row0, row_end, n0, lane, bar_next_empty);
                    continue;
                }
            }
            const StoreTarget d = epilogue.target(m0, row0);
            if (lane == 0) {
                store_turn_boxes(epilogue, d, smem, n0, n_tile, sched.n_tiles);
                bulk_commit();
                bulk_wait_read_all();   // staging has been read: the next turn's consumers may overwrite it
#if FLUXRT_GEMM_TRACE
                trace_mark(7 + 2 * turn, trace_i, true);
#endif
                mbar_arrive(bar_next_empty);
                if (last_turn) {
                    const TileFlag f = epilogue.tile_flag(d, m0, n_tile, sched.n_tiles);
                    if (f.flag != nullptr) signal_tile(f);
                }
            }
            __syncwarp();
        }
        phase ^= 1;
#if FLUXRT_GEMM_TRACE
        ++trace_i;
#endif
    }
    if (lane == 0) bulk_wait_all();  // the last stores are complete before the CTA retires
}


// Ping-pong storer (FLUXRT_GEMM_PINGPONG, TmaStoreEpilogue): this CTA's tile i is consumer k = i % 2's, staged in
// k's region (or the shared one) and announced on c_full[k], whose j-th completion (parity j & 1) is k's j-th tile.
// Once read, the region goes back: to k itself on c_empty[k] (a region per consumer), or, passing the token, to the
// other consumer on c_empty[k ^ 1] (shared staging; parities at stage_tile). Each tile leaves in 64-row boxes
// (store_turn_boxes: two per 128-byte column slab); grouped, a tile that ends past its group leaves through the
// epilogue's row-masked stores (store_rows over k's 128 rows), as in run_storer.
template <class Epilogue>
__device__ __forceinline__ void run_storer_pingpong(const Schedule& sched, const Epilogue& epilogue, u32 smem,
                                                    u32 bar_c_full, u32 bar_c_empty) {
    const int lane = threadIdx.x & 31;
    u32 phases = 0;   // bit k: parity of consumer k's next c_full completion
    int k = 0;
    for (int t = sched.first; t < sched.end(); t += sched.stride) {
        int m_tile, n_tile;
        const bool real = sched.tile(t, m_tile, n_tile);   // a phantom tile (cluster pairs) is not stored
        GroupTile rows{0, 0, 0};
        if constexpr (kGrouped) rows = sched.rows(m_tile);
        const int m0 = kGrouped ? rows.row0 : m_tile * kBM;
        mbar_wait(bar_c_full + 8 * k, (phases >> k) & 1u);  // acquire: consumer k's staging writes are visible
        phases ^= 1u << k;
        if constexpr (kGrouped) {
            if (m0 + kBM > rows.row_end) {   // the tile ends past its group: row-masked stores from k's region
                epilogue.store_rows_and_release(smem + c_slot_of(k) * kCConsumerBytes, m0, rows.row_end, n_tile * kBN,
                                                lane, bar_c_empty + 8 * (kCShared ? k ^ 1 : k));
                k ^= 1;
                continue;
            }
        }
        if (lane == 0) {
            if (real) {   // consumer k's region: one consumer per turn, its row blocks the tile's
                store_turn_boxes(epilogue, epilogue.target(m0, 0), smem + c_slot_of(k) * kCConsumerBytes, n_tile * kBN,
                                 n_tile, sched.n_tiles);
                bulk_commit();
                bulk_wait_read_all();   // staging has been read: it may be overwritten
            }
            mbar_arrive(bar_c_empty + 8 * (kCShared ? k ^ 1 : k));
        }
        __syncwarp();
        k ^= 1;
    }
    if (lane == 0) bulk_wait_all();  // the last stores are complete before the CTA retires
}

// Stream-K storer (FLUXRT_GEMM_STREAM_K, TmaStoreEpilogue): run_storer's protocol over this CTA's work units,
// skipping the pieces that went to the partials (all but a tile's last: the consumers staged nothing) and, with a
// cluster, a phantom tile's staging. Kept apart from run_storer so that every other configuration compiles to the
// instructions it had.
template <class Epilogue>
__device__ __forceinline__ void run_storer_stream_k(const Schedule& sched, const StreamK& sk, const Epilogue& epilogue,
                                                    u32 smem, u32 bar_c_full, u32 bar_c_empty) {
    const int lane = threadIdx.x & 31;
    u32 phase = 0;
    for_each_unit(sched, sk, [&](int t, int kb0, int kbs) {
        if (kb0 + kbs < sk.k_blocks) return;
        int m_tile, n_tile;
        const bool real = sched.tile(t, m_tile, n_tile) || kCluster == 1;
        const int m0 = m_tile * kBM, n0 = n_tile * kBN;
#pragma unroll
        for (int turn = 0; turn < kCTurns; ++turn) {
            const u32 bar_next_empty = bar_c_empty + 8 * ((turn + 1) % kCTurns);
            const int row0 = turn * kTurnRows;
            mbar_wait(bar_c_full + 8 * turn, phase);   // acquire: this turn's staging writes are visible
            if (!real) {                   // phantom tile (cluster of 2, M tiles odd): nothing to store
                if (lane == 0) mbar_arrive(bar_next_empty);
                __syncwarp();
                continue;
            }
            const StoreTarget d = epilogue.target(m0, row0);
            if (lane == 0) {
                store_turn_boxes(epilogue, d, smem, n0, n_tile, sched.n_tiles);
                bulk_commit();
                bulk_wait_read_all();   // staging has been read: the next turn's consumers may overwrite it
                mbar_arrive(bar_next_empty);
            }
            __syncwarp();
        }
        phase ^= 1;
    });
    if (lane == 0) bulk_wait_all();
}

}  // namespace fluxrt_sm90
