"""NVTX ranges around fluxrt's public calls, for Nsight Systems timelines.

FLUXRT_NVTX=1 (read once, when fluxrt is imported) wraps every public entry point -- the collectives (``hier.*``
across nodes), ``gemm``, ``grouped_gemm``, the fused ops' ``forward``, ``allreduce_rmsnorm``, MoE dispatch,
combine and layer, p2p ``put``/``get``, ``World.barrier`` -- in an NVTX range named
``fluxrt.<op>``, pushed with CuPy's ``cupy.cuda.nvtx`` (or the ``nvtx`` package when CuPy's is missing).
Off (the default), :func:`annotate` returns the function itself: no wrapper, no cost. Nothing CUDA is
imported here; the NVTX module is looked up at the first range.
"""
from __future__ import annotations

import functools
import logging

from .env import env_flag

log = logging.getLogger(__name__)


def enabled_from_env(env=None) -> bool:
    return env_flag("FLUXRT_NVTX", False, env)


ENABLED = enabled_from_env()
_backend: tuple | None = None   # (push(name), pop()) once looked up


def _noop(*_args) -> None:
    return None


def _load_backend() -> tuple:
    """(push, pop) from cupy.cuda.nvtx, else the nvtx package, else no-ops (said once)."""
    try:
        from cupy.cuda import nvtx as cupy_nvtx

        return cupy_nvtx.RangePush, cupy_nvtx.RangePop
    except Exception as e:  # no CuPy / no CUDA: the nvtx package, if installed
        first = e
    try:
        import nvtx as nvtx_pkg

        return (lambda name: nvtx_pkg.push_range(name)), nvtx_pkg.pop_range
    except Exception:
        log.warning("FLUXRT_NVTX=1 but no NVTX is importable (cupy.cuda.nvtx: %s; no nvtx package): ranges off",
                    first)
        return _noop, _noop


def backend() -> tuple:
    global _backend
    if _backend is None:
        _backend = _load_backend()
    return _backend


def wrap(fn, name: str):
    """`fn` inside an NVTX range `name` (always; :func:`annotate` decides whether to)."""

    @functools.wraps(fn)
    def ranged(*args, **kwargs):
        push, pop = _backend or backend()
        push(name)
        try:
            return fn(*args, **kwargs)
        finally:
            pop()

    ranged.__wrapped_nvtx__ = name
    return ranged


def annotate(name: str, enabled: bool | None = None):
    """Decorator: an NVTX range ``fluxrt.<name>`` around the function when NVTX is on, else the function
    unchanged."""
    on = ENABLED if enabled is None else enabled

    def decorate(fn):
        return wrap(fn, "fluxrt." + name) if on else fn

    return decorate


class range:  # noqa: A001 -- reads as nvtx.range("...")
    """Context manager form: ``with fluxrt.nvtx.range("step"):`` (a no-op when NVTX is off)."""

    def __init__(self, name: str, enabled: bool | None = None):
        self.name, self.on = name, ENABLED if enabled is None else enabled

    def __enter__(self):
        if self.on:
            backend()[0](self.name)
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            backend()[1]()
