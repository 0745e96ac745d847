"""Collective sweeps in the manner of nccl-tests (all_reduce_perf, all_gather_perf, ...): fluxrt and NCCL
(through cupy.cuda.nccl, communicator made from a unique id broadcast over the world's MPI communicator)
measured in the same run on the same buffers, one table line per size with a time ratio.

Sizes are nccl-tests' "size": the whole message (allreduce, broadcast: the buffer; allgather: the gathered
output; reduce_scatter: the input; alltoall(v): each rank's send buffer). With -c 1 each size is first run
once per implementation on poisoned outputs and compared on the device with the expected values: inputs are
small integers, so every summation order gives the exact result and a mismatch is a real error.
-G N captures `-n` calls in one CUDA graph and times N replays (time per call = total / (N * n)).
fluxrt's calls skip the cross-rank argument check (WorldOptions.check_collective_args) unless --check-args.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import sys
from typing import TYPE_CHECKING

import numpy as np

from ..collectives_plan import ALGO_PAIRS as _ALGO_PAIRS
from ..dtypes import normalize_dtype
from .baselines import machine, nccl_communicator, nccl_datatype
from .report import Row, Table, plot, progress, results_document, write_json
from .sweep import SweepOptions, add_sweep_arguments, bus_bandwidth_factor, describe, sizes

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "alltoallv", "broadcast")
REDUCING = ("allreduce", "reduce_scatter")
_PATTERN_PERIOD = 16  # inputs are integers in [-8, 8): sums over <= 32 ranks are exact in bf16/fp16/fp32


def size_align(op: str, element_size: int, nranks: int) -> int:
    """Sizes are rounded to whole elements, and to whole per-rank chunks where the op splits the buffer."""
    return element_size * nranks if op in ("allgather", "reduce_scatter", "alltoall", "alltoallv") else element_size


def buffer_elems(op: str, nbytes: int, element_size: int, nranks: int) -> tuple[int, int]:
    """(input elements, output elements) per rank for an nccl-tests size of `nbytes`."""
    total = nbytes // element_size
    if op == "allgather":
        return total // nranks, total
    if op == "reduce_scatter":
        return total, total // nranks
    if op in OPS:
        return total, total
    raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")


# ------------------------------------------------------------------------------------------ data and checks
_pattern_kernel = None


def _pattern(count: int, key: int, dtype, start: int = 0):
    """Integers in [-8, 8) at positions start.. that differ by position and by `key` (rank, or sender and
    receiver), made on the device without index temporaries (1 GiB sweeps must fit beside the buffers)."""
    import cupy

    global _pattern_kernel
    if _pattern_kernel is None:
        _pattern_kernel = cupy.ElementwiseKernel(
            "int64 key, int64 start", "float32 y",
            f"y = (float)((((i + start) % {_PATTERN_PERIOD}) * 7 + key * 3 + 1) % {_PATTERN_PERIOD} "
            f"- {_PATTERN_PERIOD // 2})", "fluxrt_perf_pattern")
    y = cupy.empty(count, dtype=np.float32)
    _pattern_kernel(np.int64(key), np.int64(start), y)
    return y if np.dtype(dtype) == np.float32 else y.astype(dtype)


def _combine(keys, count: int, redop: str, start: int = 0):
    """The reduction over ranks `keys` of their patterns, in fp32 (exact: small integers)."""
    import cupy

    fn = {"sum": cupy.add, "max": cupy.maximum, "min": cupy.minimum}[redop]
    acc = _pattern(count, keys[0], np.float32, start)
    for k in keys[1:]:
        fn(acc, _pattern(count, k, np.float32, start), out=acc)
    return acc


class Case:
    """One op at one size: input, poisoned output, expected output, all on the device."""

    def __init__(self, op: str, world: World, x_full, out_full, nbytes: int, dtype, redop: str, root: int):
        n, r = world.size, world.rank
        self.op, self.redop, self.root, self.world = op, redop, root, world
        self.in_elems, self.out_elems = buffer_elems(op, nbytes, np.dtype(dtype).itemsize, n)
        self.x = x_full[:self.in_elems]
        self.out = out_full[:self.out_elems]
        self.chunk = self.in_elems // n if op in ("alltoall", "alltoallv") else self.in_elems
        self.dtype = np.dtype(dtype)

    def fill_input(self) -> None:
        import cupy

        n, r, c = self.world.size, self.world.rank, self.chunk
        if self.op in ("alltoall", "alltoallv"):
            self.x[...] = cupy.concatenate([_pattern(c, r * n + q, self.dtype) for q in range(n)])
        else:
            self.x[...] = _pattern(self.in_elems, r, self.dtype)

    def expected(self):
        import cupy

        n, r, c = self.world.size, self.world.rank, self.chunk
        if self.op == "allreduce":
            return _combine(range(n), self.in_elems, self.redop)
        if self.op == "reduce_scatter":
            return _combine(range(n), self.out_elems, self.redop, start=r * self.out_elems)
        if self.op == "allgather":
            return cupy.concatenate([_pattern(self.in_elems, p, np.float32) for p in range(n)])
        if self.op in ("alltoall", "alltoallv"):
            return cupy.concatenate([_pattern(c, p * n + r, np.float32) for p in range(n)])
        return _pattern(self.in_elems, self.root, np.float32)

    def poison(self) -> None:
        self.out.fill(-12345 if self.dtype.kind in "iu" else np.nan)

    def wrong(self) -> int:
        return int((self.out.astype(np.float32) != self.expected()).sum())


# ------------------------------------------------------------------------------------------ implementations
class FluxrtRunner:
    name = "fluxrt"

    def __init__(self, world: World, op: str, algo: str, redop: str, root: int, workspace_bytes: int, symmetric: bool,
                 tuning=None):
        import fluxrt

        options = fluxrt.CollectivesOptions(workspace_bytes=workspace_bytes, tuning=tuning)  # None: the machine's table
        self.ctx = fluxrt.Collectives(world, options)
        self.op, self.algo, self.redop, self.root, self.n = op, algo, redop, root, world.size
        self.symmetric = symmetric

    def algo_name(self, case: Case) -> str:
        from ..collectives_plan import describe as plan_describe

        count = {"reduce_scatter": case.out_elems, "alltoall": case.chunk, "alltoallv": case.chunk}.get(
            self.op, case.in_elems)
        isz = case.dtype.itemsize
        nbytes = (case.out_elems if self.op == "allgather" else case.in_elems) * isz
        d = plan_describe(self.op, count, isz, self.n, self.ctx.half_bytes, self.algo,
                          direct_ok=self.symmetric, nbytes=nbytes, tuning=self.ctx.tuning)
        return d["algo"]

    def __call__(self, case: Case, stream) -> None:
        c = self.ctx
        if self.op == "allreduce":
            c.allreduce(case.x, case.out, op=self.redop, stream=stream, algo=self.algo)
        elif self.op == "reduce_scatter":
            c.reduce_scatter(case.x, case.out, op=self.redop, stream=stream, algo=self.algo)
        elif self.op == "allgather":
            c.allgather(case.x, case.out, stream=stream, algo=self.algo)
        elif self.op == "alltoall":
            c.alltoall(case.x, case.out, stream=stream, algo=self.algo)
        elif self.op == "alltoallv":
            counts = [case.chunk] * self.n
            c.alltoallv(case.x, counts, counts, case.out, max_count=case.chunk, stream=stream, algo=self.algo)
        else:
            c.broadcast(case.x, case.out, root=self.root, stream=stream, algo=self.algo)

    def close(self) -> None:
        self.ctx.free()


class NcclRunner:
    name = "nccl"

    def __init__(self, world: World, op: str, redop: str, root: int):
        from cupy.cuda import nccl

        self.nccl = nccl
        self.comm = nccl_communicator(world)
        self.op, self.root, self.n = op, root, world.size
        self.redop = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[redop]

    def algo_name(self, case: Case) -> str:
        return "nccl"

    def __call__(self, case: Case, stream) -> None:
        x, out, s, dt = case.x.data.ptr, case.out.data.ptr, stream.ptr, nccl_datatype(case.dtype)
        if self.op == "allreduce":
            self.comm.allReduce(x, out, case.in_elems, dt, self.redop, s)
        elif self.op == "reduce_scatter":
            self.comm.reduceScatter(x, out, case.out_elems, dt, self.redop, s)
        elif self.op == "allgather":
            self.comm.allGather(x, out, case.in_elems, dt, s)
        elif self.op in ("alltoall", "alltoallv"):
            step = case.chunk * case.dtype.itemsize
            self.nccl.groupStart()
            for p in range(self.n):
                self.comm.send(x + p * step, case.chunk, dt, p, s)
                self.comm.recv(out + p * step, case.chunk, dt, p, s)
            self.nccl.groupEnd()
        else:
            self.comm.broadcast(x, out, case.in_elems, dt, self.root, s)

    def close(self) -> None:
        self.comm.destroy()


# ------------------------------------------------------------------------------------------ measurement
def _time_us(world: World, run, case: Case, stream, opts: SweepOptions) -> float:
    """Microseconds per call on this rank's stream, the slowest rank's (as nccl-tests reports)."""
    import cupy
    from mpi4py import MPI

    for _ in range(opts.warmup_iters):
        run(case, stream)
    stream.synchronize()
    world.comm.Barrier()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    if opts.graph_iters:
        stream.begin_capture()
        for _ in range(opts.iters):
            run(case, stream)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        world.comm.Barrier()
        start.record(stream)
        for _ in range(opts.graph_iters):
            graph.launch(stream)
        stop.record(stream)
        calls = opts.graph_iters * opts.iters
    else:
        start.record(stream)
        for _ in range(opts.iters):
            run(case, stream)
        stop.record(stream)
        calls = opts.iters
    stop.synchronize()
    world.check_errors()
    t = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls
    return world.comm.allreduce(t, op=MPI.MAX)


def _check(world: World, run, case: Case, stream) -> int:
    from mpi4py import MPI

    case.poison()
    world.device.synchronize()  # the poison ran on the current stream, not on `stream`
    world.comm.Barrier()
    run(case, stream)
    stream.synchronize()
    world.check_errors()
    return world.comm.allreduce(case.wrong(), op=MPI.SUM)


def sweep(world: World, op: str, opts: SweepOptions, runners, root: int, out=None,
          symmetric: bool = False) -> list[Row]:
    import cupy

    n = world.size
    dtype = normalize_dtype(opts.datatype)
    esize = dtype.itemsize
    redop = opts.op if op in REDUCING else "none"
    sweep_sizes = sizes(opts, align=size_align(op, esize, n))
    max_in, max_out = buffer_elems(op, sweep_sizes[-1], esize, n)
    alloc = world.empty if symmetric else cupy.empty
    x_full = alloc(max(1, max_in), dtype=dtype)
    out_full = alloc(max(1, max_out), dtype=dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    factor = bus_bandwidth_factor(op, n)
    table = Table(impls=tuple(r.name for r in runners), out=out if world.rank == 0 else io.StringIO(),
                  show_algo=True)
    tuned = runners[0].ctx.tuning
    changed = {f.name: getattr(tuned, f.name) for f in dataclasses.fields(tuned)
               if getattr(tuned, f.name) != f.default}
    table.header([*describe(opts), f"# {op} on {n} ranks; fluxrt algo: {runners[0].algo}; buffers: "
                                   f"{'symmetric' if symmetric else 'plain cupy'}"
                                   + (f"; tuning: {changed}" if changed else "")])
    for nbytes in progress(sweep_sizes, enabled=opts.progress and world.rank == 0, desc=op):
        case = Case(op, world, x_full, out_full, nbytes, dtype, redop, root)
        case.fill_input()
        world.device.synchronize()
        line = []
        for run in runners:
            wrong = _check(world, run, case, stream) if opts.check else None
            t = _time_us(world, run, case, stream, opts)
            algo = run.algo_name(case)
            scheme, algorithm = _ALGO_PAIRS.get((op, algo), ("", "")) if run.name == "fluxrt" else ("", "")
            line.append(Row.measured(nbytes=nbytes, count=nbytes // esize, dtype=opts.datatype, redop=redop,
                                     impl=run.name, algo=algo, time_us=t, busbw_factor=factor,
                                     wrong=wrong, root=root if op == "broadcast" else -1,
                                     scheme=scheme, algorithm=algorithm))
        table.add(line)
    table.footer()
    if symmetric:
        world.free(out_full)
        world.free(x_full)
    return table.rows


def parser(op: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"fluxrt-perf {op}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(ap)
    ap.add_argument("--algo", default="auto", help="force a fluxrt algorithm (see fluxrt.collectives_plan.ALGOS)")
    ap.add_argument("--impls", default="fluxrt,nccl", help="comma list of fluxrt,nccl (default: both)")
    ap.add_argument("--root", type=int, default=0, help="broadcast root (default: 0)")
    ap.add_argument("--workspace", default="256M", help="fluxrt collectives workspace per rank (default: 256M)")
    ap.add_argument("--heap", default=None,
                    help="symmetric heap per rank (default: NVSHMEM's, or what --symmetric needs)")
    ap.add_argument("--symmetric", action="store_true",
                    help="allocate inputs and outputs on the symmetric heap (zero-copy 'direct' paths)")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="override a collectives_plan.Tuning field, e.g. --tune ll_max_bytes=256K "
                         "--tune bulk_max_grid=128 (repeatable)")
    ap.add_argument("--check-args", action="store_true",
                    help="keep fluxrt's cross-rank argument check on (an MPI allgather per eager call)")
    return ap


def main(argv=None, op: str = "allreduce") -> int:
    import fluxrt
    from ..symmetric import parse_bytes
    from ..collectives_plan import ALGOS

    if op not in OPS:
        raise SystemExit(f"fluxrt-perf: unknown collective {op!r} (one of {', '.join(OPS)})")
    ap = parser(op)
    args = ap.parse_args(argv)
    opts = SweepOptions.from_args(args)
    impls = [i for i in args.impls.split(",") if i]
    if not impls or set(impls) - {"fluxrt", "nccl"} or impls[0] != "fluxrt":
        ap.error("--impls must start with fluxrt, e.g. fluxrt,nccl or fluxrt")
    if args.algo != "auto" and args.algo not in ALGOS[op]:
        ap.error(f"--algo {args.algo!r}: {op} has {', '.join(ALGOS[op])} (or auto)")
    if args.algo == "direct" and not args.symmetric:
        ap.error("--algo direct pushes into symmetric outputs: add --symmetric")
    if op in REDUCING and opts.datatype == "int32":
        ap.error(f"{op} reduces bf16, fp16 or fp32 (-d), not int32")
    from ..collectives_plan import Tuning

    try:
        tuning = Tuning.parse(args.tune)
    except ValueError as e:
        ap.error(str(e))
    heap = args.heap
    if heap is None and args.symmetric:
        esize = np.dtype(normalize_dtype(opts.datatype)).itemsize
        heap = 2 * opts.maxbytes + 2 * esize + parse_bytes(args.workspace) + (256 << 20)
    options = fluxrt.WorldOptions(heap_size=heap, check_collective_args=args.check_args)
    with fluxrt.init(options=options) as world:
        if not 0 <= args.root < world.size:
            ap.error(f"--root {args.root} outside {world.size} ranks")
        redop = opts.op if op in REDUCING else "none"
        runners = [FluxrtRunner(world, op, args.algo, redop if op in REDUCING else "sum", args.root,
                                parse_bytes(args.workspace), args.symmetric, tuning)]
        if "nccl" in impls:
            try:
                runners.append(NcclRunner(world, op, opts.op, args.root))
            except Exception as e:  # the baseline is optional: say why it is missing and go on
                if world.rank == 0:
                    print(f"# nccl baseline unavailable: {e}", file=sys.stderr)
        rows = sweep(world, op, opts, runners, args.root, out=sys.stdout, symmetric=args.symmetric)
        for r in runners:
            r.close()
        if world.rank == 0:
            command = ["fluxrt-perf", op, *(sys.argv[2:] if argv is None else argv)]
            doc = results_document(op, [dict(vars(r), op=op) for r in rows], command, machine=machine(world))
            if opts.json_path:
                write_json(opts.json_path, doc)
            if opts.plot_path:
                plot(opts.plot_path, rows, f"{op} {opts.datatype} on {world.size} ranks")
        wrong = sum(r.wrong or 0 for r in rows)
    return 1 if wrong else 0
