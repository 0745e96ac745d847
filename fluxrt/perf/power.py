"""GPU power, SM clock and clock-limit reasons while a benchmark runs, sampled by ``nvidia-smi`` (the driver's own
tool, present wherever the NVIDIA driver is; no Python NVML binding needed).

An H200 under a long GEMM load runs at its power limit: the driver lowers the SM clock until the board draws
about its cap, so a kernel's time at steady state depends on the energy it spends per call as much as on its
cycles. Benchmarks use :class:`PowerSampler` to record that state beside their times::

    with PowerSampler(pci_bus_id) as s:
        ...                                   # the timed work
    print(summarize(s.samples, since=1.5))    # mean power and clock over the samples after 1.5 s

Without nvidia-smi the sampler records nothing (``available`` False) and the benchmark's times stand alone.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import threading
import time

log = logging.getLogger("fluxrt.perf")

QUERY = "power.draw,clocks.sm,temperature.gpu,clocks_event_reasons.active"

# nvidia-smi's clocks_event_reasons bits (nvidia-smi --help-query-gpu).
CLOCK_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float          # seconds since the sampler started
    power_w: float
    sm_mhz: float
    temp_c: float
    reasons: int      # CLOCK_REASONS bits


def parse_line(line: str, t: float) -> Sample | None:
    """One line of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` -> Sample; None for a line that
    is not one (a field reported as [N/A], a warning)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return Sample(t, float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16))
    except ValueError:
        return None


def reason_names(bits: int) -> list[str]:
    """The names of the clock-limit bits set in ``bits`` (an unknown one as its hex value); ["none"] for 0."""
    if bits == 0:
        return ["none"]
    names = [name for bit, name in CLOCK_REASONS.items() if bits & bit]
    unknown = bits & ~sum(CLOCK_REASONS)
    return names + ([hex(unknown)] if unknown else [])


def summarize(samples: list[Sample], since: float = 0.0) -> dict:
    """Mean power and SM clock, peak temperature and every clock-limit reason seen, over the samples taken at or
    after ``since`` seconds (all of them when none is that late); {} without samples."""
    late = [s for s in samples if s.t >= since] or list(samples)
    if not late:
        return {}
    bits = 0
    for s in late:
        bits |= s.reasons
    return {"power_w": sum(s.power_w for s in late) / len(late), "sm_mhz": sum(s.sm_mhz for s in late) / len(late),
            "temp_c_max": max(s.temp_c for s in late), "clock_reasons": reason_names(bits), "samples": len(late)}


class PowerSampler:
    """Samples one GPU (``device``: its PCI bus id, or an nvidia-smi index) every ``interval_ms`` while the
    ``with`` block runs; the samples are in ``samples`` afterwards."""

    def __init__(self, device: str, interval_ms: int = 100):
        self.device = str(device)
        self.interval_ms = int(interval_ms)
        self.samples: list[Sample] = []
        self.available = shutil.which("nvidia-smi") is not None
        self._proc = None
        self._reader = None
        self._t0 = 0.0

    def __enter__(self) -> "PowerSampler":
        if not self.available:
            log.info("nvidia-smi not found: no power or clock samples")
            return self
        self._t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", self.device, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            s = parse_line(line, time.perf_counter() - self._t0)
            if s is not None:
                self.samples.append(s)

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._reader.join(timeout=5)
        self._proc.stdout.close()
        self._proc = None
