#!/usr/bin/env python3
"""What padding costs the fused ops: AllGather+GEMM and GEMM+ReduceScatter at an M whose shards are whole
128-row tiles and at an M just below it (shards padded inside the op), cuBLAS at both M, timed in turns
(median ms, the slowest rank's).

    fluxrt-run -n 4 -- python3 perf/padded_shards.py --json $OUT/padded.json

Defaults: M 8192 and 8160 (TP=4: shards of 2048 and 2040 rows), AG N=7168 K=8192, RS N=8192 K=7168, bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs=2, default=(8192, 8160), help="whole-tile M and padded M")
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--json", help="write the times here (rank 0)")
    args = ap.parse_args(argv)

    import cupy

    import fluxrt
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter
    from fluxrt.perf.tp_ops import Timer, _rand

    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size="8G", check_collective_args=False))
    w, me = world.size, world.rank
    s = cupy.cuda.Stream(non_blocking=True)
    timer = Timer(world, s, args.warmup, args.iters)
    rows = {}
    try:
        with s:
            n, k = 7168, 8192
            ag = AllGatherGemm(world, max(args.m), n, k, "bf16")
            b = _rand((k, n), "bf16", 100 + me)
            fns = {}
            for m in args.m:
                a = _rand((m // w, k), "bf16", 1 + me)
                c = cupy.empty((m, n), dtype=a.dtype)
                fns[f"ag_gemm M={m} N={n} K={k}"] = lambda a=a, c=c: ag.forward(a, b, out=c, stream=s)
                af = _rand((m, k), "bf16", 3)
                fns[f"cublas M={m} N={n} K={k}"] = lambda af=af, c=c: cupy.matmul(af, b, out=c)
            rows.update(timer.many(fns))
            ag.free()
            n, k = 8192, 7168
            rs = GemmReduceScatter(world, max(args.m), n, k, "bf16")
            b = _rand((k, n), "bf16", 200 + me)
            fns = {}
            for m in args.m:
                a = _rand((m, k), "bf16", 5 + me)
                o = cupy.empty((m // w, n), dtype=a.dtype)
                fns[f"gemm_rs M={m} N={n} K={k}"] = lambda a=a, o=o: rs.forward(a, b, out=o, stream=s)
                full = cupy.empty((m, n), dtype=a.dtype)
                fns[f"cublas M={m} N={n} K={k}"] = lambda a=a, full=full: cupy.matmul(a, b, out=full)
            rows.update(timer.many(fns))
            rs.free()
        if me == 0:
            for name, ms in rows.items():
                print(f"{name:36s} {ms:8.3f} ms")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"command": f"fluxrt-run -n {w} -- python3 perf/padded_shards.py", "world": w,
                               "commit": os.environ.get("FLUXRT_COMMIT"),
                               "machine": os.environ.get("FLUXRT_MACHINE_KIND"), "ms": rows}, f, indent=1)
    finally:
        world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
