"""CPU tests of fluxrt-perf's nccl-tests parity: flags, -a over ranks, in-place blocks, header lines, JSON
fields, the dispatcher's --help and unknown subcommands, and the GEMM benches' shared vocabulary."""
from __future__ import annotations

import argparse
import importlib.util
import io
from pathlib import Path

import pytest

from fluxrt.perf import cli
from fluxrt.perf import collectives as bench
from fluxrt.perf import p2p, tp_ops
from fluxrt.perf.baselines import format_cuda_version, format_nccl_version, nccl_registration
from fluxrt.perf.report import (Row, Table, device_lines, differences_line, environment, option_differences,
                                results_document, version_line)
from fluxrt.perf.sweep import (SweepOptions, add_sweep_arguments, describe, gemm_datatype, rank_stats,
                               reduce_over_ranks, sweep_datatypes, sweep_ops, sweep_roots)

ROOT = Path(__file__).resolve().parents[2]


def _opts(argv):
    return SweepOptions.from_args(add_sweep_arguments(argparse.ArgumentParser()).parse_args(argv))


# ------------------------------------------------------------------------------------------------ flags


def test_nccl_tests_flags_parse():
    o = _opts(["-a", "3", "-r", "2", "-z", "1", "-T", "60", "-R", "2", "-g", "1", "-t", "1", "-d", "all",
               "-o", "all"])
    assert (o.average, o.root, o.blocking, o.timeout, o.register, o.ngpus, o.nthreads) == (3, 2, 1, 60.0, 2, 1, 1)
    assert (o.datatype, o.op) == ("all", "all")
    d = _opts([])
    assert (d.average, d.root, d.blocking, d.timeout, d.register) == (1, 0, 0, 0.0, 0)
    assert _opts(["-r", "all"]).root == "all" and _opts(["--root", "1"]).root == 1
    assert _opts(["--local_register", "1", "--blocking", "1", "--average", "0", "--timeout", "5"]).register == 1


@pytest.mark.parametrize("argv, needle", [
    (["-a", "4"], "-a"), (["-z", "2"], "-z"), (["-R", "3"], "-R"), (["-r", "x"], "'x'"),
    (["-o", "prod"], "do not"), (["-o", "avg"], "do not"), (["-d", "fp8"], "fp8"),
])
def test_bad_flags_are_argparse_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        add_sweep_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    (dict(ngpus=2), "-g/--ngpus must be 1"), (dict(nthreads=4), "-t/--nthreads must be 1"),
    (dict(blocking=1, graph_iters=10), "-z 1 .* -G"), (dict(timeout=-1), "-T"),
])
def test_unsupported_combinations_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SweepOptions(**kwargs)


@pytest.mark.parametrize("argv, op, message", [
    (["-g", "2"], "allreduce", "one GPU per rank"),
    (["-z", "1", "-G", "5"], "allreduce", "cannot be combined"),
    (["-o", "max"], "allgather", "does not reduce"),
    (["-r", "1"], "allreduce", "has no root"),
    (["--algo", "direct"], "allgather", "add --symmetric"),
])
def test_collective_sweep_rejects_before_starting(argv, op, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_options(op, argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_collective_sweep_options():
    _, args, opts, _ = bench.parse_options("broadcast", ["-r", "all", "-R", "1", "--algo", "direct"])
    assert opts.root == "all" and args.symmetric  # -R 1 puts fluxrt's buffers on the symmetric heap
    _, args, opts, _ = bench.parse_options("allreduce", ["-d", "all", "-o", "all", "--no-inplace"])
    assert sweep_datatypes(opts, bench.REDUCING_DTYPES) == ["fp32", "fp16", "bf16"]
    assert sweep_ops(opts) == ["sum", "max", "min"] and not args.inplace
    assert sweep_datatypes(opts) == ["fp32", "fp16", "bf16", "int32"]
    assert sweep_ops(_opts([]), reducing=False) == ["none"]
    assert sweep_roots(_opts(["-r", "all"]), 3) == [0, 1, 2] and sweep_roots(_opts([]), 3, has_root=False) == [-1]
    with pytest.raises(ValueError, match="outside 2 ranks"):
        sweep_roots(_opts(["-r", "2"]), 2)


def test_sweep_defaults_are_the_librarys_or_said():
    import fluxrt

    _, args, opts, tuning = bench.parse_options("allreduce", [])
    lib = bench.library_defaults()
    assert lib["workspace_bytes"] == fluxrt.CollectivesOptions().workspace_bytes
    used = bench.sweep_options_used(args, opts, tuning)
    assert used["workspace_bytes"] == lib["workspace_bytes"]
    diffs = option_differences(used, lib)
    assert set(diffs) == {"check_collective_args"}  # the only one, and the header says so
    line = differences_line(diffs, bench.WHY)
    assert line.startswith("#") and "check_collective_args=False (library: True; --check-args" in line
    _, args, opts, tuning = bench.parse_options("allreduce", ["--check-args", "--workspace", "64M", "-T", "5",
                                                              "--tune", "ll_max_bytes=8K"])
    used = bench.sweep_options_used(args, opts, tuning)
    diffs = option_differences(used, dict(lib, **{"tuning.ll_max_bytes": None}))
    assert set(diffs) == {"workspace_bytes", "timeout_s", "tuning.ll_max_bytes"}
    assert diffs["workspace_bytes"] == {"used": 64 << 20, "library": lib["workspace_bytes"]}
    assert differences_line({}) .endswith(": none")


def test_describe_records_new_flags():
    text = "\n".join(describe(_opts(["-a", "2", "-z", "1", "-R", "1", "-r", "1"])))
    assert "root 1" in text and "blocking: 1" in text and "(-a 2): min" in text and "register (-R): 1" in text


# ------------------------------------------------------------------------------------------- -a reduce


def test_reduce_over_ranks_is_nccl_tests_a():
    times = [4.0, 2.0, 9.0, 5.0]
    assert reduce_over_ranks(times, 0) == 4.0  # rank 0's
    assert reduce_over_ranks(times, 1) == 5.0  # mean (nccl-tests' default)
    assert reduce_over_ranks(times, 2) == 2.0
    assert reduce_over_ranks(times, 3) == 9.0
    assert reduce_over_ranks([7]) == 7.0
    with pytest.raises(ValueError, match="-a"):
        reduce_over_ranks(times, 4)
    with pytest.raises(ValueError):
        reduce_over_ranks([], 1)
    assert rank_stats(times) == {"min": 2.0, "avg": 5.0, "max": 9.0, "ranks": 4}


def test_p2p_time_over_transferring_ranks_only():
    assert p2p.acting_time([None, 8.0, None], 1) == 8.0
    assert p2p.acting_time([6.0, 8.0, None, None], 1) == 7.0
    assert p2p.acting_time([6.0, 8.0], 3) == 8.0 and p2p.acting_time([None, None]) == 0.0
    assert p2p.check_args(SweepOptions()) is None
    assert "-R" in p2p.check_args(SweepOptions(register=1))
    assert "-d all" in p2p.check_args(SweepOptions(datatype="all"))


def test_tp_ops_vocabulary():
    args = tp_ops.build_parser("ag_gemm").parse_args("-n 7 -w 2 -c 0 -d fp16 -a 3 -T 9 --M 8 --N 16 --K 32".split())
    assert (args.iters, args.warmup_iters, args.check, args.datatype, args.average, args.timeout) == \
        (7, 2, 0, "fp16", 3, 9.0)
    assert (args.m, args.n, args.k) == (8, 16, 32)
    assert tp_ops.build_parser("gemm_rs").parse_args([]).average == 1
    with pytest.raises(SystemExit):
        tp_ops.build_parser("ag_gemm").parse_args(["-i", "5"])  # -i is nccl-tests' stepbytes, not iterations


# ------------------------------------------------------------------------------------------- in place


@pytest.mark.parametrize("op, expected", [
    ("allreduce", ("x", 0, 0)), ("alltoall", ("x", 0, 0)), ("broadcast", ("x", 0, 0)),
    ("allgather", ("out", 2 * 8, 0)), ("reduce_scatter", ("x", 0, 2 * 8)),
])
def test_inplace_layouts_are_the_readme_slices(op, expected):
    n, rank, c = 4, 2, 8
    in_e, out_e = {"allgather": (c, n * c), "reduce_scatter": (n * c, c)}.get(op, (n * c, n * c))
    assert bench.inplace_layout(op, in_e, out_e, rank) == expected
    with pytest.raises(ValueError, match="no in-place"):
        bench.inplace_layout("alltoallv", 32, 32, 0)


def _row(nbytes, impl, t, inplace, wrong=0):
    return Row.measured(nbytes=nbytes, count=nbytes // 2, dtype="bf16", redop="sum", impl=impl, algo="a",
                        time_us=t, busbw_factor=1.5, wrong=wrong, inplace=inplace,
                        stats={"min": t - 1, "avg": t, "max": t + 1})


def test_inplace_table_blocks():
    out = io.StringIO()
    t = Table(("fluxrt", "nccl"), out=out, inplace=True)
    t.header()
    t.add([_row(1024, "fluxrt", 10.0, False), _row(1024, "nccl", 20.0, False),
           _row(1024, "fluxrt", 8.0, True), _row(1024, "nccl", 16.0, True, wrong=2)])
    t.add([_row(2048, "fluxrt", 10.0, False), _row(2048, "nccl", 30.0, False), _row(2048, "fluxrt", 5.0, True)])
    t.footer()
    lines = out.getvalue().splitlines()
    names = next(ln for ln in lines if "size" in ln and "busbw" in ln)
    group = lines[lines.index(names) - 1]
    # nccl-tests' order: out-of-place blocks, then in-place ones
    assert group.index("fluxrt out-of-place") < group.index("nccl out-of-place") < group.index("fluxrt in-place") \
        < group.index("nccl in-place")
    assert names.split().count("time") == 4 and names.split().count("ratio") == 2
    data = [ln for ln in lines if not ln.startswith("#")]
    assert all(len(ln) == len(names) for ln in data)
    cells = data[0].split()
    # size count type redop root | fl: t a b w | nccl: t a b w | ratio | fl in: t a b w | nccl in: t a b w | ratio
    assert cells[5] == "10.00" and cells[9] == "20.00" and cells[13] == "2.00"
    assert cells[14] == "8.00" and cells[18] == "16.00" and cells[21] == "2" and cells[22] == "2.00"
    second = data[1].split()
    assert second[18:23] == ["N/A"] * 5  # NCCL has no in-place row at that size
    footer = "\n".join(lines[-14:])
    assert "Wrong values (nccl in-place)" in footer and "2 FAILED" in footer
    assert "Wrong values (fluxrt out-of-place)" in footer
    assert "Geomean ratio (nccl/fluxrt time, in-place)" in footer
    assert t.wrong_total("nccl", True) == 2 and t.wrong_total("nccl", False) == 0 and t.wrong_total("nccl") == 2
    with pytest.raises(ValueError, match="without in-place"):
        Table(("fluxrt",), out=io.StringIO()).add([_row(8, "fluxrt", 1.0, True)])


# ------------------------------------------------------------------------------------------- header, json


def test_header_lines():
    assert device_lines([{"rank": 0, "pid": 41, "host": "n1", "device": 3, "pci_bus_id": "0000:1B:00.0",
                          "name": "NVIDIA H200"}]) == ["#  Rank  0 Pid     41 on n1 device  3 [0000:1B:00.0] NVIDIA H200"]
    line = version_line({"fluxrt": "0.1.0", "cuda_runtime": "12.8", "cuda_driver": "12.9", "nccl": None,
                         "cupy": "13.4.0", "python": "3.12.1"})
    assert line.startswith("# fluxrt 0.1.0") and "CUDA runtime 12.8 driver 12.9" in line and "NCCL N/A" in line
    assert format_cuda_version(12080) == "12.8" and format_cuda_version(0) is None
    assert format_nccl_version(22703) == "2.27.3" and format_nccl_version(2708) == "2.7.8"


def test_nccl_registration_note():
    assert nccl_registration(0) == (False, None)
    assert nccl_registration(2) == (True, None)       # the nccl-win columns are -R 2
    ok, note = nccl_registration(1)
    assert not ok and "-R 1" in note and "unregistered" in note and "nccl-win" in note


def test_results_document_versions_environment_devices_stats():
    env = {"NCCL_ALGO": "Ring", "FLUXRT_TIMEOUT_S": "60", "NVSHMEM_SYMMETRIC_SIZE": "4G", "HOME": "/root",
           "CUDA_VISIBLE_DEVICES": "0"}
    assert environment(env) == {"FLUXRT_TIMEOUT_S": "60", "NCCL_ALGO": "Ring", "NVSHMEM_SYMMETRIC_SIZE": "4G"}
    rows = [_row(1024, "fluxrt", 10.0, False), _row(1024, "fluxrt", 8.0, True)]
    doc = results_document("allreduce", rows, "fluxrt-perf allreduce", env=env,
                           versions={"fluxrt": "0.1.0", "nccl": "2.27.3", "cuda_runtime": "12.8",
                                     "cuda_driver": "12.9"},
                           devices=[{"rank": 0, "name": "H200", "pci_bus_id": "0000:1b:00.0"}],
                           options={"average": 1, "differs_from_library": {}}, notes=["n"])
    assert doc["versions"]["nccl"] == "2.27.3" and doc["versions"]["cuda_driver"] == "12.9"
    assert doc["environment"] == environment(env) and doc["devices"][0]["pci_bus_id"] == "0000:1b:00.0"
    assert doc["options"]["average"] == 1 and doc["notes"] == ["n"]
    r = doc["rows"][1]
    assert r["inplace"] is True and (r["time_min_us"], r["time_avg_us"], r["time_max_us"]) == (7.0, 8.0, 9.0)


# ------------------------------------------------------------------------------------------- dispatcher


def test_help_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.BENCHES:
        assert f"  {name} " in out
    assert set(cli.SUMMARIES) == set(cli.BENCHES)


def test_unknown_subcommand_says_so(capsys):
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'bogus'" in err and "allreduce" in err and "ag_gemm" in err
    assert cli.main([]) == 2


# ------------------------------------------------------------------------------------------- GEMM benches


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gemm_benches_share_the_vocabulary():
    bg = _load("bench_gemm").build_parser()
    a = bg.parse_args("-d fp16 -n 7 -w 3 -c 0".split())
    assert (a.dtype, a.iters, a.warmup, a.check) == ("float16", 7, 3, 0)
    a = bg.parse_args("--dtype bfloat16 --iters 9 --warmup 2 --no-check".split())  # the older spellings
    assert (a.dtype, a.iters, a.warmup, a.check) == ("bfloat16", 9, 2, 0)
    assert bg.parse_args([]).check == 1
    gs = _load("gemm_suite").build_parser()
    a = gs.parse_args("-d bf16 -n 5 -c 0".split())
    assert (a.dtype, a.iters, a.check) == ("bfloat16", 5, 0)
    assert gemm_datatype("half") == "float16"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemm_datatype("fp32")


def test_geomean_of_the_bench_scripts_leaves_out_missing_ratios():
    import math

    from fluxrt.perf.timing import geomean

    assert math.isclose(geomean([2.0, 8.0]), 4.0)
    assert math.isclose(geomean([0.5, None, 0.0, -1.0, 2.0]), 1.0)   # missing or non-positive ratios left out
    assert math.isnan(geomean([None, 0.0]))
