"""``python -m fluxrt.gemm``: tune GEMM plans for a shape suite, inspect or clear the autotune cache.

    python -m fluxrt.gemm tune --suite core [--dtype bfloat16] [--force] [--sustained MS] [--json tune.json]
    python -m fluxrt.gemm tune --shape 1024,4096,768 --trans-b
    python -m fluxrt.gemm cache path | show | clear
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

# The offline pass confirms at the power limit unless FLUXRT_GEMM_TUNE_SUSTAINED_MS or --sustained say otherwise:
# 9 finalists x 2 x 0.5 s add about 9 s a shape (docs/tuning.md, "At the power limit").
TUNE_SUSTAINED_MS = 500.0


def _tune(args) -> int:
    import cupy
    from ..perf.shapes import Shape, suite
    from ..dtypes import normalize_dtype
    from .autotune import autotune, build_candidates, cache_path, sustained_default, tuned_plan

    if args.shape:
        shapes = [Shape(*s, layout="NK" if args.trans_b else "KN", label="cli") for s in args.shape]
    else:
        shapes = suite(args.suite)[args.skip:][: args.limit]
    dt = normalize_dtype(args.dtype)
    rows = []
    if args.jobs != 0:   # the candidates of the problems this run will time (cached ones are not re-timed)
        from .kernel import _num_sms

        t0 = time.time()
        todo = [(s.m, s.n, s.k, args.dtype, args.dtype, s.trans_b) for s in shapes
                if args.force or tuned_plan(s.m, s.n, s.k, args.dtype, args.dtype, s.trans_b) is None]
        n, failed = build_candidates(todo, args.jobs, _num_sms(cupy.cuda.runtime.getDevice()))
        print(f"# {n} kernel configurations built in {time.time() - t0:.0f} s"
              f"{f' ({failed} failed: skipped by the tuning, see the log)' if failed else ''}", flush=True)
    # --sustained, else the environment's setting (0 included), else the offline pass's default
    sustained = args.sustained if args.sustained is not None else sustained_default(unset=TUNE_SUSTAINED_MS)
    print(f"# tuning {len(shapes)} shapes ({args.dtype}) into {cache_path()}"
          f"{f', each finalist alone for {sustained:g} ms' if sustained else ''}")
    t0 = time.time()
    for i, s in enumerate(shapes):
        rng = cupy.random.default_rng(i)
        a = (rng.standard_normal((s.m, s.k), dtype=cupy.float32) + 0.1).astype(dt)
        w = (rng.standard_normal((s.n, s.k) if s.trans_b else (s.k, s.n), dtype=cupy.float32) + 0.1).astype(dt)
        try:
            r = autotune(a, w, trans_b=s.trans_b, force=args.force, sustained_ms=sustained)
        except Exception as e:
            print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout} FAILED {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout} {r.us:10.1f} us  {r.plan.describe()}"
              f"{'  (cached)' if r.cached else ''}", flush=True)
        rows.append({"m": s.m, "n": s.n, "k": s.k, "layout": s.layout, "label": s.label, "dtype": args.dtype,
                     "plan": r.plan.describe(), "us": r.us, "cached": r.cached,
                     "candidates": [{"plan": p, "us": us, "confirmed": p in r.confirmed} for p, us in r.timings]})
        del a, w
        cupy.get_default_memory_pool().free_all_blocks()
        if args.json:   # after every shape: a pass cut short keeps what it measured
            _write(args.json, rows)
    print(f"# {len(rows)} shapes in {time.time() - t0:.0f} s")
    return 0 if rows or not shapes else 1


def _write(path, rows) -> None:
    import cupy
    from ..perf import results_document, write_json

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"].decode()
    write_json(path, results_document("gemm-tune", rows, ["python", "-m", "fluxrt.gemm", *sys.argv[1:]],
                                      machine={"gpu_name": name, "gpu_count": 1}))


def _cache(args) -> int:
    import importlib

    tuning = importlib.import_module("fluxrt.gemm.autotune")

    if args.action == "path":
        print(tuning.cache_path())
    elif args.action == "clear":
        print(f"removed {tuning.clear()}")
    else:
        path = tuning.cache_path()
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            print(f"# {path}: empty")
            return 0
        plans = doc.get("plans", {})
        print(f"# {path}: {len(plans)} problems")
        for key, e in sorted(plans.items()):
            p = tuning._plan_from(e["plan"])
            print(f"{key:<32} {e.get('us', 0):10.1f} us  {p.describe() if p else e['plan']}")
    return 0


def _shape(s: str):
    parts = [int(x) for x in s.replace("x", ",").split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected M,N,K")
    return tuple(parts)


def main(argv=None) -> int:
    from ..fatal import one_line_errors

    return one_line_errors("python -m fluxrt.gemm")(_main)(argv)


def _milliseconds(text: str) -> float:
    from ..errors import GemmArgumentError
    from .autotune import _check_ms

    try:
        return _check_ms(text, "--sustained")
    except GemmArgumentError as e:   # argparse reports it as a usage error
        raise argparse.ArgumentTypeError(str(e)) from None


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fluxrt.gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="time candidate plans and keep the winners in the autotune cache")
    t.add_argument("--suite", default="core", help="shape suite of fluxrt.perf.shapes (core, random, default, full)")
    t.add_argument("--shape", type=_shape, nargs="*", default=None, help="M,N,K ... instead of a suite")
    t.add_argument("--trans-b", action="store_true", help="with --shape: B stored [N, K]")
    t.add_argument("--dtype", "-d", default="bfloat16", choices=["bfloat16", "float16"])
    t.add_argument("--limit", type=int, default=None, help="first N shapes of the suite only")
    t.add_argument("--skip", type=int, default=0, help="leave out the suite's first N shapes")
    t.add_argument("--jobs", "-j", type=int, default=None,
                   help="NVRTC compiles at once (threads) building the candidates before tuning (default: the "
                        "CPUs; 0: compile each one when first timed)")
    t.add_argument("--force", action="store_true", help="re-time problems already in the cache")
    t.add_argument("--sustained", type=_milliseconds, default=None, metavar="MS",
                   help="confirm the screen's best plans each alone under MS milliseconds of load: the plan fastest "
                        "at the GPU's power limit, as a job running it sees it (default: $FLUXRT_GEMM_TUNE_SUSTAINED_MS "
                        f"where set, else {TUNE_SUSTAINED_MS:g}; 0: the interleaved confirmation only)")
    t.add_argument("--json", default=None, help="write every candidate's time here")
    t.add_argument("-v", "--verbose", action="store_true")
    c = sub.add_parser("cache", help="the autotune cache of the current GPU")
    c.add_argument("action", choices=["path", "show", "clear"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    return _tune(args) if args.command == "tune" else _cache(args)


if __name__ == "__main__":
    raise SystemExit(main())
