"""Point-to-point sweep between rank 0 and rank 1 (other ranks idle), in the manner of NVSHMEM's
shmem_put_bw and shmem_put_signal_ping_pong_latency.

Bandwidth: `iters` transfers of each size back to back on one stream, timed with CUDA events
(uni: data flows rank 0 -> rank 1, pushed by rank 0 or pulled by rank 1 for the copy engine; bidir: both
at once, aggregate = 2 * bytes / slower time). With -c 1 each size is first checked once, both ways,
against a per-rank byte pattern made on the device.
Latency: one thread per rank bounces a flag `rounds` times; one way = elapsed / (2 * rounds).
"""
from __future__ import annotations

import argparse
import logging
import dataclasses
import statistics
import sys
from typing import TYPE_CHECKING

import numpy as np

from .baselines import device_info, library_versions, machine
from .report import algbw_gbps, device_lines, progress, results_document, version_line, write_json
from .sweep import AVERAGE_MODES, SweepOptions, add_sweep_arguments, describe, format_size, reduce_over_ranks, sizes

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

MODES = ("sm_push", "copy_engine", "nvshmem_put")


def _transfer(world: World, mode, dst, src, other, nbytes, stream) -> None:
    """Move nbytes between this rank and `other` (0 <-> 1). Push modes write this rank's src into
    other's dst; the copy-engine mode pulls other's src into this rank's dst (the same data flow,
    driven by the receiver)."""
    from .. import p2p

    if mode == "copy_engine":
        p2p.get(world, dst[:nbytes], src[:nbytes], other, mode="copy_engine", stream=stream)
    else:
        p2p.put(world, dst[:nbytes], src[:nbytes], other, mode="sm" if mode == "sm_push" else "nvshmem",
                stream=stream)


def _acts(world: World, mode, direction) -> bool:
    """Uni: data flows 0 -> 1, so rank 0 pushes or rank 1 pulls. Bidir: both ranks act."""
    if world.rank > 1:
        return False
    if direction == "bidir":
        return True
    return world.rank == (1 if mode == "copy_engine" else 0)


def _pattern(nbytes: int, rank: int):
    """Bytes that differ per rank and position, made on the device (checks stay cheap at 1 GiB)."""
    import cupy

    i = cupy.arange(nbytes, dtype=np.uint32)
    return ((i * np.uint32(2654435761) + np.uint32(977 * (rank + 1))) >> np.uint32(24)).astype(np.uint8)


def _check(world: World, mode, dst, src, nbytes, stream) -> int:
    """Both ranks of the pair send fresh bytes once into poisoned buffers; count wrong bytes."""
    comm = world.comm
    other = 1 - world.rank
    if world.rank < 2:
        src[:nbytes] = _pattern(nbytes, world.rank)
        dst.fill(0xA5)
    world.synchronize()
    comm.Barrier()
    wrong = 0
    if world.rank < 2:
        _transfer(world, mode, dst, src, other, nbytes, stream)
        world.synchronize(stream)
    comm.Barrier()  # pushes into my dst have completed on the sender's stream; pulls on mine
    if world.rank < 2:
        wrong = int((dst[:nbytes] != _pattern(nbytes, other)).sum()) + int(dst[nbytes].get() != 0xA5)
    return comm.allreduce(wrong)


def _time(world: World, mode, dst, src, other, nbytes, iters, warmup, stream, blocking: int = 0) -> float:
    """One timed loop of `iters` transfers after `warmup` (as nccl-tests does); microseconds each.
    blocking (-z 1): synchronize the stream after each transfer."""
    import cupy

    for _ in range(warmup):
        _transfer(world, mode, dst, src, other, nbytes, stream)
        if blocking:
            stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        _transfer(world, mode, dst, src, other, nbytes, stream)
        if blocking:
            stream.synchronize()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / iters


def bandwidth_rows(world: World, opts: SweepOptions, modes, directions) -> list[dict]:
    import cupy

    comm = world.comm
    sweep = sizes(opts, align=1)
    dst = world.empty((sweep[-1] + 1,), np.uint8)
    src = world.empty((sweep[-1],), np.uint8)  # symmetric: the copy-engine mode pulls from it
    src.fill(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    other = 1 - world.rank if world.rank < 2 else None
    rows = []
    combos = [(m, d, n) for m in modes for d in directions for n in sweep]
    for mode, direction, nbytes in progress(combos, total=len(combos), enabled=opts.progress and world.rank == 0,
                                            desc="p2p"):
        wrong = _check(world, mode, dst, src, nbytes, stream) if opts.check else None
        comm.Barrier()
        t_us = None
        if _acts(world, mode, direction):
            t_us = _time(world, mode, dst, src, other, nbytes, opts.iters, opts.warmup_iters, stream, opts.blocking)
        t_us = acting_time(comm.allgather(t_us), opts.average)
        comm.Barrier()
        moved = nbytes * (2 if direction == "bidir" else 1)
        rows.append({"bytes": nbytes, "mode": mode, "direction": direction, "time_us": t_us,
                     "gbps": algbw_gbps(moved, t_us), "wrong": wrong})
    world.free(src)
    world.free(dst)
    return rows


def acting_time(per_rank, average: int = 1) -> float:
    """The reported time from per-rank times, None for ranks that did not transfer: -a over the ranks
    that did (rank 0 = the first of them)."""
    times = [t for t in per_rank if t is not None]
    return reduce_over_ranks(times, average) if times else 0.0


def check_args(opts: SweepOptions) -> str | None:
    """Why the sweep flags cannot apply to p2p, or None."""
    if opts.datatype == "all" or opts.op != "sum":
        return "-d all and -o do not apply to p2p (bytes are moved, nothing is reduced)"
    if opts.root != 0:
        return "-r does not apply to p2p (rank 0 <-> rank 1)"
    if opts.register:
        return "-R does not apply to p2p: its buffers are always on the symmetric heap"
    if opts.graph_iters:
        return "-G is not implemented for p2p"
    return None


def latency_rows(world: World, rounds: int, repeats: int = 5) -> list[dict]:
    """One-way signal latency: raw device flags (fluxrt primitives) and the NVSHMEM signal API."""
    import cupy

    from ..errors import op_id
    from ..p2p import state
    from ..toolchain import load_nvshmem_module

    u64, u32 = np.uint64, np.uint32
    pad = world.signal_pad(1)
    elapsed = cupy.zeros(1, np.uint64)
    nvmod = load_nvshmem_module("comm/nvshmem_p2p.cu")
    nv_pingpong = nvmod.get_function("fluxrt_nvshmem_pingpong")
    rows = []
    active = world.rank < 2
    peer = 1 - world.rank if active else 0
    for mode in ("device_flag", "nvshmem_signal"):
        samples = []
        for _ in range(repeats):
            base = pad.epoch
            pad.next_epoch(rounds)
            world.synchronize()
            world.comm.Barrier()
            if active:
                common = (u64(world.timeout_ns), u64(world.error_record), u32(op_id(f"pingpong[{mode}]")),
                          u32(world.rank))
                if mode == "device_flag":
                    state(world).pingpong((1,), (1,), (u64(pad.local_ptr(0)), u64(pad.peer_ptr(peer, 0)), u64(base),
                                                       u32(rounds), np.int32(world.rank == 0), *common,
                                                       u64(peer), u64(elapsed.data.ptr)))
                else:
                    nv_pingpong((1,), (1,), (u64(pad.local_ptr(0)), u64(base), u32(rounds),
                                             np.int32(world.rank == 0), np.int32(peer), *common,
                                             u64(elapsed.data.ptr)))
                world.synchronize()
            ns = world.comm.bcast(int(elapsed.get()[0]) if world.rank == 0 else None, root=0)
            samples.append(ns / (2 * rounds) / 1e3)
        rows.append({"mode": mode, "one_way_us": statistics.median(samples), "rounds": rounds,
                     "samples_us": samples})
    world.comm.Barrier()
    pad.free()
    return rows


def _print_tables(bw_rows, lat_rows, out=sys.stdout) -> None:
    modes = sorted({r["mode"] for r in bw_rows})
    dirs = sorted({r["direction"] for r in bw_rows}, reverse=True)
    cols = [(m, d) for d in dirs for m in modes]
    by = {(r["mode"], r["direction"], r["bytes"]): r for r in bw_rows}
    print("# p2p bandwidth rank 0 <-> rank 1: time (us) and GB/s (bidir: aggregate of both directions)", file=out)
    print(f"#{'size':>11}" + "".join(f" {m + '/' + d:>27}" for m, d in cols), file=out)
    for nbytes in sorted({r["bytes"] for r in bw_rows}):
        cells = []
        for m, d in cols:
            r = by.get((m, d, nbytes))
            bad = "" if not r or not r["wrong"] else f" WRONG={r['wrong']}"
            cells.append(f" {r['time_us']:>12.2f} {r['gbps']:>9.1f} GB/s{bad}" if r else f" {'N/A':>27}")
        print(f" {format_size(nbytes):>11}" + "".join(cells), file=out)
    for r in lat_rows:
        print(f"# signal ping-pong {r['mode']:>15}: one way {r['one_way_us']:.2f} us (median of "
              f"{len(r['samples_us'])} x {r['rounds']} round trips)", file=out)


def main(argv=None) -> int:
    import fluxrt

    ap = argparse.ArgumentParser(prog="fluxrt-perf p2p", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(ap)
    ap.set_defaults(minbytes=4, maxbytes=1 << 30, datatype="int32")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ",".join(MODES))
    ap.add_argument("--directions", default="uni,bidir")
    ap.add_argument("--rounds", type=int, default=10000, help="ping-pong round trips per sample")
    ap.add_argument("--heap", default=None, help="symmetric heap size (default: 2x the largest message)")
    args = ap.parse_args(argv)
    try:
        opts = SweepOptions.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    bad = check_args(opts)
    if bad:
        ap.error(bad)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown mode(s) {sorted(unknown)}; choose from {list(MODES)}")
    heap = args.heap or str(max(1 << 30, 2 * opts.maxbytes + (64 << 20)))
    world_kw = {"timeout_s": opts.timeout} if opts.timeout > 0 else {}
    with fluxrt.init(options=fluxrt.WorldOptions(heap_size=heap, **world_kw)) as world:
        if world.size < 2:
            print("fluxrt-perf p2p needs 2 ranks: mpirun -n 2 fluxrt-perf p2p", file=sys.stderr)
            return 2
        versions, devices = library_versions(), device_info(world)
        if world.rank == 0:
            for line in [*describe(opts), version_line(versions), *device_lines(devices),
                         f"# time over the transferring ranks: {AVERAGE_MODES[opts.average]} (-a)"]:
                print(line, flush=True)
        bw = bandwidth_rows(world, opts, modes, args.directions.split(","))
        lat = latency_rows(world, args.rounds)
        if world.rank == 0:
            _print_tables(bw, lat)
            doc = results_document("p2p", bw + lat, ["fluxrt-perf", "p2p", *(argv or sys.argv[1:])],
                                   machine=machine(world), versions=versions, devices=devices,
                                   options=dict(dataclasses.asdict(opts), modes=modes,
                                                average_name=AVERAGE_MODES[opts.average]))
            if opts.json_path:
                write_json(opts.json_path, doc)
            if opts.plot_path:
                _plot(opts.plot_path, bw)
        wrong = sum(r["wrong"] or 0 for r in bw)
    return 1 if wrong else 0


def _plot(path, bw_rows) -> None:
    from .report import Row, plot

    rows = [Row(bytes=r["bytes"], count=r["bytes"], dtype="uint8", redop="none", impl=r["mode"],
                algo=r["direction"], time_us=r["time_us"], algbw=r["gbps"], busbw=r["gbps"]) for r in bw_rows]
    plot(path, rows, "fluxrt p2p: rank 0 <-> rank 1")
