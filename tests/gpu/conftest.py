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
SKIP_REASON = None
if GPUS == 0:
    SKIP_REASON = "no CUDA GPU on this machine (GPU suite runs on a GPU node: launch/gpu-check.sh)"
elif RANKS < 2:
    SKIP_REASON = f"needs >= 2 MPI ranks (run: mpirun -n 2 python -m pytest tests/gpu); got {RANKS}"


def pytest_collection_modifyitems(config, items):
    if SKIP_REASON is None:
        return
    marker = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(marker)


@pytest.fixture(scope="module")
def world():
    import fluxrt

    w = fluxrt.init(options=fluxrt.WorldOptions(heap_size="2G", timeout_s=5))
    yield w
    w.finalize()


@pytest.fixture
def rng(request):
    import numpy as np
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
