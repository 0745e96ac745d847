// Block-scaled 8-bit formats of the device library: FP8 e4m3 and INT8 with one fp32 scale per group of
// elements (a token's row, or 128 consecutive elements), for the fused norm's FP8 output and the
// compressed collectives. A group's scale is amax / kMax; a value is stored as round(v / scale) and read
// back as q * scale. Everything is a pure function of the group's values, so every rank that quantizes
// the same values gets the same bytes.
//
//   Fp8E4M3, Int8    one 8-bit code from fp32 (encode4: four at once, packed in a u32), and back (decode4)
//   warp_max(v)      max over the 32 lanes (a fixed butterfly: the same on every rank)
//   block_sum, block_max   over a whole block (lanes, then warps in warp order), result in every thread
#pragma once

#include "fluxrt/types.cuh"

namespace fluxrt {

struct Fp8E4M3 {
    static constexpr float kMax = 448.f;  // largest finite e4m3 value
    // Four values (already divided by the scale) to four e4m3 codes, v[0] in the lowest byte. satfinite:
    // a value past 448 (rounding of v / scale at the top of the range) becomes 448, never NaN.
    static __device__ __forceinline__ u32 encode4(const float (&v)[4]) {
        unsigned short lo, hi;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1]), "f"(v[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3]), "f"(v[2]));
        return (u32)lo | ((u32)hi << 16);
    }
    static __device__ __forceinline__ void decode4(u32 w, float (&v)[4]) {
        u32 h01, h23;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h01) : "h"((unsigned short)(w & 0xFFFFu)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h23) : "h"((unsigned short)(w >> 16)));
        v[0] = f16_to_f32((unsigned short)(h01 & 0xFFFFu));
        v[1] = f16_to_f32((unsigned short)(h01 >> 16));
        v[2] = f16_to_f32((unsigned short)(h23 & 0xFFFFu));
        v[3] = f16_to_f32((unsigned short)(h23 >> 16));
    }
};

struct Int8 {
    static constexpr float kMax = 127.f;  // symmetric: -128 is never produced
    static __device__ __forceinline__ u32 encode4(const float (&v)[4]) {
        u32 w = 0;
#pragma unroll
        for (u32 k = 0; k < 4; ++k) {
            int q = __float2int_rn(v[k]);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            w |= ((u32)q & 0xFFu) << (8 * k);
        }
        return w;
    }
    static __device__ __forceinline__ void decode4(u32 w, float (&v)[4]) {
#pragma unroll
        for (u32 k = 0; k < 4; ++k) v[k] = (float)(int)(signed char)((w >> (8 * k)) & 0xFFu);
    }
};

// Quantization of one group: scale = amax / kMax (0 for an all-zero group: its codes are all 0).
template <class Q>
__device__ __forceinline__ float group_scale(float amax) { return amax / Q::kMax; }

// Four values to codes with a group's scale (division, so that q * scale reproduces v as closely as
// the format allows; a zero scale gives zero codes).
template <class Q>
__device__ __forceinline__ u32 quantize4(const float (&v)[4], float scale) {
    float s[4];
#pragma unroll
    for (u32 k = 0; k < 4; ++k) s[k] = scale > 0.f ? v[k] / scale : 0.f;
    return Q::encode4(s);
}

template <class Q>
__device__ __forceinline__ void dequantize4(u32 w, float scale, float (&v)[4]) {
    Q::decode4(w, v);
#pragma unroll
    for (u32 k = 0; k < 4; ++k) v[k] *= scale;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Over the whole block (blockDim.x a multiple of 32, at most 1024): each warp's butterfly, then the warps'
// results in warp order, so the result depends only on the values and blockDim (bitwise the same on
// every rank). Every thread gets it; `scratch` holds 32 floats of shared memory, free again on return.
template <bool kMaxOp>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    v = kMaxOp ? warp_max(v) : warp_sum(v);
    const u32 warp = threadIdx.x / 32, warps = blockDim.x / 32;
    __syncthreads();  // scratch may still be read by the previous call
    if ((threadIdx.x & 31u) == 0) scratch[warp] = v;
    __syncthreads();
    float r = scratch[0];
    for (u32 w = 1; w < warps; ++w) r = kMaxOp ? fmaxf(r, scratch[w]) : r + scratch[w];
    return r;
}
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }

}  // namespace fluxrt
