// Collectives over NVLink peer pointers, staged through a symmetric workspace (fluxrt/collectives.py).
//
// Every launch is one "round" of one collective:
//   stage push    each block copies its slice of the data this rank sends to peer q into q's workspace
//                 slot [rank] (16-byte vectors where alignment allows),
//   stage signal  every writer fences, then one thread per peer releases flag [phase][rank][block] on q,
//   stage wait    one thread per peer acquires flag [phase][p][block] locally (bounded),
//   stage consume the block reduces or copies what the peers pushed into its slice of the output.
// Direct exchange rounds (symmetric outputs) push into the peers' outputs instead, after a "ready" flag
// from each peer, and have no consume stage.
// A block only ever touches its own slice (the same partition on every rank: it depends only on the
// sizes and the grid, which every rank computes identically), so blocks never wait for each other.
//
// Epochs: the round's flag value is read from a device counter, not from a kernel argument, so a CUDA
// graph that captured the launch replays with fresh epochs. Each block advances the counter by its share
// of one round (begin_round). Flags are never reset; waits compare with >=.
//
// Programmatic dependent launch (Tuning.pdl): launched with the attribute, a round's grid may be
// scheduled while the kernel before it on the stream still runs, so the launch latency and the round's
// atomic overlap that kernel's tail. Each block takes its share of the round counter, then lets the next
// round's grid launch (griddepcontrol.launch_dependents, after the atomic returned), then waits for the
// kernel before it to complete with its memory visible (griddepcontrol.wait) before it touches x, out,
// the workspace, the LL buffer or a flag. The next round's atomics therefore follow all of this round's,
// as the counter needs. Without the attribute both instructions do nothing.
//
// Workspace reuse: round e uses workspace half (e & 1). Two halves suffice: before a rank can write
// half h in round e+2 it must finish round e+1, which needs every peer's round-(e+1) signal, and a
// peer signals round e+1 only after its round-e kernel (and so all its reads of half h) completed
// (rounds of one context run in stream order on every rank; the host serializes them).
//
// Compiled with NVRTC: builtin types only; 16-bit floats converted with PTX cvt.
#include "fluxrt/comm.cuh"

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;

namespace {

constexpr u32 kMaxBlocks = 128;  // flag slots per (phase, source rank); launches use <= this many blocks
constexpr u32 kMaxWorld = 32;    // ranks an exchange table describes (one NVLink domain)
constexpr u32 kVecBytes = 16;    // one vector load/store
constexpr u32 kFlagPhases = 6;   // flag arrays per (source rank, block): staged 0-1, pipelined 2-5
// Vectors a thread reduces at a time (their loads of one source in flight together). 4 against 1: the
// staged two-shot allreduce 6-12 % faster from 32 MiB on 4x H200; the pipelined rounds unchanged.
constexpr u32 kReduceUnroll = 4;
// Threads of a bulk block (fluxrt/collectives_plan.py THREADS). Kernels that would otherwise take more
// than 65536 / kBulkThreads registers a thread are compiled to fit (__launch_bounds__).
constexpr u32 kBulkThreads = 512;

enum ReduceOp { kSum = 0, kMax = 1, kMin = 2 };

// Everything a round needs to find peers, flags and the epoch (identical for every launch of a context).
struct Team {
    u64* epoch;               // round counter: kRoundUnit per launch (begin_round)
    char* ws;                 // this rank's workspace
    const u64* ws_peers;      // [world]: each rank's workspace, mapped here
    u64* flags;               // this rank's flags [kFlagPhases][world][kMaxBlocks]
    const u64* flags_peers;   // [world]: each rank's flags, mapped here
    u64 half_bytes;           // bytes of one workspace half
    char* ll;                 // this rank's LL buffer (zeroed at allocation; LL rounds leave it zeroed)
    const u64* ll_peers;      // [world]: each rank's LL buffer, mapped here
    u64 ll_half_bytes;        // bytes of one LL buffer half
    u32 rank, world;
    u64 timeout_ns;
    ErrorRecord* err;
    u32 op;
};

// Per-peer byte ranges of one exchange round (by value: no upload, graph-capturable).
struct ExchangeTable {
    u64 send_ptr[kMaxWorld];    // local source of what goes to peer q
    u64 send_bytes[kMaxWorld];
    u64 recv_ptr[kMaxWorld];    // local destination of what came from peer p
    u64 recv_bytes[kMaxWorld];
    u64 send_dst[kMaxWorld];    // direct rounds: where peer q wants the data (in its output, mapped here)
};

// ----------------------------------------------------------------------------------------- epochs
// All threads call; returns the round's flag value. Every launch adds exactly kRoundUnit to the counter,
// whatever its grid: block b adds its share (kRoundUnit / grid, block 0 also the remainder). Launches of
// a context run one after another (stream order; the host orders calls across streams), so every block
// of the k-th launch reads a value in [(k-1) kRoundUnit, k kRoundUnit) and all of them compute round k
// from one atomic each, without waiting for each other. 44 bits of rounds: no wrap in any job's life.
constexpr u64 kRoundShift = 20;
constexpr u64 kRoundUnit = 1ull << kRoundShift;  // > kMaxBlocks: every block's share is at least 1

// The first invocation by any thread of a block counts for the block: only the thread that took the
// block's share of the round calls it, after the atomic's result came back.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Hooks for a kernel's first loads, in flight beside the round's atomic: constant() loads what was set
// before any round (the peer tables), so it may run before the PDL wait; prefetch() (a first line of x)
// runs after it. Both before the block meets.
template <class Constant, class Prefetch>
__device__ __forceinline__ u64 begin_round(u64* counter, Constant constant, Prefetch prefetch) {
    __shared__ u64 e;
    u64 old = 0;
    if (threadIdx.x == 0) {
        const u64 share = kRoundUnit / gridDim.x;
        old = atomicAdd(counter, blockIdx.x == 0 ? kRoundUnit - share * (gridDim.x - 1) : share);
    }
    constant();
    if (threadIdx.x == 0) {
        e = (old >> kRoundShift) + 1ull;
        pdl_launch_dependents();  // after the share (e depends on the atomic's result)
    }
    pdl_wait();                   // the kernel before this one on the stream has completed
    prefetch();
    __syncthreads();
    return e;
}

__device__ __forceinline__ u64 begin_round(u64* counter) {
    return begin_round(counter, [] {}, [] {});
}

__device__ __forceinline__ u64 half_offset(const Team& t, u64 e) { return (e & 1ull) * t.half_bytes; }

__device__ __forceinline__ u64 flag_index(const Team& t, u32 phase, u32 src) {
    return ((u64)phase * t.world + src) * kMaxBlocks + blockIdx.x;
}

// ----------------------------------------------------------------------------------------- signal / wait
// After this block's pushes: each thread fences its own peer stores, the block meets, then thread q
// releases this block's flag on peer q.
__device__ __forceinline__ void signal_peers(const Team& t, u32 phase, u64 e) {
    fluxrt::fence_acq_rel_sys();  // every writer orders its own NVLink stores before the release below
    __syncthreads();
    for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) {
        u64* flag = reinterpret_cast<u64*>(t.flags_peers[q]) + flag_index(t, phase, t.rank);
        fluxrt::st_release_sys(flag, e);
    }
}

// Thread p acquires peer p's flag for this block; false (for the whole block) if any wait timed out.
__device__ __forceinline__ bool wait_peers(const Team& t, u32 phase, u64 e) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    for (u32 p = threadIdx.x; p < t.world; p += blockDim.x) {
        if (!fluxrt::wait_ge(t.flags + flag_index(t, phase, p), e, t.timeout_ns, t.err, t.op, t.rank, p))
            ok = 0;
        fluxrt::fence_acq_rel_sys();  // the acquire covers the block's later reads (same SM, bar.sync)
    }
    __syncthreads();
    return ok != 0;
}

// ----------------------------------------------------------------------------------------- copies
// Loads of pushed workspace data bypass L1 (.cv): a stale line of an earlier round must never be hit.
__device__ __forceinline__ uint4 ld_cv(const uint4* p) { return __ldcv(p); }

// The block copies `bytes` from src to dst: 16-byte vectors when both share 16-byte alignment, 4-byte
// words when they share 4-byte alignment, bytes otherwise. `fresh_src`: src holds pushed data.
__device__ void copy_block(char* __restrict__ dst, const char* __restrict__ src, u64 bytes, bool fresh_src) {
    const u64 a = reinterpret_cast<u64>(dst), b = reinterpret_cast<u64>(src);
    if (((a ^ b) & 15ull) == 0) {
        u64 head = (16ull - (a & 15ull)) & 15ull;
        if (head > bytes) head = bytes;
        for (u64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = fresh_src ? __ldcv(src + i) : src[i];
        const u64 nvec = (bytes - head) / kVecBytes;
        const uint4* s = reinterpret_cast<const uint4*>(src + head);
        uint4* d = reinterpret_cast<uint4*>(dst + head);
        constexpr u32 kUnroll = 4;  // loads in flight per thread before the first store (8: no faster)
        u64 i = threadIdx.x;
        for (; i + (kUnroll - 1) * blockDim.x < nvec; i += kUnroll * blockDim.x) {
            uint4 r[kUnroll];
#pragma unroll
            for (u32 u = 0; u < kUnroll; ++u) r[u] = fresh_src ? ld_cv(s + i + u * blockDim.x) : s[i + u * blockDim.x];
#pragma unroll
            for (u32 u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = r[u];
        }
        for (; i < nvec; i += blockDim.x) d[i] = fresh_src ? ld_cv(s + i) : s[i];
        for (u64 j = head + nvec * kVecBytes + threadIdx.x; j < bytes; j += blockDim.x)
            dst[j] = fresh_src ? __ldcv(src + j) : src[j];
    } else if (((a ^ b) & 3ull) == 0) {
        u64 head = (4ull - (a & 3ull)) & 3ull;
        if (head > bytes) head = bytes;
        for (u64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = fresh_src ? __ldcv(src + i) : src[i];
        const u64 nw = (bytes - head) / 4ull;
        const u32* s = reinterpret_cast<const u32*>(src + head);
        u32* d = reinterpret_cast<u32*>(dst + head);
        for (u64 i = threadIdx.x; i < nw; i += blockDim.x) d[i] = fresh_src ? __ldcv(s + i) : s[i];
        for (u64 j = head + nw * 4ull + threadIdx.x; j < bytes; j += blockDim.x)
            dst[j] = fresh_src ? __ldcv(src + j) : src[j];
    } else {
        for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = fresh_src ? __ldcv(src + i) : src[i];
    }
}

// [lo, hi) of `total` units split over the grid in pieces of whole `align` units (same on every rank).
__device__ __forceinline__ void block_range(u64 total, u64 align, u64* lo, u64* hi) {
    u64 per = (total + gridDim.x - 1) / gridDim.x;
    per = (per + align - 1) / align * align;
    const u64 l = (u64)blockIdx.x * per;
    *lo = l < total ? l : total;
    *hi = l + per < total ? l + per : total;
}

// ----------------------------------------------------------------------------------------- element types
struct F32 {
    typedef float T;
    static constexpr u32 kPerVec = 4;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};
struct F16 {
    typedef unsigned short T;
    static constexpr u32 kPerVec = 8;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(unsigned short v) { return fluxrt::f16_to_f32(v); }
    static __device__ __forceinline__ unsigned short from_f(float f) {
        unsigned short v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
        return v;
    }
};
struct BF16 {
    typedef unsigned short T;
    static constexpr u32 kPerVec = 8;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(unsigned short v) { return fluxrt::bf16_to_f32(v); }
    static __device__ __forceinline__ unsigned short from_f(float f) {
        unsigned short v;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
        return v;
    }
};

// Raw bytes, for rounds that only ever copy (allgather's ring: one source per stage); no arithmetic.
struct Bytes {
    typedef unsigned char T;
    static constexpr bool kArithmetic = false;
};

template <int OP>
__device__ __forceinline__ float combine(float a, float b) {
    if (OP == kSum) return a + b;
    if (OP == kMax) return fmaxf(a, b);
    return fminf(a, b);
}

// acc (op)= the elements of one 16-byte vector; p == 0 starts the accumulation.
template <class E, int OP>
__device__ __forceinline__ void accumulate_vec(float (&acc)[E::kPerVec], const uint4& raw, u32 p) {
    const typename E::T* x = reinterpret_cast<const typename E::T*>(&raw);
#pragma unroll
    for (u32 k = 0; k < E::kPerVec; ++k) acc[k] = p == 0 ? E::to_f(x[k]) : combine<OP>(acc[k], E::to_f(x[k]));
}

template <class E>
__device__ __forceinline__ uint4 pack_vec(const float (&acc)[E::kPerVec]) {
    uint4 res;
    typename E::T* r = reinterpret_cast<typename E::T*>(&res);
#pragma unroll
    for (u32 k = 0; k < E::kPerVec; ++k) r[k] = E::from_f(acc[k]);
    return res;
}

// One 16-byte vector of the reduction over n sources: vector *at(p) of each source p, fp32 in rank order
// (every rank computes bitwise the same value). Loads bypass L1 (.cv): sources may hold pushed data.
template <class E, int OP, class At>
__device__ __forceinline__ uint4 reduce_vec(u32 n, At at) {
    float acc[E::kPerVec];
    for (u32 p = 0; p < n; ++p) accumulate_vec<E, OP>(acc, ld_cv(at(p)), p);
    return pack_vec<E>(acc);
}

// The same for one element *at(p) of each source.
template <class E, int OP, class At>
__device__ __forceinline__ typename E::T reduce_elem(u32 n, At at) {
    float acc = 0.f;
    for (u32 p = 0; p < n; ++p) {
        const typename E::T x = *at(p);
        acc = p == 0 ? E::to_f(x) : combine<OP>(acc, E::to_f(x));
    }
    return E::from_f(acc);
}

// store(v, vector v of the reduction) for v < nvec, source p's vectors from src(p). A thread takes
// kReduceUnroll vectors at a time, the loads of one source for all of them in flight together.
template <class E, int OP, class Src, class Store>
__device__ __forceinline__ void reduce_vectors(u32 n, u64 nvec, Src src, Store store) {
    constexpr u32 U = kReduceUnroll;
    u64 v = threadIdx.x;
    for (; v + (U - 1) * blockDim.x < nvec; v += U * blockDim.x) {
        float acc[U][E::kPerVec];
        for (u32 p = 0; p < n; ++p) {
            const uint4* s = src(p) + v;
            uint4 raw[U];
#pragma unroll
            for (u32 u = 0; u < U; ++u) raw[u] = ld_cv(s + u * blockDim.x);
#pragma unroll
            for (u32 u = 0; u < U; ++u) accumulate_vec<E, OP>(acc[u], raw[u], p);
        }
#pragma unroll
        for (u32 u = 0; u < U; ++u) store(v + u * blockDim.x, pack_vec<E>(acc[u]));
    }
    for (; v < nvec; v += blockDim.x) store(v, reduce_vec<E, OP>(n, [&](u32 p) { return src(p) + v; }));
}

// out[i] = slot_0[i] op slot_1[i] op ... op slot_{n-1}[i] for i in [lo, hi), accumulated in fp32 in rank
// order (every rank computes bitwise the same value). Slots are `slot_stride` bytes apart from `slots`.
template <class E, int OP>
__device__ void reduce_slots(typename E::T* out, const char* slots, u64 slot_stride, u32 n, u64 lo, u64 hi) {
    typedef typename E::T T;
    constexpr u32 V = E::kPerVec;
    const bool vec_ok = ((reinterpret_cast<u64>(out) | reinterpret_cast<u64>(slots) | slot_stride) & 15ull) == 0 &&
                        lo % V == 0;
    u64 i = lo;
    if (vec_ok) {
        const u64 nvec = (hi - lo) / V;
        reduce_vectors<E, OP>(
            n, nvec, [&](u32 p) { return reinterpret_cast<const uint4*>(slots + p * slot_stride) + lo / V; },
            [&](u64 v, const uint4& res) { reinterpret_cast<uint4*>(out)[lo / V + v] = res; });
        i = lo + nvec * V;
    }
    for (u64 j = i + threadIdx.x; j < hi; j += blockDim.x)
        out[j] = reduce_elem<E, OP>(
            n, [&](u32 p) { return reinterpret_cast<const volatile T*>(slots + p * slot_stride) + j; });
}

__device__ __forceinline__ char* peer_ws(const Team& t, u32 q) { return reinterpret_cast<char*>(t.ws_peers[q]); }

// Push elements [lo, hi) of each peer's chunk: chunk q starts at src + q * src_stride elements and lands
// in q's slot [rank] at dst_off bytes into the workspace (slots `slot_bytes` apart). Peers are visited
// starting after this rank so that the ranks do not all write to the same peer at once.
template <class E>
__device__ void push_chunks(const Team& t, const typename E::T* src, u64 src_stride, u64 dst_off,
                            u64 slot_bytes, u64 lo, u64 hi) {
    typedef typename E::T T;
    for (u32 s = 0; s < t.world; ++s) {
        const u32 q = (t.rank + 1 + s) % t.world;
        char* dst = peer_ws(t, q) + dst_off + (u64)t.rank * slot_bytes + lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(src + q * src_stride + lo), (hi - lo) * sizeof(T), false);
    }
}

// ----------------------------------------------------------------------------------------- rounds
// One-shot allreduce of `count` elements: every rank pushes all of x into every peer's slot [rank]
// and reduces all n slots locally. Slots are `slot_bytes` apart in the workspace half.
template <class E, int OP>
__device__ void allreduce_oneshot(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 slot_bytes) {
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    u64 lo, hi;
    block_range(count, E::kPerVec, &lo, &hi);
    push_chunks<E>(t, x, 0, base, slot_bytes, lo, hi);                                   // stage push
    signal_peers(t, 0, e);                                                               // stage signal
    if (!wait_peers(t, 0, e)) return;                                                    // stage wait
    reduce_slots<E, OP>(out, t.ws + base, slot_bytes, t.world, lo, hi);                 // stage consume
}

// Reduce-scatter of n chunks of `chunk` elements (chunk q of x starts at q * chunk_stride): rank r ends
// with the reduction of every rank's chunk r in out[0, chunk).
template <class E, int OP>
__device__ void reduce_scatter_round(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out,
                                     u64 chunk, u64 slot_bytes) {
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    u64 lo, hi;
    block_range(chunk, E::kPerVec, &lo, &hi);
    push_chunks<E>(t, x, chunk_stride, base, slot_bytes, lo, hi);                        // stage push
    signal_peers(t, 0, e);                                                               // stage signal
    if (!wait_peers(t, 0, e)) return;                                                    // stage wait
    reduce_slots<E, OP>(out, t.ws + base, slot_bytes, t.world, lo, hi);                 // stage consume
}

// Two-shot allreduce of n chunks of `chunk` elements (the last ones may be shorter: `count` in all):
// reduce-scatter into slots of the first quarter-half, then push the reduced chunk to every peer's
// slot [rank] of the second area and copy all chunks out. Each block keeps its slice in both phases.
template <class E, int OP>
__device__ void allreduce_twoshot(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 chunk,
                                  u64 slot_bytes) {
    typedef typename E::T T;
    const u64 e = begin_round(t.epoch);
    const u64 base = half_offset(t, e);
    const u64 area2 = base + (u64)t.world * slot_bytes;
    u64 lo, hi;
    block_range(chunk, E::kPerVec, &lo, &hi);
    // stage push (phase 0): slice [lo, hi) of chunk q goes to q, clipped to the message.
    for (u32 s = 0; s < t.world; ++s) {
        const u32 q = (t.rank + 1 + s) % t.world;
        const u64 start = q * chunk;
        const u64 l = start + lo < count ? start + lo : count, h = start + hi < count ? start + hi : count;
        char* dst = peer_ws(t, q) + base + (u64)t.rank * slot_bytes + lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(x + l), (h - l) * sizeof(T), false);
    }
    signal_peers(t, 0, e);
    if (!wait_peers(t, 0, e)) return;
    // stage reduce: my chunk's slice, into my own area-2 slot (peers read nothing of mine: they get pushes).
    const u64 mine = (u64)t.rank * chunk;
    const u64 my_hi = mine + hi < count ? hi : (count > mine ? count - mine : 0);
    const u64 my_lo = lo < my_hi ? lo : my_hi;
    T* reduced = reinterpret_cast<T*>(t.ws + area2 + (u64)t.rank * slot_bytes);
    reduce_slots<E, OP>(reduced, t.ws + base, slot_bytes, t.world, my_lo, my_hi);
    __syncthreads();
    // stage push (phase 1): the reduced slice to every other peer's slot [rank] of area 2.
    for (u32 s = 1; s < t.world; ++s) {
        const u32 q = (t.rank + s) % t.world;
        char* dst = peer_ws(t, q) + area2 + (u64)t.rank * slot_bytes + my_lo * sizeof(T);
        copy_block(dst, reinterpret_cast<const char*>(reduced + my_lo), (my_hi - my_lo) * sizeof(T), true);
    }
    signal_peers(t, 1, e);
    if (!wait_peers(t, 1, e)) return;
    // stage consume: every reduced chunk's slice into out.
    for (u32 p = 0; p < t.world; ++p) {
        const u64 start = p * chunk;
        const u64 l = start + lo < count ? start + lo : count, h = start + hi < count ? start + hi : count;
        const char* src = t.ws + area2 + (u64)p * slot_bytes + lo * sizeof(T);
        copy_block(reinterpret_cast<char*>(out + l), src, (h - l) * sizeof(T), true);
    }
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
        for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) {
            u64* flag = reinterpret_cast<u64*>(t.flags_peers[q]) + flag_index(t, 1, t.rank);
            fluxrt::st_release_sys(flag, e);  // orders this rank's earlier work on the output before it
        }
        if (!wait_peers(t, 1, e)) return;
    }
    for (u32 s = 0; s < t.world; ++s) {                                                 // stage push
        const u32 q = (t.rank + 1 + s) % t.world;
        u64 lo, hi;
        block_range(tab.send_bytes[q], kVecBytes, &lo, &hi);
        char* dst = direct ? reinterpret_cast<char*>(tab.send_dst[q]) + lo
                           : peer_ws(t, q) + base + (u64)t.rank * slot_bytes + lo;
        copy_block(dst, reinterpret_cast<const char*>(tab.send_ptr[q]) + lo, hi - lo, false);
    }
    signal_peers(t, 0, e);                                                               // stage signal
    if (!wait_peers(t, 0, e) || direct) return;                                          // stage wait
    for (u32 p = 0; p < t.world; ++p) {                                                 // stage consume
        u64 lo, hi;
        block_range(tab.recv_bytes[p], kVecBytes, &lo, &hi);
        const char* src = t.ws + base + (u64)p * slot_bytes + lo;
        copy_block(reinterpret_cast<char*>(tab.recv_ptr[p]) + lo, src, hi - lo, true);
    }
}

// ----------------------------------------------------------------------------------------- pipelined rounds
// Bulk messages in one launch, without the push-then-consume stall of the staged rounds. The message is
// cut into `slices` (per pair, the same cut on both sides); each slice streams in steps of `step` bytes
// through a ring of `depth` entries in the receiver's workspace slot [sender]. Each slice has one block
// per role, so pushing never waits for consuming:
//   sender    pushes step j of its slice of every pair into the peers' rings, then raises their ready flag
//   reducer   (allreduce) waits for every peer's step j of its own chunk, reduces it with its own data
//             into out and, in the same pass, pushes the result into every peer's second ring
//   receiver  copies (reduce-scatter: reduces) what the peers pushed out of the ring, then returns the
//             entry to its sender with a credit flag
// Roles interleave by block index (block = slice * roles + role), so any prefix of resident blocks holds
// whole slices. Flags, per (phase, peer, slice):
//   ready  [kReady*][src][slice] on the receiver: src has pushed step j of this round
//   credit [kCredit*][dst][slice] on the sender: dst has finished reading step j
// A sender refills ring entry j % depth only after the credit of step j - depth. Flag values
// pipe_value(e, j) = (e << kStepBits) + j + 1 grow across rounds, so nothing is reset and waits compare
// with >=; they have flag phases of their own (the staged rounds' flags carry plain epochs).
// Every (pair, slice) moves at least one step per round (an empty slice sends a marker step), so the
// workspace-halves argument above holds: a peer's first ready flag of round e + 1 means that its round-e
// kernel, and so its reads of the other half, completed.
constexpr u32 kReady0 = 2, kReady1 = 3, kCredit0 = 4, kCredit1 = 5;  // flag phases (kFlagPhases in all)
// Rounds have 44 bits (begin_round), steps the other 20: values never wrap. Steps per (pair, slice) and
// round stay below 2^20 - 1 (the host checks; 4 GiB per slice with 4 KiB steps).
constexpr u64 kStepBits = 20;
constexpr u64 kLineBytes = 128;  // slices start on whole cache lines (full-line NVLink writes)
static_assert(kCredit1 < kFlagPhases, "the pipelined rounds' flag phases");
static_assert(kStepBits <= kRoundShift, "pipe_value(e, j): 64 - kRoundShift round bits + kStepBits must fit 64");

__device__ __forceinline__ u64 pipe_value(u64 e, u64 j) { return (e << kStepBits) + j + 1ull; }

// This block's part in a pipelined round.
struct Pipe {
    u64 e;           // round
    u32 role, slice, slices;
    u64 base;        // offset of ring 0 in the workspace (ring 1, allreduce: world - 1 slots further)
    u64 slot_bytes;  // per source rank and ring
    u64 step;        // bytes per ring entry
    u32 depth;       // entries per slice

    // Ring entry of step j that rank `src` fills in rank `owner`'s workspace (the same offset on both
    // sides of a pair). A rank never sends to itself, so a ring has world - 1 slots: src's slot is its
    // distance after the owner, minus one.
    __device__ __forceinline__ u64 entry(const Team& t, u32 ring, u32 owner, u32 src, u64 j) const {
        const u32 slot = (src + t.world - owner - 1) % t.world;
        return base + ((u64)ring * (t.world - 1) + slot) * slot_bytes + ((u64)slice * depth + j % depth) * step;
    }
    __device__ __forceinline__ u64 flag(const Team& t, u32 phase, u32 src) const {
        return ((u64)phase * t.world + src) * kMaxBlocks + slice;
    }
};

__device__ __forceinline__ Pipe begin_pipe(const Team& t, u32 roles, u64 slot_bytes, u64 step, u32 depth) {
    Pipe pp;
    pp.e = begin_round(t.epoch);
    pp.role = blockIdx.x % roles;
    pp.slice = blockIdx.x / roles;
    pp.slices = gridDim.x / roles;
    pp.base = half_offset(t, pp.e);
    pp.slot_bytes = slot_bytes;
    pp.step = step;
    pp.depth = depth;
    return pp;
}

// [lo, hi) of `total` units: this block's slice, in pieces of whole `align` units.
__device__ __forceinline__ void pipe_range(const Pipe& pp, u64 total, u64 align, u64* lo, u64* hi) {
    u64 per = (total + pp.slices - 1) / pp.slices;
    per = (per + align - 1) / align * align;
    const u64 l = (u64)pp.slice * per;
    *lo = l < total ? l : total;
    *hi = l + per < total ? l + per : total;
}

__device__ __forceinline__ u64 steps_of(u64 len, u64 step) { return len ? (len + step - 1) / step : 1; }

// Units of step j within a slice of `len` units (0 past its end: a marker step).
__device__ __forceinline__ u64 step_len(u64 len, u64 step, u64 j) {
    const u64 at = j * step;
    return at < len ? (len - at < step ? len - at : step) : 0;
}

// Thread p acquires flag [phase][p][slice] >= v for every peer p in `mask`; false (for the whole block)
// if any of these waits timed out.
__device__ __forceinline__ bool pipe_wait(const Team& t, const Pipe& pp, u32 phase, u64 v, u32 mask) {
    int ok = 1;
    const u32 p = threadIdx.x;
    if (p < t.world && ((mask >> p) & 1u)) {
        ok = fluxrt::wait_ge(t.flags + pp.flag(t, phase, p), v, t.timeout_ns, t.err, t.op, t.rank, p);
        fluxrt::fence_acq_rel_sys();  // the acquire covers the block's later accesses (bar.sync below)
    }
    return __syncthreads_and(ok) != 0;
}

// After the block's stores to (or reads of) step j: every thread fences its own accesses, the block
// meets, then thread q releases flag [phase][rank][slice] on each peer q in `mask`.
__device__ __forceinline__ void pipe_signal(const Team& t, const Pipe& pp, u32 phase, u64 v, u32 mask) {
    fluxrt::fence_acq_rel_sys();
    __syncthreads();
    const u32 q = threadIdx.x;
    if (q < t.world && ((mask >> q) & 1u))
        fluxrt::st_release_sys(reinterpret_cast<u64*>(t.flags_peers[q]) + pp.flag(t, phase, t.rank), v);
}

// Peers (not this rank) whose slice of `len[q]` units has a step j.
__device__ __forceinline__ u32 peers_with_step(const Team& t, const u64* len, u64 step, u64 j) {
    u32 mask = 0;
    for (u32 q = 0; q < t.world; ++q)
        if (q != t.rank && j < steps_of(len[q], step)) mask |= 1u << q;
    return mask;
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
                copy_block(peer_ws(t, q) + pp.entry(t, 0, q, r, j),                    // stage push
                           reinterpret_cast<const char*>(tab.send_ptr[q]) + lo[q] + j * step,
                           step_len(len[q], step, j), false);
                pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), 1u << q);             // stage ready
            }
        } else {
            const u32 p = (r + n - k) % n;
            for (u64 j = 0; j < steps_of(len[p], step); ++j) {
                if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), 1u << p)) return;
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
        pipe_range(pp, tab.send_bytes[q], kLineBytes, &l, &h);
        const u64 ss = steps_of(h - l, step);
        send_steps = ss > send_steps ? ss : send_steps;
        if (!sender) pipe_range(pp, tab.recv_bytes[q], kLineBytes, &l, &h);
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
                copy_block(peer_ws(t, q) + pp.entry(t, 0, q, t.rank, j),
                           reinterpret_cast<const char*>(tab.send_ptr[q]) + lo[q] + j * step,
                           step_len(len[q], step, j), false);
            }
            pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), mask | self);            // stage ready
        } else {
            const u64 mine = j < send_steps ? j : send_steps - 1;  // this rank's sender is past step j
            if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, mine), self)) return;
            if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), mask)) return;
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

// dst_d[i] = src[i] for i < n units of type U and every d < ndst, kReduceUnroll loads in flight per
// thread before the stores. Loads bypass L1 (.cv): src may hold pushed data.
template <class U>
__device__ __forceinline__ void copy_units(char* const* dst, u32 ndst, const char* src, u64 n) {
    constexpr u32 R = kReduceUnroll;
    const U* s = reinterpret_cast<const U*>(src);
    u64 i = threadIdx.x;
    for (; i + (R - 1) * blockDim.x < n; i += R * blockDim.x) {
        U r[R];
#pragma unroll
        for (u32 u = 0; u < R; ++u) r[u] = __ldcv(s + i + u * blockDim.x);
        for (u32 d = 0; d < ndst; ++d)
#pragma unroll
            for (u32 u = 0; u < R; ++u) reinterpret_cast<U*>(dst[d])[i + u * blockDim.x] = r[u];
    }
    for (; i < n; i += blockDim.x) {
        const U r = __ldcv(s + i);
        for (u32 d = 0; d < ndst; ++d) reinterpret_cast<U*>(dst[d])[i] = r;
    }
}

// The one-source case of reduce_sources: `bytes` of src copied as bits to every destination (16-byte
// vectors when every pointer is 16-byte aligned, 4-byte words when 4-byte aligned, bytes otherwise).
__device__ __noinline__ void copy_sources(char* const* dst, u32 ndst, const char* src, u64 bytes) {
    u64 any = reinterpret_cast<u64>(src);
    for (u32 d = 0; d < ndst; ++d) any |= reinterpret_cast<u64>(dst[d]);
    u64 done = 0;
    if ((any & 15ull) == 0) {
        copy_units<uint4>(dst, ndst, src, bytes / kVecBytes);
        done = bytes / kVecBytes * kVecBytes;
    } else if ((any & 3ull) == 0) {
        copy_units<u32>(dst, ndst, src, bytes / 4ull);
        done = bytes / 4ull * 4ull;
    }
    for (u64 i = done + threadIdx.x; i < bytes; i += blockDim.x) {
        const unsigned char b = __ldcv(reinterpret_cast<const unsigned char*>(src) + i);
        for (u32 d = 0; d < ndst; ++d) reinterpret_cast<unsigned char*>(dst[d])[i] = b;
    }
}

// dst_d[k] = src_0[k] op src_1[k] op ... op src_{n-1}[k] for k < count and every d < ndst, accumulated in
// fp32 in rank order (the same bits on every rank); one source is copied as bits. Pointers in shared
// memory, set by the caller.
template <class E, int OP>
__device__ void reduce_sources(char* const* dst, u32 ndst, const char* const* src, u32 n, u64 count) {
    typedef typename E::T T;
    if constexpr (!E::kArithmetic) {
        copy_sources(dst, ndst, src[0], count * sizeof(T));
    } else if (n == 1) {
        copy_sources(dst, ndst, src[0], count * sizeof(T));
    } else {
        constexpr u32 V = E::kPerVec;
        u64 any = 0;
        for (u32 p = 0; p < n; ++p) any |= reinterpret_cast<u64>(src[p]);
        for (u32 d = 0; d < ndst; ++d) any |= reinterpret_cast<u64>(dst[d]);
        const u64 nvec = (any & 15ull) == 0 ? count / V : 0;
        reduce_vectors<E, OP>(n, nvec, [&](u32 p) { return reinterpret_cast<const uint4*>(src[p]); },
                              [&](u64 v, const uint4& res) {
                                  for (u32 d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dst[d])[v] = res;
                              });
        for (u64 k = nvec * V + threadIdx.x; k < count; k += blockDim.x) {
            const T r = reduce_elem<E, OP>(n, [&](u32 p) { return reinterpret_cast<const volatile T*>(src[p]) + k; });
            for (u32 d = 0; d < ndst; ++d) reinterpret_cast<T*>(dst[d])[k] = r;
        }
    }
}

// Pipelined reduction round, `step` elements per ring entry.
//   reduce-scatter (two_phase false; roles sender, reducer): rank r pushes the slice steps of chunk q of
//     x (at q * chunk_stride) to q; each rank reduces its own chunk into out[0, chunk) (count == chunk).
//   allreduce (two_phase true; roles sender, reducer, receiver): chunk q = x[q * chunk, ...) clipped to
//     count; its owner reduces it into out and pushes the result into every peer's ring 1 in the same
//     pass; the receivers copy the other chunks out.
template <class E, int OP>
__device__ void reduce_pipe(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out, u64 count,
                            u64 chunk, u64 slot_bytes, u64 step, u32 depth, bool two_phase) {
    typedef typename E::T T;
    __shared__ const char* srcs[kMaxWorld];
    __shared__ char* dsts[kMaxWorld];
    const Pipe pp = begin_pipe(t, two_phase ? 3 : 2, slot_bytes, step * sizeof(T), depth);
    u64 lo, hi;
    pipe_range(pp, chunk, kLineBytes / sizeof(T), &lo, &hi);
    u64 len[kMaxWorld];  // elements of chunk q in this slice
    u64 steps = 1;
    for (u32 q = 0; q < t.world; ++q) {
        u64 n = hi - lo;
        if (two_phase) {  // clip to the message: the last chunks may be short or empty
            const u64 valid = count > q * chunk ? count - q * chunk : 0;
            const u64 h = hi < valid ? hi : valid;
            n = lo < h ? h - lo : 0;
        }
        len[q] = n;
        const u64 s = steps_of(n, step);
        steps = s > steps ? s : steps;
    }
    const u32 peers = ((t.world == 32 ? 0u : 1u << t.world) - 1u) & ~(1u << t.rank);
    if (pp.role == 0) {                                                                 // sender
        for (u64 j = 0; j < steps; ++j) {
            const u32 mask = peers_with_step(t, len, step, j);
            if (j >= depth && !pipe_wait(t, pp, kCredit0, pipe_value(pp.e, j - depth), mask)) return;
            for (u32 s = 1; s < t.world; ++s) {
                const u32 q = (t.rank + s) % t.world;
                if (!((mask >> q) & 1u)) continue;
                const u64 src = (two_phase ? q * chunk : q * chunk_stride) + lo + j * step;
                copy_block(peer_ws(t, q) + pp.entry(t, 0, q, t.rank, j), reinterpret_cast<const char*>(x + src),
                           step_len(len[q], step, j) * sizeof(T), false);
            }
            pipe_signal(t, pp, kReady0, pipe_value(pp.e, j), mask);
        }
    } else if (pp.role == 1) {                                                          // reducer
        T* my_out = (two_phase ? out + t.rank * chunk : out) + lo;
        const u64 own = (two_phase ? t.rank * chunk : t.rank * chunk_stride) + lo;
        for (u64 j = 0; j < steps_of(len[t.rank], step); ++j) {
            if (!pipe_wait(t, pp, kReady0, pipe_value(pp.e, j), peers)) return;
            if (two_phase && j >= depth && !pipe_wait(t, pp, kCredit1, pipe_value(pp.e, j - depth), peers)) return;
            const u32 p = threadIdx.x;
            if (p < t.world) {
                srcs[p] = p == t.rank ? reinterpret_cast<const char*>(x + own + j * step) : t.ws + pp.entry(t, 0, t.rank, p, j);
                // destination 0: this rank's out; 1..n-1 (two-phase): the peers' ring 1
                if (p == 0) dsts[0] = reinterpret_cast<char*>(my_out + j * step);
                else if (two_phase) {
                    const u32 q = (t.rank + p) % t.world;
                    dsts[p] = peer_ws(t, q) + pp.entry(t, 1, q, t.rank, j);
                }
            }
            __syncthreads();
            reduce_sources<E, OP>(dsts, two_phase ? t.world : 1u, srcs, t.world, step_len(len[t.rank], step, j));
            pipe_signal(t, pp, kCredit0, pipe_value(pp.e, j), peers);                  // ring-0 reads done
            if (two_phase) {  // the fence in pipe_signal also ordered this block's ring-1 pushes
                const u32 q = threadIdx.x;
                if (q < t.world && ((peers >> q) & 1u))
                    fluxrt::st_release_sys(reinterpret_cast<u64*>(t.flags_peers[q]) + pp.flag(t, kReady1, t.rank),
                                           pipe_value(pp.e, j));
            }
        }
    } else {                                                                            // receiver (allreduce)
        for (u64 j = 0; j < steps; ++j) {
            const u32 mask = peers_with_step(t, len, step, j);
            if (!pipe_wait(t, pp, kReady1, pipe_value(pp.e, j), mask)) return;
            for (u32 p = 0; p < t.world; ++p) {
                if (!((mask >> p) & 1u)) continue;
                copy_block(reinterpret_cast<char*>(out + p * chunk + lo + j * step), t.ws + pp.entry(t, 1, t.rank, p, j),
                           step_len(len[p], step, j) * sizeof(T), true);
            }
            pipe_signal(t, pp, kCredit1, pipe_value(pp.e, j), mask);
        }
    }
}

// ----------------------------------------------------------------------------------------- ring rounds
// Bulk reductions and allgathers along the ring rank -> rank + 1 (as NCCL's ring). Every rank pushes to
// one peer only:
// on 4x H200 single-destination pushes reach 345-355 GB/s per GPU with 48-128 blocks, all-to-all pushes
// 335-336 with 128-132 (perf/fabric_probe.py --peers, perf/results/fabric-*-13e981e.json); the
// pipelined rounds above push all-to-all.
// The message is n chunks. Chunk c travels c+1 -> c+2 -> ... -> c, each rank adding its x, then, reduced,
// once more around the ring until every rank holds it. Rank r, stage s, chunk c = (r + 2n - 1 - s) mod n:
//   s = 0             send x[c]                                    (reduce-scatter stages: c = r - 1 - s)
//   0 < s < n - 1     receive, add x[c], send
//   s = n - 1         receive, add x[r], write out[r], send        (allgather stages: c = r - (s - n + 1))
//   n - 1 < s < 2n-2  receive, write out[c], send
//   s = 2n - 2        receive, write out[r + 1]
// allreduce runs stages 0 .. 2n-2; reduce_scatter 0 .. n-1 (out holds chunk r only: out_stride 0);
// allgather n - 1 .. 2n - 2, its first stage sending x (chunk r only: x_stride 0) without a receive.
// A stage with one source (allreduce's first and last n - 1 stages, every allgather stage) copies bits.
// Block b takes slice b of every chunk, in pieces of `substeps` steps of `step` elements, each piece
// through all stages before the next. What rank r sends to r + 1 is one sequence of entries per slice,
// u = (piece * sends + stage - first) * substeps + i for step i of a stage, held in a ring of `depth`
// entries of the receiver's workspace (half e & 1, as every round):
//   ready  [kReady0][slice] on r + 1: entry u is written          (rank r releases after its pushes)
//   credit [kCredit0][slice] on r: r + 1 has read entry u           (r refills it with u + depth)
// Why steps within a stage: the next rank's stage s + 1 step i needs only step i of this rank's stage s,
// so the ranks run in step, and each wait has substeps - 1 steps of copying to hide the previous
// rank's fence and flag latency (with one step per stage that latency adds to every stage: 4x H200,
// 64 KiB steps, 64 blocks: 7178 us at 1 GiB). depth >= 2 substeps lets a rank send stage s + 1 while
// the next rank still reads stage s. Where a block's whole slice fits one entry the host passes
// substeps = 1 (collectives_plan.ring_geometry): each stage then pays one fence and one flag, which at
// 32-128 MiB costs less than hiding the flag latency behind a second, half-size step.
// Every stage of every slice moves at least one (maybe empty) step, so the workspace-halves argument
// holds: rank r's round e ends only after it received chunk r + 1 reduced by rank r + 1 in round e, so
// r + 1 had finished round e - 1 (and its reads of the other half).
// Sums are rounded to the dtype at each hop (as in NCCL's ring), not accumulated in fp32; a chunk is
// reduced once, by its owner, so every rank still gets the same bits.
// A ring round's flags have one source each (ready: the previous rank, credit: the next), so a phase's
// flags are indexed by slice alone, over all world x kMaxBlocks slots: up to kMaxRingBlocks slices.
constexpr u32 kMaxRingBlocks = 256;
static_assert(kMaxRingBlocks <= 2 * kMaxBlocks, "ring flags must fit world x kMaxBlocks slots for 2 ranks");

__device__ __forceinline__ u64 ring_flag(const Team& t, const Pipe& pp, u32 phase) {
    return (u64)phase * t.world * kMaxBlocks + pp.slice;
}

__device__ __forceinline__ bool ring_wait(const Team& t, const Pipe& pp, u32 prev, u64 ready, u32 next,
                                          u64 credited) {
    int ok = 1;
    if (threadIdx.x == 0 && ready) {          // entry u is in this rank's ring
        ok = fluxrt::wait_ge(t.flags + ring_flag(t, pp, kReady0), ready, t.timeout_ns, t.err, t.op, t.rank, prev);
        fluxrt::fence_acq_rel_sys();          // the acquire covers the block's reads (bar.sync below)
    } else if (threadIdx.x == 32 && credited) {  // next has read the entry u - depth we are about to refill
        ok = fluxrt::wait_ge(t.flags + ring_flag(t, pp, kCredit0), credited, t.timeout_ns, t.err, t.op, t.rank, next);
        fluxrt::fence_acq_rel_sys();
    }
    return __syncthreads_and(ok) != 0;
}

template <class E, int OP>
__device__ void reduce_ring(Team t, const typename E::T* x, u64 x_stride, typename E::T* out, u64 out_stride,
                            u64 count, u64 chunk, u64 step, u32 depth, u32 substeps, u32 first, u32 last) {
    typedef typename E::T T;
    __shared__ const char* srcs[2];
    __shared__ char* dsts[2];
    __shared__ u32 nsrc, ndst;
    const Pipe pp = begin_pipe(t, 1, 0, step * sizeof(T), depth);
    const u32 n = t.world, next = (t.rank + 1) % n, prev = (t.rank + n - 1) % n;
    u64 lo, hi;
    pipe_range(pp, chunk, kLineBytes / sizeof(T), &lo, &hi);
    const u64 sends = last - first;
    const u64 ring_at = pp.base + (u64)pp.slice * depth * pp.step;  // this slice's ring, same on every rank
    char* const ring_next = peer_ws(t, next) + ring_at;
    const char* const ring_mine = t.ws + ring_at;
    const u64 piece = step * substeps;
    for (u64 m = 0; m < steps_of(hi - lo, piece); ++m) {
        for (u32 s = first; s <= last; ++s) {
            const u32 c = (t.rank + 2 * n - 1 - s) % n;
            const u64 valid = count > c * chunk ? count - c * chunk : 0;  // chunk c clipped to the message
            const u64 end = hi < valid ? hi : valid;
            const bool recv = s > first, send = s < last;
            for (u32 i = 0; i < substeps; ++i) {
                const u64 at = lo + m * piece + i * step;  // element offset of the step within a chunk
                const u64 len = at < end ? (end - at < step ? end - at : step) : 0;
                const u64 us = (m * sends + (s - first)) * substeps + i;  // entry sent; received: us - substeps
                const u64 ur = us - substeps;
                if (!ring_wait(t, pp, prev, recv ? pipe_value(pp.e, ur) : 0, next,
                               send && us >= depth ? pipe_value(pp.e, us - depth) : 0))
                    return;
                if (threadIdx.x == 0) {                                                    // stage reduce
                    u32 ns = 0, nd = 0;
                    if (recv) srcs[ns++] = ring_mine + (ur % depth) * pp.step;
                    if (s <= n - 1) srcs[ns++] = reinterpret_cast<const char*>(x + c * x_stride + at);
                    if (send) dsts[nd++] = ring_next + (us % depth) * pp.step;
                    char* const o = reinterpret_cast<char*>(out + c * out_stride + at);
                    if (s >= n - 1 && !(ns == 1 && srcs[0] == o)) dsts[nd++] = o;  // in place: already there
                    nsrc = ns, ndst = nd;
                }
                __syncthreads();
                reduce_sources<E, OP>(dsts, ndst, srcs, nsrc, len);
                fluxrt::fence_acq_rel_sys();  // every thread orders its pushes (and its reads of the entry)
                __syncthreads();
                if (threadIdx.x == 0 && send)                                               // stage ready
                    fluxrt::st_release_sys(reinterpret_cast<u64*>(t.flags_peers[next]) + ring_flag(t, pp, kReady0),
                                           pipe_value(pp.e, us));
                else if (threadIdx.x == 32 && recv)                                         // stage credit
                    fluxrt::st_release_sys(reinterpret_cast<u64*>(t.flags_peers[prev]) + ring_flag(t, pp, kCredit0),
                                           pipe_value(pp.e, ur));
            }
        }
    }
}

// ----------------------------------------------------------------------------------------- LL rounds
// Low-latency rounds for small messages: the data carries its own flag. A sender stores each 8 bytes of
// the message as one 16-byte line of two cells {4 data bytes | 4 flag bytes} in the receiver's LL slot
// [sender]; an aligned 8-byte store is single-copy atomic, so a receiver that reads a cell holding this
// round's flag also reads its data. No fence and no separate flag word: one NVLink trip per round, at
// the price of twice the bytes on the wire.
// The receiver zeroes every line after reading it, so between rounds the LL buffer holds only zeros
// and a line can only ever match the current round's flag (never a stale one, whatever the epoch wrap).
// Reuse: round e uses LL half (e & 1), by the argument of the workspace halves above. Every pair of
// ranks exchanges at least one line per LL round (a pair with nothing to send sends one marker line),
// so a peer finishes round e only after this rank has entered it.
// One thread owns line j of every pair: it pushes line j to every peer, then takes line j from every
// peer, so in-place layouts (the line it writes is one it has already sent) need no block barrier.
constexpr u32 kLLLine = 16;  // bytes of one line on the wire (one 16-byte store: two cells)
constexpr u32 kLLData = 8;   // message bytes per line

__device__ __forceinline__ u32 ll_flag(u64 e) {
    const u32 f = (u32)e;
    return f ? f : 1u;  // zero means "empty line"
}

__device__ __forceinline__ u64 lines_of(u64 bytes) { return (bytes + kLLData - 1) / kLLData; }

__device__ __forceinline__ char* peer_ll(const Team& t, u32 q) { return reinterpret_cast<char*>(t.ll_peers[q]); }

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
__device__ __forceinline__ void accumulate_line(float (&acc)[V], u64 v, u32 p) {
    const typename E::T* el = reinterpret_cast<const typename E::T*>(&v);
#pragma unroll
    for (u32 k = 0; k < V; ++k) acc[k] = p == 0 ? E::to_f(el[k]) : combine<OP>(acc[k], E::to_f(el[k]));
}

template <class E, u32 V>
__device__ __forceinline__ u64 pack_line(const float (&acc)[V]) {
    u64 r = 0;
    typename E::T* el = reinterpret_cast<typename E::T*>(&r);
#pragma unroll
    for (u32 k = 0; k < V; ++k) el[k] = E::from_f(acc[k]);
    return r;
}

// LL reduction round: rank r contributes the `bytes` at src_of(q) to the reduction that rank q keeps;
// the reduction of every rank's contribution for this rank lands in out. Accumulated in fp32 in rank
// order, as the other reductions (every rank computes bitwise the same value).
// allreduce: src_of(q) = x for every q; reduce-scatter: src_of(q) = chunk q of x.
template <class E, int OP>
__device__ void reduce_ll(Team t, const typename E::T* x, u64 chunk_stride, typename E::T* out, u64 count,
                          u64 slot_bytes) {
    typedef typename E::T T;
    constexpr u32 V = kLLData / sizeof(T);  // elements per line
    const u64 e = begin_round(t.epoch);
    const u32 f = ll_flag(e);
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    const u64 bytes = count * sizeof(T), lines = lines_of(bytes);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    const bool one_source = chunk_stride == 0;  // allreduce: every peer gets the same line
    for (u64 j = first; j < lines; j += stride) {                                       // stage push
        const u64 shared = one_source ? load_line(reinterpret_cast<const char*>(x), bytes, j) : 0;
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            const u64 v = one_source ? shared : load_line(reinterpret_cast<const char*>(x + q * chunk_stride), bytes, j);
            ll_put(ll_line(peer_ll(t, q), half, t.rank, slot_bytes, j), v, f);
        }
    }
    const char* own = reinterpret_cast<const char*>(x + t.rank * chunk_stride);
    for (u64 j = first; j < lines; j += stride) {                                       // stage take
        float acc[V];
        for (u32 p = 0; p < t.world; ++p) {
            u64 v;
            if (p == t.rank) v = load_line(own, bytes, j);
            else if (!ll_take(t, ll_line(t.ll, half, p, slot_bytes, j), f, p, &v)) return;
            accumulate_line<E, OP, V>(acc, v, p);
        }
        store_line(reinterpret_cast<char*>(out), bytes, j, pack_line<E, V>(acc));     // stage store
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
            ll_put(ll_line(peer_ll(t, q), half, t.rank, slot_bytes, j), v, f);
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
            if (!ll_take(t, ll_line(t.ll, half, p, slot_bytes, j), f, p, &v)) return;
            if (bytes) store_line(dst, bytes, j, v);
        }
    }
}

// ----------------------------------------------------------------------------------------- LL12 allreduce
// One-shot allreduce for small messages in a denser LL format ('ll12'). The contract is the LL rounds'
// above: data and flag share one aligned 8-byte cell, which is single-copy atomic (the only atomicity
// relied on: the 16-byte store of a line is two such cells, each atomic on its own), the receiver zeroes
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
__device__ __forceinline__ void accumulate12(float (&acc)[V], const u32 (&w)[3], u32 p) {
    const typename E::T* el = reinterpret_cast<const typename E::T*>(&w[0]);
#pragma unroll
    for (u32 k = 0; k < V; ++k) acc[k] = p == 0 ? E::to_f(el[k]) : combine<OP>(acc[k], E::to_f(el[k]));
}

template <class E, u32 V>
__device__ __forceinline__ void pack12(const float (&acc)[V], u32 (&w)[3]) {
    w[0] = w[1] = w[2] = 0u;
    typename E::T* el = reinterpret_cast<typename E::T*>(&w[0]);
#pragma unroll
    for (u32 k = 0; k < V; ++k) el[k] = E::from_f(acc[k]);
}

__device__ __forceinline__ u32 everyone(const Team& t) { return t.world == 32 ? ~0u : (1u << t.world) - 1u; }

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
    float acc[kLL12Data / sizeof(typename E::T)];
    if (!take12(t, region, slot_bytes, j, f, everyone(t), own,
                [&](u32 p, const u32 (&w)[3]) { accumulate12<E, OP>(acc, w, p); }))
        return false;
    pack12<E>(acc, r);
    return true;
}

// Allreduce of `count` elements in LL12 lines: every rank pushes all of x into every peer's LL slot [rank]
// and reduces the n contributions of each line in fp32 in rank order (every rank computes bitwise the
// same value). One thread owns line j of every pair (in place: out == x is fine, the thread reads its own
// line of x before it writes that line of out). Launch: any grid and block (blockDim >= 1); the host sizes
// it a thread per line (collectives_plan.ll12_grid).
template <class E, int OP>
__device__ void allreduce_ll12(Team t, const typename E::T* x, typename E::T* out, u64 count, u64 slot_bytes) {
    typedef typename E::T T;
    static_assert(kLL12Data % sizeof(T) == 0 && sizeof(T) <= 4, "whole elements per line, in 32-bit words");
    __shared__ u64 s_peer[kMaxWorld];
    const char* src = reinterpret_cast<const char*>(x);
    const u64 bytes = count * sizeof(T), lines = lines12_of(bytes);
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    u32 mine[3] = {0u, 0u, 0u};
    const u64 e = begin_round(                                                           // stage begin
        t.epoch, [&] { for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) s_peer[q] = t.ll_peers[q]; },
        [&] { if (first < lines) load12(src, bytes, first, mine); });
    const u64 f = ll12_flag(e), flag_bits = f << kLL12FlagShift;
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    for (u64 j = first; j < lines; j += stride) {                                       // stage push
        u32 w[3] = {mine[0], mine[1], mine[2]};
        if (j != first) load12(src, bytes, j, w);
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]), half, t.rank, slot_bytes, j), w, flag_bits);
        }
    }
    for (u64 j = first; j < lines; j += stride) {                                       // stage take
        u32 own[3] = {mine[0], mine[1], mine[2]};
        if (j != first) load12(src, bytes, j, own);
        u32 r[3];
        if (!reduce_line12<E, OP>(t, t.ll + half, slot_bytes, j, f, own, r)) return;
        store12(reinterpret_cast<char*>(out), bytes, j, r);                              // stage store
    }
}

// ----------------------------------------------------------------------------------------- LL12 two-shot
// Allreduce for mid-size messages: a reduce-scatter and an allgather in LL12 lines, in one launch. Each
// rank sends 2 (n-1)/n of the message (times 4/3 for the flags) instead of one-shot's n - 1 times, at
// the price of a second NVLink trip. The message's `lines` LL12 lines are cut into n chunks of
// `chunk` = ceil(lines / n) lines (the last ones may be short or empty); rank q owns chunk q. Thread j
// owns line j of every chunk:
//   stage push     line j of chunk q of x to peer q's region 0, slot [rank]
//   stage reduce   line j of this rank's chunk: its own line and every peer's (taken from region 0, slot
//                  [p]) in fp32 in rank order, into out (every rank computes bitwise the same value)
//   stage forward  the reduced line to every peer's region 1, slot [rank]
//   stage gather   line j of chunk p from region 1, slot [p], into out
// The LL rounds' contract holds (data and flag in one 8-byte cell, lines zeroed when read, round e in
// LL half e & 1). An empty chunk still moves one marker line (j = 0) in both phases, so every pair
// exchanges lines in every round, which the halves argument needs. In place is fine: thread j reads
// line j of every chunk of x (push, reduce) before it writes any line of out.
// Region 0 holds n slots of `slot_bytes` from the half's start, region 1 n more (Layout of 'll12_twoshot').
template <class E, int OP>
__device__ void allreduce_ll12_twoshot(Team t, const typename E::T* x, typename E::T* out, u64 count,
                                       u64 slot_bytes) {
    typedef typename E::T T;
    __shared__ u64 s_peer[kMaxWorld];
    const char* src = reinterpret_cast<const char*>(x);
    const u64 bytes = count * sizeof(T), lines = lines12_of(bytes);
    const u64 chunk = (lines + t.world - 1) / t.world;
    // lines of chunk q: its length, at least one (a marker line past the end of the message)
    auto len = [&](u32 q) { const u64 at = (u64)q * chunk; return at < lines ? (lines - at < chunk ? lines - at : chunk) : 0ull; };
    auto moved = [&](u32 q) { const u64 n = len(q); return n ? n : 1ull; };
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    u32 mine[3] = {0u, 0u, 0u};  // this thread's first line of its own chunk
    const u64 e = begin_round(                                                           // stage begin
        t.epoch, [&] { for (u32 q = threadIdx.x; q < t.world; q += blockDim.x) s_peer[q] = t.ll_peers[q]; },
        [&] { if (first < len(t.rank)) load12(src, bytes, t.rank * chunk + first, mine); });
    const u64 f = ll12_flag(e), flag_bits = f << kLL12FlagShift;
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    const u64 region1 = (u64)t.world * slot_bytes;
    for (u64 j = first; j < chunk; j += stride) {                                       // stage push
        for (u32 s = 1; s < t.world; ++s) {
            const u32 q = (t.rank + s) % t.world;
            if (j >= moved(q)) continue;
            u32 w[3] = {0u, 0u, 0u};
            if (j < len(q)) load12(src, bytes, q * chunk + j, w);
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]), half, t.rank, slot_bytes, j), w, flag_bits);
        }
    }
    for (u64 j = first; j < moved(t.rank); j += stride) {                               // stage reduce
        u32 own[3] = {mine[0], mine[1], mine[2]};
        if (j != first && j < len(t.rank)) load12(src, bytes, t.rank * chunk + j, own);
        u32 r[3];
        if (!reduce_line12<E, OP>(t, t.ll + half, slot_bytes, j, f, own, r)) return;
        if (j < len(t.rank)) store12(reinterpret_cast<char*>(out), bytes, t.rank * chunk + j, r);
        for (u32 s = 1; s < t.world; ++s) {                                             // stage forward
            const u32 q = (t.rank + s) % t.world;
            ll12_put(ll_line(reinterpret_cast<char*>(s_peer[q]) + region1, half, t.rank, slot_bytes, j), r, flag_bits);
        }
    }
    for (u64 j = first; j < chunk; j += stride) {                                       // stage gather
        u32 peers = 0;
        for (u32 p = 0; p < t.world; ++p)
            if (p != t.rank && j < moved(p)) peers |= 1u << p;
        const u32 none[3] = {0u, 0u, 0u};
        const bool ok = take12(t, t.ll + half + region1, slot_bytes, j, f, peers, none,
                               [&](u32 p, const u32 (&w)[3]) {
                                   if (j < len(p)) store12(reinterpret_cast<char*>(out), bytes, p * chunk + j, w);
                               });
        if (!ok) return;
    }
}

}  // namespace

#define FLUXRT_TEAM_PARAMS                                                                              \
    u64 *epoch, char *ws, const u64 *ws_peers, u64 *flags, const u64 *flags_peers, u64 half_bytes,     \
        char *ll, const u64 *ll_peers, u64 ll_half_bytes, u32 rank, u32 world, u64 timeout_ns,         \
        ErrorRecord *err, u32 op
#define FLUXRT_TEAM                                                                                     \
    Team{epoch, ws, ws_peers, flags, flags_peers, half_bytes, ll, ll_peers, ll_half_bytes, rank, world, \
         timeout_ns, err, op}

#define FLUXRT_REDUCTIONS(NAME, E, OP)                                                                  \
    extern "C" __global__ void fluxrt_allreduce_oneshot_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,      \
                                                                 E::T* out, u64 count, u64 slot_bytes) { \
        allreduce_oneshot<E, OP>(FLUXRT_TEAM, x, out, count, slot_bytes);                               \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_allreduce_twoshot_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,      \
                                                                 E::T* out, u64 count, u64 chunk,       \
                                                                 u64 slot_bytes) {                      \
        allreduce_twoshot<E, OP>(FLUXRT_TEAM, x, out, count, chunk, slot_bytes);                        \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_reduce_scatter_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,         \
                                                              u64 chunk_stride, E::T* out, u64 chunk,   \
                                                              u64 slot_bytes) {                         \
        reduce_scatter_round<E, OP>(FLUXRT_TEAM, x, chunk_stride, out, chunk, slot_bytes);              \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_allreduce_ll_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, \
                                                            u64 count, u64 slot_bytes) {                \
        reduce_ll<E, OP>(FLUXRT_TEAM, x, 0, out, count, slot_bytes);                                    \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_allreduce_ll12_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,        \
                                                              E::T* out, u64 count, u64 slot_bytes) {   \
        allreduce_ll12<E, OP>(FLUXRT_TEAM, x, out, count, slot_bytes);                                  \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_allreduce_ll12_twoshot_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, \
                                                                      E::T* out, u64 count,            \
                                                                      u64 slot_bytes) {                \
        allreduce_ll12_twoshot<E, OP>(FLUXRT_TEAM, x, out, count, slot_bytes);                          \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_reduce_scatter_ll_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,      \
                                                                 u64 chunk_stride, E::T* out, u64 chunk, \
                                                                 u64 slot_bytes) {                      \
        reduce_ll<E, OP>(FLUXRT_TEAM, x, chunk_stride, out, chunk, slot_bytes);                         \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads)                                          \
        fluxrt_allreduce_pipe_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 count, u64 chunk,  \
                                     u64 slot_bytes, u64 step, u32 depth) {                              \
        reduce_pipe<E, OP>(FLUXRT_TEAM, x, 0, out, count, chunk, slot_bytes, step, depth, true);        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads)                                          \
        fluxrt_allreduce_ring_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 count, u64 chunk,  \
                                     u64 step, u32 depth, u32 substeps) {                                \
        reduce_ring<E, OP>(FLUXRT_TEAM, x, chunk, out, chunk, count, chunk, step, depth, substeps, 0,    \
                           2 * world - 2);                                                              \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads)                                          \
        fluxrt_reduce_scatter_ring_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 chunk,        \
                                          u64 step, u32 depth, u32 substeps) {                           \
        reduce_ring<E, OP>(FLUXRT_TEAM, x, chunk, out, 0, world * chunk, chunk, step, depth, substeps, 0, \
                           world - 1);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads)                                          \
        fluxrt_reduce_scatter_pipe_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, u64 chunk_stride, E::T* out, \
                                          u64 chunk, u64 slot_bytes, u64 step, u32 depth) {              \
        reduce_pipe<E, OP>(FLUXRT_TEAM, x, chunk_stride, out, chunk, chunk, slot_bytes, step, depth,    \
                           false);                                                                      \
    }

FLUXRT_REDUCTIONS(bf16_sum, BF16, kSum)
FLUXRT_REDUCTIONS(bf16_max, BF16, kMax)
FLUXRT_REDUCTIONS(bf16_min, BF16, kMin)
FLUXRT_REDUCTIONS(fp16_sum, F16, kSum)
FLUXRT_REDUCTIONS(fp16_max, F16, kMax)
FLUXRT_REDUCTIONS(fp16_min, F16, kMin)
FLUXRT_REDUCTIONS(fp32_sum, F32, kSum)
FLUXRT_REDUCTIONS(fp32_max, F32, kMax)
FLUXRT_REDUCTIONS(fp32_min, F32, kMin)

// Allgather along the ring: stages n - 1 .. 2n - 2 of reduce_ring, in bytes. x holds this rank's chunk
// only (x_stride 0), out all n chunks; in place (x == out + rank * chunk) this rank's chunk is not copied.
extern "C" __global__ void __launch_bounds__(kBulkThreads)
    fluxrt_allgather_ring(FLUXRT_TEAM_PARAMS, const unsigned char* x, unsigned char* out, u64 chunk, u64 step,
                          u32 depth, u32 substeps) {
    reduce_ring<Bytes, kSum>(FLUXRT_TEAM, x, 0, out, chunk, world * chunk, chunk, step, depth, substeps,
                             world - 1, 2 * world - 2);
}

extern "C" __global__ void fluxrt_exchange(FLUXRT_TEAM_PARAMS, const ExchangeTable tab, u64 slot_bytes,
                                           int direct) {
    exchange(FLUXRT_TEAM, tab, slot_bytes, direct != 0);
}

extern "C" __global__ void fluxrt_exchange_ll(FLUXRT_TEAM_PARAMS, const ExchangeTable tab, u64 slot_bytes) {
    exchange_ll(FLUXRT_TEAM, tab, slot_bytes);
}

extern "C" __global__ void fluxrt_exchange_pipe(FLUXRT_TEAM_PARAMS, const ExchangeTable tab, u64 slot_bytes,
                                                u64 step, u32 depth, int pairwise) {
    exchange_pipe(FLUXRT_TEAM, tab, slot_bytes, step, depth, pairwise != 0);
}
