// Exchange rounds (allgather, alltoall(v), broadcast): per-pair byte ranges from an ExchangeTable.
//   staged / direct   exchange
//   ll                exchange_ll
//   pipelined         exchange_pipe (all peers at once, or pairwise phases)
// (the ring's allgather is reduce_ring's last stages, schemes/ring.cuh)
#pragma once

#include "../comm/schemes/staged.cuh"
#include "../comm/schemes/ll.cuh"
#include "../comm/schemes/pipelined.cuh"

namespace fluxrt {
namespace coll {

// Whether [p, p + bytes) meets any of the bytes this rank sends (in place: a received range is also sent).
__device__ __forceinline__ bool meets_sends(const Team& t, const ExchangeTable& tab, u64 p, u64 bytes) {
    for (u32 q = 0; q < t.world; ++q)
        if (tab.send_bytes[q] && p < tab.send_ptr[q] + tab.send_bytes[q] && tab.send_ptr[q] < p + bytes) return true;
    return false;
}

// A failed round's output (see team.cuh): [lo_of(p), lo_of(p) + len_of(p)) of every pair's received
// bytes, skipping, if `keep_sent`, ranges that this rank's other blocks may still read to send.
template <class LoOf, class LenOf>
__device__ void poison_received(const Team& t, const ExchangeTable& tab, LoOf lo_of, LenOf len_of, bool keep_sent) {
    for (u32 p = 0; p < t.world; ++p) {
        const u64 at = tab.recv_ptr[p] + lo_of(p), n = len_of(p);
        if (n && !(keep_sent && meets_sends(t, tab, at, n)))
            poison_bytes(reinterpret_cast<char*>(at), n, threadIdx.x, blockDim.x);
    }
}

// The block's share of every pair's received bytes, as exchange() splits them.
__device__ void poison_block_share(const Team& t, const ExchangeTable& tab) {
    auto share = [&](u32 p, bool len) {
        u64 lo, hi;
        block_range(tab.recv_bytes[p], kVecBytes, &lo, &hi);
        return len ? hi - lo : lo;
    };
    poison_received(t, tab, [&](u32 p) { return share(p, false); }, [&](u32 p) { return share(p, true); }, false);
}

// Exchange round (allgather, alltoall(v), broadcast): peer q receives tab.send_bytes[q] bytes from
// tab.send_ptr[q]; what peer p sent lands at tab.recv_ptr[p]. Each pair's bytes are split over the blocks
// in 16-byte units; sender and receiver agree on the byte count of their pair.
// Staged rounds push into q's workspace slot [rank] and copy out after the wait. Direct rounds push
// straight into q's output (tab.send_dst[q], a symmetric array) once q has said that it entered this
// round, i.e. that its stream is done with whatever read that output before.
__device__ void exchange(Team t, const ExchangeTable& tab, u64 slot_bytes, bool direct) {
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    if (direct) {                                                                       // stage ready
        // the release orders this rank's earlier work on the output (stream order) before the flag
        release_peers(t.world, every_peer, [&](u32 q) { return t.peer_flag(q, flag_index(t, 1, t.rank)); }, e);
        if (!staged_wait(t, 1, e)) return poison_block_share(t, tab);   // nothing pushed yet
    }
    for (u32 s = 0; s < t.world; ++s) {                                                 // stage push
        const u32 q = (t.rank + 1 + s) % t.world;
        u64 lo, hi;
        block_range(tab.send_bytes[q], kVecBytes, &lo, &hi);
        char* dst = direct ? reinterpret_cast<char*>(tab.send_dst[q]) + lo
                           : t.peer_ws(q) + base + (u64)t.rank * slot_bytes + lo;
        copy_block(dst, reinterpret_cast<const char*>(tab.send_ptr[q]) + lo, hi - lo, false);
    }
    staged_signal(t, 0, e);                                                               // stage signal
    if (!staged_wait(t, 0, e)) return poison_block_share(t, tab);                          // stage wait
    if (direct) return;
    for (u32 p = 0; p < t.world; ++p) {                                                 // stage consume
        u64 lo, hi;
        block_range(tab.recv_bytes[p], kVecBytes, &lo, &hi);
        const char* src = t.ws + base + (u64)p * slot_bytes + lo;
        copy_block(reinterpret_cast<char*>(tab.recv_ptr[p]) + lo, src, hi - lo, true);
    }
}

// LL exchange round (allgather, alltoall(v), broadcast), the table as in exchange(): peer q gets
// tab.send_bytes[q] bytes from tab.send_ptr[q]; what peer p sent lands at tab.recv_ptr[p]. This rank's
// own pair is a local copy. A pair with no bytes still sends one (ignored) marker line.
__device__ void exchange_ll(Team t, const ExchangeTable& tab, u64 slot_bytes) {
    const u64 e = begin_round(t.epoch);
    const u32 f = ll_flag(e);
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    u64 lines = 1;
    for (u32 q = 0; q < t.world; ++q) {
        const u64 a = lines_of(tab.send_bytes[q]), b = lines_of(tab.recv_bytes[q]);
        lines = a > lines ? a : lines;
        lines = b > lines ? b : lines;
    }
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    for (u64 j = first; j < lines; j += stride) {                                       // stage push
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            const u64 bytes = tab.send_bytes[q];
            if (j >= (bytes ? lines_of(bytes) : 1)) continue;
            const u64 v = load_line(reinterpret_cast<const char*>(tab.send_ptr[q]), bytes, j);
            ll_put(ll_line(t.peer_ll(q), half, t.rank, slot_bytes, j), v, f);
        }
    }
    for (u64 j = first; j < lines; j += stride) {                                       // stage take
        for (u32 p = 0; p < t.world; ++p) {
            const u64 bytes = tab.recv_bytes[p];
            char* dst = reinterpret_cast<char*>(tab.recv_ptr[p]);
            if (p == t.rank) {  // own pair: a local copy
                const u64 own = bytes < tab.send_bytes[p] ? bytes : tab.send_bytes[p];
                if (j < lines_of(own))
                    store_line(dst, own, j, load_line(reinterpret_cast<const char*>(tab.send_ptr[p]), own, j));
                continue;
            }
            if (j >= (bytes ? lines_of(bytes) : 1)) continue;
            u64 v;
            if (!ll_take(t, ll_line(t.ll, half, p, slot_bytes, j), f, p, &v)) {
                for (u32 o = 0; o < t.world; ++o)   // this thread's lines of every pair
                    poison_lines(reinterpret_cast<char*>(tab.recv_ptr[o]), tab.recv_bytes[o], first, stride, kLLData);
                return;
            }
            if (bytes) store_line(dst, bytes, j, v);
        }
    }
}

// Pipelined exchange in pairwise phases (no receiver write may land where the sender still reads: an
// alltoall out of place, any allgather): in phase k = 1 .. n - 1 the sender streams
// its slice of the pair to rank r + k, the receiver its slice from r - k, so that every rank pushes to
// one peer at a time (a permutation of the ranks, the pattern of the ring rounds) instead of to all of
// them. Ring entries and flags are exchange_pipe's: flags are per (phase, source, slice) and count the
// steps of one pair, so the pairs' sequences need no common step index.
__device__ void exchange_pipe_pairwise(const Team& t, const Pipe& pp, const ExchangeTable& tab, const u64* lo,
                                       const u64* len, u64 step, u32 depth) {
    const u32 r = t.rank, n = t.world;
    if (pp.role == 1) {  // own pair first: nothing to wait for
        const u64 own = tab.send_bytes[r] < tab.recv_bytes[r] ? tab.send_bytes[r] : tab.recv_bytes[r];
        const u64 end = lo[r] + len[r] < own ? lo[r] + len[r] : own;
        if (lo[r] < end && tab.recv_ptr[r] != tab.send_ptr[r])  // in place (allgather): already there
            copy_block(reinterpret_cast<char*>(tab.recv_ptr[r]) + lo[r],
                       reinterpret_cast<const char*>(tab.send_ptr[r]) + lo[r], end - lo[r], false);
    }
    for (u32 k = 1; k < n; ++k) {
        if (pp.role == 0) {
            const u32 q = (r + k) % n;
            for (u64 j = 0; j < steps_of(len[q], step); ++j) {
                if (j >= depth && !pipe_wait(t, pp, kCredit0, pipe_value(pp.e, j - depth), 1u << q)) return;
                copy_block(t.peer_ws(q) + pp.entry(t, 0, q, r, j),                    // stage push
                           reinterpret_cast<const char*>(tab.send_ptr[q]) + lo[q] + j * step,
                           step_len(len[q], step, j), false);
                pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), 1u << q);             // stage ready
            }
        } else {
            const u32 p = (r + n - k) % n;
            for (u64 j = 0; j < steps_of(len[p], step); ++j) {
                if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), 1u << p))
                    return poison_received(t, tab, [&](u32 o) { return lo[o]; }, [&](u32 o) { return len[o]; }, true);
                copy_block(reinterpret_cast<char*>(tab.recv_ptr[p]) + lo[p] + j * step,  // stage consume
                           t.ws + pp.entry(t, 0, r, p, j), step_len(len[p], step, j), true);
                pipe_signal(t, pp, kCredit0, pipe_value(pp.e, j), 1u << p);            // stage credit
            }
        }
    }
}

// Pipelined exchange round (the table as in exchange(); staged through the ring, never direct).
// Roles: 0 sender, 1 receiver (which also copies this rank's own pair). The sender also raises its own
// rank's ready flag, and the receiver waits for it before it writes step j: an in-place alltoall's
// receiver overwrites x only where this rank's sender has already pushed from. `pairwise`: the phases
// of exchange_pipe_pairwise instead.
__device__ void exchange_pipe(Team t, const ExchangeTable& tab, u64 slot_bytes, u64 step, u32 depth, bool pairwise) {
    const Pipe pp = begin_pipe(t, 2, slot_bytes, step, depth);
    const bool sender = pp.role == 0;
    const u32 self = 1u << t.rank;
    u64 lo[kMaxWorld], len[kMaxWorld];
    u64 steps = 1, send_steps = 1;
    for (u32 q = 0; q < t.world; ++q) {  // this slice of every pair (the same cut on both sides)
        u64 l, h;
        pp.range(tab.send_bytes[q], kLineBytes, &l, &h);
        const u64 ss = steps_of(h - l, step);
        send_steps = ss > send_steps ? ss : send_steps;
        if (!sender) pp.range(tab.recv_bytes[q], kLineBytes, &l, &h);
        lo[q] = l, len[q] = h - l;
        const u64 s = steps_of(len[q], step);
        steps = s > steps ? s : steps;
    }
    if (pairwise) {
        exchange_pipe_pairwise(t, pp, tab, lo, len, step, depth);
        return;
    }
    for (u64 j = 0; j < steps; ++j) {
        const u32 mask = peers_with_step(t, len, step, j);
        if (sender) {
            if (j >= depth && !pipe_wait(t, pp, kCredit0, pipe_value(pp.e, j - depth), mask)) return;
            for (u32 s = 1; s < t.world; ++s) {                                        // stage push
                const u32 q = (t.rank + s) % t.world;
                if (!((mask >> q) & 1u)) continue;
                copy_block(t.peer_ws(q) + pp.entry(t, 0, q, t.rank, j),
                           reinterpret_cast<const char*>(tab.send_ptr[q]) + lo[q] + j * step,
                           step_len(len[q], step, j), false);
            }
            pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), mask | self);            // stage ready
        } else {
            const u64 mine = j < send_steps ? j : send_steps - 1;  // this rank's sender is past step j
            if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, mine), self) ||
                !pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), mask))
                return poison_received(t, tab, [&](u32 o) { return lo[o]; }, [&](u32 o) { return len[o]; }, true);
            for (u32 p = 0; p < t.world; ++p) {                                        // stage consume
                const u64 n = step_len(len[p], step, j);
                char* dst = reinterpret_cast<char*>(tab.recv_ptr[p]) + lo[p] + j * step;
                if ((mask >> p) & 1u) {
                    copy_block(dst, t.ws + pp.entry(t, 0, t.rank, p, j), n, true);
                } else if (p == t.rank) {  // own pair: sender and receiver cut it alike (no copy in place)
                    const char* src = reinterpret_cast<const char*>(tab.send_ptr[p]) + lo[p] + j * step;
                    const u64 own = tab.send_bytes[p] < tab.recv_bytes[p] ? tab.send_bytes[p] : tab.recv_bytes[p];
                    const u64 at = lo[p] + j * step;
                    if (src != dst) copy_block(dst, src, at < own ? (own - at < n ? own - at : n) : 0, false);
                }
            }
            pipe_signal(t, pp, kCredit0, pipe_value(pp.e, j), mask);                  // stage credit
        }
    }
}

}  // namespace coll
}  // namespace fluxrt
