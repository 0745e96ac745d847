// Deterministic reduction of partials: sources combined in fixed order 0, 1, ..., n - 1 in E::Acc (fp32 for
// the 16- and 32-bit floats, fp64 for fp64, wrapping integers for the integers), so every rank (and every
// run) computes bitwise the same value whatever order the partials arrived in.
// Used by the collectives' reductions, GEMM+ReduceScatter's reduce kernel and the GEMM's reduce hooks.
//
//   fold<E, OP>(acc, el, first)          acc[k] (op)= element k of a packed group (first: acc[k] = x)
//   fold_sources<E, OP, kFirst, kVecs, kSrcBatch[, kOpts]>(acc, n, load)
//                                        acc[j] (op)= 16-byte vector j of every source, in source order;
//                                        kSrcBatch sources x kVecs vectors of loads in flight together
//                                        (kFirst: source 0 starts the accumulation; n >= 1)
//   fold_vec_weighted<E>(acc, raw, w)    acc[k] = fma(w, element k, acc[k]) (weighted sums in caller's order)
//   pack<E>(acc, el)                     E::Acc -> elements, one cvt each (floats);  E::pack2 rounds a pair at once
//   reduce_block<E, OP>(n, nvec, src, store)   the block's strided loop over vectors of n sources
//   reduce_elem<E, OP>(n, at)            one element of n sources (tails, misaligned data)
#pragma once

#include "fluxrt/types.cuh"

namespace fluxrt {

enum ReduceOp { kSum = 0, kMax = 1, kMin = 2, kProd = 3 };

// The base reductions every reducing collective instantiates (16- and 32-bit floats x sum, max, min), as an
// X-macro: X(name, element type, op). Other element types and prod live in per-type extension modules.
#define FLUXRT_BASE_REDUCTIONS(X)                                                                       \
    X(bf16_sum, ::fluxrt::BF16, ::fluxrt::kSum)                                                          \
    X(bf16_max, ::fluxrt::BF16, ::fluxrt::kMax)                                                          \
    X(bf16_min, ::fluxrt::BF16, ::fluxrt::kMin)                                                          \
    X(fp16_sum, ::fluxrt::F16, ::fluxrt::kSum)                                                           \
    X(fp16_max, ::fluxrt::F16, ::fluxrt::kMax)                                                           \
    X(fp16_min, ::fluxrt::F16, ::fluxrt::kMin)                                                           \
    X(fp32_sum, ::fluxrt::F32, ::fluxrt::kSum)                                                           \
    X(fp32_max, ::fluxrt::F32, ::fluxrt::kMax)                                                           \
    X(fp32_min, ::fluxrt::F32, ::fluxrt::kMin)

// Vectors a thread reduces at a time in reduce_block (their loads of one source in flight together; the
// measured gain over 1 is in docs/tuning.md).
constexpr u32 kReduceUnroll = 4;
// Types of more than 8 elements a vector (uint8: 16 accumulators a vector) take half as many, so that a
// 512-thread block's registers still fit (4 x 16 accumulators took the staged uint8 rounds past 128).
template <class E>
constexpr u32 kReduceUnrollOf = E::kPerVec > 8 ? kReduceUnroll / 2 : kReduceUnroll;

template <int OP>
__device__ __forceinline__ float combine(float a, float b) {
    if (OP == kSum) return a + b;
    if (OP == kProd) return a * b;
    if (OP == kMax) return fmaxf(a, b);
    return fminf(a, b);
}

template <int OP>
__device__ __forceinline__ double combine(double a, double b) {
    if (OP == kSum) return a + b;
    if (OP == kProd) return a * b;
    if (OP == kMax) return fmax(a, b);
    return fmin(a, b);
}

// Integers: sums and products in the unsigned type of the same width, which wraps (signed overflow is
// undefined in C++), as NCCL's integer reductions do.
template <int OP, class I, class U>
__device__ __forceinline__ I combine_int(I a, I b) {
    if (OP == kSum) return (I)((U)a + (U)b);
    if (OP == kProd) return (I)((U)a * (U)b);
    if (OP == kMax) return a > b ? a : b;
    return a < b ? a : b;
}
template <int OP>
__device__ __forceinline__ int combine(int a, int b) { return combine_int<OP, int, u32>(a, b); }
template <int OP>
__device__ __forceinline__ long long combine(long long a, long long b) { return combine_int<OP, long long, u64>(a, b); }
template <int OP>
__device__ __forceinline__ u32 combine(u32 a, u32 b) { return combine_int<OP, u32, u32>(a, b); }

// acc[k] (op)= E::to_f(el[k]) for k < V; first: acc[k] = E::to_f(el[k]) (the first source starts the
// accumulation, so -0.0 and max/min keep their value).
template <class E, int OP, u32 V>
__device__ __forceinline__ void fold(typename E::Acc (&acc)[V], const typename E::T* el, bool first) {
#pragma unroll
    for (u32 k = 0; k < V; ++k) acc[k] = first ? E::to_f(el[k]) : combine<OP>(acc[k], E::to_f(el[k]));
}

// acc[k] (op)= element k of a 16-byte vector. kByWord (16-bit types): by 32-bit word through E::lo and
// E::hi; the same values as element by element, in other instructions (bf16's high element is one AND
// instead of a byte permute and a shift).
template <class E, int OP, bool kByWord = false>
__device__ __forceinline__ void fold_vec(typename E::Acc (&acc)[E::kPerVec], const uint4& raw, bool first) {
    if constexpr (kByWord) {
        static_assert(sizeof(typename E::T) == 2, "by word: 16-bit types");
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (u32 e = 0; e < 4; ++e) {
            acc[2 * e] = first ? E::lo(w[e]) : combine<OP>(acc[2 * e], E::lo(w[e]));
            acc[2 * e + 1] = first ? E::hi(w[e]) : combine<OP>(acc[2 * e + 1], E::hi(w[e]));
        }
    } else {
        fold<E, OP>(acc, reinterpret_cast<const typename E::T*>(&raw), first);
    }
}

// acc[k] = fma(w, element k of a 16-byte vector, acc[k]): one term of a weighted sum whose terms the caller
// adds in a fixed order (MoE combine: a token's expert outputs in slot order).
template <class E>
__device__ __forceinline__ void fold_vec_weighted(float (&acc)[E::kPerVec], const uint4& raw, float w) {
    const typename E::T* el = reinterpret_cast<const typename E::T*>(&raw);
#pragma unroll
    for (u32 k = 0; k < E::kPerVec; ++k) acc[k] = fmaf(w, E::to_f(el[k]), acc[k]);
}

template <class E, u32 V>
__device__ __forceinline__ void pack(const typename E::Acc (&acc)[V], typename E::T* el) {
#pragma unroll
    for (u32 k = 0; k < V; ++k) el[k] = E::from_f(acc[k]);
}

template <class E>
__device__ __forceinline__ uint4 pack_vec(const typename E::Acc (&acc)[E::kPerVec]) {
    uint4 res;
    pack<E>(acc, reinterpret_cast<typename E::T*>(&res));
    return res;
}

// Options of fold_sources (bits; 0 for none):
//   kPastAsZero   sources of the last batch that lie past n (n not a multiple of kSrcBatch) are not
//                 loaded but folded as +0.0, so the batch folds without branches and its loads are
//                 predicated (without it: a branch around each such source's loads and folds). For a sum
//                 from +0.0 only (kSum, !kFirst, acc starting at +0.0; no flush to zero): such a sum is
//                 never -0.0 (x + y is -0.0 only when both are), and x + 0.0 is x bitwise for every other
//                 x, so the result has the same bits as without the option.
//   kByWord       16-bit types are folded by 32-bit word (fold_vec).
enum FoldOptions : u32 { kPastAsZero = 1u, kByWord = 2u };

// acc[j] (op)= vector j of sources 0 .. n - 1, in this order. load(s, j): vector j of source s (16
// bytes; return zeros for a vector that is not there: only its lane's result is then meaningless).
// kFirst: source 0 starts the accumulation (acc's values are ignored; needs n >= 1: source 0 is always
// loaded); otherwise acc's values do (a plain sum from zero, or onto an accumulator). The loads of
// kSrcBatch sources x kVecs vectors are in flight before their folds, which go in source order; sources
// past n are not loaded (see kOpts).
// kFirst peels source 0 out of the loop, so that acc is defined on every path: an acc left undefined where
// the loop does not run (n == 0) lets ptxas hoist its packs to the kernel's entry, holding registers
// through every loop (the ring kernels then spill at their 128-register cap).
template <class E, int OP, bool kFirst, u32 kVecs, u32 kSrcBatch, u32 kOpts = 0, class Load>
__device__ __forceinline__ void fold_sources(typename E::Acc (&acc)[kVecs][E::kPerVec], u32 n, Load load) {
    constexpr bool kZeroPast = (kOpts & kPastAsZero) != 0;
    constexpr bool kWords = (kOpts & kByWord) != 0;
    static_assert(!kZeroPast || (OP == kSum && !kFirst), "+0.0 is the identity of a sum from +0.0 only");
    u32 s0 = 0;
    if constexpr (kFirst) {
        uint4 raw[kVecs];
#pragma unroll
        for (u32 j = 0; j < kVecs; ++j) raw[j] = load(0u, j);
#pragma unroll
        for (u32 j = 0; j < kVecs; ++j) fold_vec<E, OP, kWords>(acc[j], raw[j], true);
        s0 = 1;
    }
    for (; s0 < n; s0 += kSrcBatch) {
        uint4 raw[kSrcBatch][kVecs];
#pragma unroll
        for (u32 i = 0; i < kSrcBatch; ++i)
#pragma unroll
            for (u32 j = 0; j < kVecs; ++j) {
                if (kZeroPast) raw[i][j] = s0 + i < n ? load(s0 + i, j) : make_uint4(0u, 0u, 0u, 0u);
                else if (kSrcBatch == 1 || s0 + i < n) raw[i][j] = load(s0 + i, j);
            }
#pragma unroll
        for (u32 i = 0; i < kSrcBatch; ++i)
#pragma unroll
            for (u32 j = 0; j < kVecs; ++j)
                if (kZeroPast || kSrcBatch == 1 || s0 + i < n)
                    fold_vec<E, OP, kWords>(acc[j], raw[i][j], false);
    }
}

// The block's share of a reduction of `nvec` vectors: store(v, vector v of the reduction) for v < nvec,
// vector v of source p at src(p) + v, n >= 1. A thread takes kReduceUnrollOf<E> vectors at a time, the
// loads of one source for all of them in flight together. Loads bypass L1 (.cv): sources may hold pushed
// data.
template <class E, int OP, class Src, class Store>
__device__ __forceinline__ void reduce_block(u32 n, u64 nvec, Src src, Store store) {
    constexpr u32 U = kReduceUnrollOf<E>;
    u64 v = threadIdx.x;
    for (; v + (U - 1) * blockDim.x < nvec; v += U * blockDim.x) {
        typename E::Acc acc[U][E::kPerVec];
        fold_sources<E, OP, true, U, 1>(acc, n, [&](u32 p, u32 u) { return __ldcv(src(p) + v + u * blockDim.x); });
#pragma unroll
        for (u32 u = 0; u < U; ++u) store(v + u * blockDim.x, pack_vec<E>(acc[u]));
    }
    for (; v < nvec; v += blockDim.x) {
        typename E::Acc acc[1][E::kPerVec];
        fold_sources<E, OP, true, 1, 1>(acc, n, [&](u32 p, u32) { return __ldcv(src(p) + v); });
        store(v, pack_vec<E>(acc[0]));
    }
}

// One element of the reduction over n sources: *at(p) of each source p, in source order.
template <class E, int OP, class At>
__device__ __forceinline__ typename E::T reduce_elem(u32 n, At at) {
    typename E::Acc acc = 0;
    for (u32 p = 0; p < n; ++p) {
        const typename E::Acc x = E::to_f(*at(p));
        acc = p == 0 ? x : combine<OP>(acc, x);
    }
    return E::from_f(acc);
}

}  // namespace fluxrt
