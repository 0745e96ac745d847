// The activation of the tensor-parallel MLP block (fluxrt/ops/mlp.py) and of the MoE layer's experts
// (fluxrt/moe/layer.py): SiLU of the gate times the up projection, between the gate/up and down GEMMs.
//
//   fluxrt_silu_mul           out[r, j] = silu(h[r, j]) * h[r, f + j] for h [rows, 2 f], out [rows, f]
//   fluxrt_silu_mul_bounded   the same over rows [0, min(max_rows, *row_end)): a row count only the device
//                             knows (the MoE layer's received rows, the last of its grouped GEMM's offsets),
//                             so the launch needs no host sync; rows past it are not touched
//
// Compile-time configuration (-D, set by fluxrt/ops/mlp.py):
//   FLUXRT_MLP_DTYPE  element type of h and out: 0 bf16, 1 fp16       default 0
// f is a multiple of 8 (16-byte rows for the GEMMs' TMA), so each thread moves whole 16-byte vectors; the
// product is formed in fp32 and rounded once.
#include "fluxrt/types.cuh"

#ifndef FLUXRT_MLP_DTYPE
#define FLUXRT_MLP_DTYPE 0
#endif

using fluxrt::u32;
using fluxrt::u64;

namespace {
typedef fluxrt::ElementOf<FLUXRT_MLP_DTYPE>::type E;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ void silu_mul_rows(const uint4* __restrict__ h, uint4* __restrict__ out, u64 rows,
                                              u64 f_vecs) {
    const u64 total = rows * f_vecs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / f_vecs, j = i - r * f_vecs;
        const uint4 g = h[r * 2 * f_vecs + j];
        const uint4 u = h[r * 2 * f_vecs + f_vecs + j];
        const u32 gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            o[k] = E::pack2(silu(E::lo(gw[k])) * E::lo(uw[k]), silu(E::hi(gw[k])) * E::hi(uw[k]));
        out[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) fluxrt_silu_mul(const uint4* __restrict__ h,
                                                                  uint4* __restrict__ out, u64 rows,
                                                                  u64 f_vecs) {
    silu_mul_rows(h, out, rows, f_vecs);
}

extern "C" __global__ void __launch_bounds__(256) fluxrt_silu_mul_bounded(const uint4* __restrict__ h,
                                                                          uint4* __restrict__ out, u64 max_rows,
                                                                          u64 f_vecs, const int* row_end) {
    const int end = *row_end;
    silu_mul_rows(h, out, end <= 0 ? 0 : ((u64)end < max_rows ? (u64)end : max_rows), f_vecs);
}
