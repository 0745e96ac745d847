// Persistent tile scheduler: which tiles a CTA computes, in which order.
#pragma once

#include "../gemm/config.cuh"
#include "../gemm/params.cuh"

namespace fluxrt_sm90 {

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

    // The schedule of this CTA's cluster for the call in `g`.
    static __device__ __forceinline__ Schedule of(const GemmArgs& g) {
        Schedule s;
        s.m_tiles = (g.m + kBM - 1) / kBM;
        s.n_tiles = (g.n + kBN - 1) / kBN;
        s.m_slots = (s.m_tiles + kCluster - 1) / kCluster;
        s.total = s.m_slots * s.n_tiles;
        s.group_m = g.group_m >= kCluster ? g.group_m / kCluster : 1;   // group_m counts tile rows
        s.m_tile_offset = g.m_tile_offset % s.m_tiles;
        s.first = (int)(blockIdx.x / kCluster);
        s.stride = (int)(gridDim.x / kCluster);
        s.cta_rank = kCluster > 1 ? (int)cluster_ctarank() : 0;
        s.order_table = g.order_table;
        return s;
    }

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

// The row chunks of the hooks (and bands): chunk c = rows [c * rows, (c + 1) * rows) of the GEMM, owned by
// peer c / per_peer; a band (FLUXRT_GEMM_BANDS) is the rows of one peer's chunks.
struct RowChunks {
    int rows;
    int per_peer;

    static __device__ __forceinline__ RowChunks of(const GemmArgs& g) {
        return RowChunks{g.chunk_rows > 0 ? g.chunk_rows : g.m, g.chunks_per_peer > 0 ? g.chunks_per_peer : 1};
    }
    __device__ __forceinline__ int band_rows() const { return rows * per_peer; }
};

}  // namespace fluxrt_sm90
