#!/usr/bin/env python3
"""Split-K where K does not cut into equal 16-byte slices: shapes whose split plans exist only with uneven
slices (plan.split_slices), measured as perf/gemm_suite.py measures a shape (cuBLAS through cublasGemmEx on
the same stream, eager and CUDA-graph replays), with the heuristic's plan and with the autotuned plan.

    python3 perf/gemm_split_uneven.py --json $OUT/split-uneven.json
    python3 perf/gemm_split_uneven.py --shapes 461,9128,13208,NK 256,9216,7168,NK

Per shape (M, N, K, layout of B): gemm_suite's row with the heuristic's plan; every autotune candidate timed
(fluxrt.gemm.autotune, force=True, into a private tune directory), the best among the plans that existed
before uneven slices ("before": no split, or K % (8 * split_k) == 0) and the best of all ("after"); then
gemm_suite's row with the tuned plan (the best of all). Ratios are cuBLAS time / fluxrt time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPES = [(461, 9128, 13208, "NK"), (256, 9216, 7168, "NK"), (256, 2560, 8192, "NK"),
                  (256, 1280, 8192, "NK"), (333, 4000, 7000, "KN"), (200, 6000, 11000, "NK")]


def parse_shape(s: str):
    m, n, k, layout = s.split(",")
    if layout not in ("NK", "KN"):
        raise argparse.ArgumentTypeError(f"shape {s!r}: layout NK or KN")
    return int(m), int(n), int(k), layout


def _suite_module():
    spec = importlib.util.spec_from_file_location("_gemm_suite", ROOT / "perf" / "gemm_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_shape(suite, m: int, n: int, k: int, layout: str, iters: int, rounds: int) -> dict:
    import cupy

    from fluxrt.gemm import autotune
    from fluxrt.gemm.autotune import candidates
    from fluxrt.perf.shapes import Shape

    shape = Shape(m, n, k, layout, "split-uneven")
    keep = ("plan", "rel_err_vs_cublas", "cublas_eager_ms", "fluxrt_eager_ms", "ratio_eager", "cublas_graph_ms",
            "fluxrt_graph_ms", "ratio_graph", "graph_error")
    heur = suite.bench_shape(shape, "bfloat16", iters, rounds, True, False, True)
    rng = cupy.random.default_rng(m + n + k)
    dt = suite._np_dtype("bfloat16")
    a = rng.standard_normal((m, k), dtype=cupy.float32).astype(dt)
    b = rng.standard_normal((n, k) if shape.trans_b else (k, n), dtype=cupy.float32).astype(dt)
    cupy.cuda.Device().synchronize()
    res = autotune(a, b, trans_b=shape.trans_b, force=True)
    timed = [(p, us) for p, (_, us) in zip(candidates(m, n, k), res.timings) if us is not None]
    old = [(p.describe(), us) for p, us in timed if p.split_k == 1 or k % (8 * p.split_k) == 0]
    new = [(p.describe(), us) for p, us in timed if p.split_k > 1 and k % (8 * p.split_k)]
    tuned = suite.bench_shape(shape, "bfloat16", iters, rounds, True, False, True)   # plan_for: the tuned plan
    before = min(old, key=lambda x: x[1]) if old else (None, None)
    after = min(old + new, key=lambda x: x[1])
    uneven = min(new, key=lambda x: x[1]) if new else (None, None)
    return flat_row(m, n, k, layout, {x: heur[x] for x in keep if x in heur}, {x: tuned[x] for x in keep if x in tuned},
                    before, after, uneven, len(new))


def flat_row(m, n, k, layout, heur: dict, tuned: dict, before, after, uneven, n_uneven: int) -> dict:
    """One table row: the heuristic's and the tuned plan's gemm_suite numbers, the autotune pass's best
    candidate before / after uneven slices and its best uneven one (us: kernel time of autotune's timing)."""
    row = {"m": m, "n": n, "k": k, "layout": layout}
    for name, r in (("heuristic", heur), ("tuned", tuned)):
        row[f"{name}_plan"] = r.get("plan")
        for x in ("ratio_graph", "ratio_eager", "rel_err_vs_cublas"):
            v = r.get(x)
            row[f"{name}_{x}"] = None if v is None or v != v else round(v, 4)   # NaN -> null (JSON)
    row.update({"autotune_before_plan": before[0], "autotune_before_us": before[1] and round(before[1], 2),
                "autotune_after_plan": after[0], "autotune_after_us": round(after[1], 2),
                "best_uneven_plan": uneven[0], "best_uneven_us": uneven[1] and round(uneven[1], 2),
                "uneven_candidates": n_uneven})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="*", default=DEFAULT_SHAPES, help="M,N,K,NK|KN ...")
    ap.add_argument("-n", "--iters", type=int, default=20, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("FLUXRT_GEMM_TUNE_DIR", tempfile.mkdtemp(prefix="fluxrt-tune-"))
    suite = _suite_module()
    rows = []
    for m, n, k, layout in args.shapes:
        r = run_shape(suite, m, n, k, layout, args.iters, args.rounds)
        rows.append(r)
        print(f"{m}x{n}x{k} {layout}: heuristic {r['heuristic_ratio_graph']}x graph ({r['heuristic_plan']}) | tuned "
              f"{r['tuned_ratio_graph']}x graph ({r['tuned_plan']}) | autotune best before {r['autotune_before_us']} us "
              f"({r['autotune_before_plan']}), after {r['autotune_after_us']} us ({r['autotune_after_plan']})",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bench": "gemm_split_uneven", "commit": os.environ.get("FLUXRT_COMMIT"),
                                         "machine": os.environ.get("FLUXRT_MACHINE_KIND"),
                                         "command": " ".join(["python3", "perf/gemm_split_uneven.py", *sys.argv[1:]]),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
