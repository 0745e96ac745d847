"""fluxrt: framework-free GPU communication with fine-grained compute overlap (FLUX-style).

Start here::

    import fluxrt
    with fluxrt.init() as world:            # MPI ranks -> GPUs -> NVSHMEM
        x = world.zeros((1024,), "bf16")     # symmetric: x.peer(r) is rank r's copy over NVLink
"""
from . import log as _log
from .fatal import install_abort_excepthook as _install_abort_excepthook

_log.configure()                 # FLUXRT_DEBUG / FLUXRT_DEBUG_FILE
_install_abort_excepthook()      # FLUXRT_ABORT_ON_EXCEPTION=1 (fluxrt-run)

from .collectives import (CollectiveHandle, Collectives, CollectivesOptions, allgather, allreduce, alltoall,
                          alltoallv, barrier, broadcast, prepare, reduce_scatter, wait_all)
from .dtypes import bfloat16, normalize_dtype
from .errors import (AgreementTimeoutError, CollectiveArgumentError, CollectiveMismatchError, CompileError, DeviceError, FluxrtError,
                     GraphCaptureError, HeapExhaustedError, NotSymmetricError, NvshmemInitError, WaitTimeoutError)
from .topology import TopologyError
from .world import World, WorldOptions, current, finalize, init
from . import compressed, fused, moe, ops

__version__ = "0.1.0"

__all__ = [
    "init", "finalize", "current", "World", "WorldOptions", "bfloat16", "normalize_dtype",
    "FluxrtError", "DeviceError", "NvshmemInitError", "HeapExhaustedError", "CollectiveMismatchError",
    "NotSymmetricError", "CompileError", "WaitTimeoutError", "AgreementTimeoutError", "CollectiveArgumentError",
    "Collectives", "CollectivesOptions", "CollectiveHandle", "allreduce", "reduce_scatter", "allgather",
    "alltoall", "alltoallv", "broadcast", "barrier", "prepare", "wait_all", "GraphCaptureError", "TopologyError",
    "compressed", "fused", "moe", "ops",
]
