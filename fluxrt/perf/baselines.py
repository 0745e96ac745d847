"""What every GPU sweep shares: the machine record of a results file, library versions and devices, what
-R means for the NCCL baseline (whose binding, communicator and windows are fluxrt.perf.nccl_lib's), and
the cuBLAS GEMM baseline of the GEMM benchmarks."""
from __future__ import annotations

import ctypes
import ctypes.util

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
    """A cupy.cuda.nccl communicator over the world's ranks (collective), for the benches that call NCCL
    through CuPy's API on ordinary buffers (fused, mlp; the collective sweeps and ag_gemm/gemm_rs take
    fluxrt.perf.nccl_lib's, which also runs NCCL on registered windows). Raises ImportError (NcclUnavailable)
    saying how to get NCCL when libnccl.so.2 cannot be loaded."""
    from .nccl_lib import CupyNccl

    lib = CupyNccl()
    uid = world.comm.bcast(lib.unique_id() if world.rank == 0 else None, root=0)
    return lib.init(world.size, uid, world.rank)


def nccl_datatype(dtype) -> int:
    """ncclDataType_t of a numpy dtype or name (bf16, fp16, fp32, int32)."""
    from ..dtypes import short_name
    from .nccl_lib import DATATYPES

    return DATATYPES[short_name(dtype)]


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


def library_versions(nccl_lib=None) -> dict:
    """fluxrt, Python, CuPy, CUDA runtime and driver, NCCL and MPI versions; None for what cannot be read
    here. NCCL's is read through `nccl_lib` (the sweep's binding, :mod:`fluxrt.perf.nccl_lib`), else through
    the first binding that loads; ``nccl_binding`` names it. Never raises."""
    import platform

    import fluxrt

    v: dict = {"fluxrt": fluxrt.__version__, "python": platform.python_version(), "cupy": None,
               "cuda_runtime": None, "cuda_driver": None, "nccl": None, "nccl_binding": None, "mpi": None}
    try:
        import cupy

        v["cupy"] = cupy.__version__
        v["cuda_runtime"] = format_cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        v["cuda_driver"] = format_cuda_version(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # no CuPy or no driver: recorded as None
        pass
    try:
        if nccl_lib is None:
            from .nccl_lib import choose

            nccl_lib, _ = choose()
        v["nccl"] = format_nccl_version(nccl_lib.version_code())
        v["nccl_binding"] = nccl_lib.name + (f" {nccl_lib.binding_version}" if nccl_lib.binding_version else "")
    except Exception:
        pass
    try:
        from mpi4py import MPI

        v["mpi"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]   # Open MPI's ends in NUL
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
    """(registered, note) for nccl-tests' -R on the NCCL baseline. The sweeps run NCCL on ordinary buffers
    ("nccl") and on ncclMemAlloc buffers registered as symmetric windows ("nccl-win", what -R 2 means in
    nccl-tests) whatever -R says; -R 1 (ncclCommRegister of the ordinary buffers) is not done, and the
    note says so."""
    if register != 1:
        return register == 2, None
    return False, ("-R 1: NCCL local registration (ncclCommRegister) not done: the 'nccl' columns run on "
                   "unregistered buffers; the 'nccl-win' columns are NCCL on registered symmetric windows (-R 2)")


_cublas_lib = None
_cublas_handles: dict = {}


def _cublas():
    """libcublas through ctypes: CuPy's binding refuses to run while a stream is being captured."""
    global _cublas_lib
    if _cublas_lib is None:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            path = load_nvidia_dynamic_lib("cublas").abs_path
        except Exception:
            path = ctypes.util.find_library("cublas") or "libcublas.so.13"
        lib = ctypes.CDLL(path)
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        _cublas_lib = lib
    return _cublas_lib


def _cublas_handle(device: int):
    """One handle per device, with a workspace of its own so that cuBLAS allocates nothing during a capture."""
    entry = _cublas_handles.get(device)
    if entry is None:
        import cupy

        lib, h = _cublas(), ctypes.c_void_p()
        if lib.cublasCreate_v2(ctypes.byref(h)):
            raise RuntimeError("cublasCreate failed")
        ws = cupy.empty((32 << 20,), dtype=cupy.uint8)
        lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.data.ptr), ws.nbytes)
        entry = _cublas_handles[device] = (h, ws)
    return entry[0]


def cublas_gemm(a, w, c, trans_b: bool, stream_ptr: int):
    """A callable that runs row-major ``c = a @ w`` (``w`` [K, N]) or ``a @ w.T`` (``trans_b``, ``w`` [N, K])
    through cublasGemmEx (fp32 compute, default algorithm) on ``stream_ptr``: what cupy.matmul runs, with the
    arguments converted once. The device's handle is bound to the stream here, so make the callable right
    before its calls. Column-major view: C^T[N, M] = W^T @ A^T."""
    lib = _cublas()
    handle = _cublas_handle(a.data.device_id)
    m, k = a.shape
    n = c.shape[1]
    cdt = {"bfloat16": 14, "float16": 2}[a.dtype.name]          # CUDA_R_16BF / CUDA_R_16F
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    args = (handle, 1 if trans_b else 0, 0, n, m, k, ctypes.byref(one), ctypes.c_void_p(w.data.ptr), cdt,
            k if trans_b else n, ctypes.c_void_p(a.data.ptr), cdt, k, ctypes.byref(zero),
            ctypes.c_void_p(c.data.ptr), cdt, n, 68, -1)        # CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT
    lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_ptr))

    def run() -> None:
        status = lib.cublasGemmEx(*args)
        if status:
            raise RuntimeError(f"cublasGemmEx failed with status {status} (M={m}, N={n}, K={k})")

    run.keepalive = (one, zero)   # the scalars cuBLAS reads through pointers
    return run


def worst_rel_err(world: World, got, ref) -> float:
    """max |got - ref| / max |ref| (fp32 on the device), the largest over the world's ranks: the sweeps' check
    of an op against its baseline in the same job."""
    import cupy

    g, r = got.astype(cupy.float32), ref.astype(cupy.float32)
    err = float(cupy.abs(g - r).max()) / max(float(cupy.abs(r).max()), 1e-30)
    from mpi4py import MPI

    return world.comm.allreduce(err, op=MPI.MAX)
