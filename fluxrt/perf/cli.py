"""``fluxrt-perf``: the installed perf command. ``fluxrt-perf SUBCOMMAND [flags]``, run under mpirun."""
from __future__ import annotations

import logging
import sys

# name -> "module" (module.main(argv)) or "module:variant" (module.main(argv, variant)).
BENCHES = {
    "p2p": "fluxrt.perf.p2p",
    "allreduce": "fluxrt.perf.collectives:allreduce",
    "allgather": "fluxrt.perf.collectives:allgather",
    "reduce_scatter": "fluxrt.perf.collectives:reduce_scatter",
    "alltoall": "fluxrt.perf.collectives:alltoall",
    "alltoallv": "fluxrt.perf.collectives:alltoallv",
    "broadcast": "fluxrt.perf.collectives:broadcast",
    "ag_gemm": "fluxrt.perf.tp_ops:ag_gemm",
    "gemm_rs": "fluxrt.perf.tp_ops:gemm_rs",
    "allreduce_rmsnorm": "fluxrt.perf.fused",
    "mlp": "fluxrt.perf.mlp",
    "jax_mlp": "fluxrt.perf.jax_mlp",
    "moe_dispatch": "fluxrt.perf.moe:moe_dispatch",
    "moe_combine": "fluxrt.perf.moe:moe_combine",
    "moe_layer": "fluxrt.perf.moe:moe_layer",
    "remote_rate": "fluxrt.perf.remote_rate",
}

#: One line per subcommand for ``fluxrt-perf --help``.
SUMMARIES = {
    "p2p": "rank 0 <-> 1 bandwidth (uni, bidir) per mode and signal ping-pong latency",
    "allreduce": "all_reduce_perf: fluxrt and NCCL side by side, out-of-place and in-place",
    "allgather": "all_gather_perf: fluxrt and NCCL side by side, out-of-place and in-place",
    "reduce_scatter": "reduce_scatter_perf: fluxrt and NCCL side by side, out-of-place and in-place",
    "alltoall": "alltoall_perf: fluxrt and NCCL (grouped send/recv) side by side",
    "alltoallv": "alltoallv with equal counts: fluxrt and NCCL side by side (no in-place form)",
    "broadcast": "broadcast_perf: fluxrt and NCCL side by side, -r root or all",
    "ag_gemm": "AllGather+GEMM fused vs GEMM alone, NCCL+cuBLAS, torch async-TP; overlap efficiency",
    "gemm_rs": "GEMM+ReduceScatter fused vs GEMM alone, cuBLAS+NCCL, torch async-TP; overlap efficiency",
    "allreduce_rmsnorm": "fused allreduce+residual+RMSNorm vs fluxrt/NCCL allreduce + a separate norm, per T x H",
    "mlp": "TP MLP block (AG+GEMM, SiLU*up, GEMM+RS) eager and graph vs NCCL+cuBLAS unfused, torch async-TP",
    "jax_mlp": "TP MLP step in JAX: fluxrt's fused ops inside jax.jit vs eager from Python vs shard_map (XLA NCCL)",
    "moe_dispatch": "MoE dispatch (DeepSeek-V3-, Mixtral-like; uniform, Zipf) vs NCCL all-to-all-v, DeepEP's GB/s",
    "moe_combine": "MoE combine, the same cases, vs the reverse NCCL all-to-all-v",
    "moe_layer": "MoE layer (dispatch, grouped GEMMs, combine) eager and graph vs NCCL a2a-v + cuBLAS per expert",
    "remote_rate": "NVSHMEM device-API rail rounds vs raw NVLink pointers, same bytes both ways (virtual nodes)",
}


def usage() -> str:
    width = max(map(len, BENCHES))
    lines = ["usage: fluxrt-perf SUBCOMMAND [flags]   (fluxrt-perf SUBCOMMAND --help for its flags)",
             "       run under MPI, e.g. fluxrt-run -n 2 -- fluxrt-perf allreduce -b 8 -e 1G -f 2",
             "",
             "subcommands:"]
    lines += [f"  {name:<{width}}  {SUMMARIES.get(name, '')}" for name in BENCHES]
    lines += ["",
              "nccl-tests flags: -b -e -i -f sizes, -n iters, -w warmup, -c check, -d type|all, -o op|all, -r root|all,",
              "-a 0|1|2|3 (time over ranks: rank 0, mean, min, max), -z blocking, -T timeout, -R register, -G graph,",
              "-g 1, -t 1; plus --json F, --plot F, --no-progress."]
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..fatal import one_line_errors

    return one_line_errors("fluxrt-perf")(_main)(argv)


def _main(argv=None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] not in BENCHES:
        print(f"fluxrt-perf: unknown subcommand {argv[0]!r}; choose one of {', '.join(BENCHES)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    module, _, variant = BENCHES[argv[0]].partition(":")
    bench_main = importlib.import_module(module).main
    return bench_main(argv[1:], variant) if variant else bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
