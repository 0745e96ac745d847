#!/usr/bin/env python3
"""Stream-K against the plans before it, per shape: kernel times of every autotune candidate (fluxrt.gemm.autotune's
set: whole tiles, split-K, stream-K) beside cuBLAS (cublasGemmEx on the same stream, alternating blocks), and
which of them the heuristic picks with and without stream-K.

    python3 perf/gemm_stream_k.py --json $OUT/stream-k.json
    python3 perf/gemm_stream_k.py --shapes 461,9128,13208,NK 9166,664,12896,NK

Per shape (M, N, K, layout of B): cuBLAS's time; every candidate's time (back-to-back launches between CUDA
events, the minimum over rounds of the mean, as autotune times them); "heuristic_before" / "heuristic_after": the
heuristic's plan without / with the stream-K plans; "tuned_before" / "tuned_after": the fastest candidate without
/ with them. Ratios are cuBLAS time / fluxrt time (> 1: fluxrt faster). The full user-level comparison (eager
calls and graph replays, the cached tuned plan) is perf/gemm_suite.py --shapes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The shapes of the shape suite furthest below cuBLAS before stream-K (perf/results/gemm-suite-tuned-*): small M
# streaming B, and partial last waves of big problems.
DEFAULT_SHAPES = [(461, 9128, 13208, "NK"), (256, 9216, 7168, "NK"), (256, 9216, 16384, "NK"),
                  (256, 26624, 16384, "NK"), (256, 10240, 8192, "NK"), (256, 7168, 16384, "NK"),
                  (256, 7168, 9216, "NK"), (256, 7168, 8192, "NK"), (256, 7168, 2048, "NK"), (256, 4096, 6144, "NK"),
                  (9166, 664, 12896, "NK"), (6335, 2072, 12464, "KN"), (6580, 1000, 7952, "NK"),
                  (6737, 2464, 9960, "KN"), (2692, 1960, 8424, "KN"), (4096, 1280, 8192, "KN"),
                  (2048, 2560, 8192, "NK"), (1024, 1024, 6144, "KN"), (1024, 5120, 8192, "KN")]


def parse_shape(s: str):
    m, n, k, layout = s.split(",")
    if layout not in ("NK", "KN"):
        raise argparse.ArgumentTypeError(f"shape {s!r}: layout NK or KN")
    return int(m), int(n), int(k), layout


def _events_us(fn, stream, reps: int, rounds: int) -> float:
    import cupy

    best = float("inf")
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return best


def run_shape(m: int, n: int, k: int, layout: str, dtype: str, reps: int, rounds: int) -> dict:
    import cupy
    import ml_dtypes

    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.kernel import _num_sms
    from fluxrt.gemm.launch import _prepare
    from fluxrt.gemm.plan import heuristic_plan
    from fluxrt.perf.baselines import cublas_gemm

    trans_b = layout == "NK"
    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    rng = cupy.random.default_rng(m * 7 + n * 3 + k)
    a = (rng.standard_normal((m, k), dtype=cupy.float32) + 0.1).astype(np_dt)
    w = (rng.standard_normal((n, k) if trans_b else (k, n), dtype=cupy.float32) + 0.1).astype(np_dt)
    c_ref = cupy.empty((m, n), dtype=np_dt)
    c = cupy.empty((m, n), dtype=np_dt)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    sms = _num_sms(cupy.cuda.runtime.getDevice())
    run_cublas = cublas_gemm(a, w, c_ref, trans_b, stream.ptr)
    cands = candidates(m, n, k, dtype, sms)
    launches = []
    for plan in cands:
        try:
            packed, _, _ = _prepare(a, w, c, trans_b=trans_b, plan=plan, out_dtype=None, wait=None, epilogue=None,
                                    stream_ptr=stream.ptr)
            launches.append((plan, packed))
        except Exception as e:   # a candidate that does not build is reported, not fatal
            print(f"#   {plan.describe()}: {type(e).__name__}: {e}", flush=True)
    with stream:
        run_cublas()
        for _, p in launches:
            p.launch(stream.ptr)
        stream.synchronize()
        r64 = c_ref.astype(cupy.float64)
        times = {plan: [] for plan, _ in launches}
        cublas = []
        errs = {}
        for plan, p in launches:   # correctness of every candidate against cuBLAS (same inputs)
            c.fill(0)
            p.launch(stream.ptr)
            stream.synchronize()
            errs[plan] = float(cupy.linalg.norm(c.astype(cupy.float64) - r64) / cupy.linalg.norm(r64))
        for _ in range(rounds):   # alternating blocks: cuBLAS, then every candidate
            cublas.append(_events_us(run_cublas, stream, reps, 1))
            for plan, p in launches:
                times[plan].append(_events_us(lambda: p.launch(stream.ptr), stream, reps, 1))
    cublas_us = float(np.median(cublas))
    us = {plan: float(np.median(t)) for plan, t in times.items()}
    row = {"m": m, "n": n, "k": k, "layout": layout, "dtype": dtype, "cublas_us": cublas_us,
           "candidates": [{"plan": p.describe(), "us": round(us[p], 3), "ratio": round(cublas_us / us[p], 4),
                           "rel_err_vs_cublas": errs[p]} for p in us]}
    for name, sk in (("before", False), ("after", True)):
        hp = heuristic_plan(m, n, k, in_dtype=dtype, out_dtype=dtype, trans_b=trans_b, num_sms=sms, stream_k=sk)
        row[f"heuristic_{name}_plan"] = hp.describe()
        if hp in us:
            row[f"heuristic_{name}_us"] = us[hp]
            row[f"heuristic_{name}_ratio"] = cublas_us / us[hp]
        pool = [p for p in us if sk or not p.stream_k]
        best = min(pool, key=lambda p: us[p])
        row[f"tuned_{name}_plan"] = best.describe()
        row[f"tuned_{name}_us"] = us[best]
        row[f"tuned_{name}_ratio"] = cublas_us / us[best]
    sks = [p for p in us if p.stream_k]
    if sks:
        best = min(sks, key=lambda p: us[p])
        row["best_stream_k_plan"], row["best_stream_k_ratio"] = best.describe(), cublas_us / us[best]
    row["worst_rel_err_vs_cublas"] = max(errs.values()) if errs else None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=DEFAULT_SHAPES, metavar="M,N,K,NK|KN")
    ap.add_argument("-d", "--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--reps", type=int, default=10, help="launches per timed block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed blocks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import cupy

    from fluxrt.perf.timing import geomean

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"# {name}, {args.dtype}; ratio = cuBLAS / fluxrt (kernel time)")
    print(f"{'M':>6} {'N':>6} {'K':>6} {'W':>2} | {'cuBLAS us':>9} | {'heur bef':>8} {'heur aft':>8} | "
          f"{'tuned bef':>9} {'tuned aft':>9} {'best sk':>7} | heuristic plan after / tuned plan after")
    rows = []
    t0 = time.time()
    for m, n, k, layout in args.shapes:
        try:
            r = run_shape(m, n, k, layout, args.dtype, args.reps, args.rounds)
        except Exception as e:
            print(f"{m:>6} {n:>6} {k:>6} {layout:>2} | FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"m": m, "n": n, "k": k, "layout": layout, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(r)
        f = lambda key: f"{r[key]:.3f}" if key in r else "-"   # noqa: E731
        print(f"{m:>6} {n:>6} {k:>6} {layout:>2} | {r['cublas_us']:9.1f} | {f('heuristic_before_ratio'):>8} "
              f"{f('heuristic_after_ratio'):>8} | {f('tuned_before_ratio'):>9} {f('tuned_after_ratio'):>9} "
              f"{f('best_stream_k_ratio'):>7} | {r['heuristic_after_plan']} / {r['tuned_after_plan']}", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    ok = [r for r in rows if "cublas_us" in r]
    summary = {"shapes": len(rows), "seconds": time.time() - t0}
    for key in ("heuristic_before_ratio", "heuristic_after_ratio", "tuned_before_ratio", "tuned_after_ratio"):
        vals = [r[key] for r in ok if key in r]
        summary[f"geomean_{key}"] = geomean(vals) if vals else None
        summary[f"below_0.95_{key}"] = sum(v < 0.95 for v in vals)
    print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if args.json:
        from fluxrt.perf import results_document, write_json

        # the table holds one row per shape; every candidate's time is kept beside it, per shape
        cands = {f"{r['m']}x{r['n']}x{r['k']} {r['layout']}": r.pop("candidates") for r in rows if "candidates" in r}
        doc = results_document("gemm-stream-k", rows, ["python3", "perf/gemm_stream_k.py", *(argv or sys.argv[1:])],
                               machine={"gpu_name": name, "gpu_count": 1})
        doc["summary"] = summary
        doc["candidates"] = cands
        doc["note"] = ("kernel times (CUDA events, back-to-back launches), ratio = cuBLAS / fluxrt; heuristic and "
                       "tuned before / after: without / with the stream-K plans; every candidate's time under "
                       "'candidates'")
        write_json(args.json, doc)
        print(f"# wrote {len(rows)} rows to {args.json}")
    bad = [r for r in ok if (r.get("worst_rel_err_vs_cublas") or 0) > 1e-2]
    if bad or len(ok) < len(rows):
        print(f"# {len(bad)} shapes with a candidate off cuBLAS by > 1e-2, {len(rows) - len(ok)} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
