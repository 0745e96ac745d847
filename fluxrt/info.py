"""``python -m fluxrt.info``: what fluxrt runs on, for bug reports.

Versions (fluxrt, Python, numpy, CuPy, mpi4py, nvshmem4py, cuda-python), the MPI library, the CUDA
driver and runtime, the GPUs (name, memory, compute capability, PCI bus id) and their peer-access
matrix, ``nvidia-smi topo -m``, the NVSHMEM / fluxrt environment, the kernel cache and the GEMM autotune
cache. Every probe is independent: what cannot be read is reported on its line ("no CUDA device" on a
machine without one), never as a traceback. Does not boot NVSHMEM or initialize MPI beyond reading its
library version.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

PACKAGES = (("numpy", "numpy"), ("cupy", "cupy"), ("mpi4py", "mpi4py"), ("nvshmem4py", "nvshmem"),
            ("cuda-python", "cuda"), ("ml_dtypes", "ml_dtypes"))
DIST_NAMES = {"cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"), "nvshmem4py": ("nvshmem4py-cu13", "nvshmem4py-cu12"),
              "cuda-python": ("cuda-python", "cuda-bindings"), "mpi4py": ("mpi4py",), "numpy": ("numpy",),
              "ml_dtypes": ("ml_dtypes",)}
ENV_PREFIXES = ("NVSHMEM_", "FLUXRT_", "NCCL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MPS_",
                "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
# the launcher's view of the job: (variable, meaning) in order of preference
_LAUNCH_VARS = (("SLURM_NNODES", "nodes"), ("SLURM_NTASKS", "ranks"), ("SLURM_NTASKS_PER_NODE", "ranks per node"),
                ("OMPI_COMM_WORLD_SIZE", "ranks"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "ranks on this node"),
                ("PMI_SIZE", "ranks"), ("MPI_LOCALNRANKS", "ranks on this node"))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _version(label: str) -> str:
    from importlib import metadata

    for dist in DIST_NAMES.get(label, (label,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def versions() -> list[tuple[str, str]]:
    from . import __version__

    rows = [("fluxrt", __version__), ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform())]
    rows += [(label, _version(label)) for label, _ in PACKAGES]
    return rows


def mpi_library() -> list[tuple[str, str]]:
    try:
        import mpi4py

        mpi4py.rc.initialize = False          # reading the version needs no MPI_Init
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        name = MPI.Get_library_version().strip().splitlines()[0].strip()
        return [("MPI library", name[:200]), ("MPI standard", "%d.%d" % MPI.Get_version())]
    except Exception as e:
        return [("MPI library", f"unavailable ({_short(e)}); install an MPI: pip install 'fluxrt[mpich]' or load "
                                "your cluster's MPI module")]


def cuda() -> tuple[list[tuple[str, str]], list[str]]:
    """(rows, gpu lines): driver/runtime versions, GPUs and the peer-access matrix."""
    try:
        import cupy

        rt = cupy.cuda.runtime
    except Exception as e:
        return [("CUDA", f"CuPy unavailable ({_short(e)})")], []
    rows: list[tuple[str, str]] = []

    def ver(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    try:
        v = rt.driverGetVersion()
        rows.append(("CUDA driver", ver(v) if v else "none (no NVIDIA driver loaded)"))
    except Exception as e:
        rows.append(("CUDA driver", f"unavailable ({_short(e)})"))
    try:
        rows.append(("CUDA runtime", ver(rt.runtimeGetVersion())))
    except Exception as e:
        rows.append(("CUDA runtime", f"unavailable ({_short(e)})"))
    try:
        count = rt.getDeviceCount()
    except Exception as e:
        rows.append(("GPUs", f"no CUDA device ({_short(e)})"))
        return rows, []
    if count == 0:
        rows.append(("GPUs", "no CUDA device"))
        return rows, []
    rows.append(("GPUs", str(count)))
    lines = []
    for d in range(count):
        try:
            p = rt.getDeviceProperties(d)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            bus = "%04x:%02x:%02x.0" % (p.get("pciDomainID", 0), p.get("pciBusID", 0), p.get("pciDeviceID", 0))
            lines.append(f"  GPU {d}: {name}, {p['totalGlobalMem'] / 2**30:.1f} GiB, sm_{p['major']}{p['minor']}, "
                         f"{p['multiProcessorCount']} SMs, PCI {bus}")
        except Exception as e:
            lines.append(f"  GPU {d}: unreadable ({_short(e)})")
    if count > 1:
        lines.append("  peer access (row can access column):")
        lines.append("       " + " ".join(f"{j:>4}" for j in range(count)))
        for i in range(count):
            cells = []
            for j in range(count):
                try:
                    cells.append("   -" if i == j else "  ok" if rt.deviceCanAccessPeer(i, j) else "  no")
                except Exception:
                    cells.append("   ?")
            lines.append(f"  {i:>4} " + " ".join(cells))
    return rows, lines


def topology(timeout_s: float = 20.0) -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found"
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi topo -m failed ({_short(e)})"
    text = (out.stdout or out.stderr).rstrip()
    return text if out.returncode == 0 else f"nvidia-smi topo -m: exit {out.returncode}: {text[:300]}"


def multinode(env=None, ib_sysfs: str | None = None) -> list[tuple[str, str]]:
    """How a job launched from here would be split into nodes: FLUXRT_TOPOLOGY, the launcher's counts and
    NVSHMEM's remote transport. A running world logs its own ``world.topology`` (FLUXRT_DEBUG=info)."""
    from . import topology as topo

    env = os.environ if env is None else env
    rows = []
    try:
        v = topo.parse_setting(env.get(topo.ENV))
        rows.append(("FLUXRT_TOPOLOGY", "real nodes (COMM_TYPE_SHARED split)" if v is None else
                     f"virtual: {v.nodes} nodes x {v.ranks_per_node} ranks; peers in another virtual node go "
                     "through the NVSHMEM device API"))
    except topo.TopologyError as e:
        rows.append(("FLUXRT_TOPOLOGY", f"invalid: {e}"))
    launcher = [f"{meaning} {env[var]} ({var})" for var, meaning in _LAUNCH_VARS if env.get(var)]
    rows.append(("launcher", "; ".join(launcher) if launcher else "not inside an mpirun/srun job"))
    ok, why = topo.remote_transport(env, *(() if ib_sysfs is None else (ib_sysfs,)))
    rows.append(("remote transport", f"{'yes' if ok else 'none'}: {why}"))
    return rows


def environment(env=None) -> list[tuple[str, str]]:
    env = os.environ if env is None else env
    return sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES))


def heap() -> list[tuple[str, str]]:
    try:
        from .symmetric import heap_capacity

        return [("symmetric heap per rank", f"{heap_capacity()} bytes (NVSHMEM_SYMMETRIC_SIZE, default 1 GiB)")]
    except Exception as e:
        return [("symmetric heap per rank", f"unknown ({_short(e)})")]


def caches() -> list[tuple[str, str]]:
    rows = []
    try:
        from .toolchain import cache_dir

        rows.append(("kernel cache", str(cache_dir())))
    except Exception as e:
        rows.append(("kernel cache", f"unknown ({_short(e)})"))
    try:
        import importlib

        autotune = importlib.import_module("fluxrt.gemm.autotune")

        rows.append(("GEMM autotune dir", str(autotune.tune_dir())))
    except Exception as e:
        rows.append(("GEMM autotune dir", f"unknown ({_short(e)})"))
        return rows
    try:
        rows.append(("GEMM autotune cache", str(autotune.cache_path())))
    except Exception as e:
        rows.append(("GEMM autotune cache", f"none: no CUDA device ({_short(e)})"))
    return rows


def report() -> str:
    out = []

    def section(title: str, rows) -> None:
        out.append(f"== {title}")
        width = max((len(k) for k, _ in rows), default=0)
        out.extend(f"  {k:<{width}}  {v}" for k, v in rows)

    section("versions", versions())
    section("MPI", mpi_library())
    rows, gpu_lines = cuda()
    section("CUDA", rows)
    out.extend(gpu_lines)
    out.append("== topology (nvidia-smi topo -m)")
    out.extend("  " + line for line in topology().splitlines())
    section("nodes (fluxrt.topology)", multinode())
    section("NVSHMEM", heap())
    section("environment (NVSHMEM_*, FLUXRT_*, NCCL_*, CUDA_*)", environment() or [("(none set)", "")])
    section("caches", caches())
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fluxrt.info", description=__doc__.splitlines()[0])
    parser.add_argument("--world", action="store_true",
                        help="boot a world (run under mpirun/srun/fluxrt-run) and print its topology: nodes, "
                             "node teams, the peers each rank reaches only through NVSHMEM")
    parser.add_argument("--device", type=int, default=None,
                        help="with --world: the GPU of every rank (default: the local rank's)")
    args = parser.parse_args(argv)
    if args.world:
        return world_topology(args.device)
    print(report())
    return 0


def world_topology(device: int | None = None) -> int:
    """Every rank's view of the world's topology, printed by rank 0."""
    from . import world as _world

    with _world.init(device=device) as w:
        every = w.comm.gather(w.topology.describe(), root=0)
        if w.rank == 0:   # the nodes once, then each rank's own lines (its team, its NVSHMEM peers, its transport)
            print("\n".join(line for line in every[0] if not line.startswith(("  rank", "  remote"))))
            for mine in every:
                print("\n".join(line for line in mine if line.startswith(("  rank", "  remote"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
