"""GEMM autotuning: time candidate plans once per problem and keep the winner in an on-disk cache.

A problem is (M, N, K, input dtype, output dtype, layout of B); the cache is one JSON file per GPU model,
driver version and GEMM kernel source hash, so a driver update or a kernel change starts a fresh file
instead of trusting stale timings. Files live in ``$FLUXRT_GEMM_TUNE_DIR`` (default
``~/.cache/fluxrt/gemm-tune``); every write merges with what is on disk under an exclusive file lock and
replaces the file atomically, so ranks of one job may tune at the same time.

    plan = fluxrt.gemm.autotune(a, w, trans_b=True).plan      # time the candidates on these arrays
    fluxrt.gemm.gemm(a, w, trans_b=True)                      # later calls take the tuned plan
    python -m fluxrt.gemm tune --suite core                   # tune a whole shape suite
    python -m fluxrt.gemm cache show | path | clear

With ``FLUXRT_GEMM_AUTOTUNE=1`` a :func:`fluxrt.gemm.gemm` call whose problem is not in the cache tunes
it first (outside CUDA-graph capture; a capturing call takes the heuristic plan).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..env import env_flag
from ..errors import GemmArgumentError
from ..streams import as_cupy_stream
from .plan import (H100_H200_SMS, GemmPlan, cluster_n_plans, fitted_plans, fitted_stream_k_plans, fp8_heuristic_plan, fp8_plans, heuristic_plan, max_stages, pingpong_plans,
                   plain_plans, split_plans, stream_k_plans, tall_plans, tile_order)

log = logging.getLogger("fluxrt.gemm")

_lock = threading.Lock()
_tables: dict = {}         # cache file path -> {problem key: plan dict}


@dataclass(frozen=True)
class TuneResult:
    """What :func:`autotune` found: the winning plan, its time, and every candidate's time (None: failed)."""
    plan: GemmPlan
    us: float
    timings: tuple = field(default=())     # ((plan description, us or None), ...): the screen's us, or the
    cached: bool = False                   # confirmation's median for the plans named in `confirmed`
    confirmed: tuple = field(default=())


def problem_key(m: int, n: int, k: int, in_dtype: str, out_dtype: str, trans_b: bool) -> str:
    return f"{m}x{n}x{k}:{in_dtype}:{out_dtype}:{'NK' if trans_b else 'KN'}"


def _kernel_hash() -> str:
    from ..toolchain import kernel_root

    h = hashlib.sha256()
    root = kernel_root()
    for p in sorted([*(root / "gemm").rglob("*"), *(root / "include").rglob("*")]):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h"):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def tune_dir() -> Path:
    return Path(os.environ.get("FLUXRT_GEMM_TUNE_DIR") or Path.home() / ".cache" / "fluxrt" / "gemm-tune")


_paths: dict = {}


def cache_path(device_id: int | None = None) -> Path:
    """The cache file of a device (default: the current one): GPU model, driver, kernel hash."""
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device_id is None else device_id
    p = _paths.get(dev)
    if p is None:
        name = cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode()
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
        driver = cupy.cuda.runtime.driverGetVersion()
        p = _paths[dev] = tune_dir() / f"{slug}-drv{driver}-k{_kernel_hash()}.json"
    return p


def _read(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return doc.get("plans", {}) if isinstance(doc, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("gemm tune cache %s unreadable (%s); ignoring it", path, e)
        return {}


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _table(path: Path) -> dict:
    with _lock:
        t = _tables.get(path)
    if t is None:
        t = _read(path)
        with _lock:
            _tables[path] = t
    return t


def store(path: Path, entries: dict) -> None:
    """Merge `entries` ({problem key: {"plan": ..., "us": ...}}) into the cache file, atomically."""
    from ..toolchain import _atomic_write   # not at import: `python -m fluxrt.toolchain` imports this package

    with _file_lock(path):
        merged = _read(path)
        merged.update(entries)
        _atomic_write(path, json.dumps({"format": 1, "plans": merged}, indent=1, sort_keys=True).encode())
    with _lock:
        _tables[path] = merged
    from .launch import clear_launch_cache

    clear_launch_cache()


def clear(device_id: int | None = None) -> Path:
    """Delete the cache file of a device; returns its path."""
    path = cache_path(device_id)
    with _file_lock(path):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    with _lock:
        _tables.pop(path, None)
    from .launch import clear_launch_cache

    clear_launch_cache()
    return path


def _plan_from(d: dict) -> GemmPlan | None:
    try:
        return GemmPlan(**{f.name: d[f.name] for f in dataclasses.fields(GemmPlan) if f.name in d})
    except (TypeError, ValueError):
        return None


def tuned_plan(m: int, n: int, k: int, in_dtype: str, out_dtype: str, trans_b: bool,
               device_id: int | None = None) -> GemmPlan | None:
    """The cached winner of a problem on a device, or None."""
    entry = _table(cache_path(device_id)).get(problem_key(m, n, k, in_dtype, out_dtype, trans_b))
    return _plan_from(entry["plan"]) if entry else None


def tuned_us(m: int, n: int, k: int, in_dtype: str, out_dtype: str, trans_b: bool,
             device_id: int | None = None) -> float | None:
    """The cached winner's measured time in microseconds, or None (not tuned, or no cache for the device)."""
    try:
        entry = _table(cache_path(device_id)).get(problem_key(m, n, k, in_dtype, out_dtype, trans_b))
    except Exception as e:   # no GPU to name the cache file
        log.debug("gemm tune cache not consulted: %s", e)
        return None
    us = entry.get("us") if entry else None
    return float(us) if us else None


def plan_for(m: int, n: int, k: int, *, in_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
             trans_b: bool = False, device_id: int | None = None, num_sms: int | None = None) -> GemmPlan:
    """The plan a :func:`fluxrt.gemm.gemm` call takes: the tuned one if the cache has it, else the
    heuristic's (:func:`fluxrt.gemm.plan.heuristic_plan`)."""
    try:
        tuned = tuned_plan(m, n, k, in_dtype, out_dtype, trans_b, device_id)
    except Exception as e:   # no GPU to name the cache file: the heuristic alone
        log.debug("gemm tune cache not consulted: %s", e)
        tuned = None
    if tuned is not None:
        return tuned
    return heuristic_plan(m, n, k, in_dtype=in_dtype, out_dtype=out_dtype, trans_b=trans_b,
                          num_sms=num_sms or H100_H200_SMS)


def candidates(m: int, n: int, k: int, out_dtype: str = "bfloat16", num_sms: int = H100_H200_SMS, *,
               trans_b: bool = False) -> list[GemmPlan]:
    """The plans autotuning times: the heuristic's whole choice set (every tile shape the planner knows at its
    deepest ring, grouped order, its split-K and stream-K plans, and with B as [N, K] the fitted widths), so the
    heuristic's own pick is always among them, plus the split-K plans of ragged waves (``partial_waves``), which the
    model cannot rank, the deeper rings of :func:`deep_ring_plans` (of the plain and the stream-K plans), the
    clusters along N of :func:`cluster_n_plans`, the ping-pong plans of :func:`pingpong_plans`, the fitted widths
    with B as [K, N] too (:func:`fitted_plans` with its rings), the wider ones also in pairs along M and in stream-K
    form (:func:`fitted_stream_k_plans`), and the 256-row tiles of :func:`tall_plans`."""
    stream_k = stream_k_plans(m, n, k, out_dtype, num_sms, every_shape=True)
    return (plain_plans(m, out_dtype) + deep_ring_plans(m, out_dtype) + cluster_n_plans(m, out_dtype, n)
            + pingpong_plans(m, out_dtype)
            + split_plans(m, n, k, out_dtype, num_sms, partial_waves=True)
            + stream_k + deep_ring_plans(m, out_dtype, stream_k)
            + fitted_plans(m, out_dtype, b_kmajor=trans_b, pairs=True)
            + fitted_stream_k_plans(m, n, k, out_dtype, num_sms, b_kmajor=trans_b)
            + tall_plans(m, n, k, out_dtype, num_sms, b_kmajor=trans_b))


def build_candidates(problems, jobs: int | None = None, num_sms: int = H100_H200_SMS) -> tuple[int, int]:
    """Compile the kernels that tuning ``problems`` will time (on a GPU of ``num_sms`` SMs), ``jobs`` NVRTC compiles
    at once, so that a suite's tuning does not compile its configurations one by one between timings. problems:
    (m, n, k, in_dtype, out_dtype, trans_b) of 16-bit GEMMs. A configuration that fails to build is logged and left
    to autotune, which skips it. Returns (distinct configurations, failed ones)."""
    from ..toolchain import compile_many
    from .kernel import KERNEL_SOURCE, compile_options, plain_defines

    options = []
    for m, n, k, in_dtype, out_dtype, trans_b in problems:
        options += [compile_options(plain_defines(p, in_dtype, out_dtype, trans_b))   # the heuristic's pick among them
                    for p in candidates(m, n, k, out_dtype, num_sms, trans_b=trans_b)]
    options = list(dict.fromkeys(options))
    built = compile_many(KERNEL_SOURCE, options, jobs, keep_going=True)
    return len(options), sum(path is None for path in built)


# Tiles whose stage is at most SMALL_STAGE_BYTES (64 x 64, 64 x 128, 128 x 64) are also candidates at rings of up to
# SMALL_STAGE_MAX_STAGES (docs/tuning.md: 1.04-1.13x at 256x4096x6144 NK and 1024x1024x6144 KN).
SMALL_STAGE_BYTES = 24 * 1024
SMALL_STAGE_MAX_STAGES = 8


def deep_ring_plans(m: int, out_dtype: str = "bfloat16", plans: list[GemmPlan] | None = None) -> list[GemmPlan]:
    """The plans (default: the plain plans) whose ring gets deeper when the two consumers share one C staging
    buffer (their epilogues then take turns): with 16-bit output 128x256 with 4 stages instead of 3, 128x192 with 5
    instead of 4. Measured on H200: plain plans within a few percent of the per-consumer plan either way; 128x256
    stream-K on ten large off-grid shapes, 1-5 % ahead on 9 of them with pairs (2 % behind on one), 0.4-7 % behind on
    all without a cluster (`gemm-offgrid-study-*`). So only the autotuner tries them. The tiles whose stage is at most
    SMALL_STAGE_BYTES get rings of up to SMALL_STAGE_MAX_STAGES instead (their C staging stays per consumer)."""
    out = []
    for plan in plain_plans(m, out_dtype) if plans is None else plans:
        if plan.stage_bytes() <= SMALL_STAGE_BYTES and not plan.stream_k and plan.split_k == 1:
            deeper = min(max_stages(plan.block_m, plan.block_n, out_dtype), SMALL_STAGE_MAX_STAGES)
            if deeper > plan.stages:
                out.append(dataclasses.replace(plan, stages=deeper))
        elif plan.consumers == 2:
            deeper = min(max_stages(plan.block_m, plan.block_n, out_dtype, c_staging="shared"), 6)
            if deeper > plan.stages:
                out.append(dataclasses.replace(plan, stages=deeper, c_staging="shared"))
    return out


# Confirmation: the screen's finalists are timed again, interleaved, before one is kept (see autotune()).
FINALIST_BAND = 0.05       # candidates within 5 % of the screen's best are finalists ...
MAX_FINALISTS = 4          # ... at most this many (the heuristic's plan joins them in any case)
CONFIRM_ROUNDS = 7
HEURISTIC_TIE = 0.01       # the heuristic's plan stays unless a finalist beats it by more than 1 %
WARM_UP_MS = 30.0          # GPU time run before the screen, so that its first candidates do not meet idle clocks

_streams: dict = {}        # device -> the private stream candidates are captured and timed on
_tuning_lock = threading.Lock()   # one tuning at a time: another thread's launch must not land in a capture


def _tuning_stream(device: int):
    """A non-blocking stream of the device for the timing graphs (capture needs a stream other than the
    legacy default one, which is what callers usually pass). Callers hold _tuning_lock."""
    import cupy

    s = _streams.get(device)
    if s is None:
        with cupy.cuda.Device(device):
            s = _streams[device] = cupy.cuda.Stream(non_blocking=True)
    return s


def _stream_k_timed_out(stream, device: int) -> bool:
    """After the stream's work: whether a stream-K fixup wait timed out, so that no plan is kept on the time of
    a launch that gave up waiting. Then the record is cleared and the stream's stream-K counters, which may
    hold counts, are dropped (other streams' workspaces are left alone)."""
    from ..errors import WaitTimeoutError
    from . import stream_k
    from .split_k import release_workspaces

    stream.synchronize()
    try:
        stream_k.check_errors()
    except WaitTimeoutError as e:
        log.warning("gemm autotune: a stream-K candidate timed out (%s); stream-K plans are left out", e)
        stream_k.clear_record()
        release_workspaces(device, stream.ptr, zeroed_only=True)
        return True
    return False


class _Timed:
    """One candidate under test: its launch, captured `reps` times into a CUDA graph (eager launches when
    the capture fails), timed one replay at a time with CUDA events."""

    def __init__(self, plan: GemmPlan, packed, stream, reps: int):
        self.plan, self.packed, self.stream, self.reps = plan, packed, stream, reps
        self.graph = None
        try:
            stream.begin_capture()
            try:
                for _ in range(reps):
                    packed.launch(stream.ptr)
            finally:
                graph = stream.end_capture()
            self.graph = graph
        except Exception as e:   # noqa: BLE001 - any capture failure falls back to eager timing
            log.info("gemm autotune: %s does not capture (%s); timing eager launches", plan.describe(), e)
            stream.synchronize()

    def us(self) -> float:
        """Microseconds per call, from one replay of the graph (or `reps` eager launches)."""
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.stream)
        if self.graph is not None:
            self.graph.launch(self.stream)
        else:
            for _ in range(self.reps):
                self.packed.launch(self.stream.ptr)
        end.record(self.stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / self.reps


def _pick(screen: list, default_plan: GemmPlan | None, confirm_rounds: int) -> tuple:
    """Screen -> finalists -> interleaved confirmation. screen: [(_Timed, us)] of the candidates that ran.
    Returns (winner _Timed, its us, {id(_Timed): confirmed median us})."""
    ranked = sorted(screen, key=lambda x: x[1])
    best_us = ranked[0][1]
    finalists = [t for t, us in ranked[:MAX_FINALISTS] if us <= best_us * (1 + FINALIST_BAND)]
    default = next((t for t, _ in screen if t.plan == default_plan), None)
    if default is not None and default not in finalists:
        finalists.append(default)
    if len(finalists) == 1 or confirm_rounds <= 0:
        win, win_us = ranked[0]
        default_us = next((us for t, us in screen if t is default), None)
        if default_us is not None and default_us <= win_us * (1 + HEURISTIC_TIE):
            win, win_us = default, default_us
        return win, win_us, {}
    times: dict = {id(t): [] for t in finalists}
    for _ in range(confirm_rounds):   # interleaved: clock or thermal drift falls on every finalist alike
        for t in finalists:
            times[id(t)].append(t.us())
    med = {key: statistics.median(v) for key, v in times.items()}
    win = min(finalists, key=lambda t: med[id(t)])
    if default is not None and med[id(default)] <= med[id(win)] * (1 + HEURISTIC_TIE):
        win = default
    return win, med[id(win)], med


# Sustained confirmation (autotune(sustained_ms=...), `tune --sustained MS`): under a long load an H200 runs at its
# power limit and the driver sets the SM clock from the power the running kernel draws, so a plan's time in a job
# that runs it follows its energy per call. The screen times every candidate beside the reference, at the clock of
# their mix, which ranks plans of different energy wrongly by up to ~10 % (docs/tuning.md, "At the power limit").
# The screen's SUSTAINED_FINALISTS best (and the heuristic's plan) then each run alone for sustained_ms, twice in
# opposite orders; the lowest mean of the two second-half medians wins.
SUSTAINED_FINALISTS = 8
SUSTAINED_MAX_REPLAYS = 100_000


def _alone_us(timed, sustained_ms: float, clock=time.perf_counter) -> float:
    """``timed`` replayed back to back for ``sustained_ms`` of wall time (host gaps between replays included, as the
    GPU sees them): the median us per call of the replays in the second half (the first brings the clock to where
    this plan's power puts it). At most SUSTAINED_MAX_REPLAYS replays."""
    samples, t0 = [], clock()
    while (at := (clock() - t0) * 1e3) < sustained_ms and len(samples) < SUSTAINED_MAX_REPLAYS:
        samples.append((at, timed.us()))
    if not samples:
        samples.append((0.0, timed.us()))
    late = [us for at, us in samples if at >= sustained_ms / 2] or [samples[-1][1]]
    return statistics.median(late)


def _pick_sustained(screen: list, default_plan: GemmPlan | None, sustained_ms: float) -> tuple:
    """Screen -> its SUSTAINED_FINALISTS best (and the heuristic's plan) -> each alone (_alone_us), two passes in
    opposite orders. Returns (winner _Timed, its us, {id(_Timed): mean us})."""
    ranked = sorted(screen, key=lambda x: x[1])
    finalists = [t for t, _ in ranked[:SUSTAINED_FINALISTS]]
    default = next((t for t, _ in screen if t.plan == default_plan), None)
    if default is not None and default not in finalists:
        finalists.append(default)
    times: dict = {id(t): [] for t in finalists}
    for order in (finalists, finalists[::-1]):
        for t in order:
            times[id(t)].append(_alone_us(t, sustained_ms))
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    win = min(finalists, key=lambda t: mean[id(t)])
    if default is not None and mean[id(default)] <= mean[id(win)] * (1 + HEURISTIC_TIE):
        win = default
    return win, mean[id(win)], mean


# Band refinement: after the pick, the winner's tile order with other band heights (tile rows per band of the
# grouped order) is timed against it. The band height moves the L2 reuse of a GEMM of many waves by several
# percent with no rule the model could use (docs/tuning.md, `ORDER_BANDS`).
ORDER_BANDS = (4, 8, 16, 32)
BAND_TIE = 0.01            # a band height replaces the winner's only when faster by more than 1 %


def band_variants(plan: GemmPlan, m: int, n: int, num_sms: int = H100_H200_SMS) -> list[GemmPlan]:
    """``plan`` with each other band height of ORDER_BANDS whose tile order (:func:`tile_order`, the kernel's walk)
    is new, for a whole-tile plan (no split-K, no stream-K) in grouped order whose work items fill at least two
    waves; [] otherwise. (A band of all the tile rows, or any band over one slot column, walks the same order.)"""
    if plan.order != "grouped" or plan.split_k > 1 or plan.stream_k:
        return []
    mt, nt = plan.tiles(m, n)
    if -(-mt // plan.cluster) * -(-nt // plan.cluster_n) < 2 * (num_sms // plan.cluster_ctas):
        return []
    seen, out = {tuple(tile_order(plan, m, n))}, []
    for g in ORDER_BANDS:
        variant = dataclasses.replace(plan, group_m=g)
        order = tuple(tile_order(variant, m, n))
        if order not in seen:
            seen.add(order)
            out.append(variant)
    return out


def _refine_bands(win, variants: list, rounds: int, time_one=None) -> tuple:
    """The winner and its band variants timed in turn ``rounds`` times (``time_one(t)``: one replay, or with the
    sustained confirmation :func:`_alone_us`), the order reversed every other round; a variant replaces the winner
    when its median is more than BAND_TIE below the winner's. A variant whose timing raises is dropped (the winner's
    raising fails the tuning). Returns (kept _Timed, its median us, {id: median us} of the winner and the variants
    still timed, [dropped variants])."""
    time_one = time_one or (lambda t: t.us())
    timed, dropped = [win, *variants], []
    times: dict = {id(t): [] for t in timed}
    for r in range(rounds):
        for t in list(timed) if r % 2 == 0 else list(timed)[::-1]:
            try:
                times[id(t)].append(time_one(t))
            except Exception:   # noqa: BLE001 - one variant's failure is not the tuning's
                if t is win:
                    raise
                timed.remove(t)
                dropped.append(t)
    med = {id(t): statistics.median(times[id(t)]) for t in timed}
    rest = [t for t in timed if t is not win]
    best = min(rest, key=lambda t: med[id(t)]) if rest else win
    kept = best if med[id(best)] < med[id(win)] * (1 - BAND_TIE) else win
    return kept, med[id(kept)], med, dropped


def autotune(a, b, out=None, *, trans_b: bool = False, out_dtype: str | None = None, stream=None,
             plans: list[GemmPlan] | None = None, reps: int = 10, rounds: int = 3, confirm_rounds: int = CONFIRM_ROUNDS,
             force: bool = False, fp8_format=None, scale_a=None, scale_b=None,
             sustained_ms: float | None = None) -> TuneResult:
    """Time candidate plans for ``a @ b`` (or ``a @ b.T``) on these arrays and keep the fastest in the cache.
    fp8 (``fp8_format``, scales: as :func:`fluxrt.gemm.gemm`): the candidates are :func:`fp8_plans` of the
    call's scale mode, and the cache key names both fp8 types and the mode.

    How a plan is timed, as the suite benchmark times it: ``reps`` launches captured in one CUDA graph,
    microseconds per call of a replay (CUDA events). Warm-up: ``WARM_UP_MS`` of the heuristic's plan (the
    reference), so nothing is timed on idle clocks. Screen: every candidate ``rounds`` times, each replay
    right after one of the reference; its score is the median ratio to the reference times the reference's
    median (the clocks of a loaded GPU drift more within seconds than good plans differ). Confirmation: the
    finalists (within ``FINALIST_BAND`` of the screen's best, at most ``MAX_FINALISTS``, and the heuristic's
    own plan) replayed interleaved ``confirm_rounds`` times; the lowest median wins, except that the
    heuristic's plan stays unless beaten by more than ``HEURISTIC_TIE`` (so a near-tie does not swap the plan
    an untuned run takes for one that only won on noise). Band refinement (the default candidates only): the
    winner's other band heights (:func:`band_variants`) replayed interleaved with it, at least 3 rounds even with
    ``confirm_rounds=0``; one replaces it (the heuristic's plan included) when faster by more than ``BAND_TIE``.
    ``sustained_ms`` > 0 (default: ``$FLUXRT_GEMM_TUNE_SUSTAINED_MS``, else 0): the confirmation times the screen's
    SUSTAINED_FINALISTS best each alone under a load of that many milliseconds instead (:func:`_pick_sustained`):
    the plan fastest at the GPU's power limit, as a job that runs it back to back sees it.

    Runs after the work queued on ``stream``, on a private stream of the device, writing into ``out`` (a
    scratch array when None), and returns when it is done: not for use inside a CUDA-graph capture. A problem
    already in the cache returns its entry unless ``force``.
    """
    import cupy

    from .checks import validate_gemm_args

    fp8 = None
    if fp8_format is not None:
        from .checks import validate_fp8_args

        fp8 = validate_fp8_args(a, b, out, trans_b=trans_b, fp8_format=fp8_format, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=out_dtype)
        m, n, k, in_dt, out_dt = fp8.m, fp8.n, fp8.k, fp8.key_dtype, fp8.out_dtype
    else:
        m, n, k, in_dt, out_dt = validate_gemm_args(a, b, out, trans_b=trans_b, out_dtype=out_dtype)
    dev = cupy.cuda.runtime.getDevice()
    path = cache_path(dev)
    key = problem_key(m, n, k, in_dt, out_dt, trans_b)
    if not force and plans is None and (hit := _cached(path, key)) is not None:
        return hit
    from .kernel import _num_sms

    sms = _num_sms(dev)
    if fp8 is not None:
        default_plan = fp8_heuristic_plan(m, n, k, scale=fp8.scale, out_dtype=out_dt, num_sms=sms)
        cands = plans if plans is not None else fp8_plans(m, fp8.scale, out_dt)
    else:
        default_plan = heuristic_plan(m, n, k, in_dtype=in_dt, out_dtype=out_dt, trans_b=trans_b, num_sms=sms)
        cands = plans if plans is not None else candidates(m, n, k, out_dt, sms, trans_b=trans_b)
    if not cands:
        raise GemmArgumentError(f"gemm autotune: no candidate plan for {key}")
    sustained_ms = sustained_default() if sustained_ms is None else _check_ms(sustained_ms, "gemm autotune: sustained_ms")
    with _tuning_lock:
        # another thread may have tuned it while this one waited
        if not force and plans is None and (hit := _cached(path, key)) is not None:
            return hit
        return _tune(a, b, out, key=key, path=path, dev=dev, fp8=fp8, fp8_format=fp8_format, scale_a=scale_a,
                     scale_b=scale_b, trans_b=trans_b, out_dtype=out_dtype, out_dt=out_dt, m=m, n=n, stream=stream,
                     cands=cands, default_plan=default_plan, reps=reps, rounds=rounds, confirm_rounds=confirm_rounds,
                     refine_bands=plans is None, num_sms=sms, sustained_ms=sustained_ms)


def _cached(path, key) -> TuneResult | None:
    entry = _table(path).get(key)
    plan = _plan_from(entry["plan"]) if entry else None
    return TuneResult(plan, float(entry.get("us", 0.0)), cached=True) if plan is not None else None


def _tune(a, b, out, *, key, path, dev, fp8, fp8_format, scale_a, scale_b, trans_b, out_dtype, out_dt, m, n, stream,
          cands, default_plan, reps, rounds, confirm_rounds, refine_bands, num_sms, sustained_ms=0.0) -> TuneResult:
    """autotune()'s timing and choice, under _tuning_lock. Everything runs on the private stream, after the
    caller's queued work; the operands are imported with that stream current (so a DLPack producer's stream
    is ordered before it); the winner's launch is the last one, so ``out`` holds its product."""
    import cupy

    from .launch import _prepare, _stream_ptr
    from .split_k import release_workspaces

    ts = _tuning_stream(dev)
    after_user = cupy.cuda.Event(disable_timing=True)
    after_user.record(as_cupy_stream(_stream_ptr(stream)))
    ts.wait_event(after_user)
    t0 = time.perf_counter()
    failed = []
    try:
        with ts:
            if out is None:
                if fp8 is not None:
                    from ..dtypes import normalize_dtype

                    out = cupy.empty((m, n), dtype=normalize_dtype(out_dt))
                else:
                    out = cupy.empty((m, n), dtype=cupy.dtype(a.dtype) if out_dtype is None else out_dtype)

            def prepare_timed(plan):
                try:
                    if fp8 is not None:
                        from .fp8 import prepare as prepare_fp8

                        packed, _, _ = prepare_fp8(a, b, out, fp8_format=fp8_format, scale_a=scale_a,
                                                   scale_b=scale_b, plan=plan, out_dtype=out_dtype)
                    else:
                        packed, _, _ = _prepare(a, b, out, trans_b=trans_b, plan=plan, out_dtype=out_dtype,
                                                wait=None, epilogue=None, stream_ptr=ts.ptr)
                    for _ in range(2):   # the first launch loads the module
                        packed.launch(ts.ptr)
                    return _Timed(plan, packed, ts, reps)
                except Exception as e:   # a candidate that does not build or launch is skipped, not fatal
                    log.info("gemm autotune %s: %s failed: %s", key, plan.describe(), e)
                    ts.synchronize()
                    failed.append(plan)
                    return None

            prepared = [t for t in map(prepare_timed, cands) if t is not None]
        if not prepared:
            raise GemmArgumentError(f"gemm autotune: every candidate failed for {key}")
        # Screen. The clocks of a loaded GPU drift by 10-15 % within seconds (power and temperature), more than
        # the gaps between good plans, so each candidate is timed in turn with a reference plan (the
        # heuristic's) and scored by its time relative to the reference's, in the reference's median us.
        ref = next((t for t in prepared if t.plan == default_plan), prepared[0])
        warm_ms, n_warm = 0.0, 0
        while warm_ms < WARM_UP_MS and n_warm < 1000:   # clocks up before anything is timed
            warm_ms += ref.us() * reps / 1e3
            n_warm += 1
        ratios, ref_us = {}, []
        for timed in prepared:
            rs = []
            for _ in range(rounds):
                r = ref.us()   # the reference failing fails the tuning
                try:
                    rs.append(timed.us() / r)
                except Exception as e:   # noqa: BLE001 - one candidate's failure is not the tuning's
                    if timed is ref:
                        raise
                    log.info("gemm autotune %s: %s failed while timed: %s", key, timed.plan.describe(), e)
                    ts.synchronize()
                    failed.append(timed.plan)
                    rs = None
                    break
                ref_us.append(r)
            if rs is not None:
                ratios[id(timed)] = statistics.median(rs)
        ref_med = statistics.median(ref_us)
        screen = [(t, ratios[id(t)] * ref_med) for t in prepared if id(t) in ratios]
        while True:   # the stream-K record is sticky: one look after the screen and confirmation covers both
            if not screen:
                raise GemmArgumentError(f"gemm autotune: every candidate failed for {key}")
            if sustained_ms > 0:
                win, best_us, confirmed = _pick_sustained(screen, default_plan, sustained_ms)
            else:
                win, best_us, confirmed = _pick(screen, default_plan, confirm_rounds)
            if not (any(t.plan.stream_k for t, _ in screen) and _stream_k_timed_out(ts, dev)):
                break
            failed += [t.plan for t, _ in screen if t.plan.stream_k]
            screen = [(t, us) for t, us in screen if not t.plan.stream_k]
        if refine_bands:
            with ts:
                variants = [t for t in map(prepare_timed, band_variants(win.plan, m, n, num_sms)) if t is not None]
            if variants:
                if sustained_ms > 0:   # the variants alone too, so that every confirmed time is of one kind
                    win, best_us, band_med, dropped = _refine_bands(win, variants, 2,
                                                                    lambda t: _alone_us(t, sustained_ms))
                else:
                    win, best_us, band_med, dropped = _refine_bands(win, variants, max(confirm_rounds, 3))
                if dropped:
                    ts.synchronize()
                    for t in dropped:
                        log.info("gemm autotune %s: %s failed while timed", key, t.plan.describe())
                    failed += [t.plan for t in dropped]
                screen += [(t, band_med[id(t)]) for t in variants if id(t) in band_med]
                confirmed = {**confirmed, **band_med}   # the winner's entry too: all of one interleaved timing
        win.packed.launch(ts.ptr)   # the last launch: `out` holds the kept plan's product
    finally:
        try:
            ts.synchronize()
        finally:
            release_workspaces(dev, ts.ptr)   # up to a GiB of partials that no later call on this stream needs
    if win.plan.stream_k:
        from . import stream_k

        stream_k.check_errors()   # the kept plan's own last launch
    best = win.plan
    store(path, {key: {"plan": dataclasses.asdict(best), "us": round(best_us, 3),
                       "date": time.strftime("%Y-%m-%d"), "sustained_ms": sustained_ms}})
    log.info("gemm autotune %s: %s at %.1f us (%d candidates, %d confirmed, %.1f s)", key, best.describe(), best_us,
             len(cands), len(confirmed), time.perf_counter() - t0)
    timings = [(t.plan.describe(), confirmed.get(id(t), us)) for t, us in screen]
    timings += [(p.describe(), None) for p in failed]
    return TuneResult(best, best_us, tuple(timings), confirmed=tuple(t.plan.describe() for t, _ in screen
                                                                    if id(t) in confirmed))


def autotune_on() -> bool:
    return env_flag("FLUXRT_GEMM_AUTOTUNE", False)


def sustained_default(env=None, unset: float = 0.0) -> float:
    """``$FLUXRT_GEMM_TUNE_SUSTAINED_MS`` (milliseconds of load per finalist in autotune's sustained confirmation),
    ``unset`` when it is not set; GemmArgumentError for a value that is not a finite number >= 0."""
    text = (os.environ if env is None else env).get("FLUXRT_GEMM_TUNE_SUSTAINED_MS", "").strip()
    return _check_ms(text, "FLUXRT_GEMM_TUNE_SUSTAINED_MS") if text else unset


def _check_ms(value, what: str) -> float:
    """``value`` as finite milliseconds >= 0, else GemmArgumentError naming ``what``."""
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = float("nan")
    if not (math.isfinite(ms) and ms >= 0):
        raise GemmArgumentError(f"{what}={value!r}: expected milliseconds >= 0 (finite)")
    return ms
