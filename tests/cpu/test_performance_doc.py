"""docs/performance.md is generated from perf/results, which keeps one (the latest) result per key."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "make_performance_doc.py"


def _module():
    spec = importlib.util.spec_from_file_location("make_performance_doc", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_renders_every_kept_result(tmp_path):
    out = tmp_path / "performance.md"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, cwd=tmp_path)
    text = out.read_text()
    kept, _ = _module().latest()
    assert kept, "perf/results holds no results"
    for key, (path, data) in kept.items():
        assert f"### {key}\n" in text
        assert f"perf/results/{path.name}" in text
        assert str(data.get("commit", "not recorded")) in text
    for path in (ROOT / "perf" / "results").glob("*.json"):
        assert path.name in text, f"{path.name} is in perf/results but not in the generated doc"


def test_results_keep_only_the_latest_per_benchmark_and_machine():
    assert _module().latest()[1] == [], "run: python perf/make_performance_doc.py --superseded | xargs git rm"


def test_checked_in_doc_is_current():
    assert (ROOT / "docs" / "performance.md").read_text() == _module().render(), \
        "regenerate with: python perf/make_performance_doc.py"


def test_latest_wins_and_sweep_mode_comes_from_the_command(tmp_path):
    mod = _module()
    row = lambda impl, t: {"bytes": 1024, "impl": impl, "algo": "ll", "time_us": t, "busbw": 1.0, "wrong": 0}  # noqa: E731
    def write(name, date, commit, command):
        (tmp_path / name).write_text(json.dumps({
            "bench": "allreduce", "date": date, "commit": commit, "command": command,
            "machine": {"kind": "nvidia-h200-x4", "gpu_name": "NVIDIA H200", "gpu_count": 4},
            "rows": [row("fluxrt", 2.0), row("nccl", 4.0)]}))
    write("allreduce-h200x4-np4-2026-11-20.json", "2026-11-20T10:00:00", "aaaaaaa", "fluxrt-perf allreduce -b 8")
    write("allreduce-eager-h200x4-np4-2026-11-21-bbbbbbb.json", "2026-11-21T10:00:00", "bbbbbbb",
          "fluxrt-perf allreduce -b 8")
    write("allreduce-graph-h200x4-np4-2026-11-19-ccccccc.json", "2026-11-19T10:00:00", "ccccccc",
          "fluxrt-perf allreduce -b 8 -G 10")
    kept, old = mod.latest(tmp_path)
    assert sorted(kept) == ["allreduce-eager-h200x4-np4", "allreduce-graph-h200x4-np4"]
    assert kept["allreduce-eager-h200x4-np4"][1]["commit"] == "bbbbbbb"
    assert [p.name for p in old] == ["allreduce-h200x4-np4-2026-11-20.json"]
    text = mod.render(tmp_path)
    assert "| 1 KiB | ll | 2 | 1 | 4 | 1 | — | — | 2.00x (plain) | 0 |" in text
    assert "nvidia-h200-x4 (4x NVIDIA H200)" in text and "`fluxrt-perf allreduce -b 8 -G 10`" in text
