"""Stream arguments: every host call takes a CuPy stream, a cuda.core stream, a raw handle, or None."""
from __future__ import annotations


def stream_handle(stream) -> int:
    """The raw cudaStream_t of `stream` (None: CuPy's current stream on the current device)."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):  # cuda.core / any stream-protocol object
        _version, handle = stream.__cuda_stream__()
        return int(handle)
    if hasattr(stream, "handle"):
        return int(stream.handle)
    raise TypeError(f"cannot use {type(stream).__name__} as a CUDA stream: pass a cupy.cuda.Stream, "
                    "an object with __cuda_stream__, or a raw cudaStream_t integer")


class _RawStream:
    """A raw handle dressed in the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_wrapped: dict[int, object] = {}


def as_cupy_stream(stream):
    """A CuPy stream for `stream`, for kernel launches (raw handles wrapped once, never owned)."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    handle = stream_handle(stream)
    if handle == 0:   # the legacy default stream
        return cupy.cuda.Stream.null
    wrapped = _wrapped.get(handle)
    if wrapped is None:
        if len(_wrapped) >= 256:  # handles of destroyed streams get reused; keep the map small
            _wrapped.clear()
        wrapped = _wrapped[handle] = cupy.cuda.Stream.from_external(_RawStream(handle))
    return wrapped
