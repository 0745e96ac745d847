// Collectives with fused epilogues and compressed payloads (fluxrt/fused.py, fluxrt/compressed.py): the
// extern "C" entry points. Team parameters as in collectives.cu (one context, one epoch counter).
//
//   fluxrt_allreduce_norm_{ll,twoshot}_{bf16,fp16}              algorithms/allreduce_norm.cuh
//   fluxrt_add_rmsnorm_{bf16,fp16} (the unfused norm, a baseline) algorithms/allreduce_norm.cuh
//   fluxrt_compressed_{reduce_scatter,allreduce,allgather}_{fp8,int8}_{bf16,fp16,fp32}
//                                                               algorithms/compressed.cuh
#include "../comm/algorithms/allreduce_norm.cuh"
#include "../comm/algorithms/compressed.cuh"

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;
using namespace fluxrt::coll;
using fluxrt::BF16;
using fluxrt::F16;
using fluxrt::F32;
using fluxrt::Fp8E4M3;
using fluxrt::Int8;

#define FLUXRT_NORM_IO                                                                                  \
    NormIO { x, residual, weight, out, residual_out, scales, rows, cols, eps, quant }
#define FLUXRT_NORM_PARAMS                                                                              \
    const char *x, const char *residual, const char *weight, char *out, char *residual_out, float *scales, \
        u32 rows, u32 cols, float eps, u32 quant

#define FLUXRT_ALLREDUCE_NORM(NAME, E)                                                                  \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_allreduce_norm_ll_##NAME(FLUXRT_TEAM_PARAMS, FLUXRT_NORM_PARAMS, u64 slot_bytes) {      \
        allreduce_norm_ll<E>(FLUXRT_TEAM, FLUXRT_NORM_IO, slot_bytes);                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_allreduce_norm_twoshot_##NAME(FLUXRT_TEAM_PARAMS, FLUXRT_NORM_PARAMS, u64 chunk_rows,   \
                                             u64 row_pitch, u64 slot_bytes) {                           \
        allreduce_norm_twoshot<E>(FLUXRT_TEAM, FLUXRT_NORM_IO, chunk_rows, row_pitch, slot_bytes);      \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_add_rmsnorm_##NAME(FLUXRT_NORM_PARAMS) {                                                 \
        add_rmsnorm<E>(FLUXRT_NORM_IO);                                                                 \
    }

FLUXRT_ALLREDUCE_NORM(bf16, BF16)
FLUXRT_ALLREDUCE_NORM(fp16, F16)

#define FLUXRT_COMPRESSED_MODE(OPNAME, MODE, FMT, Q, NAME, E)                                           \
    extern "C" __global__ void __launch_bounds__(kBulkThreads, kBulkBlocksPerSM)                        \
        fluxrt_compressed_##OPNAME##_##FMT##_##NAME(FLUXRT_TEAM_PARAMS, const E::T* x, u64 x_stride,      \
                                                    E::T* out, u64 out_stride, float* ef, u64 count,     \
                                                    u64 chunk, u64 slot_bytes) {                         \
        compressed_round<E, Q, MODE>(FLUXRT_TEAM, x, x_stride, out, out_stride, ef, count, chunk,       \
                                     slot_bytes);                                                       \
    }
#define FLUXRT_COMPRESSED(FMT, Q, NAME, E)                                                              \
    FLUXRT_COMPRESSED_MODE(reduce_scatter, kCompressedReduceScatter, FMT, Q, NAME, E)                   \
    FLUXRT_COMPRESSED_MODE(allreduce, kCompressedAllreduce, FMT, Q, NAME, E)                            \
    FLUXRT_COMPRESSED_MODE(allgather, kCompressedAllgather, FMT, Q, NAME, E)

FLUXRT_COMPRESSED(fp8, Fp8E4M3, bf16, BF16)
FLUXRT_COMPRESSED(fp8, Fp8E4M3, fp16, F16)
FLUXRT_COMPRESSED(fp8, Fp8E4M3, fp32, F32)
FLUXRT_COMPRESSED(int8, Int8, bf16, BF16)
FLUXRT_COMPRESSED(int8, Int8, fp16, F16)
FLUXRT_COMPRESSED(int8, Int8, fp32, F32)
