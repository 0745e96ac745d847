#!/usr/bin/env python3
"""Several runs of perf/gemm_suite.py, combined per shape: each run's ratios and their medians.

A shape's ratio (cuBLAS time / fluxrt time) moves by several percent between runs of the same plans and kernels
(clocks under a power cap, small M and eager timings most), so the shapes below a threshold in one run are partly
that run's noise. This reads gemm_suite JSON files of one dtype (the shapes all of them measured), writes per shape
the ratios of every run and their medians, and summarises the geometric means of the medians and the shapes whose
median is below the threshold, eager, graph and both.

    python3 perf/gemm_suite_repeat.py run1.json run2.json run3.json --json $OUT/gemm-suite-repeat.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.timing import geomean  # noqa: E402

TIMINGS = ("eager", "graph")


def _key(row: dict) -> tuple:
    return int(row["m"]), int(row["n"]), int(row["k"]), row["layout"]


def combine(runs: list[dict], threshold: float = 0.95) -> tuple[list[dict], dict]:
    """(rows, summary) of gemm_suite documents ``runs``: one row per shape every run measured in both timings, in the
    first run's order, with ``ratio_<timing>_runs`` (one per run) and ``ratio_<timing>_median``; the summary's
    geometric means are of the medians. ValueError for fewer than two runs or runs of different dtypes."""
    if len(runs) < 2:
        raise ValueError(f"gemm_suite_repeat: needs at least two runs, got {len(runs)}")
    dtypes = {r.get("dtype") for run in runs for r in run.get("rows", [])}
    if len(dtypes) != 1:
        raise ValueError(f"gemm_suite_repeat: the runs are of several dtypes {sorted(map(str, dtypes))}")
    tables = [{_key(r): r for r in run["rows"] if all(f"ratio_{t}" in r for t in TIMINGS)} for run in runs]
    rows = []
    for key in tables[0]:
        if not all(key in t for t in tables):
            continue
        first = tables[0][key]
        row = {"m": key[0], "n": key[1], "k": key[2], "layout": key[3], "label": first.get("label", ""),
               "plans": [t[key].get("plan") for t in tables]}
        for timing in TIMINGS:
            vals = [float(t[key][f"ratio_{timing}"]) for t in tables]
            row[f"ratio_{timing}_runs"] = [round(v, 4) for v in vals]
            row[f"ratio_{timing}_median"] = round(statistics.median(vals), 4)
        rows.append(row)
    if not rows:
        raise ValueError("gemm_suite_repeat: no shape measured in both timings by every run")

    def name(r):
        return f"{r['m']}x{r['n']}x{r['k']} {r['layout']}"

    summary = {"runs": len(runs), "shapes": len(rows), "threshold": threshold}
    for timing in TIMINGS:
        summary[f"geomean_{timing}_of_medians"] = round(geomean(r[f"ratio_{timing}_median"] for r in rows), 4)
        summary[f"below_{timing}_median"] = [name(r) for r in rows if r[f"ratio_{timing}_median"] < threshold]
    summary["below_both_medians"] = [name(r) for r in rows
                                     if all(r[f"ratio_{t}_median"] < threshold for t in TIMINGS)]
    summary["below_both_per_run"] = [sum(all(r[f"ratio_{t}_runs"][i] < threshold for t in TIMINGS) for r in rows)
                                     for i in range(len(runs))]
    summary["plans_differ"] = [name(r) for r in rows if len(set(r["plans"])) > 1]
    return rows, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="gemm_suite --json files of one dtype")
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = [json.loads(p.read_text()) for p in args.runs]
    try:
        rows, summary = combine(runs, args.threshold)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"# {summary['shapes']} shapes, {summary['runs']} runs: geomean of the medians eager "
          f"{summary['geomean_eager_of_medians']:.3f}, graph {summary['geomean_graph_of_medians']:.3f}; below "
          f"{args.threshold} in both medians: {len(summary['below_both_medians'])} (per run: "
          f"{', '.join(map(str, summary['below_both_per_run']))})")
    for r in rows:
        if min(r["ratio_eager_median"], r["ratio_graph_median"]) < args.threshold:
            print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} {r['layout']} | eager {r['ratio_eager_median']:.3f} "
                  f"{r['ratio_eager_runs']} | graph {r['ratio_graph_median']:.3f} {r['ratio_graph_runs']}")
    if args.json:
        from fluxrt.perf import results_document, write_json

        first = runs[0]
        doc = results_document("gemm-suite-repeat", rows,
                               ["python3", "perf/gemm_suite_repeat.py", *(argv if argv is not None else sys.argv[1:])],
                               machine=first.get("machine"),
                               notes=[f"runs: {', '.join(p.name for p in args.runs)} (commits "
                                      f"{', '.join(str(r.get('commit')) for r in runs)})"])
        doc["summary"] = summary
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
