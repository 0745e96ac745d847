"""Host-side, stream-ordered point-to-point primitives.

    put         SM push into the peer's heap (kernels/comm/p2p.cu), or NVSHMEM (nvshmemx_putmem_on_stream,
                any transport); either may release a flag after the data
    get         copy-engine pull (cudaMemcpyAsync from the peer's heap) or NVSHMEM get
    signal      a one-thread kernel (fence.acq_rel.sys + release store/add) into the peer's flag, or
                cuStreamWriteValue64 where no copy-engine put precedes it
    wait        a one-thread kernel spinning with acquire loads, bounded by the world's timeout;
                cuStreamWaitValue64 is not used because it cannot be bounded
    barrier     one block signalling and waiting on every peer through a symmetric pad

Every call accepts a CuPy stream, a raw handle or None (current stream).
"""
from __future__ import annotations

import math

import numpy as np

from .errors import NO_PEER, op_id
from .streams import as_cupy_stream as _cupy_stream, stream_handle

PUT_MODES = ("sm", "nvshmem")
GET_MODES = ("copy_engine", "nvshmem")
_THREADS = 512
_VEC_BYTES_PER_THREAD = 64  # four 16-byte vectors in flight per thread per iteration
_COUNTER_SLOTS = 1024       # concurrent SM-push launches that may be in flight at once


class _P2PState:
    """Per-world kernels and scratch, made on first use."""

    def __init__(self, world):
        import cupy

        from .toolchain import load_module

        with world.device:
            self.module = load_module("comm/p2p.cu")
            self.put_signal = self.module.get_function("fluxrt_put_signal")
            self.signal = self.module.get_function("fluxrt_signal")
            self.wait = self.module.get_function("fluxrt_wait")
            self.barrier = self.module.get_function("fluxrt_barrier")
            self.pingpong = self.module.get_function("fluxrt_pingpong")
            self.counters = cupy.zeros(_COUNTER_SLOTS, dtype=np.uint32)
            self.sm_count = world.device.attributes["MultiProcessorCount"]
        self.next_counter = 0
        self.barrier_pad = world.zeros((world.size,), np.uint64)
        self.barrier_epoch = 0

    def counter_ptr(self) -> int:
        ptr = self.counters.data.ptr + 4 * self.next_counter
        self.next_counter = (self.next_counter + 1) % _COUNTER_SLOTS
        return ptr


def state(world) -> _P2PState:
    """The world's p2p kernels and scratch. Made collectively in World.__init__, never lazily: a lazy
    first use would allocate symmetric memory on whichever rank happened to call first."""
    return world._p2p_state


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


def sm_grid(world, nbytes: int, max_blocks: int | None = None) -> int:
    blocks = math.ceil(max(1, nbytes) / (_THREADS * _VEC_BYTES_PER_THREAD))
    return max(1, min(blocks, max_blocks or 2 * state(world).sm_count))


def _device_ptr(arr, what: str) -> tuple[int, int]:
    import cupy

    if isinstance(arr, np.ndarray):   # cupy.asarray would copy it to a temporary the async copy outlives
        raise ValueError(f"{what}: host numpy array of shape {arr.shape}; pass a device array")
    a = cupy.asarray(arr)
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: needs a C-contiguous array (shape {a.shape}, strides {a.strides})")
    return a.data.ptr, a.nbytes


def _what(world, verb: str, peer: int) -> str:
    return f"p2p.{verb} (rank {world.rank}, peer {peer})"


def _check_transfer(world, verb: str, mode: str, modes: tuple, peer: int, *, local, remote) -> tuple[int, int]:
    """Validate a put/get before anything is launched; returns (local pointer, bytes)."""
    what = _what(world, verb, peer)
    if mode not in modes:
        hint = " (copy-engine transfers are pulls: p2p.get)" if verb == "put" and mode == "copy_engine" else ""
        raise ValueError(f"{what}: mode {mode!r} not in {modes}{hint}")
    if not 0 <= peer < world.size:
        raise ValueError(f"{what}: peer outside world of size {world.size}")
    ptr, nbytes = _device_ptr(local, what)
    if nbytes > remote.nbytes:
        raise ValueError(f"{what}: {nbytes} bytes, but the symmetric side {remote.shape} has only {remote.nbytes}")
    if not remote.flags.c_contiguous:
        raise ValueError(f"{what}: the symmetric side must be C-contiguous (strides {remote.strides})")
    return ptr, nbytes


def put(world, dst, src, peer: int, *, mode: str = "sm", stream=None, flag_ptr: int = 0,
        flag_value: int = 0, blocks: int | None = None) -> None:
    """Copy local `src` into `dst`'s copy on `peer` (dst: a symmetric array or view). If `flag_ptr` is
    given, that flag is set to `flag_value` once the data has landed: a peer flag address
    (``pad.peer_ptr(peer, slot)``) for mode 'sm', the symmetric address (``pad.local_ptr(slot)``) for
    mode 'nvshmem'.

    There is no copy-engine put: a flag released after a copy-engine write to a peer can reach the
    peer before the data does (seen on H200 NVLink), so copy-engine transfers are pulls (``get``)."""
    src_ptr, nbytes = _check_transfer(world, "put", mode, PUT_MODES, peer, local=src, remote=dst)
    h = stream_handle(stream)
    if mode == "nvshmem":
        from nvshmem import bindings

        if flag_ptr:
            bindings.putmem_signal_on_stream(dst.data.ptr, src_ptr, nbytes, flag_ptr, flag_value, 0, peer, h)
        else:
            bindings.putmem_on_stream(dst.data.ptr, src_ptr, nbytes, peer, h)
        return
    dst_ptr = dst.peer_ptr(peer)
    if dst_ptr == 0:
        raise ValueError(f"{_what(world, 'put', peer)}: not reachable by NVLink pointers; use mode='nvshmem'")
    st = state(world)
    grid = blocks or sm_grid(world, nbytes)
    st.put_signal((grid,), (_THREADS,), (_u64(dst_ptr), _u64(src_ptr), _u64(nbytes), _u64(flag_ptr),
                                         _u64(flag_value), np.int32(0), _u64(st.counter_ptr())),
                  stream=_cupy_stream(h))


def get(world, dst, src, peer: int, *, mode: str = "copy_engine", stream=None) -> None:
    """Copy `src`'s copy on `peer` (src: a symmetric array or view) into local `dst`, stream-ordered:
    work after it on `stream` sees the data (a read completes only when the bytes are here).
    'copy_engine' pulls with cudaMemcpyAsync over NVLink and leaves the SMs free; 'nvshmem' uses
    nvshmemx_getmem_on_stream (any transport). Wait for the owner's 'ready' signal first."""
    dst_ptr, nbytes = _check_transfer(world, "get", mode, GET_MODES, peer, local=dst, remote=src)
    h = stream_handle(stream)
    if mode == "nvshmem":
        from nvshmem import bindings

        bindings.getmem_on_stream(dst_ptr, src.data.ptr, nbytes, peer, h)
        return
    src_ptr = src.peer_ptr(peer)
    if src_ptr == 0:
        raise ValueError(f"{_what(world, 'get', peer)}: not reachable by NVLink pointers; use mode='nvshmem'")
    if nbytes:
        import cupy

        cupy.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, h)


def signal(world, flag_ptr: int, value: int, *, add: bool = False, stream=None, via: str = "kernel") -> None:
    """After prior work on the stream, set or add `value` at a (peer) flag address.

    via='kernel' (default): a one-thread kernel, fence.acq_rel.sys then st/red.release.sys.
    via='stream_op': cuStreamWriteValue64 (set only; no SM used). It orders after prior kernels'
    writes; like any signal it must not follow a copy-engine write to a peer (see put)."""
    h = stream_handle(stream)
    if via not in ("kernel", "stream_op"):
        raise ValueError(f"signal via {via!r}: use 'kernel' or 'stream_op'")
    if add or via == "kernel":
        state(world).signal((1,), (1,), (_u64(flag_ptr), _u64(value), np.int32(add)), stream=_cupy_stream(h))
        return
    from cuda.bindings import driver

    (err,) = driver.cuStreamWriteValue64(driver.CUstream(h), driver.CUdeviceptr(flag_ptr), value, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWriteValue64 to 0x{flag_ptr:x} failed: {err}")


def wait(world, flag_ptr: int, value: int, *, peer: int | None = None, op: str = "wait", stream=None) -> None:
    """Stream-ordered bounded wait until the local flag at `flag_ptr` reaches `value`."""
    st = state(world)
    st.wait((1,), (1,), (_u64(flag_ptr), _u64(value), _u64(world.timeout_ns), _u64(world.error_record),
                         np.uint32(op_id(op)), np.uint32(world.rank), _u64(NO_PEER if peer is None else peer)),
            stream=_cupy_stream(stream))


def barrier(world, stream=None, op: str = "barrier") -> None:
    """Stream-ordered barrier across every rank of the world."""
    st = state(world)
    st.barrier_epoch += 1
    pad = st.barrier_pad
    threads = max(32, 32 * math.ceil(world.size / 32))
    st.barrier((1,), (threads,), (_u64(pad.peer_table.data.ptr), _u64(pad.data.ptr), np.uint32(world.rank),
                                  np.uint32(world.size), _u64(st.barrier_epoch), _u64(world.timeout_ns),
                                  _u64(world.error_record), np.uint32(op_id(op))),
               stream=_cupy_stream(stream))
