// Vectorised copies by the threads of a block or a grid, and the split of a range over blocks.
//
//   split_range     [lo, hi) of part `part` of `parts` equal pieces (whole `align` units; the same on
//                   every rank, since it depends only on the sizes)
//   copy_strided    one destination: 16-byte vectors where dst and src share 16-byte alignment, 4-byte
//                   words where they share 4-byte alignment, bytes otherwise and for head and tail
//   copy_fanout     one source to several destinations (all 16- or 4-byte aligned, or bytes)
//   copy_segments   a table of (destination, source, bytes) segments, one block per entry in turn
//   poison_bytes    all-ones bytes over a range: what a call that timed out leaves in its output
// Threads take units first, first + stride, ...: a block (threadIdx.x, blockDim.x) or a grid.
// Source loads by policy: LoadNc (read-only path: data that stays unchanged during the kernel),
// LoadFresh (pushed data: .cv, bypassing L1, so that a stale line of an earlier round is never hit;
// or plain loads when `cv` is false).
#pragma once

#include "fluxrt/types.cuh"

namespace fluxrt {

constexpr u32 kVecBytes = 16;  // one vector load/store
constexpr u32 kCopyUnroll = 4;  // loads in flight per thread before the first store (8: no faster)

__device__ __forceinline__ void split_range(u64 total, u64 align, u32 parts, u32 part, u64* lo, u64* hi) {
    u64 per = (total + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    const u64 l = (u64)part * per;
    *lo = l < total ? l : total;
    *hi = l + per < total ? l + per : total;
}

struct LoadNc {
    template <class U> __device__ __forceinline__ U operator()(const U* p) const { return __ldg(p); }
};
struct LoadFresh {
    bool cv;
    template <class U> __device__ __forceinline__ U operator()(const U* p) const { return cv ? __ldcv(p) : *p; }
};
struct LoadCv {
    template <class U> __device__ __forceinline__ U operator()(const U* p) const { return __ldcv(p); }
};

// Units i = first, first + stride, ... < n: store(i, stride, r) with r the units i + u * stride,
// kCopyUnroll of them loaded before the first store, then one at a time.
template <class U, class Load, class Store>
__device__ __forceinline__ void stream_units(const U* s, u64 n, u64 first, u64 stride, Load load, Store store) {
    u64 i = first;
    for (; i + (kCopyUnroll - 1) * stride < n; i += kCopyUnroll * stride) {
        U r[kCopyUnroll];
#pragma unroll
        for (u32 u = 0; u < kCopyUnroll; ++u) r[u] = load(s + i + u * stride);
        store(i, stride, r);
    }
    for (; i < n; i += stride) {
        const U r[1] = {load(s + i)};
        store(i, stride, r);
    }
}

// Units [0, n) of s into d.
template <class U, class Load>
__device__ __forceinline__ void copy_units(U* __restrict__ d, const U* __restrict__ s, u64 n, u64 first, u64 stride,
                                           Load load) {
    stream_units(s, n, first, stride, load, [&](u64 i, u64 st, const auto& r) {
#pragma unroll
        for (u32 u = 0; u < sizeof(r) / sizeof(U); ++u) d[i + u * st] = r[u];
    });
}

// `bytes` from src to dst. Where dst and src share 16 (4) -byte alignment: the bytes before the first
// aligned address, then vectors (words), then the tail bytes.
template <class Load>
__device__ __forceinline__ void copy_strided(char* __restrict__ dst, const char* __restrict__ src, u64 bytes,
                                             u64 first, u64 stride, Load load) {
    const u64 a = reinterpret_cast<u64>(dst), b = reinterpret_cast<u64>(src);
    const u64 unit = ((a ^ b) & 15ull) == 0 ? 16ull : ((a ^ b) & 3ull) == 0 ? 4ull : 1ull;
    u64 head = 0, done = 0;
    if (unit > 1) {
        head = (unit - (a & (unit - 1))) & (unit - 1);
        if (head > bytes) head = bytes;
        const u64 n = (bytes - head) / unit;
        if (unit == 16)
            copy_units(reinterpret_cast<uint4*>(dst + head), reinterpret_cast<const uint4*>(src + head), n, first,
                       stride, load);
        else
            copy_units(reinterpret_cast<u32*>(dst + head), reinterpret_cast<const u32*>(src + head), n, first,
                       stride, load);
        done = head + n * unit;
    }
    for (u64 i = first; i < head; i += stride) dst[i] = load(src + i);
    for (u64 j = done + first; j < bytes; j += stride) dst[j] = load(src + j);
}

// Fill [dst, dst + bytes) with 0xFF bytes, by threads lane, lane + lanes, ... (16-byte stores where
// aligned). All-ones is a NaN in fp32, fp16 and bf16 (and -1 in integers): the output a timed-out wait
// was to guard reads as NaN, never as plausible numbers computed from stale data. Failure path only, hence
// out of line: inlined into every wait site it grew the LL kernels by ~70 % of their code and their registers.
__device__ __noinline__ void poison_bytes(char* dst, u64 bytes, u32 lane, u32 lanes) {
    const u64 to_aligned = (16u - (reinterpret_cast<u64>(dst) & 15u)) & 15u;
    const u64 head = to_aligned < bytes ? to_aligned : bytes;
    for (u64 i = lane; i < head; i += lanes) dst[i] = (char)0xFF;
    uint4* v = reinterpret_cast<uint4*>(dst + head);
    const u64 nvec = (bytes - head) / 16u;
    const uint4 ones = make_uint4(~0u, ~0u, ~0u, ~0u);
    for (u64 i = lane; i < nvec; i += lanes) v[i] = ones;
    for (u64 i = head + nvec * 16u + lane; i < bytes; i += lanes) dst[i] = (char)0xFF;
}

// The block copies `bytes` from src to dst. fresh_src: src holds pushed data (loads bypass L1).
__device__ inline void copy_block(char* __restrict__ dst, const char* __restrict__ src, u64 bytes, bool fresh_src) {
    copy_strided(dst, src, bytes, threadIdx.x, blockDim.x, LoadFresh{fresh_src});
}

// The grid copies a table of segments, three u64 per entry (destination, source, bytes): block b takes
// entries b, b + gridDim.x, ... (the host cuts long segments so that entries are of similar size).
__device__ inline void copy_segments(const u64* table, u64 n, bool fresh_src) {
    for (u64 e = blockIdx.x; e < n; e += gridDim.x)
        copy_block(reinterpret_cast<char*>(table[3 * e]), reinterpret_cast<const char*>(table[3 * e + 1]),
                   table[3 * e + 2], fresh_src);
}

// The grid copies `bytes` from src (unchanged during the kernel) to dst (usually a peer pointer).
__device__ inline void put_grid(char* __restrict__ dst, const char* __restrict__ src, u64 bytes) {
    copy_strided(dst, src, bytes, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x,
                 LoadNc{});
}

// The block copies `bytes` of src (pushed data: .cv loads) as bits to dst[0 .. ndst): 16-byte vectors
// when every pointer is 16-byte aligned, 4-byte words when 4-byte aligned, bytes otherwise. Each unit
// is loaded once and stored to every destination.
template <class U>
__device__ __forceinline__ void fanout_units(char* const* dst, u32 ndst, const char* src, u64 n) {
    stream_units(reinterpret_cast<const U*>(src), n, threadIdx.x, blockDim.x, LoadCv{},
                 [&](u64 i, u64 st, const auto& r) {
                     for (u32 d = 0; d < ndst; ++d)
#pragma unroll
                         for (u32 u = 0; u < sizeof(r) / sizeof(U); ++u) reinterpret_cast<U*>(dst[d])[i + u * st] = r[u];
                 });
}

static __device__ __noinline__ void copy_fanout(char* const* dst, u32 ndst, const char* src, u64 bytes) {
    u64 any = reinterpret_cast<u64>(src);
    for (u32 d = 0; d < ndst; ++d) any |= reinterpret_cast<u64>(dst[d]);
    u64 done = 0;
    if ((any & 15ull) == 0) {
        fanout_units<uint4>(dst, ndst, src, bytes / kVecBytes);
        done = bytes / kVecBytes * kVecBytes;
    } else if ((any & 3ull) == 0) {
        fanout_units<u32>(dst, ndst, src, bytes / 4ull);
        done = bytes / 4ull * 4ull;
    }
    for (u64 i = done + threadIdx.x; i < bytes; i += blockDim.x) {
        const unsigned char b = __ldcv(reinterpret_cast<const unsigned char*>(src) + i);
        for (u32 d = 0; d < ndst; ++d) reinterpret_cast<unsigned char*>(dst[d])[i] = b;
    }
}

}  // namespace fluxrt
