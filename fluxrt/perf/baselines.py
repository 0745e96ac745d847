"""What every GPU sweep shares: the machine record of a results file and the NCCL baseline's
communicator (made from a unique id broadcast over the world's MPI communicator) and datatypes."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..world import World


def machine(world: World) -> dict:
    """The ``machine`` entry of a results document (the kind comes from FLUXRT_MACHINE_KIND)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(world.device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"gpu_name": name, "gpu_count": world.size}


def nccl_communicator(world: World):
    """An NCCL communicator over the world's ranks (collective). Raises ImportError, saying how to get
    NCCL, when cupy.cuda.nccl cannot load libnccl.so.2."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise ImportError("cupy.cuda.nccl cannot load libnccl.so.2 (pip install nvidia-nccl-cu13)")
    uid = world.comm.bcast(nccl.get_unique_id() if world.rank == 0 else None, root=0)
    return nccl.NcclCommunicator(world.size, uid, world.rank)


def nccl_datatype(dtype) -> int:
    """ncclDataType_t of a numpy dtype or name (bf16, fp16, fp32, int32)."""
    from cupy.cuda import nccl

    from ..dtypes import short_name

    return {"bf16": nccl.NCCL_BFLOAT16, "fp16": nccl.NCCL_FLOAT16, "fp32": nccl.NCCL_FLOAT32,
            "int32": nccl.NCCL_INT32}[short_name(dtype)]
