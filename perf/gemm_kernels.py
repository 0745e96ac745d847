#!/usr/bin/env python3
"""Which kernel cuBLAS runs on each shape, beside fluxrt's plan, under Nsight Compute.

`run` makes one cublasGemmEx call and one fluxrt.gemm call per shape (after three warm-up calls each) inside a
profiler range; run it under ncu with the profiler range only and this script's metrics:

    ncu --clock-control none --profile-from-start off --csv --page raw --metrics $(python3 perf/gemm_kernels.py metrics) \\
        python3 perf/gemm_kernels.py run --plans-from perf/results/gemm-suite-tuned-bfloat16-....json > ncu.csv
    python3 perf/gemm_kernels.py summarize ncu.csv --plans-from <the same file> --json gemm-cublas-kernels.json

`summarize` pairs ncu's kernels with the shapes (per shape: cuBLAS's kernels, then fluxrt's) and writes, per shape,
cuBLAS's kernel name (its tile, K block x stages, cluster and raster), grid and cluster, both kernel times, and
the DRAM and L2 bytes both read. Times are of single calls with the clocks not locked: for what runs, not for
ratios (perf/gemm_suite.py times those). --plans-from takes a gemm_suite or `fluxrt.gemm tune` JSON (its rows'
shapes and plans); without it, the suite's shapes (--suite, --shapes) with the planner's plans.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METRICS = ("gpu__time_duration.sum", "launch__grid_size", "launch__cluster_dim_x", "launch__cluster_dim_y",
           "dram__bytes_read.sum", "lts__t_sectors_srcunit_tex_op_read.sum")
SECTOR_BYTES = 32


def shapes_and_plans(args) -> list[tuple]:
    """[(m, n, k, layout, GemmPlan or None)]: the file's rows, or the suite's shapes with the planner's plan."""
    from gemm_suite import pick_shapes, plans_from

    from fluxrt.perf.shapes import suite

    if args.plans_from:
        fixed = plans_from(args.plans_from, args.dtype)
        return [(m, n, k, lay, plan) for (m, n, k, lay), plan in fixed.items()]
    return [(s.m, s.n, s.k, s.layout, None) for s in pick_shapes(suite(args.suite), args.shapes)]


def run(args) -> int:
    import cupy

    from fluxrt.gemm import gemm, plan_for
    from fluxrt.perf.baselines import cublas_gemm
    from gemm_suite import _np_dtype

    np_dt = _np_dtype(args.dtype)
    calls = []
    for m, n, k, lay, plan in shapes_and_plans(args):
        tb = lay == "NK"
        plan = plan or plan_for(m, n, k, in_dtype=args.dtype, out_dtype=args.dtype, trans_b=tb)
        rng = cupy.random.default_rng(m * 7 + n * 3 + k)
        a = rng.standard_normal((m, k), dtype=cupy.float32).astype(np_dt)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=cupy.float32).astype(np_dt)
        c_ref, c = cupy.empty((m, n), dtype=np_dt), cupy.empty((m, n), dtype=np_dt)
        ours = (lambda a=a, b=b, c=c, tb=tb, plan=plan: gemm(a, b, c, trans_b=tb, plan=plan))
        theirs = cublas_gemm(a, b, c_ref, tb, cupy.cuda.get_current_stream().ptr)
        for _ in range(3):
            theirs()
            ours()
        calls.append((theirs, ours))
        print(f"# {m}x{n}x{k} {lay} {plan.describe()}", file=sys.stderr)
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    for theirs, ours in calls:
        theirs()
        ours()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()
    return 0


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def read_ncu_csv(path: Path) -> list[dict]:
    """ncu --csv --page raw: the kernels in launch order, each a dict of metric -> text (the header row is the one
    whose first cell is "ID"; the row after it holds the units; lines before it are the program's output)."""
    lines = Path(path).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"gemm_kernels: {path} holds no ncu CSV table (a line starting with \"ID\")")
    rows = list(csv.reader(lines[start:]))
    header, units = rows[0], rows[1]
    missing = [m for m in ("Kernel Name", *METRICS) if m not in header]
    if missing:
        raise SystemExit(f"gemm_kernels: {path} lacks {missing}: run ncu with --metrics "
                         f"{','.join(METRICS)}")
    if units[header.index("gpu__time_duration.sum")] not in ("ns", "nsecond"):
        raise SystemExit(f"gemm_kernels: kernel times in {units[header.index('gpu__time_duration.sum')]!r}, "
                         f"expected ns")
    return [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _total(kernels: list[dict], metric: str, scale: float = 1.0) -> float:
    return round(sum(_number(x[metric]) for x in kernels) * scale, 2)


def pair(kernels: list[dict], shapes: list[tuple]) -> list[dict]:
    """Per shape in order: cuBLAS's kernels (every kernel up to the first fluxrt one), then fluxrt's (names starting
    with fluxrt_). Shapes without both are left out (a run cut short)."""
    out, i = [], 0
    for m, n, k, lay, plan in shapes:
        theirs, ours = [], []
        while i < len(kernels) and not kernels[i]["Kernel Name"].startswith("fluxrt"):
            theirs.append(kernels[i])
            i += 1
        while i < len(kernels) and kernels[i]["Kernel Name"].startswith("fluxrt"):
            ours.append(kernels[i])
            i += 1
        if not theirs or not ours:
            break
        first = theirs[0]
        us = _total(theirs, "gpu__time_duration.sum", 1e-3), _total(ours, "gpu__time_duration.sum", 1e-3)
        out.append({
            "m": m, "n": n, "k": k, "layout": lay, "fluxrt_plan": plan.describe() if plan else None,
            "cublas_kernel": first["Kernel Name"], "cublas_kernels": len(theirs),
            "cublas_grid": int(_number(first["launch__grid_size"])),
            "cublas_cluster": f"{first['launch__cluster_dim_x']}x{first['launch__cluster_dim_y']}",
            "fluxrt_grid": int(_number(ours[0]["launch__grid_size"])),
            "cublas_us": us[0], "fluxrt_us": us[1], "ratio": round(us[0] / us[1], 3) if us[1] else None,
            "cublas_dram_read_mb": _total(theirs, "dram__bytes_read.sum", 1e-6),
            "fluxrt_dram_read_mb": _total(ours, "dram__bytes_read.sum", 1e-6),
            "cublas_l2_read_mb": _total(theirs, "lts__t_sectors_srcunit_tex_op_read.sum", SECTOR_BYTES * 1e-6),
            "fluxrt_l2_read_mb": _total(ours, "lts__t_sectors_srcunit_tex_op_read.sum", SECTOR_BYTES * 1e-6)})
    return out


def summarize(args) -> int:
    from fluxrt.perf import results_document, write_json

    kernels = read_ncu_csv(args.csv)
    shapes = shapes_and_plans(args)
    rows = pair(kernels, shapes)
    for r in rows:
        print(f"{r['m']:>6}x{r['n']:>6}x{r['k']:>6} {r['layout']} cuBLAS {r['cublas_us']:9.1f} us "
              f"fluxrt {r['fluxrt_us']:9.1f} us  {r['cublas_kernel'][:60]} | {r['fluxrt_plan']}")
    print(f"# {len(rows)} of {len(shapes)} shapes paired")
    if args.json:
        doc = results_document("gemm-cublas-kernels", rows,
                               ["python3", "perf/gemm_kernels.py", *sys.argv[1:]],
                               notes=["kernel times of one call each under Nsight Compute with the clocks not locked; "
                                      "l2_read_mb: lts__t_sectors_srcunit_tex_op_read x 32 B",
                                      f"{len(rows)} of {len(shapes)} shapes paired"])
        write_json(args.json, doc)
    return 0 if rows else 1


def build_parser() -> argparse.ArgumentParser:
    from fluxrt.perf.shapes import SUITES, shape_arg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("metrics", help="print the --metrics list ncu needs")
    for name in ("run", "summarize"):
        p = sub.add_parser(name)
        if name == "summarize":
            p.add_argument("csv", type=Path, help="ncu's --csv --page raw output of `run`")
            p.add_argument("--json", type=Path, default=None)
        p.add_argument("--plans-from", type=Path, default=None, metavar="JSON",
                       help="shapes and plans of a gemm_suite or tune result")
        p.add_argument("--suite", choices=sorted(SUITES), default="default")
        p.add_argument("--shapes", type=shape_arg, nargs="+", default=None, metavar="M,N,K,NK|KN")
        p.add_argument("-d", "--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "metrics":
        print(",".join(METRICS))
        return 0
    return run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    raise SystemExit(main())
