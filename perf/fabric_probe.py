"""Bandwidth of the NVLink fabric, the ceiling of the bulk collectives: every rank moves `size` bytes with
each of its peers at once, one stream per peer, driven three ways:

  sm_push   SM stores into the peer's memory (fluxrt_put_signal, `blocks` per peer)
  sm_pull   SM loads from the peer's memory (the same kernel, pointers swapped)
  ce_pull   copy engine (cudaMemcpyAsync peer -> local), no SM

Peers (--peers): 'all' (every other rank: the pipelined collectives' all-to-all pattern), 'next' (rank + 1
only: the ring collectives' pattern), 'pair' (rank + n/2 only: ranks exchange in pairs).
Prints per-GPU egress (push) / ingress (pull) GB/s = peers * size / time, the slowest rank's time.

    fluxrt-run -n 4 -- python3 perf/fabric_probe.py --sizes 64M,256M --blocks 16,32,44 --json fabric.json
    fluxrt-run -n 4 -- python3 perf/fabric_probe.py --peers next --sizes 256M --blocks 48,96,128
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    import cupy
    from mpi4py import MPI

    import fluxrt
    from fluxrt import p2p
    from fluxrt.perf.baselines import machine
    from fluxrt.perf.report import results_document, write_json
    from fluxrt.perf.sweep import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M", help="bytes per peer, comma-separated")
    ap.add_argument("--blocks", default="16,32,44", help="SM blocks per peer stream, comma-separated")
    ap.add_argument("--peers", default="all", help="peer patterns, comma-separated: all, next, pair")
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    patterns = args.peers.split(",")
    if not set(patterns) <= {"all", "next", "pair"}:
        ap.error(f"--peers {args.peers!r}: expected all, next or pair (comma-separated)")
    largest = max(sizes)
    rows = []
    with fluxrt.init(options=fluxrt.WorldOptions(heap_size=2 * 4 * largest + (1 << 30))) as world:
        n, r = world.size, world.rank
        every = [q for q in range(n) if q != r]
        src = world.empty((n * largest,), np.uint8)
        dst = world.empty((n * largest,), np.uint8)
        src.fill(r + 1)
        streams = {q: cupy.cuda.Stream(non_blocking=True) for q in every}
        main_stream = cupy.cuda.Stream(non_blocking=True)
        fork, joins = cupy.cuda.Event(disable_timing=True), {q: cupy.cuda.Event(disable_timing=True) for q in every}
        st = p2p.state(world)
        world.device.synchronize()

        def once(mode, size, grid, peers):
            fork.record(main_stream)
            for q in peers:
                s = streams[q]
                s.wait_event(fork)
                mine, theirs = slice(q * size, (q + 1) * size), slice(r * size, (r + 1) * size)
                if mode == "ce_pull":    # q's chunk for me, from q's src into my dst
                    p2p.get(world, dst[mine], src[theirs], q, stream=s)
                elif mode == "sm_push":  # my chunk for q into q's dst
                    p2p.put(world, dst[theirs], src[mine], q, stream=s, blocks=grid)
                else:  # sm_pull: the put kernel reading q's chunk for me (p2p has no SM get) into my dst
                    st.put_signal((grid,), (512,), (np.uint64(dst.data.ptr + q * size),
                                                     np.uint64(src.peer_ptr(q) + r * size), np.uint64(size),
                                                     np.uint64(0), np.uint64(0), np.int32(0), np.uint64(0)),
                                  stream=s)
                joins[q].record(s)
                main_stream.wait_event(joins[q])

        for pattern, size in ((pt, sz) for pt in patterns for sz in sizes):
            peers = {"all": every, "next": [(r + 1) % n], "pair": [(r + n // 2) % n]}[pattern]
            for mode in ("sm_push", "sm_pull", "ce_pull"):
                for grid in (blocks if mode != "ce_pull" else [0]):
                    for _ in range(args.warmup):
                        once(mode, size, grid, peers)
                    main_stream.synchronize()
                    world.comm.Barrier()  # all ranks start together: every link carries traffic
                    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(main_stream)
                    for _ in range(args.iters):
                        once(mode, size, grid, peers)
                    stop.record(main_stream)
                    stop.synchronize()
                    ms = cupy.cuda.get_elapsed_time(start, stop) / args.iters
                    ms = world.comm.allreduce(ms, op=MPI.MAX)
                    gbps = len(peers) * size / (ms * 1e-3) / 1e9
                    rows.append({"peers": pattern, "mode": mode, "bytes_per_peer": size, "blocks_per_peer": grid,
                                 "ms": ms, "gbps_per_gpu": gbps, "ranks": n})
                    if r == 0:
                        print(f"{pattern:4s} {mode:8s} {size >> 20:5d} MiB/peer blocks/peer {grid:3d}: {ms:8.3f} ms "
                              f"{gbps:7.1f} GB/s per GPU", flush=True)
        world.device.synchronize()
        last = sizes[-1]  # the last pass (ce_pull of the last size) left its peers' bytes in dst
        wrong = [q for q in peers if not bool((dst[q * last:(q + 1) * last] == q + 1).all())]
        ok = not world.comm.allreduce(len(wrong), op=MPI.SUM)
        if wrong:
            print(f"rank {r}: wrong bytes from {wrong}", file=sys.stderr)
        world.free(dst)
        world.free(src)
        if r == 0 and args.json:
            write_json(args.json, results_document("fabric_probe", rows, sys.argv, machine=machine(world)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
