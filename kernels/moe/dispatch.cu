// MoE dispatch and combine over NVLink peer pointers (fluxrt/moe/dispatcher.py), on the device library.
//
// One dispatch is two launches, one combine two more; every cross-rank wait is the device library's
// bounded wait, and the round's flag value (epoch) comes from a device counter, so a captured CUDA graph
// replays with fresh epochs.
//
//   fluxrt_moe_layout_*     one block: ranks this rank's routing entries (token t, slot j) per expert in
//                           entry order (deterministic: warp ballots, no atomics on positions), sends its
//                           per-expert counts to every rank (a row of each rank's symmetric count matrix,
//                           then a notify flag), waits for every rank's row, and from the whole matrix
//                           computes where its rows go in each owner's receive buffer and, as an owner,
//                           the per-local-expert offsets and counts (int32, on the device).
//   fluxrt_moe_push         the grid: a warp per entry copies token t into row
//                           dst_base[e] + chunk_base[c][e] + pos of its expert's owner (NVLink stores);
//                           the last block to finish raises a data flag at every rank and waits for every
//                           rank's data flag, so the kernel ends when this rank has received everything.
//   fluxrt_moe_expand       (dedupe) the owner copies the rows that came once per (token, rank) into the token's
//                           other slots on this rank (descriptors left by the sources), then raises arrival flags.
//   fluxrt_moe_ll_push_*,   low-latency mode (decode batches): rows pushed into fixed slots per (source,
//   fluxrt_moe_ll_compact_*  expert) with the counts behind them and one flag round trip, then compacted
//                           locally into the same grouped layout.
//   fluxrt_moe_quantize_*   (FP8 dispatch) token rows to e4m3 and fp32 scales (per token or 1x128), pushed
//                           with their scales instead of the 16-bit rows.
//   fluxrt_moe_stage        the grid copies the expert outputs y into this rank's receive buffer (nothing
//                           when y is that buffer); the last block raises a ready flag at every rank and
//                           waits for every rank's.
//   fluxrt_moe_combine_*    a warp per token pulls its k expert outputs from their owners' buffers and sums
//                           them weighted in slot order 0 .. k-1 in fp32 (the same bits on every call).
//   fluxrt_moe_combine_returned_*  (returns: MoELayer's overlap) the same sums of rows the owners' down
//                           projection pushed back into this rank's return buffer, each owner's rows waited
//                           for (bounded) on a counter of landed elements; no stage kernel, no ready flags.
//
// Receive layout of owner r: rows grouped by local expert, inside an expert by source rank, inside a source
// by entry order (token, slot). A token routed to two experts of one rank is sent twice (once per row), or with
// dedupe once: the row of its first slot on that rank crosses NVLink, and the source leaves at each of the
// token's other rows there a descriptor (an int32 in the owner's symmetric src_of array: the first slot's row,
// -1 at a pushed row) that the owner's expand turns into a local copy. Low latency does the same with staging
// slots: the compaction reads a copied slot through its descriptor.
//
// Arrival flags (MoELayer's overlap; `order` and `arrive_peers` non-null): the layout also sorts this rank's
// entries into push order, local expert index first (every owner's expert 0, then every owner's expert 1, ...),
// inside it owners from rank + 1 on; the push goes in that order and, when this rank's last row to expert x
// has landed, sets word [x % E_local][rank] of the owner's arrival array to the round (an expert this rank
// sends nothing gets it at once). An owner's grouped GEMM waits for every source's word of a group before
// loading its rows, so an expert's tiles start while later experts' rows are still on their way. With dedupe a
// source does not raise the words of experts it sends copied rows to: the owner's expand raises every word
// after its copies (the whole push has landed by then).
//
// Returns (`home_peers` non-null): the push also writes, for each row it places at an owner, the row's home and
// entry (entry * world + this rank) into the owner's symmetric home_of array, before the row's arrival flag or
// data flag; the owner's down-projection GEMM reads it to store the row's output straight into row `entry` of
// this rank's return buffer. A return buffer is written in round n only after this rank's layout of round n
// (every owner's layout waits for its notify flag), i.e. after its combine of round n - 1 ended.
//
// Buffer reuse across calls: a source writes an owner's buffer (push) only after every rank's count row of
// the same round arrived, and a rank sends its row only after its previous combine (which read the peers'
// buffers) completed in stream order; an owner overwrites its buffer with y (stage) only after every source's
// data flag, i.e. after every push into it.
//
// Compiled with NVRTC: builtin types only.
#include "fluxrt/comm.cuh"
#include "fluxrt/quant.cuh"

namespace fluxrt {
namespace moe {

constexpr u32 kChunks = 32;         // layout: one warp ranks each contiguous chunk of the entries
constexpr u32 kMaxExperts = 256;    // fluxrt/moe/dispatcher.py MAX_EXPERTS (shared count table of layout)
constexpr u32 kMaxTopK = 32;        // fluxrt/moe/dispatcher.py MAX_TOP_K
constexpr u32 kPullBatch = 8;       // combine: expert outputs of one token loaded before the first fold
// Flag arrays (symmetric, [3][world] u64 per rank): word [kind * world + source].
constexpr u32 kNotify = 0, kData = 1, kReady = 2;

struct Team {
    u32 rank, world;
    u64 timeout_ns;
    ErrorRecord* err;
    u32 op;
    __device__ __forceinline__ Watch watch() const { return Watch{timeout_ns, err, op, rank}; }
};

__device__ __forceinline__ u32 chunk_entries(u32 n) { return (n + kChunks - 1) / kChunks; }

template <class Idx>
__device__ __forceinline__ int expert_of(const Idx* idx, u32 i, u32 num_experts) {
    const long long v = (long long)idx[i];
    return v >= 0 && v < (long long)num_experts ? (int)v : -1;  // -1: a masked slot
}

// Dedupe: the first slot q < j of token tok whose expert lives on `owner` (the slot whose row crosses NVLink
// for all of the token's slots on that owner), or -1 when slot j is that first one.
template <class Idx>
__device__ __forceinline__ int first_on_owner(const Idx* idx, u32 tok, u32 j, u32 k, u32 num_experts,
                                              u32 local_experts, u32 owner) {
    for (u32 q = 0; q < j; ++q) {
        const int x = expert_of(idx, tok * k + q, num_experts);
        if (x >= 0 && (u32)x / local_experts == owner) return (int)q;
    }
    return -1;
}

// Rows this rank sends to each owner (moved[world]: one per entry, with dedupe one per (token, owner)) and,
// with dedupe, its entries per expert that travel as a copy of another slot's row (dups[E]). One block;
// mv and dp: its shared scratch.
template <class Idx>
__device__ void count_sends(const Team& t, const Idx* idx, u32 tokens, u32 k, u32 E, u32 local_experts,
                            bool dedupe, int* mv, int* dp, int* moved, int* dups) {
    for (u32 x = threadIdx.x; x < E; x += blockDim.x) dp[x] = 0;
    for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) mv[q] = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < tokens * k; i += blockDim.x) {   // counts: the order of additions is free
        const int x = expert_of(idx, i, E);
        if (x < 0) continue;
        const u32 owner = (u32)x / local_experts;
        if (!dedupe || first_on_owner(idx, i / k, i % k, k, E, local_experts, owner) < 0) atomicAdd(mv + owner, 1);
        else atomicAdd(dp + x, 1);
    }
    __syncthreads();
    for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) moved[q] = mv[q];
    if (dups != nullptr)
        for (u32 x = threadIdx.x; x < E; x += blockDim.x) dups[x] = dp[x];
}

// The last block of the grid to get here (after every thread of every block fenced its stores) returns
// true, with a fence after its observation of the others' arrivals; it resets the counter for the next
// launch (kernels of one Dispatcher run in stream order).
__device__ __forceinline__ bool last_block(u32* done) {
    __shared__ int last;
    block_publish();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (last) {
            fence_acq_rel_sys();
            *done = 0u;
        }
    }
    __syncthreads();
    return last != 0;
}

// Raise flag word [kind][rank] at every rank, then wait for word [kind][p] of every rank p here.
__device__ __forceinline__ bool exchange_flags(const Team& t, const u64* flag_peers, const u64* flags, u32 kind,
                                               u64 e) {
    signal_peers(t.world, every_peer,
                 [&](u32 q) { return reinterpret_cast<u64*>(flag_peers[q]) + kind * t.world + t.rank; }, e);
    return wait_peers(t.watch(), t.world, every_peer, [&](u32 p) { return flags + kind * t.world + p; }, e);
}

// The block reads every rank's count row (counts_all[s * E + x]: rows source s sends to expert x; pushed by
// s, so loads bypass L1) and writes dst_base[x], the first row of this rank's rows to expert x in its owner's
// buffer, and as an owner (offsets != nullptr) the first row and count of each local expert. total and before:
// the block's shared scratch of kMaxExperts each.
__device__ void rows_from_counts(const Team& t, const int* counts_all, u32 E, u32 local_experts, int* total,
                                 int* before, int* dst_base, int* offsets, int* counts) {
    for (u32 x = threadIdx.x; x < E; x += blockDim.x) {
        int sum = 0, mine = 0;
        for (u32 s = 0; s < t.world; ++s) {
            const int v = __ldcv(counts_all + s * E + x);
            if (s < t.rank) mine += v;
            sum += v;
        }
        total[x] = sum;
        before[x] = mine;
    }
    __syncthreads();
    for (u32 x = threadIdx.x; x < E; x += blockDim.x) {
        const u32 first = x / local_experts * local_experts;
        int start = 0;
        for (u32 y = first; y < x; ++y) start += total[y];
        dst_base[x] = start + before[x];
        if (offsets != nullptr && first == t.rank * local_experts) {
            offsets[x - first] = start;
            counts[x - first] = total[x];
            if (x - first == local_experts - 1) offsets[local_experts] = start + total[x];
        }
    }
}

// Push order (arrival flags): entry i goes j-th, j = (rows of experts before its expert in push order) +
// (its rank among this rank's rows to that expert); entries past the valid ones are -1. before: shared scratch.
template <class Idx>
__device__ void push_order(const Team& t, const Idx* idx, u32 n, u32 per, u32 E, u32 local_experts,
                           const int* total, int* before, const int* pos, const int* chunk_base, int* order) {
    auto key = [&](u32 x) {
        return (x % local_experts) * t.world + (x / local_experts + t.world - t.rank - 1) % t.world;
    };
    for (u32 x = threadIdx.x; x < E; x += blockDim.x) {
        const u32 kx = key(x);
        int b = 0;
        for (u32 y = 0; y < E; ++y) b += key(y) < kx ? total[y] : 0;
        before[x] = b;
    }
    __syncthreads();
    int valid = 0;
    for (u32 y = 0; y < E; ++y) valid += total[y];
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const int x = expert_of(idx, i, E);
        if (x >= 0) order[before[x] + chunk_base[(i / per) * E + x] + pos[i]] = (int)i;
        if (i >= (u32)valid) order[i] = -1;
    }
}

template <class Idx>
__device__ void layout(const Team& t, u64* epoch, const Idx* idx, u32 tokens, u32 k, u32 num_experts,
                       u32 local_experts, const u64* count_peers, const int* counts_all, const u64* flag_peers,
                       const u64* flags, int* pos, int* chunk_base, int* dst_base, int* offsets, int* counts,
                       int* order, u32* sent, int dedupe, int* moved, int* dups) {
    __shared__ int cnt[kChunks][kMaxExperts];
    __shared__ int total[kMaxExperts];
    __shared__ int before[kMaxExperts];
    __shared__ int mv[kMaxWorld], dp[kMaxExperts];
    __shared__ u64 round;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 E = num_experts;
    for (u32 i = threadIdx.x; i < kChunks * kMaxExperts; i += blockDim.x) cnt[i / kMaxExperts][i % kMaxExperts] = 0;
    if (threadIdx.x == 0) {
        round = atomicAdd(epoch, 1ull) + 1ull;
        epoch[1] = round;  // the round of this dispatch, for its push and its combine
    }
    __syncthreads();
    const u64 e = round;
    const u32 n = tokens * k, per = chunk_entries(n);
    // Positions inside each chunk per expert, in entry order: lanes with the same expert rank themselves
    // by lane index; the lowest of them advances the chunk's count.
    for (u32 c = warp; c < kChunks; c += blockDim.x >> 5) {
        const u32 lo = c * per < n ? c * per : n, hi = lo + per < n ? lo + per : n;
        for (u32 b = lo; b < hi; b += 32u) {
            const u32 i = b + lane;
            const int x = i < hi ? expert_of(idx, i, E) : -1;
            const u32 same = __match_any_sync(0xffffffffu, x);
            const u32 below = same & ((1u << lane) - 1u);
            if (x >= 0) pos[i] = cnt[c][x] + __popc(below);
            __syncwarp();
            if (x >= 0 && below == 0) cnt[c][x] += __popc(same);
            __syncwarp();
        }
    }
    __syncthreads();
    for (u32 x = threadIdx.x; x < E; x += blockDim.x) {
        int run = 0;
        for (u32 c = 0; c < kChunks; ++c) {
            chunk_base[c * E + x] = run;
            run += cnt[c][x];
        }
        total[x] = run;
    }
    __syncthreads();
    // This rank's counts become row `rank` of every rank's matrix.
    for (u32 i = threadIdx.x; i < t.world * E; i += blockDim.x) {
        const u32 q = i / E, x = i % E;
        reinterpret_cast<int*>(count_peers[q])[t.rank * E + x] = total[x];
    }
    // exchange_flags, with the push order computed while the peers' counts are on their way
    signal_peers(t.world, every_peer,
                 [&](u32 q) { return reinterpret_cast<u64*>(flag_peers[q]) + kNotify * t.world + t.rank; }, e);
    if (order != nullptr) {
        for (u32 x = threadIdx.x; x < E; x += blockDim.x) sent[x] = 0u;   // the push's per-expert row counters
        push_order(t, idx, n, per, E, local_experts, total, before, pos, chunk_base, order);
    }
    count_sends(t, idx, tokens, k, E, local_experts, dedupe != 0, mv, dp, moved, dups);
    if (!wait_peers(t.watch(), t.world, every_peer, [&](u32 p) { return flags + kNotify * t.world + p; }, e)) return;
    rows_from_counts(t, counts_all, E, local_experts, total, before, dst_base, offsets, counts);
}

// x rows of row_bytes (a multiple of 16) each; recv_peers[r]: rank r's receive buffer mapped here.
// With arrival flags: entries in push order (order[j]), and arrive_peers[r] = rank r's arrival array
// ([E_local][world] u64), counts_all this rank's count matrix (row `rank`: its rows per expert), sent[E] the
// per-expert counters of rows landed (0 before the launch, left 0).
template <class Idx>
__device__ void push(const Team& t, const u64* epoch, const Idx* idx, u32 tokens, u32 k, u32 num_experts,
                     u32 local_experts, const char* x, u64 row_bytes, u32 recv_rows, const u64* recv_peers,
                     const float* scales, u32 scale_row, const u64* scale_peers, int* pos, const int* chunk_base,
                     const int* dst_base, const u64* flag_peers, const u64* flags, u32* done, const int* order,
                     const int* counts_all, const u64* arrive_peers, u32* sent, int* rows_out,
                     const u64* src_peers, const int* dups, const u64* home_peers) {
    const u64 e = epoch[1];
    const int* mine = counts_all + (u64)t.rank * num_experts;   // this rank's rows per expert
    auto arrival = [&](u32 xe) {
        return reinterpret_cast<u64*>(arrive_peers[xe / local_experts]) + (xe % local_experts) * t.world + t.rank;
    };
    const u32 lane = threadIdx.x & 31u;
    // after a timed-out layout (the record is set) the rows are stale: push nothing, only end the round. One
    // read per block: the record is host memory, and a read per thread (64K of them over PCIe) cost ~2 ms.
    __shared__ int failed;
    if (threadIdx.x == 0) failed = error_raised(t.err);
    __syncthreads();
    const u32 n = failed ? 0u : tokens * k, per = chunk_entries(n);
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    if (arrive_peers != nullptr && !failed && blockIdx.x == 0) {   // experts this rank sends nothing: arrived
        for (u32 xe = threadIdx.x; xe < num_experts; xe += blockDim.x)
            if (mine[xe] == 0) st_release_sys(arrival(xe), e);   // guards no data of this round
    }
    for (u32 j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < n; j += warps) {
        const int oi = order != nullptr ? order[j] : (int)j;
        if (oi < 0) continue;   // past the valid entries of the push order
        const u32 i = (u32)oi;
        const int xe = expert_of(idx, i, num_experts);
        if (xe < 0) continue;
        const u32 owner = (u32)xe / local_experts;
        const int row = dst_base[xe] + chunk_base[(i / per) * num_experts + xe] + pos[i];
        if ((u32)row >= recv_rows) continue;  // cannot happen with a complete layout: bounds the damage otherwise
        // returns: the row's home (this rank) and entry, for the owner's down projection to send its output back;
        // published with the row by the warp_publish / data flag below
        if (home_peers != nullptr && lane == 0)
            reinterpret_cast<int*>(home_peers[owner])[row] = (int)(i * t.world + t.rank);
        int src = -1;   // dedupe: the owner's row holding this token already (its first slot on that owner)
        if (src_peers != nullptr) {
            const int q = first_on_owner(idx, i / k, i % k, k, num_experts, local_experts, owner);
            if (q >= 0) {
                const u32 ip = i - i % k + (u32)q;
                const int xp = expert_of(idx, ip, num_experts);
                src = dst_base[xp] + chunk_base[(ip / per) * num_experts + xp] + pos[ip];
                if ((u32)src >= recv_rows) continue;
            }
            if (lane == 0) reinterpret_cast<int*>(src_peers[owner])[row] = src;   // the owner's expand reads it
        }
        if (src < 0) {
            char* dst = reinterpret_cast<char*>(recv_peers[owner]) + (u64)row * row_bytes;
            copy_units(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(x + (u64)(i / k) * row_bytes),
                       row_bytes / kVecBytes, lane, 32u, LoadNc{});
            if (scale_row) {  // FP8 rows: their scales go to the same row of the owner's scale buffer
                float* ds = reinterpret_cast<float*>(scale_peers[owner]) + (u64)row * scale_row;
                for (u32 q = lane; q < scale_row; q += 32u) ds[q] = scales[(u64)(i / k) * scale_row + q];
            }
        }
        // an expert with copied rows from this rank is flagged by the owner's expand, after its copies
        if (arrive_peers != nullptr && (dups == nullptr || dups[xe] == 0)) {
            warp_publish();
            if (lane == 0) arrive_counted(sent + xe, (u32)mine[xe], arrival((u32)xe), e);   // the expert's last row
        }
        __syncwarp();
        if (lane == 0) rows_out[i] = row;  // the handle of combine: where entry i's row lies at its owner
    }
    if (last_block(done)) exchange_flags(t, flag_peers, flags, kData, e);
}

// Dedupe (throughput): after the push (every source's rows are in), each row whose source left a copy
// descriptor (src_of[row] >= 0: the row of the same token's first slot on this rank) gets that row's bytes
// (FP8: and scales), a warp per row; descriptors are only ever first-slot rows, which no copy writes. With
// arrival flags the last block then raises every (local expert, source) word of this rank: the words of the
// experts with copied rows are left to it by their sources.
__device__ void expand(const Team& t, const u64* epoch, const int* src_of, const int* offsets, u32 local_experts,
                       u32 recv_rows, char* recv, u64 row_bytes, float* scales, u32 scale_row, u64* arrive,
                       u32* done) {
    const u64 e = epoch[1];
    __shared__ int failed;
    if (threadIdx.x == 0) failed = error_raised(t.err);  // once per block: the record is host memory
    __syncthreads();
    const u32 lane = threadIdx.x & 31u, warps = gridDim.x * (blockDim.x >> 5);
    const u32 all = (u32)offsets[local_experts];
    const u32 rows = failed ? 0u : (all < recv_rows ? all : recv_rows);
    for (u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        const int s = __ldcv(src_of + r);   // written by the row's source over NVLink
        if (s < 0 || (u32)s >= rows) continue;
        copy_units(reinterpret_cast<uint4*>(recv + (u64)r * row_bytes),
                   reinterpret_cast<const uint4*>(recv + (u64)s * row_bytes), row_bytes / kVecBytes, lane, 32u,
                   LoadCv{});
        for (u32 q = lane; q < scale_row; q += 32u)
            scales[(u64)r * scale_row + q] = __ldcv(scales + (u64)s * scale_row + q);
    }
    if (arrive != nullptr && last_block(done))
        for (u32 w = threadIdx.x; w < local_experts * t.world; w += blockDim.x) st_release_sys(arrive + w, e);
}

// Low-latency dispatch (decode batches): no count exchange before the data. A warp per entry ranks it among
// the earlier entries of its expert (a ballot scan: the same order as the throughput layout) and pushes the row
// into slot [this rank][local expert][position] of the owner's staging buffer ([world][E_local][max_tokens]
// rows); the last block counts the entries per expert, writes the counts as row `rank` of every rank's count
// matrix and exchanges data flags (one round trip). ll_compact then moves each owner's slots into the grouped
// layout (a local copy) and turns positions into the rows combine reads. A token may name an expert once.
template <class Idx>
__device__ void ll_push(const Team& t, u64* epoch, const Idx* idx, u32 tokens, u32 k, u32 num_experts,
                        u32 local_experts, const char* x, u64 row_bytes, u32 max_tokens, const u64* stage_peers,
                        const u64* count_peers, int* pos, const u64* flag_peers, const u64* flags, u32* done,
                        const u64* src_peers, int* moved) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = error_raised(t.err);  // once per block: the record is host memory
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    const u32 n = failed ? 0u : tokens * k;
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    for (u32 i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < n; i += warps) {
        const int xe = expert_of(idx, i, num_experts);
        if (xe < 0) continue;
        u32 p = 0;
        for (u32 b = 0; b < i; b += 32u) {
            const u32 j = b + lane;
            p += __popc(__ballot_sync(0xffffffffu, j < i && expert_of(idx, j, num_experts) == xe));
        }
        if (p >= max_tokens) continue;  // only a token naming one expert twice gets here
        const u32 owner = (u32)xe / local_experts;
        const u64 slot = ((u64)t.rank * local_experts + (u32)xe % local_experts) * max_tokens + p;
        long long src = -1;   // dedupe: the owner's staging slot of the token's first slot on that owner
        if (src_peers != nullptr) {
            const int q = first_on_owner(idx, i / k, i % k, k, num_experts, local_experts, owner);
            if (q >= 0) {
                const u32 ip = i - i % k + (u32)q;
                const int xp = expert_of(idx, ip, num_experts);
                u32 pp = 0;
                for (u32 b = 0; b < ip; b += 32u) {
                    const u32 j = b + lane;
                    pp += __popc(__ballot_sync(0xffffffffu, j < ip && expert_of(idx, j, num_experts) == xp));
                }
                if (pp < max_tokens)   // else that slot was not pushed: this one carries its own row
                    src = (long long)(((u64)t.rank * local_experts + (u32)xp % local_experts) * max_tokens + pp);
            }
            if (lane == 0) reinterpret_cast<int*>(src_peers[owner])[slot] = (int)src;   // compact reads it
        }
        if (src < 0) {
            char* dst = reinterpret_cast<char*>(stage_peers[owner]) + slot * row_bytes;
            copy_units(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(x + (u64)(i / k) * row_bytes),
                       row_bytes / kVecBytes, lane, 32u, LoadNc{});
        }
        if (lane == 0) pos[i] = (int)p;
    }
    if (!last_block(done)) return;
    __shared__ int cnt[kMaxExperts], mv[kMaxWorld], dp[kMaxExperts];
    __shared__ u64 round;
    count_sends(t, idx, failed ? 0u : tokens, k, num_experts, local_experts, src_peers != nullptr, mv, dp, moved,
                nullptr);
    for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) cnt[e] = 0;
    if (threadIdx.x == 0) {
        round = atomicAdd(epoch, 1ull) + 1ull;
        epoch[1] = round;  // the round of this dispatch, for its combine
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const int xe = expert_of(idx, i, num_experts);
        if (xe >= 0) atomicAdd(&cnt[xe], 1);  // counts only: the order of the additions does not matter
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < t.world * num_experts; i += blockDim.x) {
        const u32 q = i / num_experts, e = i % num_experts;
        reinterpret_cast<int*>(count_peers[q])[t.rank * num_experts + e] = cnt[e];
    }
    exchange_flags(t, flag_peers, flags, kData, round);
}

template <class Idx>
__device__ void ll_compact(const Team& t, const Idx* idx, u32 tokens, u32 k, u32 num_experts, u32 local_experts,
                           const int* counts_all, const char* staging, u32 max_tokens, char* recv, u64 row_bytes,
                           int* pos, int* offsets, int* counts, const int* stage_src) {
    __shared__ int total[kMaxExperts], before[kMaxExperts], base[kMaxExperts];
    rows_from_counts(t, counts_all, num_experts, local_experts, total, before, base,
                     blockIdx.x == 0 ? offsets : nullptr, counts);
    __syncthreads();
    const u32 n = tokens * k;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int xe = expert_of(idx, i, num_experts);
        if (xe >= 0) pos[i] += base[xe];  // position in (this rank, expert) -> row at the owner
    }
    // slot (source s, local expert l, row j < count) -> row offsets[l] + rows of sources before s + j
    const u32 lane = threadIdx.x & 31u, warps = gridDim.x * (blockDim.x >> 5);
    const u32 first = t.rank * local_experts;
    const u64 items = (u64)t.world * local_experts * max_tokens;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        const u32 pair = (u32)(it / max_tokens), j = (u32)(it % max_tokens);
        const u32 s = pair / local_experts, l = pair % local_experts;
        if ((int)j >= __ldcv(counts_all + s * num_experts + first + l)) continue;
        int row = 0;
        for (u32 y = first; y < first + l; ++y) row += total[y];
        for (u32 q = 0; q < s; ++q) row += __ldcv(counts_all + q * num_experts + first + l);
        // dedupe: a slot whose source pushed no row reads the slot of the token's first slot on this rank
        const int from = stage_src != nullptr ? __ldcv(stage_src + it) : -1;
        const u64 src = from >= 0 && (u64)from < items ? (u64)from : it;
        copy_units(reinterpret_cast<uint4*>(recv + (u64)(row + (int)j) * row_bytes),
                   reinterpret_cast<const uint4*>(staging + src * row_bytes), row_bytes / kVecBytes, lane, 32u,
                   LoadCv{});
    }
}

__device__ void stage(const Team& t, const u64* epoch, const char* y, u64 y_rows, char* recv, u64 row_bytes,
                      const int* offsets, u32 local_experts, const u64* flag_peers, const u64* flags, u32* done) {
    const u64 e = epoch[1];
    if (y != recv) {
        const u64 rows_r = (u64)offsets[local_experts];
        const u64 rows = rows_r < y_rows ? rows_r : y_rows;
        copy_units(reinterpret_cast<uint4*>(recv), reinterpret_cast<const uint4*>(y), rows * row_bytes / kVecBytes,
                   (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x, LoadNc{});
    }
    if (last_block(done)) exchange_flags(t, flag_peers, flags, kReady, e);
}

// out[t] = sum over slots j in order of w[t, j] * (expert output row of entry t k + j), fp32, a warp per token.
// row_of(i, xe) is where entry i's row lies (xe: its expert); ready(need) is called by every lane once per token
// with the bit mask of the owners of the token's slots and returns false when one of them could not be waited
// for (the token's output is then poisoned, nothing read). Both combines run this one loop, so they give the
// same bits for the same rows.
template <class E, class Idx, class RowOf, class Ready>
__device__ void weighted_sums(const Idx* idx, const float* weights, u32 tokens, u32 k, u32 num_experts,
                              u32 local_experts, u64 row_bytes, typename E::T* out, RowOf row_of, Ready ready) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    const u64 nvec = row_bytes / kVecBytes;
    for (u32 tok = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tok < tokens; tok += warps) {
        // lane j < k holds slot j's source row (null when masked) and weight
        const uint4* src = nullptr;
        float w = 0.f;
        u32 owner_bit = 0u;
        if (lane < k) {
            const u32 i = tok * k + lane;
            const int xe = expert_of(idx, i, num_experts);
            if (xe >= 0) {
                src = row_of(i, (u32)xe);
                w = weights[i];
                owner_bit = 1u << ((u32)xe / local_experts);
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(out) + (u64)tok * row_bytes);
        if (__all_sync(0xffffffffu, ready(__reduce_or_sync(0xffffffffu, owner_bit))) == 0) {
            poison_bytes(reinterpret_cast<char*>(dst), row_bytes, lane, 32u);
            continue;
        }
        // every lane runs every pass (the shuffles need the whole warp); lanes past the row only skip memory
        for (u64 v0 = 0; v0 < nvec; v0 += 32u) {
            const u64 v = v0 + lane;
            const bool in_row = v < nvec;
            float acc[E::kPerVec];
#pragma unroll
            for (u32 q = 0; q < E::kPerVec; ++q) acc[q] = 0.f;
            for (u32 j0 = 0; j0 < k; j0 += kPullBatch) {
                uint4 raw[kPullBatch];
                float wj[kPullBatch];
#pragma unroll
                for (u32 b = 0; b < kPullBatch; ++b) {
                    const u32 j = j0 + b < k ? j0 + b : 0u;
                    const uint4* s = reinterpret_cast<const uint4*>(__shfl_sync(0xffffffffu, (u64)src, j));
                    const float ws = __shfl_sync(0xffffffffu, w, j);
                    const bool use = j0 + b < k && s != nullptr;
                    wj[b] = use ? ws : 0.f;
                    raw[b] = use && in_row ? __ldcv(s + v) : make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (u32 b = 0; b < kPullBatch; ++b)
                    if (j0 + b < k && wj[b] != 0.f) fold_vec_weighted<E>(acc, raw[b], wj[b]);
            }
            if (in_row) dst[v] = pack_vec<E>(acc);
        }
    }
}

// Combine after the stage kernel's ready flags: every token pulls row pos[t k + j] from its expert's owner.
template <class E, class Idx>
__device__ void combine(const Idx* idx, const float* weights, u32 tokens, u32 k, u32 num_experts,
                        u32 local_experts, const int* pos, const u64* recv_peers, u64 row_bytes,
                        typename E::T* out) {
    weighted_sums<E>(
        idx, weights, tokens, k, num_experts, local_experts, row_bytes, out,
        [&](u32 i, u32 xe) {
            return reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(recv_peers[xe / local_experts]) +
                                                  (u64)pos[i] * row_bytes);
        },
        [](u32) { return true; });   // every owner's ready flag was waited for by the stage kernel
}

// Combine of rows pushed back (MoELayer overlap): the owners' down-projection GEMM stored the output row of
// this rank's entry i into row i of `ret` (this rank's return buffer) and added (rows x columns) to
// landed[owner] after its stores (GroupedScatterEpilogue in kernels/gemm/epilogue.cuh). This round, owner q
// sends hidden elements for each of this rank's entries to its experts (this rank's row of the count matrix), on
// top of landed_base[q], what had landed by the end of the previous such combine. The counters are never reset:
// they only grow, and the next round's rows cannot come before this rank's next dispatch layout (after this
// kernel in stream order), so at the end landed[q] is this round's target, the next round's base.
//   wait: each lane acquires (bounded, ld.acquire.sys) landed[q] >= target[q] itself for every owner q of a
//     token's slots it has not acquired before in this launch (a lane's acquire orders all of its later loads,
//     and every lane reads part of every slot's row), so a token is summed as soon as its owners' rows are in,
//     while other owners' rows are still on their way. A timeout names the owner; the token's row is poisoned.
//   base: the last block (after every block's waits) stores landed[q] as the next base; after a timed-out round
//     that re-bases on what did land, so a lost round does not leave every later one waiting.
template <class E, class Idx>
__device__ void combine_returned(const Team& t, const Idx* idx, const float* weights, u32 tokens, u32 k,
                                 u32 num_experts, u32 local_experts, const char* ret, u64 row_bytes, u32 hidden,
                                 const int* counts_all, const u64* landed, u64* landed_base, u32* done,
                                 typename E::T* out) {
    __shared__ u64 target[kMaxWorld];
    for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) {
        u64 rows = 0;   // this rank's entries to owner q's experts (its own row of the count matrix)
        for (u32 x = q * local_experts; x < (q + 1) * local_experts; ++x)
            rows += (u64)counts_all[(u64)t.rank * num_experts + x];
        target[q] = landed_base[q] + rows * hidden;
    }
    __syncthreads();
    const Watch watch = t.watch();
    u32 seen = 0u;   // owners this lane has acquired
    weighted_sums<E>(
        idx, weights, tokens, k, num_experts, local_experts, row_bytes, out,
        [&](u32 i, u32) { return reinterpret_cast<const uint4*>(ret + (u64)i * row_bytes); },
        [&](u32 need) {
            bool ok = true;
            for (u32 left = need & ~seen; left != 0u; left &= left - 1u) {
                const u32 q = (u32)__ffs(left) - 1u;
                if (wait_ge(landed + q, target[q], watch, q)) seen |= 1u << q;
                else ok = false;
            }
            return ok;
        });
    if (last_block(done))
        for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) landed_base[q] = ld_acquire_sys(landed + q);
}

// FP8 dispatch: token rows of x quantized to e4m3 with one fp32 scale per token or per 1x128 block, as the
// device library quantizes (fluxrt/quant.cuh: scale = amax / 448, code = e4m3(x / scale), 0 for an all-zero
// group). A warp per token; a lane takes 4 elements a pass, so a pass is one 128-element block.
template <class E>
__device__ void quantize(const typename E::T* x, u32 tokens, u32 hidden, bool block, unsigned char* q, float* scales) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    const u32 nquad = hidden / 4u;
    for (u32 tok = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tok < tokens; tok += warps) {
        const uint2* row = reinterpret_cast<const uint2*>(x + (u64)tok * hidden);
        auto load4 = [&](u32 v, float (&f)[4]) {
            const uint2 w = row[v];
            f[0] = E::lo(w.x), f[1] = E::hi(w.x), f[2] = E::lo(w.y), f[3] = E::hi(w.y);
            return fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
        };
        float row_scale = 0.f;
        if (!block) {
            float a = 0.f, f[4];
            for (u32 v = lane; v < nquad; v += 32u) a = fmaxf(a, load4(v, f));
            row_scale = group_scale<Fp8E4M3>(warp_max(a));
            if (lane == 0) scales[tok] = row_scale;
        }
        for (u32 v0 = 0; v0 < nquad; v0 += 32u) {  // every lane runs every pass (warp_max)
            const u32 v = v0 + lane;
            float f[4] = {0.f, 0.f, 0.f, 0.f};
            const float a = v < nquad ? load4(v, f) : 0.f;
            const float scale = block ? group_scale<Fp8E4M3>(warp_max(a)) : row_scale;
            if (v < nquad) reinterpret_cast<u32*>(q + (u64)tok * hidden)[v] = quantize4<Fp8E4M3>(f, scale);
            if (block && lane == 0) scales[(u64)tok * (hidden / 128u) + v0 / 32u] = scale;
        }
    }
}

}  // namespace moe
}  // namespace fluxrt

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;
using namespace fluxrt::moe;

#define FLUXRT_MOE_TEAM_PARAMS u32 rank, u32 world, u64 timeout_ns, ErrorRecord *err, u32 op
#define FLUXRT_MOE_TEAM Team{rank, world, timeout_ns, err, op}

#define FLUXRT_MOE_RETURNED(KIND, NAME, IDX, E)                                                              \
    extern "C" __global__ void fluxrt_moe_combine_returned_##KIND##_##NAME(                                  \
        FLUXRT_MOE_TEAM_PARAMS, const IDX* idx, const float* weights, u32 tokens, u32 k, u32 num_experts,    \
        u32 local_experts, const char* ret, u64 row_bytes, u32 hidden, const int* counts_all,                \
        const u64* landed, u64* landed_base, u32* done, unsigned short* out) {                               \
        combine_returned<E>(FLUXRT_MOE_TEAM, idx, weights, tokens, k, num_experts, local_experts, ret,       \
                            row_bytes, hidden, counts_all, landed, landed_base, done, out);                  \
    }

#define FLUXRT_MOE_INDEX(NAME, IDX)                                                                          \
    extern "C" __global__ void fluxrt_moe_layout_##NAME(                                                     \
        FLUXRT_MOE_TEAM_PARAMS, u64* epoch, const IDX* idx, u32 tokens, u32 k, u32 num_experts,              \
        u32 local_experts, const u64* count_peers, const int* counts_all, const u64* flag_peers,             \
        const u64* flags, int* pos, int* chunk_base, int* dst_base, int* offsets, int* counts, int* order,   \
        u32* sent, int dedupe, int* moved, int* dups) {                                                  \
        layout(FLUXRT_MOE_TEAM, epoch, idx, tokens, k, num_experts, local_experts, count_peers, counts_all,\
               flag_peers, flags, pos, chunk_base, dst_base, offsets, counts, order, sent, dedupe, moved, dups);\
    }                                                                                                        \
    extern "C" __global__ void fluxrt_moe_push_##NAME(                                                       \
        FLUXRT_MOE_TEAM_PARAMS, const u64* epoch, const IDX* idx, u32 tokens, u32 k, u32 num_experts,        \
        u32 local_experts, const char* x, u64 row_bytes, u32 recv_rows, const u64* recv_peers,               \
        const float* scales, u32 scale_row, const u64* scale_peers, int* pos, const int* chunk_base,         \
        const int* dst_base, const u64* flag_peers, const u64* flags, u32* done, const int* order,           \
        const int* counts_all, const u64* arrive_peers, u32* sent, int* rows_out, const u64* src_peers,  \
        const int* dups, const u64* home_peers) {                                                        \
        push(FLUXRT_MOE_TEAM, epoch, idx, tokens, k, num_experts, local_experts, x, row_bytes, recv_rows,     \
             recv_peers, scales, scale_row, scale_peers, pos, chunk_base, dst_base, flag_peers, flags, done,  \
             order, counts_all, arrive_peers, sent, rows_out, src_peers, dups, home_peers);              \
    }                                                                                                        \
    extern "C" __global__ void fluxrt_moe_ll_push_##NAME(                                                    \
        FLUXRT_MOE_TEAM_PARAMS, u64* epoch, const IDX* idx, u32 tokens, u32 k, u32 num_experts,              \
        u32 local_experts, const char* x, u64 row_bytes, u32 max_tokens, const u64* stage_peers,             \
        const u64* count_peers, int* pos, const u64* flag_peers, const u64* flags, u32* done,            \
        const u64* src_peers, int* moved) {                                                              \
        ll_push(FLUXRT_MOE_TEAM, epoch, idx, tokens, k, num_experts, local_experts, x, row_bytes, max_tokens, \
                stage_peers, count_peers, pos, flag_peers, flags, done, src_peers, moved);               \
    }                                                                                                        \
    extern "C" __global__ void fluxrt_moe_ll_compact_##NAME(                                                 \
        FLUXRT_MOE_TEAM_PARAMS, const IDX* idx, u32 tokens, u32 k, u32 num_experts, u32 local_experts,       \
        const int* counts_all, const char* staging, u32 max_tokens, char* recv, u64 row_bytes, int* pos,     \
        int* offsets, int* counts, const int* stage_src) {                                               \
        ll_compact(FLUXRT_MOE_TEAM, idx, tokens, k, num_experts, local_experts, counts_all, staging,         \
                   max_tokens, recv, row_bytes, pos, offsets, counts, stage_src);                        \
    }                                                                                                        \
    extern "C" __global__ void fluxrt_moe_combine_bf16_##NAME(                                               \
        const IDX* idx, const float* weights, u32 tokens, u32 k, u32 num_experts, u32 local_experts,         \
        const int* pos, const u64* recv_peers, u64 row_bytes, unsigned short* out) {                         \
        combine<fluxrt::BF16>(idx, weights, tokens, k, num_experts, local_experts, pos, recv_peers,          \
                              row_bytes, out);                                                               \
    }                                                                                                        \
    extern "C" __global__ void fluxrt_moe_combine_fp16_##NAME(                                               \
        const IDX* idx, const float* weights, u32 tokens, u32 k, u32 num_experts, u32 local_experts,         \
        const int* pos, const u64* recv_peers, u64 row_bytes, unsigned short* out) {                         \
        combine<fluxrt::F16>(idx, weights, tokens, k, num_experts, local_experts, pos, recv_peers,           \
                             row_bytes, out);                                                                \
    }                                                                                                        \
    FLUXRT_MOE_RETURNED(bf16, NAME, IDX, fluxrt::BF16)                                                       \
    FLUXRT_MOE_RETURNED(fp16, NAME, IDX, fluxrt::F16)

FLUXRT_MOE_INDEX(i32, int)
FLUXRT_MOE_INDEX(i64, long long)

extern "C" __global__ void fluxrt_moe_quantize_bf16(const unsigned short* x, u32 tokens, u32 hidden, int block,
                                                    unsigned char* q, float* scales) {
    quantize<fluxrt::BF16>(x, tokens, hidden, block != 0, q, scales);
}
extern "C" __global__ void fluxrt_moe_quantize_fp16(const unsigned short* x, u32 tokens, u32 hidden, int block,
                                                    unsigned char* q, float* scales) {
    quantize<fluxrt::F16>(x, tokens, hidden, block != 0, q, scales);
}

extern "C" __global__ void fluxrt_moe_stage(FLUXRT_MOE_TEAM_PARAMS, const u64* epoch, const char* y, u64 y_rows,
                                            char* recv, u64 row_bytes, const int* offsets, u32 local_experts,
                                            const u64* flag_peers, const u64* flags, u32* done) {
    stage(FLUXRT_MOE_TEAM, epoch, y, y_rows, recv, row_bytes, offsets, local_experts, flag_peers, flags, done);
}

// bounded to 1024 threads so that DispatcherOptions.threads up to 1024 fits its registers (no spills)
extern "C" __global__ void __launch_bounds__(1024)
fluxrt_moe_expand(FLUXRT_MOE_TEAM_PARAMS, const u64* epoch, const int* src_of, const int* offsets, u32 local_experts,
                  u32 recv_rows, char* recv, u64 row_bytes, float* scales, u32 scale_row, u64* arrive, u32* done) {
    expand(FLUXRT_MOE_TEAM, epoch, src_of, offsets, local_experts, recv_rows, recv, row_bytes, scales, scale_row,
           arrive, done);
}
