"""Kernel toolchain without a GPU: every kernel source compiles for sm_90a; cache keys; errors."""
import importlib.util
import os
from pathlib import Path

import pytest

from fluxrt import toolchain
from fluxrt.errors import CompileError

needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cuda.core") is None, reason="cuda-python not installed")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path / "cache"))


def test_kernel_tree_is_found():
    root = toolchain.kernel_root()
    assert (root / "include" / "fluxrt" / "comm.cuh").is_file()
    names = {p.name for p in toolchain.kernel_sources()}
    assert {"p2p.cu", "nvshmem_p2p.cu"} <= names


@needs_nvrtc
@pytest.mark.parametrize("source", [p.relative_to(toolchain.kernel_root()).as_posix()
                                    for p in toolchain.kernel_sources()])
def test_every_kernel_compiles_for_sm90a(source):
    src = toolchain.kernel_root() / source
    opts = toolchain.CompileOptions(arch="sm_90a")
    if toolchain.uses_nvshmem(src):
        try:
            toolchain.nvcc_path()
        except CompileError as e:
            pytest.skip(f"NVSHMEM kernels build with nvcc: {e}")
        cubin = toolchain.compile_nvshmem_cubin(src, opts)
    else:
        cubin = toolchain.compile_cubin(src, opts)
    data = Path(cubin).read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) > 1000


@needs_nvrtc
def test_cache_hit_and_key_changes_with_options():
    a = toolchain.compile_cubin("comm/p2p.cu", toolchain.CompileOptions(arch="sm_90a"))
    mtime = os.stat(a).st_mtime_ns
    assert toolchain.compile_cubin("comm/p2p.cu", toolchain.CompileOptions(arch="sm_90a")) == a
    assert os.stat(a).st_mtime_ns == mtime
    b = toolchain.compile_cubin("comm/p2p.cu", toolchain.CompileOptions(arch="sm_90a", defines=(("X", "1"),)))
    assert b != a


@needs_nvrtc
def test_compile_error_carries_the_log(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k() { this is not cuda; }\n')
    with pytest.raises(CompileError, match="broken.cu"):
        toolchain.compile_cubin(bad, toolchain.CompileOptions(arch="sm_90a"))


def test_missing_source_is_a_clear_error():
    with pytest.raises(CompileError, match="does not exist"):
        toolchain.compile_cubin("comm/no_such_kernel.cu")


def test_every_python_subpackage_is_in_the_wheel():
    """A subpackage missing from pyproject's package list imports from a checkout but not after
    `pip install .`."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "fluxrt").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
