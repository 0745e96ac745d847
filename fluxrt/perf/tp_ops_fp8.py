"""``fluxrt-perf ag_gemm|gemm_rs --fp8 tensor|block``: the tensor-parallel ops with fp8 inputs against the fp8
GEMM alone.

Per shape (the GEMM each rank runs, as the 16-bit bench's: M rows in total, N columns, K the rank's inner
dimension), under mpirun with one GPU per rank:

    op_ms         fluxrt.ops.AllGatherGemm / GemmReduceScatter with ``fp8=Fp8Options(format, scale)`` and the
                  chunk count the op's cost model picks (``chunks``; the fp8 ops take the decomposed path)
    chunks_ms     the same op with 1, 2 and 4 chunks (1: the collective, then the GEMM)
    gemm_ms       fluxrt.gemm.gemm of the whole M x N x K in fp8 with the same scales, alone
    op/gemm       op_ms / gemm_ms; the issue's target is <= 1.05 at M >= 4096

Inputs: random fp8 bytes of moderate magnitudes (no NaN or Inf encodings), scales 1 (per tensor) or
random block scales; -d is the output type (bf16 / fp16). -c 1 checks the op's result against its
one-chunk path (allgather / reduce-scatter and GEMMs in sequence). Timing as :mod:`fluxrt.perf.tp_ops`
(its Timer: ranks synchronized before each iteration, calls timed in turns).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..world import World

TARGET = 1.05          # the bound on op_ms / gemm_ms
TARGET_MIN_M = 4096    # ... at M >= this
CHUNK_OPTIONS = (1, 2, 4)
# exponent fields that give magnitudes 2^-3 .. 2^2 (never the NaN / Inf encodings)
_EXPONENTS = {"e4m3": (3, 4, 10), "e5m2": (2, 12, 18)}   # mantissa bits, lowest, highest + 1


def fp8_row(op: str, m: int, n: int, k: int, world: int, out_dtype: str, fmt: str, scale: str, op_ms: float,
            gemm_ms: float, chunks: int, chunks_ms: dict) -> dict:
    ratio = op_ms / gemm_ms if gemm_ms > 0 else float("nan")
    return {"op": op, "m": m, "n": n, "k": k, "world": world, "dtype": out_dtype, "fp8_format": fmt,
            "fp8_scale": scale, "op_ms": op_ms, "gemm_ms": gemm_ms, "op_over_gemm": ratio, "chunks": chunks,
            "chunks_ms": {str(c): t for c, t in chunks_ms.items()},
            "target": TARGET if m >= TARGET_MIN_M else None,
            "over_target": bool(m >= TARGET_MIN_M and not ratio <= TARGET)}


def format_fp8_table(rows: list[dict]) -> list[str]:
    """The header and one line per row, columns aligned."""
    head = f"# {'shape':>18} {'fp8':>12} {'op_ms':>9} {'gemm_ms':>9} {'op/gemm':>8} {'chunks':>6} " \
           f"{'1-chunk':>9} {'2-chunk':>9} {'4-chunk':>9}"
    lines = [head]
    for r in rows:
        cm = r["chunks_ms"]
        cells = [f"{cm[c]:9.3f}" if c in cm else f"{'N/A':>9}" for c in ("1", "2", "4")]
        lines.append(f"  {r['m']:>6}x{r['n']:>5}x{r['k']:>5} {r['fp8_format'] + '/' + r['fp8_scale']:>12} "
                     f"{r['op_ms']:9.3f} {r['gemm_ms']:9.3f} {r['op_over_gemm']:8.3f} {r['chunks']:>6} "
                     + " ".join(cells))
    return lines


def fp8_summary(rows: list[dict]) -> dict:
    ratios = [r["op_over_gemm"] for r in rows if r["m"] >= TARGET_MIN_M]
    return {"target": TARGET, "target_min_m": TARGET_MIN_M,
            "geomean_op_over_gemm": float(np.exp(np.mean(np.log(ratios)))) if ratios else None,
            "over_target": [f"{r['m']}x{r['n']}x{r['k']}" for r in rows if r["over_target"]]}


def random_fp8(shape, fmt: str, seed: int):
    """Random fp8 bytes (uint8 cupy array) of magnitudes 2^-3 .. 2^2 with random signs and mantissas."""
    import cupy

    mbits, lo, hi = _EXPONENTS[fmt]
    g = cupy.random.RandomState(seed)
    e = g.randint(lo, hi, size=shape, dtype=cupy.int32)
    mant = g.randint(0, 1 << mbits, size=shape, dtype=cupy.int32)
    sign = g.randint(0, 2, size=shape, dtype=cupy.int32)
    return ((sign << 7) | (e << mbits) | mant).astype(cupy.uint8)


def _scales(scale: str, rows: int, n: int, k: int, seed: int):
    import cupy

    if scale == "tensor":
        return cupy.ones((1,), cupy.float32), cupy.ones((1,), cupy.float32)
    g = cupy.random.RandomState(seed)
    kbs, nbs = -(-k // 128), -(-n // 128)
    return (g.uniform(0.5, 2.0, (rows, kbs)).astype(cupy.float32), g.uniform(0.5, 2.0, (nbs, kbs)).astype(cupy.float32))


def measure_fp8_shape(op: str, world: World, m: int, n: int, k: int, dtype: str, args, timer) -> dict:
    import cupy

    from .. import gemm as fgemm
    from ..dtypes import normalize_dtype
    from ..ops import AgGemmPlan, AllGatherGemm, Fp8Options, GemmReduceScatter, GemmRsPlan

    w, s = world.size, timer.stream
    fp8 = Fp8Options(args.fp8_format, args.fp8)
    shard = m // w
    a_rows = shard if op == "ag_gemm" else m
    seed = 1000 * world.rank + 17
    a, b = random_fp8((a_rows, k), args.fp8_format, seed), random_fp8((n, k), args.fp8_format, seed + 1)
    sa, sb = _scales(args.fp8, a_rows, n, k, seed + 2)
    # the GEMM alone: the whole M x N x K with the same scales (block: scale rows for all M)
    a_all = random_fp8((m, k), args.fp8_format, seed + 3) if op == "ag_gemm" else a
    sa_all = _scales(args.fp8, m, n, k, seed + 4)[0] if op == "ag_gemm" and args.fp8 == "block" else sa
    c_all = cupy.empty((m, n), dtype=normalize_dtype(dtype))
    cls, plan_cls = (AllGatherGemm, AgGemmPlan) if op == "ag_gemm" else (GemmReduceScatter, GemmRsPlan)
    ops = {None: cls(world, m, n, k, dtype, trans_b=True, fp8=fp8)}
    for c in CHUNK_OPTIONS:
        ops[c] = cls(world, m, n, k, dtype, trans_b=True, fp8=fp8, plan=plan_cls(decomposed_chunks=c))
    outs = {c: cupy.empty((m if op == "ag_gemm" else shard, n), dtype=c_all.dtype) for c in ops}
    choice = ops[None].path_choice(m, s)

    def call(c):
        return lambda: ops[c].forward(a, b, out=outs[c], stream=s, scale_a=sa, scale_b=sb)

    def gemm_alone():
        fgemm.gemm(a_all, b, c_all, trans_b=True, fp8_format=args.fp8_format, scale_a=sa_all, scale_b=sb, stream=s)

    if args.check:
        _check_once(op, world, call(None), call(1), outs[None], outs[1], s)
    fns = {"op": call(None), "gemm": gemm_alone, **{f"c{c}": call(c) for c in CHUNK_OPTIONS}}
    t = timer.many(fns)
    return fp8_row(op, m, n, k, w, dtype, args.fp8_format, args.fp8, t["op"], t["gemm"], choice.chunks,
                   {c: t[f"c{c}"] for c in CHUNK_OPTIONS})


def _check_once(op: str, world: World, fn, sequential, got, ref, s) -> None:
    from .baselines import worst_rel_err

    fn()
    sequential()
    s.synchronize()
    world.check_errors()
    worst = worst_rel_err(world, got, ref)
    if not worst < 3e-2:
        raise RuntimeError(f"{op} --fp8: the op's result differs from its one-chunk path: relative error {worst:.3g}")


def main_fp8(bench: str, args, argv: list, dtype: str) -> int:
    import cupy

    import fluxrt

    from .baselines import device_info, library_versions, machine
    from .report import device_lines, results_document, version_line, write_json
    from .shapes import tp_op_suite
    from .sweep import AVERAGE_MODES
    from .tp_ops import Timer, shapes_from_args

    world_kw = {"timeout_s": args.timeout} if args.timeout > 0 else {}
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size="1G", check_collective_args=args.check_args,
                                                    **world_kw))
    try:
        shapes = shapes_from_args(bench, args, world.size)
        timer = Timer(world, cupy.cuda.Stream(non_blocking=True), args.warmup_iters, args.iters, args.average)
        versions, devices = library_versions(None), device_info(world)
        if world.rank == 0:
            print(f"# fluxrt-perf {bench} --fp8 {args.fp8}: world={world.size} format={args.fp8_format} "
                  f"out={args.datatype} iters={args.iters} warmup={args.warmup_iters}; times in ms (median per "
                  f"rank, {AVERAGE_MODES[args.average]} over ranks: -a {args.average})")
            print(version_line(versions))
            for line in device_lines(devices):
                print(line)
            print(format_fp8_table([])[0], flush=True)
        labels = {(x.m, x.n, x.k): x.label for x in tp_op_suite(bench, world.size, args.suite)} if args.suite else {}
        rows = []
        for m, n, k in shapes:
            row = measure_fp8_shape(bench, world, m, n, k, dtype, args, timer)
            if (m, n, k) in labels:
                row["label"] = labels[(m, n, k)]
            rows.append(row)
            if world.rank == 0:
                print(format_fp8_table([row])[1], flush=True)
        if world.rank == 0:
            summ = fp8_summary(rows)
            print(f"# op/gemm geomean at M >= {TARGET_MIN_M}: {summ['geomean_op_over_gemm']}; over {TARGET}: "
                  f"{', '.join(summ['over_target']) or 'none'}")
            if args.json_path:
                options = {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path")}
                doc = results_document(f"{bench}_fp8", rows, ["fluxrt-perf", bench] + argv, machine=machine(world),
                                       versions=versions, devices=devices,
                                       options=dict(options, average_name=AVERAGE_MODES[args.average]))
                doc["summary"] = summ
                write_json(args.json_path, doc)
    finally:
        world.finalize()
    return 0


if __name__ == "__main__":
    from .tp_ops import main

    sys.exit(main())
