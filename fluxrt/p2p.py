"""Host-side, stream-ordered point-to-point data movement.

    put         SM push into the peer's heap (kernels/comm/p2p.cu), or NVSHMEM (nvshmemx_putmem_on_stream,
                any transport); either may release a flag after the data
    get         copy-engine pull (cudaMemcpyAsync from the peer's heap) or NVSHMEM get

Flags (signal, wait, barrier, signal pads) are ``fluxrt.signals``. Every call accepts a CuPy stream, a
cuda.core stream, a raw handle or None (current stream); the local array may be any CUDA array
(``fluxrt.arrays``), the remote one is a symmetric array.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .arrays import as_array
from .nvtx import annotate as _nvtx
from .streams import as_cupy_stream

if TYPE_CHECKING:
    from .world import World

PUT_MODES = ("sm", "nvshmem")
GET_MODES = ("copy_engine", "nvshmem")
_THREADS = 512
_VEC_BYTES_PER_THREAD = 64  # four 16-byte vectors in flight per thread per iteration
_COUNTER_SLOTS = 1024       # concurrent SM-push launches that may be in flight at once
_KEY = "fluxrt.p2p"


class _P2PState:
    """Per-world kernels and scratch (no symmetric memory: made on a rank's first use, which need not be
    collective). Callers that must not compile or allocate inside a timed or captured call make it
    first: ``p2p.state(world)``."""

    def __init__(self, world: World):
        import cupy

        from .toolchain import load_module

        with world.device:
            self.module = load_module("comm/p2p.cu")
            self.put_signal = self.module.get_function("fluxrt_put_signal")
            self.pingpong = self.module.get_function("fluxrt_pingpong")
            self.counters = cupy.zeros(_COUNTER_SLOTS, dtype=np.uint32)
            cupy.cuda.get_current_stream().synchronize()   # zeroed before a put on another stream reads them
            self.sm_count = world.device.attributes["MultiProcessorCount"]
        self.next_counter = 0

    def counter_ptr(self) -> int:
        ptr = self.counters.data.ptr + 4 * self.next_counter
        self.next_counter = (self.next_counter + 1) % _COUNTER_SLOTS
        return ptr


def state(world: World) -> _P2PState:
    """The world's p2p kernels and scratch, made on first use (kept in the world's registry)."""
    return world.registry.get_or_create(_KEY, lambda: _P2PState(world))


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


def sm_grid(world: World, nbytes: int, max_blocks: int | None = None) -> int:
    blocks = math.ceil(max(1, nbytes) / (_THREADS * _VEC_BYTES_PER_THREAD))
    return max(1, min(blocks, max_blocks or 2 * state(world).sm_count))


def _what(world: World, verb: str, peer: int) -> str:
    return f"p2p.{verb} (rank {world.rank}, peer {peer})"


def _check_transfer(world: World, verb: str, mode: str, modes: tuple, peer: int, *, local, remote,
                    stream) -> tuple[int, int]:
    """Validate a put/get before anything is launched; returns (local pointer, bytes). The local array
    is the source of a put and is written by a get."""
    what = _what(world, verb, peer)
    if mode not in modes:
        hint = " (copy-engine transfers are pulls: p2p.get)" if verb == "put" and mode == "copy_engine" else ""
        raise ValueError(f"{what}: mode {mode!r} not in {modes}{hint}")
    if not 0 <= peer < world.size:
        raise ValueError(f"{what}: peer outside world of size {world.size}")
    a = as_array(local, name="dst" if verb == "get" else "src", op=what, writable=verb == "get", stream=stream,
                 device=world.device_id, contiguous=True)
    ptr, nbytes = a.data.ptr, a.nbytes
    if nbytes > remote.nbytes:
        raise ValueError(f"{what}: {nbytes} bytes, but the symmetric side {remote.shape} has only {remote.nbytes}")
    if not remote.flags.c_contiguous:
        raise ValueError(f"{what}: the symmetric side must be C-contiguous (strides {remote.strides})")
    return ptr, nbytes


@_nvtx("put")
def put(world: World, dst, src, peer: int, *, mode: str = "sm", stream=None, flag_ptr: int = 0,
        flag_value: int = 0, blocks: int | None = None) -> None:
    """Copy local `src` into `dst`'s copy on `peer` (dst: a symmetric array or view). If `flag_ptr` is
    given, that flag is set to `flag_value` once the data has landed: a peer flag address
    (``pad.peer_ptr(peer, slot)``) for mode 'sm', the symmetric address (``pad.local_ptr(slot)``) for
    mode 'nvshmem'.

    There is no copy-engine put: a flag released after a copy-engine write to a peer can reach the
    peer before the data does (seen on H200 NVLink), so copy-engine transfers are pulls (``get``)."""
    world.check_errors()   # a sticky device error raises before anything is launched
    s = as_cupy_stream(stream)
    src_ptr, nbytes = _check_transfer(world, "put", mode, PUT_MODES, peer, local=src, remote=dst, stream=s)
    if mode == "nvshmem":
        from nvshmem import bindings

        pe = world.pe(peer)   # a sub-world's rank is not its NVSHMEM PE
        if flag_ptr:
            bindings.putmem_signal_on_stream(dst.data.ptr, src_ptr, nbytes, flag_ptr, flag_value, 0, pe, s.ptr)
        else:
            bindings.putmem_on_stream(dst.data.ptr, src_ptr, nbytes, pe, s.ptr)
        return
    dst_ptr = dst.peer_ptr(peer)
    if dst_ptr == 0:
        raise ValueError(f"{_what(world, 'put', peer)}: not reachable by NVLink pointers; use mode='nvshmem'")
    st = state(world)
    grid = blocks or sm_grid(world, nbytes)
    st.put_signal((grid,), (_THREADS,), (_u64(dst_ptr), _u64(src_ptr), _u64(nbytes), _u64(flag_ptr),
                                         _u64(flag_value), np.int32(0), _u64(st.counter_ptr())),
                  stream=s)


@_nvtx("get")
def get(world: World, dst, src, peer: int, *, mode: str = "copy_engine", stream=None) -> None:
    """Copy `src`'s copy on `peer` (src: a symmetric array or view) into local `dst`, stream-ordered:
    work after it on `stream` sees the data (a read completes only when the bytes are here).
    'copy_engine' pulls with cudaMemcpyAsync over NVLink and leaves the SMs free; 'nvshmem' uses
    nvshmemx_getmem_on_stream (any transport). Wait for the owner's 'ready' signal first."""
    world.check_errors()
    s = as_cupy_stream(stream)
    dst_ptr, nbytes = _check_transfer(world, "get", mode, GET_MODES, peer, local=dst, remote=src, stream=s)
    if mode == "nvshmem":
        from nvshmem import bindings

        bindings.getmem_on_stream(dst_ptr, src.data.ptr, nbytes, world.pe(peer), s.ptr)
        return
    src_ptr = src.peer_ptr(peer)
    if src_ptr == 0:
        raise ValueError(f"{_what(world, 'get', peer)}: not reachable by NVLink pointers; use mode='nvshmem'")
    if nbytes:
        import cupy

        cupy.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)

