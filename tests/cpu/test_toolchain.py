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


def _cuobjdump() -> str | None:
    import os
    import shutil

    found = os.environ.get("FLUXRT_CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    try:
        beside = Path(toolchain.nvcc_path()).resolve().parent / "cuobjdump"
    except CompileError:
        return None
    return str(beside) if beside.is_file() else None


_DEVICE_LIBRARY_UNITS = [
    ("comm/collectives.cu", ()),
    ("comm/p2p.cu", ()),
    *[("ops/tp_ops.cu", (("FLUXRT_RS_PARTIAL", str(p)), ("FLUXRT_RS_OUT", str(o)))) for p in (0, 1, 2) for o in (0, 1)],
]
_ENTRY_POINTS = {
    "comm/p2p.cu": {"fluxrt_put_signal", "fluxrt_signal", "fluxrt_wait", "fluxrt_barrier", "fluxrt_pingpong"},
    "ops/tp_ops.cu": {"fluxrt_ops_signal_list", "fluxrt_ops_wait_list", "fluxrt_ops_delay", "fluxrt_rs_reduce"},
}


@needs_nvrtc
@pytest.mark.parametrize("source,defines", _DEVICE_LIBRARY_UNITS)
def test_device_library_kernels_use_no_local_memory(source, defines):
    """Every entry point built on kernels/include/fluxrt compiles for sm_90a, and none spills to local memory
    (cuobjdump -res-usage LOCAL: 0). Needs cuobjdump (on PATH, beside nvcc, or FLUXRT_CUOBJDUMP)."""
    import re
    import subprocess

    cubin = toolchain.compile_cubin(source, toolchain.CompileOptions(arch="sm_90a", defines=defines))
    data = Path(cubin).read_bytes()
    missing = [n for n in _ENTRY_POINTS.get(source, ()) if n.encode() + b"\0" not in data]
    assert not missing
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    local = dict(re.findall(r"Function (\w+):\s*\n\s*REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:(\d+)", res))
    assert local and all(v == "0" for v in local.values()), {k: v for k, v in local.items() if v != "0"}
