#!/usr/bin/env python3
"""SASS of GEMM configurations, recorded and compared: registers, stack, local memory, spill stores and
loads (STL / LDL), and the histogram of SASS opcodes, per configuration. For checking that a change of
kernels/gemm keeps the instructions of the kernels it should not touch.

    python3 perf/sass_compare.py --save perf/results/gemm_sass_reference.json   # record the current tree
    python3 perf/sass_compare.py --against perf/results/gemm_sass_reference.json --markdown

Configurations: a named representative set, plus (``--tests``) every configuration that
tests/cpu/test_gemm_cpu.py compiles and the grouped ones of tests/cpu/test_grouped_gemm_cpu.py.
Needs ``cuobjdump`` (on PATH, or ``--cuobjdump``); compiles with
NVRTC through fluxrt.toolchain into a private cache directory (no GPU needed).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
KEY_OPS = ("HGMMA", "QGMMA", "LDG", "STG", "LDS", "STS", "SYNCS", "UTMALDG", "UTMASTG", "UBLKCP", "BAR", "LDL", "STL")


def named_configs():
    """name -> (plan, in, out, trans_b, hook_wait, hook_epilogue, hook_reduce, hook_copy, bands[, kwargs]); kwargs:
    the other arguments of kernel_defines (fp8's b_dtype and scale, grouped)."""
    from fluxrt.gemm.grouped import grouped_plan
    from fluxrt.gemm.plan import GemmPlan, plan_gemm

    big = plan_gemm(8192, 8192, 8192)                      # 128x256x64, 3 stages, 2 consumers
    f32 = plan_gemm(4096, 4096, 4096, out_dtype="float32")  # 128x128
    bf = "bfloat16"
    e4 = "float8_e4m3fn"
    fp8 = GemmPlan(block_k=128, stages=3)                             # 128x256x128, cooperative
    fp8_block = GemmPlan(block_n=128, block_k=128, stages=6)          # 128x128x128
    grp = grouped_plan(8192, 2048, 7168, 64)                          # 128x256, 3 stages
    grp128 = grouped_plan(8192, 128, 7168, 64)                        # 128x128
    grp32 = grouped_plan(8192, 2048, 7168, 64, out_dtype="float32")
    return {
        "plain-bf16-mn": (big, bf, bf, False, False, False, 0, False, 0),
        "plain-bf16-k": (big, bf, bf, True, False, False, 0, False, 0),
        "plain-f16": (big, "float16", "float16", False, False, False, 0, False, 0),
        "out-f32": (f32, bf, "float32", False, False, False, 0, False, 0),
        "one-consumer-64x256": (GemmPlan(block_m=64, consumers=1, block_n=256, stages=4), "float16", "float16",
                                False, False, False, 0, False, 0),
        "direct-s4": (GemmPlan(epilogue="direct", stages=4), bf, bf, True, False, False, 0, False, 0),
        "shared-c-s4": (GemmPlan(stages=4, c_staging="shared"), bf, bf, False, False, False, 0, False, 0),
        "cluster2": (GemmPlan(cluster=2), bf, bf, True, False, False, 0, False, 0),
        "hook1": (big, bf, bf, False, True, False, 0, False, 0),
        "hooks12": (big, bf, bf, False, True, True, 0, False, 0),
        "hook3-epilogue": (big, bf, bf, False, False, True, 1, False, 0),
        "hook3-tail": (big, bf, bf, False, False, True, 2, False, 0),
        "hook4": (big, bf, bf, False, True, False, 0, True, 0),
        "bands-a-hook3-tail": (big, bf, bf, False, False, True, 2, False, 1),
        "bands-c-hook1": (big, bf, bf, False, True, False, 0, False, 2),
        "bands-ac": (big, bf, bf, False, False, False, 0, False, 3),
        "fp8-none-e5m2": (fp8, e4, "float16", True, False, False, 0, False, 0, dict(b_dtype="float8_e5m2")),
        "fp8-tensor": (fp8, e4, bf, True, False, False, 0, False, 0, dict(scale="tensor")),
        "fp8-block": (fp8_block, e4, bf, True, False, False, 0, False, 0, dict(scale="block")),
        "fp8-fit-240": (GemmPlan(block_n=240, block_k=128, stages=3), e4, bf, True, False, False, 0, False, 0,
                        dict(scale="tensor")),
        "fp8-pingpong-176": (GemmPlan(block_n=176, block_k=128, stages=4, c_staging="shared", pingpong=True), e4, bf,
                             True, False, False, 0, False, 0, dict(scale="tensor")),
        "fp8-block-192": (GemmPlan(block_n=192, block_k=128, stages=4), e4, bf, True, False, False, 0, False, 0,
                          dict(scale="block")),
        "grouped-bf16-kn": (grp, bf, bf, False, False, False, 0, False, 0, dict(grouped=True)),
        "grouped-bf16-nk": (grp, bf, bf, True, False, False, 0, False, 0, dict(grouped=True)),
        "grouped-f32-128": (grp32, bf, "float32", True, False, False, 0, False, 0, dict(grouped=True)),
        "grouped-fp8-tensor": (dataclasses.replace(grp, block_k=128), e4, bf, True, False, False, 0, False, 0,
                               dict(scale="tensor", grouped=True)),
        "grouped-fp8-block": (dataclasses.replace(grp128, block_k=128), e4, bf, True, False, False, 0, False, 0,
                              dict(scale="block", grouped=True)),
        "grouped-fp8-block-192": (grouped_plan(8192, 2048, 7168, 64, in_dtype=e4, scale="block"), e4, bf, True, False,
                                  False, 0, False, 0, dict(scale="block", grouped=True)),
    }


def test_configs():
    """The configurations tests/cpu/test_gemm_cpu.py compiles, in the same tuple form as named_configs()."""
    path = ROOT / "tests" / "cpu" / "test_gemm_cpu.py"
    spec = importlib.util.spec_from_file_location("_gemm_cpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = {}
    for i, c in enumerate(mod.COMPILE_CONFIGS):
        plan, in_dt, out_dt, tb, hw, he, *rest = c
        red = int(rest[0]) if rest else 0
        copy = bool(rest[1]) if rest[1:] else False
        bands = int(rest[2]) if rest[2:] else 0
        out[f"test{i:02d}"] = (plan, in_dt, out_dt, tb, hw, he, red, copy, bands)
    path = ROOT / "tests" / "cpu" / "test_grouped_gemm_cpu.py"   # grouped, with hooks 1 and 2 of the MoE layer
    spec = importlib.util.spec_from_file_location("_grouped_cpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))   # it imports its sibling test_gemm_cpu
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    for i, c in enumerate(mod.GROUPED_CONFIGS):
        plan, in_dt, out_dt, tb = c[:4]
        hook = c[4] if len(c) > 4 else ""
        out[f"grouped-test{i:02d}"] = (plan, in_dt, out_dt, tb, hook == "arrival", hook == "scatter", 0, False, 0,
                                       dict(grouped=True))
    return out


def compile_config(cfg) -> Path:
    from fluxrt.gemm import compile_options, kernel_defines
    from fluxrt.toolchain import compile_cubin

    plan, in_dt, out_dt, tb, hw, he, red, copy, bands, *extra = cfg
    defines = kernel_defines(plan, in_dt, out_dt, tb, hw, he, red, copy, bands, **(extra[0] if extra else {}))
    return compile_cubin("gemm/hopper_gemm.cu", compile_options(defines, arch="sm_90a"))


def facts(cubin: Path, cuobjdump: str) -> dict:
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    m = _RES.search(res)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    hist: collections.Counter = collections.Counter()
    seq = []
    for line in sass.splitlines():
        mm = _INSN.search(line)
        if mm:
            hist[mm.group(2)] += 1
            seq.append(mm.group(2) + mm.group(3))
    # the main loop: from 24 instructions before the first wgmma to 24 after the last (the stage wait, the
    # MMAs, the group wait and the stage release), opcodes with modifiers in order
    hg = [i for i, op in enumerate(seq) if op.startswith(("HGMMA", "QGMMA"))]   # 16-bit, fp8
    hot = seq[max(0, hg[0] - 24):hg[-1] + 25] if hg else []
    return {
        "registers": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4)),
        "spill_stores": hist.get("STL", 0), "spill_loads": hist.get("LDL", 0),
        "total": sum(hist.values()), "ops": dict(sorted(hist.items())),
        # opcodes with modifiers in program order, no registers: equal when the same instructions are
        # emitted in the same order (register allocation and constant-bank offsets aside)
        "sequence_sha": hashlib.sha256("\n".join(seq).encode()).hexdigest()[:16],
        "mainloop_sha": hashlib.sha256("\n".join(hot).encode()).hexdigest()[:16],
    }


def collect(configs: dict, cuobjdump: str) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fluxrt-sass-") as cache:
        old = os.environ.get("FLUXRT_CACHE_DIR")
        os.environ["FLUXRT_CACHE_DIR"] = cache
        try:
            for name, cfg in configs.items():
                try:
                    cubin = compile_config(cfg)
                except Exception as e:   # a configuration this tree cannot build (yet): left out, said why
                    print(f"{name:24s} not compiled: {str(e).splitlines()[0][:200]}", file=sys.stderr)
                    continue
                rows[name] = facts(cubin, cuobjdump)
                print(f"{name:24s} {json.dumps({k: v for k, v in rows[name].items() if k != 'ops'})}",
                      file=sys.stderr)
        finally:
            if old is None:
                os.environ.pop("FLUXRT_CACHE_DIR", None)
            else:
                os.environ["FLUXRT_CACHE_DIR"] = old
    return rows


def _cell(before, after) -> str:
    return f"{after}" if before == after else f"{before}→{after}"


def compare(before: dict, after: dict, markdown: bool) -> tuple[str, int]:
    """A table of before -> after per configuration; returns (text, configurations whose resource facts or
    key opcode counts differ)."""
    cols = ("registers", "local", "stack", "spill_stores", "spill_loads")
    head = ["config", "regs", "local", "stack", "STL", "LDL", *KEY_OPS[:-2], "total", "same main loop", "same seq"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] if markdown else ["  ".join(head)]
    differ = 0
    for name in after:
        if name not in before:
            continue
        b, a = before[name], after[name]
        cells = [name] + [_cell(b[c], a[c]) for c in cols]
        cells += [_cell(b["ops"].get(op, 0), a["ops"].get(op, 0)) for op in KEY_OPS[:-2]]
        cells += [_cell(b["total"], a["total"]), "yes" if b["mainloop_sha"] == a["mainloop_sha"] else "NO",
                  "yes" if b["sequence_sha"] == a["sequence_sha"] else "no"]
        if (any(b[c] != a[c] for c in cols) or any(b["ops"].get(op, 0) != a["ops"].get(op, 0) for op in KEY_OPS)
                or b["mainloop_sha"] != a["mainloop_sha"]):
            differ += 1
        lines.append(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells))
    return "\n".join(lines), differ


def op_diff(before: dict, after: dict) -> str:
    """Opcodes whose counts changed, per configuration."""
    out = []
    for name in after:
        if name not in before:
            continue
        b, a = before[name]["ops"], after[name]["ops"]
        d = {op: a.get(op, 0) - b.get(op, 0) for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)}
        if d:
            out.append(f"{name}: " + ", ".join(f"{op} {v:+d}" for op, v in d.items()))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, help="write the facts of the current tree here (JSON)")
    ap.add_argument("--against", type=Path, help="compare the current tree with facts saved earlier")
    ap.add_argument("--tests", action="store_true", help="also every configuration the CPU tests compile")
    ap.add_argument("--markdown", action="store_true", help="the comparison as a markdown table")
    ap.add_argument("--cuobjdump", default=None, help="default: fluxrt.toolchain.binary_utility('cuobjdump')")
    args = ap.parse_args(argv)
    if not args.cuobjdump:
        from fluxrt.toolchain import binary_utility

        args.cuobjdump = binary_utility("cuobjdump")
    if not args.cuobjdump:
        print("sass_compare: cuobjdump not found (a CUDA toolkit's bin directory on PATH, pip install "
              "'cuda-toolkit[cuobjdump,nvdisasm]==13.*', or --cuobjdump)",
              file=sys.stderr)
        return 2
    configs = named_configs()
    if args.tests:
        configs.update(test_configs())
    rows = collect(configs, args.cuobjdump)
    if args.save:
        args.save.write_text(json.dumps({"bench": "gemm_sass_compare", "rows": rows}, indent=1, sort_keys=True))
    if args.against:
        before = json.loads(args.against.read_text())["rows"]
        table, differ = compare(before, rows, args.markdown)
        print(table)
        diff = op_diff(before, rows)
        if diff:
            print("\nopcode count changes:\n" + diff)
        print(f"\n{differ} of {sum(1 for n in rows if n in before)} configurations differ in registers, "
              f"local/stack/spills, key opcode counts or main loop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
