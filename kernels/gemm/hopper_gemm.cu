// fluxrt Hopper GEMM (sm_90a): C[M,N] = A[M,K] @ B, fp32 accumulate.
//
//   A  row-major [M, K] (K-major), bf16, fp16, or fp8 (e4m3 / e5m2, with per-tensor or block scales)
//   B  row-major [K, N] (MN-major, FLUXRT_GEMM_B_KMAJOR=0) or [N, K] ("trans_b", K-major, =1; fp8: only this)
//   C  row-major [M, N], bf16 / fp16 / fp32
//
// One CTA = 1 producer warpgroup + FLUXRT_GEMM_CONSUMERS consumer warpgroups, persistent over tiles:
//
//   producer WG, warp 0, lane 0  "loader":  [hook 1: wait for A's chunk (grouped: group) flag]  TMA A,B
//                                           -> smem ring
//   producer WG, warp 2, lane 0  "copier":  [hook 4 only] copies A's own rows from their source into A,
//                                           16 KiB at a time through its own smem buffer (not the ring)
//   producer WG, warp 1, lane 0  "storer":  C staging smem -> global by TMA store: into C, or with hook 2
//                                           into the tile's chunk destination (a peer's buffer), then
//                                           a per-tile flag (grouped with hook 2: the warp's lanes store
//                                           each row to its home rank, then count the rows there)
//   consumer WG c                "math":    wgmma on its rows of the tile, [64c, 64c+64) (256-row tiles: 128c on,
//                                           128 rows; ping-pong: on every row
//                                           of every other tile), [hook 3: + other
//                                           sources' partials of the tile], then registers -> C staging smem;
//                                           [hook 3 tail: after its last tile, each warp reduces 16-row
//                                           slabs of the reduced chunk, claimed one at a time]
//
// Pipeline objects (all in shared memory):
//   full[s]   loader -> math    stage s holds A,B of one K block   (1 arrival + TMA transaction bytes)
//   empty[s]  math -> loader    stage s may be overwritten         (1 arrival per consumer WG that read it,
//                                                                    per CTA writing it; ping-pong: the tile's one)
//   c_full    math -> storer    C staging holds a finished tile     (every thread of the turn's consumers;
//                                                                    ping-pong: one pair per consumer)
//   c_empty   storer -> math    C staging may be overwritten        (1 arrival, storer lane 0)
//   With FLUXRT_GEMM_C_SHARED=1 the consumers share one staging region and take turns: one c_full[c] /
//   c_empty[c] pair per consumer c, passing a single token (kCTurns in config.cuh, stage_tile in
//   epilogue.cuh).
// Every barrier follows the phase-parity protocol: the k-th completion of a barrier flips its phase;
// a waiter for "completion number k" waits on parity (k & 1). Producers of a free slot start by waiting
// on parity 1, which a freshly initialised barrier reports as already complete.
//
// Components (each its own header, composed below from the -D configuration of config.cuh):
//   params.cuh     the kernel parameter: one struct, one member struct per concern (host mirror:
//                  fluxrt/gemm/params.py)
//   scheduler.cuh  persistent tile order (grouped / Hilbert, clusters, rank offset), row chunks, the
//                  group table of the grouped GEMM (FLUXRT_GEMM_GROUPED), split-K slices and stream-K units
//   mainloop.cuh   loader variants (plain, arrival wait, own-shard copy) and the copier
//   consumer.cuh   wgmma main loop of a consumer warpgroup, fp8 scale variants (per tensor, per group, block)
//   epilogue.cuh   epilogue variants (direct, TMA store, grouped store, peer store + flag, chunk reduce,
//                  tail reduce), the storer, and the sums of partials
#include <fluxrt/comm.cuh>

// Spelled relative to kernels/include (always on the include path) so that NVRTC, which compiles the
// source from memory without its directory, finds them too. The cubin cache key covers the headers
// beside a source (fluxrt.toolchain), so edits of these change it.
#include "../gemm/config.cuh"
#include "../gemm/consumer.cuh"
#include "../gemm/epilogue.cuh"
#include "../gemm/mainloop.cuh"
#include "../gemm/params.cuh"
#include "../gemm/scheduler.cuh"

namespace fluxrt_sm90 {

// The variants of this instantiation.
using Mainloop = Select<kHookCopy, OwnShardMainloop,
                        Select<kHookWait, ArrivalWaitMainloop<AllOfA>, PlainMainloop>::type>::type;
using Epilogue =
    Select<kGrouped, Select<kGroupScatter, GroupedScatterEpilogue, GroupedStoreEpilogue>::type,
           Select<kEpiDirect, DirectEpilogue,
           Select<kReduceTail, TailReduceEpilogue,
                  Select<kReduceEpilogue, ChunkReduceEpilogue,
                         Select<kHookEpilogue, PeerStoreEpilogue, TmaStoreEpilogue>::type>::type>::type>::type>::type;

__device__ __forceinline__ AllOfA make_a_source(const Params& p, AllOfA*) { return AllOfA{&p.gemm.tmap_a}; }
__device__ __forceinline__ OwnShardOfA make_a_source(const Params& p, OwnShardOfA*) {
    return OwnShardOfA{&p.gemm.tmap_a, OwnShard::of(p.copy)};
}
__device__ __forceinline__ PlainMainloop make_mainloop(const Params& p, RowChunks, PlainMainloop*) {
    return PlainMainloop{AllOfA{&p.gemm.tmap_a}};
}
template <class ASource>
__device__ __forceinline__ ArrivalWaitMainloop<ASource> make_mainloop(const Params& p, RowChunks chunks,
                                                                      ArrivalWaitMainloop<ASource>*) {
    return ArrivalWaitMainloop<ASource>{make_a_source(p, (ASource*)nullptr), p.wait, p.timeout, chunks, -1,
                                        p.group.arrival_epoch, p.group.arrival_sources};
}

__device__ __forceinline__ DirectEpilogue make_epilogue(const Params& p, RowChunks, DirectEpilogue*) {
    return DirectEpilogue{static_cast<char*>(p.gemm.c_direct), p.gemm.m, p.gemm.n};
}
__device__ __forceinline__ TmaStoreEpilogue make_epilogue(const Params& p, RowChunks chunks, TmaStoreEpilogue*) {
    return TmaStoreEpilogue{{chunks}, &p.gemm.tmap_c, &p.fit.tmap_c_tiles};
}
__device__ __forceinline__ GroupedStoreEpilogue make_epilogue(const Params& p, RowChunks chunks,
                                                              GroupedStoreEpilogue*) {
    return GroupedStoreEpilogue{{{chunks}, &p.gemm.tmap_c, nullptr}, static_cast<char*>(p.gemm.c_direct), p.gemm.n};
}
__device__ __forceinline__ GroupedScatterEpilogue make_epilogue(const Params& p, RowChunks chunks,
                                                                GroupedScatterEpilogue*) {
    return GroupedScatterEpilogue{{{{chunks}, &p.gemm.tmap_c, nullptr}, static_cast<char*>(p.gemm.c_direct), p.gemm.n},
                                  p.group};
}
__device__ __forceinline__ PeerStoreEpilogue make_epilogue(const Params& p, RowChunks chunks, PeerStoreEpilogue*) {
    return PeerStoreEpilogue{{chunks}, p.epilogue};
}
__device__ __forceinline__ ChunkReduceEpilogue make_epilogue(const Params& p, RowChunks chunks,
                                                             ChunkReduceEpilogue*) {
    return ChunkReduceEpilogue{{{chunks}, p.epilogue}, p.reduce, p.timeout, &p.gemm.tmap_c, p.gemm.n};
}
__device__ __forceinline__ TailReduceEpilogue make_epilogue(const Params& p, RowChunks chunks, TailReduceEpilogue*) {
    return TailReduceEpilogue{{{chunks}, p.epilogue}, p.reduce, p.tail, p.timeout, p.gemm.m, p.gemm.n};
}

__device__ __forceinline__ NoScale make_scale(const Params&, NoScale*) { return NoScale{}; }
__device__ __forceinline__ TensorScale make_scale(const Params& p, TensorScale*) { return TensorScale::of(p.scale); }
__device__ __forceinline__ GroupTensorScale make_scale(const Params& p, GroupTensorScale*) {
    return GroupTensorScale::of(p.scale);
}
__device__ __forceinline__ BlockScale make_scale(const Params& p, BlockScale*) {
    return BlockScale::of(p.scale, p.gemm.m, p.gemm.n);
}

}  // namespace fluxrt_sm90

using namespace fluxrt_sm90;

// ---------------------------------------------------------------------------------------------
// Entry point. Launch with gridDim.x = kClusterCtas * min(co-resident clusters, work items) (persistent),
// blockDim.x = fluxrt_gemm_threads, dynamic shared memory = fluxrt_gemm_smem_bytes (constants below),
// and one argument: Params.
#if FLUXRT_GEMM_CLUSTER * FLUXRT_GEMM_CLUSTER_N > 1
#define FLUXRT_GEMM_CLUSTER_DIMS __cluster_dims__(FLUXRT_GEMM_CLUSTER * FLUXRT_GEMM_CLUSTER_N, 1, 1)
#else
#define FLUXRT_GEMM_CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(kThreads, 1) FLUXRT_GEMM_CLUSTER_DIMS
fluxrt_gemm(const __grid_constant__ Params p) {
    extern __shared__ char smem_raw[];
    // Align the dynamic smem base to 1024 B (128B-swizzle atoms; the host adds kSmemAlign bytes).
    const u32 raw = smem_addr(smem_raw);
    const u32 pad = (kSmemAlign - (raw & (kSmemAlign - 1))) & (kSmemAlign - 1);
    const u32 smem = raw + pad;
    const u32 bars_full = smem + kOffBars;
    const u32 bars_empty = bars_full + 8 * kStages;
    const u32 bar_c_full = bars_empty + 8 * kStages;     // c_full[kCTurns]
    const u32 bar_c_empty = bar_c_full + 8 * kCTurns;    // c_empty[kCTurns]
    const u32 bar_copy_full = bar_c_empty + 8 * kCTurns;  // hook 4: the copier's expect_tx

    // grouped: the group table is read only after the barrier below
    const Schedule sched = Schedule::of(p.gemm, GroupTable{smem + kOffGroups, p.group.groups});
    const RowChunks chunks = RowChunks::of(p.gemm);
    Epilogue epilogue = make_epilogue(p, chunks, (Epilogue*)nullptr);

    // Stage 1: barriers initialised (and the tensor maps prefetched) before anyone -- in this CTA or,
    // with a cluster, the peer CTA's TMA multicasts and stage releases -- waits on or arrives at them.
    // Broadcast from lane 0: the compiler then keeps the warpgroup (and what the consumers derive from it, the
    // wgmma descriptors of their A rows) in uniform registers instead of per-thread ones moved over per wgmma.
    const int warpgroup = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(bars_full + 8 * s, 1);               // the loader's arrive.expect_tx
            mbar_init(bars_empty + 8 * s, kStageReaders * kStageWriters);  // per reading consumer WG of the CTAs it writes
        }
        for (int k = 0; k < kCTurns; ++k) {
            mbar_init(bar_c_full + 8 * k, 128 * kConsumersPerTurn);  // every thread of the turn's consumers
            mbar_init(bar_c_empty + 8 * k, 1);                       // storer lane 0
        }
        if constexpr (kHookCopy) mbar_init(bar_copy_full, 1);
        fence_mbar_init();                                 // inits visible to TMA (async proxy)
        tma_prefetch_desc(&p.gemm.tmap_a);
        tma_prefetch_desc(&p.gemm.tmap_b);
        if constexpr (kHookCopy) tma_prefetch_desc(&p.copy.tmap_a_own);
        if constexpr ((!kHookEpilogue || kReduceEpilogue) && !kEpiDirect) tma_prefetch_desc(&p.gemm.tmap_c);
    }
    if constexpr (kGrouped) {   // warp 1 reads the offsets while thread 0 initialises the barriers
        if (threadIdx.x / 32 == 1)
            GroupTable::build(p.group, p.gemm.m, (p.gemm.n + kBN - 1) / kBN,
                              reinterpret_cast<int*>(smem_raw + pad + kOffGroups), (int)(threadIdx.x & 31));
    }
    if constexpr (kClusterCtas > 1) cluster_sync(); else __syncthreads();

    // Stage 2: the roles.
    if (warpgroup == 0) {
        if constexpr (kRebalanceRegs) regs_dealloc<kProducerRegs>();
        const int warp = threadIdx.x / 32;
        if (warp == 0) {
            if (threadIdx.x == 0) {
                Mainloop mainloop = make_mainloop(p, chunks, (Mainloop*)nullptr);
                if constexpr (kSplitK)
                    run_loader(sched, p.gemm.k, mainloop, &p.gemm.tmap_b, chunks, smem, bars_full, bars_empty,
                               KSlices::of(p.gemm, chunks));
                else if constexpr (kStreamK)
                    run_loader_stream_k(sched, StreamK::of(sched, p.gemm, p.stream_k, p.timeout), &p.gemm.tmap_a,
                                        &p.gemm.tmap_b, smem, bars_full, bars_empty);
                else
                    run_loader(sched, p.gemm.k, mainloop, &p.gemm.tmap_b, chunks, smem, bars_full, bars_empty);
            }
        } else if (warp == 1) {
            if constexpr (kPingPong)
                run_storer_pingpong(sched, epilogue, smem, bar_c_full, bar_c_empty);
            else if constexpr (kStreamK)
                run_storer_stream_k(sched, StreamK::of(sched, p.gemm, p.stream_k, p.timeout), epilogue, smem,
                                    bar_c_full, bar_c_empty);
            else if constexpr (!kEpiDirect)
                run_storer(sched, epilogue, smem, bar_c_full, bar_c_empty);
        } else if (warp == 2 && kHookCopy) {
            if (threadIdx.x == 64)
                run_copier(p.gemm.k, &p.gemm.tmap_a, OwnShard::of(p.copy), chunks, smem + kOffCopy, bar_copy_full);
        }
        // warp 3 of the producer warpgroup (and warp 2 without hook 4) has no role.
    } else {
        if constexpr (kRebalanceRegs) regs_alloc<kConsumerRegs>();
        const int wg = warpgroup - 1;
        const ConsumerSmem sm{smem, smem_raw + pad, bars_full, bars_empty, bar_c_full + 8 * c_turn_of(wg),
                              bar_c_empty + 8 * c_turn_of(wg)};
        if constexpr (kSplitK)
            run_consumer(sched, p.gemm.k, wg, sm, epilogue, make_scale(p, (Scale*)nullptr), KSlices::of(p.gemm, chunks));
        else if constexpr (kStreamK)
            run_consumer_stream_k(sched, StreamK::of(sched, p.gemm, p.stream_k, p.timeout), wg, sm, epilogue);
        else if constexpr (kPingPong)
            run_consumer_pingpong(sched, p.gemm.k, wg, sm, epilogue, make_scale(p, (Scale*)nullptr));
        else
            run_consumer(sched, p.gemm.k, wg, sm, epilogue, make_scale(p, (Scale*)nullptr));
    }
    // Stage 3: with a cluster, no CTA may exit while its peer can still multicast into its shared memory
    // or arrive on its barriers: every thread of both CTAs meets here once all work is done.
    if constexpr (kClusterCtas > 1) {
        __syncwarp();
        cluster_sync();
    }
}

// Host-visible configuration (read from the cubin by the CPU tests, and through
// cupy.RawModule.get_global to cross-check the planner).
extern "C" __device__ const unsigned int fluxrt_gemm_threads = kThreads;
extern "C" __device__ const unsigned int fluxrt_gemm_smem_bytes = kSmemBytes + kSmemAlign;
extern "C" __device__ const unsigned int fluxrt_gemm_block_m = kBM;
extern "C" __device__ const unsigned int fluxrt_gemm_block_n = kBN;
extern "C" __device__ const unsigned int fluxrt_gemm_block_k = kBK;
extern "C" __device__ const unsigned int fluxrt_gemm_params_bytes = sizeof(Params);
