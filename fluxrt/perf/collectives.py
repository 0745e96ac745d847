"""Collective sweeps in the manner of nccl-tests (all_reduce_perf, all_gather_perf, ...): fluxrt and NCCL
measured in the same run, one table line per size. NCCL runs in two modes (fluxrt.perf.nccl_lib): "nccl" on
the same buffers as fluxrt, "nccl-win" on ncclMemAlloc buffers registered as symmetric windows (nccl-tests'
-R 2, where NCCL runs its symmetric-memory kernels; needs nccl4py). The ratio column is the faster NCCL
mode's time / fluxrt's time; the JSON's "ratios" say which mode that was.

Sizes are nccl-tests' "size": the whole message (allreduce, broadcast: the buffer; allgather: the gathered
output; reduce_scatter: the input; alltoall(v): each rank's send buffer). With -c 1 each size is first run
once per implementation on poisoned outputs and compared on the device with the expected values: inputs are
small integers, so every summation order gives the exact result and a mismatch is a real error.
-G N captures `-n` calls in one CUDA graph and times N replays (time per call = total / (N * n)).
Each rank times its own calls; the time shown is those per-rank times reduced by -a as nccl-tests does
(default 1: the mean over ranks; 0 rank 0's, 2 min, 3 max); the JSON rows also keep min/avg/max.
Out-of-place, then in-place columns (allreduce, alltoall and broadcast with out = x; allgather with
x = out[r*c:(r+1)*c]; reduce_scatter with out = x[r*c:(r+1)*c]; alltoallv has none, nor does NCCL's
alltoall, made of grouped send/recv).
fluxrt's calls skip the cross-rank argument check (WorldOptions.check_collective_args) unless --check-args;
the header says which options differ from the library's defaults.
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
from ..dtypes import normalize_dtype, short_name
from . import nccl_lib
from .baselines import device_info, library_versions, machine, nccl_registration
from .report import (Row, Table, device_lines, differences_line, option_differences, plot, progress,
                     results_document, version_line, write_json)
from .sweep import (AVERAGE_MODES, DTYPE_SIZES, SweepOptions, add_sweep_arguments, bus_bandwidth_factor,
                    describe, rank_stats, reduce_over_ranks, sizes, sweep_datatypes, sweep_ops, sweep_roots)

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "alltoallv", "broadcast")
REDUCING = ("allreduce", "reduce_scatter")
INPLACE = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast")   # fluxrt's in-place layouts
REDUCING_DTYPES = ("bf16", "fp16", "fp32")
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


def inplace_layout(op: str, in_elems: int, out_elems: int, rank: int) -> tuple[str, int, int]:
    """Where an in-place call's input and output lie: (buffer "x" or "out", input offset, output offset) in
    elements of that buffer, as the README's in-place layouts (and NCCL's) put them."""
    if op not in INPLACE:
        raise ValueError(f"{op} has no in-place form (in place: {', '.join(INPLACE)})")
    if op == "allgather":
        return "out", rank * in_elems, 0
    if op == "reduce_scatter":
        return "x", 0, rank * out_elems
    return "x", 0, 0


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

    def __init__(self, op: str, world: World, x_full, out_full, nbytes: int, dtype, redop: str, root: int,
                 inplace: bool = False):
        n, r = world.size, world.rank
        self.op, self.redop, self.root, self.world, self.inplace = op, redop, root, world, inplace
        self.in_elems, self.out_elems = buffer_elems(op, nbytes, np.dtype(dtype).itemsize, n)
        if inplace:
            buf, xo, oo = inplace_layout(op, self.in_elems, self.out_elems, r)
            full = x_full if buf == "x" else out_full
            self.x = full[xo:xo + self.in_elems]
            self.out = full[oo:oo + self.out_elems]
        else:
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
        """Poison what the call must write and is not its input (in place: allgather's other chunks)."""
        value = -12345 if self.dtype.kind in "iu" else np.nan
        if not self.inplace:
            self.out.fill(value)
        elif self.op == "allgather":
            lo = self.world.rank * self.in_elems
            self.out[:lo].fill(value)
            self.out[lo + self.in_elems:].fill(value)

    def wrong(self) -> int:
        return int((self.out.astype(np.float32) != self.expected()).sum())


# ------------------------------------------------------------------------------------------ implementations
class FluxrtRunner:
    name = "fluxrt"

    def __init__(self, world: World, op: str, algo: str, redop: str, root: int, workspace_bytes: int, symmetric: bool,
                 tuning=None):
        import fluxrt

        from .. import collectives_hier
        from ..collectives_plan import choose_path

        options = fluxrt.CollectivesOptions(workspace_bytes=workspace_bytes, tuning=tuning)  # None: the machine's table
        # a world of several (or virtual) nodes times the path its collectives take: the hierarchical one
        self.hierarchical = choose_path(getattr(world, "topology", None))[0] == "hierarchical"
        if self.hierarchical:
            self.ctx = collectives_hier.HierarchicalCollectives(world, collectives_hier.HierarchicalOptions(node=options))
        else:
            self.ctx = fluxrt.Collectives(world, options)
        self.op, self.algo, self.redop, self.root, self.n = op, algo, redop, root, world.size
        self.symmetric = symmetric

    def algo_name(self, case: Case) -> str:
        from ..collectives_plan import describe as plan_describe

        if self.hierarchical:
            return "hierarchical"
        count = {"reduce_scatter": case.out_elems, "alltoall": case.chunk, "alltoallv": case.chunk}.get(
            self.op, case.in_elems)
        isz = case.dtype.itemsize
        nbytes = (case.out_elems if self.op == "allgather" else case.in_elems) * isz
        d = plan_describe(self.op, count, isz, self.n, self.ctx.half_bytes, self.algo,
                          direct_ok=self.symmetric, nbytes=nbytes, tuning=self.ctx.tuning)
        return d["algo"]

    def inplace_ok(self) -> bool:
        return self.op in INPLACE

    def __call__(self, case: Case, stream) -> None:
        c = self.ctx
        redop = case.redop if case.redop in ("sum", "max", "min") else self.redop
        if self.op == "allreduce":
            c.allreduce(case.x, case.out, op=redop, stream=stream, algo=self.algo)
        elif self.op == "reduce_scatter":
            c.reduce_scatter(case.x, case.out, op=redop, stream=stream, algo=self.algo)
        elif self.op == "allgather":
            c.allgather(case.x, case.out, stream=stream, algo=self.algo)
        elif self.op == "alltoall":
            c.alltoall(case.x, case.out, stream=stream, algo=self.algo)
        elif self.op == "alltoallv":
            counts = [case.chunk] * self.n
            c.alltoallv(case.x, counts, counts, case.out, max_count=case.chunk, stream=stream, algo=self.algo)
        else:
            c.broadcast(case.x, case.out, root=case.root, stream=stream, algo=self.algo)

    def close(self) -> None:
        self.ctx.free()


_normal_kernel = None
COMPRESSIBLE = ("allreduce", "reduce_scatter", "allgather")
_REF_PIECE = 1 << 24  # elements of the float64 reference made at a time


def _normal(count: int, key: int, start: int = 0):
    """Standard normal float32 values at positions start.. for `key` (a counter-based hash, so any range can
    be made again without the rest: the float64 reference of a 1 GiB sweep is built piece by piece)."""
    import cupy

    global _normal_kernel
    if _normal_kernel is None:
        _normal_kernel = cupy.ElementwiseKernel(
            "int64 key, int64 start", "float32 y",
            """unsigned long long z = (unsigned long long)(i + start) * 0x9E3779B97F4A7C15ull
                                      + (unsigned long long)(key + 1) * 0xD1B54A32D192ED03ull;
               z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
               z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
               z ^= z >> 31;
               const float u1 = ((float)(z >> 40) + 1.f) * (1.f / 16777217.f);
               const float u2 = (float)((z >> 16) & 0xFFFFFFull) * (1.f / 16777216.f);
               y = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);""", "fluxrt_perf_normal")
    y = cupy.empty(count, dtype=np.float32)
    _normal_kernel(np.int64(key), np.int64(start), y)
    return y


class CompressedRunner:
    """fluxrt's compressed allreduce / reduce_scatter / allgather (``compress=``), on the fluxrt runner's
    context. Lossy: instead of the exact check it reports the relative error against a float64 reference on
    normally distributed inputs (``rel_error``)."""

    lossy = True

    def __init__(self, world: World, op: str, fmt: str, ctx):
        self.world, self.op, self.fmt, self.ctx = world, op, fmt, ctx
        self.name = f"fluxrt_{fmt}"

    def algo_name(self, case: Case) -> str:
        return f"compressed_{self.fmt}"

    def inplace_ok(self) -> bool:
        return False

    def __call__(self, case: Case, stream) -> None:
        getattr(self.ctx, self.op)(case.x, case.out, stream=stream, compress=self.fmt)

    def rel_error(self, case: Case, stream) -> float:
        """||out - reference|| / ||reference|| (the largest over ranks) on normal inputs; the case's input is
        restored afterwards."""
        import cupy

        n, r = self.world.size, self.world.rank
        case.x[...] = _normal(case.in_elems, r).astype(case.dtype)
        self.world.device.synchronize()
        self(case, stream)
        stream.synchronize()
        self.world.check_errors()
        num = den = 0.0
        for lo in range(0, case.out_elems, _REF_PIECE):
            hi = min(case.out_elems, lo + _REF_PIECE)
            if self.op == "allgather":
                ref = cupy.concatenate([_normal(min(hi, (p + 1) * case.in_elems) - max(lo, p * case.in_elems), p,
                                                max(lo, p * case.in_elems) - p * case.in_elems)
                                        for p in range(n) if max(lo, p * case.in_elems) < min(hi, (p + 1) * case.in_elems)])
                ref = ref.astype(np.float64)
            else:
                base = r * case.out_elems if self.op == "reduce_scatter" else 0
                ref = cupy.zeros(hi - lo, dtype=np.float64)
                for p in range(n):
                    ref += _normal(hi - lo, p, base + lo).astype(case.dtype).astype(np.float64)
            if self.op == "allgather":
                ref = ref.astype(case.dtype).astype(np.float64)
            d = case.out[lo:hi].astype(np.float64) - ref
            num += float((d * d).sum())
            den += float((ref * ref).sum())
        case.fill_input()
        rel = (num / den) ** 0.5 if den > 0 else 0.0
        return float(max(self.world.comm.allgather(rel)))

    def close(self) -> None:
        pass


class NcclRunner:
    """NCCL on the sweep's own buffers (impl "nccl"), or with ``window=True`` on buffers of its own from
    ncclMemAlloc registered as symmetric windows (impl "nccl-win", nccl-tests' -R 2), where NCCL runs
    its symmetric-memory kernels. Both modes share one communicator (:class:`nccl_lib.Communicator`)."""

    def __init__(self, comm: nccl_lib.Communicator, op: str, redop: str, root: int, window: bool = False):
        self.comm, self.lib, self.h = comm, comm.lib, comm.handle
        self.window = window
        self.name = nccl_lib.WINDOW if window else nccl_lib.PLAIN
        self.op, self.root, self.n = op, root, comm.size
        self.redop = nccl_lib.REDOPS[redop]
        self._windows: list = []

    def algo_name(self, case: Case) -> str:
        return ""   # NCCL picks its own algorithm and protocol; the impl name says which buffers it had

    def inplace_ok(self) -> bool:
        # in place is NCCL's own layout for these; the alltoall here is grouped send/recv, which must
        # not read and write one buffer
        return self.op in INPLACE and self.op != "alltoall"

    def buffers(self, in_elems: int, out_elems: int, dtype):
        """(x, out) of this runner's own, or None to run on the sweep's buffers. Window mode: two windows
        (collective; the previous ones are released first)."""
        if not self.window:
            return None
        self.release_buffers()
        self._windows = [nccl_lib.WindowBuffer(self.comm, in_elems, dtype),
                         nccl_lib.WindowBuffer(self.comm, out_elems, dtype)]
        return self._windows[0].array, self._windows[1].array

    def release_buffers(self) -> None:
        """Deregister and free the windows (the caller has synchronized the device)."""
        for w in self._windows:
            w.free()
        self._windows = []

    def __call__(self, case: Case, stream) -> None:
        lib, h = self.lib, self.h
        x, out, s, dt = case.x.data.ptr, case.out.data.ptr, stream.ptr, nccl_lib.DATATYPES[short_name(case.dtype)]
        redop = nccl_lib.REDOPS.get(case.redop, self.redop)
        if self.op == "allreduce":
            lib.all_reduce(h, x, out, case.in_elems, dt, redop, s)
        elif self.op == "reduce_scatter":
            lib.reduce_scatter(h, x, out, case.out_elems, dt, redop, s)
        elif self.op == "allgather":
            lib.all_gather(h, x, out, case.in_elems, dt, s)
        elif self.op in ("alltoall", "alltoallv"):
            step = case.chunk * case.dtype.itemsize
            lib.group_start()
            for p in range(self.n):
                lib.send(h, x + p * step, case.chunk, dt, p, s)
                lib.recv(h, out + p * step, case.chunk, dt, p, s)
            lib.group_end()
        else:
            lib.broadcast(h, x, out, case.in_elems, dt, case.root, s)

    def close(self) -> None:
        self.release_buffers()


def nccl_runners(world: World, op: str, redop: str, modes) -> tuple[list, list[str], object]:
    """The NCCL runners of `modes` (nccl_lib.MODES), the notes on what could not run, and the communicator
    (None when NCCL is unavailable: the sweep runs without it and says why)."""
    try:
        lib, notes = nccl_lib.choose()
    except nccl_lib.NcclUnavailable as e:
        return [], [f"nccl baseline unavailable: {e}"], None
    # every rank must agree on the binding: one rank's window registration alone would hang
    names = world.comm.allgather(lib.name)
    if len(set(names)) > 1:
        return [], [f"nccl baseline not run: the ranks loaded different bindings ({', '.join(names)})"], None
    comm = nccl_lib.Communicator(world, lib)
    runners = [NcclRunner(comm, op, redop, 0) for m in modes if m == nccl_lib.PLAIN]
    if nccl_lib.WINDOW in modes:
        if lib.windows:
            runners.append(NcclRunner(comm, op, redop, 0, window=True))
    else:
        notes = []
    return runners, notes, comm


# ------------------------------------------------------------------------------------------ measurement
def _time_us(world: World, run, case: Case, stream, opts: SweepOptions) -> float:
    """Microseconds per call, the per-rank times reduced by -a (opts.average) as nccl-tests does."""
    return reduce_over_ranks(_rank_times_us(world, run, case, stream, opts), opts.average)


def _rank_times_us(world: World, run, case: Case, stream, opts: SweepOptions) -> list[float]:
    """Microseconds per call on each rank's stream (index = rank; collective). -z 1 synchronizes the
    stream after each call (nccl-tests' blocking mode)."""
    import cupy

    for _ in range(opts.warmup_iters):
        run(case, stream)
        if opts.blocking:
            stream.synchronize()
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
            if opts.blocking:
                stream.synchronize()
        stop.record(stream)
        calls = opts.iters
    stop.synchronize()
    world.check_errors()
    t = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls
    return [float(v) for v in world.comm.allgather(t)]


def _check(world: World, run, case: Case, stream) -> int:
    from mpi4py import MPI

    if case.inplace:
        case.fill_input()  # the input is (part of) the output: fresh for every check
    case.poison()
    world.device.synchronize()  # the poison ran on the current stream, not on `stream`
    world.comm.Barrier()
    run(case, stream)
    stream.synchronize()
    world.check_errors()
    return world.comm.allreduce(case.wrong(), op=MPI.SUM)


def ratio_groups(impls) -> dict:
    """The table's ratio columns: one per baseline that is not NCCL (fluxrt's compressed forms), then one
    for NCCL, against the faster of its modes present."""
    groups = {i: (i,) for i in impls[1:] if i not in nccl_lib.MODES}
    modes = tuple(i for i in impls[1:] if i in nccl_lib.MODES)
    return {**groups, "nccl": modes} if modes else groups


def sweep(world: World, op: str, opts: SweepOptions, runners, out=None, symmetric: bool = False,
          preamble=(), inplace: bool = True, table_out: list | None = None) -> list[Row]:
    """One table: every datatype (-d), reduction (-o) and root (-r) asked for, each over the sizes, each size
    out of place then (where the op has one) in place. A runner with buffers of its own (NCCL's window
    mode) gets cases on those, filled and checked the same way. `table_out`: the Table is appended to it."""
    import cupy

    n = world.size
    dtypes = sweep_datatypes(opts, REDUCING_DTYPES if op in REDUCING else tuple(DTYPE_SIZES))
    redops = sweep_ops(opts, op in REDUCING)
    roots = sweep_roots(opts, n, op == "broadcast")
    placements = (False, True) if inplace and op in INPLACE else (False,)
    factor = bus_bandwidth_factor(op, n)
    impls = tuple(r.name for r in runners)
    table = Table(impls=impls, out=out if world.rank == 0 else io.StringIO(), show_algo=True,
                  inplace=len(placements) > 1, ratios=ratio_groups(impls))
    if table_out is not None:
        table_out.append(table)
    table.header([*describe(opts), *preamble])
    alloc = world.empty if symmetric else cupy.empty
    for dt in dtypes:
        dtype = normalize_dtype(dt)
        esize = dtype.itemsize
        sweep_sizes = sizes(opts, align=size_align(op, esize, n))
        max_in, max_out = buffer_elems(op, sweep_sizes[-1], esize, n)
        x_full = alloc(max(1, max_in), dtype=dtype)
        out_full = alloc(max(1, max_out), dtype=dtype)
        own = {}
        for run in runners:
            got = run.buffers(max(1, max_in), max(1, max_out), dtype) if hasattr(run, "buffers") else None
            own[run.name] = got if got is not None else (x_full, out_full)
        stream = cupy.cuda.Stream(non_blocking=True)
        combos = [(redop, root, nbytes) for redop in redops for root in roots for nbytes in sweep_sizes]
        for redop, root, nbytes in progress(combos, enabled=opts.progress and world.rank == 0, desc=op):
            line = []
            for ip in placements:
                cases: dict = {}
                for run in runners:
                    if ip and not run.inplace_ok():
                        continue
                    xb, ob = own[run.name]
                    key = (xb.data.ptr, ob.data.ptr)
                    if key not in cases:
                        cases[key] = Case(op, world, xb, ob, nbytes, dtype, redop, max(root, 0), inplace=ip)
                        cases[key].fill_input()
                        world.device.synchronize()
                    case = cases[key]
                    if getattr(run, "lossy", False) and case.dtype.itemsize not in (2, 4) or (
                            getattr(run, "lossy", False) and case.dtype.kind in "iu"):
                        continue  # compressed forms take bf16, fp16 and fp32
                    lossy = getattr(run, "lossy", False)
                    wrong = _check(world, run, case, stream) if opts.check and not lossy else None
                    rel_err = run.rel_error(case, stream) if lossy else None
                    times = _rank_times_us(world, run, case, stream, opts)
                    algo = run.algo_name(case)
                    scheme, algorithm = _ALGO_PAIRS.get((op, algo), ("", "")) if run.name == "fluxrt" else ("", "")
                    line.append(Row.measured(nbytes=nbytes, count=nbytes // esize, dtype=dt, redop=redop,
                                             impl=run.name, algo=algo,
                                             time_us=reduce_over_ranks(times, opts.average), busbw_factor=factor,
                                             wrong=wrong, root=root, inplace=ip, stats=rank_stats(times),
                                             scheme=scheme, algorithm=algorithm, rel_err=rel_err))
            table.add(line)
        world.device.synchronize()
        for run in runners:
            if hasattr(run, "release_buffers"):
                run.release_buffers()
        if symmetric:
            world.free(out_full)
            world.free(x_full)
    table.footer()
    return table.rows


def library_defaults() -> dict:
    """The library's defaults of the options a collective sweep sets (CPU: no world started)."""
    import fluxrt

    world_fields = {f.name: f for f in dataclasses.fields(fluxrt.WorldOptions)}
    return {"workspace_bytes": fluxrt.CollectivesOptions().workspace_bytes,
            "check_collective_args": world_fields["check_collective_args"].default,
            "timeout_s": fluxrt.WorldOptions().timeout_s}


WHY = {"check_collective_args": "--check-args turns it on; it costs an MPI allgather per eager call, NCCL has "
                                "no such check"}


def sweep_options_used(args, opts: SweepOptions, tuning=None) -> dict:
    """The library options this sweep runs with, keyed as :func:`library_defaults` (plus changed tuning)."""
    from ..symmetric import parse_bytes

    lib = library_defaults()
    used = {"workspace_bytes": parse_bytes(args.workspace) if args.workspace else lib["workspace_bytes"],
            "check_collective_args": bool(args.check_args),
            "timeout_s": float(opts.timeout) if opts.timeout > 0 else lib["timeout_s"]}
    if tuning is not None:
        from ..collectives_plan import DEFAULT_TUNING

        for f in dataclasses.fields(tuning):
            if getattr(tuning, f.name) != getattr(DEFAULT_TUNING, f.name):
                used[f"tuning.{f.name}"] = getattr(tuning, f.name)
    return used


def parser(op: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"fluxrt-perf {op}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(ap)
    ap.add_argument("--algo", default="auto", help="force a fluxrt algorithm (see fluxrt.collectives_plan.ALGOS)")
    ap.add_argument("--impls", default="fluxrt,nccl,nccl-win",
                    help="comma list of fluxrt, nccl (NCCL on the sweep's buffers) and nccl-win (NCCL on "
                         "ncclMemAlloc buffers registered as symmetric windows, nccl-tests' -R 2; needs "
                         "nccl4py); ratios are against the faster NCCL mode (default: %(default)s)")
    ap.add_argument("--no-inplace", dest="inplace", action="store_false",
                    help="out-of-place columns only (skip nccl-tests' in-place half)")
    ap.add_argument("--workspace", default=None,
                    help="fluxrt collectives workspace per rank (default: the library's, CollectivesOptions)")
    ap.add_argument("--heap", default=None,
                    help="symmetric heap per rank (default: NVSHMEM's, or what --symmetric needs)")
    ap.add_argument("--symmetric", action="store_true",
                    help="allocate inputs and outputs on the symmetric heap (zero-copy 'direct' paths; "
                         "-R 1 or 2 implies it)")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="override a collectives_plan.Tuning field, e.g. --tune ll_max_bytes=256K "
                         "--tune bulk_max_grid=128 (repeatable)")
    if op in COMPRESSIBLE:
        ap.add_argument("--compress", default=None, choices=("fp8", "int8"),
                        help="add a column of fluxrt's compressed form (8-bit payload, 128-element block "
                             "scales) with its relative error against a float64 reference in the JSON")
    ap.add_argument("--device", type=int, default=None,
                    help="pin every rank to this GPU (several ranks on one GPU under CUDA MPS: a smoke run whose "
                         "timings mean nothing)")
    ap.add_argument("--check-args", action="store_true",
                    help="keep fluxrt's cross-rank argument check on, as the library's default (an MPI "
                         "allgather per eager call; off in the sweep unless given)")
    return ap


def parse_options(op: str, argv) -> tuple[argparse.ArgumentParser, argparse.Namespace, SweepOptions, object]:
    """Parse and check a sweep's command line before any world starts (CPU); errors exit 2 with the reason."""
    from ..collectives_plan import ALGOS, Tuning

    if op not in OPS:
        raise SystemExit(f"fluxrt-perf: unknown collective {op!r} (one of {', '.join(OPS)})")
    ap = parser(op)
    args = ap.parse_args(argv)
    try:
        opts = SweepOptions.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    impls = [i for i in args.impls.split(",") if i]
    if not impls or set(impls) - {"fluxrt", *nccl_lib.MODES} or impls[0] != "fluxrt" or len(set(impls)) < len(impls):
        ap.error("--impls must start with fluxrt, then any of nccl, nccl-win, e.g. fluxrt,nccl,nccl-win or fluxrt")
    args.impl_list = impls
    args.symmetric = bool(args.symmetric or opts.register)
    if args.algo != "auto" and args.algo not in ALGOS[op]:
        ap.error(f"--algo {args.algo!r}: {op} has {', '.join(ALGOS[op])} (or auto)")
    if args.algo == "direct" and not args.symmetric:
        ap.error("--algo direct pushes into symmetric outputs: add --symmetric")
    if op in REDUCING and opts.datatype == "int32":
        ap.error(f"{op} reduces bf16, fp16 or fp32 (-d), not int32")
    if op not in REDUCING and opts.op != "sum":
        ap.error(f"-o {opts.op}: {op} does not reduce (-o applies to {', '.join(REDUCING)})")
    if op != "broadcast" and opts.root != 0:
        ap.error(f"-r {opts.root}: {op} has no root (-r applies to broadcast)")
    try:
        tuning = Tuning.parse(args.tune)
    except ValueError as e:
        ap.error(str(e))
    return ap, args, opts, tuning


def main(argv=None, op: str = "allreduce") -> int:
    import fluxrt
    from ..collectives_plan import DEFAULT_TUNING
    from ..symmetric import parse_bytes

    ap, args, opts, tuning = parse_options(op, argv)
    lib = library_defaults()
    workspace = parse_bytes(args.workspace) if args.workspace else lib["workspace_bytes"]
    heap = args.heap
    if heap is None and args.symmetric:
        heap = 2 * opts.maxbytes + 2 * opts.element_size + workspace + (256 << 20)
    world_kw = {"timeout_s": opts.timeout} if opts.timeout > 0 else {}
    options = fluxrt.WorldOptions(heap_size=heap, check_collective_args=args.check_args, **world_kw)
    with fluxrt.init(device=args.device, options=options) as world:
        if opts.root != "all" and not 0 <= opts.root < world.size:
            ap.error(f"-r/--root {opts.root} outside {world.size} ranks")
        redop = opts.op if op in REDUCING and opts.op != "all" else "sum"
        runners = [FluxrtRunner(world, op, args.algo, redop, 0, workspace, args.symmetric, tuning)]
        notes = [] if args.device is None else [f"every rank on device {args.device}: timings mean nothing"]
        nccl_comm = None
        compress = getattr(args, "compress", None)
        if compress:
            if redop != "sum":
                ap.error(f"--compress: compressed {op} sums only (-o sum)")
            runners.append(CompressedRunner(world, op, compress, runners[0].ctx))
            notes.append(f"fluxrt_{compress}: compressed payload; #wrong not checked (lossy), rel_err in the JSON")
        modes = [i for i in args.impl_list if i in nccl_lib.MODES]
        if modes:
            try:
                nccl, more, nccl_comm = nccl_runners(world, op, redop, modes)
            except Exception as e:  # the baseline is optional: say why it is missing and go on
                nccl, more = [], [f"nccl baseline unavailable: {e}"]
            runners += nccl
            notes += more
            _, reg_note = nccl_registration(opts.register)
            if reg_note:
                notes.append(reg_note)
        versions = library_versions(nccl_comm.lib if nccl_comm is not None else None)
        devices = device_info(world)
        library = dict(lib, **{f"tuning.{f.name}": getattr(DEFAULT_TUNING, f.name)
                               for f in dataclasses.fields(DEFAULT_TUNING)})
        used = sweep_options_used(args, opts, tuning)
        diffs = option_differences(used, library)
        preamble = [
            f"# {op} on {world.size} ranks; fluxrt algo: {args.algo}; buffers: "
            f"{'symmetric' if args.symmetric else 'plain cupy'}; time over ranks: {AVERAGE_MODES[opts.average]} (-a)",
            version_line(versions), *device_lines(devices), differences_line(diffs, WHY),
            *(f"# {n}" for n in notes)]
        tables: list = []
        rows = sweep(world, op, opts, runners, out=sys.stdout, symmetric=args.symmetric, preamble=preamble,
                     inplace=args.inplace, table_out=tables)
        for r in runners:
            r.close()
        if nccl_comm is not None:
            nccl_comm.close()
        if world.rank == 0:
            command = ["fluxrt-perf", op, *(sys.argv[2:] if argv is None else argv)]
            record = dict(dataclasses.asdict(opts), average_name=AVERAGE_MODES[opts.average],
                          algo=args.algo, impls=args.impl_list, symmetric=args.symmetric, inplace=args.inplace,
                          library=used, differs_from_library=diffs)
            record["impls_run"] = [r.name for r in runners]
            doc = results_document(op, [dict(vars(r), op=op) for r in rows], command, machine=machine(world),
                                   versions=versions, devices=devices, options=record, notes=notes,
                                   ratios=tables[0].ratio_entries())
            if opts.json_path:
                write_json(opts.json_path, doc)
            if opts.plot_path:
                plot(opts.plot_path, [r for r in rows if not r.inplace], f"{op} {opts.datatype} on {world.size} ranks")
        wrong = sum(r.wrong or 0 for r in rows)
    return 1 if wrong else 0
