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


def format_cuda_version(code: int | None) -> str | None:
    """"12.8" from cudaRuntimeGetVersion / cudaDriverGetVersion's 12080 (None or 0: None)."""
    if not code:
        return None
    return f"{code // 1000}.{(code % 1000) // 10}"


def format_nccl_version(code: int | None) -> str | None:
    """"2.27.3" from ncclGetVersion's 22703 (NCCL >= 2.9: major*10000 + minor*100 + patch; before:
    major*1000 + minor*100 + patch)."""
    if not code:
        return None
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def library_versions() -> dict:
    """fluxrt, Python, CuPy, CUDA runtime and driver, NCCL (through cupy.cuda.nccl) and MPI versions;
    None for what cannot be read here. Never raises."""
    import platform

    import fluxrt

    v: dict = {"fluxrt": fluxrt.__version__, "python": platform.python_version(), "cupy": None,
               "cuda_runtime": None, "cuda_driver": None, "nccl": None, "mpi": None}
    try:
        import cupy

        v["cupy"] = cupy.__version__
        v["cuda_runtime"] = format_cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        v["cuda_driver"] = format_cuda_version(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # no CuPy or no driver: recorded as None
        pass
    try:
        from cupy.cuda import nccl

        if getattr(nccl, "available", True):
            v["nccl"] = format_nccl_version(nccl.get_version())
    except Exception:
        pass
    try:
        from mpi4py import MPI

        v["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:
        pass
    return v


def device_info(world: World) -> list[dict]:
    """One entry per rank (collective): host, pid, device ordinal, name and PCI bus id of its GPU."""
    import os
    import socket

    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(world.device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    try:
        pci = cupy.cuda.runtime.deviceGetPCIBusId(world.device_id)
    except Exception:
        pci = (f"{props.get('pciDomainID', 0):04x}:{props.get('pciBusID', 0):02x}:"
               f"{props.get('pciDeviceID', 0):02x}.0")
    mine = {"rank": world.rank, "host": socket.gethostname(), "pid": os.getpid(), "device": world.device_id,
            "name": name, "pci_bus_id": str(pci)}
    return world.comm.allgather(mine)


def nccl_registration(register: int) -> tuple[bool, str | None]:
    """(registered, note) for nccl-tests' -R on the NCCL baseline. The buffers are CuPy or NVSHMEM
    allocations shared with fluxrt, and registering them needs bindings cupy.cuda.nccl lacks
    (ncclCommRegister / ncclCommWindowRegister): the note says why NCCL runs unregistered."""
    if register == 0:
        return False, None
    kind = "local (ncclCommRegister)" if register == 1 else "symmetric window (ncclCommWindowRegister)"
    for mod in ("nccl4py", "nccl.core"):
        try:
            __import__(mod)
        except Exception:
            continue
        return False, (f"-R {register}: NCCL {kind} registration not done: {mod} imports, but this sweep "
                       "does not call it yet; NCCL runs on unregistered buffers")
    return False, (f"-R {register}: NCCL {kind} registration not possible: nccl4py is not importable "
                   "(cupy.cuda.nccl has no registration call); NCCL runs on unregistered buffers")
