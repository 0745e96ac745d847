#!/usr/bin/env python3
"""fluxrt Hopper GEMM vs cupy.matmul (cuBLAS): CUDA-event timing, warm-up, median over many runs,
several rotating input sets (so that L2 does not hold the operands between runs).

    python3 perf/bench_gemm.py --json $OUT/gemm.json
    python3 perf/bench_gemm.py --shapes 8192,8192,8192 -d fp16 --trans-b --order hilbert

Flags shared with fluxrt-perf: -d bf16|fp16, -n iterations, -w warm-up, -c 0|1 (--dtype, --warmup, --no-check
still work).

Shapes are given as M,K,N (the fused-op issues quote (M, K, N)). JSON rows: {m, n, k, dtype, impl, ms, tflops,
plan, trans_b}; impl is "fluxrt" or "cublas".
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_SHAPES = [(8192, 8192, 8192), (8192, 8192, 7168), (8192, 7168, 8192), (16384, 8192, 6144),
                  (4096, 8192, 7168)]   # (M, K, N)


def parse_shape(s: str) -> tuple[int, int, int]:
    parts = [int(x) for x in s.replace("x", ",").split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected M,K,N")
    return tuple(parts)


def describe(plan) -> str:
    """One-line plan text of the table and the JSON rows: GemmPlan.describe (C staging as a suffix of the epilogue,
    "epi=tma/shared"; split-K, stream-K and ping-pong as " k<n>", " sk", " pp")."""
    return plan.describe()


def idle_hook_runs(plan, m, n, trans_b, dtype) -> dict:
    """Runs with the hooks compiled in but never waiting: arrival flags already past the epoch, and
    (hooks-both) every tile routed to the local output through the storer warp, with per-tile signals.
    Their time over the plain kernel is the price of having the hooks in the kernel."""
    import cupy

    from fluxrt.gemm import ArrivalWait, TileDestinations, TileEpilogue, gemm_with_hooks

    chunk_rows = plan.block_m * max(1, (m // 4) // plan.block_m)      # ~4 chunks, as in a TP=4 AllGather
    chunks = -(-m // chunk_rows)
    n_tiles = -(-n // plan.block_n)
    per_chunk = (chunk_rows // plan.block_m) * n_tiles
    flags = cupy.ones(chunks, dtype=cupy.uint64)                       # epoch 1 already reached
    tile_flags = cupy.zeros(chunks * per_chunk, dtype=cupy.uint64)
    err = cupy.zeros(6, dtype=cupy.uint64)
    wait = ArrivalWait(flags=flags, epoch=1, chunk_rows=chunk_rows, err=err)
    flag_table = cupy.asarray(np.array([tile_flags.data.ptr + 8 * c * per_chunk for c in range(chunks)],
                                       dtype=np.uint64))
    epilogues = {}   # per output array: its chunk table (made once, outside the timed calls)

    def epilogue_for(c):
        if c.data.ptr not in epilogues:
            dests = TileDestinations([c.data.ptr + r * chunk_rows * c.strides[0] for r in range(chunks)], n, dtype)
            epilogues[c.data.ptr] = TileEpilogue(destinations=dests, chunk_rows=chunk_rows, flag_table=flag_table,
                                                 signal_value=1)
        return epilogues[c.data.ptr]

    def run_wait(a, b, c):
        gemm_with_hooks(a, b, c, trans_b=trans_b, plan=plan, wait=wait)

    # flag_table holds raw pointers into tile_flags: the closure keeps tile_flags alive as long as the
    # kernel may signal into it (a freed array was once reused and overwritten by those signals)
    def run_both(a, b, c, tile_flags=tile_flags):
        gemm_with_hooks(a, b, trans_b=trans_b, plan=plan, out_dtype=dtype, wait=wait, epilogue=epilogue_for(c))

    return {"hook-wait-idle": run_wait, "hooks-both-local": run_both}


def time_interleaved(fns: dict, sets, warmup: int, iters: int, rounds: int) -> dict:
    """Median milliseconds per fn, measured in `rounds` alternating blocks (A B C A B C ...), so that
    the GPU's clock and thermal drift during the run weighs on every implementation alike."""
    import cupy

    for fn in fns.values():
        for i in range(warmup):
            fn(*sets[i % len(sets)])
    cupy.cuda.get_current_stream().synchronize()
    per_round = max(1, iters // rounds)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            starts = [cupy.cuda.Event() for _ in range(per_round)]
            ends = [cupy.cuda.Event() for _ in range(per_round)]
            for i in range(per_round):
                starts[i].record()
                fn(*sets[i % len(sets)])
                ends[i].record()
            ends[-1].synchronize()
            samples[name] += [cupy.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)]
    return {name: float(np.median(v)) for name, v in samples.items()}


def build_parser() -> argparse.ArgumentParser:
    from fluxrt.perf.sweep import add_gemm_bench_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="*", default=DEFAULT_SHAPES, help="M,K,N ...")
    add_gemm_bench_arguments(ap, iters=50, warmup=10)
    ap.add_argument("--trans-b", action="store_true", help="B stored [N, K] (A @ B^T)")
    ap.add_argument("--order", choices=["grouped", "hilbert"], default=None, help="override the planner's order")
    ap.add_argument("--group-m", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--epilogue", choices=["tma", "direct"], default=None)
    ap.add_argument("--c-staging", choices=["per_consumer", "shared"], default=None,
                    help="C staging of the tma epilogue: one region per consumer, or one shared in turns")
    ap.add_argument("--variants", choices=["auto", "none"], default="auto",
                    help="auto: also time alternative plans (clusters, orders, group sizes, direct epilogue, "
                         "shared C staging) "
                         "so one run shows which default to pick")
    ap.add_argument("--hooks", choices=["idle", "none"], default="idle",
                    help="idle: also time the kernel with hook 1 compiled in and its flags already set "
                         "(cost of the arrival check alone) and with hooks 1+2 routing tiles to the local "
                         "output with per-tile signals (the storer-warp epilogue)")
    ap.add_argument("--sets", type=int, default=4, help="rotating input sets")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing blocks per comparison")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as a JSON list here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import cupy
    import ml_dtypes

    from fluxrt.gemm import gemm
    from fluxrt.gemm.plan import plan_gemm
    from fluxrt.perf.baselines import cublas_gemm

    np_dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"# device {dev.id}: {name}, dtype {args.dtype}, trans_b={args.trans_b}, "
          f"median of {args.iters} after {args.warmup} warm-up in {args.rounds} alternating blocks, {args.sets} rotating input sets")
    hdr = f"{'M':>6} {'K':>6} {'N':>6} | {'cuBLAS ms':>9} {'TFLOP/s':>8} | {'fluxrt ms':>9} {'TFLOP/s':>8} | {'ratio':>6} | plan"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for (m, k, n) in args.shapes:
        plan = plan_gemm(m, n, k, in_dtype=args.dtype, out_dtype=args.dtype)
        over = {f: v for f, v in (("order", args.order), ("group_m", args.group_m), ("block_n", args.block_n),
                                  ("stages", args.stages), ("epilogue", args.epilogue),
                                  ("c_staging", args.c_staging)) if v is not None}
        if over:
            plan = dataclasses.replace(plan, **over).validate(args.dtype)
        rng = cupy.random.default_rng(0)
        sets = []
        for _ in range(args.sets):
            a = (rng.standard_normal((m, k), dtype=cupy.float32) + 0.1).astype(np_dt)
            b_shape = (n, k) if args.trans_b else (k, n)
            b = (rng.standard_normal(b_shape, dtype=cupy.float32) + 0.1).astype(np_dt)
            c = cupy.empty((m, n), dtype=np_dt)
            sets.append((a, b, c))
        flops = 2.0 * m * n * k
        use_matmul = True
        try:
            a, b, c = sets[0]
            cupy.matmul(a, b.T if args.trans_b else b, out=c)
        except Exception as e:  # dtype not supported by this CuPy's matmul: call cuBLAS directly
            print(f"# cupy.matmul failed ({type(e).__name__}: {e}); timing cublasGemmEx directly", file=sys.stderr)
            use_matmul = False

        def run_cublas(a, b, c):
            if use_matmul:
                cupy.matmul(a, b.T if args.trans_b else b, out=c)
            else:
                cublas_gemm(a, b, c, args.trans_b, cupy.cuda.get_current_stream().ptr)()

        def run_fluxrt(a, b, c, plan=plan):
            gemm(a, b, c, trans_b=args.trans_b, plan=plan)

        variants = {}
        hooked = {}
        if args.hooks == "idle":
            hooked = idle_hook_runs(plan, m, n, args.trans_b, args.dtype)
        if args.variants == "auto":
            r = dataclasses.replace
            variants = {
                "cluster1": r(plan, cluster=1),
                "cluster2": r(plan, cluster=2),
                "cluster2-hilbert": r(plan, cluster=2, order="hilbert"),
                "cluster2-group32": r(plan, cluster=2, group_m=32),
                "cluster2-group8": r(plan, cluster=2, group_m=8),
                "direct-s4": r(plan, epilogue="direct", c_staging="per_consumer", stages=4),
                "cluster2-direct-s4": r(plan, cluster=2, epilogue="direct", c_staging="per_consumer", stages=4),
                "shared-s4": r(plan, epilogue="tma", c_staging="shared", stages=4),
                "cluster2-shared-s4": r(plan, cluster=2, epilogue="tma", c_staging="shared", stages=4),
                "group32": r(plan, group_m=32),
            }
            variants = {k: v for k, v in variants.items() if v != plan}

        def check(what, run):
            """Relative difference to cuBLAS on the first input set (a sanity check; the tests hold
            the float64 references)."""
            a, b, c = sets[0]
            ref = cupy.empty_like(c)
            run_cublas(a, b, ref)
            run(a, b, c)
            r64, c64 = ref.astype(cupy.float64), c.astype(cupy.float64)
            err = float(cupy.linalg.norm(c64 - r64) / cupy.linalg.norm(r64))
            if not err < 1e-2:
                print(f"!! {what} disagrees with cuBLAS at M={m} K={k} N={n}: rel err {err:.3e}", file=sys.stderr)

        if args.check:
            check("fluxrt", run_fluxrt)
        times = time_interleaved({"cublas": run_cublas, "fluxrt": run_fluxrt, **hooked},
                                 sets, args.warmup, args.iters, args.rounds)
        t_cublas, t_fluxrt = times["cublas"], times["fluxrt"]
        plan_s = describe(plan)
        for impl, ms in (("cublas", t_cublas), ("fluxrt", t_fluxrt)):
            rows.append({"m": m, "n": n, "k": k, "dtype": args.dtype, "impl": impl, "ms": ms,
                         "tflops": flops / ms / 1e9, "trans_b": args.trans_b,
                         "plan": plan_s if impl == "fluxrt" else None, "device": name})
        print(f"{m:>6} {k:>6} {n:>6} | {t_cublas:9.3f} {flops / t_cublas / 1e9:8.1f} | {t_fluxrt:9.3f} "
              f"{flops / t_fluxrt / 1e9:8.1f} | {t_cublas / t_fluxrt:6.3f} | {plan_s}")
        for hname in hooked:
            t_h = times[hname]
            rows.append({"m": m, "n": n, "k": k, "dtype": args.dtype, "impl": f"fluxrt:{hname}", "ms": t_h,
                         "tflops": flops / t_h / 1e9, "trans_b": args.trans_b, "plan": plan_s, "device": name,
                         "vs_no_hooks": t_h / t_fluxrt})
            print(f"{'':>6} {'':>6} {'':>6} | {'':>9} {'':>8} | {t_h:9.3f} {flops / t_h / 1e9:8.1f} | "
                  f"{t_cublas / t_h:6.3f} |   {hname}: {100 * (t_h / t_fluxrt - 1):+.2f}% vs no hooks")
        for vname, vplan in variants.items():
            try:
                vplan.validate(args.dtype)
                run_variant = functools.partial(run_fluxrt, plan=vplan)
                if args.check:
                    check(f"variant {vname}", run_variant)
                vt = time_interleaved({"cublas": run_cublas, "variant": run_variant},
                                      sets, args.warmup, args.iters, args.rounds)
                t_v, t_vc = vt["variant"], vt["cublas"]
            except Exception as e:  # a variant that does not fit or fails must not stop the table
                print(f"   variant {vname}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            vs = describe(vplan)
            rows.append({"m": m, "n": n, "k": k, "dtype": args.dtype, "impl": f"fluxrt:{vname}", "ms": t_v,
                         "tflops": flops / t_v / 1e9, "trans_b": args.trans_b, "plan": vs, "device": name,
                         "cublas_ms_same_blocks": t_vc})
            print(f"{'':>6} {'':>6} {'':>6} | {t_vc:9.3f} {flops / t_vc / 1e9:8.1f} | {t_v:9.3f} {flops / t_v / 1e9:8.1f} | "
                  f"{t_vc / t_v:6.3f} |   variant {vname}: {vs}")
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        from fluxrt.perf import results_document, write_json

        machine = {"gpu_name": rows[0]["device"] if rows else "unknown", "gpu_count": 1}
        write_json(args.json, results_document("gemm", rows, ["python3", "perf/bench_gemm.py", *sys.argv[1:]],
                                               machine=machine))
        print(f"# wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
