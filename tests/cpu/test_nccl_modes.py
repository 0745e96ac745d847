"""CPU tests of the NCCL baseline's two modes (ordinary buffers "nccl", registered symmetric windows
"nccl-win"): the binding choice and what it says when a mode cannot run, the runners' calls into the
binding, the table's ratio against the faster mode, the JSON's ratio records, the CLI's --impls and the
performance doc's columns. Timings come from a fake source; no GPU, no libnccl."""
from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fluxrt.perf import collectives as bench
from fluxrt.perf import nccl_lib
from fluxrt.perf.report import Row, Table, results_document, version_line

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("fluxrt", nccl_lib.PLAIN, nccl_lib.WINDOW)


def _row(nbytes, impl, t, inplace=False):
    return Row.measured(nbytes=nbytes, count=nbytes // 2, dtype="bf16", redop="sum", impl=impl,
                        algo="ll" if impl == "fluxrt" else "", time_us=t, busbw_factor=1.0, wrong=0,
                        inplace=inplace, stats={"min": t, "avg": t, "max": t})


# fake timings: (fluxrt, nccl, nccl-win) in microseconds per size
TIMES = {8: (4.0, 12.0, 6.0), 1 << 20: (20.0, 30.0, 40.0), 1 << 30: (5000.0, 5100.0, None)}


def _table(out):
    t = Table(IMPLS, out=out, show_algo=True, ratios=bench.ratio_groups(IMPLS))
    t.header()
    for nbytes, times in TIMES.items():
        t.add([_row(nbytes, impl, v) for impl, v in zip(IMPLS, times) if v is not None])
    t.footer()
    return t


def test_the_ratio_is_against_the_faster_nccl_mode():
    out = io.StringIO()
    t = _table(out)
    lines = out.getvalue().splitlines()
    names = next(ln for ln in lines if "size" in ln and "busbw" in ln)
    group = lines[lines.index(names) - 1]
    assert group.index("fluxrt") < group.index("nccl ") < group.index("nccl-win")   # both NCCL blocks shown
    assert names.split().count("time") == 3 and names.split().count("ratio") == 1
    assert "(nccl or nccl-win time (the faster) / fluxrt time)" not in out.getvalue()
    assert "nccl = nccl or nccl-win time (the faster) / fluxrt time" in out.getvalue()
    data = [ln.split() for ln in lines if not ln.startswith("#")]
    assert [d[-1] for d in data] == ["1.50", "1.50", "1.02"]   # 6/4 (window faster), 30/20 (plain), 5100/5000
    assert data[2].count("N/A") == 5                          # no window row at 1 GiB: its block is N/A
    entries = t.ratio_entries()
    assert [(e["bytes"], e["against"], round(e["ratio_value"], 2)) for e in entries] == [
        (8, "nccl-win", 1.5), (1 << 20, "nccl", 1.5), (1 << 30, "nccl", 1.02)]
    footer = [ln for ln in lines if ln.startswith("# Geomean")]
    assert len(footer) == 1 and "nccl or nccl-win (the faster)/fluxrt" in footer[0]
    gm = (1.5 * 1.5 * 1.02) ** (1 / 3)
    assert footer[0].endswith(f"{gm:.3f}")


def test_ratio_groups_follow_the_modes_run():
    assert bench.ratio_groups(IMPLS) == {"nccl": ("nccl", "nccl-win")}
    assert bench.ratio_groups(("fluxrt", "nccl")) == {"nccl": ("nccl",)}
    assert bench.ratio_groups(("fluxrt",)) == {}
    with pytest.raises(ValueError, match="must name baselines"):
        Table(IMPLS, out=io.StringIO(), ratios={"x": ("fluxrt",)})


def test_json_keeps_both_modes_and_the_ratio_records(tmp_path):
    t = _table(io.StringIO())
    doc = results_document("allreduce", [dict(vars(r), op="allreduce") for r in t.rows], "fluxrt-perf allreduce",
                           versions={"nccl": "2.28.9", "nccl_binding": "nccl4py 0.6.0"},
                           ratios=t.ratio_entries())
    doc = json.loads(json.dumps(doc))
    assert {r["impl"] for r in doc["rows"]} == set(IMPLS)
    assert doc["ratios"][0] == {"bytes": 8, "dtype": "bf16", "redop": "sum", "root": -1, "inplace": False,
                                "ratio": "nccl", "against": "nccl-win", "ratio_value": 1.5}
    assert "ratios" not in results_document("x", [], "c")   # documents without a table keep their shape
    line = version_line({"fluxrt": "0.1", "nccl": "2.28.9", "nccl_binding": "nccl4py 0.6.0"})
    assert "NCCL 2.28.9 (nccl4py 0.6.0)" in line


# ------------------------------------------------------------------------------------------------ bindings
class _FakeLib:
    """A binding that records its calls (window-capable unless told otherwise)."""

    name, binding_version = "fake", "1.0"

    def __init__(self, windows=True):
        self.windows, self.calls = windows, []

    def version_code(self):
        return 22809

    def unique_id(self):
        return b"uid"

    def init(self, n, uid, rank):
        self.calls.append(("init", n, uid, rank))
        return "comm"

    def destroy(self, comm):
        self.calls.append(("destroy", comm))

    def __getattr__(self, name):   # the collectives, send/recv, groups
        return lambda *a: self.calls.append((name, *a))


class _World:
    def __init__(self, rank=0, size=2):
        self.rank, self.size = rank, size
        self.comm = SimpleNamespace(bcast=lambda v, root=0: v, allgather=lambda v: [v] * size)


def test_choose_takes_the_first_binding_that_loads_and_says_why_windows_are_absent():
    class Broken:
        name = "nccl4py"

        def __init__(self):
            raise ImportError("No module named 'nccl'")

    class NoWindows(_FakeLib):
        name = "cupy.cuda.nccl"

        def __init__(self):
            super().__init__(windows=False)

    lib, notes = nccl_lib.choose((Broken, NoWindows))
    assert lib.name == "cupy.cuda.nccl" and len(notes) == 1
    assert "nccl-win" in notes[0] and "No module named 'nccl'" in notes[0] and "pip install nccl4py" in notes[0]
    lib, notes = nccl_lib.choose((_FakeLib,))
    assert lib.windows and notes == []
    with pytest.raises(nccl_lib.NcclUnavailable, match="nccl4py: No module named"):
        nccl_lib.choose((Broken,))


def test_runners_for_the_modes_asked(monkeypatch):
    lib = _FakeLib()
    monkeypatch.setattr(nccl_lib, "choose", lambda: (lib, []))
    runners, notes, comm = bench.nccl_runners(_World(), "allreduce", "sum", ["nccl", "nccl-win"])
    assert [r.name for r in runners] == ["nccl", "nccl-win"] and notes == []
    assert runners[0].buffers(8, 8, np.float32) is None          # plain mode: the sweep's buffers
    assert lib.calls == [("init", 2, b"uid", 0)]                 # one communicator for both modes
    runners, _, _ = bench.nccl_runners(_World(), "allreduce", "sum", ["nccl-win"])
    assert [r.name for r in runners] == ["nccl-win"]
    nowin = _FakeLib(windows=False)
    monkeypatch.setattr(nccl_lib, "choose", lambda: (nowin, ["window mode not run: why"]))
    runners, notes, _ = bench.nccl_runners(_World(), "allreduce", "sum", ["nccl", "nccl-win"])
    assert [r.name for r in runners] == ["nccl"] and notes == ["window mode not run: why"]
    runners, notes, _ = bench.nccl_runners(_World(), "allreduce", "sum", ["nccl"])
    assert notes == []                                            # not asked for: nothing to explain

    def unavailable():
        raise nccl_lib.NcclUnavailable("no NCCL binding loads: x")

    monkeypatch.setattr(nccl_lib, "choose", unavailable)
    runners, notes, comm = bench.nccl_runners(_World(), "allreduce", "sum", ["nccl"])
    assert runners == [] and comm is None and "no NCCL binding loads" in notes[0]


def test_a_window_runner_registers_its_own_buffers_and_releases_them(monkeypatch):
    made, freed = [], []

    class FakeWindow:
        def __init__(self, comm, count, dtype):
            self.array = SimpleNamespace(size=count, data=SimpleNamespace(ptr=0x1000 * (len(made) + 1)))
            made.append((count, np.dtype(dtype)))

        def free(self):
            freed.append(self)

    monkeypatch.setattr(nccl_lib, "WindowBuffer", FakeWindow)
    comm = SimpleNamespace(lib=_FakeLib(), handle="comm", size=2)
    r = bench.NcclRunner(comm, "allgather", "sum", 0, window=True)
    x, out = r.buffers(4, 8, np.float16)
    assert made == [(4, np.float16), (8, np.float16)] and (x.size, out.size) == (4, 8)
    r.buffers(2, 4, np.float16)                       # the next dtype's: the old ones go first
    assert len(freed) == 2
    r.close()
    assert len(freed) == 4


def test_runner_calls_map_onto_the_binding():
    lib = _FakeLib()
    comm = SimpleNamespace(lib=lib, handle="h", size=2)
    arr = lambda p: SimpleNamespace(data=SimpleNamespace(ptr=p))  # noqa: E731
    case = SimpleNamespace(x=arr(0x100), out=arr(0x200), dtype=np.dtype("float16"), in_elems=8, out_elems=4,
                           chunk=4, redop="max", root=1)
    bench.NcclRunner(comm, "reduce_scatter", "sum", 0)(case, SimpleNamespace(ptr=7))
    assert lib.calls[-1] == ("reduce_scatter", "h", 0x100, 0x200, 4, 6, 2, 7)   # fp16 = 6, max = 2
    bench.NcclRunner(comm, "alltoall", "sum", 0)(case, SimpleNamespace(ptr=7))
    assert [c[0] for c in lib.calls[-6:]] == ["group_start", "send", "recv", "send", "recv", "group_end"]
    assert lib.calls[-3] == ("send", "h", 0x100 + 8, 4, 6, 1, 7)
    bench.NcclRunner(comm, "broadcast", "sum", 0)(case, SimpleNamespace(ptr=7))
    assert lib.calls[-1] == ("broadcast", "h", 0x100, 0x200, 8, 6, 1, 7)
    assert not bench.NcclRunner(comm, "alltoall", "sum", 0).inplace_ok()


def test_impls_flag():
    _, args, _, _ = bench.parse_options("allreduce", [])
    assert args.impl_list == ["fluxrt", "nccl", "nccl-win"]
    _, args, _, _ = bench.parse_options("allreduce", ["--impls", "fluxrt,nccl-win"])
    assert args.impl_list == ["fluxrt", "nccl-win"]
    for bad in ("nccl,fluxrt", "fluxrt,gloo", "fluxrt,nccl,nccl"):
        with pytest.raises(SystemExit):
            bench.parse_options("allreduce", ["--impls", bad])


def test_performance_doc_shows_both_modes_and_the_ratio_against_the_faster():
    spec = importlib.util.spec_from_file_location("make_performance_doc", ROOT / "perf" / "make_performance_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [dict(vars(r)) for r in _table(io.StringIO()).rows]
    lines = mod.sweep_table(rows)
    header = lines[0]
    assert "NCCL µs" in header and "NCCL window µs" in header and "faster NCCL time / fluxrt time" in header
    first = lines[2].split("|")
    assert "1.50x (window)" in lines[2] and "1.50x (plain)" in lines[3] and "1.02x (plain)" in lines[4]
    assert first[1].strip() == "8 B"


class _Dev:
    """A host array standing in for a device array: `.data.ptr` and `.size` as CuPy's."""

    registry: dict = {}

    def __init__(self, a):
        self.a = a
        self.size = a.size
        self.data = SimpleNamespace(ptr=id(self))
        _Dev.registry[id(self)] = self


class _OneRankNccl:
    """NCCL on one rank, with the bindings' method signatures: all-gather and reduce-scatter copy."""

    def __init__(self):
        self.calls = []

    def all_gather(self, comm, x, out, count, dt, s):
        self.calls.append(("all_gather", comm, count, dt, s))
        _Dev.registry[out].a.reshape(-1)[:count] = _Dev.registry[x].a.reshape(-1)

    def reduce_scatter(self, comm, x, out, count, dt, op, s):
        self.calls.append(("reduce_scatter", comm, count, dt, op, s))
        _Dev.registry[out].a.reshape(-1)[:] = _Dev.registry[x].a.reshape(-1)[:count]


def test_mlp_unfused_block_calls_the_binding_and_computes_the_block():
    import inspect

    from fluxrt.perf import mlp as mlp_bench

    for name in ("all_gather", "reduce_scatter"):   # the fake's calls are the bindings' own signatures
        fake = inspect.signature(getattr(_OneRankNccl, name))
        for binding in nccl_lib.BINDINGS:
            assert list(inspect.signature(getattr(binding, name)).parameters) == list(fake.parameters), binding
    rng = np.random.default_rng(5)
    m, hidden, ffn = 8, 16, 12
    x, w_gu, w_down = rng.standard_normal((m, hidden)), rng.standard_normal((hidden, 2 * ffn)), \
        rng.standard_normal((ffn, hidden))
    scratch = tuple(_Dev(np.full(shape, np.nan)) for shape in ((m, hidden), (m, 2 * ffn), (m, ffn), (m, hidden)))
    out = _Dev(np.full((m, hidden), np.nan))

    def silu_mul(h, act, stream):
        g, u = h.a[:, :ffn], h.a[:, ffn:]
        act.a[:] = g / (1 + np.exp(-g)) * u

    def matmul(a, b, out):
        out.a[:] = a.a @ (b.a if isinstance(b, _Dev) else b)

    lib = _OneRankNccl()
    comm = SimpleNamespace(lib=lib, handle="comm-handle")
    stream = SimpleNamespace(ptr=7)
    mlp_bench.unfused_block(comm, 3, _Dev(x), _Dev(w_gu), _Dev(w_down), scratch, out, silu_mul, stream, matmul)
    hh = x @ w_gu
    ref = (hh[:, :ffn] / (1 + np.exp(-hh[:, :ffn])) * hh[:, ffn:]) @ w_down
    np.testing.assert_allclose(out.a, ref, rtol=1e-12)
    assert lib.calls == [("all_gather", "comm-handle", m * hidden, 3, 7),
                         ("reduce_scatter", "comm-handle", m * hidden, 3, nccl_lib.REDOPS["sum"], 7)]
