"""NVSHMEM device-API path against raw NVLink pointers: the rate of the hierarchical collectives' rail rounds.

Needs a world of (virtual) nodes: ``FLUXRT_TOPOLOGY=virtual:2x1 fluxrt-run -n 2 -- fluxrt-perf remote_rate``
on two GPUs of one node moves the same bytes over the same NVLink both ways. The members of rank 0's rail
take part; rail members 0 and 1 (rank 0 and the rank with its local index on node 1) exchange `bytes` each
way, in pieces of one rail slot (``--slot``), each piece followed by a bounded wait for the peer's:

    nvshmem_api     the rail round of the hierarchical collectives (kernels/comm/nvshmem_hier.cu:
                    fluxrt_rail_put, put-with-signal through NVSHMEM's device API, then the bounded wait of
                    fluxrt_rail_gather with nothing to copy), from the rail's symmetric send buffer
    nvlink_pointer  the SM push over the peer's NVLink pointer (fluxrt.p2p.put, mode 'sm') with a flag after
                    the data, then a bounded wait for the peer's flag (fluxrt.signals.wait)

Reported per size: time per exchange, GB/s per direction (bytes / time), and nvshmem_api / nvlink_pointer
(the issue's target: >= 0.85 at 1 GiB). Under CUDA MPS (every rank on one GPU) the numbers mean nothing;
-c 1 still checks the bytes that arrive both ways.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

import numpy as np

from .baselines import device_info, library_versions, machine
from .report import algbw_gbps, device_lines, progress, results_document, version_line, write_json
from .sweep import SweepOptions, add_sweep_arguments, describe, format_size, parse_size, sizes

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

PATHS = ("nvlink_pointer", "nvshmem_api")
TARGET_RATIO = 0.85   # the bar at 1 GiB


def piece_sizes(nbytes: int, slot: int) -> list[int]:
    """Bytes of the pieces an exchange of `nbytes` moves (one rail round each): whole slots, then the rest."""
    return [min(slot, nbytes - s) for s in range(0, max(nbytes, 1), slot)] if nbytes else [0]


def ratio_rows(rows) -> list[dict]:
    """nvshmem_api / nvlink_pointer GB/s per (bytes, put_blocks)."""
    raw = {r["bytes"]: r["gbps"] for r in rows if r["path"] == "nvlink_pointer"}
    out = []
    for r in rows:
        if r["path"] == "nvshmem_api" and raw.get(r["bytes"]):
            out.append({"bytes": r["bytes"], "put_blocks": r["put_blocks"],
                        "ratio": r["gbps"] / raw[r["bytes"]]})
    return out


def _pattern(nbytes: int, rank: int):
    import cupy

    i = cupy.arange(nbytes, dtype=np.uint32)
    return ((i * np.uint32(2654435761) + np.uint32(977 * (rank + 1))) >> np.uint32(24)).astype(np.uint8)


class _Pair:
    """Rank 0's rail: rail member 0 and member 1 exchange; the other members take part in the rounds only."""

    def __init__(self, world: World, ctx, slot: int):
        self.world, self.ctx, self.slot = world, ctx, slot
        self.member = ctx.node_index
        self.peer_member = 1 - self.member if self.member < 2 else None
        self.peer = ctx.rail[self.peer_member] if self.peer_member is not None else None
        self.src = world.empty((slot,), np.uint8)
        self.dst = world.empty((slot,), np.uint8)
        self.pad = world.signal_pad(1)

    def free(self) -> None:
        self.pad.free()
        self.world.free(self.dst)
        self.world.free(self.src)

    def nvshmem(self, nbytes: int, stream) -> int:
        mask = 0 if self.peer_member is None else 1 << self.peer_member
        e = 0
        for nb in piece_sizes(nbytes, self.slot):
            e, _ = self.ctx.rail_round(nb, mask, stream, "remote_rate.nvshmem_api")
        return e

    def raw(self, nbytes: int, stream) -> None:
        from .. import p2p, signals

        if self.peer is None:
            return
        for nb in piece_sizes(nbytes, self.slot):
            e = self.pad.next_epoch()
            p2p.put(self.world, self.dst[:nb], self.src[:nb], self.peer, mode="sm", stream=stream,
                    flag_ptr=self.pad.peer_ptr(self.peer, 0), flag_value=e)
            signals.wait(self.world, self.pad.local_ptr(0), e, peer=self.peer, op="remote_rate.nvlink_pointer",
                         stream=stream)

    def run(self, path: str, nbytes: int, stream) -> None:
        if path == "nvshmem_api":
            self.nvshmem(nbytes, stream)
        else:
            self.raw(nbytes, stream)

    def check(self, nbytes: int, stream) -> int:
        """One piece each way through both paths into poisoned buffers; wrong bytes summed over the pair."""
        nb = min(nbytes, self.slot)
        w, wrong = self.world, 0
        if self.peer is not None:
            self.src[:nb] = _pattern(nb, w.rank)
            self.dst.fill(0xA5)
            self.ctx.send[:nb] = _pattern(nb, w.rank)
        w.synchronize()
        w.comm.Barrier()
        e = self.nvshmem(nb, stream)
        self.raw(nb, stream)
        w.synchronize(stream)
        w.comm.Barrier()
        if self.peer is not None:
            want = _pattern(nb, self.peer)
            wrong += int((self.ctx.received(e, self.peer_member, nb) != want).sum())
            wrong += int((self.dst[:nb] != want).sum()) + int(nb < self.slot and int(self.dst[nb].get()) != 0xA5)
        return w.comm.allreduce(wrong)


def _time(pair: _Pair, path: str, nbytes: int, iters: int, warmup: int, stream) -> float:
    import cupy

    for _ in range(warmup):
        pair.run(path, nbytes, stream)
    pair.world.synchronize(stream)
    pair.world.comm.Barrier()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        pair.run(path, nbytes, stream)
    stop.record(stream)
    stop.synchronize()
    pair.world.check_errors()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / iters


def rate_rows(world: World, opts: SweepOptions, slot: int, put_blocks_list, paths=PATHS) -> list[dict]:
    """The sweep: per put-block count, a rail context with slots of `slot` bytes, every size through both
    paths (the raw path once, its rows shared)."""
    import cupy

    from ..collectives_hier import HierarchicalCollectives, HierarchicalOptions

    topo = world.topology
    if topo is None or topo.num_nodes < 2:
        raise SystemExit("fluxrt-perf remote_rate needs a world of 2 or more (virtual) nodes: "
                         "FLUXRT_TOPOLOGY=virtual:2x1 fluxrt-run -n 2 -- fluxrt-perf remote_rate")
    stream = cupy.cuda.Stream(non_blocking=True)
    sweep = sizes(opts, align=16)
    rows, on_rail = [], topo.local_index == 0
    # rank 0's rail (one rank of every node) as a world of its own; the other ranks wait for its rows
    pool = max(pool_bytes(slot, topo.num_nodes), (world.heap.capacity - world.heap.used) // 2)   # if none yet
    sub = world.split(0 if on_rail else None, key=world.rank, pool_bytes=pool)
    if sub is not None:
        try:
            for i, pb in enumerate(put_blocks_list):
                ctx = HierarchicalCollectives(sub, HierarchicalOptions(rail_bytes=2 * slot * sub.size,
                                                                       put_blocks=pb))
                pair = _Pair(sub, ctx, slot)
                try:
                    combos = [(p, n) for p in paths if p == "nvshmem_api" or i == 0 for n in sweep]
                    for path, nbytes in progress(combos, total=len(combos), enabled=opts.progress and sub.rank == 0,
                                                 desc=f"remote_rate put_blocks={pb}"):
                        wrong = pair.check(nbytes, stream) if opts.check else None
                        t = _time(pair, path, nbytes, opts.iters, opts.warmup_iters, stream)
                        t = max(sub.comm.allgather(t if pair.peer is not None else 0.0))
                        rows.append({"bytes": nbytes, "path": path,
                                     "put_blocks": pb if path == "nvshmem_api" else None,
                                     "pieces": len(piece_sizes(nbytes, slot)), "time_us": t,
                                     "gbps": algbw_gbps(nbytes, t), "wrong": wrong})
                finally:
                    pair.free()
                    ctx.free()
        finally:
            sub.finalize()
    return world.comm.bcast(rows, root=0)


def pool_bytes(slot: int, nodes: int) -> int:
    """The sub-world pool the bench needs: the rail buffers (three halves of `nodes` slots), the pair's two
    buffers, flags."""
    return (3 * nodes + 2) * slot + (32 << 20)


def _print(rows, out=sys.stdout) -> None:
    raw = {r["bytes"]: r for r in rows if r["path"] == "nvlink_pointer"}
    blocks = sorted({r["put_blocks"] for r in rows if r["path"] == "nvshmem_api"})
    print("# remote_rate: GB/s per direction, rail members 0 <-> 1; nvshmem_api / nvlink_pointer", file=out)
    print(f"#{'size':>11} {'nvlink_pointer':>15}" + "".join(f" {'nvshmem pb=' + str(b):>15} {'ratio':>6}"
                                                           for b in blocks), file=out)
    by = {(r["bytes"], r["put_blocks"]): r for r in rows if r["path"] == "nvshmem_api"}
    for nbytes in sorted({r["bytes"] for r in rows}):
        base = raw.get(nbytes)
        cells = [f" {base['gbps']:>15.1f}" if base else f" {'N/A':>15}"]
        for b in blocks:
            r = by.get((nbytes, b))
            ratio = r["gbps"] / base["gbps"] if r and base and base["gbps"] else float("nan")
            bad = "" if not r or not r["wrong"] else f" WRONG={r['wrong']}"
            cells.append(f" {r['gbps']:>15.1f} {ratio:>6.3f}{bad}" if r else f" {'N/A':>22}")
        print(f" {format_size(nbytes):>11}" + "".join(cells), file=out)


def main(argv=None) -> int:
    import fluxrt

    ap = argparse.ArgumentParser(prog="fluxrt-perf remote_rate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(ap)
    ap.set_defaults(minbytes=1 << 20, maxbytes=1 << 30, stepfactor=4, iters=5, warmup_iters=2, datatype="int32")
    ap.add_argument("--slot", type=parse_size, default=64 << 20,
                    help="bytes of one rail round (the rail slot; larger messages go in several rounds)")
    ap.add_argument("--put-blocks", default="8,32", help="comma list of put blocks per rail member (1..32)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ",".join(PATHS))
    ap.add_argument("--heap", default=None, help="symmetric heap size (default: room for the rail buffers)")
    args = ap.parse_args(argv)
    try:
        opts = SweepOptions.from_args(args)
        put_blocks = [int(v) for v in args.put_blocks.split(",") if v]
    except ValueError as e:
        ap.error(str(e))
    paths = [p for p in args.paths.split(",") if p]
    if set(paths) - set(PATHS) or not paths:
        ap.error(f"--paths: choose from {list(PATHS)}")
    if any(not 1 <= b <= 32 for b in put_blocks) or not put_blocks:
        ap.error("--put-blocks: values from 1 to 32 (remote::kMaxRailBlocks)")
    if args.slot < 16 or args.slot % 16:
        ap.error("--slot: a positive multiple of 16 bytes")
    heap = args.heap or str(max(2 << 30, 2 * pool_bytes(args.slot, 8) + (512 << 20)))
    world_kw = {"timeout_s": opts.timeout} if opts.timeout > 0 else {}
    with fluxrt.init(options=fluxrt.WorldOptions(heap_size=heap, **world_kw)) as world:
        versions, devices = library_versions(), device_info(world)
        if world.rank == 0:
            for line in [*describe(opts), version_line(versions), *device_lines(devices),
                         f"# slot {format_size(args.slot)}, put blocks {put_blocks}"]:
                print(line, flush=True)
        rows = rate_rows(world, opts, args.slot, put_blocks, paths)
        if world.rank == 0:
            _print(rows)
            ratios = ratio_rows(rows)
            top = [r for r in ratios if r["bytes"] == max(r2["bytes"] for r2 in ratios)] if ratios else []
            notes = [f"nvshmem_api/nvlink_pointer at {format_size(r['bytes'])}, {r['put_blocks']} put blocks: "
                     f"{r['ratio']:.3f} (target >= {TARGET_RATIO})" for r in top]
            for n in notes:
                print("# " + n)
            if opts.json_path:
                doc = results_document("remote_rate", rows, ["fluxrt-perf", "remote_rate", *(argv or sys.argv[1:])],
                                       machine=machine(world), versions=versions, devices=devices,
                                       options=dict(dataclasses.asdict(opts), slot=args.slot, put_blocks=put_blocks,
                                                    paths=paths, topology=world.topology.describe()),
                                       notes=notes, ratios=ratios)
                write_json(opts.json_path, doc)
        wrong = sum(r["wrong"] or 0 for r in rows)
    return 1 if wrong else 0


__all__ = ["PATHS", "TARGET_RATIO", "main", "piece_sizes", "pool_bytes", "rate_rows", "ratio_rows"]
