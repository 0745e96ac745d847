"""Write docs/performance.md from perf/results/*.json: per benchmark and machine, the latest result.

    python perf/make_performance_doc.py                 # writes docs/performance.md
    python perf/make_performance_doc.py --superseded    # lists result files that a newer one replaces

A result's key is its file name without the date and commit (``allreduce-eager-h200x4-np4``); collective
sweeps written before the file names carried the mode get theirs from the command (``-G`` = graph).
perf/results keeps the latest file per key; older ones live in git history.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
OUT = ROOT / "docs" / "performance.md"

SWEEP_OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "alltoallv", "broadcast")
_DATED = re.compile(r"-(\d{4}-\d{2}-\d{2})(?:-([0-9a-f]{7,40}))?$")
_TITLES = {"sweep": "Collective sweeps (fluxrt and NCCL in the same job)", "fused": "Fused tensor-parallel ops",
           "gemm": "GEMM (one GPU)", "p2p": "Point to point", "probe": "Fabric and ordering probes",
           "ops": "Fused ops on padded shards", "tune": "Tuning jobs (perf/tune_collectives.py)"}


def load(path: Path) -> dict:
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {"rows": data}


def graph_mode(command: str) -> bool:
    return re.search(r"(^|\s)-G\s*\d", command or "") is not None


def result_key(path: Path, data: dict) -> str:
    """The benchmark-and-machine key: the file stem without date and commit, with the sweep mode."""
    stem = _DATED.sub("", path.stem)
    op = stem.split("-")[0]
    if op in SWEEP_OPS and data.get("bench") == op and not re.search(r"-(eager|graph)-", stem):
        stem = stem.replace(op, f"{op}-{'graph' if graph_mode(data.get('command', '')) else 'eager'}", 1)
    return stem


def _git_date(commit: str | None) -> str:
    if not commit:
        return ""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%cI", commit], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def when(path: Path, data: dict) -> str:
    """When the result was taken: the time recorded in the JSON, else the date in its file name."""
    if data.get("date"):
        return str(data["date"])
    m = _DATED.search(path.stem)
    return m.group(1) if m else ""


def _order(path: Path, data: dict) -> str:
    """Sort key among results of one key: the recorded time, else the commit's date (git), else the name's."""
    if data.get("date"):
        return str(data["date"])
    m = _DATED.search(path.stem)
    return _git_date(data.get("commit") or (m and m.group(2))) or when(path, data)


def latest(results_dir: Path = RESULTS) -> tuple[dict[str, tuple[Path, dict]], list[Path]]:
    """{key: (path, data)} of the newest file per key, and the JSON files that a newer one supersedes."""
    groups: dict[str, list[tuple[str, Path, dict]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        data = load(path)
        groups.setdefault(result_key(path, data), []).append((_order(path, data), path, data))
    kept, old = {}, []
    for key, items in groups.items():
        items.sort(key=lambda t: (t[0], t[1].name))
        kept[key] = items[-1][1:]
        old += [p for _, p, _ in items[:-1]]
    return kept, old


def kind(key: str, data: dict) -> str:
    bench = str(data.get("bench", ""))
    if key.startswith("tune-") or bench.startswith("tune_"):
        return "tune"
    if bench in SWEEP_OPS:
        return "sweep"
    if bench in ("ag_gemm", "gemm_rs", "jax_mlp"):
        return "fused"
    if bench.startswith("gemm"):   # the GEMM bench, the shape suite, its tuning passes and SASS facts
        return "gemm"
    if bench == "p2p":
        return "p2p"
    if key.startswith("ops-"):
        return "ops"
    return "probe"


def machine(data: dict) -> str:
    m = data.get("machine")
    if isinstance(m, dict):
        return f"{m.get('kind', '?')} ({m.get('gpu_count', '?')}x {m.get('gpu_name', '?')})"
    return str(m or "not recorded")


def size(n) -> str:
    n = int(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def num(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def table(header: list[str], rows: list[list]) -> list[str]:
    cells = lambda r: "| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |"  # noqa: E731
    return [cells(header), cells(["---"] * len(header)), *map(cells, rows)]


def sweep_table(rows: list[dict]) -> list[str]:
    """One line per case (size, and type, op and root where a sweep loops over them) and placement:
    fluxrt's algorithm, time and busbw beside NCCL's on ordinary buffers and on registered windows, and
    the time ratio against the faster NCCL mode (which one in brackets)."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (str(r.get("dtype", "")), str(r.get("redop", "")), int(r.get("root", -1)), bool(r.get("inplace")),
               int(r["bytes"]))
        cases.setdefault(key, {})[str(r.get("impl"))] = r
    several = {k[:3] for k in cases}
    out = []
    for key in sorted(cases):
        dtype, redop, root, inplace, b = key
        f, n, w = (cases[key].get(i) for i in ("fluxrt", "nccl", "nccl-win"))
        timed = [(r["time_us"], name) for r, name in ((n, "plain"), (w, "window")) if r and r.get("time_us")]
        best = min(timed) if timed else None
        ratio = f"{best[0] / f['time_us']:.2f}x ({best[1]})" if f and best and f.get("time_us") else "—"
        case = ", ".join(x for x in ((f"{dtype} {redop}" + (f" root {root}" if root >= 0 else "")
                                      if len(several) > 1 else ""), "in place" if inplace else "") if x)
        out.append([size(b) + (f" ({case})" if case else ""), f.get("algo", "") if f else "—",
                    num(f["time_us"]) if f else "—", num(f["busbw"]) if f else "—",
                    num(n["time_us"]) if n else "—", num(n["busbw"]) if n else "—",
                    num(w["time_us"]) if w else "—", num(w["busbw"]) if w else "—", ratio, (f or {}).get("wrong", "—")])
    return table(["size", "fluxrt algo", "fluxrt µs", "fluxrt busbw GB/s", "NCCL µs", "NCCL busbw GB/s",
                  "NCCL window µs", "NCCL window busbw GB/s", "faster NCCL time / fluxrt time", "wrong"], out)


def generic_table(rows) -> list[str]:
    if isinstance(rows, dict):
        return table(["measurement", "value"], [[k, num(v)] for k, v in rows.items()])
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return ["(no rows)"]
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in ("plan", "device")]
    fmt = lambda c, v: size(v) if c in ("bytes", "bytes_per_peer") and isinstance(v, int) else num(v)  # noqa: E731
    return table(cols, [[fmt(c, r.get(c, "")) for c in cols] for r in rows])


def gemm_sustained_table(data: dict) -> list[str]:
    """perf/gemm_sustained.py: its summary, then per shape the ratios (cuBLAS / fluxrt: burst, steady, energy) and
    each implementation's steady us, power and SM clock alone at the power limit."""
    summ = data.get("summary") or {}
    lines = [f"- summary: {', '.join(f'{k} {num(v)}' for k, v in summ.items())}", ""] if summ else []
    header = ["M", "N", "K", "W", "ratio burst", "ratio steady", "ratio energy", "cuBLAS us", "W", "MHz",
              "fluxrt us", "W", "MHz", "plan"]
    rows = [[r.get("m"), r.get("n"), r.get("k"), r.get("layout"), num(r.get("ratio_burst", "")),
             num(r.get("ratio_steady", "")), num(r.get("ratio_energy", "")), num(r.get("cublas_steady_us", "")),
             num(r.get("cublas_power_w", "")), num(r.get("cublas_sm_mhz", "")), num(r.get("fluxrt_steady_us", "")),
             num(r.get("fluxrt_power_w", "")), num(r.get("fluxrt_sm_mhz", "")), r.get("plan", "")]
            for r in data.get("rows", []) if isinstance(r, dict)]
    return lines + table(header, rows)


def gemm_suite_table(data: dict) -> list[str]:
    """A GEMM shape-suite run: its summary, then per shape cuBLAS and fluxrt (eager, graph), the ratios
    (cuBLAS time / fluxrt time) and the plan fluxrt ran; where the run had --lt, cuBLASLt at its best per
    shape (graph) and the ratio against it."""
    summ = data.get("summary") or {}
    lines = [f"- summary: {', '.join(f'{k} {num(v)}' for k, v in summ.items())}", ""] if summ else []
    lt = any(isinstance(r, dict) and "cublaslt_graph_ms" in r for r in data.get("rows", []))
    header = ["M", "N", "K", "W", "layer", "cuBLAS eager ms", "fluxrt eager ms", "ratio eager", "cuBLAS graph ms",
              "fluxrt graph ms", "ratio graph", "host us fluxrt / cuBLAS", "plan"]
    if lt:
        header[11:11] = ["cuBLASLt graph ms", "ratio graph vs cuBLASLt"]
    rows = []
    for r in data.get("rows", []):
        if not isinstance(r, dict):
            continue
        row = [r.get("m"), r.get("n"), r.get("k"), r.get("layout"), r.get("label"), num(r.get("cublas_eager_ms", "")),
               num(r.get("fluxrt_eager_ms", "")), num(r.get("ratio_eager", "")), num(r.get("cublas_graph_ms", "")),
               num(r.get("fluxrt_graph_ms", "")), num(r.get("ratio_graph", "")),
               f"{num(r.get('fluxrt_host_us', ''))} / {num(r.get('cublas_host_us', ''))}", r.get("plan", r.get("error", ""))]
        if lt:
            row[11:11] = [num(r.get("cublaslt_graph_ms", "")), num(r.get("ratio_graph_lt", ""))]
        rows.append(row)
    return lines + table(header, rows)


def gemm_fp8_table(data: dict) -> list[str]:
    """An fp8 GEMM suite run (perf/gemm_fp8.py): its summary, then per shape cuBLASLt (torch._scaled_mm) and
    fluxrt kernel times (CUDA graph replays), the ratio (cuBLASLt time / fluxrt time), the eager ratio,
    fluxrt's TFLOP/s, the outputs' difference and the plan; where the run also timed cuBLASLt directly
    (fluxrt.perf.cublaslt), its times with fast accumulation and without, and their ratios."""
    summ = data.get("summary") or {}
    lines = [f"- summary: {', '.join(f'{k} {num(v)}' for k, v in summ.items())}", ""] if summ else []
    direct = any(isinstance(r, dict) and "lt_fast_us" in r for r in data.get("rows", []))
    header = ["M", "N", "K", "layer", "scales", "cuBLASLt µs", "fluxrt µs", "ratio", "ratio eager", "fluxrt TFLOP/s",
              "rel diff vs cuBLASLt", "plan"]
    if direct:
        header[5] = "_scaled_mm µs"
        header[7] = "ratio vs _scaled_mm"
        header[9:9] = ["Lt fast-accum µs", "ratio vs Lt fast-accum", "Lt µs", "ratio vs Lt"]
    rows = []
    for r in data.get("rows", []):
        if not isinstance(r, dict):
            continue
        diff = num(r.get("rel_err_vs_cublaslt", ""))
        if r.get("baseline_disagrees"):
            diff += " (baseline disagrees: not in the geomean)"
        row = [r.get("m"), r.get("n"), r.get("k"), r.get("label"), r.get("scale"),
               num(r.get("cublaslt_us", r.get("baseline_error", ""))), num(r.get("fluxrt_us", "")),
               num(r.get("ratio", "")), num(r.get("ratio_eager", "")), num(r.get("fluxrt_tflops", "")), diff,
               r.get("plan", r.get("error", ""))]
        if direct:
            row[9:9] = [num(r.get("lt_fast_us", r.get("lt_fast_error", ""))), num(r.get("ratio_lt_fast", "")),
                        num(r.get("lt_us", r.get("lt_error", ""))), num(r.get("ratio_lt", ""))]
        rows.append(row)
    return lines + table(header, rows)


def grouped_table(data: dict) -> list[str]:
    """A grouped-GEMM run (perf/grouped_gemm.py): its summary, then per MoE case the experts' shape, fluxrt's
    time (CUDA graph) beside the loop of cuBLAS calls, one dense cuBLAS GEMM of the same FLOPs and
    torch._grouped_mm (eager), as baseline time / fluxrt time. fp8 runs (--fp8): the loop and the dense GEMM are
    fluxrt's dense fp8 GEMM, torch is torch._scaled_mm per expert."""
    summ = data.get("summary") or {}
    lines = [f"- summary: {', '.join(f'{k} {num(v)}' for k, v in summ.items())}", ""] if summ else []
    fp8 = data.get("bench") == "gemm-grouped-fp8"
    loop, dense, torch = ("fp8 loop", "fp8 dense", "_scaled_mm loop") if fp8 else ("loop", "dense", "torch")
    header = ["model", "GEMM", "experts", "rows", "K", "N", "empty", "max rows", "fluxrt ms", "TFLOP/s", f"{loop} ms",
              f"{loop} / fluxrt", f"{dense} ms", f"{dense} / fluxrt", f"{torch} eager ms", f"{torch} / fluxrt (eager)",
              "plan"]
    rows = []
    for r in data.get("rows", []):
        if not isinstance(r, dict):
            continue
        torch_ms, torch_x = r.get("torch_eager_ms"), r.get("ratio_vs_torch_eager")
        if torch_x is None and torch_ms and r.get("fluxrt_eager_ms"):
            torch_x = torch_ms / r["fluxrt_eager_ms"]
        rows.append([r.get("model"), r.get("gemm"), r.get("experts"), r.get("rows"), r.get("k"), r.get("n"),
                     num(r.get("empty_experts", "")), num(r.get("max_rows", "")), num(r.get("fluxrt_ms", "")),
                     num(r.get("fluxrt_tflops", "")), num(r.get("loop_ms", "")), num(r.get("speedup_vs_loop", "")),
                     num(r.get("dense_ms", "")), num(r.get("ratio_vs_dense", "")),
                     num(torch_ms) if torch_ms is not None else "—", num(torch_x) if torch_x is not None else "—",
                     r.get("plan", r.get("error", ""))])
    return lines + table(header, rows)


def section(key: str, path: Path, data: dict) -> list[str]:
    rows = data.get("rows") if "rows" in data else data.get("ms", [])
    lines = [f"### {key}", "",
             f"- machine: {machine(data)}",
             f"- date: {when(path, data) or 'not recorded'}",
             f"- commit: {data.get('commit', 'not recorded')}",
             f"- command: `{data.get('command', 'not recorded')}`",
             f"- file: `perf/results/{path.name}`" + (f", plot `perf/results/{path.stem}.png`"
                                                       if path.with_suffix(".png").is_file() else "")]
    if data.get("note"):
        lines.append(f"- note: {data['note']}")
    lines.append("")
    if kind(key, data) == "sweep" and rows and isinstance(rows, list):
        lines += sweep_table(rows)
    elif data.get("bench") == "gemm-suite":
        lines += gemm_suite_table(data)
    elif data.get("bench") == "gemm-fp8":
        lines += gemm_fp8_table(data)
    elif data.get("bench") in ("gemm-grouped", "gemm-grouped-fp8"):
        lines += grouped_table(data)
    elif data.get("bench") == "gemm-sustained":
        lines += gemm_sustained_table(data)
    else:
        lines += generic_table(rows)
    return lines + [""]


def render(results_dir: Path = RESULTS) -> str:
    kept, _ = latest(results_dir)
    lines = ["# Performance", "",
             "Generated by `python perf/make_performance_doc.py` from `perf/results/*.json`: for each benchmark",
             "and machine, the latest result. Older results are in the git history of `perf/results/`.",
             "Times are as each benchmark records them (sweeps: the mean of `-n` calls, over ranks as `-a` says);",
             "sizes are nccl-tests sizes (the whole message); busbw",
             "uses the nccl-tests factors. NCCL runs on ordinary buffers (\"NCCL\") and on buffers registered as",
             "symmetric windows (\"NCCL window\", nccl-tests' `-R 2`); \"faster NCCL time / fluxrt time\" above 1",
             "means fluxrt is faster than the faster of the two. Results without window columns (—) were taken",
             "before the sweeps ran NCCL's window mode.",
             "Commands ran under `fluxrt-run -n <ranks> --` unless they say otherwise; paths in them are",
             "where the job wrote its output. Results whose options record no `average` were taken before",
             "fluxrt-perf had nccl-tests' `-a`: their times are the slowest rank's (as `-a 3` now), and",
             "their collective tables have no in-place columns; `ag_gemm -n` there meant N, not iterations.", ""]
    by_kind: dict[str, list[str]] = {}
    for key in sorted(kept):
        by_kind.setdefault(kind(key, kept[key][1]), []).append(key)
    for k in _TITLES:
        if k in by_kind:
            lines += [f"## {_TITLES[k]}", ""]
            for key in by_kind[k]:
                lines += section(key, *kept[key])
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--superseded", action="store_true",
                    help="print the result files (JSON and PNG) that a newer result replaces, and exit")
    args = ap.parse_args(argv)
    if args.superseded:
        for p in latest(args.results)[1]:
            print(p)
            if p.with_suffix(".png").is_file():
                print(p.with_suffix(".png"))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.results))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
