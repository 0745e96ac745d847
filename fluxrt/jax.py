"""Collectives inside ``jax.jit``: allreduce, allgather and reduce_scatter as XLA custom calls that run
fluxrt's kernels on XLA's own stream, on XLA's own buffers (no copy).

    import fluxrt, fluxrt.jax as fj
    world = fluxrt.init()                      # before JAX allocates much (docs/embedding.md, "JAX")
    step = jax.jit(lambda g: fj.allreduce(g, world=world, op="avg"))

Each call is a ``jax.experimental.buffer_callback``: XLA hands the Python callback its stream and the device
buffers of the inputs and of the output, and the callback enqueues the collective on that stream, so the
kernels are ordered with the rest of the jitted program and nothing is copied or synchronized. With
``command_buffer=True`` the callback is traced into XLA's command buffer (a CUDA graph): it runs once, at
capture, and later executions replay its kernels, which the collectives support (device-side epochs); the
world's context and kernels are made when the function is traced (``fluxrt.prepare``), so every rank must
trace it (as every rank calls it). The cross-rank argument check, when on, runs at each call without a
command buffer and once with one.

Why buffer_callback and not an XLA FFI handler: the collectives' host side (planning, agreement, launch
caches) is Python; an FFI handler would have to be a compiled library calling back into Python anyway,
for no gain over buffer_callback, which is that path, maintained by JAX.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from . import collectives as _coll
from .errors import CollectiveArgumentError, GraphCaptureError

if TYPE_CHECKING:
    from .world import World


def _api():
    try:
        import jax
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as e:   # pragma: no cover - depends on the installed JAX
        raise ImportError(f"fluxrt.jax needs JAX with jax.experimental.buffer_callback (JAX >= 0.7): {e}") from e
    return jax, buffer_callback


def _world(world: "World | None") -> "World":
    if world is None:
        from .world import current

        return current()
    return world


def _call(name: str, x, out_shape, world, command_buffer: bool, dtypes, ops, run):
    jax, buffer_callback = _api()
    world = _world(world)
    if command_buffer:   # the callback runs inside XLA's graph capture: nothing may be made there
        ctx = _coll.prepare(world, dtypes=dtypes, ops=ops)
        if not isinstance(ctx, _coll.Collectives):
            raise GraphCaptureError(f"{name}: command_buffer=True on a world of several nodes: the hierarchical "
                                    "collectives cannot be captured in a CUDA graph; use command_buffer=False")
    out = jax.ShapeDtypeStruct(out_shape, x.dtype)

    def callback(ctx, o, a):
        run(world, a, o, ctx.stream)

    callback.__name__ = f"fluxrt_{name}"
    return buffer_callback(callback, out, has_side_effect=True, command_buffer_compatible=command_buffer)(x)


def allreduce(x, *, world: "World | None" = None, op: str = "sum", algo: str = "auto", command_buffer: bool = False):
    """fluxrt.allreduce of a JAX array inside (or outside) ``jax.jit``; the result has x's shape and dtype."""
    return _call("allreduce", x, x.shape, world, command_buffer, (x.dtype,), (op,),
                 functools.partial(_run_allreduce, op=op, algo=algo))


def allgather(x, *, world: "World | None" = None, algo: str = "auto", command_buffer: bool = False):
    """fluxrt.allgather: the ranks' x concatenated along the first axis (shape (n * x.shape[0], ...))."""
    n = _world(world).size
    shape = (n * x.shape[0], *x.shape[1:]) if x.ndim else (n,)
    return _call("allgather", x, shape, world, command_buffer, (), (),
                 functools.partial(_run_allgather, algo=algo))


def reduce_scatter(x, *, world: "World | None" = None, op: str = "sum", algo: str = "auto",
                   command_buffer: bool = False):
    """fluxrt.reduce_scatter: rank r gets the reduction of every rank's r-th slice of the first axis."""
    n = _world(world).size
    if not x.ndim or x.shape[0] % n:
        raise CollectiveArgumentError(f"reduce_scatter: the first axis of x {tuple(x.shape)} must split into {n} ranks")
    return _call("reduce_scatter", x, (x.shape[0] // n, *x.shape[1:]), world, command_buffer, (x.dtype,), (op,),
                 functools.partial(_run_reduce_scatter, op=op, algo=algo))


def _run_allreduce(world, a, o, stream, *, op, algo):
    _coll.allreduce(world, a, o, op=op, stream=stream, algo=algo)


def _run_allgather(world, a, o, stream, *, algo):
    _coll.allgather(world, a, o, stream=stream, algo=algo)


def _run_reduce_scatter(world, a, o, stream, *, op, algo):
    _coll.reduce_scatter(world, a, o, op=op, stream=stream, algo=algo)


__all__ = ["allreduce", "allgather", "reduce_scatter"]
