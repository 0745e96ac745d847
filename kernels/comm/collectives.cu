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
// Element types and ops: the base module holds bf16, fp16 and fp32 with sum, max and min; built with
// -DFLUXRT_COLL_EXT=<code> the same file holds one more element type's reductions instead (prod and the avg
// division for the three, every op for fp64 and the integers), compiled only when a program reduces it.
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

#define FLUXRT_REDUCTIONS_ANY(NAME, E, OP)                                                                \
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

// LL12 lines carry 12 bytes: whole elements of at most 4 bytes only.
#define FLUXRT_REDUCTIONS_LL12(NAME, E, OP)                                                             \
    extern "C" __global__ void fluxrt_allreduce_ll12_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x,        \
                                                              E::T* out, u64 count, u64 slot_bytes) {   \
        allreduce_ll12<E, OP>(FLUXRT_TEAM, x, out, count, slot_bytes);                                  \
    }                                                                                                   \
    extern "C" __global__ void fluxrt_allreduce_ll12_twoshot_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, \
                                                                      E::T* out, u64 count,            \
                                                                      u64 slot_bytes) {                \
        allreduce_ll12_twoshot<E, OP>(FLUXRT_TEAM, x, out, count, slot_bytes);                          \
    }

#define FLUXRT_REDUCTIONS(NAME, E, OP) FLUXRT_REDUCTIONS_ANY(NAME, E, OP) FLUXRT_REDUCTIONS_LL12(NAME, E, OP)

#ifndef FLUXRT_COLL_EXT
FLUXRT_BASE_REDUCTIONS(FLUXRT_REDUCTIONS)

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

#else  // FLUXRT_COLL_EXT: the reductions the base module leaves out, one element type per module, compiled
       // when a program first reduces that type (fluxrt/collectives.py EXT_CODES), so that programs on
       // bf16/fp16/fp32 sums compile and load only the base module.
using fluxrt::F64;
using fluxrt::I32;
using fluxrt::I64;
using fluxrt::U8;
using fluxrt::kProd;

// avg = sum / n, rounded once from E::Acc (the sum itself is the deterministic one above).
template <class E>
__device__ __forceinline__ void divide_by_ranks(typename E::T* out, u64 count, u32 n) {
    const typename E::Acc d = (typename E::Acc)n;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
        out[i] = E::from_f(E::to_f(out[i]) / d);
}
#define FLUXRT_AVG(NAME, E)                                                                              \
    extern "C" __global__ void fluxrt_divide_##NAME(E::T* out, u64 count, u32 n) { divide_by_ranks<E>(out, count, n); }

#if FLUXRT_COLL_EXT == 0
FLUXRT_REDUCTIONS(bf16_prod, BF16, kProd)
FLUXRT_AVG(bf16, BF16)
#elif FLUXRT_COLL_EXT == 1
FLUXRT_REDUCTIONS(fp16_prod, F16, kProd)
FLUXRT_AVG(fp16, F16)
#elif FLUXRT_COLL_EXT == 2
FLUXRT_REDUCTIONS(fp32_prod, F32, kProd)
FLUXRT_AVG(fp32, F32)
#elif FLUXRT_COLL_EXT == 3  // 8-byte elements: no LL12 round
FLUXRT_REDUCTIONS_ANY(fp64_sum, F64, kSum)
FLUXRT_REDUCTIONS_ANY(fp64_prod, F64, kProd)
FLUXRT_REDUCTIONS_ANY(fp64_max, F64, kMax)
FLUXRT_REDUCTIONS_ANY(fp64_min, F64, kMin)
FLUXRT_AVG(fp64, F64)
#elif FLUXRT_COLL_EXT == 4
FLUXRT_REDUCTIONS(int32_sum, I32, kSum)
FLUXRT_REDUCTIONS(int32_prod, I32, kProd)
FLUXRT_REDUCTIONS(int32_max, I32, kMax)
FLUXRT_REDUCTIONS(int32_min, I32, kMin)
#elif FLUXRT_COLL_EXT == 5
FLUXRT_REDUCTIONS_ANY(int64_sum, I64, kSum)
FLUXRT_REDUCTIONS_ANY(int64_prod, I64, kProd)
FLUXRT_REDUCTIONS_ANY(int64_max, I64, kMax)
FLUXRT_REDUCTIONS_ANY(int64_min, I64, kMin)
#elif FLUXRT_COLL_EXT == 6
FLUXRT_REDUCTIONS(uint8_sum, U8, kSum)
FLUXRT_REDUCTIONS(uint8_prod, U8, kProd)
FLUXRT_REDUCTIONS(uint8_max, U8, kMax)
FLUXRT_REDUCTIONS(uint8_min, U8, kMin)
#else
#error "FLUXRT_COLL_EXT: 0 bf16, 1 fp16, 2 fp32 (prod and avg), 3 fp64, 4 int32, 5 int64, 6 uint8"
#endif
#endif  // FLUXRT_COLL_EXT
