"""Ending a fluxrt program cleanly on an error: one-line CLI errors with their remedy, and aborting an MPI
job when one rank dies of an uncaught exception (instead of its peers waiting for it forever).

``fluxrt-run`` exports FLUXRT_ABORT_ON_EXCEPTION=1, and ``import fluxrt`` then installs
:func:`abort_excepthook`: an uncaught exception prints its traceback and calls
``MPI.COMM_WORLD.Abort(1)`` when MPI is up with more than one rank (what ``python -m mpi4py`` does, which
fluxrt-run also uses for Python commands).
"""
from __future__ import annotations

import functools
import logging
import sys

from .env import env_flag

log = logging.getLogger("fluxrt")

MPI_REMEDY = ("no MPI library could be loaded: install an MPI: pip install 'fluxrt[mpich]' or load your "
              "cluster's MPI module")
GPU_REMEDY = "no CUDA GPU/driver found: run on a machine with an NVIDIA GPU and driver (check nvidia-smi)"
_MPI_MARKS = ("cannot load mpi library", "libmpi", "mpi library")
_NO_GPU_MARKS = ("insufficient driver", "insufficientdriver", "no cuda-capable device", "cudaerrornodevice",
                 "cuda_error_no_device", "cuda driver version is insufficient", "cuda_error_not_initialized",
                 "no cuda gpu")


def describe(exc: BaseException) -> str | None:
    """One line for an error a CLI should report without a traceback, or None (let it propagate)."""
    from .errors import FluxrtError

    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, (ImportError, RuntimeError, OSError)) and any(m in text for m in _MPI_MARKS) \
            and "mpi" in text:
        return f"{MPI_REMEDY} ({_first_line(exc)})"
    if any(m in text for m in _NO_GPU_MARKS):
        return f"{GPU_REMEDY} ({_first_line(exc)})"
    if isinstance(exc, FluxrtError):
        more = len(str(exc).strip().splitlines()) - 1
        tail = f" [{more} more line(s): FLUXRT_DEBUG=DEBUG shows them]" if more > 0 else ""
        return f"{type(exc).__name__}: {_first_line(exc)}{tail}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line_errors(prog: str):
    """Decorator for a CLI's main(): fluxrt errors, a missing MPI library and a machine without a GPU
    become ``prog: error: ...`` on stderr and exit status 1 (the traceback with FLUXRT_DEBUG=DEBUG);
    Ctrl-C exits 130. Other exceptions propagate with their traceback."""

    def decorate(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except Exception as e:
                line = describe(e)
                if line is None:
                    raise
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s failed", prog, exc_info=True)
                print(f"{prog}: error: {line}", file=sys.stderr)
                return 1

        return wrapped

    return decorate


def _mpi_world():
    """mpi4py's COMM_WORLD when MPI is initialized (never imports or initializes MPI itself)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD
    except Exception:
        return None
    return None


def abort_excepthook(exc_type, exc, tb, _previous=None) -> None:
    """Print the traceback, then MPI_Abort(COMM_WORLD, 1) when this is a multi-rank MPI job."""
    (_previous or sys.__excepthook__)(exc_type, exc, tb)
    if issubclass(exc_type, SystemExit):
        return
    world = _mpi_world()
    if world is not None and world.Get_size() > 1:
        print(f"fluxrt: rank {world.Get_rank()}: uncaught {exc_type.__name__}; aborting the MPI job",
              file=sys.stderr)
        try:
            sys.stderr.flush()
            sys.stdout.flush()
        except Exception:
            pass
        world.Abort(1)


def install_abort_excepthook(env=None) -> bool:
    """Install :func:`abort_excepthook` when FLUXRT_ABORT_ON_EXCEPTION is set (fluxrt-run sets it)."""
    if not env_flag("FLUXRT_ABORT_ON_EXCEPTION", False, env):
        return False
    if getattr(sys.excepthook, "_fluxrt_abort", False):
        return True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        abort_excepthook(exc_type, exc, tb, previous)

    hook._fluxrt_abort = True
    sys.excepthook = hook
    return True
