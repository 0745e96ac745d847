"""fluxrt's debug log, configured from the environment (NCCL_DEBUG-style).

FLUXRT_DEBUG=WARN|INFO|DEBUG|TRACE sets the level of the ``fluxrt`` logger and gives it its own handler
(stderr, or FLUXRT_DEBUG_FILE). INFO logs each call's plan on its slow path (collectives: the algorithm
and sizes; GEMM: the tile plan of a new launch; fused ops: their plans); TRACE (below DEBUG) adds the
launches of each planned call. FLUXRT_DEBUG_FILE names a file per rank: ``%r`` becomes the rank (from
the launcher's environment before MPI is up, from the world's communicator once ``fluxrt.init`` runs),
``%h`` the host name and ``%p`` the process id. Unset, fluxrt adds no handler (the application's
logging configuration applies). Every log call sits behind ``logger.isEnabledFor``: off costs one
cached lookup on slow paths and nothing on the cached fast paths.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG,
          "TRACE": TRACE, "ERROR": logging.ERROR}
# Where launchers put the rank before MPI_Init: Open MPI, MPICH/hydra and Intel MPI, PMIx, Slurm, MVAPICH.
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")
FORMAT = "%(asctime)s fluxrt[%(hostname)s:%(process)d rank %(rank)s] %(levelname)s %(name)s: %(message)s"

logger = logging.getLogger("fluxrt")
_handler: logging.Handler | None = None
_state = {"rank": None, "file": None}


def env_rank(env=None) -> int | None:
    """The rank the launcher exported, or None."""
    env = os.environ if env is None else env
    for name in RANK_VARS:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def level_from_env(env=None) -> int | None:
    """FLUXRT_DEBUG's level (None when unset or empty); an unknown name reads as INFO."""
    env = os.environ if env is None else env
    name = env.get("FLUXRT_DEBUG", "").strip().upper()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    return LEVELS.get(name, logging.INFO)


def file_name(pattern: str, rank: int | None) -> str:
    """FLUXRT_DEBUG_FILE with %r (rank, '?' when unknown), %h (host) and %p (pid) filled in; %% is %."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            sub = {"r": "?" if rank is None else str(rank), "h": socket.gethostname(), "p": str(os.getpid()),
                   "%": "%"}.get(nxt)
            if sub is not None:
                out.append(sub)
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


class _Context(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = "?" if _state["rank"] is None else _state["rank"]
        record.hostname = socket.gethostname()
        return True


def configure(env=None, rank: int | None = None) -> logging.Handler | None:
    """(Re)configure the ``fluxrt`` logger from FLUXRT_DEBUG / FLUXRT_DEBUG_FILE. Called at ``import
    fluxrt`` and again by ``fluxrt.init`` with the communicator's rank. Returns the handler (None: off)."""
    global _handler
    env = os.environ if env is None else env
    level = level_from_env(env)
    if rank is None:
        rank = _state["rank"] if _state["rank"] is not None else env_rank(env)
    _state["rank"] = rank
    if level is None:
        return None
    pattern = env.get("FLUXRT_DEBUG_FILE", "").strip()
    path = file_name(pattern, rank) if pattern else None
    if _handler is not None and path == _state["file"]:
        logger.setLevel(level)
        return _handler
    if _handler is not None:
        logger.removeHandler(_handler)
        _handler.close()
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path, mode="a")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_Context())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False   # one copy of each line even when the application configures logging too
    _handler, _state["file"] = handler, path
    return handler


def set_rank(rank: int) -> None:
    """The world's rank is known: name the log file with it (when FLUXRT_DEBUG is on)."""
    if _state["rank"] != rank or (_handler is None and level_from_env() is not None):
        configure(rank=rank)


def trace(log: logging.Logger, msg: str, *args) -> None:
    log.log(TRACE, msg, *args)
