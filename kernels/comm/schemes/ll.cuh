// LL scheme (low latency) for small messages: the data carries its own flag. Line formats and their
// put / take primitives; the rounds built on them are in algorithms/*.cuh. A sender stores each 8 bytes of
// the message as one 16-byte line of two cells {4 data bytes | 4 flag bytes} in the receiver's LL slot
// [sender]; an aligned 8-byte store is single-copy atomic, so a receiver that reads a cell holding this
// round's flag also reads its data. No fence and no separate flag word: one NVLink trip per round, at
// the price of twice the bytes on the wire.
// The receiver zeroes every line after reading it, so between rounds the LL buffer holds only zeros
// and a line can only ever match the current round's flag (never a stale one, whatever the epoch wrap).
// Reuse: round e uses LL half (e & 1), by the argument of the workspace halves (team.cuh). Every pair of
// ranks exchanges at least one line per LL round (a pair with nothing to send sends one marker line),
// so a peer finishes round e only after this rank has entered it.
// One thread owns line j of every pair: it pushes line j to every peer, then takes line j from every
// peer, so in-place layouts (the line it writes is one it has already sent) need no block barrier.
#pragma once

#include "../comm/team.cuh"

namespace fluxrt {
namespace coll {

constexpr u32 kLLLine = 16;  // bytes of one line on the wire (one 16-byte store: two cells)
constexpr u32 kLLData = 8;   // message bytes per line

__device__ __forceinline__ u32 ll_flag(u64 e) {
    const u32 f = (u32)e;
    return f ? f : 1u;  // zero means "empty line"
}

__device__ __forceinline__ u64 lines_of(u64 bytes) { return (bytes + kLLData - 1) / kLLData; }

// Message bytes [8j, 8j + 8) of src (`bytes` long; a short last line is padded with zeros).
__device__ __forceinline__ u64 load_line(const char* src, u64 bytes, u64 j) {
    const u64 at = j * kLLData;
    if (at + kLLData <= bytes && (reinterpret_cast<u64>(src + at) & 7ull) == 0)
        return *reinterpret_cast<const u64*>(src + at);
    u64 v = 0;
    for (u32 b = 0; b < kLLData && at + b < bytes; ++b) v |= (u64)(unsigned char)src[at + b] << (8 * b);
    return v;
}

__device__ __forceinline__ void store_line(char* dst, u64 bytes, u64 j, u64 v) {
    const u64 at = j * kLLData;
    if (at + kLLData <= bytes && (reinterpret_cast<u64>(dst + at) & 7ull) == 0) {
        *reinterpret_cast<u64*>(dst + at) = v;
        return;
    }
    for (u32 b = 0; b < kLLData && at + b < bytes; ++b) dst[at + b] = (char)(v >> (8 * b));
}

// One line to a peer: both 8-byte cells in one 16-byte store, each cell atomic on its own.
__device__ __forceinline__ void ll_put(char* line, u64 v, u32 f) {
    const u64 c0 = (v & 0xffffffffull) | ((u64)f << 32), c1 = (v >> 32) | ((u64)f << 32);
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line), "l"(c0), "l"(c1) : "memory");
}

__device__ __forceinline__ void ll_load(const char* line, u64* c0, u64* c1) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(*c0), "=l"(*c1) : "l"(line) : "memory");
}

// Zero a line that was read, for a later round: that round's sender writes this half only after this
// kernel ended.
__device__ __forceinline__ void ll_clear(char* line) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %1};" ::"l"(line), "l"(0ull) : "memory");
}

// Spin (bounded) until both cells of a local line carry flag f, return its 8 data bytes and zero the
// line. false when this wait, or another one of the same error record, timed out.
__device__ __forceinline__ bool ll_take(const Team& t, char* line, u32 f, u32 peer, u64* v) {
    u64 c0, c1;
    ll_load(line, &c0, &c1);
    if ((u32)(c0 >> 32) != f || (u32)(c1 >> 32) != f) {
        fluxrt::SpinBound bound;
        for (;;) {
            ll_load(line, &c0, &c1);
            if ((u32)(c0 >> 32) == f && (u32)(c1 >> 32) == f) break;
            if (bound.expired(t.err, t.timeout_ns, t.op, t.rank, peer, f, (u32)(c0 >> 32))) return false;
        }
    }
    ll_clear(line);
    *v = (c0 & 0xffffffffull) | (c1 << 32);
    return true;
}

// Lines of the LL slot that rank `src` fills for rank `dst` (the same on both sides, 16 bytes apart).
__device__ __forceinline__ char* ll_line(char* ll, u64 half, u32 src, u64 slot_bytes, u64 j) {
    return ll + half + (u64)src * slot_bytes + j * kLLLine;
}

// acc (op)= the V elements packed in one line; p == 0 starts the accumulation.
template <class E, int OP, u32 V>
__device__ __forceinline__ void accumulate_line(typename E::Acc (&acc)[V], u64 v, u32 p) {
    fold<E, OP>(acc, reinterpret_cast<const typename E::T*>(&v), p == 0);
}

template <class E, u32 V>
__device__ __forceinline__ u64 pack_line(const typename E::Acc (&acc)[V]) {
    u64 r = 0;
    pack<E>(acc, reinterpret_cast<typename E::T*>(&r));
    return r;
}

// ----------------------------------------------------------------------------------------- LL12 lines
// A denser LL format ('ll12'). The contract is the LL rounds' above: data and flag share one aligned
// 8-byte cell, which is single-copy atomic (the only atomicity relied on: the 16-byte store of a line is two such cells, each atomic on its own), the receiver zeroes
// every line it reads, round e uses LL half e & 1, every pair exchanges at least one line. A cell holds
// 6 message bytes and a 16-bit flag instead of 4 + 4, so a 16-byte line carries 12 message bytes and
// 4/3 of the message crosses NVLink instead of 2x.
// 16 flag bits suffice because the lines are zeroed: between rounds the buffer holds only zeros, and a
// line of half e & 1 is written in round e only by round e's sender (a round-(e+2) sender writes it only
// after this rank's round-e kernel ended). The flag (e mod 65535) + 1 is never zero; comparing it with the
// round's is the same extra check as the LL rounds' 32-bit flag.
// Latency: the peer-table loads go beside the round's atomic (before the PDL wait) and this thread's first
// line of x right after the wait, all before the block meets; the take loads one line
// from up to kTakeBatch peers at once and then spins only on those that are not complete yet.
// Slots are the LL rounds' (Layout of 'll', sized for 8 message bytes a line, so 12 a line fit).
constexpr u32 kLL12Data = 12;  // message bytes per line (two cells of 6)
constexpr u32 kTakeBatch = 8;  // peers whose line a thread loads before it checks any of them
constexpr u64 kLL12FlagShift = 48;

__device__ __forceinline__ u64 ll12_flag(u64 e) { return e % 0xFFFFull + 1ull; }  // 1 .. 65535

__device__ __forceinline__ u64 lines12_of(u64 bytes) { return (bytes + kLL12Data - 1) / kLL12Data; }

// Message bytes [12j, 12j + 12) of src (`bytes` long) as three little-endian words, zero past the end.
// 12j is a multiple of 4: whole words whenever src is 4-byte aligned (always, for 4-byte-aligned arrays).
__device__ __forceinline__ void load12(const char* src, u64 bytes, u64 j, u32 (&w)[3]) {
    const u64 at = j * kLL12Data;
    if (at + kLL12Data <= bytes && (reinterpret_cast<u64>(src + at) & 3ull) == 0) {
        const u32* s = reinterpret_cast<const u32*>(src + at);
        w[0] = s[0];
        w[1] = s[1];
        w[2] = s[2];
        return;
    }
    w[0] = w[1] = w[2] = 0u;
#pragma unroll
    for (u32 b = 0; b < kLL12Data; ++b)
        if (at + b < bytes) w[b / 4] |= (u32)(unsigned char)src[at + b] << (8 * (b % 4));
}

__device__ __forceinline__ void store12(char* dst, u64 bytes, u64 j, const u32 (&w)[3]) {
    const u64 at = j * kLL12Data;
    if (at + kLL12Data <= bytes && (reinterpret_cast<u64>(dst + at) & 3ull) == 0) {
        u32* d = reinterpret_cast<u32*>(dst + at);
        d[0] = w[0];
        d[1] = w[1];
        d[2] = w[2];
        return;
    }
#pragma unroll
    for (u32 b = 0; b < kLL12Data; ++b)
        if (at + b < bytes) dst[at + b] = (char)(w[b / 4] >> (8 * (b % 4)));
}

// One line to a peer: cell 0 = bytes 0-5 | flag << 48, cell 1 = bytes 6-11 | flag << 48, in one 16-byte
// store (each cell atomic on its own, as ll_put). flag_bits = flag << 48.
__device__ __forceinline__ void ll12_put(char* line, const u32 (&w)[3], u64 flag_bits) {
    const u64 c0 = (u64)w[0] | ((u64)(w[1] & 0xFFFFu) << 32) | flag_bits;
    const u64 c1 = (u64)(w[1] >> 16) | ((u64)w[2] << 16) | flag_bits;
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line), "l"(c0), "l"(c1) : "memory");
}

__device__ __forceinline__ bool ll12_complete(u64 c0, u64 c1, u64 f) {
    return (c0 >> kLL12FlagShift) == f && (c1 >> kLL12FlagShift) == f;
}

__device__ __forceinline__ void ll12_unpack(u64 c0, u64 c1, u32 (&w)[3]) {
    w[0] = (u32)c0;
    w[1] = ((u32)(c0 >> 32) & 0xFFFFu) | ((u32)c1 << 16);
    w[2] = (u32)(c1 >> 16);
}

// Spin (bounded) until both cells of a local line carry flag f; *c0, *c1: the last load. false when this
// wait, or another one of the same error record, timed out.
__device__ __forceinline__ bool ll12_wait(const Team& t, const char* line, u64 f, u32 peer, u64* c0, u64* c1) {
    fluxrt::SpinBound bound;
    for (;;) {
        ll_load(line, c0, c1);
        if (ll12_complete(*c0, *c1, f)) return true;
        if (bound.expired(t.err, t.timeout_ns, t.op, t.rank, peer, f, *c0 >> kLL12FlagShift)) return false;
    }
}

// acc (op)= the V elements of one line's 12 bytes; p == 0 starts the accumulation.
template <class E, int OP, u32 V>
__device__ __forceinline__ void accumulate12(typename E::Acc (&acc)[V], const u32 (&w)[3], u32 p) {
    fold<E, OP>(acc, reinterpret_cast<const typename E::T*>(&w[0]), p == 0);
}

template <class E, u32 V>
__device__ __forceinline__ void pack12(const typename E::Acc (&acc)[V], u32 (&w)[3]) {
    w[0] = w[1] = w[2] = 0u;
    pack<E>(acc, reinterpret_cast<typename E::T*>(&w[0]));
}

// Line j of slot [p] of an LL region, for every rank p in `from`, in rank order: use(p, words). A peer's
// line is taken (bounded wait for flag f, then zeroed); this rank's entry, if in `from`, is `own`. The
// loads of up to kTakeBatch peers' lines are in flight before the first check. false on a timeout.
template <class Use>
__device__ __forceinline__ bool take12(const Team& t, char* region, u64 slot_bytes, u64 j, u64 f, u32 from,
                                       const u32 (&own)[3], Use use) {
    for (u32 p0 = 0; p0 < t.world; p0 += kTakeBatch) {
        u64 c0[kTakeBatch], c1[kTakeBatch];
#pragma unroll
        for (u32 b = 0; b < kTakeBatch; ++b) {  // every load of the batch in flight before any check
            const u32 p = p0 + b;
            c0[b] = c1[b] = 0ull;
            if (p < t.world && p != t.rank && ((from >> p) & 1u)) ll_load(ll_line(region, 0, p, slot_bytes, j), &c0[b], &c1[b]);
        }
#pragma unroll
        for (u32 b = 0; b < kTakeBatch; ++b) {
            const u32 p = p0 + b;
            if (p >= t.world) break;
            if (!((from >> p) & 1u)) continue;
            if (p == t.rank) {
                use(p, own);
                continue;
            }
            char* line = ll_line(region, 0, p, slot_bytes, j);
            if (!ll12_complete(c0[b], c1[b], f) && !ll12_wait(t, line, f, p, &c0[b], &c1[b])) return false;
            ll_clear(line);
            u32 w[3];
            ll12_unpack(c0[b], c1[b], w);
            use(p, w);
        }
    }
    return true;
}

// Line j of this rank's reduction: `own` and line j of every peer's slot of `region` (taken), combined
// in rank order in fp32 (every rank computes bitwise the same value), packed into r. false on a timeout.
template <class E, int OP>
__device__ __forceinline__ bool reduce_line12(const Team& t, char* region, u64 slot_bytes, u64 j, u64 f,
                                              const u32 (&own)[3], u32 (&r)[3]) {
    typename E::Acc acc[kLL12Data / sizeof(typename E::T)];
    if (!take12(t, region, slot_bytes, j, f, t.everyone(), own,
                [&](u32 p, const u32 (&w)[3]) { accumulate12<E, OP>(acc, w, p); }))
        return false;
    pack12<E>(acc, r);
    return true;
}

}  // namespace coll
}  // namespace fluxrt
