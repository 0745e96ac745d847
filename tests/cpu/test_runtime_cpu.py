"""World, symmetric-memory and error plumbing that needs no GPU: what a CPU-only node must report."""
import numpy as np
import pytest

import fluxrt
from fluxrt import errors, streams, symmetric
from fluxrt.dtypes import normalize_dtype, short_name


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the no-GPU error path cannot be reached")
def test_init_without_gpu_raises_device_error_before_nvshmem():
    with pytest.raises(fluxrt.DeviceError, match="rank 0: no CUDA GPU"):
        fluxrt.init()
    with pytest.raises(fluxrt.NvshmemInitError, match="no active fluxrt world"):
        fluxrt.current()


def test_init_rejects_non_communicators():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        fluxrt.init(comm="COMM_WORLD")


def test_world_options_defaults_and_env(monkeypatch):
    monkeypatch.setenv("FLUXRT_TIMEOUT_S", "2.5")
    opts = fluxrt.WorldOptions()
    assert opts.timeout_s == 2.5 and opts.check_collective_args and opts.heap_size is None


@pytest.mark.parametrize("text, expected", [("1073741824", 1 << 30), ("512M", 512 << 20), ("4G", 4 << 30),
                                            ("2GiB", 2 << 30), ("64k", 64 << 10), (123, 123)])
def test_heap_sizes_parse_like_nvshmem(text, expected):
    assert symmetric.parse_bytes(text) == expected


def test_bad_heap_size_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot read"):
        symmetric.parse_bytes("lots")


def test_heap_capacity_follows_nvshmem_env(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert symmetric.heap_capacity() == symmetric.DEFAULT_HEAP_BYTES
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "3G")
    assert symmetric.heap_capacity() == 3 << 30


def test_dtypes_bf16_is_ml_dtypes_and_names_normalize():
    import ml_dtypes

    assert fluxrt.bfloat16 == np.dtype(ml_dtypes.bfloat16)
    assert normalize_dtype("bf16") == normalize_dtype("bfloat16") == fluxrt.bfloat16
    assert normalize_dtype("half") == np.float16 and normalize_dtype(np.int32) == np.int32
    assert short_name("bfloat16") == "bf16" and short_name(np.float32) == "fp32"
    with pytest.raises(TypeError, match="unsupported dtype"):
        normalize_dtype("float7")


def test_error_record_decodes_to_wait_timeout_naming_op_rank_peer():
    op = errors.op_id("allgather.wait_chunk")
    assert errors.op_id("allgather.wait_chunk") == op  # stable
    words = np.array([errors.STATUS_TIMEOUT, op, 3, 1, 42, 41], dtype=np.uint64)
    err = errors.decode_error_record(words)
    assert isinstance(err, fluxrt.WaitTimeoutError) and isinstance(err, TimeoutError)
    assert (err.op, err.rank, err.peer, err.expected, err.observed) == ("allgather.wait_chunk", 3, 1, 42, 41)
    assert "rank 3" in str(err) and "peer 1" in str(err) and "allgather.wait_chunk" in str(err)
    words[3] = errors.NO_PEER
    assert errors.decode_error_record(words).peer is None
    words[0] = errors.STATUS_WRITING
    assert errors.decode_error_record(words) is None
    assert errors.decode_error_record(np.zeros(errors.ERROR_RECORD_WORDS, np.uint64)) is None


def test_error_record_layout_matches_the_device_header():
    from fluxrt.toolchain import include_dir

    header = (include_dir() / "fluxrt" / "sync.cuh").read_text()
    struct = header[header.index("struct ErrorRecord"):header.index("};", header.index("struct ErrorRecord"))]
    assert struct.count("u64 ") == errors.ERROR_RECORD_WORDS


def test_stream_handles_from_every_accepted_kind():
    class Proto:
        def __cuda_stream__(self):
            return (0, 0x1234)

    assert streams.stream_handle(77) == 77
    assert streams.stream_handle(Proto()) == 0x1234
    with pytest.raises(TypeError, match="cannot use str as a CUDA stream"):
        streams.stream_handle("stream")


# --- per-world state ---------------------------------------------------------------------------------
def test_registry_makes_state_once_and_tears_it_down_newest_first(caplog):
    from fluxrt.registry import Registry, RegistryClosedError

    reg, made, torn = Registry(), [], []

    def factory(name):
        made.append(name)
        return name.upper()

    assert reg.get_or_create("signals", lambda: factory("signals"), torn.append) == "SIGNALS"
    assert reg.get_or_create("signals", lambda: factory("again")) == "SIGNALS"
    reg.get_or_create("p2p", lambda: factory("p2p"))                     # no teardown
    reg.put("collectives", "COLL", teardown=torn.append)
    reg.get_or_create("ops", lambda: factory("ops"), lambda v: 1 / 0)   # a failing teardown
    reg.put("gone", "GONE", teardown=torn.append)
    assert reg.pop("gone") == "GONE" and "gone" not in reg           # released by its owner: no teardown
    with pytest.raises(KeyError, match="exists already"):
        reg.put("collectives", "other")
    assert made == ["signals", "p2p", "ops"] and len(reg) == 4
    reg.close()
    assert torn == ["COLL", "SIGNALS"] and len(reg) == 0 and reg.closed
    assert "teardown of world state 'ops' failed" in caplog.text
    with pytest.raises(RegistryClosedError, match="finalized"):
        reg.get_or_create("p2p", lambda: factory("late"))
    assert isinstance(RegistryClosedError("x"), fluxrt.FluxrtError)


def test_a_constructor_that_registers_itself_is_kept():
    from fluxrt.registry import Registry

    reg = Registry()

    class Context:   # as fluxrt.Collectives: the first one made becomes the world's default
        def __init__(self):
            reg.put("ctx", self, teardown=lambda c: None)

    first = reg.get_or_create("ctx", Context)
    assert reg.get("ctx") is first and reg.get_or_create("ctx", Context) is first


# --- layering ----------------------------------------------------------------------------------------
_LOAD_ALONE = """
import importlib, pathlib, sys, types
pkg = types.ModuleType("fluxrt")
pkg.__path__ = [str(pathlib.Path.cwd() / "fluxrt")]
sys.modules["fluxrt"] = pkg   # the package's own __init__ imports everything; load the module by itself
importlib.import_module(sys.argv[1])
print(" ".join(sorted(m for m in sys.modules if m.startswith("fluxrt."))))
"""
_ABOVE_THE_RUNTIME = {"fluxrt.collectives", "fluxrt.collectives_plan", "fluxrt.p2p", "fluxrt.ops", "fluxrt.gemm",
                      "fluxrt.agreement", "fluxrt.perf", "fluxrt.fused", "fluxrt.compressed", "fluxrt.moe"}


@pytest.mark.parametrize("module, forbidden", [
    ("fluxrt.world", _ABOVE_THE_RUNTIME),
    ("fluxrt.signals", _ABOVE_THE_RUNTIME | {"fluxrt.world"}),
    ("fluxrt.arrays", _ABOVE_THE_RUNTIME | {"fluxrt.world", "fluxrt.signals", "fluxrt.streams"}),
    ("fluxrt.registry", _ABOVE_THE_RUNTIME | {"fluxrt.world", "fluxrt.signals", "fluxrt.arrays"}),
    ("fluxrt.p2p", _ABOVE_THE_RUNTIME - {"fluxrt.p2p"} | {"fluxrt.world"}),
])
def test_runtime_modules_import_nothing_above_them(module, forbidden):
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _LOAD_ALONE, module], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split()) | _imported_anywhere(root, module)   # deferred imports in functions too
    assert module in loaded
    above = {m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)}
    assert not above, f"{module} imports {sorted(above)}"


def _imported_anywhere(root, module: str) -> set[str]:
    """The fluxrt modules `module` imports in any function, except under ``if TYPE_CHECKING:``."""
    import ast

    tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = {module}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in typing_only:
            found |= {f"fluxrt.{node.module}"} if node.module else {f"fluxrt.{a.name}" for a in node.names}
    return found


def test_no_module_reaches_into_the_world():
    """Layers keep their state in world.registry, not in private attributes set on or read from the world."""
    import pathlib
    import re

    pattern = re.compile(r"\bworld\._[a-z]|setattr\(\s*(self\.)?world\b")
    root = pathlib.Path(fluxrt.__file__).parent
    offenders = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "world.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders


def test_sub_world_teardown_barrier_is_bounded():
    """The sub-world finalize's barrier gives up after the world's timeout instead of blocking in MPI."""
    import types

    from fluxrt.world import _bounded_barrier

    done = types.SimpleNamespace(Ibarrier=lambda: types.SimpleNamespace(Test=lambda: True))
    never = types.SimpleNamespace(Ibarrier=lambda: types.SimpleNamespace(Test=lambda: False))
    assert _bounded_barrier(done, 0.01) is True
    assert _bounded_barrier(never, 0.01) is False
