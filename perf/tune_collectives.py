"""Tune the collectives: time several fluxrt configurations (algorithm and Tuning overrides) and NCCL (on
the same buffers, and on registered windows of its own: fluxrt.perf.nccl_lib) in one job, per message size, eager and graph-replayed, plus the host time of an eager call.
What it prints picks the thresholds and grid sizes of ``fluxrt.collectives_plan.Tuning``.

    fluxrt-run -n 4 -- python3 perf/tune_collectives.py allreduce -b 8 -e 4M \\
        --config algo=ll --config algo=oneshot --config algo=twoshot,bulk_max_grid=128 -G 10 --json t.json

A config is comma-separated key=value: ``algo`` (see collectives_plan.ALGOS), ``ws`` (the context's
workspace bytes, default CollectivesOptions.workspace_bytes) and any Tuning field.
Every configuration is checked once per size against the expected values before it is timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def parse_config(text: str):
    """(algo, workspace bytes, Tuning) of one --config."""
    from fluxrt.collectives import CollectivesOptions
    from fluxrt.collectives_plan import Tuning
    from fluxrt.symmetric import parse_bytes

    items = [t for t in text.split(",") if t]
    algo, ws = "auto", CollectivesOptions().workspace_bytes
    rest = []
    for item in items:
        key, _, value = item.partition("=")
        if key == "algo":
            algo = value
        elif key == "ws":
            ws = int(parse_bytes(value))
        else:
            rest.append(item)
    return algo, ws, Tuning.parse(rest)


def host_us(run, case, stream, calls: int) -> float:
    """Host microseconds per eager call (enqueue only), after a synchronize."""
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run(case, stream)
    t = (time.perf_counter() - t0) / calls * 1e6
    stream.synchronize()
    return t


def main(argv=None) -> int:
    import cupy
    from mpi4py import MPI

    import fluxrt
    from fluxrt.dtypes import normalize_dtype
    from fluxrt.perf import collectives as bench
    from fluxrt.perf.baselines import machine
    from fluxrt.perf.report import results_document, write_json
    from fluxrt.perf.sweep import SweepOptions, add_sweep_arguments, bus_bandwidth_factor, sizes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collective", choices=bench.OPS)
    add_sweep_arguments(ap)
    ap.add_argument("--config", action="append", default=[], help="algo=...,tuning_key=value (repeatable)")
    ap.add_argument("--symmetric", action="store_true", help="symmetric inputs and outputs (direct paths)")
    ap.add_argument("--no-nccl", action="store_true")
    args = ap.parse_args(argv)
    # the slowest rank's time (-a 3), as every tuning job of docs/tuning.md measured; one type, op and root
    opts = dataclasses.replace(SweepOptions.from_args(args), average=3)
    if "all" in (opts.datatype, opts.op, opts.root) or opts.blocking or opts.register:
        ap.error("tune_collectives.py times one datatype, op and root (-d/-o/-r all are sweep-only) and takes "
                 "neither -z nor -R")
    configs = [(c, *parse_config(c)) for c in (args.config or ["algo=auto"])]
    dtype = normalize_dtype(opts.datatype)
    esize = dtype.itemsize
    op = args.collective
    redop = opts.op if op in bench.REDUCING else "none"
    heap = 3 * opts.maxbytes + sum(ws + (32 << 20) for _, _, ws, _ in configs) + (600 << 20)
    options = fluxrt.WorldOptions(heap_size=heap, check_collective_args=False)
    rows = []
    with fluxrt.init(options=options) as world:
        n = world.size
        runners = [bench.FluxrtRunner(world, op, algo, redop if op in bench.REDUCING else "sum", 0, ws,
                                      args.symmetric, tuning) for _, algo, ws, tuning in configs]
        names = [c for c, _, _, _ in configs]
        nccl_comm = None
        if not args.no_nccl:   # both NCCL modes: ordinary buffers and registered windows (own buffers)
            nccl, notes, nccl_comm = bench.nccl_runners(world, op, opts.op, ["nccl", "nccl-win"])
            runners += nccl
            names += [r.name for r in nccl]
            for note in notes if world.rank == 0 else ():
                print(f"# {note}")
        sweep_sizes = sizes(opts, align=bench.size_align(op, esize, n))
        max_in, max_out = bench.buffer_elems(op, sweep_sizes[-1], esize, n)
        alloc = world.empty if args.symmetric else cupy.empty
        x_full, out_full = alloc(max(1, max_in), dtype=dtype), alloc(max(1, max_out), dtype=dtype)
        own = {name: (run.buffers(max(1, max_in), max(1, max_out), dtype) if hasattr(run, "buffers") else None)
               or (x_full, out_full) for name, run in zip(names, runners)}
        stream = cupy.cuda.Stream(non_blocking=True)
        factor = bus_bandwidth_factor(op, n)
        eager_opts = dataclasses.replace(opts, graph_iters=0)
        if world.rank == 0:
            print(f"# {op} {opts.datatype} on {n} ranks; eager us / graph us (per call) / host us per eager call")
            print("# size " + " | ".join(f"{name}" for name in names))
        for nbytes in sweep_sizes:
            cases: dict = {}
            cells = []
            for name, run in zip(names, runners):
                xb, ob = own[name]
                if (xb.data.ptr, ob.data.ptr) not in cases:
                    cases[xb.data.ptr, ob.data.ptr] = bench.Case(op, world, xb, ob, nbytes, dtype, redop, 0)
                    cases[xb.data.ptr, ob.data.ptr].fill_input()
                    world.device.synchronize()
                case = cases[xb.data.ptr, ob.data.ptr]
                wrong = bench._check(world, run, case, stream)
                eager = bench._time_us(world, run, case, stream, eager_opts)
                graph = bench._time_us(world, run, case, stream, opts) if opts.graph_iters else None
                host = world.comm.allreduce(host_us(run, case, stream, opts.iters), op=MPI.MAX)
                algo = run.algo_name(case)
                rows.append({"op": op, "bytes": nbytes, "dtype": opts.datatype, "config": name, "algo": algo,
                             "eager_us": eager, "graph_us": graph, "host_us": host, "wrong": wrong,
                             "busbw_eager": nbytes / eager / 1e3 * factor if eager else None})
                cells.append(f"{eager:8.2f}/{graph if graph is not None else float('nan'):7.2f}/{host:5.1f}"
                             f"{'' if not wrong else ' WRONG=%d' % wrong}")
            if world.rank == 0:
                print(f"{nbytes:>11d} " + " | ".join(cells), flush=True)
        world.device.synchronize()
        for r in runners:
            r.close()
        if nccl_comm is not None:
            nccl_comm.close()
        if args.symmetric:
            world.free(out_full)
            world.free(x_full)
        if world.rank == 0 and opts.json_path:
            write_json(opts.json_path, results_document(f"tune_{op}", rows, sys.argv, machine=machine(world)))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
