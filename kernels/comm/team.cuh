// What every collective round shares, whatever its transfer scheme: the team (peers, flags, workspace,
// epoch counter), the exchange table, and the start of a round.
//
// Every launch is one "round" of one collective. A block only ever touches its own slice (the same
// partition on every rank: it depends only on the sizes and the grid, which every rank computes
// identically), so blocks never wait for each other.
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
// (rounds of one context run in stream order on every rank; the host serializes them). Every scheme
// keeps this argument true by moving at least one (maybe empty) unit between every pair in every round.
//
// Compiled with NVRTC: builtin types only; 16-bit floats converted with PTX cvt.
#pragma once

#include "fluxrt/comm.cuh"

namespace fluxrt {
namespace coll {

constexpr u32 kMaxBlocks = 128;  // flag slots per (phase, source rank); launches use <= this many blocks
constexpr u32 kFlagPhases = 6;   // flag arrays per (source rank, block): staged 0-1, pipelined 2-5
// Threads of a bulk block (fluxrt/collectives_plan.py THREADS). Kernels that would otherwise take more
// than 65536 / kBulkThreads registers a thread are compiled to fit (__launch_bounds__).
constexpr u32 kBulkThreads = 512;
// Blocks of kBulkThreads an SM must hold at once, the second argument of those __launch_bounds__: one,
// so the cap stays 128 registers. Given the thread count alone ptxas may aim for two blocks an SM and
// squeeze kernels that need a little more than 64 registers into 64 with spills; a second block gains
// nothing, since a round's grid is at most kMaxBlocks or kMaxRingBlocks blocks.
constexpr u32 kBulkBlocksPerSM = 1;

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

    __device__ __forceinline__ Watch watch() const { return Watch{timeout_ns, err, op, rank}; }
    __device__ __forceinline__ char* peer_ws(u32 q) const { return reinterpret_cast<char*>(ws_peers[q]); }
    __device__ __forceinline__ char* peer_ll(u32 q) const { return reinterpret_cast<char*>(ll_peers[q]); }
    // Flag word `index` of peer q's flag array.
    __device__ __forceinline__ u64* peer_flag(u32 q, u64 index) const {
        return reinterpret_cast<u64*>(flags_peers[q]) + index;
    }
    // Every rank but this one, as a bit mask (world <= kMaxWorld).
    __device__ __forceinline__ u32 everyone() const { return world == 32 ? ~0u : (1u << world) - 1u; }
    __device__ __forceinline__ u32 peers() const { return ((world == 32 ? 0u : 1u << world) - 1u) & ~(1u << rank); }
};

// Peer set of a bit mask, as the block-level signal/wait primitives take it.
struct InMask {
    u32 mask;
    __device__ __forceinline__ bool operator()(u32 p) const { return (mask >> p) & 1u; }
};

// Per-peer byte ranges of one exchange round (by value: no upload, graph-capturable).
struct ExchangeTable {
    u64 send_ptr[kMaxWorld];    // local source of what goes to peer q
    u64 send_bytes[kMaxWorld];
    u64 recv_ptr[kMaxWorld];    // local destination of what came from peer p
    u64 recv_bytes[kMaxWorld];
    u64 send_dst[kMaxWorld];    // direct rounds: where peer q wants the data (in its output, mapped here)
};

// The team as the leading parameters of an extern "C" entry point, and the Team they make (for files of
// entry points with `using` of fluxrt::u64, u32 and ErrorRecord; the host packs one team tuple for all).
#define FLUXRT_TEAM_PARAMS                                                                              \
    u64 *epoch, char *ws, const u64 *ws_peers, u64 *flags, const u64 *flags_peers, u64 half_bytes,     \
        char *ll, const u64 *ll_peers, u64 ll_half_bytes, u32 rank, u32 world, u64 timeout_ns,         \
        ErrorRecord *err, u32 op
#define FLUXRT_TEAM                                                                                     \
    Team{epoch, ws, ws_peers, flags, flags_peers, half_bytes, ll, ll_peers, ll_half_bytes, rank, world, \
         timeout_ns, err, op}

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

// ----------------------------------------------------------------------------------------- timeouts
// A wait that timed out (or saw another waiter's error) ends the round; before it returns, the block or
// thread poisons the part of the output it was responsible for and has not written (all of it, for
// simplicity: what it wrote before the wait is overwritten too), so a caller who reads the output
// without asking fluxrt for errors sees NaN, not numbers computed from stale data. Only what the failing
// unit owns is touched: never a buffer its own rank's other blocks may still read to push to a peer.

// Block-level: elements [lo, hi) of out.
template <class T>
__device__ __forceinline__ void poison_elems(T* out, u64 lo, u64 hi) {
    if (lo < hi) poison_bytes(reinterpret_cast<char*>(out + lo), (hi - lo) * sizeof(T), threadIdx.x, blockDim.x);
}

// One thread: its lines first, first + stride, ... of an output of `bytes`, `data` bytes per line.
__device__ __forceinline__ void poison_lines(char* out, u64 bytes, u64 first, u64 stride, u64 data) {
    for (u64 at = first * data; at < bytes; at += stride * data)
        poison_bytes(out + at, bytes - at < data ? bytes - at : data, 0, 1);
}

}  // namespace coll
}  // namespace fluxrt
