"""Flags: uint64 words in symmetric memory, never reset, and the one host API that sets and waits on them.

Each use of a flag takes a new epoch (``pad.next_epoch()``); signallers write the epoch (or add to it),
waiters wait until the flag reaches it. Because the epoch only grows, no memset separates two calls and
a late signal from an old call can never satisfy a newer wait.

Every call is stream-ordered and takes a CuPy stream, a cuda.core stream, a raw handle or None (the
current stream):

    signal(world, flag_ptr, value)   after prior work on the stream, set (or add) one flag, local or a
                                     peer's: a one-thread kernel (fence.acq_rel.sys, then a release store
                                     or add), or cuStreamWriteValue64 (via='stream_op', set only)
    wait(world, flag_ptr, value)     bounded wait until a local flag reaches value: a one-thread kernel
                                     spinning with acquire loads (cuStreamWaitValue64 cannot be bounded)
    signal_list / wait_list          the same for every flag of a PointerList in one launch (fused ops;
                                     these take the CuPy stream their caller's entry converted)
    barrier(world)                   every rank of the world, through its barrier pad
    SignalPad                        `slots` flags per rank and the epoch of their next use

A wait that expires records the op, rank and peer in the world's error record; ``world.check_errors()``
raises it as WaitTimeoutError.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .errors import NO_PEER, CollectiveArgumentError, op_id
from .streams import as_cupy_stream

if TYPE_CHECKING:
    from .world import World

_KEY = "fluxrt.signals"
_LIST_THREADS = 128
_u64 = np.uint64


class _Flags:
    """A world's flag kernels and barrier pad. Made in World.__init__, collectively: the pad is symmetric
    memory, which a lazy first use would allocate on whichever rank happened to call first."""

    def __init__(self, world: World):
        from .toolchain import load_module

        self._device = world.device
        with world.device:
            comm = load_module("comm/p2p.cu")
            self.signal = comm.get_function("fluxrt_signal")
            self.wait = comm.get_function("fluxrt_wait")
            self.barrier = comm.get_function("fluxrt_barrier")
        self._lists = None
        self.barrier_pad = world.zeros((world.size,), np.uint64)
        self.barrier_epoch = 0
        # the barrier kernel stores into every peer's pad through its NVLink pointer (none to another node)
        self.barrier_unreachable = [r for r in range(world.size) if self.barrier_pad.peer_ptr(r) == 0]

    def lists(self):
        """(signal_list, wait_list) kernels, loaded on first use (they live with the fused ops' kernels,
        whose module a world that runs no fused op need not compile). Users load them before their first
        timed or captured call: ``signals.state(world).lists()``."""
        if self._lists is None:
            from .toolchain import load_module

            with self._device:
                mod = load_module("ops/tp_ops.cu")
                self._lists = (mod.get_function("fluxrt_ops_signal_list"), mod.get_function("fluxrt_ops_wait_list"))
        return self._lists


def state(world: World) -> _Flags:
    """The world's flag kernels and barrier pad (made by World.__init__)."""
    return world.registry.get_or_create(_KEY, lambda: _Flags(world))


# --- one flag --------------------------------------------------------------------------------------------
def signal(world: World, flag_ptr: int, value: int, *, add: bool = False, stream=None, via: str = "kernel") -> None:
    """After prior work on `stream`, set or add `value` at a (peer) flag address.

    via='kernel' (default): a one-thread kernel, fence.acq_rel.sys then st/red.release.sys.
    via='stream_op': cuStreamWriteValue64 (set only; no SM used). It orders after prior kernels' writes;
    like any signal it must not follow a copy-engine write to a peer (fluxrt.p2p.put says why)."""
    world.check_errors()   # sticky: nothing more is launched on a world with a device error
    if via not in ("kernel", "stream_op"):
        raise ValueError(f"signal via {via!r}: use 'kernel' or 'stream_op'")
    s = as_cupy_stream(stream)
    if add or via == "kernel":
        state(world).signal((1,), (1,), (_u64(flag_ptr), _u64(value), np.int32(add)), stream=s)
        return
    from cuda.bindings import driver

    (err,) = driver.cuStreamWriteValue64(driver.CUstream(s.ptr), driver.CUdeviceptr(flag_ptr), value, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWriteValue64 to 0x{flag_ptr:x} failed: {err}")


def wait(world: World, flag_ptr: int, value: int, *, peer: int | None = None, op: str = "wait", stream=None) -> None:
    """Stream-ordered bounded wait until the local flag at `flag_ptr` reaches `value`. `peer` names who is
    expected to signal, for the timeout report."""
    world.check_errors()
    state(world).wait((1,), (1,), (_u64(flag_ptr), _u64(value), _u64(world.timeout_ns), _u64(world.error_record),
                                   np.uint32(op_id(op)), np.uint32(world.rank),
                                   _u64(NO_PEER if peer is None else peer)),
                      stream=as_cupy_stream(stream))


# --- many flags in one launch ----------------------------------------------------------------------------
class PointerList:
    """A device list of flag addresses (and the peer each one belongs to) for the list kernels.

    ``ptrs_addr`` / ``peers_addr`` are the device addresses the kernels take; :meth:`sub` views a range of
    a list by address arithmetic, so per-call slices cost no upload and no array object."""

    def __init__(self, ptrs, peers=None):
        import cupy

        self.count = len(ptrs)
        peers = [NO_PEER] * len(ptrs) if peers is None else peers
        self._arrays = (cupy.asarray(np.asarray(ptrs, dtype=np.uint64)),
                        cupy.asarray(np.asarray(peers, dtype=np.uint64))) if ptrs else None
        self.ptrs_addr, self.peers_addr = (int(a.data.ptr) for a in self._arrays) if ptrs else (0, 0)
        # The uploads above are ordered on the current stream only; a kernel on another stream (a comm
        # stream) may read the list at any time from now on, so wait for them here (once per list).
        if ptrs:
            cupy.cuda.get_current_stream().synchronize()

    def sub(self, start: int, count: int = 1) -> PointerList:
        """Entries [start, start + count) as a list of their own (a view of this one's device arrays)."""
        if not 0 <= start <= start + count <= self.count:
            raise IndexError(f"PointerList.sub({start}, {count}) outside a list of {self.count}")
        view = object.__new__(PointerList)
        view.count, view._arrays = count, self._arrays
        view.ptrs_addr, view.peers_addr = self.ptrs_addr + 8 * start, self.peers_addr + 8 * start
        return view


def signal_list(world: World, plist: PointerList, value: int, stream) -> None:
    """After prior work on the CuPy `stream` (converted by the caller's entry), release every flag of
    `plist` to `value`."""
    if plist.count == 0:
        return
    grid = (plist.count + _LIST_THREADS - 1) // _LIST_THREADS
    kernel, _ = state(world).lists()
    kernel((grid,), (_LIST_THREADS,), (_u64(plist.ptrs_addr), np.uint32(plist.count), _u64(value)), stream=stream)


def wait_list(world: World, plist: PointerList, target: int, op: str, stream) -> None:
    """Bounded wait on the CuPy `stream` until every flag of `plist` is >= target (timeouts name the peer)."""
    if plist.count == 0:
        return
    grid = (plist.count + _LIST_THREADS - 1) // _LIST_THREADS
    _, kernel = state(world).lists()
    kernel((grid,), (_LIST_THREADS,),
           (_u64(plist.ptrs_addr), _u64(plist.peers_addr), np.uint32(plist.count), _u64(target),
            _u64(world.timeout_ns), _u64(world.error_record), np.uint32(op_id(op)), np.uint32(world.rank)),
           stream=stream)


# --- every rank ------------------------------------------------------------------------------------------
def barrier(world: World, stream=None, op: str = "barrier") -> None:
    """Stream-ordered barrier across every rank of the world (one block signalling and waiting on every
    peer through the world's barrier pad)."""
    world.check_errors()
    st = state(world)
    if st.barrier_unreachable:
        raise CollectiveArgumentError(
            f"{op}: the device barrier needs NVLink pointers to every rank; rank {world.rank} has none to ranks "
            f"{st.barrier_unreachable} (another node). Across nodes use world.comm.Barrier() (host) or order "
            "the work with the collectives (docs/multinode.md)")
    st.barrier_epoch += 1
    pad = st.barrier_pad
    threads = max(32, 32 * math.ceil(world.size / 32))
    st.barrier((1,), (threads,), (_u64(pad.peer_table.data.ptr), _u64(pad.data.ptr), np.uint32(world.rank),
                                  np.uint32(world.size), _u64(st.barrier_epoch), _u64(world.timeout_ns),
                                  _u64(world.error_record), np.uint32(op_id(op))),
               stream=as_cupy_stream(stream))


# --- pads ------------------------------------------------------------------------------------------------
class SignalPad:
    """`slots` flags on every rank. ``flags`` is the symmetric uint64 array; slot i of rank r is
    ``flags.peer(r)[i]``. Collective to create (``world.signal_pad(slots)``)."""

    def __init__(self, world: World, slots: int):
        if int(slots) < 1:
            raise ValueError(f"a signal pad needs at least one slot, got {slots}")
        self.world = world
        self.slots = int(slots)
        self.flags = world.zeros((self.slots,), np.uint64)
        self.epoch = 0

    def next_epoch(self, step: int = 1) -> int:
        """Advance and return the epoch every rank uses for its next call on this pad. Ranks must
        advance in lockstep (same number of calls)."""
        self.epoch += step
        return self.epoch

    def local_ptr(self, slot: int) -> int:
        self._check(slot)
        return self.flags.data.ptr + 8 * slot

    def peer_ptr(self, peer: int, slot: int) -> int:
        self._check(slot)
        ptr = self.flags.peer_ptr(peer)
        if ptr == 0:
            raise ValueError(f"rank {peer} is not reachable through NVLink pointers from rank {self.world.rank}")
        return ptr + 8 * slot

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"signal slot {slot} outside pad of {self.slots} slots")

    def signal(self, peer: int, slot: int, value: int, *, add: bool = False, stream=None) -> None:
        """Stream-ordered: after prior work on `stream`, set (or add to) slot `slot` of `peer`'s pad."""
        signal(self.world, self.peer_ptr(peer, slot), value, add=add, stream=stream)

    def wait(self, slot: int, value: int, *, peer: int | None = None, op: str = "signal_pad.wait",
             stream=None) -> None:
        """Stream-ordered bounded wait until this rank's slot reaches `value`. `peer` names who is
        expected to signal, for the timeout message."""
        wait(self.world, self.local_ptr(slot), value, peer=peer, op=op, stream=stream)

    def free(self) -> None:
        self.world.free(self.flags)


__all__ = ["SignalPad", "PointerList", "signal", "wait", "signal_list", "wait_list", "barrier", "state"]
