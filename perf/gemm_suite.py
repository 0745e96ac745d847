#!/usr/bin/env python3
"""fluxrt.gemm against cuBLAS over a shape suite (fluxrt.perf.shapes), as a user calls them.

cuBLAS is called through cublasGemmEx (libcublas through ctypes, fp32 compute, default algorithm) on the
same stream: what cupy.matmul runs, without CuPy's own host overhead, and capturable in a CUDA graph
(CuPy's binding refuses capture). cupy.matmul's eager time is recorded beside it (matmul_eager_ms).
``--lt`` adds cuBLASLt at its best per shape (the fastest of its heuristic's first 8 algorithms, timed on
the shape; nvmath-python's bindings, fluxrt.perf.cublaslt): columns cublaslt_*, ratios *_lt.

Per shape and implementation, in alternating rounds on one stream (the order reversed every other round; medians):
  eager   `iters` back-to-back calls between two CUDA events: host time included, as a user sees it
          (below ~20 us of GPU work per call the GPU waits for Python)
  graph   the same calls captured once in a CUDA graph and replayed: kernel time only
  host    host time of one eager call: wall time of issuing the calls / iters (the launch queue never fills)

    python3 perf/gemm_suite.py --suite default -d bf16 --json $OUT/gemm-suite.json
    python3 perf/gemm_suite.py --shapes 461,9128,13208,NK 8200,8200,8192,KN   # any shapes (suite labels kept)
    python3 perf/gemm_suite.py --plans-from perf/results/gemm-suite-tuned-....json   # its shapes and plans: an A/B
                                                              # of two kernel trees, one process on each

Ratios are cuBLAS time / fluxrt time (> 1: fluxrt faster); geometric means over the suite at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.baselines import cublas_gemm  # noqa: E402
from fluxrt.perf.cublaslt import describe_config  # noqa: E402
from fluxrt.perf.shapes import SUITES, Shape, shape_arg, suite  # noqa: E402
from fluxrt.perf.timing import capture, eager_ms_and_host_us, geomean, graph_ms  # noqa: E402


def _np_dtype(name: str):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float16)


def round_order(impls: dict, i: int) -> list[str]:
    """The implementations in round i: in order on even rounds, reversed on odd ones, so that over an even number
    of rounds each runs as often first as last (a GPU's clocks drift within a round under a power cap)."""
    names = list(impls)
    return names if i % 2 == 0 else names[::-1]


def timed_rounds(impls: dict, rounds: int, time_one) -> dict[str, list]:
    """{name: [time_one(impl) of each round]}, the implementations of each round in :func:`round_order`."""
    out = {name: [] for name in impls}
    for i in range(rounds):
        for name in round_order(impls, i):
            out[name].append(time_one(impls[name]))
    return out


def bench_shape(s: Shape, dtype: str, iters: int, rounds: int, graphs: bool, autotune: bool, check: bool,
                lt=None, plan=None) -> dict:
    """One shape: cuBLAS, fluxrt (the planner's plan, or `plan`) and cuBLASLt (with `lt`), eager and graph."""
    import cupy

    from fluxrt.gemm import gemm, plan_for

    np_dt = _np_dtype(dtype)
    rng = cupy.random.default_rng(s.m * 7 + s.n * 3 + s.k)
    a = (rng.standard_normal((s.m, s.k), dtype=cupy.float32) + 0.1).astype(np_dt)
    w = (rng.standard_normal((s.n, s.k) if s.trans_b else (s.k, s.n), dtype=cupy.float32) + 0.1).astype(np_dt)
    wm = w.T if s.trans_b else w
    c_ref = cupy.empty((s.m, s.n), dtype=np_dt)
    c = cupy.empty((s.m, s.n), dtype=np_dt)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()   # the operands, made on the current stream, before any call on `stream`
    if autotune:
        from fluxrt.gemm import autotune as tune

        with stream:
            tune(a, w, trans_b=s.trans_b)
    forced = plan
    plan = forced or plan_for(s.m, s.n, s.k, in_dtype=dtype, out_dtype=dtype, trans_b=s.trans_b)

    run_cublas = cublas_gemm(a, w, c_ref, s.trans_b, stream.ptr)

    def run_matmul():
        cupy.matmul(a, wm, out=c_ref)

    def run_fluxrt():
        gemm(a, w, c, trans_b=s.trans_b, stream=stream, plan=forced)

    row = {"m": s.m, "n": s.n, "k": s.k, "layout": s.layout, "label": s.label, "dtype": dtype,
           "plan": plan.describe()}
    impls = {"cublas": run_cublas, "fluxrt": run_fluxrt}
    if lt is not None:   # cuBLASLt at its best for the shape (fluxrt.perf.cublaslt), on its own output
        c_lt = cupy.empty_like(c)
        impls["cublaslt"] = lt.gemm(a, w, c_lt, trans_b=s.trans_b, stream=stream)
        row["cublaslt_algo"] = impls["cublaslt"].choice.index
        row["cublaslt_config"] = describe_config(impls["cublaslt"].choice.config)
    with stream:
        run_cublas()
        run_fluxrt()
        stream.synchronize()
        if check:
            r64, c64 = c_ref.astype(cupy.float64), c.astype(cupy.float64)
            row["rel_err_vs_cublas"] = float(cupy.linalg.norm(c64 - r64) / cupy.linalg.norm(r64))
            if lt is not None:
                l64 = c_lt.astype(cupy.float64)
                row["rel_err_cublaslt_vs_cublas"] = float(cupy.linalg.norm(l64 - r64) / cupy.linalg.norm(r64))
        for fn in impls.values():   # warm-up
            for _ in range(3):
                fn()
        stream.synchronize()
        timed = timed_rounds(impls, rounds, lambda fn: eager_ms_and_host_us(fn, iters, stream))
        for name, pairs in timed.items():
            eager = [ms for ms, _ in pairs]
            row[f"{name}_eager_ms"] = float(np.median(eager))
            row[f"{name}_host_us"] = float(np.median([us for _, us in pairs]))
            row[f"{name}_eager_rounds_ms"] = [round(float(t), 5) for t in eager]
        row["ratio_eager"] = row["cublas_eager_ms"] / row["fluxrt_eager_ms"]
        if lt is not None:
            row["ratio_eager_lt"] = row["cublaslt_eager_ms"] / row["fluxrt_eager_ms"]
        row["matmul_eager_ms"] = float(np.median([eager_ms_and_host_us(run_matmul, iters, stream)[0] for _ in range(rounds)]))
        if graphs:
            try:
                gs = {name: capture(fn, iters, stream) for name, fn in impls.items()}
                for g in gs.values():
                    g.launch(stream)
                times = timed_rounds(gs, rounds, lambda g: graph_ms(g, iters, stream))
                for name in times:
                    row[f"{name}_graph_ms"] = float(np.median(times[name]))
                    row[f"{name}_graph_rounds_ms"] = [round(float(t), 5) for t in times[name]]
                row["ratio_graph"] = row["cublas_graph_ms"] / row["fluxrt_graph_ms"]
                if lt is not None:
                    row["ratio_graph_lt"] = row["cublaslt_graph_ms"] / row["fluxrt_graph_ms"]
            except Exception as e:   # a capture failure is reported, not fatal to the sweep
                row["graph_error"] = f"{type(e).__name__}: {e}"
        stream.synchronize()
    return row


def pick_shapes(suite_shapes: list[Shape], wanted: list[Shape] | None) -> list[Shape]:
    """The suite, or the wanted shapes in the order given, each with its suite label where it has one."""
    if not wanted:
        return list(suite_shapes)
    known = {s.key(): s for s in suite_shapes}
    return [known.get(w.key(), w) for w in wanted]


def build_parser() -> argparse.ArgumentParser:
    from fluxrt.perf.sweep import add_gemm_bench_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="default", choices=sorted(SUITES))
    add_gemm_bench_arguments(ap, iters=20)   # -n: calls per timed block
    ap.add_argument("--rounds", type=int, default=4,
                    help="timed blocks per implementation, the order reversed every other round")
    ap.add_argument("--no-graph", action="store_true", help="eager calls only")
    ap.add_argument("--autotune", action="store_true", help="tune each shape first (fluxrt.gemm.autotune)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the suite's first N shapes")
    ap.add_argument("--limit", type=int, default=None, help="first N shapes of the suite only")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="M,N,K,NK|KN", type=shape_arg,
                    help="these shapes instead of the suite (e.g. 461,9128,13208,NK; NK: B stored [N, K]); a shape "
                         "of the suite keeps its label")
    ap.add_argument("--lt", action="store_true",
                    help="also time cuBLASLt at its best per shape (needs nvmath-python: fluxrt.perf.cublaslt)")
    ap.add_argument("--plan", type=plan_arg, default=None, metavar="FIELD=VALUE,...",
                    help="fluxrt runs this plan on every shape instead of the planner's: GemmPlan fields over its "
                         "defaults, e.g. cluster=2,block_n=192,stages=4 (an A/B of plans in one job)")
    ap.add_argument("--plans-from", type=Path, default=None, metavar="JSON",
                    help="the shapes and, per shape, the plan of an earlier gemm_suite or `fluxrt.gemm tune` JSON (its "
                         "rows' m, n, k, layout and plan): the same plans on another kernel tree or machine; with "
                         "--shapes, those of them the file has")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def plans_from(path: Path, dtype: str) -> dict:
    """(m, n, k, layout) -> GemmPlan of the rows of an earlier result of this dtype (rows without a plan, e.g.
    failed shapes, are left out)."""
    from fluxrt.gemm.plan import GemmPlan

    rows = json.loads(Path(path).read_text()).get("rows", [])
    out = {}
    for r in rows:
        if r.get("plan") and r.get("dtype", dtype) == dtype:
            out[(int(r["m"]), int(r["n"]), int(r["k"]), r["layout"])] = GemmPlan.parse(r["plan"]).validate(dtype)
    if not out:
        raise SystemExit(f"gemm_suite: {path} has no {dtype} rows with a plan")
    return out


def plan_arg(text: str):
    """FIELD=VALUE,... -> a validated GemmPlan (the defaults elsewhere; consumers follow block_m: 1 for 64 rows, else 2)."""
    import dataclasses

    from fluxrt.gemm.plan import GemmPlan, consumers_for

    fields = {f.name: f for f in dataclasses.fields(GemmPlan)}
    kw = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        if key in ("order", "epilogue", "c_staging"):
            kw[key] = value
        elif key == "stream_k":
            if value.lower() not in ("0", "1", "true", "false"):
                raise argparse.ArgumentTypeError(f"{item!r}: stream_k is 0, 1, true or false")
            kw[key] = value.lower() in ("1", "true")
        elif value.lstrip("-").isdigit():
            kw[key] = int(value)
        else:
            raise argparse.ArgumentTypeError(f"{item!r}: {key} takes an integer")
    if "block_m" in kw and "consumers" not in kw:
        kw["consumers"] = consumers_for(kw["block_m"])
    try:
        return GemmPlan(**kw).validate()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if (args.plan is not None) + (args.plans_from is not None) + bool(args.autotune) > 1:
        ap.error("--plan, --plans-from and --autotune exclude each other (each fixes fluxrt's plan)")
    fixed = plans_from(args.plans_from, args.dtype) if args.plans_from else None

    import cupy

    shapes = pick_shapes(suite(args.suite), args.shapes)
    if fixed is not None:   # the file's shapes (those of --shapes it has), in its order
        wanted = {(s.m, s.n, s.k, s.layout) for s in shapes} if args.shapes else None
        shapes = [Shape(m, n, k, layout=lay, label="cli") for (m, n, k, lay) in fixed
                  if wanted is None or (m, n, k, lay) in wanted]
        shapes = pick_shapes(suite(args.suite), shapes)   # suite shapes keep their labels
    shapes = shapes[args.skip:][: args.limit]
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"# {name}, {args.dtype}, suite {args.suite} ({len(shapes)} shapes), {args.iters} calls x {args.rounds} "
          f"rounds, autotune={'on' if args.autotune else 'off'}"
          f"{', plan ' + args.plan.describe() if args.plan else ''}; ratio = cuBLAS / fluxrt")
    hdr = (f"{'M':>6} {'N':>6} {'K':>6} {'W':>2} | {'eager cuBLAS':>12} {'fluxrt':>8} {'ratio':>6} | "
           f"{'graph cuBLAS':>12} {'fluxrt':>8} {'ratio':>6} | {'host us':>11} | plan")
    print(hdr)
    print("-" * len(hdr))
    lt = None
    if args.lt:
        from fluxrt.perf.cublaslt import CublasLt

        lt = CublasLt()
    rows = []
    t_start = time.time()
    for s in shapes:
        try:
            plan = fixed[(s.m, s.n, s.k, s.layout)] if fixed is not None else args.plan
            r = bench_shape(s, args.dtype, args.iters, args.rounds, not args.no_graph, args.autotune, bool(args.check),
                            lt, plan)
        except Exception as e:
            print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout:>2} | FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"m": s.m, "n": s.n, "k": s.k, "layout": s.layout, "label": s.label, "dtype": args.dtype,
                         "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(r)
        g = (f"{r['cublas_graph_ms']:12.4f} {r['fluxrt_graph_ms']:8.4f} {r['ratio_graph']:6.3f}"
             if "ratio_graph" in r else f"{'-':>12} {'-':>8} {'-':>6}")
        err = r.get("rel_err_vs_cublas", 0.0)
        flag = "  !! rel err %.2e" % err if err > 1e-2 else ""
        print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout:>2} | {r['cublas_eager_ms']:12.4f} {r['fluxrt_eager_ms']:8.4f} "
              f"{r['ratio_eager']:6.3f} | {g} | {r['fluxrt_host_us']:5.1f}/{r['cublas_host_us']:5.1f} | {r['plan']}{flag}"
              + (f" | lt: {r['cublaslt_config']}" if r.get("cublaslt_config") else ""),
              flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
        if args.json:   # after every shape: a run cut short keeps what it measured
            _write(args, argv, name, rows, summarize(rows, len(shapes), lt is not None, t_start))
    summary = summarize(rows, len(shapes), lt is not None, t_start)
    print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if args.json:
        _write(args, argv, name, rows, summary)
        print(f"# wrote {len(rows)} rows to {args.json}")
    bad = [r for r in rows if "error" in r or r.get("rel_err_vs_cublas", 0.0) > 1e-2]
    if bad:
        print(f"# {len(bad)} shapes failed or disagree with cuBLAS (rel err > 1e-2)", file=sys.stderr)
    return 1 if bad else 0


def _write(args, argv, gpu_name: str, rows: list[dict], summary: dict) -> None:
    from fluxrt.perf import results_document, write_json

    doc = results_document("gemm-suite", rows, ["python3", "perf/gemm_suite.py", *(argv or sys.argv[1:])],
                           machine={"gpu_name": gpu_name, "gpu_count": 1})
    doc["summary"] = summary
    write_json(args.json, doc)


SHAPE_CLASSES = ("aligned", "k_off_lines", "b_off_sectors", "small_m")


def shape_class(m: int, n: int, k: int, layout: str) -> str:
    """Which of the populations that lose for different reasons a shape belongs to (kernels/gemm/NOTES.md):
    small_m (M <= 512: B streamed once, few tile rows), b_off_sectors (B's rows not whole 32-byte sectors),
    k_off_lines (K % 64 != 0: A's rows not whole 128-byte lines), else aligned."""
    from fluxrt.gemm.plan import misaligned_b_rows

    if m <= 512:
        return "small_m"
    if misaligned_b_rows(n, k, layout == "NK"):
        return "b_off_sectors"
    return "k_off_lines" if k % 64 else "aligned"


def summarize(rows: list[dict], n_shapes: int, with_lt: bool, t_start: float) -> dict:
    """Geometric means, counts below 0.95, worst ratios and median host times of the measured rows; per shape
    class (:func:`shape_class`) the count and the geometric mean of its graph ratios (eager where none has one)."""
    ok = [r for r in rows if "ratio_eager" in r]
    summary = {"shapes": n_shapes, "measured": len(ok),
               "geomean_eager": geomean(r["ratio_eager"] for r in ok),
               "geomean_graph": geomean(r.get("ratio_graph") for r in ok),
               # eager against cupy.matmul: cuBLAS as a CuPy user calls it, CuPy's host cost included
               "geomean_eager_vs_cupy_matmul": geomean(r["matmul_eager_ms"] / r["fluxrt_eager_ms"] for r in ok),
               "below_0.95_eager": sum(r["ratio_eager"] < 0.95 for r in ok),
               "below_0.95_graph": sum(r.get("ratio_graph", 1) < 0.95 for r in ok),
               # below in both timings: a loss, not a timing's noise (eager and graph time the same kernels)
               "below_0.95_both": sum(max(r["ratio_eager"], r.get("ratio_graph", 0)) < 0.95 for r in ok),
               "worst_eager": min((r["ratio_eager"] for r in ok), default=None),
               "worst_graph": min((r["ratio_graph"] for r in ok if "ratio_graph" in r), default=None),
               "median_host_us_fluxrt": float(np.median([r["fluxrt_host_us"] for r in ok])) if ok else None,
               "median_host_us_cublas": float(np.median([r["cublas_host_us"] for r in ok])) if ok else None,
               "seconds": time.time() - t_start}
    if with_lt:
        summary.update({"geomean_eager_vs_cublaslt": geomean(r.get("ratio_eager_lt") for r in ok),
                        "geomean_graph_vs_cublaslt": geomean(r.get("ratio_graph_lt") for r in ok),
                        "below_0.95_graph_vs_cublaslt": sum(r.get("ratio_graph_lt", 1) < 0.95 for r in ok),
                        "worst_graph_vs_cublaslt": min((r["ratio_graph_lt"] for r in ok if "ratio_graph_lt" in r),
                                                       default=None)})
    for cls in SHAPE_CLASSES:
        mine = [r for r in ok if shape_class(r["m"], r["n"], r["k"], r["layout"]) == cls]
        if mine:
            summary[f"shapes_{cls}"] = len(mine)
            graph = [r["ratio_graph"] for r in mine if "ratio_graph" in r]
            summary[f"geomean_{cls}"] = geomean(graph) if graph else geomean(r["ratio_eager"] for r in mine)
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
