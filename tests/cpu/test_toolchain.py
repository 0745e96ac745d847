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
def test_compile_many_fills_the_same_cache_entries(monkeypatch):
    monkeypatch.setattr(toolchain, "_resolve_arch", lambda options: options.arch or "sm_90a")   # no GPU here
    opts = [toolchain.CompileOptions(defines=(("X", str(i)),)) for i in range(3)]
    built = toolchain.compile_many("comm/p2p.cu", opts + opts[:1], jobs=2)   # the repeat is built once
    assert len(built) == 3 and len(set(built)) == 3
    mtimes = [os.stat(p).st_mtime_ns for p in built]
    assert [toolchain.compile_cubin("comm/p2p.cu", o) for o in opts] == built   # cache hits, same keys
    assert [os.stat(p).st_mtime_ns for p in built] == mtimes


def _compile_counting(cache, marks, start, q):
    """One process of test_processes_missing_the_cache_at_once_compile_once: compile p2p.cu once the others are
    ready, appending a line to `marks` for every NVRTC compile it actually runs."""
    os.environ["FLUXRT_CACHE_DIR"] = cache
    real = toolchain._nvrtc_compile

    def counted(*args):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*args)

    toolchain._nvrtc_compile = counted
    start.wait()
    q.put(str(toolchain.compile_cubin("comm/p2p.cu", toolchain.CompileOptions(arch="sm_90a",
                                                                               defines=(("LOCK_TEST", "1"),)))))


@needs_nvrtc
def test_processes_missing_the_cache_at_once_compile_once(tmp_path):
    """Ranks of a node that miss the cache together: one compiles, the others wait for its cubin (so they leave
    the compile together) instead of compiling it again side by side."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    marks, start, q = tmp_path / "marks", ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_compile_counting, args=(str(tmp_path / "shared"), str(marks), start, q))
             for _ in range(3)]
    for p in procs:
        p.start()
    start.set()
    paths = {q.get(timeout=300) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(paths) == 1 and Path(paths.pop()).stat().st_size > 1000
    assert len(marks.read_text().split()) == 1


@needs_nvrtc
def test_a_build_lock_held_too_long_is_passed_by(tmp_path, monkeypatch, caplog):
    """A process holding a cubin's build lock past FLUXRT_LOAD_WAIT_S (stopped, hung) does not stop the others:
    they build the cubin themselves after the bound, with a warning."""
    import fcntl
    import logging
    import time

    monkeypatch.setenv("FLUXRT_LOAD_WAIT_S", "0.3")
    opts = toolchain.CompileOptions(arch="sm_90a", defines=(("LOCK_HELD", "1"),))
    key_probe = toolchain.compile_cubin("comm/p2p.cu", opts)   # where the cubin and its lock live
    key_probe.unlink()
    fd = os.open(key_probe.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # held by "another process" (another open file description)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fluxrt"):
            built = toolchain.compile_cubin("comm/p2p.cu", opts)
        assert 0.3 <= time.monotonic() - t0 < 60
        assert built == key_probe and built.stat().st_size > 1000
        assert "FLUXRT_LOAD_WAIT_S" in caplog.text
    finally:
        os.close(fd)


@needs_nvrtc
def test_compile_many_names_the_failing_configuration(tmp_path):
    bad = tmp_path / "half.cu"
    bad.write_text('#if BROKEN\nthis is not cuda;\n#endif\nextern "C" __global__ void k() {}\n')
    opts = [toolchain.CompileOptions(arch="sm_90a", defines=(("BROKEN", b),)) for b in ("0", "1")]
    with pytest.raises(CompileError, match="-DBROKEN=1"):
        toolchain.compile_many(bad, opts, jobs=2)


@needs_nvrtc
def test_compile_many_keeps_going_past_a_failing_configuration(tmp_path):
    bad = tmp_path / "half.cu"
    bad.write_text('#if BROKEN\nthis is not cuda;\n#endif\nextern "C" __global__ void k() {}\n')
    opts = [toolchain.CompileOptions(arch="sm_90a", defines=(("BROKEN", b),)) for b in ("1", "0")]
    built = toolchain.compile_many(bad, opts, jobs=2, keep_going=True)
    assert built[0] is None and built[1] is not None and built[1].read_bytes()[:4] == b"\x7fELF"


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


def _fake_nvcc(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_system_nvcc(tmp_path, monkeypatch):
    """A machine with no nvcc on PATH, no CUDA toolkit, no pip nvcc and no cuda-pathfinder hit."""
    monkeypatch.setattr(toolchain.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(toolchain, "_site_dirs", lambda: [str(tmp_path / "empty"), str(site)])
    import sys
    import types

    fake_pathfinder = types.ModuleType("cuda.pathfinder")
    fake_pathfinder.find_nvidia_binary_utility = lambda name: None
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", fake_pathfinder)
    return site


@pytest.mark.parametrize("layout", ["nvidia/cu13/bin", "nvidia/cuda_nvcc/bin"])
def test_nvcc_from_a_pip_wheel_when_there_is_no_toolkit(no_system_nvcc, layout):
    nvcc = _fake_nvcc(no_system_nvcc / layout / "nvcc")
    assert toolchain.nvcc_path() == str(nvcc)


def test_toolkit_nvcc_wins_over_pip(no_system_nvcc, tmp_path, monkeypatch):
    _fake_nvcc(no_system_nvcc / "nvidia/cu13/bin/nvcc")
    toolkit = _fake_nvcc(tmp_path / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert toolchain.nvcc_path() == str(toolkit)


def test_non_executable_pip_nvcc_is_skipped(no_system_nvcc):
    _fake_nvcc(no_system_nvcc / "nvidia/cu13/bin/nvcc").chmod(0o644)
    with pytest.raises(CompileError):
        toolchain.nvcc_path()


def test_cuda_pathfinder_is_the_last_resort(no_system_nvcc, tmp_path):
    import sys

    found = _fake_nvcc(tmp_path / "elsewhere" / "nvcc")
    sys.modules["cuda.pathfinder"].find_nvidia_binary_utility = lambda name: str(found) if name == "nvcc" else None
    assert toolchain.nvcc_path() == str(found)


def test_missing_nvcc_names_the_pip_package(no_system_nvcc):
    with pytest.raises(CompileError, match=r'pip install "cuda-toolkit\[nvcc,cccl\]==13\.\*"'):
        toolchain.nvcc_path()


def test_nvcc_extra_is_the_one_the_error_names():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f'"{extras["nvcc"][0]}"' in toolchain.NVCC_REMEDY


def test_every_kernel_folder_ships_in_the_wheel():
    """pyproject lists each kernels/ folder as a package with its sources as package data: a new folder that is
    not listed would be left out of the wheel and its kernels would not compile where fluxrt is installed."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python >= 3.11) reads pyproject.toml")
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent for p in (root / "kernels").rglob("*") if p.suffix in (".cu", ".cuh", ".h")}
    for folder in folders:
        pkg = ".".join(("fluxrt", "kernels", *folder.relative_to(root / "kernels").parts))
        assert pkg in cfg["packages"], f"{folder} is not listed in pyproject's packages"
        assert pkg in cfg["package-data"], f"{folder}'s sources are not package data"

def _cuobjdump() -> str | None:
    import os

    return os.environ.get("FLUXRT_CUOBJDUMP") or toolchain.binary_utility("cuobjdump")


_DEVICE_LIBRARY_UNITS = [
    ("comm/collectives.cu", ()),
    ("comm/p2p.cu", ()),
    ("comm/fused.cu", ()),
    *[("ops/tp_ops.cu", (("FLUXRT_RS_PARTIAL", str(p)), ("FLUXRT_RS_OUT", str(o)))) for p in (0, 1, 2) for o in (0, 1)],
    ("moe/dispatch.cu", ()),
]
_ENTRY_POINTS = {
    "comm/p2p.cu": {"fluxrt_put_signal", "fluxrt_signal", "fluxrt_wait", "fluxrt_barrier", "fluxrt_pingpong"},
    "comm/fused.cu": {"fluxrt_allreduce_norm_ll_bf16", "fluxrt_allreduce_norm_twoshot_fp16",
                      "fluxrt_compressed_allreduce_fp8_bf16", "fluxrt_compressed_allgather_int8_fp32"},
    "ops/tp_ops.cu": {"fluxrt_ops_signal_list", "fluxrt_ops_wait_list", "fluxrt_ops_delay", "fluxrt_rs_reduce"},
    "moe/dispatch.cu": {"fluxrt_moe_stage", *(f"fluxrt_moe_{k}_{i}" for k in ("layout", "push", "combine_bf16",
                                                                            "combine_fp16") for i in ("i32", "i64"))},
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
    if source in ("comm/collectives.cu", "comm/fused.cu"):
        # Spills show as stack (LOCAL counts other local memory only). The pipelined rounds keep per-peer
        # u64[kMaxWorld] arrays on the stack (reduce_pipe: len; exchange_pipe: lo and len); every other
        # kernel must keep everything in registers (the bf16/fp16 ring kernels once spilled 16-24 bytes
        # at the 128-register cap of __launch_bounds__(512): fluxrt/reduce.cuh fold_sources).
        stack = dict(re.findall(r"Function (\w+):\s*\n\s*REG:\d+ STACK:(\d+)", res))
        allowed = {k: (512 if k == "fluxrt_exchange_pipe" else 256 if "_pipe_" in k else 0) for k in stack}
        over = {k: v for k, v in stack.items() if int(v) > allowed[k]}
        assert stack and not over, over


def test_missing_header_hint_names_the_wheel():
    cccl = "/x/nvshmem_common_transport.h:5:10: fatal error: cuda/std/cstdint: No such file or directory\n"
    assert "cuda-toolkit[cccl]==13.*" in toolchain.missing_header_hint(cccl)
    nvshmem = "kernels/comm/nvshmem_p2p.cu:3:10: fatal error: nvshmem.h: No such file or directory\n"
    assert "nvidia-nvshmem-cu13" in toolchain.missing_header_hint(nvshmem)
    assert toolchain.missing_header_hint(cccl * 2).count("cccl]") == 1
    assert toolchain.missing_header_hint("error: identifier \"x\" is undefined") == ""


def test_nvcc_extra_brings_the_cccl_headers_nvshmem_includes():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("cuda-toolkit[") and "cccl" in r.split("]")[0] for r in extras["nvcc"])


def _pip_only_env(tmp_path):
    """The environment of a GPU node with pip's toolchain only: no /usr/local or CUDA dir on PATH, no CUDA_HOME
    (pointed at an empty dir so the /usr/local/cuda default is not probed either)."""
    import shutil
    import sys

    path = os.pathsep.join([str(Path(sys.executable).parent)] +
                           [d for d in os.environ.get("PATH", "").split(os.pathsep)
                            if d and not d.startswith("/usr/local") and "cuda" not in d.lower()])
    if shutil.which("nvcc", path=path):
        return None, path
    return {"PATH": path, "HOME": os.environ.get("HOME", str(tmp_path)), "CUDA_HOME": str(tmp_path / "no-cuda"),
            "FLUXRT_CACHE_DIR": str(tmp_path / "pip-cache")}, path


@needs_nvrtc
def test_pip_toolchain_alone_builds_the_nvshmem_kernel(tmp_path):
    """`pip install ".[nvcc]"` is enough for the NVSHMEM device-API kernel (README's promise): with no CUDA
    toolkit in sight, nvcc comes from pip's nvidia/cu13/bin, CCCL from nvidia-cuda-cccl, libnvshmem_device.a
    from nvidia-nvshmem-cu13, and nvJitLink from nvidia-nvjitlink. Skipped unless this interpreter has pip's nvcc
    (a venv made with the nvcc extra) and a host compiler."""
    import shutil
    import subprocess
    import sys

    if toolchain._pip_nvcc() is None:
        pytest.skip("no pip nvcc in this environment (pip install '.[nvcc]')")
    env, path = _pip_only_env(tmp_path)
    if env is None or not shutil.which("g++", path=path):
        pytest.skip("an nvcc outside /usr/local is on PATH, or no g++")
    repo = Path(toolchain.__file__).resolve().parents[1]
    script = ("import fluxrt.toolchain as t\n"
              "assert t.nvcc_path() == t._pip_nvcc(), t.nvcc_path()\n"
              "print(t.compile_nvshmem_cubin('comm/nvshmem_p2p.cu', t.CompileOptions(arch='sm_90a')))\n"
              "print(t.compile_cubin('comm/p2p.cu', t.CompileOptions(arch='sm_90a')))\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cubins = res.stdout.split()
    assert len(cubins) == 2 and all(Path(c).read_bytes()[:4] == b"\x7fELF" for c in cubins)
