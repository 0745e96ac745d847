"""Fused tensor-parallel op benchmarks: ``fluxrt-perf ag_gemm`` and ``fluxrt-perf gemm_rs``.

Per shape (the GEMM each rank runs: M rows in total, N columns, K = the rank's inner dimension), under
mpirun with one GPU per rank:

    fused_ms        fluxrt.ops.AllGatherGemm / GemmReduceScatter
    gemm_ms_fluxrt  fluxrt.gemm.gemm alone, same shape
    gemm_ms_cublas  cupy.matmul (cuBLAS) alone
    comm_ms_nccl    NCCL all-gather of A [M, K] / reduce-scatter of C [M, N] on ordinary buffers
    comm_ms_nccl_win  the same on ncclMemAlloc buffers registered as symmetric windows (nccl-tests -R 2;
                    fluxrt.perf.nccl_lib, needs nccl4py)
    sequential_ms   NCCL then cuBLAS (AG) / cuBLAS then NCCL (RS) on one stream; sequential_ms_win the
                    same with NCCL on the windows. Overlap efficiency is taken against the faster of the two
    decomposed_ms   the ops' decomposed path (fluxrt.ops.decomposed: chunked fluxrt collectives beside fluxrt
                    GEMMs, no torch, no NCCL), the best of 1, 2 and 4 chunks (decomposed_chunks)
    torch_ms        torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter, when torch
                    imports and sets up (never a dependency; skipped with a note otherwise)
    overlap_eff     FLUX: ECT = t - best GEMM alone; E = 1 - ECT_fused / ECT_sequential
    tflops          2 M N K / fused time, per GPU
    path, op_ms     the path the op's cost model picks (fluxrt.ops.cost) and that path's time
    op/best         op_ms over the best baseline (sequential, decomposed, torch); the issue's target is <= 1.01

Timing: each measurement is warmed up, then each timed iteration starts with every rank synchronized
(MPI barrier after a stream sync), a short GPU delay so the host can enqueue the whole call before the
GPU starts it, and CUDA events around the call; the row reports the median per rank, reduced over ranks by
-a as nccl-tests does (default 1: mean; 0 rank 0's, 2 min, 3 max).
The fluxrt, cuBLAS and NCCL calls of a shape are timed in turns (one of each per round), so that clock
drift over the run (H200s under a sustained GEMM vary by several %) does not bias their ratios; torch
is timed right after them.
Shapes: ``--M M --N N --K K`` or ``--shapes MxNxK,...`` (default: the three TP shapes of DEFAULT_SHAPES), or
``--suite tp|tp-quick``: the GEMM shape suite's tensor-parallel layers at TP = the world size
(fluxrt.perf.shapes.tp_op_suite), with geometric means and the shapes over target after the table.
Flags as every fluxrt-perf subcommand: -n iterations, -w warm-up, -c check, -d type, -a, -T.
``--fp8 tensor|block``: the ops with fp8 inputs (fluxrt.ops.Fp8Options) timed against the fp8 GEMM alone
instead (fluxrt.perf.tp_ops_fp8; -d is then the output type).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import statistics
import sys
import warnings
from typing import TYPE_CHECKING

import numpy as np

from ..ops.plan import RS_REDUCE_MODES
from . import nccl_lib
from .shapes import TP_OP_SUITES, tp_op_suite
from .baselines import device_info, library_versions, machine, worst_rel_err
from .report import column_table, device_lines, results_document, version_line, write_json
from .sweep import AVERAGE_MODES, add_average_argument, add_timeout_argument, normalize_datatype, reduce_over_ranks

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OPS = ("ag_gemm", "gemm_rs")
DEFAULT_SHAPES = {   # M x N x K of the per-rank GEMM at TP=4 (AG: K full, N local; RS: K local, N full)
    "ag_gemm": ((8192, 7168, 8192), (16384, 6144, 8192), (4096, 7168, 8192)),
    "gemm_rs": ((8192, 8192, 7168), (16384, 6144, 8192), (4096, 7168, 8192)),
}
DEFAULT_SHAPES_TP = 4   # other world sizes scale the sharded dimension (AG: N, RS: K) by 4 / world
LAUNCH_SLACK_S = 500e-6   # GPU delay before each timed call: covers the host's enqueue of the whole call
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'8192x7168x8192,4096x7168x8192' -> [(M, N, K), ...]."""
    out = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"shape {part!r}: expected MxNxK with positive integers, e.g. 8192x7168x8192")
        out.append(tuple(int(d) for d in dims))
    return out


def build_parser(op: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fluxrt-perf {op}", description=__doc__.split("\n\n")[0])
    p.add_argument("--M", dest="m", type=int, metavar="M", help="rows of A (all ranks together)")
    p.add_argument("--N", dest="n", type=int, metavar="N", help="columns of B and C")
    p.add_argument("--K", dest="k", type=int, metavar="K", help="inner dimension of this rank's GEMM")
    p.add_argument("--shapes", help="comma-separated MxNxK list (instead of --M --N --K)")
    p.add_argument("--suite", choices=sorted(TP_OP_SUITES), default=None,
                   help="the shape suite's TP layers of this op at TP = world size (instead of --shapes)")
    p.add_argument("--no-decomposed", action="store_true", help="skip the decomposed-path baseline")
    p.add_argument("-d", "--datatype", default="bf16", type=normalize_datatype, help="bf16|fp16 (default bf16)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per measurement (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed warm-up iterations (default 5)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check the fused result once against cuBLAS(+NCCL) (default 1)")
    add_average_argument(p)
    add_timeout_argument(p)
    p.add_argument("--comm-mode", choices=("pull", "push"), default=None, help="AG: override the planner")
    p.add_argument("--chunks", type=int, default=None, help="AG: chunks per rank (override the planner)")
    p.add_argument("--reduce-mode", choices=RS_REDUCE_MODES, default=None,
                   help="RS: override the planner")
    p.add_argument("--rs-comm", choices=("ce", "sm"), default=None,
                   help="RS: how partials reach their owner (copy engine or SM stores; override the planner)")
    p.add_argument("--ce-groups", type=int, default=None, help="RS 'ce': column groups per owner (override)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch async-TP baseline")
    p.add_argument("--fp8", choices=("tensor", "block"), default=None,
                   help="fp8 inputs with per-tensor or block scales: the op against the fp8 GEMM alone")
    p.add_argument("--fp8-format", choices=("e4m3", "e5m2"), default="e4m3", help="with --fp8 (default e4m3)")
    p.add_argument("--check-args", action="store_true",
                   help="keep the ops' cross-rank argument check on (an MPI allgather per call; off by default "
                        "in the sweep, as in the collective sweeps)")
    p.add_argument("--json", dest="json_path", default=None, help="write the rows as JSON to PATH")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG bar chart to PATH")
    return p


def default_shapes(op: str, world: int) -> list[tuple[int, int, int]]:
    """The default shapes for a `world`-way tensor-parallel layer: the same model dimensions, so the
    per-rank N (AllGather+GEMM) or K (GEMM+ReduceScatter) is scaled by 4 / world (doubled at TP=2)."""
    out = []
    for m, n, k in DEFAULT_SHAPES[op]:
        if op == "ag_gemm":
            n = n * DEFAULT_SHAPES_TP // world
        else:
            k = k * DEFAULT_SHAPES_TP // world
        out.append((m, n, k))
    return out


def heap_size(op: str, shapes) -> str:
    """The symmetric heap a sweep of `shapes` needs, as WorldOptions.heap_size: the largest shape's buffers (AG's
    gathered A [M, K]; RS's received and ('ce') pulled partials, two parities of [M, N] each; neither scales
    with TP; each shape's op is freed before the next) beside the collectives context that the decomposed path
    and the baselines keep (its workspace, LL buffer and flags), and 64 MiB of headroom."""
    from ..tuning_tables import TUNED_WORKSPACE_BYTES

    largest = max((m * k * 2 if op == "ag_gemm" else 4 * m * n * 2) + 4096 for m, n, k in shapes)
    ll_and_flags, headroom = 64 << 20, 64 << 20
    need = largest + TUNED_WORKSPACE_BYTES + ll_and_flags + headroom
    return f"{-(-need // (1 << 30))}G"


def shapes_from_args(op: str, args, world: int = DEFAULT_SHAPES_TP) -> list[tuple[int, int, int]]:
    if getattr(args, "suite", None):
        if args.shapes or any(v is not None for v in (args.m, args.n, args.k)):
            raise ValueError("--suite replaces --shapes / --M --N --K: give one of them")
        return [(x.m, x.n, x.k) for x in tp_op_suite(op, world, args.suite)]
    if args.shapes:
        return parse_shapes(args.shapes)
    given = [args.m, args.n, args.k]
    if any(v is not None for v in given):
        if not all(v is not None and v > 0 for v in given):
            raise ValueError("give all of --M, --N and --K (positive), or --shapes")
        return [tuple(given)]
    return default_shapes(op, world)


def overlap_row(op: str, m: int, n: int, k: int, world: int, dtype: str, fused_ms: float, gemm_fluxrt: float,
                gemm_cublas: float, comm_ms: float, sequential_ms: float, torch_ms: float | None,
                comm_win_ms: float | None = None, sequential_win_ms: float | None = None) -> dict:
    """One result row, with ECT-based overlap efficiency (against the faster sequential baseline: NCCL on
    ordinary buffers or on registered windows) and TFLOP/s per GPU."""
    best = min(x for x in (gemm_fluxrt, gemm_cublas) if x is not None)
    seqs = [x for x in (sequential_ms, sequential_win_ms) if x is not None]
    ect_fused = fused_ms - best
    ect_seq = min(seqs) - best if seqs else 0.0
    eff = 1.0 - ect_fused / ect_seq if ect_seq > 0 else float("nan")
    return {"op": op, "m": m, "n": n, "k": k, "world": world, "dtype": dtype, "fused_ms": fused_ms,
            "gemm_ms_fluxrt": gemm_fluxrt, "gemm_ms_cublas": gemm_cublas, "comm_ms_nccl": comm_ms,
            "comm_ms_nccl_win": comm_win_ms, "sequential_ms": sequential_ms, "sequential_ms_win": sequential_win_ms,
            "torch_ms": torch_ms, "overlap_eff": eff, "tflops": 2.0 * m * n * k / (fused_ms * 1e-3) / 1e12}


def baseline_fields(row: dict, decomposed: dict, path: str, path_chunks: int) -> dict:
    """`row` (overlap_row) with the decomposed baseline (``decomposed``: chunks -> ms), the path the op's
    cost model picks, that path's time (``op_ms``), and the ratios to the best baseline (sequential with
    NCCL in either mode, decomposed, torch async-TP)."""
    best_dec = min(decomposed.items(), key=lambda x: x[1]) if decomposed else (None, None)
    op_ms = decomposed.get(path_chunks) if path == "decomposed" else row["fused_ms"]
    baselines = [x for x in (row.get("sequential_ms"), row.get("sequential_ms_win"), best_dec[1], row.get("torch_ms"))
                 if x]
    best = min(baselines) if baselines else None
    return dict(row, decomposed_ms=best_dec[1], decomposed_chunks=best_dec[0],
                decomposed_all_ms={str(c): t for c, t in sorted(decomposed.items())}, path=path,
                path_chunks=path_chunks, op_ms=op_ms, best_baseline_ms=best,
                op_over_best=op_ms / best if best and op_ms else None,
                fused_over_best=row["fused_ms"] / best if best else None)


TARGET_OVER_BEST = 1.01   # issue: on every shape, the op <= 1.01x min(sequential, decomposed, torch async-TP)


def summary(rows: list[dict]) -> dict:
    """Geometric means of the op's speedup over each baseline, the shapes over target, the fallbacks."""
    def geomean(key):
        xs = [r[key] / r["op_ms"] for r in rows if r.get(key) and r.get("op_ms")]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    def shape(r):
        return f"{r['m']}x{r['n']}x{r['k']}"

    return {"shapes": len(rows), "geomean_sequential_over_op": geomean("sequential_ms"),
            "geomean_torch_over_op": geomean("torch_ms"), "geomean_decomposed_over_op": geomean("decomposed_ms"),
            "over_target": [shape(r) for r in rows if (r.get("op_over_best") or 0) > TARGET_OVER_BEST],
            "fallback": [shape(r) for r in rows if r.get("path") == "decomposed"]}


def summary_lines(s: dict) -> list[str]:
    def f(x):
        return "N/A" if x is None else f"{x:.3f}"

    return [f"# {s['shapes']} shapes; geometric mean speedup of the op: {f(s['geomean_sequential_over_op'])}x over "
            f"NCCL+cuBLAS sequential, {f(s['geomean_torch_over_op'])}x over torch async-TP, "
            f"{f(s['geomean_decomposed_over_op'])}x over the decomposed path",
            f"# over target (op > {TARGET_OVER_BEST}x best baseline): {', '.join(s['over_target']) or 'none'}",
            f"# decomposed path chosen: {', '.join(s['fallback']) or 'none'}"]


# (header, row key or a derived ratio, width, decimals)
_COLUMNS = (("M", "m", 6, None), ("N", "n", 6, None), ("K", "k", 6, None), ("fused", "fused_ms", 8, 3),
            ("gemm", "gemm_ms_fluxrt", 8, 3), ("cublas", "gemm_ms_cublas", 8, 3), ("nccl", "comm_ms_nccl", 8, 3),
            ("nccl-win", "comm_ms_nccl_win", 8, 3), ("seq", "sequential_ms", 8, 3),
            ("seq-win", "sequential_ms_win", 8, 3), ("torch", "torch_ms", 8, 3), ("decomp", "decomposed_ms", 8, 3),
            ("path", "path", 10, None), ("op/best", "op_over_best", 7, 3), ("fused/cublas", "fused/cublas", 12, 3),
            ("torch/fused", "torch/fused", 11, 3), ("overlap", "overlap_eff", 8, 3), ("TFLOP/s", "tflops", 8, 1))


def _cell(r: dict, key: str):
    if key == "fused/cublas":
        return r["fused_ms"] / r["gemm_ms_cublas"] if r.get("gemm_ms_cublas") else None
    if key == "torch/fused":
        return r["torch_ms"] / r["fused_ms"] if r.get("torch_ms") else None
    return r.get(key)


def format_table(rows: list[dict]) -> list[str]:
    """Header line + one line per row (times in ms; ratios > 1 in torch/fused mean fluxrt is faster)."""
    return column_table(_COLUMNS, rows, _cell)


def plot_ratios(path: str, rows: list[dict], title: str) -> None:
    """A suite: per shape, each baseline's time over the op's (above 1: the op is faster), and the target."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8, 0.35 * len(rows)), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    series = (("NCCL+cuBLAS sequential", "sequential_ms"), ("decomposed (fluxrt)", "decomposed_ms"),
              ("torch async-TP", "torch_ms"))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        pts = [(j + i * width, r[key] / r["op_ms"]) for j, r in enumerate(rows) if r.get(key) and r.get("op_ms")]
        if pts:
            ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=label)
    ax.axhline(1 / TARGET_OVER_BEST, color="k", lw=0.8, ls="--", label="target (baseline / op >= 1/1.01)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['m']}x{r['n']}x{r['k']}" + ("*" if r.get("path") == "decomposed" else "")
                        for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("baseline time / op time")
    ax.set_title(title + " (* decomposed path chosen)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_rows(path: str, rows: list[dict], title: str) -> None:
    """Grouped bars per shape: fused, cuBLAS alone, NCCL+cuBLAS sequential, decomposed, torch async-TP."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, 2.5 * len(rows)), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    series = (("fluxrt fused", "fused_ms"), ("cuBLAS GEMM alone", "gemm_ms_cublas"),
              ("NCCL+cuBLAS sequential", "sequential_ms"),
              ("NCCL window+cuBLAS sequential", "sequential_ms_win"), ("fluxrt decomposed", "decomposed_ms"),
              ("torch async-TP", "torch_ms"))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [j + i * width for j, r in enumerate(rows) if r.get(key)]
        ys = [r[key] for r in rows if r.get(key)]
        if xs:
            ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['m']}x{r['n']}x{r['k']}" for r in rows])
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- measurement (GPU from here on) -------------------------------------------------------------------

class Timer:
    """Median time of a stream-ordered call, ranks synchronized before each timed iteration."""

    def __init__(self, world: World, stream, warmup: int, iters: int, average: int = 1):
        self.world, self.stream, self.warmup, self.iters = world, stream, warmup, iters
        self.average = average

    def __call__(self, fn, stream=None) -> float:
        return self.many({"t": fn}, {"t": stream} if stream is not None else None)["t"]

    def many(self, fns: dict, streams: dict | None = None) -> dict:
        """Median times of several calls measured in turns (each round times every call once), so that a
        GPU clock drifting with temperature or power over the run shifts them alike and their ratios hold."""
        streams = streams or {}
        for name, fn in fns.items():
            for _ in range(self.warmup):
                fn()
            streams.get(name, self.stream).synchronize()
        self.world.check_errors()
        times: dict = {name: [] for name in fns}
        for _ in range(self.iters):
            for name, fn in fns.items():
                times[name].append(self._once(fn, streams.get(name, self.stream)))
        self.world.check_errors()
        return {name: reduce_over_ranks(self.world.comm.allgather(statistics.median(t)), self.average)
                for name, t in times.items()}

    def _once(self, fn, s) -> float:
        import cupy

        from ..ops import common

        s.synchronize()
        self.world.comm.Barrier()
        common.delay(self.world, LAUNCH_SLACK_S, s)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(s)
        fn()
        end.record(s)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)


def _nccl_comm(world: World) -> tuple:
    """(an NCCL communicator over the world's ranks, notes): None (NCCL columns N/A) without NCCL; the
    notes say why a mode is missing (window mode needs nccl4py)."""
    try:
        lib, notes = nccl_lib.choose()
    except nccl_lib.NcclUnavailable as e:
        log.warning("%s: NCCL columns are N/A", e)
        return None, [f"nccl baseline unavailable: {e}"]
    if len(set(world.comm.allgather(lib.name))) > 1:
        return None, ["nccl baseline not run: the ranks loaded different NCCL bindings"]
    return nccl_lib.Communicator(world, lib), notes


class TorchBaseline:
    """torch async-TP (symmetric-memory fused ops) on the same GPU, or a note saying why not."""

    def __init__(self, world: World):
        self.note = None
        self.ok = False
        try:
            import torch
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            addr = world.comm.bcast(os.uname().nodename if world.rank == 0 else None, root=0)
            port = world.comm.bcast(29500 + (os.getpid() % 2000) if world.rank == 0 else None, root=0)
            os.environ.setdefault("MASTER_ADDR", addr)
            os.environ.setdefault("MASTER_PORT", str(port))
            torch.cuda.set_device(world.device_id)
            if not dist.is_initialized():
                dist.init_process_group("nccl", rank=world.rank, world_size=world.size,
                                        device_id=torch.device("cuda", world.device_id))
            self.group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # deprecated no-op in newer torch
            if enable is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    enable(self.group)
            self.torch = torch
            self.ok = True
        except Exception as e:  # optional baseline: say why it is missing, never fail the bench
            self.note = f"torch async-TP skipped: {type(e).__name__}: {e}"

    def stream(self):
        from ..streams import as_cupy_stream

        return as_cupy_stream(self.torch.cuda.current_stream().cuda_stream)

    def tensor(self, x):
        return self.torch.from_dlpack(x)

    def ag(self, a_shard, b):
        return self.torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], gather_dim=0, group_name=self.group)

    def rs(self, a, b):
        return self.torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=self.group)


def _rand(shape, dtype, seed):
    import cupy

    from ..dtypes import normalize_dtype

    g = cupy.random.default_rng(seed)
    x = (g.standard_normal(shape, dtype=np.float32) / 8).astype(normalize_dtype(dtype))
    cupy.cuda.Device().synchronize()   # made on the current stream; the timed calls run on other streams
    return x


def measure_shape(op: str, world: World, m: int, n: int, k: int, dtype: str, args, timer, nccl_comm,
                  torch_base) -> dict:
    import cupy

    from .. import gemm as fgemm
    from ..ops import AgGemmPlan, AllGatherGemm, GemmReduceScatter, common, decomposed, plan_ag_gemm, \
        plan_gemm_rs
    from ..dtypes import normalize_dtype, short_name
    from ..ops.cost import DECOMPOSED_CHUNKS, chunk_rows

    w, me = world.size, world.rank
    s = timer.stream
    nt = nccl_lib.DATATYPES[short_name(dtype)]
    lib, h = (nccl_comm.lib, nccl_comm.handle) if nccl_comm is not None else (None, None)
    windows = nccl_comm is not None and lib.windows
    wins: list = []   # NCCL's window buffers: registered collectively, freed after the shape

    def window(shape):
        buf = nccl_lib.WindowBuffer(nccl_comm, int(np.prod(shape)), normalize_dtype(dtype))
        wins.append(buf)
        return buf.array.reshape(shape)

    shard = m // w
    with s:
        if op == "ag_gemm":
            plan = plan_ag_gemm(m, n, k, w)
            if args.comm_mode or args.chunks:
                plan = AgGemmPlan(chunks_per_rank=args.chunks or plan.chunks_per_rank,
                                  comm_mode=args.comm_mode or plan.comm_mode)
            fused_op = AllGatherGemm(world, m, n, k, dtype, plan=plan)
            a_shard = _rand((shard, k), dtype, 1 + me)
            a_full = cupy.empty((m, k), dtype=a_shard.dtype)
            b = _rand((k, n), dtype, 100 + me)
            c = cupy.empty((m, n), dtype=a_shard.dtype)

            def fused():
                fused_op.forward(a_shard, b, out=c, stream=s, path="fused")

            def decomposed_call(chunks):
                return lambda: decomposed.ag_gemm(fused_op, common.decomposed_state(fused_op), a_shard, b, c, shard,
                                                  m, chunks, s)

            def comm():
                lib.all_gather(h, a_shard.data.ptr, a_full.data.ptr, a_shard.size, nt, s.ptr)

            def sequential():
                comm()
                gemm_cublas()

            if windows:
                a_shard_w, a_full_w = window((shard, k)), window((m, k))
                a_shard_w[...] = a_shard

                def comm_win():
                    lib.all_gather(h, a_shard_w.data.ptr, a_full_w.data.ptr, a_shard_w.size, nt, s.ptr)

                def sequential_win():
                    comm_win()
                    gemm_into(a_full_w, c)
        else:
            plan = plan_gemm_rs(m, n, k, w)
            overrides = {k: v for k, v in (("reduce_mode", args.reduce_mode), ("comm_mode", args.rs_comm),
                                           ("ce_groups", args.ce_groups)) if v is not None}
            if overrides:
                plan = dataclasses.replace(plan, **overrides).validate()
            fused_op = GemmReduceScatter(world, m, n, k, dtype, plan=plan)
            a_full = _rand((m, k), dtype, 1 + me)
            b = _rand((k, n), dtype, 100 + me)
            c = cupy.empty((m, n), dtype=a_full.dtype)
            out = cupy.empty((shard, n), dtype=a_full.dtype)

            def fused():
                fused_op.forward(a_full, b, out=out, stream=s, path="fused")

            def decomposed_call(chunks):
                return lambda: decomposed.gemm_rs(fused_op, common.decomposed_state(fused_op), a_full, b, out, shard,
                                                  m, chunks, s)

            def comm():
                lib.reduce_scatter(h, c.data.ptr, out.data.ptr, out.size, nt, nccl_lib.REDOPS["sum"], s.ptr)

            def sequential():
                gemm_cublas()
                comm()

            if windows:
                c_w, out_w = window((m, n)), window((shard, n))

                def comm_win():
                    lib.reduce_scatter(h, c_w.data.ptr, out_w.data.ptr, out_w.size, nt, nccl_lib.REDOPS["sum"], s.ptr)

                def sequential_win():
                    gemm_into(a_full, c_w)
                    comm_win()

        # both ops time the same local GEMM: C [M, N] = A_full [M, K] @ B
        def gemm_cublas():
            cupy.matmul(a_full, b, out=c)

        def gemm_fluxrt():
            fgemm.gemm(a_full, b, out=c, stream=s)

        def gemm_into(a, dst):   # the sequential baselines' GEMM: cuBLAS (the fluxrt GEMM where it fails)
            if cublas_ok:
                cupy.matmul(a, b, out=dst)
            else:
                fgemm.gemm(a, b, out=dst, stream=s)
    cublas_ok = True
    try:
        with s:
            gemm_cublas()
        s.synchronize()
    except Exception as e:   # cuBLAS without this dtype: the sequential baseline uses the fluxrt GEMM
        log.warning("cupy.matmul %s failed (%s); sequential baseline uses the fluxrt GEMM", dtype, e)
        cublas_ok = False
        gemm_cublas = gemm_fluxrt  # noqa: F811 (sequential() picks this up)
    s.synchronize()
    world.comm.Barrier()
    # the decomposed baseline at each chunk count that cuts the shard differently
    dec_calls, cuts = {}, set()
    for chunks in () if args.no_decomposed else DECOMPOSED_CHUNKS:
        cut = tuple(chunk_rows(shard, chunks))
        if cut not in cuts:
            cuts.add(cut)
            dec_calls[chunks] = decomposed_call(chunks)
    choice = fused_op.path_choice(m, s)
    if args.check and nccl_comm is not None:
        with s:
            _check_once(op, world, fused, sequential, c if op == "ag_gemm" else out, s)
            for fn in dec_calls.values():
                _check_once(op, world, fn, sequential, c if op == "ag_gemm" else out, s)
    calls = {"fused": fused, "fluxrt": gemm_fluxrt, **{f"dec{x}": fn for x, fn in dec_calls.items()}}
    if cublas_ok:
        calls["cublas"] = gemm_cublas
    if nccl_comm is not None:
        calls.update(comm=comm, sequential=sequential)
    if windows:
        calls.update(comm_win=comm_win, sequential_win=sequential_win)
    with s:
        t = timer.many(calls)
    t_fused, t_fl, t_cb, t_comm, t_seq, t_cw, t_sw = (
        t.get(x) for x in ("fused", "fluxrt", "cublas", "comm", "sequential", "comm_win", "sequential_win"))
    s.synchronize()
    for buf in wins:
        buf.free()
    t_torch = None
    if torch_base is not None and torch_base.ok:
        try:
            ts = torch_base.stream()
            with ts:
                if op == "ag_gemm":
                    ta, tb = torch_base.tensor(a_shard), torch_base.tensor(b)
                    t_torch = timer(lambda: torch_base.ag(ta, tb), stream=ts)
                else:
                    ta, tb = torch_base.tensor(a_full), torch_base.tensor(b)
                    t_torch = timer(lambda: torch_base.rs(ta, tb), stream=ts)
        except Exception as e:
            torch_base.note = f"torch async-TP failed at {m}x{n}x{k}: {type(e).__name__}: {e}"
            log.warning("%s", torch_base.note)
    fused_op.free()
    row = overlap_row(op, m, n, k, w, dtype, t_fused, t_fl, t_cb, t_comm, t_seq, t_torch, t_cw, t_sw)
    return baseline_fields(row, {x: t[f"dec{x}"] for x in dec_calls}, choice.path, choice.chunks)


def _check_once(op, world: World, fused, sequential, result, s) -> None:
    """The fused result equals NCCL + GEMM within bf16/fp16 rounding (relative to the largest value)."""
    fused()
    s.synchronize()
    got = result.astype(np.float32)
    sequential()
    s.synchronize()
    world.check_errors()
    worst = worst_rel_err(world, got, result)
    if not worst < 3e-2:
        raise RuntimeError(f"{op}: fused result differs from NCCL + GEMM: relative error {worst:.3g}")


def main(argv=None, bench: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OPS:
        bench = argv.pop(0)
    if bench is None:   # `fluxrt-perf ag_gemm ...`: the command line names the bench
        bench = next((a for a in sys.argv[1:2] if a in OPS), None) or next((a for a in sys.argv if a in OPS), "ag_gemm")
    args = build_parser(bench).parse_args(argv)
    dtype = _DTYPES.get(args.datatype)
    if dtype is None:
        print(f"fluxrt-perf {bench}: datatype {args.datatype} not supported (bf16 or fp16)", file=sys.stderr)
        return 2
    shapes = shapes_from_args(bench, args)   # validated before the world starts (world size not known yet)
    if args.fp8:
        from .tp_ops_fp8 import main_fp8

        return main_fp8(bench, args, argv, dtype)

    import cupy

    import fluxrt

    world_kw = {"timeout_s": args.timeout} if args.timeout > 0 else {}
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size=heap_size(bench, shapes),
                                                    check_collective_args=args.check_args, **world_kw))
    nccl_comm, nccl_notes = None, []
    try:
        shapes = shapes_from_args(bench, args, world.size)   # an M the op cannot split: OpsArgumentError
        stream = cupy.cuda.Stream(non_blocking=True)
        timer = Timer(world, stream, args.warmup_iters, args.iters, args.average)
        nccl_comm, nccl_notes = _nccl_comm(world)
        torch_base = None if args.no_torch else TorchBaseline(world)
        rows = []
        versions = library_versions(nccl_comm.lib if nccl_comm is not None else None)
        devices = device_info(world)
        if world.rank == 0:
            print(f"# fluxrt-perf {bench}: world={world.size} dtype={args.datatype} iters={args.iters} "
                  f"warmup={args.warmup_iters}; times in ms (median per rank, {AVERAGE_MODES[args.average]} "
                  f"over ranks: -a {args.average})")
            print(version_line(versions))
            for line in device_lines(devices):
                print(line)
            if not args.check_args:
                print("# options differing from the library's defaults: check_collective_args=False "
                      "(library: True; --check-args turns it on)")
            for note in nccl_notes:
                print(f"# {note}")
            if torch_base is not None and torch_base.note:
                print(f"# {torch_base.note}")
            for line in format_table([]):
                print(line, flush=True)
        labels = {(x.m, x.n, x.k): x.label for x in tp_op_suite(bench, world.size, args.suite)} if args.suite else {}
        for m, n, k in shapes:
            row = measure_shape(bench, world, m, n, k, dtype, args, timer, nccl_comm, torch_base)
            if (m, n, k) in labels:
                row["label"] = labels[(m, n, k)]
            rows.append(row)
            if world.rank == 0:
                print(format_table([row])[1], flush=True)
        if world.rank == 0:
            summ = summary(rows)
            for line in summary_lines(summ):
                print(line)
            if torch_base is not None and torch_base.note and torch_base.ok:
                print(f"# {torch_base.note}")
            if args.json_path:
                options = {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path")}
                doc = results_document(bench, rows, ["fluxrt-perf", bench] + argv, machine=machine(world),
                                       versions=versions, devices=devices,
                                       options=dict(options, average_name=AVERAGE_MODES[args.average]))
                doc["summary"] = summ
                doc["notes"] = nccl_notes + ([torch_base.note] if torch_base is not None and torch_base.note else [])
                write_json(args.json_path, doc)
            if args.plot_path:
                plot = plot_ratios if args.suite else plot_rows
                plot(args.plot_path, rows, f"fluxrt {bench}, {world.size} GPUs, {args.datatype}")
    finally:
        if nccl_comm is not None:
            nccl_comm.close()
        world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
