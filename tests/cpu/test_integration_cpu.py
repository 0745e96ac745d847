"""Features that must compose: the NVLink-only entries (allreduce+RMSNorm, MoE, the fused GEMM ops, the device
barrier) refuse a world of several nodes with a fluxrt error before anything is allocated or launched; the
hierarchical collectives refuse a CUDA graph capture; fluxrt.jax's errors are fluxrt errors. No GPU: worlds are
test doubles carrying a two-node topology."""
import types

import numpy as np
import pytest

import fluxrt
from fluxrt import errors, signals
from fluxrt.topology import Topology, require_one_domain


def _two_nodes(virtual: bool = False) -> Topology:
    every = tuple((True,) * 4 for _ in range(4))
    return Topology(rank=0, node_of=(0, 0, 1, 1), pointer=every, remote=(True,) * 4, remote_why=("",) * 4,
                    virtual=virtual)


def _world(topology):
    def nothing_else(*args, **kwargs):
        raise AssertionError("the op went past its topology check")

    return types.SimpleNamespace(topology=topology, rank=0, size=4, check_active=lambda: None,
                                 check_errors=lambda: None, comm=None, registry=None, device=None,
                                 empty=nothing_else, zeros=nothing_else, signal_pad=nothing_else)


@pytest.mark.parametrize("virtual", [False, True])
def test_require_one_domain_refuses_several_nodes_only(virtual):
    require_one_domain(_world(None), "op")
    require_one_domain(_world(fluxrt.topology.single()), "op")
    with pytest.raises(errors.CollectiveArgumentError, match="2 (virtual )?nodes.*ranks 2-3"):
        require_one_domain(_world(_two_nodes(virtual)), "op", errors.CollectiveArgumentError)


def test_allreduce_rmsnorm_on_several_nodes_raises_a_fluxrt_error():
    with pytest.raises(errors.CollectiveArgumentError, match="allreduce_rmsnorm.*nodes"):
        fluxrt.fused.allreduce_rmsnorm(_world(_two_nodes()), None, None, None)


def test_moe_on_several_nodes_raises_before_allocating():
    w = _world(_two_nodes())
    with pytest.raises(fluxrt.moe.MoEArgumentError, match="Dispatcher"):
        fluxrt.moe.Dispatcher(w, 8, 128, 16)
    with pytest.raises(fluxrt.moe.MoEArgumentError, match="MoELayer|moe_layer"):
        fluxrt.moe.MoELayer(w, 8, 128, 256, 16)


@pytest.mark.parametrize("cls", ["AllGatherGemm", "GemmReduceScatter", "TPMLP"])
def test_fused_gemm_ops_on_several_nodes_raise_before_allocating(cls):
    from fluxrt.ops.plan import OpsArgumentError

    with pytest.raises(OpsArgumentError, match="nodes"):
        getattr(fluxrt.ops, cls)(_world(_two_nodes()), 256, 256, 256)


def test_device_barrier_refuses_ranks_without_pointers():
    w = _world(_two_nodes())
    st = types.SimpleNamespace(barrier_unreachable=[2, 3])
    w.registry = types.SimpleNamespace(get_or_create=lambda key, make: st)
    with pytest.raises(errors.CollectiveArgumentError, match=r"barrier.*\[2, 3\]"):
        signals.barrier(w)


def test_hierarchical_calls_refuse_a_graph_capture():
    from fluxrt.collectives_hier import _not_capturing

    _not_capturing("allreduce", types.SimpleNamespace(is_capturing=lambda: False))
    with pytest.raises(errors.GraphCaptureError, match="allreduce across nodes"):
        _not_capturing("allreduce", types.SimpleNamespace(is_capturing=lambda: True))


def test_jax_reduce_scatter_shape_error_is_a_fluxrt_error():
    import fluxrt.jax as fj

    w = types.SimpleNamespace(size=4)
    with pytest.raises(errors.CollectiveArgumentError):
        fj.reduce_scatter(np.zeros((6, 2), np.float32), world=w)


def test_public_names_exist_and_every_error_is_a_fluxrt_error():
    import inspect

    import fluxrt.compressed  # noqa: F401
    import fluxrt.gemm
    import fluxrt.ops.plan

    for name in fluxrt.__all__:
        assert hasattr(fluxrt, name), name
    assert issubclass(fluxrt.TopologyError, fluxrt.FluxrtError)
    for mod in (fluxrt.errors, fluxrt.topology, fluxrt.moe, fluxrt.ops.plan, fluxrt.gemm, fluxrt.registry):
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__.startswith("fluxrt"):
                assert issubclass(obj, fluxrt.FluxrtError), f"{mod.__name__}.{name}"


def test_prepare_on_several_nodes_checks_the_rail_reductions_and_passes_the_options(monkeypatch):
    from fluxrt import collectives, collectives_hier

    made = []

    class Recorder:
        def __init__(self, world, options=None):
            made.append(options)
            self.checked = []

        prepare = collectives_hier.HierarchicalCollectives.prepare

    monkeypatch.setattr(collectives_hier, "HierarchicalCollectives", Recorder)
    w = _world(_two_nodes())
    w.registry = fluxrt.registry.Registry()
    opts = collectives.CollectivesOptions(workspace_bytes=1 << 20)
    ctx = collectives.prepare(w, dtypes=("bf16", "fp32"), ops=("sum", "max"), options=opts)
    assert isinstance(ctx, Recorder) and made[0].node is opts
    for dtype, op in (("float64", "sum"), ("int32", "sum"), ("bf16", "avg"), ("fp32", "prod")):
        with pytest.raises(errors.CollectiveArgumentError, match="across nodes"):
            ctx.prepare((dtype,), (op,))


def test_fluxrt_perf_times_the_hierarchical_path_on_several_nodes(monkeypatch):
    from fluxrt import collectives_hier
    from fluxrt.perf import collectives as perf

    made = []

    class Recorder:
        def __init__(self, world, options=None):
            made.append(options)

    monkeypatch.setattr(collectives_hier, "HierarchicalCollectives", Recorder)
    r = perf.FluxrtRunner(_world(_two_nodes(virtual=True)), "allreduce", "auto", "sum", 0, 1 << 20, False)
    assert isinstance(r.ctx, Recorder) and made[0].node.workspace_bytes == 1 << 20
    assert r.algo_name(None) == "hierarchical"


def test_jax_command_buffer_on_several_nodes_raises_at_trace(monkeypatch):
    import fluxrt.jax as fj
    from fluxrt import collectives

    monkeypatch.setattr(fj, "_api", lambda: (None, None))
    monkeypatch.setattr(collectives, "prepare", lambda world, dtypes=(), ops=(): object())   # not a Collectives
    x = types.SimpleNamespace(shape=(8,), ndim=1, dtype=np.float32)
    with pytest.raises(errors.GraphCaptureError, match="several nodes"):
        fj.allreduce(x, world=_world(_two_nodes()), command_buffer=True)


def test_allreduce_rmsnorm_refuses_a_context_without_fused_kernels():
    from fluxrt.collectives_hier import HierarchicalCollectives

    ctx = HierarchicalCollectives.__new__(HierarchicalCollectives)
    with pytest.raises(errors.CollectiveArgumentError, match="ctx must be a fluxrt.Collectives"):
        fluxrt.fused.allreduce_rmsnorm(_world(None), None, None, None, ctx=ctx)


def test_gpu_scripts_name_only_public_names_that_exist():
    """The scripts GPU tests start in subprocesses (tests/gpu/mpi_scripts, examples) fail only on a GPU node when
    they name a fluxrt attribute that does not exist: every ``fluxrt.<name>`` / ``fluxrt.<module>.<name>`` they
    use, and every ``from fluxrt... import name``, must resolve here."""
    import ast
    import importlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    scripts = sorted((root / "tests" / "gpu" / "mpi_scripts").glob("*.py")) + sorted((root / "examples").glob("*.py"))
    assert scripts
    missing = []
    for path in scripts:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fluxrt":
                if node.module == "fluxrt.jax":
                    continue   # needs JAX
                mod = importlib.import_module(node.module)
                missing += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                            if not hasattr(mod, a.name) and not _is_module(f"{node.module}.{a.name}")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fluxrt":
                if not hasattr(importlib.import_module("fluxrt"), node.attr) and not _is_module(f"fluxrt.{node.attr}"):
                    missing.append(f"{path.name}: fluxrt.{node.attr}")
    assert not missing, missing


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
