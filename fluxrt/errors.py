"""fluxrt's exception types and the device error record they are decoded from."""
from __future__ import annotations

import threading

# Words of struct fluxrt::ErrorRecord (kernels/include/fluxrt/comm.cuh).
ERROR_RECORD_WORDS = 6
STATUS_OK, STATUS_WRITING, STATUS_TIMEOUT = 0, 1, 2
NO_PEER = (1 << 64) - 1


class FluxrtError(RuntimeError):
    """Base class of every error fluxrt raises on purpose."""

    def again(self) -> "FluxrtError":
        """A fresh copy of this error for raising it once more (a sticky error: the original's traceback
        is not extended by every later raise), with a note saying where it comes from."""
        import copy

        err = copy.copy(self)
        err.__traceback__ = None
        err.__notes__ = ["this error is sticky: every fluxrt call on the world raises it again until "
                         "world.reset_error()"]
        return err


class DeviceError(FluxrtError):
    """No usable GPU, or fewer GPUs than ranks on a node."""


class NvshmemInitError(FluxrtError):
    """NVSHMEM could not be booted (or a world is already active in this process)."""


class HeapExhaustedError(FluxrtError, MemoryError):
    """The NVSHMEM symmetric heap cannot hold the requested allocation."""


class CollectiveMismatchError(FluxrtError, ValueError):
    """Ranks passed different arguments (shape, dtype, count, op) to a collective call."""


class CollectiveArgumentError(FluxrtError, ValueError):
    """A collective's arguments are unusable on this rank (dtype, device, layout, sizes, out too small)."""


class NotSymmetricError(FluxrtError, ValueError):
    """An array that must live on the symmetric heap does not."""


class ArrayArgumentError(FluxrtError, ValueError):
    """An array argument is unusable: on another GPU, read-only where it is written, badly laid out."""


class ArrayTypeError(FluxrtError, TypeError):
    """An argument is not a CUDA array (no __dlpack__ / __cuda_array_interface__, or host memory)."""


class GemmArgumentError(FluxrtError, ValueError):
    """A GEMM operand has the wrong shape, layout, alignment or device."""


class GemmTypeError(FluxrtError, TypeError):
    """A GEMM operand has an unsupported type or dtype."""


class GraphCaptureError(FluxrtError):
    """A call would need work a CUDA graph capture cannot contain (allocating symmetric memory, compiling or
    loading kernels); raised before anything is enqueued, so the capture is left intact. Make the resources
    first (``fluxrt.prepare`` or the context's constructor)."""


class CompileError(FluxrtError):
    """A kernel failed to compile or link; the message carries the compiler log."""


class WaitTimeoutError(FluxrtError, TimeoutError):
    """A bounded device-side wait expired: a peer never signalled."""

    def __init__(self, op: str, rank: int, peer: int | None, expected: int, observed: int):
        self.op, self.rank, self.peer = op, rank, peer
        self.expected, self.observed = expected, observed
        who = f"peer {peer}" if peer is not None else "an unknown peer"
        # a wait inside a persistent grid also expires when what it waits for cannot run beside the grid
        grid = ("; or the kernels and copies this wait depends on could not run beside its persistent grid (a GPU "
                "shared through MPS or with other kernels: lower the op plan's sm_count)"
                if _ops.in_persistent_grid(op) else "")
        super().__init__(
            f"{op}: rank {rank} timed out waiting for {who} "
            f"(flag expected >= {expected}, last seen {observed}); "
            f"the peer may have crashed, be slower than FLUXRT_TIMEOUT_S, or skipped the call{grid}")

    def __reduce__(self):
        return type(self), (self.op, self.rank, self.peer, self.expected, self.observed)


class AgreementTimeoutError(FluxrtError, TimeoutError):
    """Ranks did not all reach a collective call's host-side argument exchange within the world's timeout."""

    def __init__(self, op: str, rank: int, missing: list[int], timeout_s: float):
        self.op, self.rank, self.missing, self.timeout_s = op, rank, list(missing), timeout_s
        super().__init__(
            f"{op}: rank {rank} waited {timeout_s:g} s for rank(s) {self.missing} to make the same call; they "
            "may have crashed, be stuck, or skipped the call (ranks are now out of step: end the job)")

    def __reduce__(self):
        return type(self), (self.op, self.rank, self.missing, self.timeout_s)


class _OpRegistry:
    """Small integers that kernels write into the error record instead of op names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._names: list[str] = ["<none>"]
        self._persistent: set[str] = set()

    def id(self, name: str, persistent_grid: bool = False) -> int:
        with self._lock:
            if name not in self._ids:
                self._ids[name] = len(self._names)
                self._names.append(name)
            if persistent_grid:
                self._persistent.add(name)
            return self._ids[name]

    def in_persistent_grid(self, name: str) -> bool:
        return name in self._persistent

    def name(self, op_id: int) -> str:
        return self._names[op_id] if 0 <= op_id < len(self._names) else f"<op {op_id}>"


_ops = _OpRegistry()


def op_id(name: str, persistent_grid: bool = False) -> int:
    """The id a kernel reports for op `name` when one of its waits times out. persistent_grid: the wait runs
    in a persistent grid and waits for flags that its other CTAs or kernels and copies beside it release, so
    its timeout message also names those not getting to run."""
    return _ops.id(name, persistent_grid)


def decode_error_record(words) -> WaitTimeoutError | None:
    """Turn the words of a device ErrorRecord into the exception it stands for (None when clear)."""
    status = int(words[0])
    if status != STATUS_TIMEOUT:
        return None
    peer = int(words[3])
    return WaitTimeoutError(op=_ops.name(int(words[1])), rank=int(words[2]),
                            peer=None if peer == NO_PEER else peer,
                            expected=int(words[4]), observed=int(words[5]))


class ErrorRecordView:
    """The host's view of a device ErrorRecord (ERROR_RECORD_WORDS words at `host`: pinned, host-mapped memory
    that kernels write through the same address) and the first error decoded from it, kept (sticky) until
    :meth:`reset`. The world's record and the stream-K GEMM's use it."""

    __slots__ = ("host", "words", "status", "error")

    def __init__(self, host: int):
        import ctypes

        import numpy as np

        self.host = host
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * ERROR_RECORD_WORDS).from_address(host))
        self.status = ctypes.c_uint64.from_address(host)   # word 0, polled without decoding
        self.error: WaitTimeoutError | None = None

    @staticmethod
    def allocate() -> int:
        """Zeroed host-mapped pinned words for a record (free with cupy.cuda.runtime.freeHost)."""
        import ctypes

        import cupy

        rt = cupy.cuda.runtime
        nbytes = ERROR_RECORD_WORDS * 8
        host = rt.hostAlloc(nbytes, rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(host, 0, nbytes)
        return host

    def poll(self) -> WaitTimeoutError | None:
        """The sticky error, decoding the record once a kernel has finished writing it (None while clear).
        Does not synchronize: one read of host-mapped memory while nothing is recorded."""
        if self.error is None and self.status.value:
            self.error = decode_error_record(self.words)
        return self.error

    def reset(self) -> None:
        self.error = None
        self.words[:] = 0
