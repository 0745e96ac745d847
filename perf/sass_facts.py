#!/usr/bin/env python3
"""SASS facts of the fluxrt GEMM kernel: HGMMA instructions present, registers per thread, local memory
(spills) and shared memory, for the default plan with and without the fused-op hooks.

Needs ``cuobjdump`` (CUDA toolkit) on PATH; compiles with NVRTC through fluxrt.toolchain (no GPU needed).

    python3 perf/sass_facts.py --json $OUT/sass.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {            # name: (hook_wait, hook_epilogue, hook_reduce (0, 1 epilogue, 2 tail), hook_copy)
    "plain": (False, False, False, False),
    "hook-wait": (True, False, False, False),
    "hooks-both": (True, True, False, False),
    "hooks-epilogue-reduce": (False, True, 1, False),      # GEMM+ReduceScatter's reduce_mode='epilogue'
    "hooks-tail-reduce": (False, True, 2, False),          # GEMM+ReduceScatter's reduce_mode='tail'
    "hooks-wait-copy": (True, False, False, True),         # AllGather+GEMM with its own shard copied by the GEMM
}
def facts(cubin: Path, cuobjdump: str) -> dict:
    """This script's summary of perf/sass_compare.py's facts of one cubin."""
    from sass_compare import facts as sass_facts

    f = sass_facts(cubin, cuobjdump)
    ops = f["ops"]
    return {
        "registers": f["registers"], "stack_bytes": f["stack"], "local_bytes": f["local"],
        "hgmma": ops.get("HGMMA", 0), "utmaldg": ops.get("UTMALDG", 0), "utmastg": ops.get("UTMASTG", 0),
        "syncs_mbarrier": ops.get("SYNCS", 0), "ldl_stl": ops.get("LDL", 0) + ops.get("STL", 0),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192,8192,8192", help="M,K,N whose default plan is inspected")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from fluxrt.toolchain import binary_utility

    cuobjdump = binary_utility("cuobjdump")
    if cuobjdump is None:
        print("sass_facts: cuobjdump not found (a CUDA toolkit's bin directory on PATH, or pip install "
              "'cuda-toolkit[cuobjdump,nvdisasm]==13.*')", file=sys.stderr)
        return 2

    from fluxrt.gemm import compile_options, kernel_defines
    from fluxrt.gemm.plan import plan_gemm
    from fluxrt.toolchain import compile_cubin

    m, k, n = (int(x) for x in args.shape.split(","))
    plan = plan_gemm(m, n, k)
    rows = []
    for name, (wait, epi, red, copy) in CONFIGS.items():
        defines = kernel_defines(plan, "bfloat16", "bfloat16", False, wait, epi, red, copy)
        cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(defines, arch="sm_90a"))
        row = {"config": name, "plan": f"{plan.block_m}x{plan.block_n}x{plan.block_k} s{plan.stages}",
               **facts(cubin, cuobjdump)}
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"bench": "gemm_sass", "shape_mkn": [m, k, n], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
