#!/usr/bin/env python3
"""fluxrt.gemm against cuBLAS at steady state: each implementation ALONE under a sustained load, with the GPU's power,
SM clock and clock-limit reasons sampled (fluxrt.perf.power, nvidia-smi).

Why beside perf/gemm_suite.py: an H200 running GEMMs back to back sits at its power limit within about a second, and
the driver then sets the SM clock from the power the running kernel draws. gemm_suite alternates cuBLAS and fluxrt
every few milliseconds, so both run at the clock their mix sets; a job that runs one implementation gets the clock
that implementation sets. This benchmark measures that: per shape, cuBLAS and fluxrt each replay a CUDA graph of
``-n`` calls back to back for ``--seconds`` (after ``--cool`` seconds idle), the order swapped every other shape.

Columns per implementation: burst (median us per call over the first 0.3 s), steady (median over the second half),
mean power and SM clock over the second half, energy per call (power x steady time). Ratios are cuBLAS / fluxrt
(> 1: fluxrt faster, or spending less energy). Operands and seeds are gemm_suite's, so the rows compare with it.

    python3 perf/gemm_sustained.py --shapes 461,9128,13208,NK 8192,8192,8192,NK -d bf16 --json $OUT/sustained.json
    python3 perf/gemm_sustained.py --plans-from perf/results/gemm-suite-tuned-....json --shapes 461,9128,13208,NK
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fluxrt.perf.baselines import cublas_gemm  # noqa: E402
from fluxrt.perf.power import PowerSampler, summarize  # noqa: E402
from fluxrt.perf.shapes import shape_arg  # noqa: E402
from fluxrt.perf.timing import capture, geomean, graph_ms  # noqa: E402
from gemm_suite import _np_dtype, pick_shapes, plans_from  # noqa: E402

BURST_S = 0.3


def sustained_run(graph, iters: int, stream, seconds: float, device: str) -> dict:
    """Replay ``graph`` (``iters`` calls) back to back for ``seconds`` with the power sampler on: burst and steady
    microseconds per call, and the sampler's summary over the second half."""
    times = []
    with PowerSampler(device) as s:
        t0 = time.perf_counter()
        while (t := time.perf_counter() - t0) < seconds:
            times.append((t, graph_ms(graph, iters, stream) * 1e3))
    burst = [us for t, us in times if t < BURST_S] or [times[0][1]]
    steady = [us for t, us in times if t >= seconds / 2] or [times[-1][1]]
    out = {"burst_us": statistics.median(burst), "steady_us": statistics.median(steady), "replays": len(times)}
    out.update(summarize(s.samples, since=seconds / 2))
    if "power_w" in out:
        out["energy_mj_per_call"] = out["power_w"] * out["steady_us"] * 1e-3
    return out


def bench_shape(s, dtype: str, plan, iters: int, seconds: float, cool: float, fluxrt_first: bool, device: str) -> dict:
    import cupy

    from fluxrt.gemm import gemm
    from fluxrt.gemm.autotune import plan_for

    np_dt = _np_dtype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = cupy.random.default_rng(s.m * 7 + s.n * 3 + s.k)   # gemm_suite's operands
    with stream:
        a = (rng.standard_normal((s.m, s.k), dtype=cupy.float32) + 0.1).astype(np_dt)
        w = (rng.standard_normal((s.n, s.k) if s.trans_b else (s.k, s.n), dtype=cupy.float32) + 0.1).astype(np_dt)
        c_ref = cupy.empty((s.m, s.n), np_dt)
        c = cupy.full((s.m, s.n), float("nan"), np_dt)
    source = "given"
    if plan is None:
        plan, source = plan_for(s.m, s.n, s.k, in_dtype=dtype, out_dtype=dtype, trans_b=s.trans_b), "plan_for"
    impls = {"cublas": cublas_gemm(a, w, c_ref, s.trans_b, stream.ptr),
             "fluxrt": lambda: gemm(a, w, c, trans_b=s.trans_b, plan=plan, stream=stream)}
    with stream:
        for f in impls.values():
            f()
        ref, got = c_ref.astype(cupy.float64), c.astype(cupy.float64)
        finite = cupy.isfinite(ref)   # fp16 may overflow in both: compare where cuBLAS is finite
        same_overflow = bool((cupy.isfinite(got) == finite).all())
        err = float(cupy.linalg.norm((got - ref)[finite]) / max(float(cupy.linalg.norm(ref[finite])), 1e-30))
        graphs = {name: capture(f, iters, stream) for name, f in impls.items()}
    stream.synchronize()
    row = {"m": s.m, "n": s.n, "k": s.k, "layout": s.layout, "label": s.label, "dtype": dtype,
           "plan": plan.describe(), "plan_source": source, "rel_err_vs_cublas": err, "overflow_agrees": same_overflow}
    runs = {}
    for name in (["fluxrt", "cublas"] if fluxrt_first else ["cublas", "fluxrt"]):
        time.sleep(cool)
        runs[name] = sustained_run(graphs[name], iters, stream, seconds, device)
    return flat_row(row, runs["cublas"], runs["fluxrt"])


def flat_row(row: dict, cu: dict, fl: dict) -> dict:
    """``row`` with each implementation's run as cublas_* / fluxrt_* columns and the ratios (cuBLAS / fluxrt)."""
    for name, run in (("cublas", cu), ("fluxrt", fl)):
        for key, value in run.items():
            row[f"{name}_{key}"] = value
    row["ratio_burst"] = cu["burst_us"] / fl["burst_us"]
    row["ratio_steady"] = cu["steady_us"] / fl["steady_us"]
    if "energy_mj_per_call" in cu and "energy_mj_per_call" in fl:
        row["ratio_energy"] = cu["energy_mj_per_call"] / fl["energy_mj_per_call"]
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=None, metavar="M,N,K,NK|KN", type=shape_arg,
                    help="the shapes (a suite shape keeps its label); with --plans-from, those of its shapes")
    ap.add_argument("--plans-from", type=Path, default=None, metavar="JSON",
                    help="per shape, the plan of an earlier gemm_suite or `fluxrt.gemm tune` JSON (default: the "
                         "plan fluxrt.gemm takes, tuned if the cache has one)")
    ap.add_argument("-d", "--dtype", default="bfloat16", choices=["bfloat16", "float16", "bf16", "fp16"])
    ap.add_argument("-n", "--iters", type=int, default=10, help="calls per graph replay")
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained load per implementation and shape")
    ap.add_argument("--cool", type=float, default=1.0, help="idle seconds before each implementation's load")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(args.dtype, args.dtype)
    if args.seconds <= 2 * BURST_S:
        ap.error(f"--seconds must exceed {2 * BURST_S} (burst and steady windows)")
    fixed = plans_from(args.plans_from, args.dtype) if args.plans_from else {}
    if args.shapes is None and not fixed:
        ap.error("give --shapes, --plans-from or both")
    from fluxrt.perf.shapes import Shape, suite

    shapes = args.shapes or [Shape(m, n, k, layout=lay, label="cli") for (m, n, k, lay) in fixed]
    shapes = pick_shapes(suite("default"), shapes)

    import cupy

    from fluxrt.perf import results_document, write_json

    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bus = dev.pci_bus_id
    print(f"# {name} ({bus}), {args.dtype}, {len(shapes)} shapes, {args.seconds:g} s each implementation alone after "
          f"{args.cool:g} s idle; ratio = cuBLAS / fluxrt")
    hdr = (f"{'M':>6} {'N':>6} {'K':>6} {'W':>2} | {'burst':>6} {'steady':>6} {'energy':>6} | cuBLAS us W MHz | "
           f"fluxrt us W MHz | plan")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    missing = [s for s in shapes if fixed and (s.m, s.n, s.k, s.layout) not in fixed]
    if missing:
        print(f"# {len(missing)} shapes not in {args.plans_from}: their plan is fluxrt.gemm's own (plan_for): "
              + " ".join(f"{s.m},{s.n},{s.k},{s.layout}" for s in missing), file=sys.stderr)
    for i, s in enumerate(shapes):
        r = bench_shape(s, args.dtype, fixed.get((s.m, s.n, s.k, s.layout)), args.iters, args.seconds, args.cool,
                        i % 2 == 1, bus)
        rows.append(r)
        st = lambda name: (f"{r[name + '_steady_us']:7.1f} {r.get(name + '_power_w', float('nan')):4.0f} "
                           f"{r.get(name + '_sm_mhz', float('nan')):5.0f}")
        print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout:>2} | {r['ratio_burst']:6.3f} {r['ratio_steady']:6.3f} "
              f"{r.get('ratio_energy', float('nan')):6.3f} | {st('cublas')} | {st('fluxrt')} | {r['plan']}", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    summary = {"shapes": len(rows), "geomean_ratio_burst": geomean(r["ratio_burst"] for r in rows),
               "geomean_ratio_steady": geomean(r["ratio_steady"] for r in rows),
               "geomean_ratio_energy": geomean(r.get("ratio_energy") for r in rows),
               "below_0.95_steady": [f"{r['m']}x{r['n']}x{r['k']} {r['layout']}" for r in rows
                                     if r["ratio_steady"] < 0.95]}
    print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if args.json:
        doc = results_document("gemm-sustained", rows, ["python3", "perf/gemm_sustained.py", *(argv or sys.argv[1:])],
                               machine={"gpu_name": name, "gpu_count": 1})
        doc["summary"] = summary
        write_json(args.json, doc)
        print(f"# wrote {len(rows)} rows to {args.json}")
    bad = [r for r in rows if r["rel_err_vs_cublas"] > 1e-2 or not r["overflow_agrees"]]
    if bad:
        print(f"# {len(bad)} shapes disagree with cuBLAS", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
