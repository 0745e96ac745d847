"""``fluxrt-perf``: the installed perf command. ``fluxrt-perf BENCH [flags]``, run under mpirun."""
from __future__ import annotations

import logging
import sys

BENCHES = {
    "p2p": "fluxrt.perf.p2p",
}


def main(argv=None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        names = ", ".join(BENCHES)
        print(f"usage: fluxrt-perf {{{names}}} [nccl-tests flags: -b -e -f -n -w -c ...] [--json F] [--plot F]\n"
              f"       run under MPI, e.g. fluxrt-run -n 2 -- fluxrt-perf p2p -b 4 -e 1G",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
