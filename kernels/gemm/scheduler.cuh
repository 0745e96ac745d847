// Persistent tile scheduler: which tiles a CTA computes, in which order.
#pragma once

#include "../gemm/config.cuh"
#include "../gemm/params.cuh"

namespace fluxrt_sm90 {

// Grouped GEMM (FLUXRT_GEMM_GROUPED): where a tile row of the schedule's grid lies. The grid's tile rows are
// the groups' tile rows one after another (group g has ceil(M_g / kBM) of them, an empty group none); tile
// row r of group g covers A's and C's rows [first_row[g] + r * kBM, min(+ kBM, row_end of g)).
struct GroupTile {
    int group;
    int row0;       // first row of the tile in A and C
    int row_end;    // one past the group's last row: the tile's rows from here on belong to the next group
};

// The table every role of a CTA reads, in shared memory at `table` (a shared::cta address):
//   first_row[g], g <= kMaxGroups   offsets[g] clamped to [0, M] (M past G)
//   tile_rows[g], g <= kMaxGroups   tile rows of groups 0 .. g - 1 (the grid's tile rows from G on)
//   tile_rows[kMaxGroups + 1]       the grid's work items (tile rows x n_tiles)
// A group ends at max(first_row[g], first_row[g + 1]): offsets that decrease make empty groups, never rows
// outside [0, M). Read with ld.shared at every use: kept in registers, the grid size made the consumers
// (128 accumulators) and the storer (40 registers) spill.
struct GroupTable {
    u32 table;
    int groups;

    static constexpr u32 kTileRowsOffset = 4u * (kMaxGroups + 1);

    // Built by one warp before the CTA's first barrier: lane l takes groups 8l .. 8l + 7 (kMaxGroups = 256
    // = 32 x 8), reads their offsets (9 per lane, the next lane's first included), counts tile rows and
    // scans the counts across the warp.
    static __device__ __forceinline__ void build(const GroupArgs& a, int M, int n_tiles, int* first_row,
                                                 int lane) {
        constexpr int kPer = kMaxGroups / 32;
        static_assert(kMaxGroups % 32 == 0, "groups split evenly over a warp");
        int* tile_rows = first_row + (kMaxGroups + 1);
        int start[kPer + 1];
#pragma unroll
        for (int j = 0; j <= kPer; ++j) {
            const int g = kPer * lane + j;
            long long v = M;   // past G: the table's end (counts there are 0 anyway)
            if (g <= a.groups)
                v = a.offsets_64 ? static_cast<const long long*>(a.offsets)[g]
                                 : (long long)static_cast<const int*>(a.offsets)[g];
            start[j] = (int)(v < 0 ? 0 : (v > M ? M : v));
        }
        int count[kPer], sum = 0;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const int g = kPer * lane + j;
            const int rows = g < a.groups ? max(0, start[j + 1] - start[j]) : 0;
            count[j] = (rows + kBM - 1) / kBM;
            sum += count[j];
        }
        int incl = sum;   // inclusive scan of the lanes' sums
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int v = __shfl_up_sync(~0u, incl, d);
            if (lane >= d) incl += v;
        }
        int prefix = incl - sum;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const int g = kPer * lane + j;
            first_row[g] = start[j];
            tile_rows[g] = prefix;
            prefix += count[j];
        }
        if (lane == 31) {
            first_row[kMaxGroups] = start[kPer];
            tile_rows[kMaxGroups] = prefix;
            tile_rows[kMaxGroups + 1] = prefix * n_tiles;
        }
    }

    __device__ __forceinline__ int first_row(int g) const { return ld_shared_s32(table + 4u * g); }
    __device__ __forceinline__ int tile_rows(int g) const { return ld_shared_s32(table + kTileRowsOffset + 4u * g); }
    __device__ __forceinline__ int total_tile_rows() const { return tile_rows(kMaxGroups); }
    __device__ __forceinline__ int items() const { return tile_rows(kMaxGroups + 1); }

    // Tile row r (< total_tile_rows()) -> its group (the last g with tile_rows[g] <= r: never an empty one,
    // whose successor starts at the same tile row) and rows. Binary search over G + 1 entries.
    __device__ __forceinline__ GroupTile locate(int r) const {
        int lo = 0, hi = groups;   // tile_rows[lo] <= r < tile_rows[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (tile_rows(mid) <= r) lo = mid;
            else hi = mid;
        }
        const int first = first_row(lo);
        return GroupTile{lo, first + (r - tile_rows(lo)) * kBM, max(first, first_row(lo + 1))};
    }
};

// Tile scheduler. Work items are (slot row, slot column) of a [m_slots, n_slots] grid, one slot row = kCluster
// consecutive M tiles (one per M rank of a cluster; those CTAs share the B tile), one slot column = kClusterN
// consecutive N tiles (one per N rank; those share the A tile). A cluster takes items
// t = cluster id, + number of clusters, ...; item t -> (slot row, slot column):
//   order_table != nullptr: packed (row << 16 | column) per t (Hilbert curve, computed on the host);
//   otherwise grouped order: bands of `group_m` slot rows, column by column inside a band.
// The CTA's tile is m_tile = row * kCluster + m rank, n_tile = column * kClusterN + n rank; then the rank
// offset rotates the rows:
// m_tile = (m_tile + m_tile_offset) % m_tiles, so a rank starts at its own shard of A (AllGather+GEMM)
// or at the rows the next peer owns (GEMM+ReduceScatter).
struct Schedule {
    int m_tiles, n_tiles, m_slots, n_slots, total;
    int group_m, m_tile_offset;
    int first, stride;          // this cluster's first item, number of clusters
    int cta_rank;               // rank in the cluster
    const u32* order_table;
    GroupTable groups;          // grouped GEMM only

    // The schedule of this CTA's cluster for the call in `g` (grouped: with the CTA's group table, whose
    // contents are read only once the roles run).
    static __device__ __forceinline__ Schedule of(const GemmArgs& g, GroupTable groups = GroupTable{0u, 0}) {
        Schedule s;
        s.m_tiles = (g.m + kBM - 1) / kBM;
        s.n_tiles = (g.n + kBN - 1) / kBN;
        s.m_slots = (s.m_tiles + kCluster - 1) / kCluster;
        s.n_slots = (s.n_tiles + kClusterN - 1) / kClusterN;
        s.total = s.m_slots * s.n_slots;
        s.group_m = g.group_m >= kCluster ? g.group_m / kCluster : 1;   // group_m counts tile rows
        s.m_tile_offset = g.m_tile_offset % s.m_tiles;
        s.first = (int)(blockIdx.x / kClusterCtas);
        s.stride = (int)(gridDim.x / kClusterCtas);
        s.cta_rank = kClusterCtas > 1 ? (int)cluster_ctarank() : 0;
        s.order_table = g.order_table;
        s.groups = groups;
        return s;
    }

    // This CTA's place in its cluster: which M tile of a slot row, which N tile of a slot column.
    __device__ __forceinline__ int m_rank() const { return kClusterN == 1 ? cta_rank : cta_rank % kCluster; }
    __device__ __forceinline__ int n_rank() const { return kClusterN == 1 ? 0 : cta_rank / kCluster; }

    // Grouped GEMM: the grid's tile rows are the groups' (m_tiles, m_slots and total above are not used: they
    // count A's rows), read from the table at every use, in grouped order without rank offset.
    __device__ __forceinline__ int slot_rows() const {
        if constexpr (kGrouped) return groups.total_tile_rows();
        else return m_slots;
    }
    // One past the last work item (the persistent loops' bound).
    __device__ __forceinline__ int end() const {
        if constexpr (kGrouped) return groups.items();
        else return total;
    }

    // The rows of tile row m_tile: with groups, located in the table; otherwise rows m_tile * kBM on, of
    // group 0 (row_end is not used).
    __device__ __forceinline__ GroupTile rows(int m_tile) const {
        if constexpr (kGrouped) return groups.locate(m_tile);
        else return GroupTile{0, m_tile * kBM, 0};
    }

    // Returns false for a phantom tile (a cluster of 2 along M or N, m_tiles or n_tiles odd, the last slot):
    // that CTA still runs the pipeline on the first real tile of its slot, so that its share of B (and A)
    // reaches the CTAs that share it, but stores nothing. Every CTA of a B (A) sharing group takes the same
    // N (M) tile, phantom or not, so the parts they multicast make one tile.
    __device__ __forceinline__ bool tile(int t, int& m_tile, int& n_tile) const {
        int row, n;
        if (!kGrouped && order_table != nullptr) {   // grouped: the host has no table (it cannot know the grid)
            const u32 packed = __ldg(order_table + t);
            row = (int)(packed >> 16);
            n = (int)(packed & 0xFFFFu);
        } else {
            const int per_group = group_m * n_slots;
            const int g = t / per_group;
            const int first_row = g * group_m;
            const int rows = min(slot_rows() - first_row, group_m);
            const int r = t - g * per_group;
            row = first_row + r % rows;
            n = r / rows;
        }
        if constexpr (kGrouped) {   // no cluster, no rank offset
            m_tile = row;
            n_tile = n;
            return true;
        }
        int m = row * kCluster + m_rank();
        bool real = m < m_tiles;
        if (!real) m = row * kCluster;
        m += m_tile_offset;
        if (m >= m_tiles) m -= m_tiles;
        m_tile = m;
        if constexpr (kClusterN == 1) {
            n_tile = n;
        } else {   // n is the slot column
            n_tile = n * kClusterN + n_rank();
            if (n_tile >= n_tiles) {
                n_tile = n * kClusterN;
                real = false;
            }
        }
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

// Split-K (FLUXRT_GEMM_SPLIT_K): the launch's rows are bands of band_rows rows; band s multiplies K columns
// [s * slice, min((s + 1) * slice, k)). slice is a multiple of kBK, so a slice other than the last ends on a
// K block boundary (its last block never reads the next slice's columns) and only the last one's final
// block reaches past K, which TMA fills with zeros. The host makes every band's range non-empty.
struct KSlices {
    int k, slice, band_rows;

    static __device__ __forceinline__ KSlices of(const GemmArgs& g, RowChunks chunks) {
        return KSlices{g.k, g.k_slice, chunks.band_rows()};
    }
    // First K column of the slice of the tile whose first (launch) row is row0.
    __device__ __forceinline__ int begin(int row0) const { return row0 / band_rows * slice; }
    __device__ __forceinline__ int blocks(int row0) const { return (min(slice, k - begin(row0)) + kBK - 1) / kBK; }
    // The K blocks of work item t of the schedule.
    __device__ __forceinline__ int blocks_of_item(const Schedule& sched, int t) const {
        int m_tile, n_tile;
        sched.tile(t, m_tile, n_tile);
        return blocks(sched.rows(m_tile).row0);
    }
};

// Stream-K (FLUXRT_GEMM_STREAM_K), in its "split tail" form: schedule items [0, dp_tiles) are whole tiles, taken
// round robin as without stream-K (dp_tiles is a whole number of waves); each of the remaining `cut` tiles is cut
// into `pieces` K ranges of piece_blocks K blocks (the last one shorter), and the cut units u = piece * cut + i
// (piece-major, so the CTAs of one wave run the same K range of neighbouring tiles and share A and B in L2 as
// whole tiles do) continue the round robin: CTA b takes u = b, b + ctas, ... The host picks dp_tiles and pieces
// so that the units fill the waves (fluxrt.gemm.plan.stream_k_geometry). A tile's last piece finishes it: its
// CTA waits for the tile's counter to count the other pieces, which stored their fp32 partials in slots
// i * (pieces - 1) + piece, adds them in piece order and stores the tile, so reruns give the same bits. Every
// role (loader, consumers, storer) walks the same units with for_each_unit.
// With a cluster of 2 along M the schedule's items are the pairs' slots and `ctas` counts clusters: both CTAs of a
// pair run every unit on their own M tile of the slot (the same K range, so B is multicast as in a whole tile), and
// cut tile i * kCluster + m rank has its own counter and partials; a phantom tile (M tiles odd) runs its units for
// the multicast only and touches neither.
//
// No deadlock: a unit waits only for units of smaller index u, and a CTA runs its units in increasing u, so the
// CTA waiting at the smallest u waits for units whose CTAs are past them (the grid is at most one CTA per SM,
// 1 CTA/SM by its shared memory, so all of them can be resident at once; a CTA not yet resident waits only for
// SMs that other kernels hold). The wait is bounded all the same (an ErrorRecord names the op).
struct StreamK {
    int dp_tiles;       // whole tiles first (a multiple of ctas)
    int total;          // schedule items
    int k_blocks;       // K blocks per tile
    int ctas;           // the grid, in clusters
    int pieces;         // K ranges per cut tile (>= 1)
    int piece_blocks;   // K blocks of a piece but the last
    u64* counters;
    float* partials;
    fluxrt::Watch watch;   // the finishing CTA's bounded wait (peer: the CTA of the tile's first piece)

    static __device__ __forceinline__ StreamK of(const Schedule& sched, const GemmArgs& g, const StreamKArgs& a,
                                                 const TimeoutArgs& to) {
        return StreamK{a.dp_tiles, sched.total, (g.k + kBK - 1) / kBK, sched.stride, a.pieces, a.piece_blocks,
                       a.counters, a.partials, fluxrt::Watch{to.timeout_ns, to.err, a.op_id, to.rank}};
    }
    __device__ __forceinline__ int cut() const { return total - dp_tiles; }
    // The unit that holds K blocks [kb0, ...) of schedule item t (t >= dp_tiles), and its cluster.
    __device__ __forceinline__ int unit_of(int t, int kb0) const { return kb0 / piece_blocks * cut() + t - dp_tiles; }
    __device__ __forceinline__ int cta_of(int u) const { return (dp_tiles + u) % ctas; }
    // Cut tile index of this CTA's tile in schedule item t: its counter and partials.
    __device__ __forceinline__ int cut_tile(int t, const Schedule& sched) const {
        if constexpr (kCluster == 1) return t - dp_tiles;
        else return (t - dp_tiles) * kCluster + sched.m_rank();
    }
};

// The work units of this CTA: body(schedule item, first K block, K blocks), whole tiles first.
template <class Body>
__device__ __forceinline__ void for_each_unit(const Schedule& sched, const StreamK& sk, Body&& body) {
    for (int t = sched.first; t < sk.dp_tiles; t += sched.stride) body(t, 0, sk.k_blocks);
    const int cut = sk.cut();
    for (int u = sched.first; u < cut * sk.pieces; u += sched.stride) {
        const int piece = u / cut;
        const int kb0 = piece * sk.piece_blocks;
        body(sk.dp_tiles + (u - piece * cut), kb0, min(sk.piece_blocks, sk.k_blocks - kb0));
    }
}

// The roles' K per tile: all of K's blocks, or with split-K (a KSlices after them, the pack below holds none
// or one) the slice of the tile's band. Overloads, so that the roles of other configurations take exactly
// the arguments they took before split-K had slices (an extra argument, even unused, moved instructions).
__device__ __forceinline__ int band_k_first(int) { return 0; }
__device__ __forceinline__ int band_k_first(int row0, const KSlices& s) { return s.begin(row0); }
__device__ __forceinline__ int band_k_blocks(int k_blocks, int) { return k_blocks; }
__device__ __forceinline__ int band_k_blocks(int, int row0, const KSlices& s) { return s.blocks(row0); }
__device__ __forceinline__ int item_k_blocks(int k_blocks, const Schedule&, int) { return k_blocks; }
__device__ __forceinline__ int item_k_blocks(int, const Schedule& sched, int t, const KSlices& s) {
    return s.blocks_of_item(sched, t);
}

}  // namespace fluxrt_sm90
