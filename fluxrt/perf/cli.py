"""``fluxrt-perf``: the installed perf command. ``fluxrt-perf BENCH [flags]``, run under mpirun."""
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
}


def main(argv=None) -> int:
    from ..fatal import one_line_errors

    return one_line_errors("fluxrt-perf")(_main)(argv)


def _main(argv=None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        names = ", ".join(BENCHES)
        print(f"usage: fluxrt-perf {{{names}}} [nccl-tests flags: -b -e -f -n -w -c ...] [--json F] [--plot F]\n"
              f"       run under MPI, e.g. fluxrt-run -n 2 -- fluxrt-perf p2p -b 4 -e 1G",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    module, _, variant = BENCHES[argv[0]].partition(":")
    bench_main = importlib.import_module(module).main
    return bench_main(argv[1:], variant) if variant else bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
