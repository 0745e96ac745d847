// Compressed collectives (fluxrt/compressed.py): the payload crosses NVLink as 8-bit codes (FP8 e4m3 or
// INT8) with one fp32 scale per 128 elements (fluxrt/quant.cuh); owners accumulate in fp32 in rank order,
// so every rank gets bitwise the same result. Staged scheme (staged.cuh), one launch per piece:
//
//   reduce_scatter  stage push     chunk q of x (+ the error-feedback buffer) quantized into peer q's
//                                  slot [rank]; the quantization error goes back to the buffer
//                   stage reduce   the n slots of this rank's chunk dequantized and summed in rank order
//   allreduce       the same, then stage forward: the reduced chunk quantized again into every rank's
//                   area-2 slot [rank] (this rank's too), and stage gather: every rank dequantizes every
//                   chunk from area 2, so the owner's copy is the same bits as everyone else's
//   allgather       stage push: x quantized once into every rank's slot [rank]; stage gather as above
//
// A slot holds a chunk's groups: the codes (128 bytes a group), then the scales (a float a group). A warp
// takes one group at a time (lane l: elements 4l .. 4l + 3); block b takes groups [lo, hi) of every
// chunk in every stage. Elements past a chunk's length are quantized as zeros and never stored.
#pragma once

#include "../comm/schemes/staged.cuh"
#include "fluxrt/quant.cuh"

namespace fluxrt {
namespace coll {

constexpr u32 kQGroup = 128;  // elements per scale
enum CompressedMode : int { kCompressedReduceScatter = 0, kCompressedAllreduce = 1, kCompressedAllgather = 2 };

// Four elements [at, at + 4) of src (length len) as fp32, zeros past len.
template <class E>
__device__ __forceinline__ void load4(const typename E::T* src, u64 len, u64 at, float (&v)[4]) {
    typedef typename E::T T;
    if (at + 4 <= len && (reinterpret_cast<u64>(src + at) & (4 * sizeof(T) - 1)) == 0) {
        if constexpr (sizeof(T) == 2) {
            const uint2 w = *reinterpret_cast<const uint2*>(src + at);
            v[0] = E::lo(w.x), v[1] = E::hi(w.x), v[2] = E::lo(w.y), v[3] = E::hi(w.y);
        } else {
            const float4 w = *reinterpret_cast<const float4*>(src + at);
            v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        }
        return;
    }
#pragma unroll
    for (u32 k = 0; k < 4; ++k) v[k] = at + k < len ? E::to_f(src[at + k]) : 0.f;
}

template <class E>
__device__ __forceinline__ void store4(typename E::T* dst, u64 len, u64 at, const float (&v)[4]) {
    typedef typename E::T T;
    if (at + 4 <= len && (reinterpret_cast<u64>(dst + at) & (4 * sizeof(T) - 1)) == 0) {
        if constexpr (sizeof(T) == 2) {
            *reinterpret_cast<uint2*>(dst + at) = make_uint2(E::pack2(v[0], v[1]), E::pack2(v[2], v[3]));
        } else {
            *reinterpret_cast<float4*>(dst + at) = make_float4(v[0], v[1], v[2], v[3]);
        }
        return;
    }
#pragma unroll
    for (u32 k = 0; k < 4; ++k)
        if (at + k < len) dst[at + k] = E::from_f(v[k]);
}

__device__ __forceinline__ void load4_f32(const float* src, u64 len, u64 at, float (&v)[4]) {
    load4<F32>(src, len, at, v);
}
__device__ __forceinline__ void store4_f32(float* dst, u64 len, u64 at, const float (&v)[4]) {
    store4<F32>(dst, len, at, v);
}

// Group k of a slot of `groups` groups.
__device__ __forceinline__ u32* group_codes(char* slot, u64 k) { return reinterpret_cast<u32*>(slot + k * kQGroup); }
__device__ __forceinline__ float* group_scale_at(char* slot, u64 groups, u64 k) {
    return reinterpret_cast<float*>(slot + groups * kQGroup) + k;
}

// The warp quantizes its lane's four values v of group k (one scale for the group) into every slot that
// dst(q) names for q in `to` (a bit mask); returns the lane's dequantized values in v.
template <class Q, class Dst>
__device__ __forceinline__ void put_group(float (&v)[4], u64 groups, u64 k, u32 to, u32 world, Dst dst) {
    const u32 lane = threadIdx.x & 31u;
    float amax = 0.f;
#pragma unroll
    for (u32 i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(v[i]));
    const float scale = group_scale<Q>(warp_max(amax));
    const u32 w = quantize4<Q>(v, scale);
    for (u32 q = 0; q < world; ++q) {
        if (!((to >> q) & 1u)) continue;
        char* slot = dst(q);
        group_codes(slot, k)[lane] = w;
        if (lane == 0) *group_scale_at(slot, groups, k) = scale;
    }
    dequantize4<Q>(w, scale, v);
}

// The lane's four dequantized values of group k of a slot (pushed data: loads bypass L1).
template <class Q>
__device__ __forceinline__ void get_group(const char* slot, u64 groups, u64 k, float (&v)[4]) {
    const u32 w = __ldcv(reinterpret_cast<const u32*>(slot + k * kQGroup) + (threadIdx.x & 31u));
    const float scale = __ldcv(reinterpret_cast<const float*>(slot + groups * kQGroup) + k);
    dequantize4<Q>(w, scale, v);
}

// One round. Chunk q has len(q) = clamp(count - q * chunk, 0, chunk) elements (reduce_scatter and
// allgather: every chunk is whole). Sources: reduce_scatter / allreduce chunk q at x + q * x_stride (and
// ef + q * x_stride); allgather x (and ef). Outputs: reduce_scatter out (this rank's chunk); allreduce and
// allgather chunk p at out + p * out_stride. ef (fp32, may be null): error feedback of the first
// quantization, ef = (x + ef) - dequantized. Grid <= kMaxBlocks; blockDim a multiple of 32.
template <class E, class Q, int kMode>
__device__ void compressed_round(Team t, const typename E::T* x, u64 x_stride, typename E::T* out, u64 out_stride,
                                 float* ef, u64 count, u64 chunk, u64 slot_bytes) {
    const u64 groups = (chunk + kQGroup - 1) / kQGroup;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    auto len = [&](u32 q) {
        const u64 at = (u64)q * chunk;
        return at < count ? (count - at < chunk ? count - at : chunk) : 0ull;
    };
    const u64 e = begin_round(t.epoch);                                                  // stage begin
    const u64 base = half_offset(t, e), area2 = base + (u64)t.world * slot_bytes;
    u64 lo, hi;
    block_range(groups, 1, &lo, &hi);
    auto area_slot = [&](u32 q, u64 area, u32 src) { return t.peer_ws(q) + area + (u64)src * slot_bytes; };
    // stage push
    for (u64 k = lo + warp; k < hi; k += warps) {
        const u64 at = k * kQGroup + 4 * lane;
        if (kMode == kCompressedAllgather) {
            float v[4], err[4];
            load4<E>(x, chunk, at, v);
            if (ef) {
                load4_f32(ef, chunk, at, err);
#pragma unroll
                for (u32 i = 0; i < 4; ++i) v[i] += err[i];
                err[0] = v[0], err[1] = v[1], err[2] = v[2], err[3] = v[3];
            }
            put_group<Q>(v, groups, k, t.everyone(), t.world, [&](u32 q) { return area_slot(q, base, t.rank); });
            if (ef) {
#pragma unroll
                for (u32 i = 0; i < 4; ++i) err[i] -= v[i];
                store4_f32(ef, chunk, at, err);
            }
            continue;
        }
        for (u32 s = 0; s < t.world; ++s) {
            const u32 q = (t.rank + 1 + s) % t.world;
            float v[4], err[4];
            load4<E>(x + (u64)q * x_stride, len(q), at, v);
            if (ef) {
                load4_f32(ef + (u64)q * x_stride, len(q), at, err);
#pragma unroll
                for (u32 i = 0; i < 4; ++i) v[i] += err[i];
                err[0] = v[0], err[1] = v[1], err[2] = v[2], err[3] = v[3];
            }
            put_group<Q>(v, groups, k, 1u << q, t.world, [&](u32 p) { return area_slot(p, base, t.rank); });
            if (ef) {
#pragma unroll
                for (u32 i = 0; i < 4; ++i) err[i] -= v[i];
                store4_f32(ef + (u64)q * x_stride, len(q), at, err);
            }
        }
    }
    staged_signal(t, 0, e);
    if (!staged_wait(t, 0, e)) return;
    if (kMode != kCompressedAllgather) {
        for (u64 k = lo + warp; k < hi; k += warps) {                                    // stage reduce
            const u64 at = k * kQGroup + 4 * lane;
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            for (u32 p = 0; p < t.world; ++p) {
                float v[4];
                get_group<Q>(t.ws + base + (u64)p * slot_bytes, groups, k, v);
#pragma unroll
                for (u32 i = 0; i < 4; ++i) acc[i] = p == 0 ? v[i] : acc[i] + v[i];
            }
            if (kMode == kCompressedReduceScatter) {
                store4<E>(out, len(t.rank), at, acc);
            } else {                                                                     // stage forward
                put_group<Q>(acc, groups, k, t.everyone(), t.world, [&](u32 q) { return area_slot(q, area2, t.rank); });
            }
        }
        if (kMode == kCompressedReduceScatter) return;
        staged_signal(t, 1, e);
        if (!staged_wait(t, 1, e)) return;
    }
    const u64 from = kMode == kCompressedAllgather ? base : area2;
    for (u32 p = 0; p < t.world; ++p)                                                    // stage gather
        for (u64 k = lo + warp; k < hi; k += warps) {
            float v[4];
            get_group<Q>(t.ws + from + (u64)p * slot_bytes, groups, k, v);
            store4<E>(out + (u64)p * out_stride, kMode == kCompressedAllgather ? chunk : len(p), k * kQGroup + 4 * lane, v);
        }
}

}  // namespace coll
}  // namespace fluxrt
