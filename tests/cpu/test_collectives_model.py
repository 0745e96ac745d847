"""The collectives' host side (validation, planning, launch arguments, exchange tables) driving a numpy
model of kernels/comm/collectives.cu, on every rank of a simulated world (threads stand in for MPI ranks).

The model mirrors each kernel's stages (block slices, workspace slots and halves, direct pushes, LL lines
with their flags in the LL buffer); it checks
that the arguments the host builds move every element to the right place, for odd sizes, several launches
per message, in-place layouts and symmetric outputs. Pipelined rounds run as one actor per (rank, block)
under a random schedule, with their ready/credit flags: the model checks that no actor waits forever,
that no ring entry is overwritten before it was read, and that every read finds the step it expects. The
kernels' memory ordering is the GPU suite's job.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from fluxrt import collectives as coll
from fluxrt import collectives_plan as plan
from fluxrt.dtypes import bfloat16
from fluxrt.errors import CollectiveMismatchError

BASE = 1 << 20          # model addresses start here (0 stays an invalid pointer)
RANK_BYTES = 1 << 24    # each rank's share of the model address space
WORKSPACE = 1 << 16     # small, so that larger messages need several launches
# a small LL buffer too: forced LL rounds come in several launches; pipelined rounds with several slices
# and many steps per slice (their ring wraps many times)
# the LL12 two-shot's share of the buffer is small as well (forced two-shots of larger messages take several
# launches)
TUNING = plan.Tuning(ll_max_bytes=2048, pipe_bytes_per_block=1024, pipe_max_grid=4, ll12_twoshot_max_bytes=6000,
                     ring_max_grid=4)


class Memory:
    """One flat byte space holding every rank's buffers; a pointer is BASE + offset."""

    def __init__(self, ranks: int):
        self.bytes = np.zeros(ranks * RANK_BYTES, dtype=np.uint8)
        self.top = [r * RANK_BYTES for r in range(ranks)]

    def alloc(self, rank: int, nbytes: int) -> int:
        off = self.top[rank]
        self.top[rank] += (nbytes + 255) // 256 * 256 + 256
        assert self.top[rank] <= (rank + 1) * RANK_BYTES
        return BASE + off

    def view(self, ptr: int, count: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        off = ptr - BASE
        return self.bytes[off:off + count * dtype.itemsize].view(dtype)


class FakeArray:
    """Enough of a CuPy array for the host code: a 1-D contiguous view of model memory."""

    def __init__(self, mem: Memory, ptr: int, count: int, dtype, heap=None, peers=None):
        self.mem, self.dtype, self.size = mem, np.dtype(dtype), count
        self.data = SimpleNamespace(ptr=ptr)
        self.itemsize = self.dtype.itemsize
        self.nbytes = count * self.itemsize
        self.shape, self.ndim, self.strides = (count,), 1, (self.itemsize,)
        self.flags = SimpleNamespace(c_contiguous=True)
        self.device = SimpleNamespace(id=0)
        self._heap, self._peers = heap, peers  # symmetric: peers[q] = the same view on rank q

    def __getitem__(self, s: slice) -> "FakeArray":
        start, stop, _ = s.indices(self.size)
        shift = start * self.itemsize
        peers = None if self._peers is None else [p + shift for p in self._peers]
        return FakeArray(self.mem, self.data.ptr + shift, stop - start, self.dtype, self._heap, peers)

    @property
    def offset_bytes(self) -> int:
        return self._peers[0] - BASE  # the same on every rank by construction

    def peer_ptr(self, q: int) -> int:
        return self._peers[q]

    def get(self) -> np.ndarray:
        return self.mem.view(self.data.ptr, self.size, self.dtype)


_MODEL_DTYPES = {"bf16": bfloat16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32),
                 "fp64": np.dtype(np.float64), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
                 "uint8": np.dtype(np.uint8)}
_MODEL_FNS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _acc(dtype) -> np.dtype:
    """The kernels' accumulator (E::Acc): fp32 for the 16- and 32-bit floats, uint32 for uint8, else the type."""
    d = np.dtype(dtype)
    if d == np.uint8:
        return np.dtype(np.uint32)
    return d if d in (np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64)) else np.dtype(np.float32)


class Kernel:
    def __init__(self, name: str):
        self.name = name


class ThreadComm:
    """allgather across the threads of a simulated world."""

    def __init__(self, n: int):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def allgather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class Model:
    """n ranks: their contexts (host code under test) and the kernels' model."""

    def __init__(self, n: int, check: bool = False):
        self.n, self.mem = n, Memory(n)
        self.seed = 0  # of the pipelined rounds' schedules
        self.comm = ThreadComm(n)
        self.heap = object()
        self.ws = [self.mem.alloc(r, WORKSPACE) for r in range(n)]
        self.ll_bytes = TUNING.ll_buffer_bytes(n)
        self.ll = [self.mem.alloc(r, self.ll_bytes) for r in range(n)]
        self.epoch = [0] * n
        self.ctx = []
        for r in range(n):
            world = SimpleNamespace(size=n, rank=r, device_id=0, heap=self.heap, make_current=lambda: None,
                                    options=SimpleNamespace(check_collective_args=check),
                                    comm=SimpleNamespace(allgather=lambda v, r=r: self.comm.allgather(r, v)))
            c = object.__new__(coll.Collectives)
            c.world, c.half_bytes, c._fast = world, WORKSPACE // 2, {}
            c.tuning, c.ll_half_bytes = TUNING, self.ll_bytes // 2
            c._kernels = {}
            c._check_loaded = lambda dt, red: None   # no modules to load in the model
            c._ext_met = set(coll.EXT_CODES.values())   # and none whose first call still has to meet
            c._launch = lambda name, grid, args, block=plan.THREADS, pdl=True: SimpleNamespace(
                kernel=Kernel(name), grid=grid, args=args, block=block)
            c._teams = {name: ("team", r) for name in plan.ALGOS}
            c._output = lambda out, name, dtype, count, shape, op, stream, r=r: (
                out if out is not None else self.array(r, count, dtype))
            self.ctx.append(c)

    def array(self, rank: int, count: int, dtype, values=None) -> FakeArray:
        a = FakeArray(self.mem, self.mem.alloc(rank, count * np.dtype(dtype).itemsize), count, dtype)
        a.get()[...] = (np.array(-7).astype(dtype) if np.dtype(dtype).kind in "iu" else np.nan) if values is None else values
        return a

    def symmetric(self, count: int, dtype) -> list[FakeArray]:
        ptrs = [self.mem.alloc(r, count * np.dtype(dtype).itemsize) for r in range(self.n)]
        out = [FakeArray(self.mem, ptrs[r], count, dtype, self.heap, ptrs) for r in range(self.n)]
        for a in out:
            a.get()[...] = -7 if np.dtype(dtype).kind in "iu" else np.nan
        return out

    def call(self, method: str, args_per_rank, **kw):
        """Plan the call on every rank (threads: the host code may exchange over 'MPI'), then run the model."""
        plans, errors = [None] * self.n, [None] * self.n

        def host(r):
            try:
                c = self.ctx[r]
                c._run = lambda stream, async_op, launches, result, keep: (launches, result)
                plans[r] = getattr(c, method)(*args_per_rank[r], **kw)
            except Exception as e:  # reported below, per rank
                errors[r] = e

        threads = [threading.Thread(target=host, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(errors):
            raise next(e for e in errors if e)
        launches = [p[0] for p in plans]
        assert len({len(ls) for ls in launches}) == 1, "ranks disagree on the number of launches"
        for k in range(len(launches[0])):
            self.run([ls[k] for ls in launches])
        return [p[1] for p in plans]

    # --- the kernels' model ---------------------------------------------------------------------------
    def run(self, launch_per_rank) -> None:
        names = {launch.kernel.name for launch in launch_per_rank}
        if len(names) == 1 and next(iter(names)).startswith("fluxrt_divide_"):  # avg: a plain local launch
            dtype = _MODEL_DTYPES[next(iter(names))[len("fluxrt_divide_"):]]
            for launch in launch_per_rank:
                out, count, ranks = (int(v) for v in launch.args)
                assert ranks == self.n
                v = self.mem.view(out, count, dtype)
                v[...] = (v.astype(_acc(dtype)) / _acc(dtype).type(ranks)).astype(dtype)
            return
        grids = {launch.grid for launch in launch_per_rank}
        assert len(names) == 1 and len(grids) == 1, f"ranks launch different kernels: {names} {grids}"
        name, grid = names.pop(), grids.pop()
        assert 1 <= grid <= (plan.MAX_RING_BLOCKS if "_ring" in name else plan.MAX_BLOCKS)
        es = {self.epoch[r] + 1 for r in range(self.n)}
        assert len(es) == 1
        e = es.pop()
        self.epoch = [e] * self.n
        half = (e & 1) * (WORKSPACE // 2)
        tails = [launch.args[2:] for launch in launch_per_rank]
        if "_ring" in name:
            RingRound(self, name, grid, e, half, tails).run(np.random.default_rng(self.seed + e))
        elif "_pipe" in name:
            PipeRound(self, name, grid, e, half, tails).run(np.random.default_rng(self.seed + e))
        elif "_ll12_twoshot_" in name:
            self._ll12_twoshot_round(name, (e & 1) * (self.ll_bytes // 2), e % 0xFFFF + 1, tails)
        elif "_ll12_" in name:
            self._ll12_round(name, (e & 1) * (self.ll_bytes // 2), e % 0xFFFF + 1, tails)
        elif "_ll" in name:
            self._ll_round(name, (e & 1) * (self.ll_bytes // 2), e & 0xFFFFFFFF or 1, tails)
        elif name == "fluxrt_exchange":
            self._exchange(grid, half, tails)
        else:
            kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
            self._reduction(kind, dt, red, grid, half, tails)

    def _range(self, total, align, grid, b):
        per = -(-total // grid)
        per = -(-per // align) * align
        lo = b * per
        return min(lo, total), min(lo + per, total)

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            d, s = dst - BASE, src - BASE
            assert 0 <= s and s + nbytes <= len(self.mem.bytes) and 0 <= d and d + nbytes <= len(self.mem.bytes)
            self.mem.bytes[d:d + nbytes] = self.mem.bytes[s:s + nbytes].copy()

    def _exchange(self, grid, half, tails) -> None:
        n = self.n
        tabs = [t[0].view(np.uint64).reshape(5, plan.MAX_WORLD).astype(np.int64) for t in tails]
        slot = int(tails[0][1])
        direct = bool(tails[0][2])
        assert all(int(t[1]) == slot and bool(t[2]) == direct for t in tails)
        for p in range(n):  # each pair agrees on its byte count
            for q in range(n):
                if not direct:
                    assert tabs[p][1][q] == tabs[q][3][p], f"rank {p} sends {tabs[p][1][q]} B to {q}, which expects " \
                                                           f"{tabs[q][3][p]}"
        for b in range(grid):
            for r in range(n):
                for q in range(n):
                    lo, hi = self._range(int(tabs[r][1][q]), plan.VEC_BYTES, grid, b)
                    assert hi <= slot or direct
                    dst = int(tabs[r][4][q]) + lo if direct else self.ws[q] + half + r * slot + lo
                    self._copy(dst, int(tabs[r][0][q]) + lo, hi - lo)
            if direct:
                continue
            for r in range(n):
                for p in range(n):
                    lo, hi = self._range(int(tabs[r][3][p]), plan.VEC_BYTES, grid, b)
                    self._copy(int(tabs[r][2][p]) + lo, self.ws[r] + half + p * slot + lo, hi - lo)

    # --- LL rounds: lines of {4 data bytes, 4 flag bytes} x 2 in the receiver's LL slot [sender] -------------
    def _ll_put(self, q: int, r: int, half: int, slot: int, src: int, nbytes: int, flag: int) -> None:
        """Rank r's `nbytes` at src as lines into q's LL slot [r] (at least one line: a marker)."""
        lines = max(1, -(-nbytes // plan.LL_DATA_BYTES))
        assert lines * plan.LL_LINE_BYTES <= slot, f"{nbytes} B do not fit an LL slot of {slot} B"
        data = np.zeros(lines * plan.LL_DATA_BYTES, np.uint8)
        data[:nbytes] = self.mem.bytes[src - BASE:src - BASE + nbytes]
        cells = np.zeros((lines * 2, 2), np.uint32)
        cells[:, 0] = data.view(np.uint32)
        cells[:, 1] = flag
        at = self.ll[q] - BASE + half + r * slot
        line_bytes = self.mem.bytes[at:at + lines * plan.LL_LINE_BYTES]
        assert not line_bytes.any(), "an LL line was written twice in a round, or not cleared after a round"
        line_bytes[...] = cells.view(np.uint8).reshape(-1)

    def _ll_take(self, r: int, p: int, half: int, slot: int, dst: int, nbytes: int, flag: int) -> None:
        lines = max(1, -(-nbytes // plan.LL_DATA_BYTES))
        at = self.ll[r] - BASE + half + p * slot
        raw = self.mem.bytes[at:at + lines * plan.LL_LINE_BYTES]
        cells = raw.copy().view(np.uint32).reshape(-1, 2)
        assert (cells[:, 1] == flag).all(), f"rank {r} waits forever for an LL line from rank {p}"
        raw[...] = 0
        if nbytes:
            self.mem.bytes[dst - BASE:dst - BASE + nbytes] = cells[:, 0].copy().view(np.uint8)[:nbytes]

    def _ll_round(self, name: str, half: int, flag: int, tails) -> None:
        n = self.n
        slot = int(tails[0][-1])
        assert all(int(t[-1]) == slot for t in tails) and slot * n <= self.ll_bytes // 2
        if name == "fluxrt_exchange_ll":
            tabs = [t[0].view(np.uint64).reshape(5, plan.MAX_WORLD).astype(np.int64) for t in tails]
            for r in range(n):
                for q in range(n):
                    if q != r:
                        self._ll_put(q, r, half, slot, int(tabs[r][0][q]), int(tabs[r][1][q]), flag)
            for r in range(n):
                for p in range(n):
                    if p == r:
                        self._copy(int(tabs[r][2][r]), int(tabs[r][0][r]), min(int(tabs[r][1][r]), int(tabs[r][3][r])))
                    else:
                        self._ll_take(r, p, half, slot, int(tabs[r][2][p]), int(tabs[r][3][p]), flag)
            return
        kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
        dtype = _MODEL_DTYPES[dt]
        fn = _MODEL_FNS[red]
        isz = dtype.itemsize
        if kind == "allreduce_ll":
            srcs = [(int(x), 0, int(out), int(count)) for x, out, count, _ in tails]
        else:
            assert kind == "reduce_scatter_ll"
            srcs = [(int(x), int(stride), int(out), int(chunk)) for x, stride, out, chunk, _ in tails]
        staged = []  # what each rank receives, in scratch memory (the take writes whole lines)
        for r, (x, stride, out, count) in enumerate(srcs):
            for q in range(n):
                if q != r:
                    self._ll_put(q, r, half, slot, x + q * stride * isz, count * isz, flag)
        for r, (x, stride, out, count) in enumerate(srcs):
            parts = []
            for p in range(n):
                if p == r:
                    parts.append(self.mem.view(x + r * stride * isz, count, dtype).astype(_acc(dtype)))
                else:
                    tmp = self.mem.alloc(r, count * isz + 16)
                    self._ll_take(r, p, half, slot, tmp, count * isz, flag)
                    parts.append(self.mem.view(tmp, count, dtype).astype(_acc(dtype)))
            acc = parts[0]
            for part in parts[1:]:
                acc = fn(acc, part)
            staged.append(acc)
        for (x, stride, out, count), acc in zip(srcs, staged):
            self.mem.view(out, count, dtype)[...] = acc.astype(dtype)

    # --- LL12 allreduce: lines of {6 data bytes | 16-bit flag} x 2 ------------------------------------------
    def _ll12_cells(self, data: np.ndarray, flag: int) -> np.ndarray:
        """12-byte groups of `data` as 16-byte lines: two little-endian 8-byte cells of 6 bytes + flag."""
        six = data.reshape(-1, 6)
        cells = np.zeros((six.shape[0], 8), np.uint8)
        cells[:, :6] = six
        cells[:, 6:] = np.frombuffer(np.uint16(flag).tobytes(), np.uint8)
        return cells.reshape(-1)

    def _ll12_round(self, name: str, half: int, flag: int, tails) -> None:
        n = self.n
        slot = int(tails[0][-1])
        assert all(int(t[-1]) == slot for t in tails) and slot * n <= self.ll_bytes // 2
        assert 1 <= flag <= 0xFFFF
        kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
        assert kind == "allreduce_ll12"
        dtype = _MODEL_DTYPES[dt]
        fn = _MODEL_FNS[red]
        isz = dtype.itemsize
        srcs = [(int(x), int(out), int(count)) for x, out, count, _ in tails]
        assert len({count for _, _, count in srcs}) == 1
        for r, (x, _, count) in enumerate(srcs):  # push: rank r's message into every peer's slot [r]
            nbytes = count * isz
            lines = -(-nbytes // plan.LL12_DATA_BYTES)
            data = np.zeros(lines * plan.LL12_DATA_BYTES, np.uint8)
            data[:nbytes] = self.mem.bytes[x - BASE:x - BASE + nbytes]
            for q in range(n):
                if q == r:
                    continue
                assert lines * plan.LL_LINE_BYTES <= slot, f"{nbytes} B do not fit an LL slot of {slot} B"
                at = self.ll[q] - BASE + half + r * slot
                line_bytes = self.mem.bytes[at:at + lines * plan.LL_LINE_BYTES]
                assert not line_bytes.any(), "an LL line was written twice in a round, or not cleared after a round"
                line_bytes[...] = self._ll12_cells(data, flag)
        staged = []
        for r, (x, out, count) in enumerate(srcs):  # take: every peer's lines, zeroed after reading
            nbytes = count * isz
            lines = -(-nbytes // plan.LL12_DATA_BYTES)
            parts = []
            for p in range(n):
                if p == r:
                    parts.append(self.mem.view(x, count, dtype).astype(_acc(dtype)))
                    continue
                at = self.ll[r] - BASE + half + p * slot
                raw = self.mem.bytes[at:at + lines * plan.LL_LINE_BYTES]
                cells = raw.copy().reshape(-1, 8)
                flags = cells[:, 6:].copy().view(np.uint16).reshape(-1)
                assert (flags == flag).all(), f"rank {r} waits forever for an LL12 line from rank {p}"
                raw[...] = 0
                data = cells[:, :6].reshape(-1)[:nbytes].copy()
                parts.append(data.view(dtype).astype(_acc(dtype)))
            acc = parts[0]
            for part in parts[1:]:
                acc = fn(acc, part)
            staged.append(acc)
        for (x, out, count), acc in zip(srcs, staged):
            self.mem.view(out, count, dtype)[...] = acc.astype(dtype)

    def _ll12_lines(self, rank: int, half: int, region: int, slot: int, src: int, lines: int) -> np.ndarray:
        """Bytes of `lines` lines of slot [src] of an LL region of rank's buffer (a view)."""
        at = self.ll[rank] - BASE + half + (region * self.n + src) * slot
        assert lines * plan.LL_LINE_BYTES <= slot, f"{lines} lines do not fit an LL12 two-shot slot of {slot} B"
        return self.mem.bytes[at:at + lines * plan.LL_LINE_BYTES]

    def _ll12_put(self, rank: int, half: int, region: int, slot: int, src: int, data: np.ndarray, flag: int) -> None:
        lines = len(data) // plan.LL12_DATA_BYTES
        view = self._ll12_lines(rank, half, region, slot, src, lines)
        assert not view.any(), "an LL line was written twice in a round, or not cleared after a round"
        view[...] = self._ll12_cells(data, flag)

    def _ll12_take(self, rank: int, half: int, region: int, slot: int, src: int, lines: int, flag: int) -> np.ndarray:
        view = self._ll12_lines(rank, half, region, slot, src, lines)
        cells = view.copy().reshape(-1, 8)
        flags = cells[:, 6:].copy().view(np.uint16).reshape(-1)
        assert (flags == flag).all(), f"rank {rank} waits forever for an LL12 line from rank {src}"
        view[...] = 0
        return cells[:, :6].reshape(-1).copy()

    def _ll12_twoshot_round(self, name: str, half: int, flag: int, tails) -> None:
        """Chunk q (`chunk` lines) is reduced by rank q from every rank's region-0 lines, then forwarded to
        every peer's region 1; an empty chunk moves one marker line in both phases."""
        n, L = self.n, plan.LL12_DATA_BYTES
        slot = int(tails[0][-1])
        assert all(int(t[-1]) == slot for t in tails) and 2 * n * slot <= self.ll_bytes // 2
        kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
        assert kind == "allreduce_ll12_twoshot"
        dtype = _MODEL_DTYPES[dt]
        fn = _MODEL_FNS[red]
        srcs = [(int(x), int(out), int(count)) for x, out, count, _ in tails]
        assert len({count for _, _, count in srcs}) == 1
        nbytes = srcs[0][2] * dtype.itemsize
        lines = -(-nbytes // L)
        chunk = plan.ll12_twoshot_chunk(nbytes, n)
        length = [min(max(lines - q * chunk, 0), chunk) for q in range(n)]
        moved = [max(1, m) for m in length]

        def message(x):  # the message as whole lines, zero past its end, plus room for marker lines
            data = np.zeros((n * chunk + 1) * L, np.uint8)
            data[:nbytes] = self.mem.bytes[x - BASE:x - BASE + nbytes]
            return data

        def part(data, q):  # the `moved` lines of chunk q (a marker line reads zeros)
            return data[q * chunk * L:(q * chunk + moved[q]) * L] if length[q] else np.zeros(L, np.uint8)

        xs = [message(x) for x, _, _ in srcs]
        for r in range(n):                                                   # push
            for q in range(n):
                if q != r:
                    self._ll12_put(q, half, 0, slot, r, part(xs[r], q), flag)
        reduced = []
        for r in range(n):                                                   # reduce
            acc = None
            for p in range(n):
                raw = part(xs[r], r) if p == r else self._ll12_take(r, half, 0, slot, p, moved[r], flag)
                v = raw.view(dtype).astype(_acc(dtype))
                acc = v if acc is None else fn(acc, v)
            reduced.append(acc.astype(dtype).view(np.uint8))
        for r in range(n):                                                   # forward
            for q in range(n):
                if q != r:
                    self._ll12_put(q, half, 1, slot, r, reduced[r], flag)
        for r, (_, out, count) in enumerate(srcs):                           # gather (and own chunk)
            result = np.zeros((n * chunk + 1) * L, np.uint8)
            for p in range(n):
                got = reduced[r] if p == r else self._ll12_take(r, half, 1, slot, p, moved[p], flag)
                if length[p]:
                    result[p * chunk * L:(p * chunk + length[p]) * L] = got
            self.mem.bytes[out - BASE:out - BASE + nbytes] = result[:nbytes]

    def _reduction(self, kind, dt, red, grid, half, tails) -> None:
        n = self.n
        dtype = _MODEL_DTYPES[dt]
        isz = dtype.itemsize
        vec = plan.VEC_BYTES // isz
        fn = _MODEL_FNS[red]
        slot = int(tails[0][-1])
        view = self.mem.view

        def reduce_into(r, dst, base, lo, hi):
            acc = view(self.ws[r] + base, hi, dtype)[lo:hi].astype(_acc(dtype))
            for p in range(1, n):
                acc = fn(acc, view(self.ws[r] + base + p * slot, hi, dtype)[lo:hi].astype(_acc(dtype)))
            view(dst, hi, dtype)[lo:hi] = acc.astype(dtype)

        if kind == "allreduce_oneshot":
            for b in range(grid):
                for r, (x, out, count, _) in enumerate(tails):
                    lo, hi = self._range(int(count), vec, grid, b)
                    for q in range(n):
                        self._copy(self.ws[q] + half + r * slot + lo * isz, int(x) + lo * isz, (hi - lo) * isz)
                for r, (x, out, count, _) in enumerate(tails):
                    lo, hi = self._range(int(count), vec, grid, b)
                    reduce_into(r, int(out), half, lo, hi)
        elif kind == "reduce_scatter":
            for b in range(grid):
                for r, (x, stride, out, chunk, _) in enumerate(tails):
                    lo, hi = self._range(int(chunk), vec, grid, b)
                    for q in range(n):
                        self._copy(self.ws[q] + half + r * slot + lo * isz, int(x) + (q * int(stride) + lo) * isz,
                                   (hi - lo) * isz)
                for r, (x, stride, out, chunk, _) in enumerate(tails):
                    lo, hi = self._range(int(chunk), vec, grid, b)
                    reduce_into(r, int(out), half, lo, hi)
        else:
            assert kind == "allreduce_twoshot"
            area2 = half + n * slot
            for b in range(grid):
                for r, (x, out, count, chunk, _) in enumerate(tails):
                    count, chunk = int(count), int(chunk)
                    lo, hi = self._range(chunk, vec, grid, b)
                    for q in range(n):
                        l, h = min(q * chunk + lo, count), min(q * chunk + hi, count)
                        assert (hi - lo) * isz <= slot
                        self._copy(self.ws[q] + half + r * slot + lo * isz, int(x) + l * isz, (h - l) * isz)
                for r, (x, out, count, chunk, _) in enumerate(tails):
                    count, chunk = int(count), int(chunk)
                    lo, hi = self._range(chunk, vec, grid, b)
                    mine = r * chunk
                    my_hi = hi if mine + hi < count else (count - mine if count > mine else 0)
                    my_lo = min(lo, my_hi)
                    reduce_into(r, self.ws[r] + area2 + r * slot, half, my_lo, my_hi)
                    for q in range(n):
                        if q != r:
                            self._copy(self.ws[q] + area2 + r * slot + my_lo * isz,
                                       self.ws[r] + area2 + r * slot + my_lo * isz, (my_hi - my_lo) * isz)
                for r, (x, out, count, chunk, _) in enumerate(tails):
                    count, chunk = int(count), int(chunk)
                    lo, hi = self._range(chunk, vec, grid, b)
                    for p in range(n):
                        l, h = min(p * chunk + lo, count), min(p * chunk + hi, count)
                        self._copy(int(out) + l * isz, self.ws[r] + area2 + p * slot + lo * isz, (h - l) * isz)


class PipeRound:
    """One pipelined launch on every rank (kernels/comm/collectives.cu, "pipelined rounds"): an actor per
    (rank, block) runs its role (sender, reducer, receiver) as a generator that yields what it waits for;
    a random schedule advances actors whose wait is satisfied."""

    READY0, READY1, CREDIT0, CREDIT1 = 2, 3, 4, 5

    def __init__(self, model: "Model", name: str, grid: int, e: int, half: int, tails):
        self.m, self.n, self.e, self.half = model, model.n, e, half
        self.flags = [dict() for _ in range(self.n)]  # rank -> {(phase, src, slice): value}
        self.ring = {}                                 # (owner, ring, slot, slice, entry) -> (src, step)
        self.actors = []
        if name == "fluxrt_exchange_pipe":
            tabs = [t[0].view(np.uint64).reshape(5, plan.MAX_WORLD).astype(np.int64) for t in tails]
            self.slot, self.step, self.depth = int(tails[0][1]), int(tails[0][2]), int(tails[0][3])
            assert all((int(t[1]), int(t[2]), int(t[3])) == (self.slot, self.step, self.depth) for t in tails), \
                "ranks disagree on the ring geometry"
            self.roles = 2
            pairwise = {int(t[4]) for t in tails}  # the kernel's `pairwise` argument
            assert len(pairwise) == 1, "ranks disagree on the pairwise phases"
            run = self._exchange_pairwise if pairwise.pop() else self._exchange
            for r in range(self.n):
                for b in range(grid):
                    self.actors.append(run(r, b, grid, tabs[r]))
        else:
            kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
            self.dtype = _MODEL_DTYPES[dt]
            self.fn = _MODEL_FNS[red]
            two = kind == "allreduce_pipe"
            self.roles = 3 if two else 2
            geometry = {tuple(int(v) for v in t[-3:]) for t in tails}
            assert len(geometry) == 1, f"ranks disagree on the ring geometry: {geometry}"
            for r, t in enumerate(tails):
                if two:
                    x, out, count, chunk, slot, step, depth = (int(v) for v in t)
                    stride = 0
                else:
                    x, stride, out, chunk, slot, step, depth = (int(v) for v in t)
                    count = chunk
                self.slot, self.step, self.depth = slot, step * self.dtype.itemsize, depth
                for b in range(grid):
                    self.actors.append(self._reduce(r, b, grid, x, stride, out, count, chunk, step, two))
        assert grid % self.roles == 0 and grid <= plan.MAX_BLOCKS
        assert self.depth >= 2 and self.step % plan.VEC_BYTES == 0
        rings = 2 if self.roles == 3 else 1
        assert rings * max(1, self.n - 1) * self.slot <= WORKSPACE // 2, "the rings overflow the workspace half"
        assert (grid // self.roles) * self.depth * self.step <= self.slot, "a slot is too small for its entries"
        # by byte address: no two ring entries overlap, and all lie inside this round's workspace half
        spans = sorted(self.entry(ring, 0, src, sl, k)[0] - self.m.ws[0]
                       for ring in range(rings) for src in range(1, max(2, self.n))
                       for sl in range(grid // self.roles) for k in range(self.depth))
        assert all(b - a >= self.step for a, b in zip(spans, spans[1:])), "ring entries overlap"
        assert self.half <= spans[0] and spans[-1] + self.step <= self.half + WORKSPACE // 2

    # --- shared pieces (as in the kernel) --------------------------------------------------------------
    def value(self, j: int) -> int:
        return (self.e << plan.PIPE_STEP_BITS) + j + 1

    def entry(self, ring: int, owner: int, src: int, sl: int, j: int):
        """(model pointer, state key) of the ring entry of step j that src fills in owner's workspace."""
        slot = (src + self.n - owner - 1) % self.n
        key = (owner, ring, slot, sl, j % self.depth)
        off = self.half + (ring * (self.n - 1) + slot) * self.slot + (sl * self.depth + j % self.depth) * self.step
        return self.m.ws[owner] + off, key

    def fill(self, key, src: int, j: int) -> None:
        assert self.ring.get(key) is None, f"ring entry {key} overwritten before it was read ({self.ring[key]})"
        self.ring[key] = (src, j)

    def take(self, key, src: int, j: int) -> None:
        assert self.ring.get(key) == (src, j), f"ring entry {key} holds {self.ring.get(key)}, not step {j} of {src}"

    def waits(self, r: int, phase: int, sl: int, j: int, peers):
        v = self.value(j)
        return lambda: all(self.flags[r].get((phase, p, sl), 0) >= v for p in peers)

    @staticmethod
    def srange(total: int, align: int, sl: int, slices: int):
        per = -(-total // slices)
        per = -(-per // align) * align
        lo = sl * per
        return min(lo, total), min(lo + per, total)

    @staticmethod
    def steps_of(length: int, step: int) -> int:
        return -(-length // step) if length else 1

    @staticmethod
    def step_len(length: int, step: int, j: int) -> int:
        at = j * step
        return min(step, length - at) if at < length else 0

    def release(self, r: int, phase: int, sl: int, j: int, peers) -> None:
        for q in peers:
            self.flags[q][(phase, r, sl)] = self.value(j)

    # --- roles ------------------------------------------------------------------------------------------
    def _exchange_slices(self, b, grid, tab):
        """Block b's role, slice, and the [lo, hi) of its slice of every pair's send and receive bytes."""
        sl, slices, line = b // 2, grid // 2, plan.PIPE_LINE_BYTES
        send = [self.srange(int(tab[1][q]), line, sl, slices) for q in range(self.n)]
        recv = [self.srange(int(tab[3][q]), line, sl, slices) for q in range(self.n)]
        return b % 2, sl, send, recv

    def _exchange(self, r, b, grid, tab):
        n, step, depth = self.n, self.step, self.depth
        role, sl, send, recv = self._exchange_slices(b, grid, tab)
        send_steps = max(self.steps_of(h - lo, step) for lo, h in send)
        mine = send if role == 0 else recv
        steps = max(self.steps_of(h - lo, step) for lo, h in mine)
        for j in range(steps):
            mask = [q for q in range(n) if q != r and j < self.steps_of(mine[q][1] - mine[q][0], step)]
            if role == 0:
                if j >= depth:
                    yield self.waits(r, self.CREDIT0, sl, j - depth, mask)
                for q in mask:
                    lo, h = send[q]
                    ptr, key = self.entry(0, q, r, sl, j)
                    self.fill(key, r, j)
                    self.m._copy(ptr, int(tab[0][q]) + lo + j * step, self.step_len(h - lo, step, j))
                self.release(r, self.READY0, sl, j, mask + [r])
            else:
                yield self.waits(r, self.READY0, sl, min(j, send_steps - 1), [r])
                yield self.waits(r, self.READY0, sl, j, mask)
                for p in range(n):
                    lo, h = recv[p]
                    count = self.step_len(h - lo, step, j)
                    dst = int(tab[2][p]) + lo + j * step
                    if p in mask:
                        ptr, key = self.entry(0, r, p, sl, j)
                        self.take(key, p, j)
                        self.m._copy(dst, ptr, count)
                        self.ring[key] = None
                    elif p == r:
                        own = min(int(tab[1][r]), int(tab[3][r]))
                        at = lo + j * step
                        src = int(tab[0][r]) + at
                        if src != dst:
                            self.m._copy(dst, src, min(own - at, count) if at < own else 0)
                self.release(r, self.CREDIT0, sl, j, mask)

    def _exchange_pairwise(self, r, b, grid, tab):
        n, step, depth = self.n, self.step, self.depth
        role, sl, send, recv = self._exchange_slices(b, grid, tab)
        if role == 1:  # own pair first (in place: already there)
            lo, h = recv[r]
            end = min(h, int(tab[1][r]), int(tab[3][r]))
            if lo < end and tab[2][r] != tab[0][r]:
                self.m._copy(int(tab[2][r]) + lo, int(tab[0][r]) + lo, end - lo)
        for k in range(1, n):
            if role == 0:
                q = (r + k) % n
                lo, h = send[q]
                for j in range(self.steps_of(h - lo, step)):
                    if j >= depth:
                        yield self.waits(r, self.CREDIT0, sl, j - depth, [q])
                    ptr, key = self.entry(0, q, r, sl, j)
                    self.fill(key, r, j)
                    self.m._copy(ptr, int(tab[0][q]) + lo + j * step, self.step_len(h - lo, step, j))
                    self.release(r, self.READY0, sl, j, [q])
            else:
                p = (r - k) % n
                lo, h = recv[p]
                for j in range(self.steps_of(h - lo, step)):
                    yield self.waits(r, self.READY0, sl, j, [p])
                    ptr, key = self.entry(0, r, p, sl, j)
                    self.take(key, p, j)
                    self.m._copy(int(tab[2][p]) + lo + j * step, ptr, self.step_len(h - lo, step, j))
                    self.ring[key] = None
                    self.release(r, self.CREDIT0, sl, j, [p])

    def _reduce(self, r, b, grid, x, stride, out, count, chunk, step, two):
        n, depth, isz, dtype = self.n, self.depth, self.dtype.itemsize, self.dtype
        roles = self.roles
        role, sl, slices = b % roles, b // roles, grid // roles
        lo, hi = self.srange(chunk, plan.PIPE_LINE_BYTES // isz, sl, slices)

        def length(q):
            if not two:
                return hi - lo
            valid = max(0, count - q * chunk)
            h = min(hi, valid)
            return h - lo if lo < h else 0

        lens = [length(q) for q in range(n)]
        steps = max(self.steps_of(v, step) for v in lens)
        peers = [q for q in range(n) if q != r]
        view = self.m.mem.view
        if role == 0:                                                            # sender
            for j in range(steps):
                mask = [q for q in peers if j < self.steps_of(lens[q], step)]
                if j >= depth:
                    yield self.waits(r, self.CREDIT0, sl, j - depth, mask)
                for q in mask:
                    src = ((q * chunk) if two else q * stride) + lo + j * step
                    ptr, key = self.entry(0, q, r, sl, j)
                    self.fill(key, r, j)
                    self.m._copy(ptr, x + src * isz, self.step_len(lens[q], step, j) * isz)
                self.release(r, self.READY0, sl, j, mask)
        elif role == 1:                                                          # reducer
            own = ((r * chunk) if two else r * stride) + lo
            my_out = out + (((r * chunk) if two else 0) + lo) * isz
            for j in range(self.steps_of(lens[r], step)):
                yield self.waits(r, self.READY0, sl, j, peers)
                if two and j >= depth:
                    yield self.waits(r, self.CREDIT1, sl, j - depth, peers)
                k = self.step_len(lens[r], step, j)
                parts = []
                for p in range(n):
                    if p == r:
                        parts.append(view(x + (own + j * step) * isz, k, dtype).astype(_acc(dtype)))
                    else:
                        ptr, key = self.entry(0, r, p, sl, j)
                        self.take(key, p, j)
                        parts.append(view(ptr, k, dtype).astype(_acc(dtype)))
                        self.ring[key] = None
                acc = parts[0]
                for part in parts[1:]:
                    acc = self.fn(acc, part)
                res = acc.astype(dtype)
                view(my_out + j * step * isz, k, dtype)[...] = res
                if two:
                    for q in peers:
                        ptr, key = self.entry(1, q, r, sl, j)
                        self.fill(key, r, j)
                        view(ptr, k, dtype)[...] = res
                self.release(r, self.CREDIT0, sl, j, peers)
                if two:
                    self.release(r, self.READY1, sl, j, peers)
        else:                                                                    # receiver (allreduce)
            for j in range(steps):
                mask = [p for p in peers if j < self.steps_of(lens[p], step)]
                yield self.waits(r, self.READY1, sl, j, mask)
                for p in mask:
                    ptr, key = self.entry(1, r, p, sl, j)
                    self.take(key, p, j)
                    self.m._copy(out + (p * chunk + lo + j * step) * isz, ptr, self.step_len(lens[p], step, j) * isz)
                    self.ring[key] = None
                self.release(r, self.CREDIT1, sl, j, mask)

    # --- the schedule -------------------------------------------------------------------------------------
    def run(self, rng) -> None:
        pending = []  # (actor, wait condition)
        for a in self.actors:
            pending.append((a, lambda: True))
        while pending:
            ready = [i for i, (_, cond) in enumerate(pending) if cond()]
            assert ready, f"{len(pending)} blocks wait forever (a pipelined round deadlocks)"
            i = ready[int(rng.integers(len(ready)))]
            actor, _ = pending.pop(i)
            try:
                pending.append((actor, next(actor)))
            except StopIteration:
                pass
        assert all(v is None for v in self.ring.values()), "ring entries left unread at the end of the round"


class RingRound(PipeRound):
    """One ring launch on every rank (kernels/comm/collectives.cu, "ring rounds"): an actor per (rank,
    block) runs its pieces' stages as a generator that yields what it waits for (the previous rank's
    ready flag, the next rank's credit); the schedule and the ring-entry checks are PipeRound's."""

    def __init__(self, model: "Model", name: str, grid: int, e: int, half: int, tails):
        self.m, self.n, self.e, self.half = model, model.n, e, half
        self.flags = [dict() for _ in range(self.n)]
        self.ring = {}
        self.actors = []
        n = self.n
        if name == "fluxrt_allgather_ring":  # bytes, copies only
            kind, self.dtype, self.fn = "allgather_ring", np.dtype(np.uint8), None
        else:
            kind, dt, red = name[len("fluxrt_"):].rsplit("_", 2)
            self.dtype = _MODEL_DTYPES[dt]
            self.fn = _MODEL_FNS[red]
        geometry = {tuple(int(v) for v in t[-3:]) for t in tails}  # (step, depth, substeps)
        assert len(geometry) == 1, f"ranks disagree on the ring geometry: {geometry}"
        for r, t in enumerate(tails):
            if kind == "allreduce_ring":
                x, out, count, chunk, step, depth, sub = (int(v) for v in t)
                x_stride, out_stride, first, last = chunk, chunk, 0, 2 * n - 2
            elif kind == "allgather_ring":
                x, out, chunk, step, depth, sub = (int(v) for v in t)
                count, x_stride, out_stride, first, last = n * chunk, 0, chunk, n - 1, 2 * n - 2
            else:
                x, out, chunk, step, depth, sub = (int(v) for v in t)
                count, x_stride, out_stride, first, last = n * chunk, chunk, 0, 0, n - 1
            self.step, self.depth, self.sub = step * self.dtype.itemsize, depth, sub
            for b in range(grid):
                self.actors.append(self._stages(r, b, grid, x, x_stride, out, out_stride, count, chunk, step,
                                                first, last))
        assert self.sub >= 1 and self.depth >= 2 * self.sub and self.step % plan.VEC_BYTES == 0
        assert grid * self.depth * self.step <= WORKSPACE // 2, "the rings overflow the workspace half"

    def entry(self, owner: int, sl: int, u: int):
        """(model pointer, state key) of entry u of slice sl's ring in owner's workspace."""
        off = self.half + (sl * self.depth + u % self.depth) * self.step
        return self.m.ws[owner] + off, (owner, sl, u % self.depth)

    def _stages(self, r, b, grid, x, x_stride, out, out_stride, count, chunk, step, first, last):
        n, depth, isz, dtype = self.n, self.depth, self.dtype.itemsize, self.dtype
        nxt, prv = (r + 1) % n, (r - 1) % n
        lo, hi = self.srange(chunk, plan.PIPE_LINE_BYTES // isz, b, grid)
        view = self.m.mem.view
        sub = self.sub
        for m in range(self.steps_of(hi - lo, step * sub)):
            for s, i in ((s, i) for s in range(first, last + 1) for i in range(sub)):
                at = lo + (m * sub + i) * step
                c = (r + 2 * n - 1 - s) % n
                end = min(hi, max(0, count - c * chunk))
                k = min(end - at, step) if at < end else 0
                recv, send = s > first, s < last
                us = (m * (last - first) + s - first) * sub + i
                ur = us - sub
                if recv:
                    yield self.waits(r, self.READY0, b, ur, [prv])
                if send and us >= depth:
                    yield self.waits(r, self.CREDIT0, b, us - depth, [nxt])
                parts = []
                if recv:
                    ptr, got = self.entry(r, b, ur)
                    self.take(got, prv, ur)
                    parts.append(view(ptr, k, dtype))
                if s <= n - 1:
                    parts.append(view(x + (c * x_stride + at) * isz, k, dtype))
                if len(parts) == 1:  # one source: copied as bits
                    res = parts[0].copy()
                else:
                    acc = parts[0].astype(_acc(dtype))
                    for part in parts[1:]:
                        acc = self.fn(acc, part.astype(_acc(dtype)))
                    res = acc.astype(dtype)
                if send:
                    ptr, key = self.entry(nxt, b, us)
                    self.fill(key, r, us)
                    view(ptr, k, dtype)[...] = res
                if s >= n - 1:
                    view(out + (c * out_stride + at) * isz, k, dtype)[...] = res
                if recv:
                    self.ring[got] = None
                    self.release(r, self.CREDIT0, b, ur, [prv])
                if send:
                    self.release(r, self.READY0, b, us, [nxt])


def _ring_reference(inputs, redop, chunk, dtype):
    """Chunk c as the ring reduces it: x[c+1] op x[c+2] op ... op x[c], rounded to the dtype at each hop."""
    fn = _MODEL_FNS[redop]
    n, count = len(inputs), inputs[0].size
    out = np.empty(count, dtype)
    for c in range(n):
        lo, hi = min(count, c * chunk), min(count, (c + 1) * chunk)
        acc = inputs[(c + 1) % n][lo:hi]
        for k in range(2, n + 1):
            acc = fn(acc.astype(_acc(dtype)), inputs[(c + k) % n][lo:hi].astype(_acc(dtype))).astype(dtype)
        out[lo:hi] = acc
    return out


def _inputs(n, count, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(n)]
    return [rng.uniform(-1, 1, count).astype(dtype) for _ in range(n)]


def _reference(inputs, redop):
    fn = _MODEL_FNS[redop]
    dtype = inputs[0].dtype
    acc = inputs[0].astype(_acc(dtype))
    for a in inputs[1:]:
        acc = fn(acc, a.astype(_acc(dtype)))
    return acc


# ---------------------------------------------------------------------------------------------- tests
@pytest.fixture(autouse=True)
def _fake_arrays(monkeypatch):
    real = coll._as_array
    monkeypatch.setattr(coll, "_as_array", lambda x, name, op, world, stream, writable=False:
                        x if isinstance(x, FakeArray) else real(x, name, op, world, stream, writable))
    monkeypatch.setattr(coll, "as_cupy_stream", lambda stream: stream)   # no CUDA streams on a CPU node


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", ["ll", "ll12", "ll12_twoshot", "oneshot", "twoshot", "pipe", "ring"])
@pytest.mark.parametrize("dtype, redop", [(bfloat16, "sum"), (np.float16, "max"), (np.float32, "min")])
@pytest.mark.parametrize("count", [1, 13, 1023, 4099, 40_000])  # 40 000: several launches
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_model(n, algo, dtype, redop, count, in_place):
    m = Model(n)
    ins = _inputs(n, count, dtype, count + n)
    xs = [m.array(r, count, dtype, ins[r]) for r in range(n)]
    outs = xs if in_place else [m.array(r, count, dtype) for r in range(n)]
    m.call("allreduce", [(xs[r], outs[r]) for r in range(n)], op=redop, algo=algo)
    if algo == "ring":
        vec = plan.VEC_BYTES // np.dtype(dtype).itemsize
        want = _ring_reference(ins, redop, -(-(-(-count // n)) // vec) * vec, dtype)
    else:
        want = _reference(ins, redop).astype(dtype)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", ["auto", "ll", "ll12", "oneshot", "twoshot", "pipe", "ring"])
@pytest.mark.parametrize("dtype, redop", [(np.float64, "sum"), (np.float64, "avg"), (np.float32, "prod"),
                                          (bfloat16, "avg"), (np.int32, "sum"), (np.int32, "prod"),
                                          (np.int64, "max"), (np.uint8, "sum"), (np.uint8, "min")])
@pytest.mark.parametrize("count", [1, 13, 4099, 40_000])
def test_allreduce_model_more_types(n, algo, dtype, redop, count):
    """fp64 and integer reductions, prod and avg: fp64 sums in fp64, integers wrap, avg divides the sum; ll12
    is refused for 8-byte elements (and 'auto' never picks it for them)."""
    m = Model(n)
    ins = _inputs(n, count, dtype, count + n)
    if np.dtype(dtype).kind in "iu" and redop == "prod":
        ins = [np.where(np.arange(count) % 3 == 0, a, a % 7).astype(dtype) for a in ins]  # some wrap, some not
    xs = [m.array(r, count, dtype, ins[r]) for r in range(n)]
    outs = [m.array(r, count, dtype) for r in range(n)]
    if algo == "ll12" and np.dtype(dtype).itemsize == 8:
        with pytest.raises(ValueError, match="12-byte line"):
            m.call("allreduce", [(xs[r], outs[r]) for r in range(n)], op=redop, algo=algo)
        return
    m.call("allreduce", [(xs[r], outs[r]) for r in range(n)], op=redop, algo=algo)
    kernel_op = "sum" if redop == "avg" else redop
    if algo == "ring":
        vec = plan.VEC_BYTES // np.dtype(dtype).itemsize
        want = _ring_reference(ins, kernel_op, -(-(-(-count // n)) // vec) * vec, dtype)
    else:
        with np.errstate(over="ignore"):
            want = _reference(ins, kernel_op).astype(dtype)
    if redop == "avg":
        want = (want.astype(_acc(dtype)) / _acc(dtype).type(n)).astype(dtype)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want)
    if np.dtype(dtype) == np.float64 and redop == "sum" and count > 1:  # close to the exact sum too
        np.testing.assert_allclose(outs[0].get(), np.sum(ins, axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("chunk", [1, 1023, 9000])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("algo", ["auto", "ll", "pipe", "ring"])
def test_reduce_scatter_model(n, chunk, in_place, algo):
    m = Model(n)
    ins = _inputs(n, n * chunk, np.float32, chunk)
    xs = [m.array(r, n * chunk, np.float32, ins[r]) for r in range(n)]
    outs = [xs[r][r * chunk:(r + 1) * chunk] if in_place else m.array(r, chunk, np.float32) for r in range(n)]
    m.call("reduce_scatter", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    want = _ring_reference(ins, "sum", chunk, np.float32) if algo == "ring" else _reference(ins, "sum")
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want[r * chunk:(r + 1) * chunk])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [1, 1023, 20_001])
@pytest.mark.parametrize("layout", ["plain", "in_place", "direct", "direct_in_place", "ll", "ll_in_place", "pipe",
                                    "pipe_in_place", "ring", "ring_in_place", "ring_direct", "pairwise",
                                    "pairwise_in_place"])
def test_allgather_model(n, count, layout):
    m = Model(n)
    ins = _inputs(n, count, np.int32, count)
    outs = m.symmetric(n * count, np.int32) if "direct" in layout else \
        [m.array(r, n * count, np.int32) for r in range(n)]
    if layout.endswith("in_place"):
        xs = [outs[r][r * count:(r + 1) * count] for r in range(n)]
        for r in range(n):
            xs[r].get()[...] = ins[r]
    else:
        xs = [m.array(r, count, np.int32, ins[r]) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll", "pipe", "ring", "pairwise")) else "auto"
    m.call("allgather", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), np.concatenate(ins))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 777, 9001])
@pytest.mark.parametrize("layout", ["plain", "in_place", "direct", "ll", "ll_in_place", "pipe", "pipe_in_place",
                                    "pairwise"])
def test_alltoall_model(n, chunk, layout):
    m = Model(n)
    ins = _inputs(n, n * chunk, bfloat16, chunk)
    xs = [m.array(r, n * chunk, bfloat16, ins[r]) for r in range(n)]
    outs = xs if layout.endswith("in_place") else m.symmetric(n * chunk, bfloat16) if layout == "direct" else \
        [m.array(r, n * chunk, bfloat16) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll", "pipe", "pairwise")) else "auto"
    m.call("alltoall", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    for r in range(n):
        want = np.concatenate([ins[p][r * chunk:(r + 1) * chunk] for p in range(n)])
        np.testing.assert_array_equal(outs[r].get().astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("count", [1, 40_001])
@pytest.mark.parametrize("layout", ["in_place", "plain", "direct", "ll", "ll_in_place", "pipe", "pipe_in_place"])
def test_broadcast_model(n, count, layout):
    m = Model(n)
    root = n - 1
    ins = _inputs(n, count, np.int32, count)
    xs = [m.array(r, count, np.int32, ins[r]) for r in range(n)]
    outs = xs if layout.endswith("in_place") else m.symmetric(count, np.int32) if layout == "direct" else \
        [m.array(r, count, np.int32) for r in range(n)]
    args = [(xs[r],) if layout.endswith("in_place") else (xs[r], outs[r]) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll", "pipe")) else "auto"
    m.call("broadcast", args, root=root, algo=algo)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), ins[root])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("scale, trusted, algo", [(5, False, "auto"), (30_000, False, "auto"), (30_000, True, "auto"),
                                                 (3_000, True, "ll"), (3_000, False, "ll"), (5, False, "pipe"),
                                                 (30_000, True, "pipe")])
def test_alltoallv_model(n, scale, trusted, algo):
    rng = np.random.default_rng(scale + n)
    matrix = rng.integers(0, scale, (n, n))
    matrix[rng.random((n, n)) < 0.3] = 0
    m = Model(n)
    ins = [_inputs(1, int(matrix[r].sum()) + 3 * n, np.int32, r)[0] for r in range(n)]
    sd = [np.concatenate(([0], np.cumsum(matrix[r] + 3)[:-1])) for r in range(n)]   # gaps of 3
    rd = [np.concatenate(([0], np.cumsum(matrix[:, r] + 1)[:-1])) for r in range(n)]  # gaps of 1
    xs = [m.array(r, ins[r].size, np.int32, ins[r]) for r in range(n)]
    outs = [m.array(r, int(matrix[:, r].sum()) + n, np.int32) for r in range(n)]
    kw = {"max_count": int(matrix.max())} if trusted else {}
    args = [(xs[r], matrix[r], matrix[:, r] if trusted else None, outs[r]) for r in range(n)]
    # displacements differ per rank: call through a per-rank closure
    plans = []
    for r in range(n):
        plans.append(dict(send_displs=sd[r], recv_displs=rd[r], algo=algo, **kw))
    _call_per_rank(m, "alltoallv", args, plans)
    for r in range(n):
        got = outs[r].get()
        for p in range(n):
            want = ins[p][sd[p][r]:sd[p][r] + matrix[p][r]]
            np.testing.assert_array_equal(got[rd[r][p]:rd[r][p] + matrix[p][r]], want)


def _call_per_rank(m: Model, method: str, args, kwargs) -> None:
    original = {r: getattr(m.ctx[r], method) for r in range(m.n)}
    for r in range(m.n):
        setattr(m.ctx[r], method, lambda *a, r=r: original[r](*a, **kwargs[r]))
    m.call(method, args)


def test_model_rejects_disagreeing_alltoallv_counts():
    m = Model(2)
    xs = [m.array(r, 8, np.int32, np.arange(8)) for r in range(2)]
    outs = [m.array(r, 8, np.int32) for r in range(2)]
    with pytest.raises(CollectiveMismatchError, match="rank 0 sends 4 to rank 0, which expects 3"):
        m.call("alltoallv", [(xs[0], [4, 4], [3, 4], outs[0]), (xs[1], [4, 4], [4, 4], outs[1])])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_pipe_rounds_under_many_schedules(n, seed):
    """The same pipelined calls under different random schedules of the blocks: an in-place alltoall (its
    receivers must not overwrite what this rank's senders still push), an allreduce with a short last
    chunk, and rounds back to back on one context."""
    m = Model(n)
    m.seed = 1000 * seed
    chunk = 4001 + seed
    ins = _inputs(n, n * chunk, np.int32, seed)
    xs = [m.array(r, n * chunk, np.int32, ins[r]) for r in range(n)]
    m.call("alltoall", [(xs[r], xs[r]) for r in range(n)], algo="pipe")
    for r in range(n):
        want = np.concatenate([ins[p][r * chunk:(r + 1) * chunk] for p in range(n)])
        np.testing.assert_array_equal(xs[r].get(), want)
    count = n * 2999 + 1
    fins = _inputs(n, count, np.float32, seed + 7)
    fx = [m.array(r, count, np.float32, fins[r]) for r in range(n)]
    outs = [m.array(r, count, np.float32) for r in range(n)]
    for _ in range(2):
        m.call("allreduce", [(fx[r], outs[r]) for r in range(n)], algo="pipe")
        for r in range(n):
            np.testing.assert_array_equal(outs[r].get(), _reference(fins, "sum"))
    for _ in range(2):  # the ring, in place: a rank overwrites x[c] only after its own stage read it
        ring = [m.array(r, count, np.float32, fins[r]) for r in range(n)]
        m.call("allreduce", [(ring[r], ring[r]) for r in range(n)], algo="ring")
        want = _ring_reference(fins, "sum", -(-(-(-count // n)) // 4) * 4, np.float32)
        for r in range(n):
            np.testing.assert_array_equal(ring[r].get(), want)


def _alltoall(seed, n, algo):
    m = Model(n)
    m.seed = seed
    xs = [m.array(r, n * 9001, np.int32, np.arange(n * 9001)) for r in range(n)]
    outs = [m.array(r, n * 9001, np.int32) for r in range(n)]
    m.call("alltoall", [(xs[r], outs[r]) for r in range(n)], algo=algo)


def _pipelined_alltoall(seed):
    _alltoall(seed, 2, "pipe")


def _pairwise_alltoall(seed):
    _alltoall(seed, 3, "pairwise")


def _ring_allreduce_in_place(seed):
    m = Model(3)
    m.seed = seed
    ins = _inputs(3, 40_000, np.float32, seed)
    xs = [m.array(r, 40_000, np.float32, ins[r]) for r in range(3)]
    m.call("allreduce", [(xs[r], xs[r]) for r in range(3)], algo="ring")


@pytest.mark.parametrize("call", [_pipelined_alltoall, _pairwise_alltoall, _ring_allreduce_in_place])
def test_model_catches_a_ring_overrun(call):
    """The model's own check, for the pipelined and the ring rounds: with the credit wait removed, some
    schedule refills a ring entry the receiver has not read."""
    original = PipeRound.waits

    def no_credit(self, r, phase, sl, j, peers):
        return (lambda: True) if phase == self.CREDIT0 else original(self, r, phase, sl, j, peers)

    PipeRound.waits = no_credit
    try:
        with pytest.raises(AssertionError, match="overwritten before it was read|holds"):
            for seed in range(20):
                call(seed)
    finally:
        PipeRound.waits = original


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("depth, substeps, one_step", [(2, 1, 0), (3, 1, 0), (5, 2, 0), (6, 3, 0), (4, 2, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_ring_geometries_under_many_schedules(n, depth, substeps, one_step, seed):
    """Ring depths and steps per stage other than the defaults (a depth that is no multiple of the steps
    per stage included), and one step per stage where a slice fits an entry (one_step: the geometry's
    own depth), allreduce out of place, reduce_scatter in place and allgather (odd byte chunks), under
    random schedules."""
    import dataclasses

    m = Model(n)
    m.seed = 100 * seed + depth
    for c in m.ctx:
        c.tuning = dataclasses.replace(TUNING, ring_depth=depth, ring_substeps=substeps,
                                       ring_one_step_max_grid=one_step)
    count = n * 3001 + seed
    chunk = -(-(-(-count // n)) // 4) * 4
    geometry = plan.ring_geometry(m.ctx[0]._half("ring"), n, chunk * 4, m.ctx[0].tuning)
    assert geometry.substeps == (1 if one_step else substeps)
    ins = _inputs(n, count, np.float32, seed)
    xs = [m.array(r, count, np.float32, ins[r]) for r in range(n)]
    outs = [m.array(r, count, np.float32) for r in range(n)]
    m.call("allreduce", [(xs[r], outs[r]) for r in range(n)], algo="ring")
    want = _ring_reference(ins, "sum", chunk, np.float32)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want)
    chunk = 2999
    rs_in = _inputs(n, n * chunk, np.float32, seed + 1)
    rx = [m.array(r, n * chunk, np.float32, rs_in[r]) for r in range(n)]
    m.call("reduce_scatter", [(rx[r], rx[r][r * chunk:(r + 1) * chunk]) for r in range(n)], algo="ring")
    want = _ring_reference(rs_in, "sum", chunk, np.float32)
    for r in range(n):
        np.testing.assert_array_equal(rx[r].get()[r * chunk:(r + 1) * chunk], want[r * chunk:(r + 1) * chunk])
    ag_in = _inputs(n, 3003, np.float16, seed + 2)
    gx = [m.array(r, 3003, np.float16, ag_in[r]) for r in range(n)]
    gout = [m.array(r, n * 3003, np.float16) for r in range(n)]
    m.call("allgather", [(gx[r], gout[r]) for r in range(n)], algo="ring")
    for r in range(n):
        np.testing.assert_array_equal(gout[r].get(), np.concatenate(ag_in))
