"""``fluxrt-perf allreduce_rmsnorm``: the fused allreduce + residual + RMSNorm against the unfused forms,
per (tokens T, hidden H), all measured in the same run on the same buffers:

    fused          fluxrt.fused.allreduce_rmsnorm (one launch)
    fused_fp8      the same with FP8 output (--quant: per_token or per_block scales)
    fluxrt_ar      fluxrt.allreduce alone (the target: fused <= 1.05x this)
    fluxrt_ar+norm fluxrt.allreduce, then the separate norm kernel (fluxrt.fused.add_rmsnorm)
    nccl_ar+norm   NCCL allreduce, then the same norm kernel
    nccl_ar        NCCL allreduce alone

Times are CUDA-event means over -n calls after -w warm-up calls (-G N: N replays of a graph of -n calls),
per rank, reduced over ranks by -a as nccl-tests does. The JSON keeps every time, the ratios, and the
largest difference between the fused output and fluxrt_ar+norm's (relative to the output's magnitude).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import normalize_dtype
from .baselines import device_info, library_versions, machine, nccl_communicator, nccl_datatype
from .report import results_document, write_json
from .sweep import AVERAGE_MODES, rank_stats, reduce_over_ranks

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
DEFAULT_HIDDEN = (4096, 7168, 8192)
IMPLS = ("fused", "fused_fp8", "fluxrt_ar", "fluxrt_ar+norm", "nccl_ar+norm", "nccl_ar")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fluxrt-perf allreduce_rmsnorm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-T", "--tokens", type=_ints, default=DEFAULT_TOKENS, help="rows T (comma list)")
    ap.add_argument("-H", "--hidden", type=_ints, default=DEFAULT_HIDDEN, help="columns H (comma list)")
    ap.add_argument("-d", "--datatype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", type=int, default=5)
    ap.add_argument("-G", "--cudagraph", type=int, default=0, help="time N replays of a graph of -n calls")
    ap.add_argument("-a", "--average", type=int, default=1, choices=tuple(AVERAGE_MODES))
    ap.add_argument("--quant", default="per_token", choices=("per_token", "per_block"),
                    help="scales of the fused_fp8 column")
    ap.add_argument("--algo", default="auto", help="force the fused algorithm (ll or twoshot)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--device", type=int, default=None,
                    help="pin every rank to this GPU (several ranks on one GPU under CUDA MPS: a smoke run whose "
                         "timings mean nothing)")
    return ap


def parse_options(argv) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if not impls or set(impls) - set(IMPLS):
        ap.error(f"--impls: choose from {', '.join(IMPLS)}")
    if args.iters < 1 or args.warmup_iters < 0 or args.cudagraph < 0:
        ap.error("-n must be >= 1, -w and -G >= 0")
    if args.algo not in ("auto", "ll", "twoshot"):
        ap.error("--algo: auto, ll or twoshot")
    args.impl_list = impls
    return args


def ratios(times: dict) -> dict:
    """The issue's ratios from one point's times (missing ones are None): fused / fluxrt_ar (target <= 1.05),
    (nccl_ar+norm) / fused (speed-up, target >= 1.4 for T <= 128, >= 1.05 above), fused_fp8 / fused
    (target <= 1.03), (fluxrt_ar+norm) / fused."""
    def ratio(a, b):
        return times[a] / times[b] if times.get(a) and times.get(b) else None

    return {"fused_over_fluxrt_ar": ratio("fused", "fluxrt_ar"),
            "nccl_norm_over_fused": ratio("nccl_ar+norm", "fused"),
            "fp8_over_fused": ratio("fused_fp8", "fused"),
            "fluxrt_norm_over_fused": ratio("fluxrt_ar+norm", "fused")}


def _time_rank_us(world: World, fn, stream, args) -> list[float]:
    """Microseconds per call of fn(stream) on each rank, timed as the collective sweeps time theirs."""
    from types import SimpleNamespace

    from .collectives import _rank_times_us

    opts = SimpleNamespace(warmup_iters=args.warmup_iters, iters=args.iters, graph_iters=args.cudagraph,
                           blocking=False)
    return _rank_times_us(world, lambda case, s: fn(s), None, stream, opts)


def main(argv=None) -> int:
    import cupy

    import fluxrt
    import fluxrt.fused as fused

    args = parse_options(argv)
    dtype = normalize_dtype(args.datatype)
    with fluxrt.init(device=args.device, options=fluxrt.WorldOptions(check_collective_args=False)) as world:
        notes = [] if args.device is None else [f"every rank on device {args.device}: timings mean nothing"]
        comm = None
        if any(i.startswith("nccl") for i in args.impl_list):
            try:
                comm = nccl_communicator(world)
            except Exception as e:  # the baseline is optional: say why it is missing and go on
                notes.append(f"nccl baseline unavailable: {e}")
        ctx = fluxrt.collectives.context(world)
        stream = cupy.cuda.Stream(non_blocking=True)
        rows_out = []
        if world.rank == 0:
            print(f"# allreduce_rmsnorm on {world.size} ranks, {args.datatype}, fp8 scales {args.quant}; "
                  f"times in us ({AVERAGE_MODES[args.average]} over ranks)")
            print("# " + " ".join(f"{c:>14}" for c in ("T", "H", "algo", *args.impl_list, "fused/ar", "nccl+n/fused")))
        for h in args.hidden:
            for t in args.tokens:
                rng = cupy.random.default_rng(1000 + world.rank)
                x = rng.standard_normal((t, h), dtype=np.float32).astype(dtype)
                residual = cupy.random.default_rng(7).standard_normal((t, h), dtype=np.float32).astype(dtype)
                weight = cupy.random.default_rng(8).standard_normal((h,), dtype=np.float32).astype(dtype)
                cupy.cuda.Device().synchronize()   # the inputs, made on the current stream, before calls on `stream`
                out, ro, reduced = cupy.empty_like(x), cupy.empty_like(x), cupy.empty_like(x)
                out2, ro2 = cupy.empty_like(x), cupy.empty_like(x)
                codes = cupy.empty((t, h), np.uint8)
                scales = cupy.empty(fused.scales_shape(t, h, args.quant), np.float32)
                p = fused.plan_allreduce_rmsnorm(t, h, world.size, x.itemsize, ctx.half_bytes, ctx.ll_half_bytes,
                                                 ctx.tuning, args.algo)
                calls = {
                    "fused": lambda s: fused.allreduce_rmsnorm(world, x, residual, weight, args.eps, out=out,
                                                               residual_out=ro, algo=args.algo, stream=s),
                    "fused_fp8": lambda s: fused.allreduce_rmsnorm(world, x, residual, weight, args.eps, out=codes,
                                                                   residual_out=ro, quant=args.quant,
                                                                   scales_out=scales, algo=args.algo, stream=s),
                    "fluxrt_ar": lambda s: ctx.allreduce(x, reduced, stream=s),
                    "fluxrt_ar+norm": lambda s: (ctx.allreduce(x, reduced, stream=s),
                                                 fused.add_rmsnorm(world, reduced, residual, weight, args.eps,
                                                                   out=out2, residual_out=ro2, stream=s)),
                }
                if comm is not None:
                    dt = nccl_datatype(dtype)

                    def nccl_ar(s):
                        comm.allReduce(x.data.ptr, reduced.data.ptr, x.size, dt, 0, s.ptr)  # ncclSum

                    calls["nccl_ar"] = nccl_ar
                    calls["nccl_ar+norm"] = lambda s: (nccl_ar(s), fused.add_rmsnorm(
                        world, reduced, residual, weight, args.eps, out=out2, residual_out=ro2, stream=s))
                times, stats = {}, {}
                for impl in args.impl_list:
                    if impl not in calls:
                        continue
                    per_rank = _time_rank_us(world, calls[impl], stream, args)
                    times[impl] = reduce_over_ranks(per_rank, args.average)
                    stats[impl] = rank_stats(per_rank)
                # agreement of the fused output with fluxrt's allreduce + the separate norm
                calls["fused"](stream)
                ctx.allreduce(x, reduced, stream=stream)
                fused.add_rmsnorm(world, reduced, residual, weight, args.eps, out=out2, residual_out=ro2, stream=stream)
                stream.synchronize()
                a, b = out.astype(np.float32), out2.astype(np.float32)
                diff = float(cupy.abs(a - b).max() / max(float(cupy.abs(b).max()), 1e-30))
                diff = max(world.comm.allgather(diff))
                row = dict(tokens=t, hidden=h, dtype=args.datatype, algo=p.algo, launches=len(p.pieces),
                           quant=args.quant, bytes=x.nbytes, times_us=times, stats=stats, ratios=ratios(times),
                           max_rel_diff_vs_unfused=diff)
                rows_out.append(row)
                if world.rank == 0:
                    r = row["ratios"]
                    cells = [str(t), str(h), p.algo] + [f"{times[i]:.2f}" if i in times else "N/A" for i in args.impl_list]
                    cells += [f"{r['fused_over_fluxrt_ar']:.3f}" if r["fused_over_fluxrt_ar"] else "N/A",
                              f"{r['nccl_norm_over_fused']:.3f}" if r["nccl_norm_over_fused"] else "N/A"]
                    print("  " + " ".join(f"{c:>14}" for c in cells), flush=True)
        if comm is not None:
            comm.destroy()
        if world.rank == 0 and args.json_path:
            command = ["fluxrt-perf", "allreduce_rmsnorm", *(sys.argv[2:] if argv is None else argv)]
            doc = results_document("allreduce_rmsnorm", rows_out, command, machine=machine(world),
                                   versions=library_versions(), devices=device_info(world),
                                   options=dict(vars(args)), notes=notes)
            write_json(args.json_path, doc)
    return 0
