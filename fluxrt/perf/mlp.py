"""``fluxrt-perf mlp``: the tensor-parallel MLP block (fluxrt.ops.TPMLP) against the same block unfused.

Per shape (M rows over all ranks, hidden size H, intermediate size I over all ranks; each rank holds
I/world intermediate columns), under mpirun with one GPU per rank:

    fluxrt_ms     TPMLP.forward, eager: each op on the path its cost model picks (paths column)
    graph_ms      the same block captured in a CUDA graph, one replay (both ops on the decomposed path)
    fused_ms      TPMLP.forward with path='fused' (both fused kernels)
    unfused_ms    NCCL all-gather -> cuBLAS gate/up -> SiLU-and-multiply (the block's kernel) -> cuBLAS down
                  -> NCCL reduce-scatter, one stream
    torch_ms      torch async-TP: fused_all_gather_matmul -> silu * up -> fused_matmul_reduce_scatter
                  (never a dependency; skipped with a note where torch is missing)
    speedup       unfused_ms / fluxrt_ms (the issue's target: >= 1.15 at TP=4)

Shapes: ``--M --hidden --ffn`` or ``--suite tp|tp-quick`` (every model's MLP of fluxrt.perf.shapes at TP =
world size). Timing as ``fluxrt-perf ag_gemm`` (fluxrt.perf.tp_ops.Timer: calls timed in turns, median per
rank, reduced over ranks by -a).
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

from .baselines import device_info, library_versions, machine, nccl_datatype, worst_rel_err
from .nccl_lib import REDOPS
from .report import column_table, device_lines, results_document, version_line, write_json
from .shapes import TP_OP_SUITES, tp_mlp_suite
from .sweep import AVERAGE_MODES, add_average_argument, add_timeout_argument, normalize_datatype
from .tp_ops import _DTYPES, _nccl_comm, _rand, TorchBaseline, Timer

if TYPE_CHECKING:
    from ..world import World

DEFAULT_SHAPE = (8192, 8192, 28672)   # llama3-70b's MLP at M 8192


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluxrt-perf mlp", description=__doc__.split("\n\n")[0])
    p.add_argument("--M", dest="m", type=int, default=None, help="rows over all ranks")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="intermediate size over all ranks")
    p.add_argument("--suite", choices=sorted(TP_OP_SUITES), default=None, help="every model's MLP at TP = world")
    p.add_argument("-d", "--datatype", default="bf16", type=normalize_datatype, help="bf16|fp16 (default bf16)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check the block once against the unfused block (default 1)")
    add_average_argument(p)
    add_timeout_argument(p)
    p.add_argument("--no-torch", action="store_true", help="skip the torch async-TP baseline")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None)
    return p


def shapes_from_args(args, world: int) -> list[tuple[int, int, int, str]]:
    if args.suite:
        if any(v is not None for v in (args.m, args.hidden, args.ffn)):
            raise ValueError("--suite replaces --M --hidden --ffn: give one of them")
        return tp_mlp_suite(world, args.suite)
    m, h, f = (v if v is not None else d for v, d in zip((args.m, args.hidden, args.ffn), DEFAULT_SHAPE))
    if min(m, h, f) <= 0:
        raise ValueError("--M, --hidden and --ffn must be positive")
    return [(m, h, f, "")]


def measure(world: World, m: int, hidden: int, inter: int, dtype: str, args, timer, nccl_comm, torch_base) -> dict:
    import cupy

    from ..ops import TPMLP

    w, me = world.size, world.rank
    ffn, shard = inter // w, m // w
    s = timer.stream
    with s:
        mlp = TPMLP(world, m, hidden, ffn, dtype)
        x = _rand((shard, hidden), dtype, 1 + me)
        w_gu = _rand((hidden, 2 * ffn), dtype, 100 + me)
        w_down = _rand((ffn, hidden), dtype, 200 + me)
        y = cupy.empty((shard, hidden), dtype=x.dtype)
        x_full = cupy.empty((m, hidden), dtype=x.dtype)
        h = cupy.empty((m, 2 * ffn), dtype=x.dtype)
        act = cupy.empty((m, ffn), dtype=x.dtype)
        part = cupy.empty((m, hidden), dtype=x.dtype)
        y_ref = cupy.empty((shard, hidden), dtype=x.dtype)
    nt = nccl_datatype(dtype) if nccl_comm is not None else None

    def fluxrt_eager():
        mlp.forward(x, w_gu, w_down, out=y, stream=s)

    def fused():
        mlp.forward(x, w_gu, w_down, out=y, stream=s, path="fused")

    def unfused():
        unfused_block(nccl_comm, nt, x, w_gu, w_down, (x_full, h, act, part), y_ref, mlp.silu_mul, s, cupy.matmul)

    with s:
        mlp.forward(x, w_gu, w_down, out=y, stream=s, path="decomposed")   # the capture's kernels, loaded first
        s.synchronize()
        s.begin_capture()
        mlp.forward(x, w_gu, w_down, out=y, stream=s)
        graph = s.end_capture()
        paths = f"{mlp.ag.path_choice(m, s).path}/{mlp.rs.path_choice(m, s).path}"
    calls = {"fluxrt": fluxrt_eager, "graph": lambda: graph.launch(s), "fused": fused}
    if nccl_comm is not None:
        calls["unfused"] = unfused
        if args.check:
            with s:
                _check(world, fluxrt_eager, unfused, y, y_ref, s)
    with s:
        t = timer.many(calls)
    t_torch = None
    if torch_base is not None and torch_base.ok:
        try:
            ts = torch_base.stream()
            torch = torch_base.torch
            with ts:
                tx, tgu, tdown = torch_base.tensor(x), torch_base.tensor(w_gu), torch_base.tensor(w_down)

                def torch_block():
                    _, outs = torch_base.ag(tx, tgu)
                    hh = outs[0]
                    a = torch.nn.functional.silu(hh[:, :ffn]) * hh[:, ffn:]
                    return torch_base.rs(a, tdown)

                t_torch = timer(torch_block, stream=ts)
        except Exception as e:
            torch_base.note = f"torch async-TP failed at MLP {m}x{hidden}x{inter}: {type(e).__name__}: {e}"
    mlp.free()
    un = t.get("unfused")
    return {"m": m, "hidden": hidden, "ffn": inter, "world": w, "dtype": dtype, "paths": paths,
            "fluxrt_ms": t["fluxrt"], "graph_ms": t["graph"], "fused_ms": t["fused"], "unfused_ms": un,
            "torch_ms": t_torch, "speedup": un / t["fluxrt"] if un else None,
            "torch_over_fluxrt": t_torch / t["fluxrt"] if t_torch else None}


def unfused_block(comm, nt: int, x, w_gu, w_down, scratch, out, silu_mul, stream, matmul) -> None:
    """The MLP block unfused on `stream`: NCCL all-gather of x -> gate/up GEMM -> SiLU-and-multiply ->
    down GEMM -> NCCL reduce-scatter (sum) into `out`. `comm`: a :class:`nccl_lib.Communicator`; `scratch`:
    (x_full, h, act, part); `matmul(a, b, out=)` runs on the current stream."""
    x_full, h, act, part = scratch
    lib, handle = comm.lib, comm.handle
    lib.all_gather(handle, x.data.ptr, x_full.data.ptr, x.size, nt, stream.ptr)
    matmul(x_full, w_gu, out=h)
    silu_mul(h, act, stream)
    matmul(act, w_down, out=part)
    lib.reduce_scatter(handle, part.data.ptr, out.data.ptr, out.size, nt, REDOPS["sum"], stream.ptr)


def _check(world: World, block, unfused, y, y_ref, s) -> None:
    block()
    unfused()
    s.synchronize()
    world.check_errors()
    worst = worst_rel_err(world, y, y_ref)
    if not worst < 3e-2:
        raise RuntimeError(f"mlp: the block differs from NCCL + cuBLAS: relative error {worst:.3g}")


_COLUMNS = (("M", "m", 6, None), ("H", "hidden", 6, None), ("I", "ffn", 6, None), ("paths", "paths", 21, None),
            ("fluxrt", "fluxrt_ms", 8, 3), ("graph", "graph_ms", 8, 3), ("fused", "fused_ms", 8, 3),
            ("unfused", "unfused_ms", 8, 3), ("torch", "torch_ms", 8, 3), ("speedup", "speedup", 8, 3),
            ("torch/flx", "torch_over_fluxrt", 9, 3))


def format_table(rows: list[dict]) -> list[str]:
    return column_table(_COLUMNS, rows)


def geomean(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def plot_rows(path: str, rows: list[dict], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, 0.5 * len(rows) + 3), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    series = (("fluxrt TPMLP", "fluxrt_ms"), ("graph replay", "graph_ms"), ("NCCL+cuBLAS unfused", "unfused_ms"),
              ("torch async-TP", "torch_ms"))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        pts = [(j + i * width, r[key]) for j, r in enumerate(rows) if r.get(key)]
        if pts:
            ax.bar([p[0] for p in pts], [p[1] for p in pts], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['m']}x{r['hidden']}x{r['ffn']}" for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dtype = _DTYPES.get(args.datatype)
    if dtype is None:
        print(f"fluxrt-perf mlp: datatype {args.datatype} not supported (bf16 or fp16)", file=sys.stderr)
        return 2
    shapes = shapes_from_args(args, 4)

    import cupy

    import fluxrt

    heap = max(m * h * 2 + 4 * m * h * 2 for m, h, _, _ in shapes) + (64 << 20)   # AG's A + RS's partials
    world_kw = {"timeout_s": args.timeout} if args.timeout > 0 else {}
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size=f"{-(-heap // (1 << 30))}G", check_collective_args=False,
                                                    **world_kw))
    nccl_comm, nccl_notes = None, []
    try:
        shapes = shapes_from_args(args, world.size)
        stream = cupy.cuda.Stream(non_blocking=True)
        timer = Timer(world, stream, args.warmup_iters, args.iters, args.average)
        nccl_comm, nccl_notes = _nccl_comm(world)
        torch_base = None if args.no_torch else TorchBaseline(world)
        versions = library_versions(nccl_comm.lib if nccl_comm is not None else None)
        devices = device_info(world)
        rows = []
        if world.rank == 0:
            print(f"# fluxrt-perf mlp: world={world.size} dtype={args.datatype} iters={args.iters} "
                  f"warmup={args.warmup_iters}; times in ms ({AVERAGE_MODES[args.average]} over ranks)")
            print(version_line(versions))
            for line in device_lines(devices):
                print(line)
            for note in nccl_notes:
                print(f"# {note}")
            if torch_base is not None and torch_base.note:
                print(f"# {torch_base.note}")
            print(format_table([])[0], flush=True)
        for m, h, inter, label in shapes:
            if m % world.size or inter % (8 * world.size):
                raise ValueError(f"mlp: M={m} must be a multiple of {world.size} and I={inter} of {8 * world.size}")
            row = measure(world, m, h, inter, dtype, args, timer, nccl_comm, torch_base)
            row["label"] = label
            rows.append(row)
            if world.rank == 0:
                print(format_table([row])[1], flush=True)
        if world.rank == 0:
            summ = {"shapes": len(rows), "geomean_unfused_over_fluxrt": geomean(rows, "speedup"),
                    "geomean_torch_over_fluxrt": geomean(rows, "torch_over_fluxrt")}
            g1, g2 = summ["geomean_unfused_over_fluxrt"], summ["geomean_torch_over_fluxrt"]
            print(f"# geometric mean speedup of TPMLP: {g1 and f'{g1:.3f}'}x over unfused, "
                  f"{g2 and f'{g2:.3f}'}x over torch async-TP")
            if args.json_path:
                doc = results_document("mlp", rows, ["fluxrt-perf", "mlp"] + argv, machine=machine(world),
                                       versions=versions, devices=devices, options=vars(args))
                doc["summary"] = summ
                notes = nccl_notes + ([torch_base.note] if torch_base is not None and torch_base.note else [])
                if notes:
                    doc["notes"] = notes
                write_json(args.json_path, doc)
            if args.plot_path:
                plot_rows(args.plot_path, rows, f"fluxrt TP MLP, {world.size} GPUs, {args.datatype}")
    finally:
        if nccl_comm is not None:
            nccl_comm.close()
        world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
