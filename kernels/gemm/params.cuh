// The GEMM's kernel parameter: ONE struct passed by value (__grid_constant__, so the tensor maps are
// read in place through their parameter-space address), one member struct per concern. The layout is
// the same in every configuration (a hook that is compiled out ignores its struct) and is mirrored on
// the host by fluxrt/gemm/params.py; tests/cpu/test_gemm_params.py compiles the field offsets and sizes
// and compares them with that layout. Change both together.
//
// Size: 960 bytes, below the 4 KiB kernel-parameter limit of every CUDA version (static_assert below).
#pragma once

#include <fluxrt/comm.cuh>

#include "../gemm/sm90_primitives.cuh"

namespace fluxrt_sm90 {

// The plain GEMM.
struct GemmArgs {
    TmaDesc tmap_a;             // A [M, K], box {64 K, kBM / kClusterN rows} (banded A: 3-D, [bands][rows][K])
    TmaDesc tmap_b;             // B [N, K] box {64 K, kBN / kCluster rows}, or [K, N] box {64 N, 64 K}
    TmaDesc tmap_c;             // C [M, N] for the staged epilogue, box {128 B, 64 rows} (banded C: 3-D);
                                //   hook 3 in the epilogue: the reduced chunk's output [chunk rows, N]
    const u32* order_table;     // Hilbert order: packed (slot row << 16 | slot column) per work item; null: grouped
    void* c_direct;             // C for the direct epilogue (row-major [M, N])
    int m, n, k;
    int group_m;                // grouped order: tile rows per band
    int m_tile_offset;          // rotates the tile rows: a rank starts at its own shard
    int chunk_rows;             // the hooks' row chunks (a multiple of kBM); without hooks the band height
    int chunks_per_peer;        // chunk / chunks_per_peer = the peer that owns a chunk (band = chunk_rows * this)
    int k_slice;                // split-K: K columns of one slice (a multiple of kBK; band s multiplies
                                //   [s * k_slice, min((s + 1) * k_slice, k))); otherwise not read
};

// Hooks 1 and 3: how long a flag is waited for, and where a timeout is reported (one report per kernel).
struct TimeoutArgs {
    u64 timeout_ns;
    fluxrt::ErrorRecord* err;
    u32 rank;
};

// Hook 1 (arrival wait): before the first load of A's chunk c, wait until flags[c] >= epoch.
struct WaitArgs {
    const u64* flags;           // one word per chunk of chunk_rows rows of A
    u64 epoch;
    u32 op_id;
};

// Hook 2 (peer store + tile flag): the tiles of chunk c go to dst_tmaps[c] and raise a flag.
struct EpilogueArgs {
    const TmaDesc* dst_tmaps;   // per chunk: tensor map of its destination, row 0 = the chunk's first row
                                //   (global memory, 64-byte aligned; box as tmap_c's)
    u64* const* flag_table;     // per chunk: one flag word per tile (local_m_tile * n_tiles + n), or with
                                //   flag_group_n > 0 one per group of that many n tiles (n / flag_group_n):
                                //   a counter of the group's finished tiles across the chunk's rows
    u64 signal_value;
    int flag_group_n;
    int signal_add;             // 0: flag = signal_value (release store); 1: flag += signal_value
};

// Hook 3 (chunk reduce): chunk `chunk` is summed with the other sources' partials of its rows.
struct ReduceArgs {
    const char* partials;       // source s's partial of the chunk's rows at + s * source_bytes,
    long long source_bytes;     //   row-major, ld elements per row, C's element type
    long long ld;
    u64* flags;                 // source s's flags at + s * flag_stride: per tile (local_m_tile * n_tiles + n)
    long long flag_stride;      //   or with group_n > 0 per group of n tiles (n / group_n)
    u64 epoch;                  // a partial is in place once its flag >= epoch
    int chunk;                  // the chunk reduced here; source `chunk` is this GEMM
    u32 sources;                // sources 0 .. sources - 1 (at most 128: one waiting thread each)
    int group_n;
    u32 op_id;
};

// Hook 3 in the tail: where the reduced chunk goes and the slab claims.
struct TailArgs {
    char* out;                  // the reduced chunk, [chunk rows, N] row-major, C's type
    u32* counter;               // slab claims; 0 before the launch, reset to 0 by the launch's last claim
};

// Hook 4 (own-shard copy): A's rows [row0, row0 + rows) are read from their own source and copied into A.
struct CopyArgs {
    TmaDesc tmap_a_own;         // [rows, K], row 0 = A's row row0 (box as tmap_a's)
    u64* counters;              // one per own chunk: += pieces of it stored into A
    int row0, rows;             // whole chunks of chunk_rows
};

// fp8 dequantisation scales (FLUXRT_GEMM_SCALE), fp32 in device memory: read by the consumers, so graph
// replays and in-place scale updates see the current values.
struct ScaleArgs {
    const float* a;             // per tensor: 1 value; block: [M, k_blocks] (1 x 128: a row, a K block)
    const float* b;             // per tensor: 1 value; block: [ceil(N / 128), k_blocks] (128 x 128)
    int k_blocks;               // block: ceil(K / 128), the row length of both scale arrays
    int b_group_stride;         // grouped GEMM: group g's B scales start at b + g * this (per tensor: 1, or 0
                                //   for one scale of every group; block: ceil(N / 128) * k_blocks)
};

// Grouped GEMM (FLUXRT_GEMM_GROUPED): group g is A's rows [offsets[g], offsets[g + 1]) times B[g]. The
// offsets are read by the kernel only (no host sync: a call can be captured in a CUDA graph); each is
// clamped to [0, M] and a group with offsets[g + 1] <= offsets[g] is empty, so no offsets can make the
// kernel touch memory outside A, B and C.
//
// With hook 1 (per-group arrival wait, the MoE layer's dispatch -> gate/up overlap): before the first load of
// group g's A rows, the loader waits until WaitArgs.flags[g * arrival_sources + s] >= *arrival_epoch for every
// source s < arrival_sources (peer s in a timeout report). The epoch is read on the device, from the memory
// the producer's earlier launch wrote it to, so a CUDA graph replay waits for the replayed round.
//
// With hook 2 (per-row scatter, the MoE layer's down projection -> combine overlap): every row y of C goes
// not to C but to row `scatter_rows[y] / scatter_homes` of home rank `scatter_rows[y] % scatter_homes`'s
// buffer (scatter_dst[home], scatter_ld elements per row; a peer's symmetric memory), and once a turn's rows
// are stored the storer adds (rows x columns) of each home's rows to that home's word *scatter_flags[home].
struct GroupArgs {
    const void* offsets;        // G + 1 prefix sums of the groups' rows, int32 or int64
    int groups;                 // G, 1 .. kMaxGroups
    int offsets_64;             // 1: offsets are int64
    const u64* arrival_epoch;   // hook 1: the value the arrival flags must reach (device memory)
    u32 arrival_sources;        // hook 1: arrival flags per group (one per source)
    u32 scatter_homes;          // hook 2: home ranks (the divisor of scatter_rows)
    const int* scatter_rows;    // hook 2: per row of C, entry * scatter_homes + home (written by the sources)
    const u64* scatter_dst;     // hook 2: per home, its destination buffer (row-major, scatter_ld per row)
    u64* const* scatter_flags;  // hook 2: per home, the counter of landed elements it waits on
    long long scatter_ld;       // hook 2: elements per destination row
    long long scatter_entries;  // hook 2: rows of each destination buffer (a larger entry is not stored)
};

// Stream-K (FLUXRT_GEMM_STREAM_K): the tiles cut between CTAs and where their pieces meet. The bounded wait of a
// tile's finishing CTA reports through TimeoutArgs (err, timeout_ns, rank) and op_id here.
struct StreamKArgs {
    u64* counters;              // per cut tile and consumer warpgroup: pieces stored; 0 before the launch,
                                //   reset to 0 by the tile's finishing warpgroup (with a cluster of 2 along M, cut
                                //   tile i * 2 + M rank of cut item i)
    float* partials;            // per piece of a cut tile but its last, one fp32 partial tile (fragment order)
    int dp_tiles;               // schedule items [0, dp_tiles) run whole (tiles, or with a cluster the pairs'
                                //   slots); the rest are cut by K blocks
    u32 op_id;
    int pieces;                 // K ranges per cut tile
    int piece_blocks;           // K blocks of a piece but the last
};

// Fitted tile widths (block_n not a multiple of the 64-column staging slab) with the staged epilogue: C seen as
// [M][N / kBN][kBN], so that a box of one slab clips at the tile's last column; the last tile column (which may
// be narrower) goes through tmap_c, which clips at N.
struct FitArgs {
    TmaDesc tmap_c_tiles;       // dims {kBN, N / kBN, M} (innermost first), box {128 B, 1, 64 rows}
};

struct Params {
    GemmArgs gemm;
    CopyArgs copy;
    TimeoutArgs timeout;
    WaitArgs wait;
    EpilogueArgs epilogue;
    ReduceArgs reduce;
    TailArgs tail;
    ScaleArgs scale;
    GroupArgs group;
    StreamKArgs stream_k;       // appended: every earlier field keeps its offset
    FitArgs fit;                // appended after stream_k
};
static_assert(sizeof(Params) <= 4096, "kernel parameters are limited to 4 KiB");

}  // namespace fluxrt_sm90
