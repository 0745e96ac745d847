// Collectives over NVLink peer pointers, staged through a symmetric workspace (fluxrt/collectives.py):
// the extern "C" entry points. An algorithm is a (scheme, collective) pair:
//
//   scheme      collective       entry point                           device code
//   staged      allreduce        fluxrt_allreduce_{oneshot,twoshot}_*  algorithms/allreduce.cuh
//   staged      reduce-scatter   fluxrt_reduce_scatter_*               algorithms/reduce_scatter.cuh
//   staged      exchange         fluxrt_exchange (push, direct)        algorithms/exchange.cuh
//   ll          allreduce        fluxrt_allreduce_ll_*                 algorithms/reduce_scatter.cuh
//   ll          reduce-scatter   fluxrt_reduce_scatter_ll_*            algorithms/reduce_scatter.cuh
//   ll          exchange         fluxrt_exchange_ll                    algorithms/exchange.cuh
//   ll12        allreduce        fluxrt_allreduce_ll12{,_twoshot}_*    algorithms/allreduce.cuh
//   pipelined   allreduce        fluxrt_allreduce_pipe_*               algorithms/reduce_scatter.cuh
//   pipelined   reduce-scatter   fluxrt_reduce_scatter_pipe_*          algorithms/reduce_scatter.cuh
//   pipelined   exchange         fluxrt_exchange_pipe (pipe, pairwise) algorithms/exchange.cuh
//   ring        allreduce        fluxrt_allreduce_ring_*               schemes/ring.cuh
//   ring        reduce-scatter   fluxrt_reduce_scatter_ring_*          schemes/ring.cuh
//   ring        allgather        fluxrt_allgather_ring                 schemes/ring.cuh
//
// Transfer schemes (kernels/comm/schemes): staged.cuh, ll.cuh, pipelined.cuh, ring.cuh, on the device
// library (kernels/include/fluxrt) and team.cuh (team, epochs, workspace halves).
#include "../comm/algorithms/allreduce.cuh"
#include "../comm/algorithms/reduce_scatter.cuh"
#include "../comm/algorithms/exchange.cuh"
#include "../comm/schemes/ring.cuh"

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;
using namespace fluxrt::coll;
using fluxrt::BF16;
using fluxrt::F16;
using fluxrt::F32;
using fluxrt::Bytes;
using fluxrt::kSum;
using fluxrt::kMax;
using fluxrt::kMin;

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
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_allreduce_pipe_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 count, u64 chunk,  \
                                     u64 slot_bytes, u64 step, u32 depth) {                              \
        reduce_pipe<E, OP>(FLUXRT_TEAM, x, 0, out, count, chunk, slot_bytes, step, depth, true);        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_allreduce_ring_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 count, u64 chunk,  \
                                     u64 step, u32 depth, u32 substeps) {                                \
        reduce_ring<E, OP>(FLUXRT_TEAM, x, chunk, out, chunk, count, chunk, step, depth, substeps, 0,    \
                           2 * world - 2);                                                              \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_reduce_scatter_ring_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, E::T* out, u64 chunk,        \
                                          u64 step, u32 depth, u32 substeps) {                           \
        reduce_ring<E, OP>(FLUXRT_TEAM, x, chunk, out, 0, world * chunk, chunk, step, depth, substeps, 0, \
                           world - 1);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
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
extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)
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
