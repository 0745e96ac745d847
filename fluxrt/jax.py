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

The fused tensor-parallel ops (AllGather+GEMM, GEMM+ReduceScatter, the MLP block) go through the same
callback, from a :class:`TPOps` object that holds one ``fluxrt.ops`` object per call shape::

    tp = fj.TPOps(world)
    @jax.jit
    def mlp(x_shard, w_gate_up, w_down):                  # column- then row-parallel
        h = tp.ag_gemm(x_shard, w_gate_up)                 # [M, 2 ffn]
        ffn = h.shape[1] // 2
        return tp.gemm_rs(jax.nn.silu(h[:, :ffn]) * h[:, ffn:], w_down)   # [M/world, hidden]

An op is made (collectively) and run once on zeros when a function that calls it is traced, so its kernels
are compiled and its path agreed outside XLA's execution; later traces of the same shape reuse it.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from . import collectives as _coll
from .errors import CollectiveArgumentError, GraphCaptureError
from .streams import as_cupy_stream

log = logging.getLogger(__name__)

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
    world = _world(world)
    if command_buffer:   # the callback runs inside XLA's graph capture: nothing may be made there
        ctx = _coll.prepare(world, dtypes=dtypes, ops=ops)
        if not isinstance(ctx, _coll.Collectives):
            raise GraphCaptureError(f"{name}: command_buffer=True on a world of several nodes: the hierarchical "
                                    "collectives cannot be captured in a CUDA graph; use command_buffer=False")
    return _buffer_call(name, (x,), out_shape, x.dtype, command_buffer, lambda stream, o, a: run(world, a, o, stream))


def _buffer_call(name: str, inputs: tuple, out_shape, dtype, command_buffer: bool, run, on_call=None):
    """One XLA custom call: ``run(stream, out, *inputs)`` enqueues on XLA's stream, writing the output
    buffer (`out_shape`, `dtype`) in place. on_call(stream), if given, runs first (bookkeeping)."""
    jax, buffer_callback = _api()
    out = jax.ShapeDtypeStruct(tuple(out_shape), dtype)

    def callback(ctx, o, *a):
        if on_call is not None:
            on_call(ctx.stream)
        run(ctx.stream, o, *a)

    callback.__name__ = f"fluxrt_{name}"
    return buffer_callback(callback, out, has_side_effect=True, command_buffer_compatible=command_buffer)(*inputs)


def device(world: "World | None" = None):
    """The JAX device of the world's GPU (the local device with its CUDA ordinal), on which the arrays of a
    jitted fluxrt call must live."""
    jax, _ = _api()
    world = _world(world)
    for d in jax.local_devices(backend="gpu"):
        if getattr(d, "local_hardware_id", d.id) == world.device_id:
            return d
    raise RuntimeError(f"fluxrt.jax: JAX has no local GPU with CUDA ordinal {world.device_id} (the world's device); "
                       "is CUDA_VISIBLE_DEVICES different from fluxrt's?")


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





# ------------------------------------------------------------------------------------------ fused ops
class TPOps:
    """AllGather+GEMM, GEMM+ReduceScatter and the MLP block (``fluxrt.ops``) callable inside ``jax.jit``.

    Each method is traced into one XLA custom call whose callback runs the op's ``forward`` on XLA's
    stream, reading the inputs and writing the output in XLA's buffers. The op objects live here, one per
    (op, M, sizes, dtype, trans_b), made when a function that calls the method is first traced with that
    shape: construction is collective (symmetric buffers, agreed arguments), so every rank must trace the
    same functions in the same order, as every rank calls them. At that point the op also runs once on
    zeros, on a side stream of the world's device: its kernels are compiled and loaded and its path agreed
    across ranks (``fluxrt.ops.cost``) before XLA runs anything. :meth:`free` (collective) returns the
    ops' symmetric memory.

    path: None (each op's cost model picks per M), 'fused' or 'decomposed', per object or per call.
    command_buffer: trace the callback into XLA's command buffer (a CUDA graph): the op then takes the
    decomposed path (the fused kernels take per-call flag epochs from the host, which a replay would
    repeat; the decomposed path's collectives count their rounds on the device), and the warm-up runs
    that path. ``captured`` counts the callbacks that ran inside a capture, ``calls`` all of them.
    """

    def __init__(self, world: "World | None" = None, *, path: str | None = None, command_buffer: bool = False):
        self.world = _world(world)
        self.path, self.command_buffer = path, bool(command_buffer)
        self._ops: dict = {}
        self._ready: set = set()
        self.calls = 0
        self.captured = 0

    @property
    def ops(self) -> dict:
        """The op objects made so far, by key (kind, M, sizes..., dtype, trans_b)."""
        return dict(self._ops)

    # --- the calls ----------------------------------------------------------------------------------
    def ag_gemm(self, x_shard, w, *, trans_b: bool = False, path: str | None = None,
                command_buffer: bool | None = None):
        """allgather(x_shard [M/world, K]) @ w (w [K, N], or [N, K] with trans_b) -> [M, N]
        (fluxrt.ops.AllGatherGemm)."""
        from .ops import AllGatherGemm

        n_ranks = self.world.size
        mode = self._mode("ag_gemm", path, command_buffer)
        dtype = self._dtype("ag_gemm", x_shard, w)
        k = self._matrix("ag_gemm", "x_shard", x_shard)[1]
        n = self._weight("ag_gemm", "w", w, k, trans_b)
        m = int(x_shard.shape[0]) * n_ranks
        key = ("ag_gemm", m, n, k, dtype, bool(trans_b))
        op = self._op(key, lambda: AllGatherGemm(self.world, m, n, k, dtype, trans_b=trans_b))
        return self._run(key, op, (x_shard, w), (m, n), x_shard.dtype, mode)

    def gemm_rs(self, a, w, *, trans_b: bool = False, path: str | None = None, command_buffer: bool | None = None):
        """This rank's rows of reduce_scatter(a [M, K_local] @ w) (w [K_local, N], or [N, K_local] with
        trans_b) -> [M/world, N] (fluxrt.ops.GemmReduceScatter)."""
        from .ops import GemmReduceScatter

        mode = self._mode("gemm_rs", path, command_buffer)
        dtype = self._dtype("gemm_rs", a, w)
        m, k = self._matrix("gemm_rs", "a", a)
        n = self._weight("gemm_rs", "w", w, k, trans_b)
        self._rows("gemm_rs", m)
        key = ("gemm_rs", m, n, k, dtype, bool(trans_b))
        op = self._op(key, lambda: GemmReduceScatter(self.world, m, n, k, dtype, trans_b=trans_b))
        return self._run(key, op, (a, w), (m // self.world.size, n), a.dtype, mode)

    def mlp(self, x_shard, w_gate_up, w_down, *, trans_b: bool = False, path: str | None = None,
            command_buffer: bool | None = None):
        """The MLP block (fluxrt.ops.TPMLP) as one call: x_shard [M/world, hidden], w_gate_up [hidden,
        2 ffn] (gate columns, then up columns), w_down [ffn, hidden] (both transposed with trans_b) ->
        [M/world, hidden]."""
        from .ops import TPMLP

        mode = self._mode("mlp", path, command_buffer)
        dtype = self._dtype("mlp", x_shard, w_gate_up, w_down)
        hidden = self._matrix("mlp", "x_shard", x_shard)[1]
        two_ffn = self._weight("mlp", "w_gate_up", w_gate_up, hidden, trans_b)
        if two_ffn % 2:
            raise self._error(f"mlp: w_gate_up has {two_ffn} output columns, not gate and up halves")
        ffn = two_ffn // 2
        if self._weight("mlp", "w_down", w_down, ffn, trans_b) != hidden:
            raise self._error(f"mlp: w_down {tuple(w_down.shape)} does not map ffn={ffn} back to hidden={hidden}")
        m = int(x_shard.shape[0]) * self.world.size
        key = ("mlp", m, hidden, ffn, dtype, bool(trans_b))
        op = self._op(key, lambda: TPMLP(self.world, m, hidden, ffn, dtype, trans_b=trans_b))
        return self._run(key, op, (x_shard, w_gate_up, w_down), (m // self.world.size, hidden), x_shard.dtype, mode)

    def paths(self) -> dict:
        """{(op key, path asked): the path the op takes for its M}: 'fused' or 'decomposed' (the MLP block:
        its AllGather+GEMM's, then its GEMM+ReduceScatter's), as agreed at the warm-up (no exchange now)."""
        out = {}
        for key, path in sorted(self._ready, key=str):
            op = self._ops[key]
            parts = (op.ag, op.rs) if key[0] == "mlp" else (op,)
            out[(key, path)] = "/".join(p.path_choice(key[1], path=path).path for p in parts)
        return out

    def free(self) -> None:
        """Collective: free every op's symmetric buffers (functions traced with them must not run again)."""
        for op in reversed(list(self._ops.values())):
            op.free()
        self._ops.clear()
        self._ready.clear()

    def __repr__(self) -> str:
        return (f"TPOps(world={self.world.size}, path={self.path}, command_buffer={self.command_buffer}, "
                f"ops={list(self._ops)})")

    # --- the plumbing -------------------------------------------------------------------------------
    def _op(self, key, make):
        op = self._ops.get(key)
        if op is None:
            op = self._ops[key] = make()
            log.info("fluxrt.jax: rank %d made %r for %s", self.world.rank, op, key)
        return op

    def _mode(self, name: str, path, command_buffer) -> tuple:
        """(path, command_buffer) of a call, checked before any op is made."""
        cb = self.command_buffer if command_buffer is None else bool(command_buffer)
        path = self.path if path is None else path
        if path not in (None, "auto", "fused", "decomposed"):
            raise self._error(f"fluxrt.jax.TPOps.{name}: path={path!r}: use None, 'auto', 'fused' or 'decomposed'")
        if cb:
            if path == "fused":
                raise GraphCaptureError(f"fluxrt.jax.TPOps.{name}: path='fused' with command_buffer=True: the "
                                        "fused kernels take per-call flag epochs from the host and cannot be "
                                        "replayed; use path=None or 'decomposed'")
            path = "decomposed"
        return path, cb

    def _run(self, key, op, inputs, out_shape, dtype, mode):
        path, cb = mode
        if (key, path) not in self._ready:
            self._warm_up(op, key, path)
            self._ready.add((key, path))

        def run(stream, o, *a):
            op.forward(*a, out=o, stream=stream, path=path)

        return _buffer_call(key[0], inputs, out_shape, dtype, cb, run, self._count)

    def _count(self, stream) -> None:
        self.calls += 1
        if as_cupy_stream(stream).is_capturing():
            self.captured += 1

    def _warm_up(self, op, key, path) -> None:
        """One collective call on zeros, outside XLA: compiles and loads the call's kernels, makes the
        decomposed path's buffers and agrees the path of this M (cached by the op)."""
        import cupy

        from .dtypes import normalize_dtype

        world, kind = self.world, key[0]
        dt = normalize_dtype(key[4])
        m, w = key[1], world.size
        if kind == "ag_gemm":
            _, _, n, k, _, tb = key
            shapes = [(m // w, k), (n, k) if tb else (k, n), (m, n)]
        elif kind == "gemm_rs":
            _, _, n, k, _, tb = key
            shapes = [(m, k), (n, k) if tb else (k, n), (m // w, n)]
        else:
            _, _, hidden, ffn, _, tb = key
            shapes = [(m // w, hidden), (2 * ffn, hidden) if tb else (hidden, 2 * ffn),
                      (hidden, ffn) if tb else (ffn, hidden), (m // w, hidden)]
        with world.device:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                arrays = [cupy.zeros(shape, dtype=dt) for shape in shapes]
            op.forward(*arrays[:-1], out=arrays[-1], stream=s, path=path)
            s.synchronize()
        world.check_errors()

    def _error(self, text: str):
        from .ops import OpsArgumentError

        return OpsArgumentError(text)

    def _dtype(self, name: str, *xs) -> str:
        from .dtypes import normalize_dtype

        kinds = {normalize_dtype(x.dtype).name for x in xs}
        if len(kinds) != 1 or not kinds <= {"bfloat16", "float16"}:
            raise self._error(f"fluxrt.jax.TPOps.{name}: the inputs must all be bf16 or all fp16, got "
                              f"{[str(x.dtype) for x in xs]}")
        return kinds.pop()

    def _matrix(self, name: str, what: str, x) -> tuple[int, int]:
        if len(x.shape) != 2:
            raise self._error(f"fluxrt.jax.TPOps.{name}: {what} must be 2-D, got shape {tuple(x.shape)}")
        return int(x.shape[0]), int(x.shape[1])

    def _weight(self, name: str, what: str, w, k: int, trans_b: bool) -> int:
        """N of a weight [k, N] ([N, k] with trans_b)."""
        rows, cols = self._matrix(name, what, w)
        inner, n = (cols, rows) if trans_b else (rows, cols)
        if inner != k:
            form = "[N, K]" if trans_b else "[K, N]"
            raise self._error(f"fluxrt.jax.TPOps.{name}: {what} {(rows, cols)} ({form}) has K={inner}, the "
                              f"activations have K={k}")
        return n

    def _rows(self, name: str, m: int) -> None:
        if m % self.world.size:
            raise self._error(f"fluxrt.jax.TPOps.{name}: M={m} rows must split into {self.world.size} ranks")


__all__ = ["allreduce", "allgather", "reduce_scatter", "device", "TPOps"]
