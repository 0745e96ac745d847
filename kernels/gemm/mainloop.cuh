// Mainloop (producer side): one thread streams A and B K blocks of this CTA's tiles into the smem ring.
// Variants, as types the loader is instantiated with:
//   PlainMainloop         A and B from their tensor maps
//   ArrivalWaitMainloop   hook 1: before A's rows of a chunk are first loaded, wait for the chunk's flag
//   OwnShardMainloop      hook 4: as ArrivalWaitMainloop, but A's own rows come from their own source
//                         (no wait: they are local), and the copier role (OwnShardCopier) copies them
//                         into A beside the GEMM
#pragma once

#include <fluxrt/comm.cuh>

#include "../gemm/config.cuh"
#include "../gemm/params.cuh"
#include "../gemm/scheduler.cuh"

namespace fluxrt_sm90 {

// Where the A rows of a tile are loaded from: a tensor map and its row.
struct ARows {
    const TmaDesc* map;
    int row;
};

// A's rows all come from tmap_a.
struct AllOfA {
    const TmaDesc* tmap_a;
    __device__ __forceinline__ bool own(int) const { return false; }
    __device__ __forceinline__ ARows rows(int m0) const { return ARows{tmap_a, m0}; }
};

// Hook 4: A's own rows and where they come from (CopyArgs without its tensor map, which stays in place).
struct OwnShard {
    const TmaDesc* map;         // CopyArgs::tmap_a_own
    u64* counters;
    int row0, rows;

    static __device__ __forceinline__ OwnShard of(const CopyArgs& c) {
        return OwnShard{&c.tmap_a_own, c.counters, c.row0, c.rows};
    }
    __device__ __forceinline__ bool contains(int m0) const { return m0 >= row0 && m0 < row0 + rows; }
};

// Rows [row0, row0 + rows) come from the own shard, counted from its row 0 (the rest from tmap_a).
struct OwnShardOfA {
    const TmaDesc* tmap_a;
    OwnShard shard;
    __device__ __forceinline__ bool own(int m0) const { return shard.contains(m0); }
    __device__ __forceinline__ ARows rows(int m0) const {
        const bool o = own(m0);
        return ARows{o ? shard.map : tmap_a, o ? m0 - shard.row0 : m0};
    }
};

struct PlainMainloop {
    AllOfA a;
    __device__ __forceinline__ void before_tile(int, int) {}
};

// Hook 1: rows [m0, m0 + kBM) of A come from chunk m0 / chunk_rows, written by a peer (or a copy engine).
template <class ASource>
struct ArrivalWaitMainloop {
    ASource a;
    WaitArgs wait;
    TimeoutArgs timeout;
    RowChunks chunks;
    int waited_chunk;   // the last chunk (grouped: group) waited for (tiles of one chunk follow each other)
    const u64* arrival_epoch;   // grouped: GroupArgs::arrival_epoch, arrival_sources
    u32 arrival_sources;

    // 1. ld.acquire.sys of the chunk's flag, bounded: on timeout the error record is filled and the tile
    //    is computed on whatever is there, so the CTA never hangs.
    // 2. fence.proxy.async: the TMA (async proxy) reads that follow observe the data the flag guards.
    // Grouped: the tile's group instead of its chunk, one flag per source, the epoch read on the device.
    __device__ __forceinline__ void before_tile(int m0, int group) {
        if constexpr (kGrouped) {
            if (group != waited_chunk) {
                const u64 target = *reinterpret_cast<const volatile u64*>(arrival_epoch);
                const u64* flags = wait.flags + (u64)group * arrival_sources;
                for (u32 s = 0; s < arrival_sources; ++s)
                    fluxrt::wait_ge(flags + s, target, timeout.timeout_ns, timeout.err, wait.op_id, timeout.rank,
                                    (u64)s);                                                  // 1
                fluxrt::fence_proxy_async();                                                  // 2
                waited_chunk = group;
            }
            return;
        }
        const int chunk = m0 / chunks.rows;
        if (chunk != waited_chunk && !a.own(m0)) {   // hook 4's own rows are local
            fluxrt::wait_ge(wait.flags + chunk, wait.epoch, timeout.timeout_ns, timeout.err, wait.op_id,
                            timeout.rank, (u64)(chunk / chunks.per_peer));   // 1
            fluxrt::fence_proxy_async();                                      // 2
            waited_chunk = chunk;
        }
    }
};
using OwnShardMainloop = ArrivalWaitMainloop<OwnShardOfA>;

// The loader: per K block, wait until every consumer (of every CTA the stage's loads reach) released it,
// announce the stage's bytes on full[s], and issue the TMA loads that complete them.
// Split-K passes its KSlices last (`slices`: none or one).
template <class Mainloop, class... KSlicesT>
__device__ __forceinline__ void run_loader(const Schedule& sched, int K, Mainloop& mainloop, const TmaDesc* tmap_b,
                                           RowChunks chunks, u32 smem, u32 bars_full, u32 bars_empty,
                                           KSlicesT... slices) {
    const int k_blocks_all = (K + kBK - 1) / kBK;
    int stage = 0;
    u32 phase = 0;
#if FLUXRT_GEMM_TRACE
    int trace_idx = 0;   // K blocks loaded so far
#endif
    for (int t = sched.first; t < sched.end(); t += sched.stride) {
        int m_tile, n_tile;
        sched.tile(t, m_tile, n_tile);
        const GroupTile rows = sched.rows(m_tile);   // grouped: B's group and A's first row
        const int m0 = rows.row0, n0 = n_tile * kBN;
        mainloop.before_tile(m0, rows.group);
        const ARows a = mainloop.a.rows(m0);
        // banded A: the tile's rows are rows [a.row % band_rows, + kBM) of band a.row / band_rows
        const int a_band = (kBandsA || kSplitK) ? a.row / chunks.band_rows() : 0;
        const int a_band_row = (kBandsA || kSplitK) ? a.row - a_band * chunks.band_rows() : a.row;
        // split-K: band a_band's slice of K, its first column and its K blocks (the last slice's may be fewer)
        const int k_first = band_k_first(a.row, slices...);
        const int k_blocks = band_k_blocks(k_blocks_all, a.row, slices...);
        for (int kb = 0; kb < k_blocks; ++kb) {
            const u32 full = bars_full + 8 * stage, empty = bars_empty + 8 * stage;
#if FLUXRT_GEMM_TRACE
            traced_wait(0, trace_idx++, true, [&] { mbar_wait(empty, phase ^ 1); });
#else
            mbar_wait(empty, phase ^ 1);  // every consumer released this slot (parity protocol)
#endif
            mbar_arrive_expect_tx(full, kStageBytes);
            const int k0 = k_first + kb * kBK;
            if constexpr (kSplitK)   // the band's rows of A, read in place (2-D map)
                tma_load_2d(smem + kOffA + stage * kTileABytes, a.map, k0, a_band_row, full);
            else if constexpr (kBandsA)
                tma_load_3d(smem + kOffA + stage * kTileABytes, a.map, k0, a_band_row, a_band, full);
            else if constexpr (kClusterN == 1)
                tma_load_2d(smem + kOffA + stage * kTileABytes, a.map, k0, a.row, full);
            else {   // box {64 K, kBM / kClusterN rows}: this CTA's share of A's rows, to the CTAs of its M tile
                const int part = sched.n_rank();
                tma_load_2d_multicast(smem + kOffA + stage * kTileABytes + part * (kTileABytes / kClusterN), a.map,
                                      k0, a.row + part * (kBM / kClusterN), full, a_sharers(sched.m_rank()));
            }
            const u32 b_dst = smem + kOffB + stage * kTileBBytes;
            if constexpr (kBKMajor) {
                // box {64 K, kBN / kCluster rows of N}: with a cluster, this CTA's share of the rows
                if constexpr (kGrouped) {   // B [G][N][K] as (k, n, group)
                    tma_load_3d(b_dst, tmap_b, k0, n0, rows.group, full);
                } else if constexpr (kCluster == 1) {
                    tma_load_2d(b_dst, tmap_b, k0, n0, full);
                } else {
                    const int part = sched.m_rank();
                    tma_load_2d_multicast(b_dst + part * (kTileBBytes / kCluster), tmap_b, k0,
                                          n0 + part * (kBN / kCluster), full, b_sharers(sched.n_rank()));
                }
            } else {
#pragma unroll
                for (int j = 0; j < kBSlabs; ++j) {  // boxes {64 N, 64 K}: one 128-byte wide slab each
                    if constexpr (kGrouped)   // B [G][K][N] as (n, k, group)
                        tma_load_3d(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, rows.group, full);
                    else if constexpr (kCluster == 1)
                        tma_load_2d(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full);
                    else if (j % kCluster == sched.m_rank())   // slab j comes from M rank j % kCluster
                        tma_load_2d_multicast(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full,
                                              b_sharers(sched.n_rank()));
                }
            }
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

// Stream-K loader (FLUXRT_GEMM_STREAM_K): the same ring protocol as run_loader, over this CTA's work units
// (schedule item, first K block, K blocks) of for_each_unit; plain 2-D loads (no hooks, bands, groups), B
// multicast to the pair as in run_loader with a cluster of 2 along M.
// Kept apart from run_loader so that every other configuration compiles to the instructions it had.
__device__ __forceinline__ void run_loader_stream_k(const Schedule& sched, const StreamK& sk, const TmaDesc* tmap_a,
                                                    const TmaDesc* tmap_b, u32 smem, u32 bars_full, u32 bars_empty) {
    int stage = 0;
    u32 phase = 0;
    for_each_unit(sched, sk, [&](int t, int kb0, int kbs) {
        int m_tile, n_tile;
        sched.tile(t, m_tile, n_tile);
        const int m0 = m_tile * kBM, n0 = n_tile * kBN;
        for (int kb = kb0; kb < kb0 + kbs; ++kb) {
            const u32 full = bars_full + 8 * stage, empty = bars_empty + 8 * stage;
            mbar_wait(empty, phase ^ 1);  // every consumer released this slot (parity protocol)
            mbar_arrive_expect_tx(full, kStageBytes);
            const int k0 = kb * kBK;
            tma_load_2d(smem + kOffA + stage * kTileABytes, tmap_a, k0, m0, full);
            const u32 b_dst = smem + kOffB + stage * kTileBBytes;
            if constexpr (kBKMajor) {
                if constexpr (kCluster == 1) {
                    tma_load_2d(b_dst, tmap_b, k0, n0, full);
                } else {   // box {64 K, kBN / kCluster rows of N}: this CTA's share, to both CTAs of the pair
                    const int part = sched.m_rank();
                    tma_load_2d_multicast(b_dst + part * (kTileBBytes / kCluster), tmap_b, k0,
                                          n0 + part * (kBN / kCluster), full, b_sharers(sched.n_rank()));
                }
            } else {
#pragma unroll
                for (int j = 0; j < kBSlabs; ++j) {
                    if constexpr (kCluster == 1)
                        tma_load_2d(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full);
                    else if (j % kCluster == sched.m_rank())   // slab j comes from M rank j % kCluster
                        tma_load_2d_multicast(b_dst + j * kBAtomBytes, tmap_b, n0 + 64 * j, k0, full,
                                              b_sharers(sched.n_rank()));
                }
            }
            if (++stage == kStages) {
                stage = 0;
                phase ^= 1;
            }
        }
    });
}

// Copier (hook 4): copies A's own rows from their source (tmap_a_own) into A (tmap_a) beside the GEMM,
// through a buffer of its own, so that the ring and the math never wait for it. The rows are cut into
// {kBK x kBM} pieces, numbered chunk by chunk (m tile, then K block); CTA b copies pieces b, b + G, ...
// (G CTAs), so every CTA takes part and chunk 0 is complete first. Per piece:
//   1. arrive.expect_tx(copy_full) + TMA load into the buffer; wait copy_full: the bytes landed
//   2. TMA store of the buffer into A; cp.async.bulk.wait_group.read 0: the buffer may be reloaded
// When the next piece is in another chunk (or none is left):
//   3. cp.async.bulk.wait_group 0 (the rows are written) -> fence.proxy.async -> signal_add
//      (fence.acq_rel.sys + red.release.sys) of this CTA's count of pieces to the chunk's counter: a peer
//      that acquires the counter at its total sees the chunk.
__device__ __forceinline__ void run_copier(int K, const TmaDesc* tmap_a, const OwnShard& copy, RowChunks chunks,
                                           u32 buf, u32 bar) {
    const int k_blocks = (K + kBK - 1) / kBK;
    const int pieces_per_chunk = chunks.rows / kBM * k_blocks;
    const int pieces = copy.rows / kBM * k_blocks;
    u32 phase = 0;
    int count = 0;   // pieces of the current chunk stored by this CTA, not yet signalled
    for (int i = (int)blockIdx.x; i < pieces; i += (int)gridDim.x) {
        const int m0 = i / k_blocks * kBM, k0 = i % k_blocks * kBK;
        mbar_arrive_expect_tx(bar, kTileABytes);                                       // 1
        tma_load_2d(buf, copy.map, k0, m0, bar);
        mbar_wait(bar, phase);
        phase ^= 1;
        tma_store_2d(tmap_a, buf, k0, copy.row0 + m0);                                 // 2
        bulk_commit();
        bulk_wait_read_all();
        ++count;
        const int next = i + (int)gridDim.x;
        if (next >= pieces || next / pieces_per_chunk != i / pieces_per_chunk) {       // 3
            bulk_wait_all();
            fluxrt::fence_proxy_async();
            fluxrt::signal_add(copy.counters + i / pieces_per_chunk, (u64)count);
            count = 0;
        }
    }
}

}  // namespace fluxrt_sm90
