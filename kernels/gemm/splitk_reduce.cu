// Split-K fixup: C = sum over splits of the fp32 partials the GEMM stored, in split order 0, 1, ... (the
// same bits on every call and every GPU), rounded once into C's type.
//
//   FLUXRT_SPLITK_OUT   C's element type: 0 bf16, 1 fp16, 2 fp32 (fluxrt/gemm/kernel.py OUT_IDS)
//
// partials: [splits][M * N] fp32, planes `plane` floats apart; C: [M * N] row-major. M * N is a multiple
// of 4 (rows are 16-byte multiples), so each thread takes 4 consecutive elements per step.
#include <fluxrt/types.cuh>

#ifndef FLUXRT_SPLITK_OUT
#define FLUXRT_SPLITK_OUT 0
#endif

using fluxrt::u32;

template <int kOut> struct Store4;
template <> struct Store4<2> {
    static __device__ __forceinline__ void at(void* c, long long i, float4 v) { reinterpret_cast<float4*>(c)[i] = v; }
};
template <int kOut> struct Store4 {
    typedef typename fluxrt::ElementOf<kOut>::type E;
    static __device__ __forceinline__ void at(void* c, long long i, float4 v) {
        reinterpret_cast<uint2*>(c)[i] = make_uint2(E::pack2(v.x, v.y), E::pack2(v.z, v.w));
    }
};

extern "C" __global__ void __launch_bounds__(256) fluxrt_splitk_reduce(const float4* __restrict__ partials,
                                                                         void* __restrict__ c, long long vecs,
                                                                         long long plane_vecs, int splits) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < vecs; i += (long long)gridDim.x * blockDim.x) {
        float4 acc = __ldcs(partials + i);   // read once: streaming, keep L2 for the GEMM's operands
        for (int s = 1; s < splits; ++s) {
            const float4 v = __ldcs(partials + s * plane_vecs + i);
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        Store4<FLUXRT_SPLITK_OUT>::at(c, i, acc);
    }
}
