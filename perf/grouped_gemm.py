#!/usr/bin/env python3
"""fluxrt.gemm.grouped_gemm (one launch over all experts, offsets on the device) against, in the same process
and on the same stream:

  loop    one cublasGemmEx per non-empty expert (fluxrt.perf.baselines.cublas_gemm: fp32 compute, default
          algorithm), the counts known to the host
  dense   ONE cublasGemmEx of the same FLOPs: [sum M_g, K] x [K, N], the rate a grouped GEMM would have
          without its groups
  torch   torch._grouped_mm (bf16, offsets on the device) where torch is installed and has it: eager calls
          only, after every other measurement (a device-side assert in it would end the CUDA context)

MoE cases: DeepSeek-V3 experts (7168 -> 2048 and 2048 -> 7168, 64 local experts) and Mixtral (4096 -> 14336 and
14336 -> 4096, 2 local experts); the rows per expert are drawn from a seeded Zipf-like router (expert e of a
shuffled order gets weight 1 / (rank + 1)^s, a tenth of the experts none: zero-token experts), for several
total row counts. Weights are [G, N, K] (trans_b=True, as nn.Linear stores them) unless --kn.

Timing, per case, in alternating rounds: "graph" = `iters` calls captured once in a CUDA graph and replayed
(kernel time; the loop's 64 launches included), "eager" = the same calls back to back between two events
(host time included, as a user sees it). Ratios are baseline time / fluxrt time (> 1: fluxrt faster);
"tile_rows_128" counts the 128-row tiles the experts need (padding included), against rows / 128 for dense.
"wave_bound_vs_dense" is the ratio to dense that whole waves of the default plan's tiles allow: dense's waves of
tiles over the grouped call's (each expert's rows padded to whole tiles; every tile runs all of K), with one
tile per SM; a grouped GEMM whose tiles ran at the dense tile rate would reach it.

    python3 perf/grouped_gemm.py --json perf/results/gemm-grouped-h200-<date>-<commit>.json

--fp8 tensor|block: the fp8 grouped GEMM (e4m3 tokens and weights [G, N, K], bf16 out; per-tensor scales with one
B scale per expert, or DeepSeek block scales A 1x128 and B 128x128 per expert) against

  loop    one dense fluxrt fp8 GEMM (fluxrt.gemm.gemm with fp8_format) per non-empty expert, on that expert's rows
          and scales, the counts known to the host
  dense   ONE dense fluxrt fp8 GEMM of the same FLOPs: [sum M_g, K] x one expert's [N, K]
  torch   torch._scaled_mm (cuBLASLt) per non-empty expert (its rows zero-padded to a multiple of 16, as
          cuBLASLt's fp8 GEMM needs), per-tensor scales only, eager (after every other measurement), where torch
          is installed

    python3 perf/grouped_gemm.py --fp8 tensor --json perf/results/gemm-grouped-fp8-tensor-h200-<date>-<commit>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.baselines import cublas_gemm  # noqa: E402
from fluxrt.perf.timing import capture, eager_ms, geomean, graph_ms  # noqa: E402

# (model, gemm, experts, K, N)
MODELS = [("deepseek-v3", "up", 64, 7168, 2048), ("deepseek-v3", "down", 64, 2048, 7168),
          ("mixtral", "up", 2, 4096, 14336), ("mixtral", "down", 2, 14336, 4096)]
ROWS = {"deepseek-v3": (8192, 32768), "mixtral": (4096, 16384)}


def router_counts(experts: int, rows: int, seed: int, skew: float = 1.2, zero_frac: float = 0.1) -> np.ndarray:
    """Rows per expert of a skewed router: Zipf-like weights over a shuffled expert order, the lightest
    `zero_frac` of the experts (at least one when there are more than 2) get no rows; multinomial draw."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1) ** skew
    zeros = int(experts * zero_frac) if experts > 2 else 0
    if zeros:
        w[-zeros:] = 0.0
    w = w[rng.permutation(experts)]
    return rng.multinomial(rows, w / w.sum())








def _torch_grouped(a, b_gnk, counts, trans_b: bool, stream):
    """A callable running torch._grouped_mm on the same operands (zero-copy through DLPack), or the reason why
    not. torch wants mat_b [G, K, N] with K as the inner stride ([G, N, K] transposed) and int32 end offsets."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    if not hasattr(torch, "_grouped_mm"):
        return None, f"torch {torch.__version__} has no _grouped_mm"
    import cupy

    try:
        ta = torch.from_dlpack(a)
        tb = torch.from_dlpack(b_gnk)
        tb = tb.transpose(-2, -1) if trans_b else tb
        offs = torch.from_dlpack(cupy.asarray(np.cumsum(counts).astype(np.int32)))
        ts = torch.cuda.ExternalStream(stream.ptr)

        def run():
            with torch.cuda.stream(ts):
                torch._grouped_mm(ta, tb, offs=offs, out_dtype=ta.dtype)

        run()
        stream.synchronize()
        return run, None
    except Exception as e:   # unsupported layout / version: recorded, not fatal
        return None, f"{type(e).__name__}: {e}"[:200]


def operands(experts, k, n, rows, dtype, trans_b, seed):
    """The case's tokens, weights, rows per expert (host) and offsets (device), seeded."""
    import cupy

    np_dt = cupy.dtype(_np_dtype(dtype))
    counts = router_counts(experts, rows, seed)
    offs_host = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rng = cupy.random.default_rng(seed)
    a = (rng.standard_normal((rows, k), dtype=cupy.float32) * 0.5).astype(np_dt)
    b = (rng.standard_normal((experts, n, k) if trans_b else (experts, k, n), dtype=cupy.float32) * 0.5).astype(np_dt)
    offsets = cupy.asarray(offs_host)
    # made on the current stream; the timed calls run on a non-blocking stream that does not wait for it
    cupy.cuda.Device().synchronize()
    return a, b, counts, offs_host, offsets


def bench_case(model, gemm_name, experts, k, n, rows, dtype, trans_b, iters, rounds, seed, check, plans):
    import cupy

    from fluxrt.gemm import grouped_gemm
    from fluxrt.gemm.grouped import grouped_plan

    a, b, counts, offs_host, offsets = operands(experts, k, n, rows, dtype, trans_b, seed)
    out = cupy.empty((rows, n), dtype=a.dtype)
    out_loop = cupy.empty((rows, n), dtype=a.dtype)
    out_dense = cupy.empty((rows, n), dtype=a.dtype)
    w_dense = b[int(np.argmax(counts))]     # one expert's weights: the dense GEMM of the same FLOPs
    stream = cupy.cuda.Stream(non_blocking=True)
    default = grouped_plan(rows, n, k, experts, in_dtype=dtype, out_dtype=dtype)
    fl = {"default": default}
    for p in plans:
        fl[p.describe()] = p

    loop_calls = [cublas_gemm(a[offs_host[g]:offs_host[g + 1]], b[g], out_loop[offs_host[g]:offs_host[g + 1]], trans_b,
                              stream.ptr) for g in range(experts) if counts[g] > 0]
    dense_call = cublas_gemm(a, w_dense, out_dense, trans_b, stream.ptr)

    def run_loop():
        for c in loop_calls:
            c()

    impls = {"loop": run_loop, "dense": dense_call}
    for name, plan in fl.items():
        impls[f"fluxrt:{name}"] = (lambda plan=plan: grouped_gemm(a, b, offsets, out, trans_b=trans_b, stream=stream,
                                                                   plan=plan))
    row = {"model": model, "gemm": gemm_name, "experts": experts, "rows": rows, "k": k, "n": n, "dtype": dtype,
           "layout": "NK" if trans_b else "KN", "empty_experts": int((counts == 0).sum()),
           "max_rows": int(counts.max()), "min_nonzero_rows": int(counts[counts > 0].min()),
           "tile_rows_128": int(sum(-(-int(c) // 128) for c in counts)), "plan": default.describe()}
    row.update(wave_bound(counts, rows, n, default.block_m, default.block_n,
                          cupy.cuda.Device().attributes["MultiProcessorCount"]))
    return _time_case(row, impls, out, out_loop, offs_host, 2.0 * rows * n * k, stream, iters, rounds, check)


def wave_bound(counts, rows: int, n: int, block_m: int, block_n: int, sms: int) -> dict:
    """Whole waves of tiles (one per SM) of the grouped call (every expert's rows padded to whole tiles) and of the
    dense GEMM of the same rows, and their ratio: the best ratio to dense a grouped GEMM of this tile can reach
    when its tiles run at the dense tile rate."""
    n_tiles = -(-n // block_n)
    grouped = sum(-(-int(c) // block_m) for c in counts) * n_tiles
    dense = -(-rows // block_m) * n_tiles
    gw, dw = -(-grouped // sms), -(-dense // sms)
    return {"tiles": grouped, "dense_tiles": dense, "tile_waves": gw, "dense_tile_waves": dw,
            "wave_bound_vs_dense": dw / gw}


def _time_case(row, impls, out, out_loop, offs_host, flops, stream, iters, rounds, check) -> dict:
    """Warm every implementation up, check the grouped output against the loop's (``rel_err_vs_loop``; where it is
    not finite, which output holds the bad values and where), then time graph replays and eager calls of each in
    alternating rounds into ``row``."""
    import cupy

    with stream:
        for fn in impls.values():   # compile, pack, warm up
            for _ in range(2):
                fn()
        stream.synchronize()
        if check:
            r64 = out_loop.astype(cupy.float64)
            for name in [n for n in impls if n.startswith("fluxrt:") and n != "fluxrt:default"] + ["fluxrt:default"]:
                impls[name]()   # the default plan last: its output is the one examined below
                stream.synchronize()
                key = "rel_err_vs_loop" + ("" if name == "fluxrt:default" else name[6:])
                row[key] = float(cupy.linalg.norm(out.astype(cupy.float64) - r64) / cupy.linalg.norm(r64))
            if not np.isfinite(row["rel_err_vs_loop"]):   # which output holds the non-finite values, and where
                for name, o in (("fluxrt", out.astype(cupy.float32)), ("loop", r64)):
                    bad = ~cupy.isfinite(o)
                    rows_bad = cupy.nonzero(bad.any(axis=1))[0]
                    row[f"nonfinite_{name}"] = int(bad.sum())
                    row[f"max_abs_{name}"] = float(cupy.abs(o).max())
                    row[f"norm_{name}"] = float(cupy.linalg.norm(o.astype(cupy.float64).ravel()))
                    row[f"nonfinite_rows_{name}"] = [int(v) for v in cupy.asnumpy(rows_bad[:4])] + (
                        [int(rows_bad[-1])] if rows_bad.size > 4 else [])
                row["offsets"] = [int(v) for v in offs_host]
        graphs = {name: capture(fn, iters, stream) for name, fn in impls.items()}
        for g in graphs.values():
            g.launch(stream)
        times = {name: [] for name in impls}
        eager = {name: [] for name in impls}
        for _ in range(rounds):
            for name in impls:
                times[name].append(graph_ms(graphs[name], iters, stream))
                eager[name].append(eager_ms(impls[name], iters, stream))
        stream.synchronize()
    for name in impls:
        key = name.replace("fluxrt:default", "fluxrt")
        row[f"{key}_ms"] = float(np.median(times[name]))
        row[f"{key}_eager_ms"] = float(np.median(eager[name]))
    row["fluxrt_tflops"] = flops / row["fluxrt_ms"] / 1e9
    row["dense_tflops"] = flops / row["dense_ms"] / 1e9
    row["speedup_vs_loop"] = row["loop_ms"] / row["fluxrt_ms"]
    row["ratio_vs_dense"] = row["dense_ms"] / row["fluxrt_ms"]
    row["speedup_vs_loop_eager"] = row["loop_eager_ms"] / row["fluxrt_eager_ms"]
    return row


# --- fp8 ------------------------------------------------------------------------------------------------------

def rand_e4m3(rng, shape):
    """Random e4m3 bytes: magnitudes about 2^-3 .. 2^3 (no NaN), random signs."""
    import cupy

    mag = rng.integers(0x20, 0x58, size=shape, dtype=cupy.int32)
    return (mag | (rng.integers(0, 2, size=shape, dtype=cupy.int32) << 7)).astype(cupy.uint8)


def operands_fp8(experts, k, n, rows, scale, seed):
    """The case's fp8 tokens [rows, K], weights [G, N, K], scales, rows per expert (host) and offsets (device)."""
    import cupy

    counts = router_counts(experts, rows, seed)
    offs_host = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rng = cupy.random.default_rng(seed)
    a = rand_e4m3(rng, (rows, k))
    b = rand_e4m3(rng, (experts, n, k))
    kbs, nbs = -(-k // 128), -(-n // 128)
    if scale == "tensor":
        sa = rng.uniform(0.5, 2.0, size=(1,)).astype(cupy.float32)
        sb = rng.uniform(0.5, 2.0, size=(experts,)).astype(cupy.float32)
    else:
        sa = rng.uniform(0.5, 2.0, size=(rows, kbs)).astype(cupy.float32)
        sb = rng.uniform(0.5, 2.0, size=(experts, nbs, kbs)).astype(cupy.float32)
    offsets = cupy.asarray(offs_host)
    # made on the current stream; the timed calls run on a non-blocking stream that does not wait for it
    cupy.cuda.Device().synchronize()
    return a, b, sa, sb, counts, offs_host, offsets


def _expert_scales(sa, sb, scale, r0, r1, g):
    """One expert's scales as the dense fp8 GEMM takes them."""
    return (sa, sb[g:g + 1]) if scale == "tensor" else (sa[r0:r1], sb[g])


def bench_case_fp8(model, gemm_name, experts, k, n, rows, scale, iters, rounds, seed, check, plans):
    import cupy

    from fluxrt.gemm import gemm, grouped_gemm
    from fluxrt.gemm.grouped import grouped_plan

    a, b, sa, sb, counts, offs_host, offsets = operands_fp8(experts, k, n, rows, scale, seed)
    bf16 = _np_dtype("bfloat16")
    out, out_loop, out_dense = (cupy.empty((rows, n), dtype=bf16) for _ in range(3))
    g_dense = int(np.argmax(counts))
    stream = cupy.cuda.Stream(non_blocking=True)
    default = grouped_plan(rows, n, k, experts, in_dtype="float8_e4m3fn", scale=scale)
    fl = {"default": default}
    from fluxrt.gemm.plan import FP8_BLOCK_K

    for p in plans:
        fl[p.describe()] = dataclasses.replace(p, block_k=FP8_BLOCK_K)
    kw = dict(trans_b=True, fp8_format="e4m3", stream=stream)
    loop_args = []
    for g in range(experts):
        r0, r1 = int(offs_host[g]), int(offs_host[g + 1])
        if r1 > r0:
            ea, eb = _expert_scales(sa, sb, scale, r0, r1, g)
            loop_args.append((a[r0:r1], b[g], out_loop[r0:r1], ea, eb))
    dense_sa, dense_sb = _expert_scales(sa, sb, scale, 0, rows, g_dense)

    def run_loop():
        for x, w, o, ea, eb in loop_args:
            gemm(x, w, o, scale_a=ea, scale_b=eb, **kw)

    impls = {"loop": run_loop,
             "dense": lambda: gemm(a, b[g_dense], out_dense, scale_a=dense_sa, scale_b=dense_sb, **kw)}
    for name, plan in fl.items():
        impls[f"fluxrt:{name}"] = (lambda plan=plan: grouped_gemm(a, b, offsets, out, fp8_format="e4m3", scale_a=sa,
                                                                   scale_b=sb, stream=stream, plan=plan))
    row = {"model": model, "gemm": gemm_name, "experts": experts, "rows": rows, "k": k, "n": n,
           "dtype": "float8_e4m3fn", "out_dtype": "bfloat16", "scale": scale, "layout": "NK",
           "empty_experts": int((counts == 0).sum()), "max_rows": int(counts.max()),
           "min_nonzero_rows": int(counts[counts > 0].min()),
           "tile_rows_128": int(sum(-(-int(c) // 128) for c in counts)), "plan": default.describe()}
    row.update(wave_bound(counts, rows, n, default.block_m, default.block_n,
                          cupy.cuda.Device().attributes["MultiProcessorCount"]))
    return _time_case(row, impls, out, out_loop, offs_host, 2.0 * rows * n * k, stream, iters, rounds, check)


def torch_case_fp8(row, iters, rounds, seed) -> None:
    """torch._scaled_mm (cuBLASLt, per-tensor scales) per non-empty expert on the case's operands, eager, into row:
    torch_eager_ms, ratio_vs_torch_eager and rel_err_torch_vs_fluxrt. Run after every other measurement."""
    if row.get("scale") != "tensor":
        row["torch_note"] = "torch._scaled_mm baseline with per-tensor scales only"
        return
    try:
        import torch
    except ImportError:
        row["torch_note"] = "torch not installed"
        return
    import cupy

    from fluxrt.gemm import grouped_gemm

    a, b, sa, sb, counts, offs_host, offsets = operands_fp8(row["experts"], row["k"], row["n"], row["rows"], "tensor",
                                                            seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    ts = torch.cuda.ExternalStream(stream.ptr)
    ta = torch.from_dlpack(a).view(torch.float8_e4m3fn)
    tb = torch.from_dlpack(b).view(torch.float8_e4m3fn)
    tsa, tsb = torch.from_dlpack(sa).reshape(()), torch.from_dlpack(sb)
    tc = torch.empty((row["rows"], row["n"]), dtype=torch.bfloat16, device=ta.device)
    # cuBLASLt's fp8 GEMM wants the rows of A in multiples of 16: each expert's rows are copied (outside the
    # timing) into a zero-padded buffer, its product goes to a padded output and is copied back for the check
    calls = []
    for g in range(row["experts"]):
        r0, r1 = int(offs_host[g]), int(offs_host[g + 1])
        if r1 > r0:
            pad = -(-(r1 - r0) // 16) * 16
            xa = torch.zeros((pad, row["k"]), dtype=torch.uint8, device=ta.device).view(torch.float8_e4m3fn)
            xa[: r1 - r0] = ta[r0:r1]
            xc = torch.empty((pad, row["n"]), dtype=torch.bfloat16, device=ta.device)
            calls.append((r0, r1, xa, tb[g].t(), tsb[g].reshape(()).contiguous(), xc))
    torch.cuda.synchronize()

    def run():
        with torch.cuda.stream(ts):
            for _, _, xa, xb, s_b, xc in calls:
                torch._scaled_mm(xa, xb, scale_a=tsa, scale_b=s_b, out_dtype=torch.bfloat16, out=xc)

    with stream:
        for _ in range(2):
            run()
        with torch.cuda.stream(ts):
            for r0, r1, _, _, _, xc in calls:
                tc[r0:r1] = xc[: r1 - r0]
        stream.synchronize()
        out = cupy.empty((row["rows"], row["n"]), dtype=_np_dtype("bfloat16"))
        grouped_gemm(a, b, offsets, out, fp8_format="e4m3", scale_a=sa, scale_b=sb, stream=stream)
        stream.synchronize()
        r64 = torch.from_dlpack(tc).to(torch.float64)
        row["rel_err_torch_vs_fluxrt"] = float(torch.linalg.norm(torch.from_dlpack(out).to(torch.float64) - r64)
                                               / torch.linalg.norm(r64))
        row["torch_eager_ms"] = float(np.median([eager_ms(run, iters, stream) for _ in range(rounds)]))
    row["ratio_vs_torch_eager"] = row["torch_eager_ms"] / row["fluxrt_eager_ms"]
    row["torch_note"] = None


def torch_case(row, trans_b, iters, rounds, seed) -> None:
    """torch._grouped_mm on the case's operands, eager (torch allocates its own per-call workspace, which a
    capture that torch does not know of would leave dangling), into row: torch_eager_ms and
    ratio_vs_torch_eager. Run after every other measurement: a device-side assert in it ends the process's
    CUDA context."""
    import cupy

    a, b, counts, _, _ = operands(row["experts"], row["k"], row["n"], row["rows"], row["dtype"], trans_b, seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    run, note = _torch_grouped(a, b, counts, trans_b, stream)
    row["torch_note"] = note
    if run is None:
        return
    with stream:
        for _ in range(2):
            run()
        row["torch_eager_ms"] = float(np.median([eager_ms(run, iters, stream) for _ in range(rounds)]))
    row["ratio_vs_torch_eager"] = row["torch_eager_ms"] / row["fluxrt_eager_ms"]


def seed_of(args, rows: int, experts: int) -> int:
    return args.seed + rows + experts


def _np_dtype(name: str):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float16)




def _plan(text: str):
    """'128x128s5' -> GemmPlan(block_n=128, stages=5) (block_m 128 or 64); a GemmPlan.describe() line (with spaces,
    e.g. '128x128x64 s5 grouped/g16 epi=tma/shared x1 pp') -> that plan."""
    from fluxrt.gemm.plan import GemmPlan, consumers_for

    if " " in text.strip():
        return GemmPlan.parse(text)
    mn, s = text.lower().split("s")
    bm, bn = (int(x) for x in mn.split("x"))
    return GemmPlan(block_m=bm, block_n=bn, consumers=consumers_for(bm), stages=int(s), group_m=16)


def build_parser() -> argparse.ArgumentParser:
    from fluxrt.perf.sweep import add_gemm_bench_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gemm_bench_arguments(ap, iters=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed blocks per implementation")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--kn", action="store_true", help="weights [G, K, N] (trans_b=False) instead of [G, N, K]")
    ap.add_argument("--models", default=",".join(sorted({m for m, *_ in MODELS})), help="comma-separated")
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="total rows (default: per model)")
    ap.add_argument("--plans", default="", help="extra grouped plans to time, comma-separated: 128x128s5,64x256s4 or "
                    "GemmPlan.describe() lines ('128x128x64 s5 grouped/g16 epi=tma/shared x1 pp')")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    ap.add_argument("--fp8", choices=("tensor", "block"), default=None,
                    help="the fp8 grouped GEMM (e4m3 -> bf16) with these scales, against dense fluxrt fp8 GEMMs")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import cupy

    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    plans = [_plan(p) for p in args.plans.split(",") if p]
    from fluxrt.errors import GemmArgumentError
    from fluxrt.gemm.grouped import check_grouped_plan
    from fluxrt.gemm.plan import FP8_BLOCK_K
    try:   # before any case: one plan the kernel cannot run would fail every case
        for p in plans:   # an fp8 case runs the plan with fp8's K block (bench_case_fp8)
            check_grouped_plan(dataclasses.replace(p, block_k=FP8_BLOCK_K) if args.fp8 else p,
                               "bfloat16" if args.fp8 else args.dtype, "float8_e4m3fn" if args.fp8 else args.dtype,
                               args.fp8 or "none")
    except GemmArgumentError as e:
        print(f"grouped_gemm: --plans: {e}", file=sys.stderr)
        return 2
    wanted = set(args.models.split(","))
    if args.fp8 and args.kn:
        print("grouped_gemm: fp8 weights are [G, N, K] only (--kn does not apply)", file=sys.stderr)
        return 2
    what = f"fp8 e4m3 -> bf16, {args.fp8} scales, loop/dense = fluxrt fp8 GEMMs" if args.fp8 else args.dtype
    print(f"# {name}, {what}, weights {'[G,K,N]' if args.kn else '[G,N,K]'}, {args.iters} calls x "
          f"{args.rounds} rounds (CUDA graph); ratio = baseline time / fluxrt time")
    hdr = (f"{'model':>11} {'gemm':>4} {'G':>3} {'rows':>6} {'K':>6} {'N':>6} {'0s':>3} {'max':>5} | "
           f"{'fluxrt ms':>9} {'TFLOP/s':>7} | {'loop ms':>8} {'x':>5} | {'dense ms':>8} {'x':>5} | "
           f"{'eager ms':>8} {'x loop':>6}")
    print(hdr)
    print("-" * len(hdr))
    rows, t0 = [], time.time()
    for model, gname, experts, k, n in MODELS:
        if model not in wanted:
            continue
        for total in (args.rows or ROWS[model]):
            try:
                if args.fp8:
                    r = bench_case_fp8(model, gname, experts, k, n, total, args.fp8, args.iters, args.rounds,
                                       seed_of(args, total, experts), bool(args.check), plans)
                else:
                    r = bench_case(model, gname, experts, k, n, total, args.dtype, not args.kn, args.iters,
                                   args.rounds, seed_of(args, total, experts), bool(args.check), plans)
            except Exception as e:
                print(f"{model:>11} {gname:>4} {experts:>3} {total:>6} {k:>6} {n:>6} | FAILED {type(e).__name__}: {e}",
                      flush=True)
                rows.append({"model": model, "gemm": gname, "experts": experts, "rows": total, "k": k, "n": n,
                             "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append(r)
            err = r.get("rel_err_vs_loop", 0.0)
            extra = "".join(f" {key[7:-3]} {r[key]:.4f}" for key in r if key.startswith("fluxrt:") and
                            key.endswith("_ms") and not key.endswith("eager_ms"))
            print(f"{model:>11} {gname:>4} {experts:>3} {total:>6} {k:>6} {n:>6} {r['empty_experts']:>3} "
                  f"{r['max_rows']:>5} | {r['fluxrt_ms']:9.4f} {r['fluxrt_tflops']:7.1f} | {r['loop_ms']:8.4f} "
                  f"{r['speedup_vs_loop']:5.2f} | {r['dense_ms']:8.4f} {r['ratio_vs_dense']:5.2f} | "
                  f"{r['fluxrt_eager_ms']:8.4f} {r['speedup_vs_loop_eager']:5.2f}{'  !! rel err %.2e' % err if err > 1e-2 else ''}{extra}",
                  flush=True)
            cupy.get_default_memory_pool().free_all_blocks()
    ok = [r for r in rows if "fluxrt_ms" in r]
    if args.fp8 and not args.no_torch and ok:
        print("# torch._scaled_mm per expert (cuBLASLt), eager (after every other measurement)")
        for r in ok:
            try:
                torch_case_fp8(r, args.iters, args.rounds, seed_of(args, r["rows"], r["experts"]))
            except Exception as e:
                r["torch_note"] = f"{type(e).__name__}: {e}"[:200]
            t = f"{r['torch_eager_ms']:.4f} ms, fluxrt eager {r['ratio_vs_torch_eager']:.2f}x, rel diff " \
                f"{r['rel_err_torch_vs_fluxrt']:.2e}" if "torch_eager_ms" in r else r["torch_note"]
            print(f"{r['model']:>11} {r['gemm']:>4} {r['rows']:>6}: torch {t}", flush=True)
    elif args.dtype == "bfloat16" and not args.no_torch and ok:
        print("# torch._grouped_mm, eager (after every other measurement)")
        for r in ok:
            try:
                torch_case(r, not args.kn, args.iters, args.rounds, seed_of(args, r["rows"], r["experts"]))
            except Exception as e:
                r["torch_note"] = f"{type(e).__name__}: {e}"[:200]
            t = f"{r['torch_eager_ms']:.4f} ms, fluxrt eager {r['ratio_vs_torch_eager']:.2f}x" \
                if "torch_eager_ms" in r else r["torch_note"]
            print(f"{r['model']:>11} {r['gemm']:>4} {r['rows']:>6}: torch {t}", flush=True)
    summary = {"cases": len(rows), "measured": len(ok),
               "geomean_speedup_vs_loop": geomean(r["speedup_vs_loop"] for r in ok),
               "geomean_ratio_vs_dense": geomean(r["ratio_vs_dense"] for r in ok),
               "min_speedup_vs_loop": min((r["speedup_vs_loop"] for r in ok), default=None),
               "min_ratio_vs_dense": min((r["ratio_vs_dense"] for r in ok), default=None),
               "geomean_speedup_vs_loop_eager": geomean(r["speedup_vs_loop_eager"] for r in ok),
               "geomean_ratio_vs_torch_eager": geomean(r.get("ratio_vs_torch_eager") for r in ok),
               "seconds": time.time() - t0}
    print("# " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if args.json:
        from fluxrt.perf import results_document, write_json

        doc = results_document("gemm-grouped-fp8" if args.fp8 else "gemm-grouped", rows,
                               ["python3", "perf/grouped_gemm.py", *(argv or sys.argv[1:])],
                               machine={"gpu_name": name, "gpu_count": 1})
        doc["summary"] = summary
        write_json(args.json, doc)
        print(f"# wrote {len(rows)} rows to {args.json}")
    bad = [r for r in rows if "error" in r or r.get("rel_err_vs_loop", 0.0) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
