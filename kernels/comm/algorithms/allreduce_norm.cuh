// Allreduce fused with the residual add and RMSNorm of the next layer (fluxrt/fused.py), one launch:
//   h[r]   = dtype(x_0[r] + x_1[r] + ... + x_{n-1}[r] + residual[r])   (fp32, rank order, one rounding)
//   out[r] = dtype(h[r] * rsqrt(mean(h[r]^2) + eps) * weight)          or its FP8 e4m3 codes and scales
// h goes to residual_out. Rows are [rows, cols] 16-bit (bf16, fp16). A row is handled by one block: the
// sum of squares is a block reduction in a fixed order (fluxrt/quant.cuh), and the norm of a row is a
// pure function of h[r], so every rank that holds the same h gets the same bits in out.
//
//   ll        (small messages) every rank pushes its rows in LL lines (ll.cuh) to every peer and
//             reduces, adds and normalises every row itself: one NVLink trip, no flag word.
//   twoshot   (large) rows are cut into n chunks of `chunk_rows`; chunk q is reduced by rank q:
//             stage push     rows of chunk q to peer q's workspace slot [rank] (staged scheme, phase 0)
//             stage reduce   the owned rows: the n slots in rank order + residual -> h, pushed to every
//                            rank's area-2 slot [rank] (phase 1)
//             stage norm     every row's h from area 2 -> residual_out and out. Gathering h (and not the
//                            normalised row and h) moves half the bytes of gathering both; normalising a
//                            row again on every rank is local and gives the same bits.
// Block b keeps the same rows in every stage (rows [lo, hi) of every chunk), so in place (out == x,
// residual_out == residual) is safe: a block writes only rows it has read already.
#pragma once

#include "../comm/schemes/staged.cuh"
#include "../comm/schemes/ll.cuh"
#include "fluxrt/quant.cuh"

namespace fluxrt {
namespace coll {

enum NormQuant : u32 { kNormQuantNone = 0, kNormQuantToken = 1, kNormQuantBlock = 2 };
constexpr u32 kNormGroup = 128;  // columns per scale of kNormQuantBlock (1 x 128)
constexpr u32 kNormLineElems = kLLData / 2;  // 16-bit elements per 8-byte line

// Arguments of one launch (pointers of this piece's first row).
struct NormIO {
    const char* x;
    const char* residual;
    const char* weight;
    char* out;           // [rows, cols] of the dtype, or e4m3 codes (1 byte each) when quantized
    char* residual_out;  // [rows, cols]: h
    float* scales;       // kNormQuantToken: [rows]; kNormQuantBlock: [rows, ceil(cols / 128)]
    u32 rows, cols;
    float eps;
    u32 quant;

    __device__ __forceinline__ u64 row_bytes() const { return (u64)cols * 2; }
    __device__ __forceinline__ u64 lines() const { return lines_of(row_bytes()); }
    // elements of line j inside the row (a short last line)
    __device__ __forceinline__ u32 valid(u64 j) const {
        const u64 at = j * kNormLineElems;
        return at >= cols ? 0u : (cols - at < kNormLineElems ? (u32)(cols - at) : kNormLineElems);
    }
};

template <class E>
__device__ __forceinline__ void line_to_f(u64 v, u32 valid, float (&f)[kNormLineElems]) {
    const typename E::T* el = reinterpret_cast<const typename E::T*>(&v);
#pragma unroll
    for (u32 k = 0; k < kNormLineElems; ++k) f[k] = k < valid ? E::to_f(el[k]) : 0.f;
}

// Four e4m3 codes of line j of a row of `cols` bytes.
__device__ __forceinline__ void store_codes(char* row, u32 cols, u64 j, u32 w) {
    const u64 at = j * kNormLineElems;
    if (at + 4 <= cols && (reinterpret_cast<u64>(row + at) & 3ull) == 0) {
        *reinterpret_cast<u32*>(row + at) = w;
        return;
    }
#pragma unroll
    for (u32 b = 0; b < 4; ++b)
        if (at + b < cols) row[at + b] = (char)(w >> (8 * b));
}

// The rest of row r once the block has its sum of squares: rstd, then out (or codes and scales). The
// block's threads take lines j = threadIdx.x, + blockDim.x, ... (as the caller did); hline(j) is h's
// line j. Every thread of the block calls it.
template <class E, class HLine>
__device__ void norm_row(const NormIO& io, u32 r, float sumsq, HLine hline, float* scratch) {
    const float total = block_sum(sumsq, scratch);
    const float rstd = 1.f / sqrtf(total / (float)io.cols + io.eps);
    const u64 L = io.lines(), rb = io.row_bytes();
    auto y_of = [&](u64 j, float (&y)[kNormLineElems]) {
        const u32 valid = io.valid(j);
        float h[kNormLineElems], w[kNormLineElems];
        line_to_f<E>(hline(j), valid, h);
        line_to_f<E>(load_line(io.weight, rb, j), valid, w);
#pragma unroll
        for (u32 k = 0; k < kNormLineElems; ++k) y[k] = h[k] * rstd * w[k];
    };
    if (io.quant == kNormQuantNone) {
        char* row = io.out + (u64)r * rb;
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float y[kNormLineElems];
            y_of(j, y);
            u64 v = 0;
            pack<E>(y, reinterpret_cast<typename E::T*>(&v));
            store_line(row, rb, j, v);
        }
        return;
    }
    char* codes = io.out + (u64)r * io.cols;
    if (io.quant == kNormQuantToken) {
        float amax = 0.f;
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float y[kNormLineElems];
            y_of(j, y);
#pragma unroll
            for (u32 k = 0; k < kNormLineElems; ++k) amax = fmaxf(amax, fabsf(y[k]));
        }
        const float scale = group_scale<Fp8E4M3>(block_max(amax, scratch));
        if (threadIdx.x == 0) io.scales[r] = scale;
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float y[kNormLineElems];
            y_of(j, y);
            store_codes(codes, io.cols, j, quantize4<Fp8E4M3>(y, scale));
        }
        return;
    }
    // 1 x 128: a group is 32 lines, one warp's lanes in one pass (blockDim.x is a multiple of 32)
    const u64 groups = (io.cols + kNormGroup - 1) / kNormGroup;
    const u64 Lw = (L + 31) / 32 * 32;  // every lane of a warp takes part in its shuffles
    for (u64 j = threadIdx.x; j < Lw; j += blockDim.x) {
        float y[kNormLineElems] = {0.f, 0.f, 0.f, 0.f};
        if (j < L) y_of(j, y);
        float amax = 0.f;
#pragma unroll
        for (u32 k = 0; k < kNormLineElems; ++k) amax = fmaxf(amax, fabsf(y[k]));
        const float scale = group_scale<Fp8E4M3>(warp_max(amax));
        const u64 g = j / 32;
        if ((threadIdx.x & 31u) == 0 && g < groups) io.scales[(u64)r * groups + g] = scale;
        if (j < L) store_codes(codes, io.cols, j, quantize4<Fp8E4M3>(y, scale));
    }
}

// h's line j from the fp32 sum of the ranks' lines (acc) and the residual: one rounding; elements past
// the row are zero. Adds the line's squares to sumsq.
template <class E>
__device__ __forceinline__ u64 finish_line(const NormIO& io, u32 r, u64 j, float (&acc)[kNormLineElems],
                                           float* sumsq) {
    const u32 valid = io.valid(j);
    float res[kNormLineElems];
    line_to_f<E>(load_line(io.residual + (u64)r * io.row_bytes(), io.row_bytes(), j), valid, res);
    u64 h = 0;
    typename E::T* el = reinterpret_cast<typename E::T*>(&h);
#pragma unroll
    for (u32 k = 0; k < kNormLineElems; ++k) {
        if (k >= valid) continue;
        el[k] = E::from_f(acc[k] + res[k]);
        const float v = E::to_f(el[k]);
        *sumsq += v * v;
    }
    return h;
}

// ------------------------------------------------------------------------------------------------- ll
// Row r's line j goes to line r * lines + j of every peer's LL slot [rank]; slot_bytes must hold
// rows * lines lines (the host checks). Any grid; blockDim a multiple of 32.
template <class E>
__device__ void allreduce_norm_ll(Team t, NormIO io, u64 slot_bytes) {
    static_assert(sizeof(typename E::T) == 2, "16-bit rows");
    __shared__ float scratch[32];
    const u64 rb = io.row_bytes(), L = io.lines();
    const u64 e = begin_round(t.epoch);                                                  // stage begin
    const u32 f = ll_flag(e);
    const u64 half = (e & 1ull) * t.ll_half_bytes;
    for (u32 r = blockIdx.x; r < io.rows; r += gridDim.x)                                // stage push
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            const u64 v = load_line(io.x + (u64)r * rb, rb, j);
            for (u32 s = 1; s < t.world; ++s) {
                const u32 q = (t.rank + s) % t.world;
                ll_put(ll_line(t.peer_ll(q), half, t.rank, slot_bytes, (u64)r * L + j), v, f);
            }
        }
    bool ok = true;  // after a timeout the block stops waiting (the host raises it); block-uniform calls go on
    for (u32 r = blockIdx.x; r < io.rows; r += gridDim.x) {                              // stage reduce
        float sumsq = 0.f;
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float acc[kNormLineElems];
            for (u32 p = 0; p < t.world; ++p) {
                u64 v = 0;
                if (p == t.rank) v = load_line(io.x + (u64)r * rb, rb, j);
                else if (ok) ok = ll_take(t, ll_line(t.ll, half, p, slot_bytes, (u64)r * L + j), f, p, &v);
                fold<E, kSum>(acc, reinterpret_cast<const typename E::T*>(&v), p == 0);
            }
            store_line(io.residual_out + (u64)r * rb, rb, j, finish_line<E>(io, r, j, acc, &sumsq));
        }
        // stage norm: this thread's own lines of residual_out, just written
        norm_row<E>(io, r, sumsq, [&](u64 j) { return load_line(io.residual_out + (u64)r * rb, rb, j); }, scratch);
    }
}

// ------------------------------------------------------------------------------------------- twoshot
// Chunk q: rows [q * chunk_rows, ...) (the last chunks may be short or empty). Slot rows are `row_pitch`
// bytes apart (whole 8-byte lines); area 1 holds n slots of `slot_bytes` from the half's start, area 2 n
// more. Grid <= kMaxBlocks (per-block flags); blockDim a multiple of 32.
template <class E>
__device__ void allreduce_norm_twoshot(Team t, NormIO io, u64 chunk_rows, u64 row_pitch, u64 slot_bytes) {
    static_assert(sizeof(typename E::T) == 2, "16-bit rows");
    __shared__ float scratch[32];
    const u64 rb = io.row_bytes(), L = io.lines();
    auto rows_of = [&](u32 q) {
        const u64 at = (u64)q * chunk_rows;
        return at < io.rows ? (io.rows - at < chunk_rows ? io.rows - at : chunk_rows) : 0ull;
    };
    const u64 e = begin_round(t.epoch);                                                  // stage begin
    const u64 base = half_offset(t, e), area2 = base + (u64)t.world * slot_bytes;
    u64 lo, hi;
    block_range(chunk_rows, 1, &lo, &hi);
    for (u32 s = 0; s < t.world; ++s) {                                                  // stage push
        const u32 q = (t.rank + 1 + s) % t.world;
        const u64 n = rows_of(q) < hi ? rows_of(q) : hi;
        for (u64 i = lo; i < n; ++i)
            copy_block(t.peer_ws(q) + base + (u64)t.rank * slot_bytes + i * row_pitch,
                       io.x + ((u64)q * chunk_rows + i) * rb, rb, false);
    }
    staged_signal(t, 0, e);
    if (!staged_wait(t, 0, e)) return;
    float unused = 0.f;
    const u64 mine = rows_of(t.rank) < hi ? rows_of(t.rank) : hi;
    for (u64 i = lo; i < mine; ++i) {                                                    // stage reduce
        const u32 r = (u32)((u64)t.rank * chunk_rows + i);
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float acc[kNormLineElems];
            for (u32 p = 0; p < t.world; ++p) {
                const u64 v = __ldcv(reinterpret_cast<const u64*>(t.ws + base + (u64)p * slot_bytes + i * row_pitch) + j);
                fold<E, kSum>(acc, reinterpret_cast<const typename E::T*>(&v), p == 0);
            }
            const u64 h = finish_line<E>(io, r, j, acc, &unused);
            for (u32 s = 0; s < t.world; ++s) {
                const u32 q = (t.rank + s) % t.world;
                reinterpret_cast<u64*>(t.peer_ws(q) + area2 + (u64)t.rank * slot_bytes + i * row_pitch)[j] = h;
            }
        }
    }
    staged_signal(t, 1, e);
    if (!staged_wait(t, 1, e)) return;
    for (u32 p = 0; p < t.world; ++p) {                                                  // stage norm
        const u64 n = rows_of(p) < hi ? rows_of(p) : hi;
        for (u64 i = lo; i < n; ++i) {
            const u32 r = (u32)((u64)p * chunk_rows + i);
            const u64* src = reinterpret_cast<const u64*>(t.ws + area2 + (u64)p * slot_bytes + i * row_pitch);
            float sumsq = 0.f;
            for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
                const u64 h = __ldcv(src + j);
                store_line(io.residual_out + (u64)r * rb, rb, j, h);
                float v[kNormLineElems];
                line_to_f<E>(h, io.valid(j), v);
#pragma unroll
                for (u32 k = 0; k < kNormLineElems; ++k) sumsq += v[k] * v[k];
            }
            norm_row<E>(io, r, sumsq, [&](u64 j) { return __ldcv(src + j); }, scratch);
        }
    }
}

// ---------------------------------------------------------------------------------------- add_rmsnorm
// The same residual add and norm as a kernel of its own, on an already reduced x (one rank's data): the
// baseline the fused rounds are measured against (fluxrt-perf allreduce_rmsnorm: an allreduce, then this).
// One block a row (any grid); blockDim a multiple of 32.
template <class E>
__device__ void add_rmsnorm(NormIO io) {
    static_assert(sizeof(typename E::T) == 2, "16-bit rows");
    __shared__ float scratch[32];
    const u64 rb = io.row_bytes(), L = io.lines();
    for (u32 r = blockIdx.x; r < io.rows; r += gridDim.x) {
        float sumsq = 0.f;
        for (u64 j = threadIdx.x; j < L; j += blockDim.x) {
            float acc[kNormLineElems];
            const u64 v = load_line(io.x + (u64)r * rb, rb, j);
            fold<E, kSum>(acc, reinterpret_cast<const typename E::T*>(&v), true);
            store_line(io.residual_out + (u64)r * rb, rb, j, finish_line<E>(io, r, j, acc, &sumsq));
        }
        norm_row<E>(io, r, sumsq, [&](u64 j) { return load_line(io.residual_out + (u64)r * rb, rb, j); }, scratch);
    }
}

}  // namespace coll
}  // namespace fluxrt
