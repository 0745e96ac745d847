"""A tensor-parallel MLP block with fluxrt: AllGather+GEMM -> SiLU-and-multiply -> GEMM+ReduceScatter.

    fluxrt-run -n 4 -- python examples/tp_mlp.py [--M 8192] [--hidden 8192] [--ffn 28672] [--dtype bf16]

Each rank holds M/world rows of the activations and ffn/world columns of the intermediate layer. The block
runs eagerly once (checked against numpy on a few rows), then is captured in a CUDA graph and replayed.
FLUXRT_DEBUG=INFO shows which path each op took (fused kernel or decomposed) and why.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

log = logging.getLogger("tp_mlp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, default=4096, help="tokens (rows) over all ranks")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336, help="intermediate size over all ranks")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--replays", type=int, default=100)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import cupy

    import fluxrt
    from fluxrt.ops import TPMLP

    with fluxrt.init() as world:
        w, me = world.size, world.rank
        if args.M % w or args.ffn % (8 * w):
            raise SystemExit(f"--M must be a multiple of {w} and --ffn of {8 * w}")
        ffn = args.ffn // w
        dt = fluxrt.bfloat16 if args.dtype == "bf16" else np.float16
        rng = cupy.random.default_rng(1234 + me)   # every rank its own rows and its own weight columns
        x = (rng.standard_normal((args.M // w, args.hidden), dtype=np.float32)).astype(dt)
        w_gate_up = (rng.standard_normal((args.hidden, 2 * ffn), dtype=np.float32) / args.hidden ** 0.5).astype(dt)
        w_down = (rng.standard_normal((ffn, args.hidden), dtype=np.float32) / ffn ** 0.5).astype(dt)
        mlp = TPMLP(world, args.M, args.hidden, ffn, args.dtype)
        s = cupy.cuda.Stream(non_blocking=True)
        y = cupy.empty((args.M // w, args.hidden), dtype=dt)

        mlp.forward(x, w_gate_up, w_down, out=y, stream=s)   # eager: each op's path from the cost model
        world.synchronize(s)
        _check_rows(world, x, w_gate_up, w_down, y, ffn)

        mlp.forward(x, w_gate_up, w_down, out=y, stream=s, path="decomposed")   # load the capture's kernels
        s.synchronize()
        s.begin_capture()
        mlp.forward(x, w_gate_up, w_down, out=y, stream=s)
        graph = s.end_capture()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(s)
        for _ in range(args.replays):
            graph.launch(s)
        end.record(s)
        world.synchronize(s)
        _check_rows(world, x, w_gate_up, w_down, y, ffn)
        ms = cupy.cuda.get_elapsed_time(start, end) / args.replays
        if me == 0:
            log.info("TP MLP M=%d hidden=%d ffn=%d on %d ranks: %.3f ms per graph replay", args.M, args.hidden,
                     args.ffn, w, ms)
        mlp.free()
    return 0


def _check_rows(world, x, w_gate_up, w_down, y, ffn, rows: int = 4) -> None:
    """The first rows of every rank's output against a float64 numpy block (every rank's inputs over MPI)."""
    xs = world.comm.allgather(x[:rows].get().astype(np.float64))
    parts = []
    for xr in xs:   # token rows of each rank, through my intermediate columns
        h = xr @ w_gate_up.get().astype(np.float64)
        g, u = h[:, :ffn], h[:, ffn:]
        parts.append((g / (1 + np.exp(-g)) * u) @ w_down.get().astype(np.float64))
    totals = world.comm.allreduce(np.stack(parts))   # sum of every rank's partials, per source rank's rows
    ref = totals[world.rank]
    got = y[:rows].get().astype(np.float64)
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    if err > 3e-2:
        raise SystemExit(f"rank {world.rank}: MLP output differs from numpy: relative error {err:.3g}")


if __name__ == "__main__":
    raise SystemExit(main())
