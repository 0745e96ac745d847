#!/usr/bin/env python3
"""Fit the GEMM planner's tile rates (fluxrt.gemm.plan.FIT_RATE of the fitted widths by default, or TILE_RATE entries
named with --keys) to autotuning passes.

An autotuning pass (``python -m fluxrt.gemm tune --suite default --json F``) times every candidate plan of every
shape. For a set of rates, the heuristic picks one plan per shape without measuring; its loss on a shape is the
time of that pick over the best candidate's. This script moves the chosen rates one at a time over a grid
(coordinate descent) to minimise the geometric mean of that loss over the passes given, and prints the rates,
the loss before and after, and every pick that changed. The rates go into plan.py by hand, their provenance
into docs/tuning.md.

    python3 perf/fit_tile_rates.py perf/results/gemm-tune-bfloat16-*.json              # the fitted widths
    python3 perf/fit_tile_rates.py F.json --keys 128x256x2 128x192x1 --grid 0.5 1.3 0.01
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.gemm import plan as P  # noqa: E402


def load(paths: list[Path]) -> list[dict]:
    """Rows (one per shape and pass) with every candidate's time: {m, n, k, trans_b, dtype, times}."""
    rows = []
    for path in paths:
        doc = json.loads(path.read_text())
        for r in doc.get("rows", []):
            times = {c["plan"]: c["us"] for c in r.get("candidates", []) if c.get("us")}
            if times:
                rows.append({"m": r["m"], "n": r["n"], "k": r["k"], "trans_b": r["layout"] == "NK",
                             "dtype": r.get("dtype", "bfloat16"), "times": times, "src": path.name})
    return rows


def picks(rows: list[dict]) -> list[str]:
    P.heuristic_plan.cache_clear()
    return [P.heuristic_plan(r["m"], r["n"], r["k"], in_dtype=r["dtype"], out_dtype=r["dtype"],
                             trans_b=r["trans_b"]).describe() for r in rows]


def loss(rows: list[dict], chosen: list[str]) -> tuple[float, int]:
    """Mean log(best / picked) (<= 0) over the rows, and how many picks were not timed in the pass (each counted
    as UNTIMED_LOSS, so that the fit does not move picks out of what was measured)."""
    total, missing = 0.0, 0
    for r, p in zip(rows, chosen):
        us = r["times"].get(p)
        if us is None:
            missing += 1
            total += UNTIMED_LOSS
            continue
        total += math.log(min(r["times"].values()) / us)
    return total / len(rows), missing


UNTIMED_LOSS = math.log(0.8)


class Rates:
    """The planner's rate of a tile shape: TILE_RATE's entry, or for a fitted width (block_n not a multiple of 64)
    its FIT_RATE entry."""

    def __getitem__(self, key):
        return P.FIT_RATE[key[1]] if key[1] % 64 else P.TILE_RATE[key]

    def __setitem__(self, key, value):
        if key[1] % 64:
            if key[:1] != (128,) or key[2] != 1:
                raise SystemExit(f"fitted widths have rates for 128-row tiles without a cluster only, not {key}")
            P.FIT_RATE[key[1]] = value
        else:
            P.TILE_RATE[key] = value


def key_of(text: str) -> tuple[int, int, int]:
    bm, bn, cl = (int(x) for x in text.split("x"))
    return bm, bn, cl


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("passes", nargs="+", type=Path, help="gemm-tune JSON files")
    ap.add_argument("--keys", nargs="+", default=None, metavar="BMxBNxCLUSTER",
                    help="rates to fit (default: the 128-row fitted widths, FIT_WIDTHS)")
    ap.add_argument("--grid", nargs=3, type=float, default=(0.50, 1.30, 0.01), metavar=("LO", "HI", "STEP"))
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)

    rows = load(args.passes)
    if not rows:
        ap.error("no rows with candidate times in the passes given")
    keys = [key_of(k) for k in args.keys] if args.keys else [(128, bn, 1) for bn in P.FIT_WIDTHS]
    rates = Rates()
    for key in keys:   # a fitted width without a FIT_RATE starts at what tile_rate gives it now
        rates[key] = round(P.tile_rate(*key), 3)
    before = {key: rates[key] for key in keys}
    chosen0 = picks(rows)
    loss0, missing0 = loss(rows, chosen0)
    lo, hi, step = args.grid
    grid = [round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1)]
    best = loss0
    for _ in range(args.rounds):
        moved = False
        for key in keys:
            keep = rates[key]
            scores = []
            for v in grid:
                rates[key] = v
                scores.append((loss(rows, picks(rows))[0], -abs(v - keep), v))
            top = max(scores)
            if top[0] > best + 1e-9:
                best, moved = top[0], True
                rates[key] = top[2]
            else:
                rates[key] = keep
        if not moved:
            break
    chosen1 = picks(rows)
    loss1, missing1 = loss(rows, chosen1)
    print(f"# {len(rows)} rows from {len(args.passes)} pass(es)")
    print(f"heuristic pick / best candidate, geomean: {math.exp(loss0):.4f} -> {math.exp(loss1):.4f}"
          f"  (picks not timed: {missing0} -> {missing1})")
    for key in keys:
        print(f"  {key}: {before[key]:.3f} -> {rates[key]:.3f}")
    print("changed picks (shape: before -> after, us):")
    for r, a, b in zip(rows, chosen0, chosen1):
        if a != b:
            ta, tb = r["times"].get(a), r["times"].get(b)
            fmt = lambda t: f"{t:.1f}" if t else "-"  # noqa: E731
            print(f"  {r['m']}x{r['n']}x{r['k']} {'NK' if r['trans_b'] else 'KN'}: {a} ({fmt(ta)}) -> {b} ({fmt(tb)})"
                  f"  best {min(r['times'].values()):.1f}")
    print("rates: " + ", ".join(f"{'FIT_RATE' if P.GemmPlan(block_n=k[1]).fitted_n else 'TILE_RATE'}[{k}]: "
                                f"{rates[k]:.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
