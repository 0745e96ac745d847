"""fluxrt.perf.power (the power / clock sampler behind perf/gemm_sustained.py) and autotune's sustained setting,
without a GPU: nvidia-smi's lines parsed, summaries over the late samples, the environment variable checked."""
import pytest

from fluxrt.perf.power import CLOCK_REASONS, PowerSampler, Sample, parse_line, reason_names, summarize


def test_parse_line_reads_nvidia_smi_csv_and_rejects_other_lines():
    s = parse_line("691.24, 1455, 56, 0x0000000000000004", 2.5)
    assert s == Sample(2.5, 691.24, 1455.0, 56.0, 4)
    assert reason_names(s.reasons) == ["sw_power_cap"]
    assert parse_line("[N/A], 1455, 56, 0x0", 0.0) is None
    assert parse_line("No devices were found", 0.0) is None
    assert parse_line("1, 2, 3", 0.0) is None


def test_reason_names_cover_every_bit_and_unknown_ones():
    assert reason_names(0) == ["none"]
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reason_names(0x10000) == ["0x10000"]
    assert reason_names(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]
    assert all(bit & (bit - 1) == 0 for bit in CLOCK_REASONS)   # one bit each


def test_summarize_averages_the_samples_after_since():
    samples = [Sample(0.1, 300.0, 1980.0, 40.0, 0), Sample(1.6, 690.0, 1500.0, 55.0, 4),
               Sample(2.0, 694.0, 1400.0, 57.0, 4 | 0x20)]
    got = summarize(samples, since=1.5)
    assert got["power_w"] == pytest.approx(692.0) and got["sm_mhz"] == pytest.approx(1450.0)
    assert got["temp_c_max"] == 57.0 and got["samples"] == 2
    assert got["clock_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert summarize(samples, since=9.0)["samples"] == 3   # none that late: all of them
    assert summarize([]) == {}


def test_sampler_without_nvidia_smi_records_nothing(monkeypatch):
    import fluxrt.perf.power as power

    monkeypatch.setattr(power.shutil, "which", lambda name: None)
    with PowerSampler("0000:00:06.0") as s:
        pass
    assert not s.available and s.samples == []


def test_sampler_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that prints its arguments' query lines every interval: the sampler passes the
    device and query, parses what it prints (skipping a malformed line) and stops it at the block's end."""
    import os
    import stat
    import time

    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\necho 'not, a, sample'\n"
                      "while true; do echo '690.5, 1500, 55, 0x0000000000000004'; sleep 0.02; done\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with PowerSampler("0000:00:06.0", interval_ms=20) as s:
        time.sleep(0.3)
    assert s.available and len(s.samples) >= 3
    assert all(x.power_w == 690.5 and x.sm_mhz == 1500.0 and x.reasons == 4 for x in s.samples)
    assert [x.t for x in s.samples] == sorted(x.t for x in s.samples)
    args = (tmp_path / "args").read_text()
    assert "-i 0000:00:06.0" in args and "--query-gpu=power.draw,clocks.sm" in args and "-lms 20" in args
    n = len(s.samples)
    time.sleep(0.1)
    assert len(s.samples) == n   # stopped


class _FakeTimed:
    """A tuning candidate whose replays take ``us`` microseconds each (a list: one per replay, the last repeated),
    on a fake clock that each replay advances by ``step_ms``."""

    def __init__(self, us, clock, step_ms=1.0, plan=None):
        self.us_list, self.clock, self.step_ms, self.plan, self.n = list(us), clock, step_ms, plan, 0
        self.reps = 10

    def us(self):
        v = self.us_list[min(self.n, len(self.us_list) - 1)]
        self.n += 1
        self.clock.now += self.step_ms / 1e3
        return v


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_alone_us_takes_the_second_half_of_the_load():
    from fluxrt.gemm.autotune import _alone_us

    clock = _Clock()
    t = _FakeTimed([10.0] * 5 + [20.0] * 100, clock, step_ms=1.0)   # fast until the clock drops after 5 ms
    assert _alone_us(t, 10.0, clock=clock) == 20.0 and t.n == 10   # 10 ms of 1 ms replays, the last 5 counted
    zero = _FakeTimed([0.0], clock, step_ms=0.0)   # a replay that takes no time on a clock that stands still
    assert _alone_us(zero, 5.0, clock=clock) == 0.0   # ends at the replay cap, does not spin forever
    assert _alone_us(_FakeTimed([7.0], clock), 0.0, clock=clock) == 7.0   # no load asked: one replay


def test_pick_sustained_times_the_best_eight_and_the_heuristic_twice_alone(monkeypatch):
    import sys

    import fluxrt.gemm  # noqa: F401 - fluxrt.gemm.autotune is also the function's name there
    from fluxrt.gemm.plan import GemmPlan

    at = sys.modules["fluxrt.gemm.autotune"]

    plans = [GemmPlan(block_n=bn, stages=s) for bn in (64, 128, 192, 256) for s in (2, 3, 4)]   # 12 candidates
    timed = [_FakeTimed([1.0], _Clock(), plan=p) for p in plans]
    alone = {id(t): 100.0 - i for i, t in enumerate(timed)}   # alone, the screen's worst is the fastest
    alone[id(timed[3])] = 50.0
    order = []
    monkeypatch.setattr(at, "_alone_us", lambda t, ms: order.append(id(t)) or alone[id(t)])
    screen = [(t, 1.0 + i) for i, t in enumerate(timed)]   # ranked as listed
    default = plans[11]
    win, us, mean = at._pick_sustained(screen, default, 500.0)
    finalists = [id(t) for t in timed[:8]] + [id(timed[11])]   # the 8 best, then the heuristic's
    assert order == finalists + finalists[::-1]   # twice, in opposite orders
    assert set(mean) == set(finalists)
    assert win is timed[3] and us == 50.0
    alone[id(timed[11])] = 50.4   # within HEURISTIC_TIE of the winner: the heuristic's plan stays
    order.clear()
    win, us, _ = at._pick_sustained(screen, default, 500.0)
    assert win is timed[11] and us == 50.4


def test_sustained_setting_from_the_environment():
    from fluxrt.errors import GemmArgumentError
    from fluxrt.gemm.autotune import sustained_default

    assert sustained_default({}) == 0.0
    assert sustained_default({"FLUXRT_GEMM_TUNE_SUSTAINED_MS": " 500 "}) == 500.0
    assert sustained_default({}, unset=500.0) == 500.0   # the tune CLI's default where the variable is not set
    assert sustained_default({"FLUXRT_GEMM_TUNE_SUSTAINED_MS": "0"}, unset=500.0) == 0.0
    for bad in ("-1", "fast", "nan", "inf"):
        with pytest.raises(GemmArgumentError, match="FLUXRT_GEMM_TUNE_SUSTAINED_MS"):
            sustained_default({"FLUXRT_GEMM_TUNE_SUSTAINED_MS": bad})


def test_tune_cli_takes_sustained_milliseconds():
    import argparse

    from fluxrt.gemm.__main__ import _milliseconds

    assert _milliseconds("250") == 250.0
    for bad in ("-5", "x", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="--sustained"):
            _milliseconds(bad)


def test_refine_bands_times_with_the_given_function_in_alternating_order():
    """The sustained confirmation times the winner's band variants alone (time_one): each once per round, the order
    reversed every other round; a variant faster by more than BAND_TIE replaces the winner, else the winner stays."""
    import sys

    import fluxrt.gemm  # noqa: F401 - fluxrt.gemm.autotune is also the function's name there

    at = sys.modules["fluxrt.gemm.autotune"]
    clock = _Clock()
    win, v1, v2 = (_FakeTimed([1.0], clock) for _ in range(3))
    alone = {id(win): 100.0, id(v1): 98.0, id(v2): 99.5}
    order = []
    kept, us, med, dropped = at._refine_bands(win, [v1, v2], 2, lambda t: order.append(t) or alone[id(t)])
    assert order == [win, v1, v2, v2, v1, win]
    assert kept is v1 and us == 98.0 and set(med) == {id(win), id(v1), id(v2)} and dropped == []
    alone[id(v1)] = 99.5   # within BAND_TIE: the winner stays
    kept, us, _, _ = at._refine_bands(win, [v1, v2], 2, lambda t: alone[id(t)])
    assert kept is win and us == 100.0
    assert win.n == v1.n == v2.n == 0   # time_one given: no replay through us()
