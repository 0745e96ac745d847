"""Egress per GPU of SM pushes by traffic pattern, every rank at once, the same bytes per GPU and the
same copy loop (16-byte vectors, 4 in flight per thread, 512 threads a block):

  ring     every block pushes to rank + 1 (the ring collectives' pattern)
  ringbi   half the blocks to rank + 1, half to rank - 1
  pair     every block to rank + 2 (ranks exchange in pairs)
  a2a      the blocks split evenly over the peers (the pipelined collectives' pattern)
  a2a_rot  every block visits every peer in turn, 64 KiB at a time

    fluxrt-run -n 4 -- python3 perf/fabric_patterns.py 268435456
"""
import sys, statistics
import numpy as np
import cupy
from mpi4py import MPI
import fluxrt

SRC = r'''
typedef unsigned long long u64;
#define SEG 1024
extern "C" __global__ void push(const u64* dst, const u64* src, const u64* len, const u64* nseg) {
    // block b: segments [b*SEG, b*SEG+nseg[b]) of (dst, src, len)
    const unsigned b = blockIdx.x;
    for (u64 s = 0; s < nseg[b]; ++s) {
        const uint4* sp = reinterpret_cast<const uint4*>(src[b * SEG + s]);
        uint4* dp = reinterpret_cast<uint4*>(dst[b * SEG + s]);
        const u64 nvec = len[b * SEG + s] / 16;
        u64 i = threadIdx.x;
        for (; i + 3 * blockDim.x < nvec; i += 4 * blockDim.x) {
            uint4 r0 = sp[i], r1 = sp[i + blockDim.x], r2 = sp[i + 2 * blockDim.x], r3 = sp[i + 3 * blockDim.x];
            dp[i] = r0; dp[i + blockDim.x] = r1; dp[i + 2 * blockDim.x] = r2; dp[i + 3 * blockDim.x] = r3;
        }
        for (; i < nvec; i += blockDim.x) dp[i] = sp[i];
    }
}
'''
world = fluxrt.init(options=fluxrt.WorldOptions(heap_size="3G"))
comm = MPI.COMM_WORLD
n, r = world.size, world.rank
TOTAL = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
dst = world.empty((n * TOTAL,), "uint8")  # slot per source rank
src = cupy.random.randint(0, 255, TOTAL, dtype=cupy.uint8)
kern = cupy.RawModule(code=SRC).get_function("push")
PIECE = 64 << 10
SEG = 1024


def plan(pattern, blocks):
    peers = {"ring": [(r + 1) % n], "ringbi": [(r + 1) % n, (r - 1) % n], "pair": [(r + 2) % n],
             "a2a": [(r + s) % n for s in range(1, n)], "a2a_rot": [(r + s) % n for s in range(1, n)]}[pattern]
    per_peer = TOTAL // len(peers) // 4096 * 4096
    D = np.zeros(blocks * SEG, np.uint64); S = np.zeros_like(D); L = np.zeros_like(D); N = np.zeros(blocks, np.uint64)
    if pattern == "a2a_rot":  # every block: its slice of every peer's share, pieces rotating over peers
        per_block = per_peer // blocks // 4096 * 4096
        pieces = per_block // PIECE
        for b in range(blocks):
            k = 0
            for j in range(pieces):
                for s in range(len(peers)):
                    q = peers[(b + s) % len(peers)]
                    off = b * per_block + j * PIECE
                    if k >= SEG:
                        break
                    D[b * SEG + k] = dst.peer_ptr(q) + r * TOTAL + off
                    S[b * SEG + k] = src.data.ptr + (peers.index(q) * per_peer + off)
                    L[b * SEG + k] = PIECE
                    k += 1
            N[b] = k
        return D, S, L, N, min(SEG // len(peers), pieces) * len(peers) * PIECE * blocks
    bpp = blocks // len(peers)
    per_block = per_peer // bpp // 4096 * 4096
    for i, q in enumerate(peers):
        for j in range(bpp):
            b = i * bpp + j
            D[b * SEG] = dst.peer_ptr(q) + r * TOTAL + j * per_block
            S[b * SEG] = src.data.ptr + i * per_peer + j * per_block
            L[b * SEG] = per_block
            N[b] = 1
    return D, S, L, N, per_block * bpp * len(peers)


stream = cupy.cuda.Stream(non_blocking=True)
for pattern in ("ring", "ringbi", "pair", "a2a", "a2a_rot"):
    for blocks in (24, 48, 96, 132):
        if pattern == "a2a_rot" and TOTAL // (n - 1) // blocks < PIECE:
            continue
        D, S, L, N, moved = plan(pattern, blocks)
        args = [cupy.asarray(a) for a in (D, S, L, N)]
        ts = []
        for it in range(8):
            stream.synchronize(); comm.Barrier()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(stream)
            kern((blocks,), (512,), tuple(args), stream=stream)
            e1.record(stream); e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1))
        t = statistics.median(ts[2:])
        worst = comm.allreduce(t, op=MPI.MAX)
        if r == 0:
            print(f"{pattern:8s} blocks {blocks:4d} bytes {moved >> 20:5d} MiB  {worst*1e3:9.1f} us  egress {moved / worst / 1e6:6.1f} GB/s", flush=True)
world.finalize()
