"""The collectives' host side (validation, planning, launch arguments, exchange tables) driving a numpy
model of kernels/comm/collectives.cu, on every rank of a simulated world (threads stand in for MPI ranks).

The model mirrors each kernel's stages (block slices, workspace slots and halves, direct pushes, LL lines
with their flags in the LL buffer); it checks
that the arguments the host builds move every element to the right place, for odd sizes, several launches
per message, in-place layouts and symmetric outputs. The kernels' memory ordering is the GPU suite's job.
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
TUNING = plan.Tuning(ll_max_bytes=2048)  # a small LL buffer too: forced LL rounds come in several launches


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
        self.comm = ThreadComm(n)
        self.heap = object()
        self.ws = [self.mem.alloc(r, WORKSPACE) for r in range(n)]
        self.ll_bytes = TUNING.ll_buffer_bytes(n)
        self.ll = [self.mem.alloc(r, self.ll_bytes) for r in range(n)]
        self.epoch = [0] * n
        self.ctx = []
        for r in range(n):
            world = SimpleNamespace(size=n, rank=r, device_id=0, heap=self.heap,
                                    options=SimpleNamespace(check_collective_args=check),
                                    comm=SimpleNamespace(allgather=lambda v, r=r: self.comm.allgather(r, v)))
            c = object.__new__(coll.Collectives)
            c.world, c.half_bytes, c._fast = world, WORKSPACE // 2, {}
            c.tuning, c.ll_half_bytes = TUNING, self.ll_bytes // 2
            c._kernels = {}
            c._launch = lambda name, grid, args: SimpleNamespace(kernel=Kernel(name), grid=grid, args=args)
            c._teams = {name: ("team", r) for name in plan.ALGOS}
            c._output = lambda out, name, dtype, count, shape, r=r: (
                out if out is not None else self.array(r, count, dtype))
            self.ctx.append(c)

    def array(self, rank: int, count: int, dtype, values=None) -> FakeArray:
        a = FakeArray(self.mem, self.mem.alloc(rank, count * np.dtype(dtype).itemsize), count, dtype)
        a.get()[...] = (-7 if np.dtype(dtype).kind in "iu" else np.nan) if values is None else values
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
        grids = {launch.grid for launch in launch_per_rank}
        assert len(names) == 1 and len(grids) == 1, f"ranks launch different kernels: {names} {grids}"
        name, grid = names.pop(), grids.pop()
        assert 1 <= grid <= plan.MAX_BLOCKS
        es = {self.epoch[r] + 1 for r in range(self.n)}
        assert len(es) == 1
        e = es.pop()
        self.epoch = [e] * self.n
        half = (e & 1) * (WORKSPACE // 2)
        tails = [launch.args[2:] for launch in launch_per_rank]
        if "_ll" in name:
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
        dtype = {"bf16": bfloat16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}[dt]
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[red]
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
                    parts.append(self.mem.view(x + r * stride * isz, count, dtype).astype(np.float32))
                else:
                    tmp = self.mem.alloc(r, count * isz + 16)
                    self._ll_take(r, p, half, slot, tmp, count * isz, flag)
                    parts.append(self.mem.view(tmp, count, dtype).astype(np.float32))
            acc = parts[0]
            for part in parts[1:]:
                acc = fn(acc, part)
            staged.append(acc)
        for (x, stride, out, count), acc in zip(srcs, staged):
            self.mem.view(out, count, dtype)[...] = acc.astype(dtype)

    def _reduction(self, kind, dt, red, grid, half, tails) -> None:
        n = self.n
        dtype = {"bf16": bfloat16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}[dt]
        isz = dtype.itemsize
        vec = plan.VEC_BYTES // isz
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[red]
        slot = int(tails[0][-1])
        view = self.mem.view

        def reduce_into(r, dst, base, lo, hi):
            acc = view(self.ws[r] + base, hi, dtype)[lo:hi].astype(np.float32)
            for p in range(1, n):
                acc = fn(acc, view(self.ws[r] + base + p * slot, hi, dtype)[lo:hi].astype(np.float32))
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


def _inputs(n, count, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(n)]
    return [rng.uniform(-1, 1, count).astype(dtype) for _ in range(n)]


def _reference(inputs, redop):
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[redop]
    acc = inputs[0].astype(np.float32)
    for a in inputs[1:]:
        acc = fn(acc, a.astype(np.float32))
    return acc


# ---------------------------------------------------------------------------------------------- tests
@pytest.fixture(autouse=True)
def _fake_arrays(monkeypatch):
    real = coll._as_array
    monkeypatch.setattr(coll, "_as_array", lambda x, name, dev: x if isinstance(x, FakeArray) else real(x, name, dev))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", ["ll", "oneshot", "twoshot"])
@pytest.mark.parametrize("dtype, redop", [(bfloat16, "sum"), (np.float16, "max"), (np.float32, "min")])
@pytest.mark.parametrize("count", [1, 13, 1023, 4099, 40_000])  # 40 000: several launches
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_model(n, algo, dtype, redop, count, in_place):
    m = Model(n)
    ins = _inputs(n, count, dtype, count + n)
    xs = [m.array(r, count, dtype, ins[r]) for r in range(n)]
    outs = xs if in_place else [m.array(r, count, dtype) for r in range(n)]
    m.call("allreduce", [(xs[r], outs[r]) for r in range(n)], op=redop, algo=algo)
    want = _reference(ins, redop).astype(dtype)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("chunk", [1, 1023, 9000])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("algo", ["auto", "ll"])
def test_reduce_scatter_model(n, chunk, in_place, algo):
    m = Model(n)
    ins = _inputs(n, n * chunk, np.float32, chunk)
    xs = [m.array(r, n * chunk, np.float32, ins[r]) for r in range(n)]
    outs = [xs[r][r * chunk:(r + 1) * chunk] if in_place else m.array(r, chunk, np.float32) for r in range(n)]
    m.call("reduce_scatter", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    want = _reference(ins, "sum")
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), want[r * chunk:(r + 1) * chunk])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [1, 1023, 20_001])
@pytest.mark.parametrize("layout", ["plain", "in_place", "direct", "direct_in_place", "ll", "ll_in_place"])
def test_allgather_model(n, count, layout):
    m = Model(n)
    ins = _inputs(n, count, np.int32, count)
    outs = m.symmetric(n * count, np.int32) if layout.startswith("direct") else \
        [m.array(r, n * count, np.int32) for r in range(n)]
    if layout.endswith("in_place"):
        xs = [outs[r][r * count:(r + 1) * count] for r in range(n)]
        for r in range(n):
            xs[r].get()[...] = ins[r]
    else:
        xs = [m.array(r, count, np.int32, ins[r]) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll")) else "auto"
    m.call("allgather", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), np.concatenate(ins))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 777, 9001])
@pytest.mark.parametrize("layout", ["plain", "in_place", "direct", "ll", "ll_in_place"])
def test_alltoall_model(n, chunk, layout):
    m = Model(n)
    ins = _inputs(n, n * chunk, bfloat16, chunk)
    xs = [m.array(r, n * chunk, bfloat16, ins[r]) for r in range(n)]
    outs = xs if layout.endswith("in_place") else m.symmetric(n * chunk, bfloat16) if layout == "direct" else \
        [m.array(r, n * chunk, bfloat16) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll")) else "auto"
    m.call("alltoall", [(xs[r], outs[r]) for r in range(n)], algo=algo)
    for r in range(n):
        want = np.concatenate([ins[p][r * chunk:(r + 1) * chunk] for p in range(n)])
        np.testing.assert_array_equal(outs[r].get().astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("count", [1, 40_001])
@pytest.mark.parametrize("layout", ["in_place", "plain", "direct", "ll", "ll_in_place"])
def test_broadcast_model(n, count, layout):
    m = Model(n)
    root = n - 1
    ins = _inputs(n, count, np.int32, count)
    xs = [m.array(r, count, np.int32, ins[r]) for r in range(n)]
    outs = xs if layout.endswith("in_place") else m.symmetric(count, np.int32) if layout == "direct" else \
        [m.array(r, count, np.int32) for r in range(n)]
    args = [(xs[r],) if layout.endswith("in_place") else (xs[r], outs[r]) for r in range(n)]
    algo = layout.split("_")[0] if layout.startswith(("direct", "ll")) else "auto"
    m.call("broadcast", args, root=root, algo=algo)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].get(), ins[root])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("scale, trusted, algo", [(5, False, "auto"), (30_000, False, "auto"), (30_000, True, "auto"),
                                                 (3_000, True, "ll"), (3_000, False, "ll")])
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
