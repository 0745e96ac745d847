#!/usr/bin/env python3
"""Per-K-block timeline of one GEMM's pipeline: where CTA 0's loader and math warpgroups wait.

Runs the diagnostic build of the GEMM kernel (FLUXRT_GEMM_TRACE=1: CTA 0 records clock64 around the loader's
wait for a free ring slot and around each consumer's wait for a full stage, per K block; kernels/gemm/config.cuh)
once on random inputs and summarises the trace:

- ``period``: cycles between consumer 0 passing its full-stage wait for consecutive K blocks (the rate at which
  it issues K blocks), against ``ideal``, the tensor cores' time for one K block of the tile;
- ``tile_start``: the periods at the first K blocks of each tile after CTA 0's first (the previous tile's
  drain and epilogue, then the refill of the ring);
- ``excess_per_tile``: the sum of a tile's periods minus its ideal, per tile after the first;
- the waits themselves (a consumer wait shorter than the K block still queued on the tensor cores costs
  nothing; the loader waits whenever the ring is full);
- with two consumers, ``consumer1_lag``: how far consumer 1 passes each full wait after consumer 0 (a stage goes
  back to the loader only when both have read it), over all K blocks and at the tile starts;
- the staged epilogue's hand-offs per tile (``epi_*``, from a second trace array: CTA 0's first 256 tiles): each
  consumer's wait for the staging token once its accumulators are final, its staging writes, and the storer's time
  from a turn staged to its TMA stores having read the staging (with shared staging, consumer 1's turn waits for
  consumer 0's to be read).

Cooperative consumers only (no stream-K, ping-pong or split-K plans: their loops are not traced). The traced
kernel is a different module, slower than the plain one by the clock reads: its times are for the shape of the
timeline, not for the speed.

    python3 perf/gemm_trace.py --shape 2639,10728,12440,NK \
        --plan "128x256x64 s4 grouped/g16 epi=tma/shared x2" --json $OUT/trace.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fluxrt.perf.shapes import shape_arg  # noqa: E402

# Dense 16-bit wgmma per SM and clock on sm_90 (H100 SXM / H200): 989.4 TFLOPS at the 1830 MHz boost clock on
# 132 SMs (NVIDIA's H100 datasheet) is 4096 FLOP per SM per clock.
DENSE_16BIT_FLOP_PER_CLK_SM = 4096
TRACE_ROWS, TRACE_BLOCKS = 6, 2048   # fluxrt_gemm_trace (kernels/gemm/config.cuh)
ROW_NAMES = ["loader_wait_start", "loader_wait_end", "consumer0_wait_start", "consumer0_wait_end",
             "consumer1_wait_start", "consumer1_wait_end"]


def _pct(x: np.ndarray) -> list[int]:
    return [int(np.percentile(x, q)) for q in (10, 50, 90)] if len(x) else []


def summarize(trace: np.ndarray, k_blocks_per_tile: int, ideal_cycles: float, start_blocks: int = 5) -> dict:
    """Statistics of a trace of 4 or 6 rows (ROW_NAMES: loader wait start / end, consumer 0's, then consumer 1's
    where it is recorded, per K block; columns not reached are 0). k_blocks_per_tile: K blocks of one tile;
    ideal_cycles: the tensor cores' cycles for one K block; start_blocks: how many K blocks at a tile's start count
    as its start. Percentiles are p10 / p50 / p90."""
    n = int(min((trace[1] > 0).sum(), (trace[3] > 0).sum()))
    if n < 2:
        raise ValueError(f"gemm_trace: {n} K blocks traced, need at least 2")
    t = trace[:, :n].astype(np.int64)
    loader_wait, consumer_wait = t[1] - t[0], t[3] - t[2]
    period = np.diff(t[3])                         # period[i]: K block i + 1 issued after K block i
    block = np.arange(1, n)
    in_tile = block % k_blocks_per_tile
    start = (in_tile < start_blocks) & (block >= k_blocks_per_tile)
    tiles = n // k_blocks_per_tile
    excess = [int(period[j * k_blocks_per_tile - 1:(j + 1) * k_blocks_per_tile - 1].sum()
                  - ideal_cycles * k_blocks_per_tile) for j in range(1, tiles)]
    return {
        "k_blocks_traced": n, "tiles_traced": tiles, "k_blocks_per_tile": k_blocks_per_tile,
        "ideal_cycles_per_k_block": round(float(ideal_cycles), 1),
        "period_p10_50_90": _pct(period), "period_mean": round(float(period.mean()), 1),
        "period_mean_inside_tiles": round(float(period[~start].mean()), 1) if (~start).any() else None,
        "efficiency_mean": round(float(ideal_cycles / period.mean()), 4),
        "tile_start_periods_by_block": [round(float(period[(in_tile == i) & start].mean()), 1)
                                        for i in range(start_blocks) if ((in_tile == i) & start).any()],
        "excess_per_tile_cycles": excess,
        "loader_wait_p10_50_90": _pct(loader_wait), "consumer_wait_p10_50_90": _pct(consumer_wait),
        "loader_wait_share": round(float(loader_wait.sum() / max(1, t[1, -1] - t[0, 0])), 4),
        "consumer_wait_share": round(float(consumer_wait.sum() / max(1, t[3, -1] - t[2, 0])), 4),
        **(_consumer1(t, k_blocks_per_tile) if len(t) >= 6 else {}),
    }


def _consumer1(t: np.ndarray, k_blocks_per_tile: int) -> dict:
    """Consumer 1's lag behind consumer 0 (cycles from consumer 0 passing a K block's full wait to consumer 1
    passing it), where consumer 1's rows of the traced columns `t` are all recorded (one-consumer plans leave
    them 0)."""
    if not (t[5] > 0).all():
        return {}
    lag = t[5] - t[3]
    first = np.arange(t.shape[1]) % k_blocks_per_tile == 0
    return {"consumer1_lag_p10_50_90": _pct(lag), "consumer1_lag_at_tile_first_block_p10_50_90": _pct(lag[first]),
            "consumer1_wait_p10_50_90": _pct(t[5] - t[4])}


EPI_ROWS, EPI_TILES = 10, 256   # fluxrt_gemm_epi_trace (kernels/gemm/config.cuh)
EPI_ROW_NAMES = ["consumer0_final", "consumer0_token", "consumer0_staged", "consumer1_final", "consumer1_token",
                 "consumer1_staged", "storer_turn0_staged", "storer_turn0_read", "storer_turn1_staged",
                 "storer_turn1_read"]


def summarize_epilogue(epi: np.ndarray) -> dict:
    """The staged epilogue's hand-offs per tile (EPI_ROW_NAMES; columns of tiles not reached, rows of a consumer or
    turn the plan does not have, are 0), as p10 / p50 / p90 cycles over the tiles where both ends are recorded:
    each consumer's wait for the staging token after its accumulators are final, its staging writes, the storer's
    time from a turn staged to its TMA stores having read the staging, from consumer 0's arrival to the storer
    seeing turn 0, and consumer 1's final accumulators and staged tile after consumer 0's. With shared staging
    (turn 1 recorded) also from turn 0 read to consumer 1's token, the token passing between the consumers; with a
    region per consumer a tile's token comes from the previous tile, so that span is left out."""
    names = {name: i for i, name in enumerate(EPI_ROW_NAMES)}
    shared = bool((epi[names["storer_turn1_staged"]] > 0).any())

    def span(a: str, b: str) -> list[int]:
        x, y = epi[names[a]].astype(np.int64), epi[names[b]].astype(np.int64)
        ok = (x > 0) & (y > 0)
        return _pct(y[ok] - x[ok])

    out = {}
    for key, (a, b) in {
        "consumer0_token_wait": ("consumer0_final", "consumer0_token"),
        "consumer0_staging_write": ("consumer0_token", "consumer0_staged"),
        "consumer1_token_wait": ("consumer1_final", "consumer1_token"),
        "consumer1_staging_write": ("consumer1_token", "consumer1_staged"),
        "storer_turn0_stage_to_read": ("storer_turn0_staged", "storer_turn0_read"),
        "storer_turn1_stage_to_read": ("storer_turn1_staged", "storer_turn1_read"),
        "consumer0_staged_to_storer": ("consumer0_staged", "storer_turn0_staged"),
        "storer_turn0_read_to_consumer1_token": ("storer_turn0_read", "consumer1_token"),
        "consumer1_final_after_consumer0": ("consumer0_final", "consumer1_final"),
        "consumer1_staged_after_consumer0": ("consumer0_staged", "consumer1_staged"),
    }.items():
        if key == "storer_turn0_read_to_consumer1_token" and not shared:
            continue
        pct = span(a, b)
        if pct:
            out[f"epi_{key}_p10_50_90"] = pct
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=shape_arg, required=True, metavar="M,N,K,NK|KN",
                    help="the problem; NK: B stored [N, K], KN: [K, N]")
    ap.add_argument("-d", "--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--plan", help="a GemmPlan describe line (default: the plan fluxrt.gemm would take)")
    ap.add_argument("--json", help="write the summary and the trace here")
    args = ap.parse_args(argv)

    os.environ["FLUXRT_GEMM_TRACE"] = "1"   # before any kernel is loaded
    import cupy

    from fluxrt.dtypes import normalize_dtype
    from fluxrt.gemm import gemm
    from fluxrt.gemm.autotune import plan_for
    from fluxrt.gemm.kernel import KERNEL_SOURCE, compile_options, plain_defines
    from fluxrt.gemm.plan import GemmPlan
    from fluxrt.perf import results_document, write_json
    from fluxrt.toolchain import load_module

    m, n, k, dt, tb = args.shape.m, args.shape.n, args.shape.k, args.dtype, args.shape.trans_b
    plan = (GemmPlan.parse(args.plan).validate(dt, b_kmajor=tb) if args.plan
            else plan_for(m, n, k, in_dtype=dt, out_dtype=dt, trans_b=tb))
    if plan.stream_k or plan.pingpong or plan.split_k > 1:
        print(f"gemm_trace: {plan.describe()}: stream-K, ping-pong and split-K loops are not traced", file=sys.stderr)
        return 2
    rng = cupy.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=cupy.float32).astype(normalize_dtype(dt))
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=cupy.float32).astype(normalize_dtype(dt))
    c = cupy.empty((m, n), dtype=normalize_dtype(dt))
    gemm(a, b, c, trans_b=tb, plan=plan)   # loads (and compiles) the traced module
    mod = load_module(KERNEL_SOURCE, compile_options(plain_defines(plan, dt, dt, tb)))
    trace = cupy.ndarray((TRACE_ROWS, TRACE_BLOCKS), dtype=cupy.int64, memptr=mod.get_global("fluxrt_gemm_trace"))
    epi = cupy.ndarray((EPI_ROWS, EPI_TILES), dtype=cupy.int64, memptr=mod.get_global("fluxrt_gemm_epi_trace"))
    trace[...] = 0
    epi[...] = 0
    cupy.cuda.Device().synchronize()
    gemm(a, b, c, trans_b=tb, plan=plan)
    cupy.cuda.Device().synchronize()
    host, epi_host = cupy.asnumpy(trace), cupy.asnumpy(epi)
    kpt = -(-k // plan.block_k)
    ideal = plan.block_m * plan.block_n * plan.block_k * 2 / DENSE_16BIT_FLOP_PER_CLK_SM
    summary = {**summarize(host, kpt, ideal), **summarize_epilogue(epi_host)}
    row = {"m": m, "n": n, "k": k, "layout": args.shape.layout, "dtype": dt, "plan": plan.describe(), **summary}
    print(f"# {m}x{n}x{k} {args.shape.layout} {dt}, {plan.describe()}: {summary['k_blocks_traced']} K blocks of CTA 0 "
          f"({summary['tiles_traced']} tiles)")
    for key, value in summary.items():
        print(f"{key:>30}  {value}")
    if args.json:
        nk = summary["k_blocks_traced"]
        doc = results_document("gemm-trace", [row], ["python3", "perf/gemm_trace.py", *(argv or sys.argv[1:])],
                               machine={"gpu_name": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                        "gpu_count": 1})
        doc["trace"] = {"rows": ROW_NAMES, "cycles": np.where(host[:, :nk] > 0, host[:, :nk] - host[0, 0], 0).tolist()}
        nt = int((epi_host[0] > 0).sum())
        doc["epilogue_trace"] = {"rows": EPI_ROW_NAMES,
                                 "cycles": np.where(epi_host[:, :nt] > 0, epi_host[:, :nt] - host[0, 0], 0).tolist()}
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
