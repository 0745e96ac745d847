"""GPU tests: run under mpirun on 2+ GPUs (`mpirun -n 2 python -m pytest tests/gpu`); skipped elsewhere.

Every rank runs the same tests in the same order: collective calls inside them must line up.
"""
import os

import pytest


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _mpi_size() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_size()
    except Exception:
        return 1


GPUS = _gpu_count()
RANKS = _mpi_size()
NO_GPU = "no CUDA GPU on this machine (the GPU suite runs on a GPU node: launch/gpu-check.sh)"
FEW_RANKS = f"needs >= 2 MPI ranks, got {RANKS} (run: fluxrt-run -n 2 -- python -m pytest tests/gpu)"


def _hopper_skip_reason() -> str | None:
    if GPUS == 0:
        return NO_GPU
    import cupy

    cc = cupy.cuda.Device(int(os.environ.get("FLUXRT_TEST_DEVICE", "0"))).compute_capability
    return None if cc == "90" else f"the GEMM kernels target sm_90a (Hopper wgmma and TMA); this GPU is sm_{cc}"


def pytest_configure(config):
    config.addinivalue_line("markers", "multirank: needs >= 2 MPI ranks with one GPU each")
    config.addinivalue_line("markers", "hopper: needs a Hopper GPU (sm_90a kernels)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu" not in str(item.fspath).replace(os.sep, "/"):
            continue
        if GPUS == 0:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
        elif RANKS < 2 and item.get_closest_marker("multirank"):
            item.add_marker(pytest.mark.skip(reason=FEW_RANKS))
        elif item.get_closest_marker("hopper") and (reason := _hopper_skip_reason()):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def world():
    import fluxrt

    # FLUXRT_TEST_DEVICE pins every rank to one GPU: several ranks on one GPU under CUDA MPS, a correctness run
    # for machines with fewer GPUs than ranks (docs/design.md, "Testing")
    dev = os.environ.get("FLUXRT_TEST_DEVICE")
    w = fluxrt.init(device=int(dev) if dev else None, options=fluxrt.WorldOptions(heap_size="2G", timeout_s=5))
    yield w
    w.finalize()


@pytest.fixture
def rng(request):
    import numpy as np
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
