"""The NCCL baseline's binding: NCCL on ordinary buffers and on registered symmetric windows.

NCCL (2.27 and later) runs its symmetric-memory kernels on buffers allocated with ``ncclMemAlloc`` and
registered with ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)`` on every rank (nccl-tests' ``-R 2``),
and its default kernels on any other buffer. The sweeps measure both and compare fluxrt with the faster.

Two bindings of the same libnccl.so.2, tried in this order:

- nccl4py (NVIDIA's binding, ``pip install nccl4py``): both modes. Its documented ``nccl.core`` makes the
  communicator; the per-call work goes through its ``nccl.bindings.nccl`` layer (raw pointers, one C call
  each, as NCCL's own C API), so no argument parsing is timed.
- cupy.cuda.nccl: ordinary buffers only (it has no window or ``ncclMemAlloc`` call).

Nothing here runs without a GPU except :func:`choose`'s import probing; the sweeps say why a mode is absent.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

# ncclDataType_t and ncclRedOp_t values of nccl.h (fixed by NCCL's ABI).
DATATYPES = {"int32": 2, "fp16": 6, "fp32": 7, "bf16": 9}
REDOPS = {"sum": 0, "max": 2, "min": 3}
WIN_COLL_SYMMETRIC = 0x01   # NCCL_WIN_COLL_SYMMETRIC

PLAIN, WINDOW = "nccl", "nccl-win"   # the impl names of the two modes in tables and JSON
MODES = (PLAIN, WINDOW)


class NcclUnavailable(ImportError):
    """No binding of libnccl could be loaded (the message says what was tried)."""


class Nccl4py:
    """NCCL through nccl4py: communicator, collectives, ncclMemAlloc and window registration."""

    name = "nccl4py"
    windows = True

    def __init__(self):
        import nccl.core as core
        from nccl.bindings import nccl as b

        self.core, self.b = core, b
        self.binding_version = getattr(core, "__version__", None)

    def version_code(self) -> int:
        return int(self.b.get_version())

    def unique_id(self) -> bytes:
        return bytes(self.core.get_unique_id())

    def init(self, nranks: int, uid: bytes, rank: int):
        comm = self.core.Communicator.init(nranks=nranks, rank=rank, unique_id=self.core.UniqueId.from_bytes(uid))
        return comm, self.b.Comm(comm.ptr)   # the Communicator owns it; the second is the calls' handle

    def destroy(self, comm) -> None:
        comm[0].destroy()

    def all_reduce(self, comm, x, out, count, dt, op, s):
        self.b.all_reduce(x, out, count, dt, op, comm[1], s)

    def reduce_scatter(self, comm, x, out, count, dt, op, s):
        self.b.reduce_scatter(x, out, count, dt, op, comm[1], s)

    def all_gather(self, comm, x, out, count, dt, s):
        self.b.all_gather(x, out, count, dt, comm[1], s)

    def broadcast(self, comm, x, out, count, dt, root, s):
        self.b.broadcast(x, out, count, dt, root, comm[1], s)

    def send(self, comm, x, count, dt, peer, s):
        self.b.send(x, count, dt, peer, comm[1], s)

    def recv(self, comm, out, count, dt, peer, s):
        self.b.recv(out, count, dt, peer, comm[1], s)

    def group_start(self):
        self.b.group_start()

    def group_end(self):
        self.b.group_end()

    def mem_alloc(self, nbytes: int) -> int:
        return int(self.b.mem_alloc(nbytes))

    def mem_free(self, ptr: int) -> None:
        self.b.mem_free(ptr)

    def window_register(self, comm, ptr: int, nbytes: int):
        return self.b.comm_window_register(comm[1], ptr, nbytes, WIN_COLL_SYMMETRIC)

    def window_deregister(self, comm, win) -> None:
        self.b.comm_window_deregister(comm[1], win)


class CupyNccl:
    """NCCL through cupy.cuda.nccl: ordinary buffers only."""

    name = "cupy.cuda.nccl"
    windows = False
    binding_version = None

    def __init__(self):
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):
            raise NcclUnavailable("cupy.cuda.nccl cannot load libnccl.so.2 (pip install nvidia-nccl-cu13)")
        self.nccl = nccl

    def version_code(self) -> int:
        return int(self.nccl.get_version())

    def unique_id(self):
        return self.nccl.get_unique_id()

    def init(self, nranks: int, uid, rank: int):
        return self.nccl.NcclCommunicator(nranks, uid, rank)

    def destroy(self, comm) -> None:
        comm.destroy()

    def all_reduce(self, comm, x, out, count, dt, op, s):
        comm.allReduce(x, out, count, dt, op, s)

    def reduce_scatter(self, comm, x, out, count, dt, op, s):
        comm.reduceScatter(x, out, count, dt, op, s)

    def all_gather(self, comm, x, out, count, dt, s):
        comm.allGather(x, out, count, dt, s)

    def broadcast(self, comm, x, out, count, dt, root, s):
        comm.broadcast(x, out, count, dt, root, s)

    def send(self, comm, x, count, dt, peer, s):
        comm.send(x, count, dt, peer, s)

    def recv(self, comm, out, count, dt, peer, s):
        comm.recv(out, count, dt, peer, s)

    def group_start(self):
        self.nccl.groupStart()

    def group_end(self):
        self.nccl.groupEnd()


BINDINGS = (Nccl4py, CupyNccl)


def choose(bindings=BINDINGS):
    """(binding, notes): the first binding that loads, and why the ones before it, or window mode, are
    not used. Raises NcclUnavailable naming every failure when none loads."""
    notes, failures = [], []
    for cls in bindings:
        try:
            lib = cls()
        except Exception as e:   # ImportError, or a binding present without its libnccl
            failures.append(f"{cls.name}: {e}")
            continue
        if not lib.windows:
            notes.append(f"NCCL window mode ({WINDOW}) not run: {lib.name} has no ncclMemAlloc / "
                         "ncclCommWindowRegister binding" + (f" ({'; '.join(failures)})" if failures else "")
                         + "; pip install nccl4py for it")
        return lib, notes
    raise NcclUnavailable("no NCCL binding loads: " + "; ".join(failures))


class Communicator:
    """One NCCL communicator over the world's ranks (collective: the unique id is broadcast over the
    world's MPI communicator), with the binding it was made by."""

    def __init__(self, world: World, lib):
        self.lib = lib
        uid = world.comm.bcast(lib.unique_id() if world.rank == 0 else None, root=0)
        self.handle = lib.init(world.size, uid, world.rank)
        self.rank, self.size = world.rank, world.size

    def close(self) -> None:
        if self.handle is not None:
            self.lib.destroy(self.handle)
            self.handle = None


class WindowBuffer:
    """``nbytes`` of ncclMemAlloc memory registered as a symmetric window on every rank (collective: every
    rank makes the same windows in the same order), viewed as a CuPy array of ``dtype``."""

    def __init__(self, comm: Communicator, count: int, dtype):
        import cupy
        import numpy as np

        dtype = np.dtype(dtype)
        self.comm, self.nbytes = comm, max(1, count) * dtype.itemsize
        lib = comm.lib
        self.ptr = lib.mem_alloc(self.nbytes)
        try:
            self.win = lib.window_register(comm.handle, self.ptr, self.nbytes)
        except Exception:
            lib.mem_free(self.ptr)
            raise
        mem = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self)
        self.array = cupy.ndarray((max(1, count),), dtype, cupy.cuda.MemoryPointer(mem, 0))

    def free(self) -> None:
        """Deregister and free (after the device has finished with it)."""
        if self.ptr:
            self.comm.lib.window_deregister(self.comm.handle, self.win)
            self.comm.lib.mem_free(self.ptr)
            self.ptr, self.array = 0, None
