#!/usr/bin/env python3
"""Probe: after a device-side flag wait, does every way of reading SM-pushed peer data see it?

Each rank pushes a pattern to its right neighbour's symmetric buffer with fluxrt's SM put + release
flag (p2p.put mode 'sm'), waits for its left neighbour's flag on a stream, synchronizes that stream,
and then reads the received bytes in one of three ways:
  ce_other_stream  cupy.asnumpy on the null stream (a copy-engine read issued after the host sync)
  ce_same_stream   cudaMemcpyAsync D2H on the waiting stream, right behind the wait kernel
  sm_then_ce       an SM comparison kernel first, then the copy-engine read
and counts iterations in which any byte differs. Run under MPI on >= 2 GPUs:

    fluxrt-run -n 4 -- python3 perf/ordering_probe.py --iters 200 --json probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POISON = 0xA5
VARIANTS = ("ce_other_stream", "ce_same_stream", "sm_then_ce")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,12M,64M")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import cupy

    import fluxrt
    from fluxrt import p2p
    from fluxrt.perf.sweep import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size="1G", timeout_s=5))
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    dst = world.empty((max(sizes),), np.uint8)
    pad = world.signal_pad(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    host = cupy.cuda.alloc_pinned_memory(max(sizes))
    results = []
    for nbytes in sizes:
        mine = cupy.asarray(np.random.default_rng(world.rank).integers(0, 256, nbytes, dtype=np.uint8))
        exp_host = np.random.default_rng(left).integers(0, 256, nbytes, dtype=np.uint8)
        expected = cupy.asarray(exp_host)
        for variant in VARIANTS:
            bad_iters = 0
            for _ in range(args.iters):
                dst[:nbytes].fill(POISON)
                epoch = pad.next_epoch()
                world.synchronize()
                world.comm.Barrier()               # every poison is in place before anyone pushes
                p2p.put(world, dst[:nbytes], mine, right, mode="sm", stream=stream,
                        flag_ptr=pad.peer_ptr(right, 0), flag_value=epoch)
                pad.wait(0, epoch, peer=left, op="ordering_probe", stream=stream)
                if variant == "ce_same_stream":
                    cupy.cuda.runtime.memcpyAsync(host.ptr, dst.data.ptr, nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                    world.synchronize(stream)
                    got = np.frombuffer(host, np.uint8, nbytes)
                    wrong = int(np.count_nonzero(got != exp_host))
                else:
                    world.synchronize(stream)
                    if variant == "sm_then_ce":
                        int((dst[:nbytes] != expected).sum())
                    wrong = int(np.count_nonzero(cupy.asnumpy(dst[:nbytes]) != exp_host))
                bad_iters += wrong > 0
                world.comm.Barrier()               # nobody re-poisons before everyone has read
            total = world.comm.allreduce(bad_iters)
            row = {"bytes": nbytes, "variant": variant, "iters_per_rank": args.iters, "ranks": world.size,
                   "bad_iters_all_ranks": total}
            results.append(row)
            if world.rank == 0:
                print(json.dumps(row), flush=True)
    if world.rank == 0 and args.json:
        args.json.write_text(json.dumps({"bench": "ordering_probe", "rows": results}, indent=1))
    world.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
