"""Symmetric memory: CuPy arrays on the NVSHMEM heap, their peer views and device-side peer tables.

A symmetric allocation has the same offset in every rank's heap, so a view (slice) of it is symmetric
too: ``arr.peer(r)`` maps any view onto rank r's copy through NVLink (``nvshmem_ptr``). Allocation is
collective; shapes and dtypes are compared across ranks before NVSHMEM is called, because a mismatched
``nvshmem_malloc`` hangs or corrupts the heap instead of failing.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .dtypes import normalize_dtype
from .errors import CollectiveMismatchError, HeapExhaustedError, NotSymmetricError

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger(__name__)

DEFAULT_HEAP_BYTES = 1 << 30  # NVSHMEM_SYMMETRIC_SIZE default in NVSHMEM 3.x
_ALIGN = 512  # bytes each allocation may take beyond its size (NVSHMEM aligns blocks)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_bytes(text: str | int) -> int:
    """'4G', '512M', '1073741824' -> bytes (NVSHMEM_SYMMETRIC_SIZE syntax, powers of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (examples: 1073741824, 512M, 4G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def heap_capacity() -> int:
    return parse_bytes(os.environ.get("NVSHMEM_SYMMETRIC_SIZE", DEFAULT_HEAP_BYTES))


@dataclass
class _Allocation:
    base: int          # local device address of the allocation
    nbytes: int
    peer_bases: list   # peer_bases[r]: rank r's copy mapped into this process (0: not reachable)
    peer_table: object = None  # cupy uint64 array of peer_bases, made on first use


def _symmetric_array_class():
    import cupy

    class SymmetricArray(cupy.ndarray):
        """A cupy.ndarray on the NVSHMEM symmetric heap. Slices stay symmetric; results of arithmetic
        are ordinary device memory, and ``peer`` refuses them."""

        def __array_finalize__(self, obj):
            self._heap = getattr(obj, "_heap", None)

        def _allocation(self) -> _Allocation:
            heap = getattr(self, "_heap", None)
            alloc = heap.find(self.data.ptr, self.nbytes) if heap is not None else None
            if alloc is None:
                raise NotSymmetricError(
                    "this array is not (a view of) a live symmetric allocation: results of arithmetic "
                    "are ordinary device memory; allocate with world.empty/zeros and write into it")
            return alloc

        def peer(self, rank: int):
            """This view as seen in rank `rank`'s heap (a plain cupy.ndarray over NVLink)."""
            alloc = self._allocation()
            heap = self._heap
            if not 0 <= rank < heap.world.size:
                raise ValueError(f"peer rank {rank} outside world of size {heap.world.size}")
            pbase = alloc.peer_bases[rank]
            if pbase == 0:
                raise NotSymmetricError(
                    f"rank {rank} is not reachable by load/store from rank {heap.world.rank} "
                    "(no NVLink/P2P mapping); use the NVSHMEM put path instead")
            ptr = pbase + (self.data.ptr - alloc.base)
            mem = cupy.cuda.UnownedMemory(ptr, self.nbytes, self, heap.world.device_id)
            return cupy.ndarray(self.shape, self.dtype, cupy.cuda.MemoryPointer(mem, 0), self.strides)

        def peer_ptr(self, rank: int) -> int:
            """Device address of this view in rank `rank`'s heap (0 when not reachable)."""
            alloc = self._allocation()
            pbase = alloc.peer_bases[rank]
            return pbase + (self.data.ptr - alloc.base) if pbase else 0

        @property
        def peer_table(self):
            """Device uint64[world] of the allocation's per-rank base addresses, for kernels.
            Add ``offset_bytes`` of a view to index into it."""
            alloc = self._allocation()
            if alloc.peer_table is None:
                alloc.peer_table = cupy.asarray(np.asarray(alloc.peer_bases, dtype=np.uint64))
                cupy.cuda.get_current_stream().synchronize()   # uploaded on this stream, read on any
            return alloc.peer_table

        @property
        def offset_bytes(self) -> int:
            return self.data.ptr - self._allocation().base

        def as_cupy(self):
            """The same memory as a plain cupy.ndarray (no peer methods)."""
            return self.view(cupy.ndarray)

    return SymmetricArray


_cls = None


def symmetric_array_type():
    global _cls
    if _cls is None:
        _cls = _symmetric_array_class()
    return _cls


class SymmetricHeap:
    """Every symmetric allocation of one world; frees them all (in allocation order) at finalize."""

    def __init__(self, world: World):
        self.world = world
        self.capacity = heap_capacity()
        self._allocs: dict[int, _Allocation] = {}
        self.used = 0

    def find(self, ptr: int, nbytes: int) -> _Allocation | None:
        for a in self._allocs.values():
            if a.base <= ptr and ptr + nbytes <= a.base + a.nbytes:
                return a
        return None

    def _request(self, shape, dtype) -> tuple[tuple, np.dtype, int]:
        """An allocation's (shape, dtype, bytes) after its checks, the same on every rank (compared across
        ranks when the world checks collective arguments)."""
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        dtype = normalize_dtype(dtype)
        self._check_collective(shape, dtype)
        return shape, dtype, max(1, math.prod(shape)) * dtype.itemsize

    def _check_collective(self, shape: tuple, dtype: np.dtype) -> None:
        if not self.world.options.check_collective_args or self.world.size == 1:
            return
        mine = (shape, dtype.str)
        from .agreement import exchange

        every = exchange(self.world, "world.empty", mine)   # bounded by the world's timeout
        if any(s != mine for s in every):
            detail = ", ".join(f"rank {r}: shape={s[0]} dtype={np.dtype(s[1])}" for r, s in enumerate(every))
            raise CollectiveMismatchError(f"symmetric allocation differs across ranks ({detail}); "
                                          "every rank must allocate the same shape and dtype in the same order")

    def empty(self, shape, dtype):
        import cupy
        from nvshmem import bindings

        shape, dtype, nbytes = self._request(shape, dtype)
        if self.used + nbytes + _ALIGN > self.capacity:
            raise HeapExhaustedError(
                f"symmetric allocation of {nbytes} bytes (shape {shape}, {dtype}) does not fit: "
                f"{self.used} of {self.capacity} heap bytes in use on rank {self.world.rank}. "
                f"Set NVSHMEM_SYMMETRIC_SIZE (e.g. {_suggest(self.used + nbytes)}) before fluxrt.init, "
                "or pass WorldOptions(heap_size=...)")
        try:
            base = int(bindings.malloc(nbytes))
        except Exception as e:
            base, err = 0, e
        else:
            err = None
        if base == 0:
            raise HeapExhaustedError(
                f"nvshmem_malloc({nbytes}) failed on rank {self.world.rank} (shape {shape}, {dtype}; "
                f"{self.used} bytes already in use; NVSHMEM_SYMMETRIC_SIZE={self.capacity}). "
                f"Raise NVSHMEM_SYMMETRIC_SIZE (e.g. {_suggest(self.used + nbytes)}). {err or ''}")
        peers = [int(bindings.ptr(base, r)) for r in range(self.world.size)]
        alloc = _Allocation(base=base, nbytes=nbytes, peer_bases=peers)
        self._allocs[base] = alloc
        self.used += nbytes + _ALIGN
        mem = cupy.cuda.UnownedMemory(base, nbytes, self, self.world.device_id)
        arr = symmetric_array_type()(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
        arr._heap = self
        log.debug("rank %d: symmetric alloc %s %s at 0x%x", self.world.rank, shape, dtype, base)
        return arr

    def free(self, arr) -> None:
        """Collective: every rank frees the same allocation."""
        from nvshmem import bindings

        alloc = self._allocs.get(arr.data.ptr)
        if alloc is None:
            raise NotSymmetricError("free() needs the array returned by world.empty/zeros (not a view, "
                                    "not already freed)")
        self.world.device.synchronize()  # no kernel may still touch it on any stream of this rank
        del self._allocs[alloc.base]
        self.used -= alloc.nbytes + _ALIGN
        bindings.free(alloc.base)
        arr._heap = None

    def free_all(self) -> None:
        from nvshmem import bindings

        for base in list(self._allocs):
            bindings.free(base)
        self._allocs.clear()
        self.used = 0

    def __len__(self) -> int:
        return len(self._allocs)


def _suggest(nbytes: int) -> str:
    gib = max(1, math.ceil(nbytes * 1.25 / (1 << 30)))
    return f"{gib}G"


# ------------------------------------------------------------------------------------------ sub-world heaps
def common_fit(free_lists, nbytes: int) -> int | None:
    """The lowest offset at which `nbytes` are free in every list of `free_lists` (one per rank: sorted,
    disjoint (start, end) ranges), or None. A pure function of its arguments, so every rank that gathered
    the same lists picks the same offset."""
    common = [tuple(r) for r in free_lists[0]]
    for ranges in free_lists[1:]:
        out, i, j = [], 0, 0
        while i < len(common) and j < len(ranges):
            lo, hi = max(common[i][0], ranges[j][0]), min(common[i][1], ranges[j][1])
            if lo < hi:
                out.append((lo, hi))
            if common[i][1] < ranges[j][1]:
                i += 1
            else:
                j += 1
        common = out
    for lo, hi in common:
        if hi - lo >= nbytes:
            return lo
    return None


class SubworldPool:
    """One symmetric allocation of the NVSHMEM job's heap that the sub-worlds of a process carve their
    symmetric memory from. A range is symmetric among the members of one sub-world only: they agree on an
    offset that is free on each of them (``common_fit`` over their gathered free lists), so worlds that share
    some ranks (a TP group and a DP group) never overlap on a shared rank, and worlds on disjoint ranks may
    use the same offsets."""

    def __init__(self, array):
        alloc = array._allocation()
        self.array = array
        self.base, self.nbytes = alloc.base, alloc.nbytes
        self.pe_bases = list(alloc.peer_bases)   # by NVSHMEM PE (the root world's rank)
        self._used: dict[int, int] = {}           # offset -> bytes

    def free_ranges(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for off in sorted(self._used):
            if off > at:
                out.append((at, off))
            at = off + self._used[off]
        if at < self.nbytes:
            out.append((at, self.nbytes))
        return out

    def take(self, off: int, nbytes: int) -> None:
        self._used[off] = nbytes

    def give_back(self, off: int) -> None:
        self._used.pop(off, None)

    @property
    def used(self) -> int:
        return sum(self._used.values())


class SubworldHeap(SymmetricHeap):
    """The symmetric memory of a sub-world: ranges of the process's ``SubworldPool`` at offsets its members
    agree on (one exchange over the sub-world's communicator per allocation). Peer views go through the
    NVSHMEM PE of each member."""

    def __init__(self, world: World, pool: SubworldPool):
        self.world, self.pool = world, pool
        self.capacity = pool.nbytes
        self._allocs: dict[int, _Allocation] = {}
        self._offsets: dict[int, int] = {}
        self.own_used = 0   # bytes of this sub-world's own allocations

    @property
    def used(self) -> int:
        """Bytes of the pool in use on this rank, by every sub-world that shares it: ``capacity - used`` is
        what this rank still has, as for the root world's heap."""
        return self.pool.used

    def empty(self, shape, dtype):
        import cupy

        shape, dtype, nbytes = self._request(shape, dtype)
        span = -(-nbytes // _ALIGN) * _ALIGN
        world = self.world
        mine = self.pool.free_ranges()
        from .agreement import exchange

        every = exchange(world, "world.empty (sub-world offsets)", mine) if world.size > 1 else [mine]
        off = common_fit(every, span)
        if off is None:
            raise HeapExhaustedError(
                f"sub-world allocation of {nbytes} bytes (shape {shape}, {dtype}) does not fit in the sub-world "
                f"pool ({self.pool.used} of {self.pool.nbytes} bytes in use on rank {world.rank}, free ranges "
                "must coincide on every member); reserve a larger one with WorldOptions(subworld_heap=...) at the "
                "first fluxrt.init, or split(..., pool_bytes=...)")
        self.pool.take(off, span)
        base = self.pool.base + off
        peers = [self.pool.pe_bases[pe] + off if self.pool.pe_bases[pe] else 0 for pe in world.pes]
        self._allocs[base] = _Allocation(base=base, nbytes=nbytes, peer_bases=peers)
        self._offsets[base] = off
        self.own_used += span
        mem = cupy.cuda.UnownedMemory(base, nbytes, self, world.device_id)
        arr = symmetric_array_type()(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
        arr._heap = self
        log.debug("rank %d: sub-world alloc %s %s at pool offset 0x%x", world.rank, shape, dtype, off)
        return arr

    def free(self, arr) -> None:
        """Collective over the sub-world: the range goes back to the pool once every member is done with it."""
        alloc = self._allocs.get(arr.data.ptr)
        if alloc is None:
            raise NotSymmetricError("free() needs the array returned by world.empty/zeros (not a view, "
                                    "not already freed)")
        self.world.device.synchronize()
        if not getattr(self.world, "_finalizing", False):
            from .agreement import barrier

            barrier(self.world, "world.free")   # no member still writes into this range when it is reused
        self._release(alloc.base)
        arr._heap = None

    def _release(self, base: int) -> None:
        alloc = self._allocs.pop(base)
        self.own_used -= -(-alloc.nbytes // _ALIGN) * _ALIGN
        self.pool.give_back(self._offsets.pop(base))

    def free_all(self) -> None:
        for base in list(self._allocs):
            self._release(base)
