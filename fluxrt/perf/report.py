"""Reporting for fluxrt's perf sweeps: nccl-tests-style tables, JSON result files, PNG plots, progress.

Nothing here touches the GPU: a benchmark measures, builds :class:`Row` objects, and hands them over.
The table puts fluxrt and a baseline (NCCL) side by side on one line per size, so a regression shows up
as a ratio below 1 without comparing two separate logs.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping, Sequence, TypeVar

from .sweep import format_size

log = logging.getLogger(__name__)

__all__ = ["ENV_PREFIXES", "Row", "Table", "algbw_gbps", "device_lines", "differences_line", "environment",
           "option_differences", "plot", "progress", "results_document", "version_line", "write_json"]

T = TypeVar("T")


def algbw_gbps(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s, as nccl-tests): bytes moved per call / time per call."""
    if time_us <= 0 or not math.isfinite(time_us):
        return 0.0
    return nbytes / (time_us * 1e-6) / 1e9


@dataclass
class Row:
    """One measurement: one implementation (``impl``, e.g. "fluxrt" or "nccl") at one message size.

    ``wrong`` is the number of wrong elements found by the check, or None when it was not checked.
    ``root`` is -1 for collectives without a root, as nccl-tests prints it. ``inplace``: the in-place
    variant (nccl-tests' second block). ``time_us`` is the per-rank times reduced by ``-a``;
    ``time_min_us`` / ``time_avg_us`` / ``time_max_us`` are their statistics over ranks (None if unknown).
    """

    bytes: int
    count: int
    dtype: str
    redop: str
    impl: str
    algo: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None = None
    root: int = -1
    inplace: bool = False
    time_min_us: float | None = None
    time_avg_us: float | None = None
    time_max_us: float | None = None
    scheme: str = ""     # fluxrt's algo as a (scheme, algorithm) pair (collectives_plan.ALGO_PAIRS); "" elsewhere
    algorithm: str = ""
    rel_err: float | None = None  # lossy (compressed) rows: ||out - float64 reference|| / ||reference||

    @classmethod
    def measured(cls, *, nbytes: int, count: int, dtype: str, redop: str, impl: str, algo: str,
                 time_us: float, busbw_factor: float, wrong: int | None = None,
                 root: int = -1, inplace: bool = False, stats: Mapping | None = None,
                 scheme: str = "", algorithm: str = "", rel_err: float | None = None) -> "Row":
        """A row with algbw and busbw derived from the time, so no caller gets the units wrong.
        ``stats``: {"min", "avg", "max"} over ranks (:func:`fluxrt.perf.sweep.rank_stats`)."""
        algbw = algbw_gbps(nbytes, time_us)
        stats = stats or {}
        return cls(bytes=nbytes, count=count, dtype=dtype, redop=redop, impl=impl, algo=algo,
                   time_us=time_us, algbw=algbw, busbw=algbw * busbw_factor, wrong=wrong, root=root,
                   inplace=inplace, time_min_us=stats.get("min"), time_avg_us=stats.get("avg"),
                   time_max_us=stats.get("max"), scheme=scheme, algorithm=algorithm, rel_err=rel_err)


# (name, unit, width) of the columns shared by all implementations, then of each implementation's block.
_COMMON = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 6), ("redop", "", 6),
           ("root", "", 5))
_PER_IMPL = (("time", "(us)", 9), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7), ("#wrong", "", 6))
_ALGO = ("algo", "", 10)


def _fmt_time(us: float) -> str:
    # nccl-tests' precision: fewer decimals as the number grows, so the column keeps its width.
    if us >= 1e4:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


class Table:
    """nccl-tests-style table with one block of columns per implementation and time ratios.

    ``impls[0]`` is the implementation under test (fluxrt); the others are baselines. Each ratio column
    is the fastest time of a group of baselines / ``impls[0]`` time, so > 1 means ``impls[0]`` is faster
    than the best of that group. ``ratios`` maps a column's name to its group (default: one column per
    baseline); the sweeps group NCCL's two modes (ordinary buffers, registered windows) into one column,
    so the ratio is always against the faster NCCL.
    ``inplace=True`` adds nccl-tests' in-place half: the out-of-place blocks (and their ratios), then the
    in-place ones; a row goes to the half its ``inplace`` says, and a line is one size, type, op and root.
    Lines go to ``out`` (stdout by default): printing is this class's job, unlike the rest of fluxrt.
    """

    def __init__(self, impls: Sequence[str] = ("fluxrt", "nccl"), out: IO[str] | None = None,
                 show_algo: bool = False, inplace: bool = False,
                 ratios: Mapping[str, Sequence[str]] | None = None) -> None:
        if not impls:
            raise ValueError("Table needs at least one implementation name")
        if len(set(impls)) != len(impls):
            raise ValueError(f"duplicate implementation names in {list(impls)}")
        self.impls = tuple(impls)
        if ratios is None:
            ratios = {b: (b,) for b in self.impls[1:]}
        self.ratios = {name: tuple(group) for name, group in ratios.items()}
        for name, group in self.ratios.items():
            if not group or set(group) - set(self.impls[1:]):
                raise ValueError(f"ratio {name!r}: its group {list(group)} must name baselines of {list(self.impls)}")
        self.out = out if out is not None else sys.stdout
        self.show_algo = show_algo
        self.inplace = inplace
        self.placements = (False, True) if inplace else (False,)
        self.rows: list[Row] = []
        per_impl = _PER_IMPL + ((_ALGO,) if show_algo else ())
        self._cols = list(_COMMON)
        for _ in self.placements:
            for _ in self.impls:
                self._cols.extend(per_impl)
            # One ratio column per group; its units cell names the group ("(nccl)").
            self._cols.extend(("ratio", f"({name})", max(6, len(name) + 2)) for name in self.ratios)
        self._block = len(per_impl)

    def best(self, by_impl: Mapping[str, Row], group: Sequence[str]) -> Row | None:
        """The fastest measured row of `group` among ``by_impl`` (None when none of them was measured)."""
        timed = [by_impl[i] for i in group if i in by_impl and by_impl[i].time_us > 0]
        return min(timed, key=lambda r: r.time_us) if timed else None

    def ratio_entries(self) -> list[dict]:
        """Every ratio of the table as JSON-able records: the line (size, type, op, root, placement), the
        ratio's name, the baseline that was fastest and its time / impls[0]'s time."""
        base, lines = self.impls[0], {}
        for r in self.rows:
            lines.setdefault((r.bytes, r.dtype, r.redop, r.root, bool(r.inplace)), {})[r.impl] = r
        out = []
        for (nbytes, dtype, redop, root, ip), by_impl in lines.items():
            b = by_impl.get(base)
            for name, group in self.ratios.items():
                best = self.best(by_impl, group)
                if b is None or best is None or b.time_us <= 0:
                    continue
                out.append({"bytes": nbytes, "dtype": dtype, "redop": redop, "root": root, "inplace": ip,
                            "ratio": name, "against": best.impl, "ratio_value": best.time_us / b.time_us})
        return out

    def label(self, impl: str, inplace: bool) -> str:
        """How the group line and the footer name one block."""
        if not self.inplace:
            return impl
        return f"{impl} {'in-place' if inplace else 'out-of-place'}"

    def _line(self, cells: Sequence[str], lead: str = " ") -> str:
        # Every cell right-aligned in its width and separated by one space; header lines swap the
        # leading space for '#', so data and header columns end at the same character.
        parts = [f"{c:>{w}}" for c, (_, _, w) in zip(cells, self._cols)]
        return lead + " ".join(parts)

    def _write(self, line: str) -> None:
        self.out.write(line.rstrip() + "\n")

    def header(self, preamble: Iterable[str] = ()) -> None:
        """Print the '#' lines: optional preamble (e.g. :func:`fluxrt.perf.sweep.describe`), then a
        group line naming each implementation over its block, the column names and their units."""
        for text in preamble:
            self._write(text if text.startswith("#") else "# " + text)
        if self.ratios:
            base = self.impls[0]
            others = ", ".join(f"{name} = {' or '.join(group)} time" + (" (the faster)" if len(group) > 1 else "")
                               + f" / {base} time" for name, group in self.ratios.items())
            self._write(f"# ratio ({others}): > 1: {base} faster")
        widths = [w for _, _, w in self._cols]
        group = "#" + " " * (sum(widths[:len(_COMMON)]) + len(_COMMON) - 1)
        start = len(_COMMON)
        for ip in self.placements:
            for name in self.impls:
                span = sum(widths[start:start + self._block]) + self._block
                group += self.label(name, ip).center(span)
                start += self._block
            nratio = len(self.ratios)
            group += " " * (sum(widths[start:start + nratio]) + nratio)
            start += nratio
        self._write(group)
        self._write(self._line([name for name, _, _ in self._cols], lead="#"))
        self._write(self._line([unit for _, unit, _ in self._cols], lead="#"))

    def add(self, rows: Sequence[Row]) -> str:
        """Print one line for one message size from its rows (at most one per implementation and
        placement). A block without a row shows N/A; the line printed is also returned."""
        if not rows:
            raise ValueError("Table.add needs at least one row")
        by_key: dict[tuple[str, bool], Row] = {}
        for r in rows:
            if r.impl not in self.impls:
                raise ValueError(f"row for unknown implementation {r.impl!r}; table has {self.impls}")
            if r.inplace and not self.inplace:
                raise ValueError(f"in-place row for {r.impl!r} in a table without in-place blocks")
            key = (r.impl, bool(r.inplace))
            if key in by_key:
                raise ValueError(f"two rows for {self.label(*key)!r} at {r.bytes} bytes")
            if r.bytes != rows[0].bytes:
                raise ValueError(f"rows of one line must share a size: {rows[0].bytes} vs {r.bytes}")
            by_key[key] = r
        first = rows[0]
        cells = [str(first.bytes), str(first.count), first.dtype, first.redop, str(first.root)]
        for ip in self.placements:
            for impl in self.impls:
                r = by_key.get((impl, ip))
                if r is None:
                    cells += ["N/A"] * self._block
                    continue
                cells += [_fmt_time(r.time_us), f"{r.algbw:.2f}", f"{r.busbw:.2f}",
                          "N/A" if r.wrong is None else str(r.wrong)]
                if self.show_algo:
                    cells.append(r.algo or "-")
            base = by_key.get((self.impls[0], ip))
            here = {impl: r for (impl, p), r in by_key.items() if p == ip}
            for group in self.ratios.values():
                other = self.best(here, group)
                if base is None or other is None or base.time_us <= 0:
                    cells.append("N/A")
                else:
                    cells.append(f"{other.time_us / base.time_us:.2f}")
        self.rows.extend(by_key[(i, ip)] for ip in self.placements for i in self.impls if (i, ip) in by_key)
        line = self._line(cells)
        self._write(line)
        return line

    def wrong_total(self, impl: str, inplace: bool | None = None) -> int | None:
        """Wrong elements summed over the sizes added for ``impl`` (one placement, or both when None);
        None if none of them was checked."""
        counts = [r.wrong for r in self.rows if r.impl == impl and r.wrong is not None
                  and (inplace is None or bool(r.inplace) == inplace)]
        return sum(counts) if counts else None

    def footer(self) -> None:
        """Print nccl-tests' closing lines per implementation (wrong values, average busbw) and the
        geometric mean of each ratio (the mean a ratio needs: 2x faster and 2x slower average to 1)."""
        lines: list[tuple[str, str]] = []
        for ip in self.placements:
            for impl in self.impls:
                wrong = self.wrong_total(impl, ip)
                status = "N/A" if wrong is None else (f"{wrong} OK" if wrong == 0 else f"{wrong} FAILED")
                lines.append((f"Wrong values ({self.label(impl, ip)})", status))
        for ip in self.placements:
            for impl in self.impls:
                bws = [r.busbw for r in self.rows if r.impl == impl and bool(r.inplace) == ip]
                lines.append((f"Avg bus bandwidth ({self.label(impl, ip)})",
                              f"{sum(bws) / len(bws):.3f}" if bws else "N/A"))
        base = self.impls[0]
        for ip in self.placements:
            entries = [e for e in self.ratio_entries() if e["inplace"] == ip]
            for name, group in self.ratios.items():
                ratios = [e["ratio_value"] for e in entries if e["ratio"] == name and e["ratio_value"] > 0]
                gm = f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}" if ratios else "N/A"
                suffix = f", {'in-place' if ip else 'out-of-place'}" if self.inplace else ""
                what = f"{' or '.join(group)} (the faster)" if len(group) > 1 else name
                lines.append((f"Geomean ratio ({what}/{base} time{suffix})", gm))
        label_w = max(len(label) for label, _ in lines)
        self._write("#")
        for label, value in lines:
            self._write(f"# {label:<{label_w}} : {value}")
        self._write("#")


def _git_commit() -> str:
    """$FLUXRT_COMMIT (for copies of a checkout without .git), else HEAD of the repository containing
    the current directory, else "unknown"."""
    if os.environ.get("FLUXRT_COMMIT"):
        return os.environ["FLUXRT_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.getcwd(), capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("git rev-parse failed: %s", exc)
        return "unknown"
    commit = res.stdout.strip()
    return commit if res.returncode == 0 and commit else "unknown"


#: Prefixes of the environment variables a results document records (they change what is measured).
ENV_PREFIXES = ("FLUXRT_", "NCCL_", "NVSHMEM_")


def environment(env: Mapping[str, str] | None = None, prefixes: Sequence[str] = ENV_PREFIXES) -> dict:
    """The FLUXRT_* / NCCL_* / NVSHMEM_* variables of ``env`` (default: os.environ), sorted by name."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k.startswith(tuple(prefixes))}


def results_document(bench: str, rows: Iterable[Row | Mapping], command: str | Sequence[str],
                     machine: Mapping | None = None, *, versions: Mapping | None = None,
                     devices: Sequence[Mapping] | None = None, options: Mapping | None = None,
                     env: Mapping[str, str] | None = None, notes: Sequence[str] = (),
                     ratios: Sequence[Mapping] | None = None) -> dict:
    """A self-describing JSON-able record of one sweep: what ran, where, on which commit, the rows.

    ``machine`` comes from the caller (e.g. {"gpu_name": ..., "gpu_count": ...}): this module never
    queries the GPU. ``kind`` defaults to $FLUXRT_MACHINE_KIND so results from lent machines can be told
    apart later. ``versions`` (fluxrt, CUDA runtime and driver, NCCL, ...), ``devices`` (one entry per
    rank) and ``options`` (the sweep's, with what differs from the library's defaults) come from the
    caller too; ``environment`` is taken from ``env`` (default os.environ, see :func:`environment`).
    Rows carry their per-rank statistics (time_min_us / time_avg_us / time_max_us) where measured.
    ``ratios`` (:meth:`Table.ratio_entries`): per line, the baseline group's fastest time / fluxrt's, and
    which baseline that was (the sweeps: the faster NCCL mode).
    """
    mach: dict = {"kind": os.environ.get("FLUXRT_MACHINE_KIND", "unknown"),
                  "gpu_name": "unknown", "gpu_count": None}
    mach.update(machine or {})
    if not isinstance(command, str):
        command = shlex.join(str(c) for c in command)
    return {
        "bench": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "command": command,
        "machine": mach,
        "versions": dict(versions or {}),
        "environment": environment(env),
        "devices": [dict(d) for d in (devices or ())],
        "options": dict(options or {}),
        "notes": list(notes),
        "rows": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows],
        **({"ratios": [dict(e) for e in ratios]} if ratios is not None else {}),
    }


def device_lines(devices: Sequence[Mapping]) -> list[str]:
    """nccl-tests' per-rank header lines: '#  Rank  0 Pid 1234 on host device  0 [0000:1b:00.0] NVIDIA H200'."""
    return [f"#  Rank {d.get('rank', '?'):>2} Pid {d.get('pid', '?'):>6} on {d.get('host', '?')} device "
            f"{d.get('device', '?'):>2} [{d.get('pci_bus_id', '?')}] {d.get('name', '?')}" for d in devices]


def version_line(versions: Mapping) -> str:
    """'# fluxrt 0.1.0 | CUDA runtime 12.8 driver 12.9 | NCCL 2.27.3 | ...' (unknown shows as N/A)."""
    def v(key):
        return versions.get(key) or "N/A"

    line = (f"# fluxrt {v('fluxrt')} | CUDA runtime {v('cuda_runtime')} driver {v('cuda_driver')} | "
            f"NCCL {v('nccl')}" + (f" ({versions['nccl_binding']})" if versions.get("nccl_binding") else "")
            + f" | CuPy {v('cupy')} | Python {v('python')}")
    return line + (f" | MPI {versions['mpi']}" if versions.get("mpi") else "")


def option_differences(used: Mapping, library: Mapping) -> dict:
    """{name: {"used": ..., "library": ...}} for each option of ``used`` whose value is not the library's."""
    return {k: {"used": used[k], "library": library.get(k)} for k in used if used[k] != library.get(k)}


def differences_line(diffs: Mapping, why: Mapping[str, str] | None = None) -> str:
    """'# differs from the library's defaults: a=1 (library: 2; why)' or '# ...: none'."""
    why = why or {}
    if not diffs:
        return "# options differing from the library's defaults: none"
    parts = [f"{k}={d['used']} (library: {d['library']}{'; ' + why[k] if k in why else ''})"
             for k, d in diffs.items()]
    return "# options differing from the library's defaults: " + ", ".join(parts)


def column_table(columns: Sequence[tuple], rows: Iterable[Mapping], cell=None) -> list[str]:
    """A fixed-width text table: a ``#`` header line, then one line per row. columns: (title, key, width,
    decimals or None for as-is); cell(row, key) reads a value (default ``row.get(key)``); missing and NaN
    values print as N/A."""
    get = cell or (lambda r, key: r.get(key))
    lines = ["#" + " ".join(f"{name:>{w}}" for name, _, w, _ in columns)]
    for r in rows:
        cells = []
        for _, key, w, dec in columns:
            v = get(r, key)
            if v is None or (isinstance(v, float) and v != v):
                cells.append(f"{'N/A':>{w}}")
            else:
                cells.append(f"{v:>{w}}" if dec is None else f"{v:>{w}.{dec}f}")
        lines.append(" " + " ".join(cells))
    return lines


def write_json(path: str | os.PathLike, doc: Mapping) -> Path:
    """Write ``doc`` as indented JSON; via a temporary file and rename, so an interrupted run never
    leaves a truncated result file behind. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    log.info("wrote %s", path)
    return path


def plot(path: str | os.PathLike, rows: Iterable[Row], title: str) -> Path:
    """Save a PNG with latency (time vs size, log-log) and busbw (vs size, log-x), one line per
    (impl, algo), or per impl where a row names no algo of its own (the NCCL modes: nccl, nccl-win).

    Uses matplotlib's Agg canvas directly, never pyplot, so it works headless and does not change a
    caller's global backend.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise ImportError("fluxrt.perf.report.plot needs matplotlib: pip install matplotlib") from exc

    series: dict[str, list[Row]] = {}
    for r in rows:
        label = r.impl if r.algo in ("", r.impl) else f"{r.impl} {r.algo}"
        series.setdefault(label, []).append(r)

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax_t, ax_bw = fig.subplots(1, 2)
    ticks = FuncFormatter(lambda x, _pos: format_size(int(x)) if x >= 1 else f"{x:g}")
    for label, pts in sorted(series.items()):
        pts = sorted((p for p in pts if p.time_us > 0), key=lambda p: p.bytes)
        if not pts:
            continue
        xs = [p.bytes for p in pts]
        ax_t.plot(xs, [p.time_us for p in pts], marker="o", markersize=3, label=label)
        ax_bw.plot(xs, [p.busbw for p in pts], marker="o", markersize=3, label=label)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set(xlabel="message size (bytes)", ylabel="time (us)", title="latency")
    ax_bw.set_xscale("log", base=2)
    ax_bw.set(xlabel="message size (bytes)", ylabel="busbw (GB/s)", title="bus bandwidth")
    for ax in (ax_t, ax_bw):
        ax.xaxis.set_major_formatter(ticks)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    log.info("wrote %s", path)
    return path


def _fallback_progress(iterable: Iterable[T], total: int | None, desc: str,
                       stream: IO[str]) -> Iterator[T]:
    """Minimal progress: one "[k/n] desc" line per item before it runs, so a hang shows where."""
    n = "?" if total is None else str(total)
    for k, item in enumerate(iterable, 1):
        stream.write(f"[{k}/{n}] {desc}\n")
        stream.flush()
        yield item


def progress(iterable: Iterable[T], total: int | None = None, enabled: bool = True, desc: str = "",
             stream: IO[str] | None = None) -> Iterable[T]:
    """Wrap ``iterable`` with a progress indicator on stderr (tqdm if installed, else plain lines).

    Returns ``iterable`` untouched when disabled or when the stream is not a TTY, so redirected logs
    and CI output stay clean and the table on stdout is never interleaved with progress noise.
    """
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not enabled or not (callable(isatty) and isatty()):
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    try:
        from tqdm import tqdm
    except ImportError:
        return _fallback_progress(iterable, total, desc, stream)
    return tqdm(iterable, total=total, desc=desc, file=stream, leave=False)
