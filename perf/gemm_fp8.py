#!/usr/bin/env python3
"""fluxrt's fp8 GEMM against cuBLASLt's (torch._scaled_mm) over a shape suite (fluxrt.perf.shapes).

Every shape runs as C[M, N] (bf16) = A[M, K] (e4m3) @ B[N, K].T (e4m3), B stored [N, K] (the only fp8
layout of both: a "KN" shape of the suite is timed as its "NK" twin, duplicates dropped), with per-tensor
scales (``--scale tensor``) or DeepSeek-style block scales (``--scale block``: A 1x128, B 128x128; the
baseline only where this torch's _scaled_mm takes block scales). PyTorch is the baseline only: without
it the script says so and times fluxrt alone.

With nvmath-python installed, per-tensor shapes are also timed against cuBLASLt called directly
(fluxrt.perf.cublaslt: the fastest of the heuristic's first 8 algorithms, timed on the shape), with fast
accumulation ("lt_fast", the accumulation fluxrt's per-tensor kernel does) and without ("lt", what
torch._scaled_mm asks for by default); ``ratio_lt_fast`` is the like-for-like ratio.

Per shape, in alternating rounds on one stream: `iters` calls captured in a CUDA graph and replayed
(kernel time: "graph"), and the same calls back to back between two events ("eager", host time included).
Ratios are baseline time / fluxrt time (> 1: fluxrt faster); geometric means at the end (all shapes, and
M >= 1024, the shapes the FP8 target of issue #30 counts).

    python3 perf/gemm_fp8.py --suite default --scale tensor --json perf/results/gemm-fp8-tensor-h200-DATE-COMMIT.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.shapes import SUITES, suite  # noqa: E402
from fluxrt.perf.timing import eager_ms, geomean  # noqa: E402

# byte ranges of fp8 magnitudes drawn at random (sign bit separate): about 2^-3 .. 2^3, no NaN or Inf
_MAG_BYTES = {"e4m3": (0x20, 0x58), "e5m2": (0x30, 0x4C)}




def rand_fp8_bytes(rng, shape, fmt: str):
    import cupy

    lo, hi = _MAG_BYTES[fmt]
    mag = rng.integers(lo, hi, size=shape, dtype=cupy.int32)
    sign = rng.integers(0, 2, size=shape, dtype=cupy.int32) << 7
    return (mag | sign).astype(cupy.uint8)




def _torch_block_scale_layouts(torch, sa, sb):
    """Layouts of the block scales to offer torch's _scaled_mm (1x128 / 128x128 scaling), most likely first:
    its releases differ in what they take (cuBLASLt wants 16-byte aligned scale rows: the K-block dimension
    padded to a multiple of 4); a wrong one that is accepted shows in the output check."""
    kbs = sa.shape[1]
    kbs4 = -(-kbs // 4) * 4
    a_cm = sa.t().contiguous().t()   # [M, K/128] with outer stride M
    b_pad = torch.zeros((sb.shape[0], kbs4), dtype=sb.dtype, device=sb.device)
    b_pad[:, :kbs] = sb
    return [(a_cm, b_pad[:, :kbs].t()), (a_cm, sb.t()), (a_cm, sb), (sa, sb.t()), (sa, sb)]


def _lt_impls(lt, a, b, c_of, sa, sb, stream, row) -> dict:
    """cuBLASLt callables (fast accumulation on and off), each writing its own output from ``c_of()``."""
    impls = {}
    for name, fast in (("lt_fast", True), ("lt", False)):
        out = c_of()
        try:
            fn = lt.gemm(a, b, out, trans_b=True, stream=stream, fp8_format="e4m3", scale_a=sa, scale_b=sb,
                         fast_accum=fast)
        except Exception as e:   # recorded, not fatal: the other baselines still run
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        fn.out = out
        row[f"{name}_algo"] = fn.choice.index
        impls[name] = fn
    return impls


def bench_shape(s, scale: str, iters: int, rounds: int, torch, check: bool, lt=None, tune: bool = False) -> dict:
    import cupy

    from fluxrt.gemm import gemm
    from fluxrt.gemm.checks import validate_fp8_args
    from fluxrt.gemm.fp8 import plan_fp8

    m, n, k = s.m, s.n, s.k
    rng = cupy.random.default_rng(m * 7 + n * 3 + k)
    a = rand_fp8_bytes(rng, (m, k), "e4m3")
    b = rand_fp8_bytes(rng, (n, k), "e4m3")
    kbs = -(-k // 128)
    if scale == "tensor":
        sa = cupy.asarray(rng.uniform(0.5, 2.0, size=()), dtype=cupy.float32)
        sb = cupy.asarray(rng.uniform(0.5, 2.0, size=()), dtype=cupy.float32)
    else:
        sa = rng.uniform(0.5, 2.0, size=(m, kbs)).astype(cupy.float32)
        sb = rng.uniform(0.5, 2.0, size=(-(-n // 128), kbs)).astype(cupy.float32)
    c = cupy.empty((m, n), dtype=np.dtype(ml_dtypes.bfloat16))
    prob = validate_fp8_args(a, b, c, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    if tune:   # time the fp8 candidates once and keep the winner in the plan cache (fluxrt.gemm.autotune)
        from fluxrt.gemm import autotune

        cupy.cuda.Device().synchronize()
        autotune(a, b, c, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb)
    plan = plan_fp8(prob, cupy.cuda.runtime.getDevice())
    row = {"m": m, "n": n, "k": k, "label": s.label, "scale": scale, "plan": plan.describe()}

    if torch is not None:
        ts = torch.cuda.Stream()
        stream = cupy.cuda.ExternalStream(ts.cuda_stream)
    else:
        ts = None
        stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()

    def run_fluxrt():
        gemm(a, b, c, trans_b=True, fp8_format="e4m3", scale_a=sa, scale_b=sb, stream=stream)

    impls = {"fluxrt": run_fluxrt}
    if torch is not None:
        ta = torch.from_dlpack(a).view(torch.float8_e4m3fn)
        tb = torch.from_dlpack(b).view(torch.float8_e4m3fn)
        tsa, tsb = torch.from_dlpack(sa), torch.from_dlpack(sb)
        layouts = _torch_block_scale_layouts(torch, tsa, tsb) if scale == "block" else [(tsa, tsb)]
        tc = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        for la, lb in layouts:
            def run_torch(la=la, lb=lb):
                torch._scaled_mm(ta, tb.t(), scale_a=la, scale_b=lb, out_dtype=torch.bfloat16, out=tc)

            try:
                with torch.cuda.stream(ts):
                    run_torch()
                ts.synchronize()
                impls["cublaslt"] = run_torch
                break
            except Exception as e:   # e.g. block scales on a torch without them: fluxrt alone
                row["baseline_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if "cublaslt" in impls:
            row.pop("baseline_error", None)
    if lt is not None and scale == "tensor":
        impls.update(_lt_impls(lt, a, b, lambda: cupy.empty_like(c), sa, sb, stream, row))

    ctx = torch.cuda.stream(ts) if torch is not None else stream
    with ctx:
        for fn in impls.values():   # warm-up (compiles fluxrt's kernel on the first shape of a plan)
            for _ in range(3):
                fn()
        stream.synchronize()
        if check and "cublaslt" in impls:
            r64 = torch.from_dlpack(tc).to(torch.float64)
            c64 = torch.from_dlpack(c).to(torch.float64)
            row["rel_err_vs_cublaslt"] = float(torch.linalg.norm(c64 - r64) / torch.linalg.norm(r64))
        for name in ("lt_fast", "lt"):
            if check and name in impls:
                r64, c64 = impls[name].out.astype(cupy.float64), c.astype(cupy.float64)
                row[f"rel_err_vs_{name}"] = float(cupy.linalg.norm(c64 - r64) / cupy.linalg.norm(r64))
        eager = {name: [] for name in impls}
        for _ in range(rounds):
            for name, fn in impls.items():
                eager[name].append(eager_ms(fn, iters, stream))
        for name in impls:
            row[f"{name}_eager_us"] = 1e3 * float(np.median(eager[name]))
        if torch is not None:
            graphs = {}
            for name, fn in impls.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=ts):
                    for _ in range(iters):
                        fn()
                graphs[name] = g
            for g in graphs.values():
                g.replay()
            times = {name: [] for name in graphs}
            for _ in range(rounds):
                for name, g in graphs.items():
                    times[name].append(eager_ms(g.replay, 1, stream) / iters)
            for name in graphs:
                row[f"{name}_us"] = 1e3 * float(np.median(times[name]))
        else:
            row["fluxrt_us"] = row["fluxrt_eager_us"]
        stream.synchronize()
    row["fluxrt_tflops"] = 2.0 * m * n * k / (row["fluxrt_us"] * 1e-6) / 1e12
    if "cublaslt_us" in row:
        row["ratio"] = row["cublaslt_us"] / row["fluxrt_us"]
        row["ratio_eager"] = row["cublaslt_eager_us"] / row["fluxrt_eager_us"]
    for name in ("lt_fast", "lt"):
        if f"{name}_us" in row:
            row[f"ratio_{name}"] = row[f"{name}_us"] / row["fluxrt_us"]
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="default", choices=sorted(SUITES))
    ap.add_argument("--scale", default="tensor", choices=("tensor", "block"))
    ap.add_argument("--min-m", type=int, default=0, help="only shapes with M >= this")
    ap.add_argument("-n", "--iters", type=int, default=20, help="calls per timed block (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed blocks per implementation")
    ap.add_argument("--limit", type=int, default=None, help="first N shapes only")
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new shapes after this many s")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the baseline's output")
    ap.add_argument("--autotune", action="store_true", help="tune each shape first (fluxrt.gemm.autotune)")
    ap.add_argument("--no-lt", action="store_true", help="skip the direct cuBLASLt baseline (nvmath-python)")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import cupy

    try:
        import torch
    except ImportError:
        torch = None
        print("# torch is not importable: no cuBLASLt baseline (torch._scaled_mm); timing fluxrt alone")
    lt = None
    if args.scale == "tensor" and not args.no_lt:
        from fluxrt.perf.cublaslt import CublasLt, CublasLtUnavailable

        try:
            lt = CublasLt()
        except CublasLtUnavailable as e:
            print(f"# {e}: no direct cuBLASLt baseline")
    seen, shapes = set(), []
    for s in suite(args.suite):
        if s.m >= args.min_m and (s.m, s.n, s.k) not in seen and s.k % 16 == 0 and s.n % 16 == 0:
            seen.add((s.m, s.n, s.k))
            shapes.append(s)
    shapes = shapes[: args.limit]
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"# {name}, fp8 e4m3 -> bf16, {args.scale} scales, suite {args.suite} ({len(shapes)} shapes), "
          f"{args.iters} calls x {args.rounds} rounds; ratio = cuBLASLt / fluxrt (graph replays)")
    print(f"{'M':>6} {'N':>6} {'K':>6} | {'cuBLASLt us':>11} {'fluxrt us':>10} {'ratio':>6} | "
          f"{'eager ratio':>11} | {'TFLOP/s':>7} | plan")
    rows, t0 = [], time.time()
    for s in shapes:
        if args.time_budget and time.time() - t0 > args.time_budget:
            print(f"# time budget of {args.time_budget} s spent: {len(shapes) - len(rows)} shapes not measured")
            break
        try:
            r = bench_shape(s, args.scale, args.iters, args.rounds, torch, not args.no_check, lt,
                            args.autotune)
        except Exception as e:
            print(f"{s.m:>6} {s.n:>6} {s.k:>6} | FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"m": s.m, "n": s.n, "k": s.k, "label": s.label, "scale": args.scale,
                         "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(r)
        err = r.get("rel_err_vs_cublaslt", 0.0)
        flag = "  !! rel err %.2e" % err if not err <= 1e-2 else ""
        print(f"{s.m:>6} {s.n:>6} {s.k:>6} | {r.get('cublaslt_us', float('nan')):11.2f} {r['fluxrt_us']:10.2f} "
              f"{r.get('ratio', float('nan')):6.3f} | {r.get('ratio_eager', float('nan')):11.3f} | "
              f"{r['fluxrt_tflops']:7.1f} | {r['plan']}{flag}"
              + (f" | lt_fast {r['ratio_lt_fast']:.3f} lt {r.get('ratio_lt', float('nan')):.3f}"
                 if "ratio_lt_fast" in r else ""), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    for r in rows:   # a baseline whose output disagrees with fluxrt's (checked against float64 in the tests)
        err = r.get("rel_err_vs_cublaslt")
        if err is not None and not err <= 1e-2:
            r["baseline_disagrees"] = True
    ok = [r for r in rows if "ratio" in r and not r.get("baseline_disagrees")]
    big = [r for r in ok if r["m"] >= 1024]
    summary = {"shapes": len(shapes), "measured": len([r for r in rows if "fluxrt_us" in r]),
               "with_baseline": len(ok),
               "baseline_disagrees": sum(bool(r.get("baseline_disagrees")) for r in rows), "geomean": geomean(r["ratio"] for r in ok),
               "geomean_m_ge_1024": geomean(r["ratio"] for r in big), "shapes_m_ge_1024": len(big),
               "geomean_eager": geomean(r["ratio_eager"] for r in ok),
               "below_0.95": sum(r["ratio"] < 0.95 for r in ok),
               "worst": min((r["ratio"] for r in ok), default=None),
               "seconds": time.time() - t0}
    for impl in ("lt_fast", "lt"):   # the direct cuBLASLt baselines, where their output agrees
        lt_ok = [r for r in rows if f"ratio_{impl}" in r and r.get(f"rel_err_vs_{impl}", 0.0) <= 1e-2]
        if lt_ok:
            summary[f"geomean_vs_{impl}"] = geomean(r[f"ratio_{impl}"] for r in lt_ok)
            summary[f"geomean_vs_{impl}_m_ge_1024"] = geomean(r[f"ratio_{impl}"] for r in lt_ok if r["m"] >= 1024)
            summary[f"below_0.95_vs_{impl}"] = sum(r[f"ratio_{impl}"] < 0.95 for r in lt_ok)
            summary[f"worst_vs_{impl}"] = min(r[f"ratio_{impl}"] for r in lt_ok)
            summary[f"disagrees_{impl}"] = sum(1 for r in rows if r.get(f"rel_err_vs_{impl}", 0.0) > 1e-2)
    print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if args.json:
        from fluxrt.perf import results_document, write_json

        doc = results_document("gemm-fp8", rows, ["python3", "perf/gemm_fp8.py", *(argv or sys.argv[1:])],
                               machine={"gpu_name": name, "gpu_count": 1},
                               versions={"torch": getattr(torch, "__version__", None),
                                         "cublaslt": lt.version() if lt is not None else None})
        doc["summary"] = summary
        write_json(args.json, doc)
        print(f"# wrote {len(rows)} rows to {args.json}")
    bad = [r for r in rows if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
