"""The world: ranks from an mpi4py communicator, one GPU per rank, NVSHMEM booted over that communicator.

``fluxrt.init(comm=None, device=None)`` is the entry point. A World holds its own duplicate of the
communicator (fluxrt's messages never interleave with the program's), the device, the symmetric heap, the
error record that bounded device waits report into, and a registry (``fluxrt.registry``) in which the
layers above it (p2p, collectives, fused ops) keep their per-world state; it imports none of them.

NVSHMEM is one runtime per process: the first ``fluxrt.init`` of a process boots it (the root world).
Further worlds on the same processes are sub-worlds of the root: ``world.split(color, key)``, or another
``fluxrt.init(comm)`` while the root is active. They share the root's NVSHMEM job and heap and have their own
ranks, communicator, symmetric memory (ranges of the root's sub-world pool: ``WorldOptions.subworld_heap``),
flags, collectives context and error record, so a TP group and a DP group of the same ranks run side by side.
Sub-communicators without an active root each boot their own NVSHMEM job, so two halves of COMM_WORLD can
also run as two root worlds.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from . import log as _log
from . import signals
from . import topology as _topology
from .env import env_flag
from .errors import DeviceError, ErrorRecordView, NvshmemInitError
from .nvtx import annotate as _nvtx
from .registry import Registry
from .streams import stream_handle
from .symmetric import SubworldHeap, SubworldPool, SymmetricHeap, parse_bytes

log = logging.getLogger(__name__)

_active: "World | None" = None
_atexit_registered = False

# NVLink multicast stays off: on shared hosts a multicast object can take the GPUs out of service.
_SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class WorldOptions:
    """How a world is booted.

    heap_size: symmetric heap per rank ('4G', bytes); sets NVSHMEM_SYMMETRIC_SIZE for this boot.
        None keeps the environment's value (NVSHMEM's default: 1 GiB).
    subworld_heap: part of the heap reserved at boot for sub-worlds ('1G', bytes); needed by a second
        ``fluxrt.init(comm)`` while this world is active. None: reserved by the first ``split`` instead
        (its ``pool_bytes``, default half of the heap then free).
    timeout_s: bound of every device-side wait; a wait that expires raises WaitTimeoutError.
    check_collective_args: compare collective arguments (allocation shape/dtype, ...) across ranks
        over MPI before acting on them.
    abort_on_error: an exception leaving ``with fluxrt.init()`` on a multi-rank world logs the error and
        calls ``MPI_Abort(comm, 1)``, ending every rank, instead of the collective finalize (which would
        wait forever for ranks still inside their own work). False (or FLUXRT_ABORT_ON_ERROR=0): finalize
        anyway, for programs that catch the error on every rank themselves.
    """

    heap_size: str | int | None = None
    subworld_heap: str | int | None = None
    timeout_s: float = field(default_factory=lambda: float(os.environ.get("FLUXRT_TIMEOUT_S", "30")))
    check_collective_args: bool = True
    abort_on_error: bool = field(default_factory=lambda: env_flag("FLUXRT_ABORT_ON_ERROR", True))


def _node_communicator(comm):
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def _select_device(local_rank: int, local_size: int, device: int | None) -> tuple[int | None, str | None]:
    """(device id, None) or (None, reason) -- decided before anything collective can hang."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver / no device
        return None, f"no CUDA GPU usable ({e.__class__.__name__}: {e})"
    if count == 0:
        return None, "no CUDA GPU visible (CUDA_VISIBLE_DEVICES?)"
    if device is None:
        if local_size > count:
            return None, (f"{local_size} ranks on this node but only {count} GPU(s) visible: "
                          "fluxrt needs one GPU per rank (launch fewer ranks per node, or pass device=)")
        device = local_rank
    if not 0 <= device < count:
        return None, f"device {device} requested but only {count} GPU(s) visible"
    return device, None


class World:
    """Ranks, their GPUs and the symmetric heap of one NVSHMEM job (or of a sub-world on the job of `root`).
    Create with ``fluxrt.init`` or ``world.split``. `comm` becomes the world's own (a duplicate the caller
    made for it), freed at finalize."""

    def __init__(self, comm, device: int | None, options: WorldOptions, root: "World | None" = None):
        if root is not None:
            self._init_sub(comm, device, options, root)
            return
        import cupy

        self.options = options
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.root, self.pes, self.pool = self, list(range(self.size)), None
        self._children: list[World] = []
        node = _node_communicator(comm)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node_leader = node.bcast(self.rank, root=0)   # lowest world rank of the node (key=rank): names the node
        node.Free()
        from mpi4py import MPI

        _log.set_rank(MPI.COMM_WORLD.Get_rank())   # FLUXRT_DEBUG_FILE's %r

        dev, reason = _select_device(self.local_rank, self.local_size, device)
        setting, topo_reason = None, None
        try:   # FLUXRT_TOPOLOGY is read before anything collective can hang on it
            setting = _topology.setting_from_env()
            if setting is not None:
                setting.node_of(self.size)
        except _topology.TopologyError as e:
            topo_reason = str(e)
        every = comm.allgather((reason, topo_reason))
        failures = [(r, why) for r, (why, _) in enumerate(every) if why]
        if failures:
            raise DeviceError("; ".join(f"rank {r}: {why}" for r, why in failures))
        bad_setting = [(r, why) for r, (_, why) in enumerate(every) if why]
        if bad_setting:
            raise _topology.TopologyError("; ".join(f"rank {r}: {why}" for r, why in bad_setting))
        self.device_id = dev
        self.device = cupy.cuda.Device(dev)
        self.device.use()
        self._finalized = False
        self._boot_nvshmem()
        # fluxrt.agreement's bounded exchanges: their own communicator, apart from the application's messages
        # (made once NVSHMEM is up, so a failed boot leaves none behind)
        self.agree_comm = comm.Dup()
        self.heap = SymmetricHeap(self)
        self._error_host, self.error_record = self._alloc_error_record()
        self.registry = Registry()
        try:   # which peers NVLink pointers reach, which only NVSHMEM; no transport at all: fail on every rank
            self.topology = _topology.discover(self, node_leader, setting)
        except _topology.TopologyError:
            self.finalize()
            raise
        if self.rank == 0 and self.topology.num_nodes > 1:
            log.info("topology: %s", "\n".join(self.topology.describe()))
        # The barrier pad is symmetric memory: made now, collectively, not on some rank's first barrier.
        signals.state(self)
        if options.subworld_heap is not None:
            self._reserve_pool(options.subworld_heap)
        log.info("rank %d/%d (local %d/%d) on GPU %d: NVSHMEM up, heap %d bytes", self.rank, self.size,
                 self.local_rank, self.local_size, dev, self.heap.capacity)

    def _init_sub(self, comm, device: int | None, options: WorldOptions, root: "World") -> None:
        """A sub-world of `root` over `comm` (every member's root is the same NVSHMEM job; init checked)."""
        self.options, self.comm, self.root = options, comm, root
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = _node_communicator(comm)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        reason = None
        if device is not None and device != root.device_id:
            reason = f"device {device} requested, but this process's NVSHMEM runs on GPU {root.device_id}"
        elif root.pool is None:
            reason = "no sub-world pool"
        every = comm.allgather((reason, root.rank))
        failures = [(r, why) for r, (why, _) in enumerate(every) if why]
        if failures:
            raise NvshmemInitError("sub-world: " + "; ".join(f"rank {r}: {why}" for r, why in failures))
        self.pes = [pe for _, pe in every]   # NVSHMEM PE (root rank) of each member
        # the root's nodes and links among the members: a sub-world inside one node runs the flat (NVLink)
        # collectives and the fused ops, one across nodes the hierarchical collectives (fluxrt.topology.tp_dp_split)
        topo = getattr(root, "topology", None)
        self.topology = None if topo is None else topo.restrict(self.pes, self.rank)
        self.device_id, self.device = root.device_id, root.device
        self.device.use()
        self._finalized = False
        self._children = []
        self.pool = root.pool
        self.agree_comm = comm.Dup()
        self.heap = SubworldHeap(self, root.pool)
        self._error_host, self.error_record = self._alloc_error_record()
        self.registry = Registry()
        signals.state(self)
        root._children.append(self)
        log.info("rank %d/%d: sub-world of PEs %s on GPU %d", self.rank, self.size, self.pes, self.device_id)

    def _reserve_pool(self, nbytes) -> None:
        """Collective over the root world: the symmetric pool its sub-worlds allocate from."""
        if nbytes is None:
            nbytes = (self.heap.capacity - self.heap.used) // 2
        nbytes = (parse_bytes(nbytes) // (2 << 20)) * (2 << 20)
        if nbytes <= 0:
            raise ValueError(f"sub-world pool of {nbytes} bytes: give a size of at least 2 MiB")
        self.pool = SubworldPool(self.heap.empty((nbytes,), np.uint8))

    @property
    def is_subworld(self) -> bool:
        return self.root is not self

    def pe(self, rank: int) -> int:
        """The NVSHMEM PE of this world's `rank` (the same number in a root world)."""
        return self.pes[rank]

    def split(self, color, key: int | None = None, *, options: WorldOptions | None = None,
              pool_bytes: str | int | None = None) -> "World | None":
        """Collective: the sub-world of the ranks that pass the same `color`, ordered by `key` (default: this
        world's rank), on this process's NVSHMEM heap; None for a rank whose color is None (MPI.UNDEFINED).
        The first split of a root world without ``WorldOptions.subworld_heap`` reserves the sub-world pool
        (`pool_bytes`, default half of the heap then free)."""
        from mpi4py import MPI

        self.check_active()
        root = self.root
        if root.pool is None:
            if self.is_subworld:
                raise NvshmemInitError("split: this sub-world's root has no sub-world pool")
            root._reserve_pool(pool_bytes if pool_bytes is not None else self.options.subworld_heap)
        sub = self.comm.Split(MPI.UNDEFINED if color is None else int(color), self.rank if key is None else int(key))
        if sub == MPI.COMM_NULL:
            return None
        try:
            return World(sub, None, options or self.options, root=root)
        except BaseException:
            sub.Free()
            raise

    # --- boot / teardown ------------------------------------------------------------------------
    def _boot_nvshmem(self) -> None:
        import nvshmem.core as nvshmem
        from cuda.core import Device

        for k, v in _SAFE_ENV.items():
            os.environ.setdefault(k, v)
        if self.options.heap_size is not None:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(parse_bytes(self.options.heap_size))
        Device(self.device_id).set_current()
        try:
            uid = nvshmem.get_unique_id(empty=self.rank != 0)
            self.comm.Bcast(uid._data.view(np.int8), root=0)
            # names this NVSHMEM job: a later fluxrt.init(comm) checks that all of comm's processes run in it
            self.job_token = hashlib.sha256(uid._data.view(np.uint8).tobytes()).hexdigest()
            nvshmem.init(device=Device(self.device_id), uid=uid, rank=self.rank, nranks=self.size,
                         initializer_method="uid")
        except Exception as e:
            raise NvshmemInitError(f"rank {self.rank}: NVSHMEM init over a {self.size}-rank communicator "
                                   f"failed: {e}") from e
        from nvshmem import bindings

        if bindings.my_pe() != self.rank or bindings.n_pes() != self.size:
            raise NvshmemInitError(f"NVSHMEM PE {bindings.my_pe()}/{bindings.n_pes()} does not match MPI rank "
                                   f"{self.rank}/{self.size}")

    def _alloc_error_record(self):
        """Host-mapped pinned words a timed-out kernel writes; the host reads them without a sync."""
        host = ErrorRecordView.allocate()
        self._bind_error_record(host)
        return host, host  # unified addressing: the device uses the host pointer as is

    def _bind_error_record(self, host: int) -> None:
        """The host's view of the record at `host`; its first device error is sticky until reset_error()."""
        self._errors = ErrorRecordView(host)

    def finalize(self) -> None:
        """Free every symmetric allocation and shut NVSHMEM down. Collective; safe to call twice."""
        global _active
        if self._finalized:
            return
        if self.is_subworld:
            self._finalize_sub()
            return
        for child in reversed(list(self._children)):   # collective over each child: the same order everywhere
            child.finalize()
        self._finalized = True
        import cupy
        import nvshmem.core as nvshmem

        try:
            self.device.use()
            try:
                self.device.synchronize()
            except Exception as e:  # a failed kernel must not stop the teardown
                log.warning("rank %d: device sync at finalize failed: %s", self.rank, e)
            self.registry.close()   # the layers' state, newest first; their symmetric memory goes with free_all
            self.heap.free_all()
            nvshmem.finalize()
        finally:
            cupy.cuda.runtime.freeHost(self._error_host)
            self._free_comms()
            if _active is self:
                _active = None
        log.info("rank %d: NVSHMEM finalized", self.rank)

    def _finalize_sub(self) -> None:
        """A sub-world's teardown: its layers' state, then its ranges back to the pool once every member is
        done with them; NVSHMEM stays up for the root."""
        import cupy

        self._finalized = True
        self._finalizing = True
        try:
            for child in reversed(list(self._children)):
                child.finalize()
            self.device.use()
            try:
                self.device.synchronize()
            except Exception as e:
                log.warning("rank %d: device sync at sub-world finalize failed: %s", self.rank, e)
            self.registry.close()
            # no member still touches this world's ranges when they are reused; a member that never arrives
            # leaves them taken rather than reused under it
            if _bounded_barrier(self.comm, float(self.options.timeout_s)):
                self.heap.free_all()
            else:
                log.warning("rank %d: sub-world finalize: not every member arrived within %s s; its pool ranges "
                            "are not reused", self.rank, self.options.timeout_s)
        finally:
            cupy.cuda.runtime.freeHost(self._error_host)
            self._free_comms()
            parent_children = self.root._children
            if self in parent_children:
                parent_children.remove(self)
        log.info("rank %d: sub-world finalized", self.rank)

    def _free_comms(self) -> None:
        for c in (self.agree_comm, self.comm):
            try:
                c.Free()
            except Exception as e:
                log.warning("rank %d: freeing a communicator failed: %s", self.rank, e)

    @property
    def active(self) -> bool:
        return not self._finalized

    def __enter__(self) -> "World":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exit_action(self, exc_type, exc) == "abort":
            abort_job(self, exc_type, exc, tb)   # returns only where Abort does (tests' fake communicators)
            return
        self.finalize()

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"device={self.device_id}, active={self.active})")

    # --- memory ----------------------------------------------------------------------------------
    def empty(self, shape, dtype="float32"):
        """Collective: an uninitialised symmetric array (a cupy.ndarray subclass with ``peer(r)``)."""
        self.check_active()
        self.check_errors()
        self.make_current()   # the context and fused ops allocate (and zero) through here
        return self.heap.empty(shape, dtype)

    def zeros(self, shape, dtype="float32"):
        """Collective: a zeroed symmetric array; returns once every rank's copy is zero."""
        import cupy

        arr = self.empty(shape, dtype)
        cupy.cuda.runtime.memset(arr.data.ptr, 0, arr.nbytes)
        self.device.synchronize()
        self.comm.Barrier()
        return arr

    def free(self, arr) -> None:
        """Collective: return a symmetric array to the heap (every rank, same order)."""
        self.check_active()
        self.heap.free(arr)

    def signal_pad(self, slots: int) -> signals.SignalPad:
        """Collective: `slots` uint64 flags per rank, compared against growing epochs (never reset)."""
        return signals.SignalPad(self, slots)

    # --- synchronization -----------------------------------------------------------------------
    @_nvtx("world.barrier")
    def barrier(self, stream=None) -> None:
        """Stream-ordered barrier across all ranks (a bounded device kernel; errors surface at
        ``synchronize``/``check_errors``)."""
        self.check_active()
        self.check_errors()
        signals.barrier(self, stream)

    def synchronize(self, stream=None) -> None:
        """Wait for `stream` (None: the whole device), then raise any device-side wait timeout."""
        import cupy

        if stream is None:
            self.device.synchronize()
        else:
            cupy.cuda.runtime.streamSynchronize(stream_handle(stream))
        self.check_errors()

    def check_errors(self) -> None:
        """Raise the error a bounded device wait recorded, if any. Does not synchronize.

        The error is sticky, as NCCL's asynchronous errors are: once seen, this and every later fluxrt
        call on the world raises it again (the device record stays set too, so later kernels' waits
        stop early instead of waiting out their bound) until :meth:`reset_error`."""
        rec = self._errors
        if rec.error is None:
            if not rec.status.value:   # the fast path: one read of host-mapped memory
                return
            if rec.poll() is None:   # a kernel is filling the record: the next check sees it
                return
            log.error("rank %d: %s (sticky: every later fluxrt call on this world raises it until "
                      "world.reset_error())", self.rank, rec.error)
        raise rec.error.again()

    @property
    def error(self):
        """The sticky device error of this world (None while clear), without raising it."""
        return self._errors.poll()

    def reset_error(self) -> None:
        """Clear the sticky error and the device record, so calls run again. Local to this rank.

        A timeout leaves the ranks out of step (a kernel that gave up left flags, workspace and the
        outputs of the calls in flight in an undefined state), so the safe way on after an error is to end
        the job. Reset only where every rank has synchronized and the program rebuilds what it uses (frees
        and remakes its Collectives context and fused ops); the tests use it for that."""
        self._errors.reset()

    @property
    def timeout_ns(self) -> int:
        return int(self.options.timeout_s * 1e9)

    def make_current(self) -> None:
        """Make the world's GPU the calling thread's current device if something else changed it (JAX's GPU
        client makes its own first GPU current when it starts). A fluxrt call allocates its outputs, takes its
        default stream and launches on the current device, so every collective and fused-op call (and every
        symmetric allocation) starts here; the device stays current after the call, as fluxrt.init left it."""
        import cupy

        if cupy.cuda.runtime.getDevice() != self.device_id:
            self.device.use()

    def check_active(self) -> None:
        """Raise NvshmemInitError when this world has been finalized."""
        if self._finalized:
            raise NvshmemInitError("this world has been finalized; call fluxrt.init() again")


def exit_action(world, exc_type, exc) -> str:
    """What leaving ``with fluxrt.init()`` does: 'finalize' (collective: every rank must get there) or
    'abort' (MPI_Abort): an exception on a multi-rank world with options.abort_on_error. The peers of a rank
    that raised may never reach the collective finalize (they wait in a collective, or are themselves
    stuck), so that rank ends the job rather than wait for them. sys.exit(0) / SystemExit(None) is a normal
    exit."""
    if exc_type is None:
        return "finalize"
    if issubclass(exc_type, SystemExit) and (exc is None or exc.code in (None, 0)):
        return "finalize"
    if getattr(world, "size", 1) <= 1 or not world.options.abort_on_error:
        return "finalize"
    return "abort"


def abort_job(world, exc_type, exc, tb) -> None:
    """Log the error (once, with its traceback), flush, and MPI_Abort the world's communicator with
    errorcode 1 (a SystemExit's own integer code when it has one)."""
    import sys
    import traceback

    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    text = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip()
    msg = (f"fluxrt: rank {world.rank}/{world.size}: {exc_type.__name__} inside `with fluxrt.init()`; "
           f"aborting the job (MPI_Abort, errorcode {code}) instead of a collective finalize that the other "
           f"ranks may never reach\n{text}")
    if log.hasHandlers() and log.isEnabledFor(logging.ERROR):
        log.error("%s", msg)
    else:   # no logging configured: stderr (once; logging's last-resort handler would drop the rank)
        print(msg, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    world.comm.Abort(code)


def _bounded_barrier(comm, timeout_s: float) -> bool:
    """MPI barrier that gives up after timeout_s: True once every rank arrived, False otherwise (the request
    is left pending; the communicator is freed right after by the caller)."""
    import time

    req = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


def init(comm=None, device: int | None = None, options: WorldOptions | None = None) -> World:
    """Boot a world over `comm` (default MPI.COMM_WORLD) with GPU `device` (default: the local rank)."""
    global _active, _atexit_registered
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py communicator, got {comm!r}")
    root = _active if _active is not None and _active.active else None
    own = comm.Dup()   # fluxrt's traffic on its own communicator, apart from the program's
    try:
        tokens = own.allgather(None if root is None else root.job_token)
        if all(t is None for t in tokens):
            world = World(own, device, options or WorldOptions())
            _active = world
        elif root is not None and all(t == root.job_token for t in tokens):
            if root.pool is None:
                raise NvshmemInitError(
                    f"a fluxrt world is already active in this process ({root!r}); a second world on its NVSHMEM "
                    "job needs the sub-world pool: pass WorldOptions(subworld_heap='1G') to the first fluxrt.init, "
                    "or make sub-worlds with world.split(color, key)")
            world = World(own, device, options or root.options, root=root)
        else:
            have = [r for r, t in enumerate(tokens) if t is not None]
            raise NvshmemInitError(
                f"fluxrt.init over {len(tokens)} ranks: ranks {have} have an active fluxrt world and the others "
                "have none or another one (NVSHMEM is one runtime per process: a second world must lie within "
                "the first one's ranks)")
    except BaseException:
        own.Free()
        raise
    if not _atexit_registered:
        atexit.register(_finalize_at_exit)
        _atexit_registered = True
    return world


def finalize() -> None:
    """Finalize the active world, if any."""
    if _active is not None:
        _active.finalize()


def current() -> World:
    """The active world; raises when none is."""
    if _active is None or not _active.active:
        raise NvshmemInitError("no active fluxrt world: call fluxrt.init() first")
    return _active


def _finalize_at_exit() -> None:
    if _active is not None and _active.active:
        log.info("finalizing the fluxrt world at interpreter exit")
        try:
            _active.finalize()
        except Exception as e:  # exiting anyway; say why teardown was incomplete
            log.error("fluxrt finalize at exit failed: %s", e)
