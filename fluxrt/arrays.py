"""The one intake of array arguments: every entry point (collectives, p2p, fused ops, GEMM) takes CuPy
arrays, DLPack producers (torch, JAX, CuPy) and ``__cuda_array_interface__`` producers (Numba) here.

Two steps, so that arguments are checked before any CUDA call:

    inspect(x, name=, op=)  -> ArrayInfo    shape, dtype name, strides, pointer, device, read-only; no CUDA
    as_array(x, name=, op=, writable=, stream=, device=, contiguous=) -> cupy.ndarray (a view, never a copy)

Streams. DLPack: the consumer hands its stream to ``__dlpack__(stream=...)`` and the producer makes that
stream wait for its own work; CuPy passes its current stream, so the import runs with `stream` current.
CAI v3: a 'stream' entry names the producer's stream; the consumer stream waits for an event recorded
on it (stream-ordered, no host synchronization).

Writes. An array written by the call (``writable=True``, e.g. ``out=``) must be mutable: a CAI producer
says so in ``data[1]``; a JAX array is immutable (recognised by its type's module, without importing
jax); CuPy arrays and torch tensors are writable.

Errors are raised as `error` (layout, device, mutability) and `type_error` (not a CUDA array, host
memory), so that each layer reports in its own exception types; the message starts with ``op: name``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .dtypes import dtype_name, normalize_dtype
from .errors import ArrayArgumentError, ArrayTypeError

_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13          # DLPack device types that are device memory
_KDL_NAMES = {1: "host (CPU)", 3: "pinned host (CUDAHost)", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm"}
_LEGACY_STREAM = 1                             # the legacy default stream in both protocols (0 in CuPy)


@dataclass(frozen=True)
class ArrayInfo:
    """What a CUDA array argument is, read without any CUDA call."""

    name: str
    shape: tuple
    dtype: str                  # canonical name: 'bfloat16', 'float16', 'float32', ...
    strides: tuple | None       # bytes; None: C-contiguous (CAI) or not known before import (DLPack only)
    ptr: int                    # -1: not known before import (DLPack only)
    device: int | None          # None: not known without a CUDA call
    readonly: bool
    protocol: str               # how it is imported: 'cupy' (as is), 'dlpack' (preferred) or 'cai'
    stream: int | None = None   # CAI v3: the producer's stream
    producer: str = ""          # the type of the argument, for messages

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _producer(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _is_jax(producer: str) -> bool:
    """jax.Array (ArrayImpl, tracers) is immutable; recognised by its type's module so jax is never imported.
    XLA's FFI ``Buffer`` (what ``jax.experimental.buffer_callback`` hands a callback: XLA's own device buffers,
    the outputs written in place) is not."""
    return producer.split(".", 1)[0] in ("jax", "jaxlib") and not _is_xla_buffer(producer)


def _is_xla_buffer(producer: str) -> bool:
    return producer.split(".", 1)[0] in ("jax", "jaxlib") and producer.rsplit(".", 1)[-1] == "Buffer"


def _cupy_ndarray():
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is a dependency; keep inspection importable without it
        return None
    return cupy.ndarray


def _cai(x):
    """The CUDA array interface of `x`, or None (also when the producer refuses to export one, as torch
    does for tensors that require grad: then DLPack reports why)."""
    if not hasattr(type(x), "__cuda_array_interface__") and not hasattr(x, "__cuda_array_interface__"):
        return None
    try:
        return x.__cuda_array_interface__
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return None


def inspect(x, *, name: str, op: str, error: type = ArrayArgumentError, type_error: type = ArrayTypeError) -> ArrayInfo:
    """Shape, dtype, strides, pointer, device and mutability of a CUDA array; makes no CUDA call."""
    if x is None:
        raise type_error(f"{op}: {name} is None")
    if isinstance(x, np.ndarray):
        raise type_error(f"{op}: {name} is a host numpy array {x.shape}; pass a device array (cupy.asarray)")
    ndarray = _cupy_ndarray()
    if ndarray is not None and isinstance(x, ndarray):
        return ArrayInfo(name, tuple(x.shape), x.dtype.name, tuple(x.strides), int(x.data.ptr),
                         int(x.data.device_id), False, "cupy", None, _producer(x))
    dlpack = hasattr(x, "__dlpack__")
    cai = _cai(x)
    if cai is not None:   # a pointer and strides before any CUDA call; imported through DLPack if it can be
        info = _from_cai(x, cai, name, op, error)
        return dataclasses.replace(info, protocol="dlpack") if dlpack and not _is_xla_buffer(info.producer) else info
    if dlpack:
        return _from_dlpack_attributes(x, name, op, type_error)
    raise type_error(f"{op}: {name} of type {type(x).__name__} is not a CUDA array "
                     "(needs __dlpack__ or __cuda_array_interface__)")


def _from_cai(x, cai: dict, name: str, op: str, error: type) -> ArrayInfo:
    if cai.get("mask") is not None:
        raise error(f"{op}: {name} is a masked array; pass the data without a mask")
    shape = tuple(int(s) for s in cai["shape"])
    own = getattr(x, "dtype", None)   # the producer's dtype names bf16, which a typestr ('<V2') cannot
    dtype = dtype_name(own) if own is not None else dtype_name(np.dtype(cai["typestr"]))
    strides = cai.get("strides")
    ptr, readonly = cai["data"]
    stream = cai.get("stream") if int(cai.get("version", 0)) >= 3 else None
    if stream == 0:
        raise error(f"{op}: {name} exports stream 0 in __cuda_array_interface__, which the protocol forbids "
                    "(1: legacy default stream, 2: per-thread default stream)")
    producer = _producer(x)
    return ArrayInfo(name, shape, dtype, tuple(int(s) for s in strides) if strides is not None else None,
                     int(ptr), None, bool(readonly) or _is_jax(producer), "cai",
                     None if stream is None else int(stream), producer)


def _from_dlpack_attributes(x, name: str, op: str, type_error: type) -> ArrayInfo:
    device = None
    if hasattr(x, "__dlpack_device__"):
        kind, dev = x.__dlpack_device__()
        if int(kind) not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            where = _KDL_NAMES.get(int(kind), f"DLPack device type {int(kind)}")
            raise type_error(f"{op}: {name} lives in {where} memory; pass a CUDA array")
        device = int(dev)
    shape = tuple(int(s) for s in getattr(x, "shape", ()))
    own = getattr(x, "dtype", None)   # (np.dtype(None) would be float64)
    dtype = dtype_name(own) if own is not None else "unknown"
    producer = _producer(x)
    return ArrayInfo(name, shape, dtype, None, -1, device, _is_jax(producer), "dlpack", None, producer)


def check_writable(info: ArrayInfo, op: str, error: type = ArrayArgumentError) -> None:
    if info.readonly:
        what = "an immutable JAX array" if _is_jax(info.producer) else "marked read-only by its producer"
        raise error(f"{op}: {info.name} is written by this call, but it is {what} ({info.producer}); pass a "
                    "writable CUDA array (CuPy, torch, Numba)")


def as_array(x, *, name: str, op: str, writable: bool = False, stream=None, device: int | None = None,
             contiguous: bool = False, error: type = ArrayArgumentError, type_error: type = ArrayTypeError):
    """`x` as a cupy.ndarray over the same memory, ordered after its producer's work on `stream` (a CuPy
    stream; None: the current one). Checks, in this order: a CUDA array at all, mutability when
    `writable`, the GPU when `device` is given, C-contiguity when `contiguous`."""
    ndarray = _cupy_ndarray()
    if ndarray is not None and isinstance(x, ndarray):   # the common case: no import, nothing to order
        a = x
    else:
        if (not writable and hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)
                and not _is_xla_buffer(_producer(x))):   # XLA's buffers: by their CAI pointer, no handshake
            # imported through DLPack whatever else it exports: its CAI (pointer, strides, read-only flag)
            # would only be read and thrown away
            info = _from_dlpack_attributes(x, name, op, type_error)
        else:
            info = inspect(x, name=name, op=op, error=error, type_error=type_error)
        if writable:
            check_writable(info, op, error)
        if device is not None and info.device is not None and info.device != device:
            raise error(f"{op}: {name} is on GPU {info.device}, but this rank's world uses GPU {device}")
        a = _import(x, info, stream, op, error)
    if device is not None and a.device.id != device:
        raise error(f"{op}: {name} is on GPU {a.device.id}, but this rank's world uses GPU {device}")
    if contiguous and not a.flags.c_contiguous:
        raise error(f"{op}: {name} must be C-contiguous (shape {a.shape}, strides {a.strides}); pass a contiguous "
                    "copy (cupy.ascontiguousarray)")
    return a


def _import(x, info: ArrayInfo, stream, op: str, error: type):
    import cupy

    s = cupy.cuda.get_current_stream() if stream is None else stream
    if info.protocol == "cai":
        try:
            a = _view_of_cai(x, info, op, error)
            _wait_for_producer(info.stream, s)
        except error:
            raise
        except Exception as e:   # a CUDA error of the import: a rank's argument error like any other
            raise error(f"{op}: {info.name} cannot be imported through __cuda_array_interface__ "
                        f"({type(e).__name__}: {e})") from e
        return a
    try:
        with s:   # CuPy hands its current stream to __dlpack__(stream=...)
            return cupy.from_dlpack(x)
    except Exception as e:
        raise error(f"{op}: {info.name} cannot be imported through DLPack as GPU memory "
                    f"({type(e).__name__}: {e})") from e


def _view_of_cai(x, info: ArrayInfo, op: str, error: type):
    """A CuPy view of a CAI producer's memory with the producer's own dtype (bf16 included), keeping `x`
    alive. Built here rather than by cupy.asarray, which would block the host on the producer's stream."""
    import cupy

    try:
        dtype = normalize_dtype(info.dtype)
    except TypeError as e:
        raise error(f"{op}: {info.name} has dtype {info.dtype}, which CuPy cannot hold") from e
    if info.size == 0:   # no memory to view (the pointer may be 0)
        return cupy.empty(info.shape, dtype=dtype)
    if info.ptr == 0:
        raise error(f"{op}: {info.name} has {info.size} elements at address 0")
    strides = info.strides
    if strides is None:
        lo, hi = 0, info.size * dtype.itemsize
    else:
        lo = sum(min(0, (d - 1) * st) for d, st in zip(info.shape, strides))
        hi = sum(max(0, (d - 1) * st) for d, st in zip(info.shape, strides)) + dtype.itemsize
    device = cupy.cuda.runtime.pointerGetAttributes(info.ptr).device
    mem = cupy.cuda.UnownedMemory(info.ptr + lo, hi - lo, x, device)
    return cupy.ndarray(info.shape, dtype, cupy.cuda.MemoryPointer(mem, -lo), strides)


def _wait_for_producer(producer: int | None, consumer) -> None:
    """CAI v3: `consumer` (a CuPy stream) waits for the work enqueued so far on the producer's stream."""
    if producer is None:
        return
    import cupy

    mine = consumer.ptr
    if producer == mine or (producer == _LEGACY_STREAM and mine == 0):
        return
    rt = cupy.cuda.runtime
    event = cupy.cuda.Event(disable_timing=True)
    rt.eventRecord(event.ptr, producer)    # 1 and 2 are the runtime's own handles of the default streams
    rt.streamWaitEvent(mine, event.ptr, 0)


__all__ = ["ArrayInfo", "inspect", "as_array", "check_writable"]
