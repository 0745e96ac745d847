"""Kernel toolchain: compile kernels/ sources for the device's arch, cache the cubins, load them.

Two paths:

* plain kernels: NVRTC (through ``cuda.core.Program``) -> cubin for e.g. ``sm_90a`` -> ``cupy.RawModule``.
  CuPy's own NVRTC call forces ``-arch=sm_90``, which rejects wgmma/setmaxnreg, so the cubin is built here.
* kernels calling the NVSHMEM device API: ``nvcc -rdc=true -cubin`` -> nvJitLink (``cuda.core.Linker``)
  with ``libnvshmem_device.a`` -> ``cupy.RawModule`` -> ``nvshmem.bindings.cumodule_init``.

Cubins are cached on disk, keyed by every source byte the compile can see (the kernel and the shared
include tree), the options, the arch and the compiler version. Writes are atomic, and a process that misses
the cache takes a lock beside the cubin (bounded by FLUXRT_LOAD_WAIT_S), so the ranks of a node that share the
cache compile a module once and leave the compile together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CompileError

log = logging.getLogger(__name__)

_DEFAULT_ARCH_NO_GPU = "sm_90a"


@dataclass(frozen=True)
class CompileOptions:
    """How a kernel source is compiled. ``arch=None`` means the current device's (``sm_90a`` on Hopper)."""

    arch: str | None = None
    defines: tuple[tuple[str, str], ...] = ()
    std: str = "c++17"
    max_registers: int | None = None
    lineinfo: bool = False
    include_dirs: tuple[str, ...] = ()
    extra_nvcc: tuple[str, ...] = field(default=())

    def key(self) -> str:
        return repr(dataclasses.astuple(self))


def kernel_root() -> Path:
    """The kernels/ tree: inside the installed package (fluxrt/kernels) or beside it in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "include" / "fluxrt" / "comm.cuh").is_file():
            return candidate
    raise CompileError(f"fluxrt kernel sources not found next to {here} (looked for kernels/include/fluxrt)")


def include_dir() -> Path:
    return kernel_root() / "include"


def cache_dir() -> Path:
    d = Path(os.environ.get("FLUXRT_CACHE_DIR") or Path.home() / ".cache" / "fluxrt" / "kernels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def device_arch(device_id: int | None = None) -> str:
    """sm_XY for the device, with the arch-specific 'a' suffix on 9.0 / 10.0 (wgmma, setmaxnreg, tcgen05)."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    cc = dev.compute_capability  # e.g. "90"
    return f"sm_{cc}a" if cc in ("90", "100", "103") else f"sm_{cc}"


def _resolve_arch(options: CompileOptions) -> str:
    if options.arch:
        return options.arch
    try:
        return device_arch()
    except Exception:  # no GPU visible: compile-only use (CI)
        return _DEFAULT_ARCH_NO_GPU


def _source_digest(source: Path, extra_dirs: tuple[str, ...]) -> str:
    """Hash of the source and every header it can include: the shared include dir, the extra include
    dirs, and the headers beside the source (kernels/gemm/*.cuh)."""
    h = hashlib.sha256()
    h.update(source.read_bytes())
    for root in (include_dir(), source.parent, *map(Path, extra_dirs)):
        for f in sorted(root.rglob("*.cuh")) + sorted(root.rglob("*.h")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _build_lock(out: Path):
    """Exclusive lock on ``out``'s build (a ``.lock`` file beside it): the ranks of a node that miss the cache at
    once wait for one compile instead of each running its own, and so leave it together (ranks compiling side by
    side finish seconds apart, and a rank ahead reaches its next bounded exchange early). Released when the holder
    exits, however it ends. The wait is bounded by FLUXRT_LOAD_WAIT_S (default 300 s): past it (a stopped or hung
    compile) this process builds without the lock, as it does where the platform or file system has none; the
    cubin is written atomically either way."""
    fd = None
    try:
        import fcntl

        fd = os.open(out.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        limit = float(os.environ.get("FLUXRT_LOAD_WAIT_S", "300"))
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("waited %.0f s (FLUXRT_LOAD_WAIT_S) for another process's build of %s; building "
                                "it here", limit, out.name)
                    break
                time.sleep(0.05)
    except (ImportError, OSError) as e:   # not POSIX, or a file system without locks
        log.debug("no build lock for %s (%s)", out.name, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _source_path(source: str | os.PathLike) -> Path:
    p = Path(source)
    if not p.is_absolute():
        p = kernel_root() / p
    if not p.is_file():
        raise CompileError(f"kernel source {p} does not exist")
    return p


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc{major}.{minor}"


def _cuda_include_dirs() -> list[str]:
    """CUDA headers NVRTC may need (cuda_bf16.h, cuda_fp16.h, ...), wherever the toolkit lives."""
    dirs = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d:
            dirs.append(d)
    except Exception:  # older cuda-pathfinder, or headers not installed as wheels
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if (Path(home) / "include" / "cuda_bf16.h").is_file():
        dirs.append(str(Path(home) / "include"))
    return dirs


def compile_cubin(source: str | os.PathLike, options: CompileOptions = CompileOptions(), *,
                  resolved_arch: str | None = None) -> Path:
    """Compile a kernels/ source with NVRTC into a cached cubin; returns the cubin's path. ``resolved_arch``:
    the arch that ``options.arch=None`` stands for, given by a caller that resolved it already
    (:func:`compile_many`, whose threads need not query the GPU); the cache key is the same either way."""
    src = _source_path(source)
    arch = options.arch or resolved_arch or _resolve_arch(options)
    key = hashlib.sha256("|".join([_source_digest(src, options.include_dirs), options.key(), arch,
                                   _nvrtc_version(), "default-device"]).encode()).hexdigest()[:24]
    out = cache_dir() / f"{src.stem}-{arch}-{key}.cubin"
    if out.is_file():
        return out
    with _build_lock(out):
        if out.is_file():   # built by another process while this one waited
            return out
        return _nvrtc_compile(src, arch, options, out)


def _nvrtc_compile(src: Path, arch: str, options: CompileOptions, out: Path) -> Path:
    from cuda.core import Program, ProgramOptions

    popts = ProgramOptions(
        name=src.name, arch=arch, std=options.std,
        include_path=[str(include_dir()), *options.include_dirs, *_cuda_include_dirs()],
        define_macro=[f"{k}={v}" for k, v in options.defines] or None,
        max_register_count=options.max_registers, lineinfo=options.lineinfo or None,
        # -default-device: lambdas in the device library are device code (NVRTC 13.0 rejects them otherwise)
        device_as_default_execution_space=True,
    )
    logs = io.StringIO()
    try:
        obj = Program(src.read_text(), "c++", popts).compile("cubin", logs=logs)
    except Exception as e:  # cuda.core raises its own types with the NVRTC log in the message
        raise CompileError(f"NVRTC failed on {src} for {arch}:\n{e}") from e
    text = logs.getvalue().strip()
    if text:   # ptxas' remarks (e.g. C7515: wgmma serialised) stay beside the cubin (compile_log), written first
        _atomic_write(out.with_suffix(".log"), text.encode())
        (log.warning if WGMMA_SERIALIZED in text else log.debug)("NVRTC on %s for %s: %s", src.name, arch, text)
    _atomic_write(out, bytes(obj.code))
    log.info("compiled %s for %s -> %s", src.name, arch, out)
    return out


def compile_many(source: str | os.PathLike, options: list[CompileOptions], jobs: int | None = None, *,
                 keep_going: bool = False) -> list[Path | None]:
    """Compile many configurations of one source into the cache at once, ``jobs`` NVRTC compiles in parallel
    threads (default: the CPUs this process may use), one path per distinct configuration in order.
    Configurations already cached cost a file lookup. An NVRTC failure raises :class:`CompileError` naming the
    configuration (the compiles not yet started are cancelled); with ``keep_going`` it is logged and its path is
    None."""
    import concurrent.futures

    src = _source_path(source)
    arch = _resolve_arch(CompileOptions())
    todo = list(dict.fromkeys(options))
    jobs = max(1, min(jobs or len(os.sched_getaffinity(0)), len(todo)))
    from cuda.core import Program  # noqa: F401  (imported once here: a first import from several threads races)

    def named(o: CompileOptions, e: CompileError) -> CompileError:
        return CompileError(f"{e}\n(configuration: {' '.join(f'-D{k}={v}' for k, v in o.defines)})")

    out: list[Path | None] = []
    # threads: NVRTC's compile runs without the GIL
    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(compile_cubin, src, o, resolved_arch=arch) for o in todo]
        for o, f in zip(todo, futures):
            try:
                out.append(f.result())
            except CompileError as e:
                if not keep_going:
                    raise named(o, e) from e
                log.warning("%s", named(o, e))
                out.append(None)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out


# ptxas' remark when it inserts a wait after every wgmma (accumulators touched by other instructions inside the
# pipeline): a silent loss of 15-25 % in a GEMM main loop.
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def compile_log(cubin: str | os.PathLike) -> str:
    """NVRTC's log (ptxas remarks) of a cubin that :func:`compile_cubin` built; '' where it printed nothing."""
    path = Path(cubin).with_suffix(".log")
    return path.read_text() if path.is_file() else ""


_modules: dict = {}
_modules_lock = threading.Lock()


def load_module(source: str | os.PathLike, options: CompileOptions = CompileOptions()):
    """Compile (or fetch from the cache) and load a module; returns a ``cupy.RawModule``, one per source,
    options and arch in a process (every layer that asks for the same kernels shares it)."""
    import cupy

    key = (str(source), options, _resolve_arch(options))
    with _modules_lock:
        mod = _modules.get(key)
    if mod is None:
        mod = cupy.RawModule(path=str(compile_cubin(source, options)))
        with _modules_lock:
            mod = _modules.setdefault(key, mod)
    return mod


# --- NVSHMEM device-API path ---------------------------------------------------------------------

def _nvshmem_root() -> Path:
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        inc = find_nvidia_header_directory("nvshmem")
        if inc:
            return Path(inc).parent
    except Exception:
        pass
    import importlib.util

    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    raise CompileError("NVSHMEM headers not found: install nvidia-nvshmem-cu13 (a dependency of nvshmem4py-cu13)")


# Layouts of pip's nvcc: CUDA 13 wheels (nvidia-cuda-nvcc 13, via cuda-toolkit[nvcc]) install into
# nvidia/cu13/, CUDA 12 wheels into nvidia/cuda_nvcc/. nvcc.profile finds cicc and the headers relative
# to its own bin/, so the binary runs from there as is.
_PIP_NVCC_DIRS = ("nvidia/cu13/bin", "nvidia/cuda_nvcc/bin")
NVCC_REMEDY = ('pip install "cuda-toolkit[nvcc,cccl]==13.*" (fluxrt\'s "nvcc" extra), or put a CUDA toolkit\'s '
               'nvcc on PATH, or set CUDA_HOME')
# The NVSHMEM device headers include CCCL (<cuda/std/...>). pip's nvcc finds it in nvidia/cu13/include/cccl
# (nvcc.profile's -isystem), where the nvidia-cuda-cccl wheel puts it: cuda-toolkit[cccl], which
# nvidia-nvshmem-cu13 also pulls in.
_MISSING_HEADER_REMEDIES = (
    ("cuda/", 'CCCL headers (<cuda/std/...>) missing: pip install "cuda-toolkit[cccl]==13.*" (nvidia-cuda-cccl; '
              'part of fluxrt\'s "nvcc" extra), or use a CUDA toolkit\'s nvcc'),
    ("nvshmem", "NVSHMEM headers missing: pip install nvidia-nvshmem-cu13 (a dependency of nvshmem4py-cu13)"),
)


def missing_header_hint(stderr: str) -> str:
    """What to install when nvcc stopped on a missing header ("fatal error: cuda/std/cstdint: No such file")."""
    hints = []
    for m in re.finditer(r"fatal error: ([^\s:]+): No such file", stderr):
        for prefix, remedy in _MISSING_HEADER_REMEDIES:
            if m.group(1).startswith(prefix) and remedy not in hints:
                hints.append(remedy)
    return "\n".join(hints)


def _site_dirs() -> list[str]:
    """Where pip puts wheels for this interpreter: sys.path entries plus the site-packages dirs."""
    import site
    import sys

    dirs = list(sys.path)
    try:
        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # some embedded interpreters lack these
        pass
    return [d for d in dict.fromkeys(dirs) if d]


def _pip_nvcc(site_dirs: list[str] | None = None) -> str | None:
    for d in (_site_dirs() if site_dirs is None else site_dirs):
        for sub in _PIP_NVCC_DIRS:
            cand = Path(d) / sub / "nvcc"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def nvcc_path() -> str:
    """nvcc for the NVSHMEM device-API kernels: PATH, then $CUDA_HOME / $CUDA_PATH / /usr/local/cuda, then
    pip's nvcc wheel (a GPU node may have no CUDA toolkit), then cuda-pathfinder's search."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = Path(home) / "bin" / "nvcc"
    if cand.is_file():
        return str(cand)
    found = _pip_nvcc()
    if found:
        return found
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvcc")
    except Exception:  # cuda-pathfinder absent or older than its binary finder
        found = None
    if found:
        return found
    raise CompileError(f"nvcc not found (needed for kernels that call the NVSHMEM device API): {NVCC_REMEDY}")


def binary_utility(name: str) -> str | None:
    """A CUDA binary utility (``cuobjdump``, ``nvdisasm``) for inspecting cubins: PATH, then beside the nvcc that
    :func:`nvcc_path` finds, then pip's wheel (``cuda-toolkit[cuobjdump,nvdisasm]``, which the ``test`` extra
    installs) through cuda-pathfinder; None where none is found."""
    found = shutil.which(name)
    if found:
        return found
    try:
        beside = Path(nvcc_path()).resolve().parent / name
        if beside.is_file():
            return str(beside)
    except CompileError:
        pass
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        return find_nvidia_binary_utility(name)
    except Exception:  # cuda-pathfinder absent or older than its binary finder
        return None


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def _gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def compile_nvshmem_cubin(source: str | os.PathLike, options: CompileOptions = CompileOptions()) -> Path:
    """Relocatable nvcc compile + nvJitLink against libnvshmem_device.a; returns the linked cubin's path."""
    src = _source_path(source)
    arch = _resolve_arch(options)
    root = _nvshmem_root()
    lib = root / "lib" / "libnvshmem_device.a"
    if not lib.is_file():
        raise CompileError(f"{lib} not found: the NVSHMEM device library ships with nvidia-nvshmem-cu13")
    nvcc = nvcc_path()
    key = hashlib.sha256("|".join([_source_digest(src, options.include_dirs), options.key(), arch,
                                   _nvcc_version(nvcc), str(lib.stat().st_size)]).encode()).hexdigest()[:24]
    out = cache_dir() / f"{src.stem}-{arch}-nvshmem-{key}.cubin"
    if out.is_file():
        return out
    with _build_lock(out):
        if out.is_file():   # built by another process while this one waited
            return out
        _nvcc_link(src, arch, options, root, lib, nvcc, out)
    return out


def _nvcc_link(src: Path, arch: str, options: CompileOptions, root: Path, lib: Path, nvcc: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rdc = Path(tmp) / "rdc.cubin"
        cmd = [nvcc, _gencode(arch), "-rdc=true", "-cubin", f"-std={options.std}", "-DFLUXRT_WITH_NVSHMEM=1",
               f"-I{include_dir()}", f"-I{root / 'include'}",
               *[f"-I{d}" for d in options.include_dirs],
               *[f"-D{k}={v}" for k, v in options.defines], *options.extra_nvcc,
               "-o", str(rdc), str(src)]
        if options.max_registers:
            cmd.insert(1, f"-maxrregcount={options.max_registers}")
        if options.lineinfo:
            cmd.insert(1, "-lineinfo")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            hint = missing_header_hint(res.stderr)
            raise CompileError(f"nvcc failed on {src}:\n{' '.join(cmd)}\n{res.stderr}" + (f"\n{hint}" if hint else ""))
        from cuda.core import Linker, LinkerOptions, ObjectCode

        try:
            linker = Linker(ObjectCode.from_cubin(rdc.read_bytes()),
                            ObjectCode.from_library(lib.read_bytes()),
                            options=LinkerOptions(arch=arch))
            linked = linker.link("cubin")
        except Exception as e:
            raise CompileError(f"nvJitLink failed linking {src} with {lib}:\n{e}") from e
        _atomic_write(out, bytes(linked.code))
    log.info("compiled+linked %s (NVSHMEM) for %s -> %s", src.name, arch, out)


def load_nvshmem_module(source: str | os.PathLike, options: CompileOptions = CompileOptions()):
    """Load an NVSHMEM-API module and register it with the NVSHMEM runtime (world must be up)."""
    import cupy
    from nvshmem import bindings

    mod = cupy.RawModule(path=str(compile_nvshmem_cubin(source, options)))
    status = bindings.cumodule_init(mod.module.ptr)  # binds the module's nvshmemi_device_state
    if status not in (None, 0):
        raise CompileError(f"nvshmemx_cumodule_init failed ({status}) for {source}")
    return mod


# --- build everything (CI compile check, gpu-check warm-up) ------------------------------------------

def kernel_sources() -> list[Path]:
    """Every kernel translation unit under kernels/ (headers are compiled through them)."""
    return sorted(kernel_root().rglob("*.cu"))


def uses_nvshmem(source: Path) -> bool:
    """Convention: a source that calls the NVSHMEM device API is named nvshmem_*.cu."""
    return source.name.startswith("nvshmem_")


def build_all(options: CompileOptions = CompileOptions()) -> list[Path]:
    return [(compile_nvshmem_cubin if uses_nvshmem(src) else compile_cubin)(src, options)
            for src in kernel_sources()]


def main(argv=None) -> int:
    from .fatal import one_line_errors

    return one_line_errors("python -m fluxrt.toolchain")(_main)(argv)


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fluxrt.toolchain",
                                 description="Compile every kernel under kernels/ into the cache.")
    ap.add_argument("--arch", default=None, help="e.g. sm_90a (default: the current GPU's, or sm_90a)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in build_all(CompileOptions(arch=args.arch)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
