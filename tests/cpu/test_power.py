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


def test_sustained_setting_from_the_environment():
    from fluxrt.errors import GemmArgumentError
    from fluxrt.gemm.autotune import sustained_default

    assert sustained_default({}) == 0.0
    assert sustained_default({"FLUXRT_GEMM_TUNE_SUSTAINED_MS": " 500 "}) == 500.0
    for bad in ("-1", "fast", "nan"):
        with pytest.raises(GemmArgumentError, match="FLUXRT_GEMM_TUNE_SUSTAINED_MS"):
            sustained_default({"FLUXRT_GEMM_TUNE_SUSTAINED_MS": bad})


def test_tune_cli_takes_sustained_milliseconds():
    import argparse

    from fluxrt.gemm.__main__ import _milliseconds

    assert _milliseconds("250") == 250.0
    for bad in ("-5", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            _milliseconds(bad)
