"""CPU tests of fluxrt.perf: nccl-tests flags and sizes, busbw factors, tables, JSON, plots, progress."""
from __future__ import annotations

import argparse
import io
import json
import math
import statistics
from fractions import Fraction

import pytest

from fluxrt.perf import report as report_mod
from fluxrt.perf.report import Row, Table, algbw_gbps, plot, progress, results_document, write_json
from fluxrt.perf.sweep import (SweepOptions, add_sweep_arguments, bus_bandwidth_factor, describe,
                               element_size, format_size, normalize_datatype, parse_size, sizes)

# ---------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, expected", [
    ("8", 8), ("0", 0), ("64K", 65536), ("64k", 65536), ("1M", 1 << 20), ("1G", 1 << 30),
    ("256MB", 256 << 20), ("256mb", 256 << 20), ("1GiB", 1 << 30), ("1gib", 1 << 30),
    ("4KiB", 4096), ("2T", 2 << 40), (" 16 ", 16), ("8B", 8), (128, 128),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "1.5M", "-8", "8X", "M", "1 M B", "64KK", "1e6"])
def test_parse_size_errors_name_the_text(bad):
    with pytest.raises(ValueError) as err:
        parse_size(bad)
    assert repr(bad) in str(err.value)


def test_parse_size_rejects_negative_int():
    with pytest.raises(ValueError, match="-1"):
        parse_size(-1)


def test_format_size():
    assert [format_size(n) for n in (8, 1024, 65536, 1 << 20, 3 << 29, 1 << 30)] == \
        ["8", "1K", "64K", "1M", "1.5G", "1G"]


def test_sizes_factor_8_to_1g():
    opts = SweepOptions(minbytes=parse_size("8"), maxbytes=parse_size("1G"), stepfactor=2)
    got = sizes(opts)
    assert got[0] == 8
    assert got[-1] == 1 << 30
    assert len(got) == 28  # 2**3 .. 2**30
    assert all(b == 2 * a for a, b in zip(got, got[1:]))


def test_sizes_factor_stops_at_max_inclusive_only_when_reached():
    got = sizes(SweepOptions(minbytes=8, maxbytes=100, stepfactor=4), align=1)
    assert got == [8, 32]


def test_sizes_stepbytes():
    opts = SweepOptions(minbytes=1024, maxbytes=8192, stepbytes=parse_size("2K"), datatype="fp32")
    assert sizes(opts) == [1024, 3072, 5120, 7168]


def test_sizes_align_to_element_size():
    # fp32: 4-byte elements; 1..64 by factor 3 -> 1, 3, 9, 27 -> rounded down, at least one element.
    opts = SweepOptions(minbytes=1, maxbytes=64, stepfactor=3, datatype="fp32")
    assert sizes(opts) == [4, 8, 24]  # 1 -> 4, 3 -> 4 (deduplicated), 9 -> 8, 27 -> 24
    assert sizes(opts, align=1) == [1, 3, 9, 27]
    assert all(s % 4 == 0 for s in sizes(opts))
    # Collectives that split evenly over 4 ranks of bf16: multiples of 8 bytes.
    opts = SweepOptions(minbytes=10, maxbytes=1000, stepbytes=100, datatype="bf16")
    assert sizes(opts, align=element_size("bf16") * 4) == [8, 104, 208, 304, 408, 504, 608, 704,
                                                            808, 904]


@pytest.mark.parametrize("kwargs, match", [
    (dict(minbytes=1024, maxbytes=8), "maxbytes"),
    (dict(stepfactor=1), "stepfactor"),
    (dict(minbytes=0), "minbytes"),
    (dict(iters=0), "iters"),
    (dict(warmup_iters=-1), "warmup"),
    (dict(check=2), "check"),
    (dict(graph_iters=-1), "graph"),
    (dict(datatype="fp8"), "datatype"),
    (dict(op="prod"), "op"),
])
def test_options_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SweepOptions(**kwargs)


def test_sizes_revalidates_mutated_options_and_align():
    opts = SweepOptions()
    opts.maxbytes = 4
    with pytest.raises(ValueError, match="maxbytes"):
        sizes(opts)
    with pytest.raises(ValueError, match="align"):
        sizes(SweepOptions(), align=0)


@pytest.mark.parametrize("name, canonical", [
    ("float", "fp32"), ("fp32", "fp32"), ("half", "fp16"), ("FP16", "fp16"), ("bfloat16", "bf16"),
    ("bf16", "bf16"), ("int32", "int32"), ("int", "int32"),
])
def test_datatype_aliases(name, canonical):
    assert normalize_datatype(name) == canonical


# ------------------------------------------------------------------------------------------- argparse


def _parser() -> argparse.ArgumentParser:
    return add_sweep_arguments(argparse.ArgumentParser(prog="all_reduce_perf"))


def test_argparse_round_trip():
    argv = ["-b", "8", "-e", "128M", "-f", "2", "-n", "50", "-w", "10", "-c", "1", "-d", "bf16",
            "-G", "10"]
    opts = SweepOptions.from_args(_parser().parse_args(argv))
    assert opts == SweepOptions(minbytes=8, maxbytes=128 << 20, stepfactor=2, stepbytes=0, iters=50,
                                warmup_iters=10, check=1, datatype="bf16", op="sum", graph_iters=10)
    assert sizes(opts)[-1] == 128 << 20


def test_argparse_long_names_and_extras(tmp_path):
    argv = ["--minbytes", "1K", "--maxbytes", "1GiB", "--stepfactor", "4", "--stepbytes", "0",
            "--iters", "7", "--warmup_iters", "0", "--check", "0", "--datatype", "float",
            "--op", "MAX", "--graph", "3", "--json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "r.png"), "--no-progress"]
    opts = SweepOptions.from_args(_parser().parse_args(argv))
    assert (opts.minbytes, opts.maxbytes, opts.stepfactor, opts.iters, opts.warmup_iters) == \
        (1024, 1 << 30, 4, 7, 0)
    assert (opts.check, opts.datatype, opts.op, opts.graph_iters) == (0, "fp32", "max", 3)
    assert opts.json_path == str(tmp_path / "r.json") and opts.plot_path == str(tmp_path / "r.png")
    assert opts.progress is False


def test_argparse_defaults_match_dataclass():
    assert SweepOptions.from_args(_parser().parse_args([])) == SweepOptions()
    d = SweepOptions()
    assert (d.minbytes, d.maxbytes, d.stepfactor, d.stepbytes, d.iters, d.warmup_iters, d.check,
            d.datatype, d.op, d.graph_iters, d.progress) == \
        (8, 64 << 20, 2, 0, 20, 5, 1, "bf16", "sum", 0, True)


@pytest.mark.parametrize("argv, needle", [
    (["-b", "12Q"], "'12Q'"), (["-d", "fp8"], "fp8"), (["-o", "prod"], "prod"), (["-c", "3"], "3"),
])
def test_argparse_errors_are_clear(argv, needle, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert needle in capsys.readouterr().err


def test_from_args_validates_combination():
    ns = _parser().parse_args(["-b", "1M", "-e", "1K"])
    with pytest.raises(ValueError, match="maxbytes"):
        SweepOptions.from_args(ns)


def test_describe_mentions_parameters():
    text = "\n".join(describe(SweepOptions(stepbytes=64)))
    assert text.startswith("#") and "minBytes 8" in text and "64(bytes)" in text


# ---------------------------------------------------------------------------------------------- busbw


@pytest.mark.parametrize("n", [2, 4, 8])
def test_busbw_factors(n):
    # Independent: bytes crossing the busiest link of a ring, per byte of payload.
    ring_allreduce = Fraction(2 * (n - 1), n)   # reduce-scatter pass + all-gather pass
    one_pass = Fraction(n - 1, n)               # each rank receives the n-1 chunks it lacks
    expected = {
        "allreduce": ring_allreduce, "all_reduce": ring_allreduce,
        "allgather": one_pass, "reduce_scatter": one_pass, "reduce-scatter": one_pass,
        "alltoall": one_pass, "broadcast": 1, "reduce": 1, "sendrecv": 1, "p2p": 1,
    }
    for op, factor in expected.items():
        assert bus_bandwidth_factor(op, n) == pytest.approx(float(factor)), op
    assert {2: 1.0, 4: 1.5, 8: 1.75}[n] == bus_bandwidth_factor("AllReduce", n)
    assert {2: 0.5, 4: 0.75, 8: 0.875}[n] == bus_bandwidth_factor("allgather", n)


def test_busbw_errors():
    with pytest.raises(ValueError, match="gather_scatter"):
        bus_bandwidth_factor("gather_scatter", 4)
    with pytest.raises(ValueError, match="nranks"):
        bus_bandwidth_factor("allreduce", 0)


# ---------------------------------------------------------------------------------------------- table


def _rows(nbytes, t_flux, t_nccl, nranks=4, wrong=0):
    f = bus_bandwidth_factor("allreduce", nranks)
    common = dict(nbytes=nbytes, count=nbytes // 2, dtype="bf16", redop="sum", busbw_factor=f)
    return [Row.measured(impl="fluxrt", algo="oneshot", time_us=t_flux, wrong=wrong, **common),
            Row.measured(impl="nccl", algo="", time_us=t_nccl, wrong=None, **common)]


def _ends(line):
    """End index of each whitespace-separated token of a line."""
    ends, i = [], 0
    for tok in line.split():
        i = line.index(tok, i) + len(tok)
        ends.append(i)
    return ends


def test_algbw_units():
    assert algbw_gbps(1 << 20, 10.0) == pytest.approx((1 << 20) / 10e-6 / 1e9)  # 104.8576 GB/s
    assert algbw_gbps(1 << 20, 0.0) == 0.0
    row = _rows(1 << 30, 3000.0, 3100.0)[0]
    assert row.algbw == pytest.approx((1 << 30) / 3000e-6 / 1e9)
    assert row.busbw == pytest.approx(row.algbw * 1.5)


def test_table_layout_and_ratio():
    out = io.StringIO()
    table = Table(("fluxrt", "nccl"), out=out)
    table.header(describe(SweepOptions()))
    table.add(_rows(8, 10.0, 15.0))
    table.add(_rows(65536, 12.5, 17.6))
    table.add(_rows(1 << 30, 3100.0, 3025.0))
    table.add(_rows(4 << 30, 12345.0, 12000.0))
    table.footer()
    lines = out.getvalue().splitlines()

    names = next(ln for ln in lines if "size" in ln and "busbw" in ln)
    units = lines[lines.index(names) + 1]
    data = [ln for ln in lines if not ln.startswith("#")]
    assert len(data) == 4
    for col in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "ratio"):
        assert col in names.split()
    assert "(us)" in units and "(GB/s)" in units and "(nccl)" in units
    group = lines[lines.index(names) - 1]
    assert group.startswith("#") and group.index("fluxrt") < group.index("nccl")

    # Fixed-width: every data line has the header's length, and each value ends where its column
    # name ends (right-aligned columns).
    name_ends = _ends(names[1:])
    for ln in data:
        assert len(ln) == len(names)
        assert _ends(ln[1:]) == name_ends
        assert len(ln.split()) == len(names.split()) - 1  # names row has the leading '#'

    first = data[0].split()
    # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong | ratio
    assert first[:5] == ["8", "4", "bf16", "sum", "-1"]
    assert first[5] == "10.00" and first[8] == "0"
    assert first[9] == "15.00" and first[12] == "N/A"
    assert float(first[-1]) == pytest.approx(15.0 / 10.0)
    assert float(data[1].split()[-1]) == pytest.approx(17.6 / 12.5, abs=0.005)
    big = data[2].split()
    assert big[5] == "3100.0" and float(big[-1]) == pytest.approx(3025.0 / 3100.0, abs=0.005)
    assert float(big[7]) == pytest.approx((1 << 30) / 3100e-6 / 1e9 * 1.5, abs=0.005)
    assert data[3].split()[5] == "12345"

    footer = "\n".join(lines[-8:])
    assert "# Wrong values (fluxrt)" in footer and ": 0 OK" in footer
    avg = [ln for ln in lines if ln.startswith("# Avg bus bandwidth (fluxrt)")][0]
    expected = sum(r.busbw for r in table.rows if r.impl == "fluxrt") / 4
    assert float(avg.split(":")[1]) == pytest.approx(expected, abs=1e-3)
    gm = [ln for ln in lines if ln.startswith("# Geomean ratio")][0]
    ratios = [15.0 / 10.0, 17.6 / 12.5, 3025.0 / 3100.0, 12000.0 / 12345.0]
    assert float(gm.split(":")[1]) == pytest.approx(
        math.exp(sum(map(math.log, ratios)) / 4), abs=1e-3)


def test_table_missing_impl_wrong_counts_and_errors():
    out = io.StringIO()
    table = Table(out=out, show_algo=True)
    table.header()
    line = table.add(_rows(16, 5.0, 6.0)[1:])  # nccl only
    assert line.split()[5:9] == ["N/A"] * 4 and line.split()[-1] == "N/A"
    table.add(_rows(32, 5.0, 6.0, wrong=3))
    assert "oneshot" in out.getvalue()
    assert table.wrong_total("fluxrt") == 3 and table.wrong_total("nccl") is None
    table.footer()
    assert "3 FAILED" in out.getvalue()
    with pytest.raises(ValueError, match="unknown implementation"):
        table.add([Row.measured(nbytes=8, count=4, dtype="bf16", redop="sum", impl="mpi", algo="",
                                time_us=1.0, busbw_factor=1.0)])
    with pytest.raises(ValueError, match="share a size"):
        table.add(_rows(8, 1.0, 1.0)[:1] + _rows(16, 1.0, 1.0)[1:])
    with pytest.raises(ValueError, match="two rows"):
        table.add(_rows(8, 1.0, 1.0)[:1] * 2)


# ----------------------------------------------------------------------------------------- json, plot


def test_results_document(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUXRT_MACHINE_KIND", "nvidia-h200-x4")
    rows = _rows(1 << 20, 10.0, 12.0)
    doc = results_document("allreduce", rows, ["mpirun", "-np", "4", "python", "x.py", "-b", "8"],
                           machine={"gpu_name": "NVIDIA H200", "gpu_count": 4})
    assert set(doc) == {"bench", "date", "commit", "command", "machine", "versions", "environment", "devices",
                        "options", "notes", "rows"}
    assert doc["bench"] == "allreduce"
    assert doc["command"] == "mpirun -np 4 python x.py -b 8"
    assert doc["machine"] == {"kind": "nvidia-h200-x4", "gpu_name": "NVIDIA H200", "gpu_count": 4}
    assert doc["date"].endswith("+00:00") and "T" in doc["date"]
    assert doc["commit"] == "unknown" or len(doc["commit"]) == 40
    assert doc["rows"][0]["impl"] == "fluxrt" and doc["rows"][1]["wrong"] is None
    assert set(doc["rows"][0]) >= {"bytes", "count", "dtype", "redop", "impl", "algo", "time_us",
                                   "algbw", "busbw", "wrong"}
    path = write_json(tmp_path / "sub" / "r.json", doc)
    assert json.loads(path.read_text()) == doc
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_results_document_defaults_outside_git(tmp_path, monkeypatch):
    monkeypatch.delenv("FLUXRT_MACHINE_KIND", raising=False)
    monkeypatch.chdir(tmp_path)
    doc = results_document("x", [], "cmd")
    assert doc["machine"]["kind"] == "unknown" and doc["rows"] == []
    assert doc["commit"] == "unknown" or len(doc["commit"]) == 40  # tmp may sit inside a repo


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="plot needs matplotlib: pip install matplotlib")
    rows = [r for n in (8, 1024, 1 << 20, 1 << 26) for r in _rows(n, 10.0 + n / 1e5, 12.0 + n / 9e4)]
    path = plot(tmp_path / "p" / "allreduce.png", rows, "allreduce, 4 ranks")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot(tmp_path / "x.png", [], "t")


# ------------------------------------------------------------------------------------------- progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_disabled_or_not_a_tty_passes_through():
    items = [1, 2, 3]
    assert progress(items, enabled=False) is items
    assert progress(items, enabled=True, stream=io.StringIO()) is items


def test_progress_fallback_lines(monkeypatch):
    stream = _Tty()
    got = list(report_mod._fallback_progress(iter("ab"), 2, "allreduce", stream))
    assert got == ["a", "b"]
    assert stream.getvalue().splitlines() == ["[1/2] allreduce", "[2/2] allreduce"]


def test_progress_on_tty_yields_all_items():
    stream = _Tty()
    assert list(progress(range(5), desc="sweep", stream=stream)) == list(range(5))
    assert stream.getvalue()  # something was shown (tqdm or the fallback)


# ------------------------------------------------------------------------------------------- cuBLASLt baseline


def test_cublaslt_baseline_without_nvmath_says_how_to_get_it(monkeypatch):
    import sys

    from fluxrt.perf.cublaslt import CublasLt, CublasLtUnavailable

    monkeypatch.setitem(sys.modules, "nvmath", None)   # import nvmath.bindings fails as if not installed
    monkeypatch.setitem(sys.modules, "nvmath.bindings", None)
    with pytest.raises(CublasLtUnavailable, match="pip install nvmath-python"):
        CublasLt()
    assert issubclass(CublasLtUnavailable, ImportError)


def _perf_module(name: str):
    """perf/<name>.py loaded as a module (the perf scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gemm_benchmarks_take_the_cublaslt_flags():
    for script, flag in (("gemm_suite", "--lt"), ("gemm_fp8", "--no-lt")):
        mod = _perf_module(script)
        args = mod.build_parser().parse_args([flag])
        assert getattr(args, flag.lstrip("-").replace("-", "_")) is True


def test_gemm_suite_shapes_are_any_shapes_and_keep_suite_labels():
    from fluxrt.perf.shapes import suite

    mod = _perf_module("gemm_suite")
    known = suite("default")[0]
    args = mod.build_parser().parse_args(["--shapes", "8200,8200,8192,KN", f"{known.m},{known.n},{known.k},{known.layout}"])
    picked = mod.pick_shapes(suite("default"), args.shapes)
    assert [(s.m, s.n, s.k, s.layout, s.label) for s in picked] == [(8200, 8200, 8192, "KN", "cli"),
                                                                   (known.m, known.n, known.k, known.layout, known.label)]
    assert picked[0].trans_b is False and picked[1].trans_b == (known.layout == "NK")
    assert mod.pick_shapes(suite("default"), None) == suite("default")
    for bad in ("8200,8200,8192", "8200,8200,8192,NN", "0,8,8,NK", "a,8,8,KN"):
        with pytest.raises(SystemExit):
            mod.build_parser().parse_args(["--shapes", bad])


def test_gemm_suite_plan_option_builds_a_validated_plan():
    from fluxrt.gemm.plan import GemmPlan

    mod = _perf_module("gemm_suite")
    args = mod.build_parser().parse_args(["--plan", "cluster=2,block_n=192,stages=4"])
    assert args.plan == GemmPlan(cluster=2, block_n=192, stages=4)
    assert mod.plan_arg("block_m=64,block_n=128,stages=6,stream_k=1") == GemmPlan(block_m=64, consumers=1, block_n=128,
                                                                                    stages=6, stream_k=True)
    assert mod.plan_arg("block_m=256,block_n=128,stages=4,c_staging=shared") == GemmPlan(
        block_m=256, consumers=2, block_n=128, stages=4, c_staging="shared")   # two consumers of 128 rows
    for bad in ("cluster=3", "stages=9,block_n=256", "tile=128", "cluster=", "stream_k=yes", "stages=four",
                "block_m=256,block_n=256,stages=2"):
        with pytest.raises(SystemExit):
            mod.build_parser().parse_args(["--plan", bad])
    with pytest.raises(SystemExit):
        mod.main(["--plan", "cluster=2", "--autotune"])


def test_gemm_suite_plans_from_an_earlier_result(tmp_path):
    """--plans-from: every shape of an earlier result with the plan it recorded (its own dtype's rows; those of
    --shapes only), parsed back from the describe line; it excludes --plan and --autotune."""
    import json

    from fluxrt.gemm.plan import GemmPlan

    mod = _perf_module("gemm_suite")
    rows = [{"m": 461, "n": 9128, "k": 13208, "layout": "NK", "dtype": "bfloat16",
             "plan": "128x256x64 s3 grouped/g4 epi=tma x2 sk"},
            {"m": 1024, "n": 1024, "k": 6144, "layout": "KN", "dtype": "bfloat16",
             "plan": "64x128x64 s6 grouped/g16 epi=tma x1"},
            {"m": 1024, "n": 1024, "k": 6144, "layout": "KN", "dtype": "float16",
             "plan": "128x128x64 s5 grouped/g16 epi=tma x1 k2"},
            {"m": 256, "n": 4096, "k": 4104, "layout": "NK", "dtype": "bfloat16", "error": "CompileError: x"}]
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"bench": "gemm-suite", "rows": rows}))
    got = mod.plans_from(path, "bfloat16")
    assert got == {(461, 9128, 13208, "NK"): GemmPlan(stages=3, group_m=4, cluster=2, stream_k=True),
                   (1024, 1024, 6144, "KN"): GemmPlan(block_m=64, block_n=128, consumers=1, stages=6)}
    assert mod.plans_from(path, "float16") == {(1024, 1024, 6144, "KN"): GemmPlan(block_n=128, stages=5, split_k=2)}
    args = mod.build_parser().parse_args(["--plans-from", str(path)])
    assert args.plans_from == path
    for other in (["--plan", "cluster=2"], ["--autotune"]):
        with pytest.raises(SystemExit):
            mod.main(["--plans-from", str(path), *other])
    (tmp_path / "empty.json").write_text(json.dumps({"rows": rows[3:]}))
    with pytest.raises(SystemExit, match="no bfloat16 rows with a plan"):
        mod.plans_from(tmp_path / "empty.json", "bfloat16")


def test_gemm_suite_summary_splits_the_shape_classes():
    import math

    mod = _perf_module("gemm_suite")
    assert mod.shape_class(461, 9128, 13208, "NK") == "small_m"
    assert mod.shape_class(8192, 8192, 8200, "NK") == "b_off_sectors"     # rows of 16400 B
    assert mod.shape_class(8200, 8200, 8192, "KN") == "b_off_sectors"     # B [K, N]: rows of N
    assert mod.shape_class(8200, 8200, 8192, "NK") == "aligned"
    assert mod.shape_class(2048, 8192, 7392, "NK") == "k_off_lines"       # 14784 B: whole sectors, not lines
    rows = [{"m": 8192, "n": 8192, "k": 8192, "layout": "NK", "ratio_eager": 1.1, "ratio_graph": 1.0,
             "matmul_eager_ms": 1.0, "fluxrt_eager_ms": 1.0, "fluxrt_host_us": 10.0, "cublas_host_us": 20.0},
            {"m": 4096, "n": 4096, "k": 4096, "layout": "KN", "ratio_eager": 0.9, "ratio_graph": 0.81,
             "matmul_eager_ms": 1.0, "fluxrt_eager_ms": 1.0, "fluxrt_host_us": 12.0, "cublas_host_us": 18.0},
            {"m": 256, "n": 4096, "k": 4096, "layout": "NK", "ratio_eager": 0.5,
             "matmul_eager_ms": 1.0, "fluxrt_eager_ms": 1.0, "fluxrt_host_us": 9.0, "cublas_host_us": 19.0},
            {"m": 256, "n": 4096, "k": 4104, "layout": "NK", "error": "CompileError: x"}]
    s = mod.summarize(rows, 4, False, 0.0)
    assert s["shapes"] == 4 and s["measured"] == 3
    assert s["shapes_aligned"] == 2 and math.isclose(s["geomean_aligned"], math.sqrt(1.0 * 0.81))
    assert s["shapes_small_m"] == 1 and math.isclose(s["geomean_small_m"], 0.5)   # eager where no graph ratio
    assert "shapes_b_off_sectors" not in s and "geomean_k_off_lines" not in s
    assert s["below_0.95_graph"] == 1 and s["worst_eager"] == 0.5
    assert s["below_0.95_both"] == 2   # 0.9 / 0.81, and 0.5 eager with no graph timing; not 1.1 / 1.0


def test_gemm_suite_rounds_reverse_the_order_every_other_round():
    mod = _perf_module("gemm_suite")
    impls = {"cublas": None, "fluxrt": None, "cublaslt": None}
    orders = [mod.round_order(impls, i) for i in range(4)]
    assert orders[0] == ["cublas", "fluxrt", "cublaslt"] and orders[1] == ["cublaslt", "fluxrt", "cublas"]
    assert orders[2] == orders[0] and orders[3] == orders[1]
    firsts = [o[0] for o in orders]
    assert firsts.count("cublas") == firsts.count("cublaslt") == 2
    calls = []
    timed = mod.timed_rounds({"a": 1, "b": 2}, 3, lambda v: calls.append(v) or 10 * v + len(calls))
    assert calls == [1, 2, 2, 1, 1, 2]
    assert timed == {"a": [11, 14, 15], "b": [22, 23, 26]}


def test_tp_op_heap_holds_the_largest_shape_beside_the_collectives_context():
    from fluxrt.perf.tp_ops import heap_size
    from fluxrt.tuning_tables import TUNED_WORKSPACE_BYTES

    # GEMM+RS: two parities of received and pulled [M, N] 16-bit partials, beside the collectives context's
    # workspace (the decomposed path's and the baselines'); at 16384x6144 that passed 1 GiB at 2 ranks
    shapes = [(8192, 8192, 14336), (16384, 6144, 16384), (4096, 7168, 16384)]
    need = max(4 * m * n * 2 for m, n, _ in shapes) + TUNED_WORKSPACE_BYTES
    got = int(heap_size("gemm_rs", shapes)[:-1]) << 30
    assert need + (64 << 20) < got <= need + (1 << 30) + (128 << 20)
    need_ag = max(m * k * 2 for m, _, k in shapes) + TUNED_WORKSPACE_BYTES
    got_ag = int(heap_size("ag_gemm", shapes)[:-1]) << 30
    assert need_ag + (64 << 20) < got_ag <= need_ag + (1 << 30) + (128 << 20)


def test_gemm_kernels_pairs_ncu_kernels_with_the_shapes(tmp_path, capsys):
    """perf/gemm_kernels.py summarize: ncu's raw CSV (after the program's own output) paired shape by shape, each
    shape's cuBLAS kernels up to the first fluxrt kernel, then fluxrt's (a split-K reduce counted with its GEMM);
    a shape the run did not reach is left out; the JSON carries cuBLAS's kernel, grid, cluster and the byte counts."""
    import csv
    import io
    import json

    mod = _perf_module("gemm_kernels")
    assert mod.main(["metrics"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(mod.METRICS)
    rows = [{"m": 256, "n": 2048, "k": 6144, "layout": "NK", "dtype": "bfloat16",
             "plan": "64x128x64 s6 grouped/g8 epi=tma x1 k2"},
            {"m": 1024, "n": 1024, "k": 6144, "layout": "KN", "dtype": "bfloat16",
             "plan": "64x128x64 s6 grouped/g16 epi=tma x1"},
            {"m": 8192, "n": 8192, "k": 8192, "layout": "NK", "dtype": "bfloat16",
             "plan": "128x256x64 s3 grouped/g16 epi=tma x2"}]
    plans = tmp_path / "suite.json"
    plans.write_text(json.dumps({"rows": rows}))
    header = ["ID", "Process ID", "Kernel Name", *mod.METRICS]
    units = ["", "", "", "ns", "", "", "", "byte", "sector"]

    def kernel(i, name, ns, grid, cx, dram, sectors):
        return [str(i), "7", name, f"{ns:,}", str(grid), str(cx), "1", f"{dram:,}", f"{sectors:,}"]

    table = [kernel(0, "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT", 15232, 128, 2, 28328960, 2396000),
             kernel(1, "fluxrt_gemm", 16480, 128, 0, 28329472, 2272000),
             kernel(2, "fluxrt_splitk_reduce", 4064, 512, 0, 4202240, 131000),
             kernel(3, "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", 20800, 128, 2, 25187328, 3940000),
             kernel(4, "fluxrt_gemm", 26656, 128, 0, 25180416, 5053000),
             kernel(5, "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 1181632, 132, 2, 545295360, 27065000)]
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    for r in (header, units, *table):
        w.writerow(r)
    ncu = tmp_path / "ncu.csv"
    ncu.write_text("==PROF== Connected to process 7\n# program output\n" + buf.getvalue())
    out = tmp_path / "kernels.json"
    assert mod.main(["summarize", str(ncu), "--plans-from", str(plans), "--json", str(out)]) == 0
    assert "2 of 3 shapes paired" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["bench"] == "gemm-cublas-kernels" and len(doc["rows"]) == 2
    first, second = doc["rows"]
    assert first["cublas_kernel"].startswith("nvjet_sm90_tst_64x64") and first["cublas_cluster"] == "2x1"
    assert first["cublas_us"] == 15.23 and first["fluxrt_us"] == round((16480 + 4064) / 1e3, 2)
    assert first["ratio"] == round(15.23 / 20.54, 3) and first["cublas_grid"] == 128
    assert first["fluxrt_dram_read_mb"] == round((28329472 + 4202240) / 1e6, 2)
    assert first["cublas_l2_read_mb"] == round(2396000 * 32 / 1e6, 2)
    assert first["fluxrt_plan"] == "64x128x64 s6 grouped/g8 epi=tma x1 k2"
    assert (second["m"], second["layout"], second["fluxrt_us"]) == (1024, "KN", 26.66)
    bad = tmp_path / "bad.csv"
    bad.write_text(ncu.read_text().replace("dram__bytes_read.sum", "dram__other"))
    with pytest.raises(SystemExit, match="lacks"):
        mod.main(["summarize", str(bad), "--plans-from", str(plans)])
    (tmp_path / "none.csv").write_text("no table\n")
    with pytest.raises(SystemExit, match="no ncu CSV table"):
        mod.main(["summarize", str(tmp_path / "none.csv"), "--plans-from", str(plans)])


def _suite_run(ratios: dict, dtype: str = "bfloat16", plan: str = "128x256x64 s3 grouped/g16 epi=tma x1") -> dict:
    """A gemm_suite document whose rows have the given (eager, graph) ratio per (m, n, k, layout)."""
    return {"bench": "gemm-suite", "commit": "abc", "machine": {"kind": "nvidia-h200", "gpu_name": "NVIDIA H200"},
            "rows": [{"m": m, "n": n, "k": k, "layout": lay, "dtype": dtype, "label": "x", "plan": plan,
                      "ratio_eager": e, "ratio_graph": g} for (m, n, k, lay), (e, g) in ratios.items()]}


def test_gemm_suite_repeat_medians_and_the_shapes_below(tmp_path, capsys):
    """Per shape the runs' ratios and their medians; the summary's geometric means are of the medians, and a shape
    is below only where its median is (one noisy run does not put it there)."""
    mod = _perf_module("gemm_suite_repeat")
    a, b, c = (256, 4096, 1024, "NK"), (4096, 4096, 4096, "KN"), (461, 9128, 13208, "NK")
    runs = [_suite_run({a: (0.90, 0.99), b: (1.00, 1.02), c: (0.87, 0.86)}),
            _suite_run({a: (0.97, 0.93), b: (1.04, 0.91), c: (0.85, 0.88)}),
            _suite_run({a: (0.99, 0.96), b: (1.01, 1.05), c: (0.90, 0.84)}, plan="256x160x64 s4 grouped/g2 epi=direct x1x2")]
    rows, summary = mod.combine(runs)
    by = {(r["m"], r["n"], r["k"], r["layout"]): r for r in rows}
    assert by[a]["ratio_eager_runs"] == [0.90, 0.97, 0.99] and by[a]["ratio_eager_median"] == 0.97
    assert by[b]["ratio_graph_median"] == 1.02 and by[c]["ratio_graph_median"] == 0.86
    meds = [statistics.median(v) for v in ((0.99, 0.93, 0.96), (1.02, 0.91, 1.05), (0.86, 0.88, 0.84))]
    assert summary["geomean_graph_of_medians"] == round(math.exp(sum(map(math.log, meds)) / 3), 4)
    assert summary["below_both_medians"] == ["461x9128x13208 NK"]
    assert summary["below_eager_median"] == ["461x9128x13208 NK"] and summary["below_graph_median"] == ["461x9128x13208 NK"]
    assert summary["below_both_per_run"] == [1, 1, 1]   # run 2's a and b are below in graph replay only
    assert summary["plans_differ"] == ["256x4096x1024 NK", "4096x4096x4096 KN", "461x9128x13208 NK"]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "repeat.json"
    assert mod.main([*map(str, paths), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "gemm-suite-repeat" and doc["summary"] == json.loads(json.dumps(summary))
    assert "461" in capsys.readouterr().out
    with pytest.raises(ValueError, match="at least two runs"):
        mod.combine(runs[:1])
    with pytest.raises(ValueError, match="several dtypes"):
        mod.combine([runs[0], _suite_run({a: (1.0, 1.0)}, dtype="float16")])
    assert mod.main([str(paths[0])]) == 2


def test_gemm_trace_summary_of_a_made_timeline():
    """perf/gemm_trace.py's statistics of a timeline built by hand: 3 tiles of 4 K blocks, consumer 0 issuing a
    K block every 100 cycles inside a tile and 400 cycles into a tile's first block (its predecessor's drain and
    epilogue), then 150 into its second; the loader waiting 30 cycles per block and consumer 0 10; consumer 1
    passing each wait 20 cycles after consumer 0, 900 at a tile's first block (its epilogue turn comes second)."""
    import numpy as np

    mod = _perf_module("gemm_trace")
    periods = [100, 100, 100, 400, 150, 100, 100, 400, 150, 100, 100]   # into blocks 1 .. 11
    issue = np.concatenate([[1000], 1000 + np.cumsum(periods)])
    trace = np.zeros((mod.TRACE_ROWS, mod.TRACE_BLOCKS), dtype=np.int64)
    trace[3, :12] = issue
    trace[2, :12] = issue - 10
    trace[1, :12] = issue - 500
    trace[0, :12] = issue - 530
    lag = np.where(np.arange(12) % 4 == 0, 900, 20)
    trace[5, :12] = issue + lag
    trace[4, :12] = issue + lag - 40
    s = mod.summarize(trace, k_blocks_per_tile=4, ideal_cycles=100.0, start_blocks=2)
    assert s["consumer1_lag_at_tile_first_block_p10_50_90"] == [900, 900, 900]
    assert s["consumer1_lag_p10_50_90"] == [20, 20, 900] and s["consumer1_wait_p10_50_90"] == [40, 40, 40]
    s4 = mod.summarize(trace[:4], k_blocks_per_tile=4, ideal_cycles=100.0, start_blocks=2)   # consumer 0 only
    assert "consumer1_lag_p10_50_90" not in s4 and {k: v for k, v in s.items() if not k.startswith("consumer1")} == s4
    assert (s["k_blocks_traced"], s["tiles_traced"]) == (12, 3)
    assert s["period_mean"] == round(sum(periods) / 11, 1)
    assert s["period_p10_50_90"][1] == 100
    # tiles 1 and 2: periods into their 4 blocks (400, 150, 100, 100) = 750 against 4 x 100
    assert s["excess_per_tile_cycles"] == [350, 350]
    assert s["tile_start_periods_by_block"] == [400.0, 150.0]
    assert s["period_mean_inside_tiles"] == 100.0
    assert s["loader_wait_p10_50_90"] == [30, 30, 30] and s["consumer_wait_p10_50_90"] == [10, 10, 10]
    assert s["consumer_wait_share"] == round(120 / (issue[-1] - issue[0] + 10), 4)
    assert s["efficiency_mean"] == round(100 / (sum(periods) / 11), 4)
    with pytest.raises(ValueError, match="1 K blocks traced"):
        mod.summarize(trace[:, :1], 4, 100.0)


def test_gemm_trace_epilogue_hand_offs_of_a_made_trace():
    """perf/gemm_trace.py's epilogue statistics of a hand-made per-tile trace with shared staging, three tiles whose
    hand-offs differ: consumer 0's accumulators final at 0, its token 10 later, staged 300 (+100 per tile) after
    that; the storer sees turn 0 50 cycles later and its TMA stores read it in 700; consumer 1 (final 40 after
    consumer 0) gets the token 60 after that, stages in 300, turn 1 reads in 650. A fourth column with the storer's
    turn-0 mark only (a phantom tile) and tiles not reached stay out of every span."""
    import numpy as np

    mod = _perf_module("gemm_trace")
    epi = np.zeros((mod.EPI_ROWS, mod.EPI_TILES), dtype=np.int64)
    col = {name: i for i, name in enumerate(mod.EPI_ROW_NAMES)}
    for t in range(3):
        base, w = 10_000 + 100_000 * t, 300 + 100 * t
        marks = {"consumer0_final": 0, "consumer0_token": 10, "consumer0_staged": 10 + w}
        marks["storer_turn0_staged"] = marks["consumer0_staged"] + 50
        marks["storer_turn0_read"] = marks["storer_turn0_staged"] + 700
        marks["consumer1_final"] = 40
        marks["consumer1_token"] = marks["storer_turn0_read"] + 60
        marks["consumer1_staged"] = marks["consumer1_token"] + 300
        marks["storer_turn1_staged"] = marks["consumer1_staged"] + 50
        marks["storer_turn1_read"] = marks["storer_turn1_staged"] + 650
        for name, dt in marks.items():
            epi[col[name], t] = base + dt
    epi[col["storer_turn0_staged"], 3] = 900_000   # one end only: in no span
    s = mod.summarize_epilogue(epi)
    assert s == {
        "epi_consumer0_token_wait_p10_50_90": [10, 10, 10],
        "epi_consumer0_staging_write_p10_50_90": [320, 400, 480],
        "epi_consumer1_token_wait_p10_50_90": [1100, 1180, 1260],
        "epi_consumer1_staging_write_p10_50_90": [300, 300, 300],
        "epi_storer_turn0_stage_to_read_p10_50_90": [700, 700, 700],
        "epi_storer_turn1_stage_to_read_p10_50_90": [650, 650, 650],
        "epi_consumer0_staged_to_storer_p10_50_90": [50, 50, 50],
        "epi_storer_turn0_read_to_consumer1_token_p10_50_90": [60, 60, 60],
        "epi_consumer1_final_after_consumer0_p10_50_90": [40, 40, 40],
        "epi_consumer1_staged_after_consumer0_p10_50_90": [1110, 1110, 1110],
    }
    epi[col["storer_turn1_staged"]] = 0   # a region per consumer: one turn, the token from the previous tile
    epi[col["storer_turn1_read"]] = 0
    s1 = mod.summarize_epilogue(epi)
    assert set(s) - set(s1) == {"epi_storer_turn1_stage_to_read_p10_50_90",
                                "epi_storer_turn0_read_to_consumer1_token_p10_50_90"}
    assert mod.summarize_epilogue(np.zeros_like(epi)) == {}


def test_gemm_sustained_arguments_and_columns(capsys):
    """perf/gemm_sustained.py: its shapes and plan file, the load windows checked before any GPU work, and a row's
    columns (each implementation's run as cublas_* / fluxrt_*, the ratios cuBLAS / fluxrt)."""
    mod = _perf_module("gemm_sustained")
    args = mod.build_parser().parse_args(["--shapes", "461,9128,13208,NK", "-d", "fp16", "--seconds", "2"])
    assert [(s.m, s.n, s.k, s.layout) for s in args.shapes] == [(461, 9128, 13208, "NK")] and args.cool == 1.0
    with pytest.raises(SystemExit):
        mod.main(["--shapes", "64,64,64,NK", "--seconds", "0.5"])   # no steady window after the burst
    assert "--seconds must exceed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main([])   # neither shapes nor a plan file
    cu = {"burst_us": 10.0, "steady_us": 12.0, "power_w": 690.0, "energy_mj_per_call": 690.0 * 12.0e-3}
    fl = {"burst_us": 8.0, "steady_us": 15.0, "power_w": 600.0, "energy_mj_per_call": 600.0 * 15.0e-3}
    row = mod.flat_row({"m": 1}, cu, fl)
    assert row["cublas_steady_us"] == 12.0 and row["fluxrt_power_w"] == 600.0
    assert row["ratio_burst"] == pytest.approx(1.25) and row["ratio_steady"] == pytest.approx(0.8)
    assert row["ratio_energy"] == pytest.approx(8.28 / 9.0)
    assert "ratio_energy" not in mod.flat_row({}, {"burst_us": 1.0, "steady_us": 1.0},
                                             {"burst_us": 1.0, "steady_us": 1.0})   # no power samples
