// Element types of the device library: integer aliases, the team-size bound, and the 16-bit float
// conversions every reduction uses (collectives, GEMM+ReduceScatter's reduce kernel, the GEMM's reduce
// hooks). Compiled with NVRTC (no standard library): builtin types and PTX cvt only.
//
//   E::T          storage type of one element
//   E::kPerVec    elements per 16-byte vector
//   E::Acc        type a reduction accumulates in: fp32 for the 16- and 32-bit floats, the element's own
//                 type for fp64 and the integers (uint8: 32 bits, truncated back; sums and products wrap)
//   E::to_f(x)    one element -> E::Acc;  E::from_f(f)  E::Acc -> one element (floats: round to nearest
//                 even)
//   E::lo(w), E::hi(w), E::pack2(lo, hi)   (16-bit types) element 0 / 1 of a packed 32-bit pair, and
//                 two fp32 values rounded into one pair (one cvt for both)
#pragma once

namespace fluxrt {

typedef unsigned long long u64;
typedef unsigned int u32;

// Ranks one team describes (one NVLink domain): peer sets are u32 bit masks, exchange tables have this
// many rows (fluxrt/collectives_plan.py MAX_WORLD).
constexpr u32 kMaxWorld = 32;

__device__ __forceinline__ float bf16_to_f32(unsigned short v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ float f16_to_f32(unsigned short v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}

struct F32 {
    typedef float Acc;
    typedef float T;
    static constexpr u32 kPerVec = 4;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};

struct F16 {
    typedef float Acc;
    typedef unsigned short T;
    static constexpr u32 kPerVec = 8;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(unsigned short v) { return f16_to_f32(v); }
    static __device__ __forceinline__ unsigned short from_f(float f) {
        unsigned short v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
        return v;
    }
    static __device__ __forceinline__ float lo(u32 w) { return f16_to_f32((unsigned short)(w & 0xFFFFu)); }
    static __device__ __forceinline__ float hi(u32 w) { return f16_to_f32((unsigned short)(w >> 16)); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

struct BF16 {
    typedef float Acc;
    typedef unsigned short T;
    static constexpr u32 kPerVec = 8;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ float to_f(unsigned short v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ unsigned short from_f(float f) {
        unsigned short v;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
        return v;
    }
    static __device__ __forceinline__ float lo(u32 w) { return bf16_to_f32((unsigned short)(w & 0xFFFFu)); }
    static __device__ __forceinline__ float hi(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// Element types that only the collectives' reductions use (the GEMM and the fused ops stay on the float
// types above). They accumulate in their own type, so fp64 keeps every bit and integer sums and products
// wrap as two's complement, as NCCL's do.
struct F64 {
    typedef double T;
    typedef double Acc;
    static constexpr u32 kPerVec = 2;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ double to_f(double v) { return v; }
    static __device__ __forceinline__ double from_f(double v) { return v; }
};

struct I32 {
    typedef int T;
    typedef int Acc;
    static constexpr u32 kPerVec = 4;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ int to_f(int v) { return v; }
    static __device__ __forceinline__ int from_f(int v) { return v; }
};

struct I64 {
    typedef long long T;
    typedef long long Acc;
    static constexpr u32 kPerVec = 2;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ long long to_f(long long v) { return v; }
    static __device__ __forceinline__ long long from_f(long long v) { return v; }
};

struct U8 {
    typedef unsigned char T;
    typedef u32 Acc;  // the low 8 bits of a 32-bit sum or product are those of the 8-bit one
    static constexpr u32 kPerVec = 16;
    static constexpr bool kArithmetic = true;
    static __device__ __forceinline__ u32 to_f(unsigned char v) { return v; }
    static __device__ __forceinline__ unsigned char from_f(u32 v) { return (unsigned char)v; }
};

// Raw bytes, for rounds that only ever copy (one source per stage); no arithmetic.
struct Bytes {
    typedef unsigned char T;
    static constexpr bool kArithmetic = false;
};

// Element type by the host's code (fluxrt/ops: 0 bf16, 1 fp16, 2 fp32), for -D configured kernels.
template <int kCode> struct ElementOf;
template <> struct ElementOf<0> { typedef BF16 type; };
template <> struct ElementOf<1> { typedef F16 type; };
template <> struct ElementOf<2> { typedef F32 type; };

}  // namespace fluxrt
