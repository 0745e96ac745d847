"""Embedding fluxrt in other codes, without a GPU: the sub-world pool's offset agreement, async handles'
host waits, and the refusals that keep a CUDA graph capture intact."""
from types import SimpleNamespace

import numpy as np
import pytest

import fluxrt
from fluxrt import collectives as coll
from fluxrt import collectives_plan as plan
from fluxrt.symmetric import SubworldPool, common_fit


# ---------------------------------------------------------------------------------------------- sub-world pool
def test_common_fit_is_the_lowest_range_free_on_every_rank():
    assert common_fit([[(0, 100)]], 100) == 0
    assert common_fit([[(0, 100)]], 101) is None
    # rank 0 uses [0, 40), rank 1 uses [30, 60): the first common gap of 20 starts at 60
    assert common_fit([[(40, 100)], [(0, 30), (60, 100)]], 20) == 60
    assert common_fit([[(40, 100)], [(0, 30), (60, 100)]], 41) is None
    # a gap that exists on each rank at different places is no common gap
    assert common_fit([[(0, 10), (50, 60)], [(10, 50)]], 5) is None
    assert common_fit([[(0, 64), (128, 512)], [(32, 256)], [(0, 512)]], 64) == 128


def _pool(nbytes=4096):
    arr = SimpleNamespace(_allocation=lambda: SimpleNamespace(base=1 << 20, nbytes=nbytes, peer_bases=[1 << 20, 2 << 20]))
    return SubworldPool(arr)


def test_pool_ranges_follow_takes_and_give_backs():
    p = _pool()
    assert p.free_ranges() == [(0, 4096)]
    p.take(0, 512)
    p.take(1024, 512)
    assert p.free_ranges() == [(512, 1024), (1536, 4096)] and p.used == 1024
    p.give_back(0)
    assert p.free_ranges() == [(0, 1024), (1536, 4096)]


def test_a_subworld_heap_counts_what_every_subworld_holds_in_the_shared_pool():
    """capacity - used is what this rank still has: a TP and a DP world on one pool see each other's bytes
    (a size check made on one of them, as the MoE Dispatcher's, must not pass when the pool is full)."""
    from fluxrt.symmetric import SubworldHeap

    p = _pool()
    tp, dp = SubworldHeap(SimpleNamespace(rank=0), p), SubworldHeap(SimpleNamespace(rank=0), p)
    assert tp.capacity == dp.capacity == 4096 and tp.used == dp.used == 0
    p.take(0, 3072)   # the DP world's allocation on this rank
    assert tp.used == dp.used == 3072 and tp.capacity - tp.used == 1024
    assert tp.own_used == 0


def test_overlapping_worlds_never_share_a_range_on_a_common_rank():
    """Four processes, TP groups {0,1} {2,3} and DP groups {0,2} {1,3}, allocating in turn: every range a
    world takes is free on all of its members, so no process holds two overlapping ranges."""
    pools = [_pool(1 << 16) for _ in range(4)]
    groups = [(0, 1), (2, 3), (0, 2), (1, 3)]
    held = {r: [] for r in range(4)}
    rng = np.random.default_rng(0)
    for step in range(40):
        g = groups[step % 4]
        size = int(rng.integers(1, 8)) * 512
        off = common_fit([pools[r].free_ranges() for r in g], size)
        assert off is not None
        for r in g:
            pools[r].take(off, size)
            held[r].append((off, off + size))
        if step % 5 == 4:  # a world frees its oldest range on all members
            r0 = g[0]
            lo, hi = held[r0][0]
            for r in g:
                if (lo, hi) in held[r]:
                    held[r].remove((lo, hi))
                    pools[r].give_back(lo)
    for r in range(4):
        spans = sorted(held[r])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"process {r} holds overlapping ranges"


def test_world_options_reserve_a_subworld_pool_by_name():
    assert fluxrt.WorldOptions(subworld_heap="1G").subworld_heap == "1G"
    assert fluxrt.WorldOptions().subworld_heap is None


# ---------------------------------------------------------------------------------------------- handles
class _Event:
    def __init__(self, done):
        self.done, self.synced = done, 0

    def synchronize(self):
        self.synced += 1
        self.done = True


def _handle(done, errors=None):
    world = SimpleNamespace(check_errors=lambda: errors and (_ for _ in ()).throw(errors))
    return coll.CollectiveHandle(world, _Event(done), "result", ("keep",))


def test_handles_test_and_wait_on_the_host():
    h = _handle(False)
    assert h.test() is False and h.is_done() is False
    assert h.wait(host=True) == "result" and h._event.synced == 1 and h._keep is None
    assert h.test() is True
    hs = [_handle(False), None, _handle(True)]
    assert fluxrt.wait_all(hs, host=True) == ["result", None, "result"]
    assert hs[0]._event.synced == 1


def test_a_host_wait_raises_the_recorded_device_timeout():
    err = fluxrt.WaitTimeoutError("allreduce", 0, 1, 5, 4)
    with pytest.raises(fluxrt.WaitTimeoutError, match="peer 1"):
        _handle(False, err).wait(host=True)


# ---------------------------------------------------------------------------------------------- graph capture
class _Stream:
    def __init__(self, capturing):
        self.capturing, self.ptr = capturing, 1

    def is_capturing(self):
        return self.capturing


def test_a_first_call_inside_a_capture_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(coll, "as_cupy_stream", lambda s: s)
    made = []
    monkeypatch.setattr(coll, "Collectives", lambda *a, **k: made.append(a))
    world = SimpleNamespace(registry={}, make_current=lambda: None)
    with pytest.raises(fluxrt.GraphCaptureError, match="fluxrt.prepare"):
        coll.context(world, _Stream(True))
    assert not made
    coll.context(world, _Stream(False))
    assert made


def test_extension_kernels_are_refused_inside_a_capture_unless_prepared(monkeypatch):
    c = object.__new__(coll.Collectives)
    c._ext_modules, c._capturing_stream = {}, _Stream(True)
    with pytest.raises(fluxrt.GraphCaptureError, match="'fp64'"):
        c._check_loaded("fp64", "sum")
    c._check_loaded("bf16", "sum")            # base module: nothing to load
    with pytest.raises(fluxrt.GraphCaptureError):
        c._check_loaded("fp32", "avg")        # the division kernel lives in fp32's extension module
    c._ext_modules[coll.EXT_CODES["fp64"]] = "loaded"
    c._check_loaded("fp64", "prod")


def test_first_call_of_an_extension_module_agrees_with_the_load_wait(monkeypatch):
    monkeypatch.setenv("FLUXRT_LOAD_WAIT_S", "120")
    c = object.__new__(coll.Collectives)
    c.world, c._ext_met = SimpleNamespace(options=SimpleNamespace(timeout_s=5.0)), set()
    got = lambda dt, red: ("a", "o", dt, red)   # noqa: E731 (the checks' result: dtype and reduction at 2, 3)
    assert c._agree_bound(got("fp64", "sum"), 2) == 120.0   # a peer may still be compiling fp64's module
    assert c._agree_bound(got("fp32", "avg"), 2) == 120.0   # avg's division is in fp32's extension module
    assert c._agree_bound(got("bf16", "sum"), 2) is None    # the base module, loaded with the context
    assert c._agree_bound(None, 2) == 120.0   # this rank's checks failed: its peers may be compiling
    c._ext_met.add(coll.EXT_CODES["fp64"])
    assert c._agree_bound(got("fp64", "sum"), 2) is None    # met once: the world's timeout again


def test_kernel_module_routing():
    assert coll.kernel_module_code("fluxrt_allreduce_ll_bf16_sum") is None
    assert coll.kernel_module_code("fluxrt_allreduce_ring_fp32_max") is None
    assert coll.kernel_module_code("fluxrt_allreduce_ll_bf16_prod") == coll.EXT_CODES["bf16"]
    assert coll.kernel_module_code("fluxrt_reduce_scatter_pipe_fp64_sum") == coll.EXT_CODES["fp64"]
    assert coll.kernel_module_code("fluxrt_divide_fp16") == coll.EXT_CODES["fp16"]
    assert coll.kernel_module_code("fluxrt_exchange_pipe") is None
    assert coll.kernel_module_code("fluxrt_allgather_ring") is None


def test_ll12_only_for_elements_that_divide_its_line():
    assert plan.ll12_fits(2) and plan.ll12_fits(4) and plan.ll12_fits(1) and not plan.ll12_fits(8)
    t = plan.DEFAULT_TUNING
    mid = (t.ll12_twoshot_min_bytes + t.ll12_twoshot_max_bytes) // 2
    assert plan.choose_algo("allreduce", mid, 4, itemsize=2) == "ll12_twoshot"
    assert plan.choose_algo("allreduce", mid, 4, itemsize=8) not in plan.LL_ALGOS[1:]
    assert plan.choose_algo("allreduce", t.ll12_min_bytes, 4, itemsize=8) == "ll"
    with pytest.raises(ValueError, match="12-byte line"):
        plan.choose_algo("allreduce", 4096, 4, algo="ll12_twoshot", itemsize=8)


# ---------------------------------------------------------------------------------------------- XLA's buffers
def test_xla_ffi_buffers_are_mutable_and_read_through_their_cai():
    """jax.experimental.buffer_callback hands XLA's device buffers (jaxlib's FFI Buffer) to the callback: an
    output is written in place, so it is not refused as an immutable JAX array, and it is viewed through its
    __cuda_array_interface__ (no DLPack stream handshake inside XLA's execution)."""
    from fluxrt import arrays

    Buffer = type("Buffer", (), {
        "__module__": "jaxlib._jax",
        "__cuda_array_interface__": property(lambda self: {"shape": (4,), "typestr": "<f4", "data": (1 << 20, False),
                                                          "version": 2, "strides": None}),
        "__dlpack__": lambda self, stream=None: None,
        "dtype": np.dtype(np.float32)})
    info = arrays.inspect(Buffer(), name="out", op="allreduce")
    assert not info.readonly and info.protocol == "cai"
    arrays.check_writable(info, "allreduce")
    Array = type("ArrayImpl", (), {"__module__": "jaxlib._jax", "__dlpack__": lambda self, stream=None: None,
                                   "__dlpack_device__": lambda self: (2, 0), "shape": (4,),
                                   "dtype": np.dtype(np.float32)})
    with pytest.raises(fluxrt.errors.ArrayArgumentError, match="immutable JAX array"):
        arrays.check_writable(arrays.inspect(Array(), name="out", op="allreduce"), "allreduce")


# ---------------------------------------------------------------------------------------------- fused ops in jax.jit
class _FakeOp:
    """Records what fluxrt.jax.TPOps makes and calls (a fused op's constructor and forward)."""

    made: list = []

    def __init__(self, world, *args, **kw):
        self.args, self.kw, self.calls, self.freed = args, kw, [], False
        _FakeOp.made.append(self)

    def forward(self, *args, out=None, stream=None, path=None):
        self.calls.append((args, out, stream, path))
        return out

    def free(self):
        self.freed = True

    def path_choice(self, m, stream=None, path=None):
        return SimpleNamespace(path=path or "fused")


@pytest.fixture
def tpops(monkeypatch):
    """A TPOps on a 2-rank fake world whose ops, warm-up and XLA custom call are recorded, not run."""
    import fluxrt.jax as fj
    from fluxrt import ops

    _FakeOp.made = []
    for name in ("AllGatherGemm", "GemmReduceScatter", "TPMLP"):
        monkeypatch.setattr(ops, name, type(name, (_FakeOp,), {}))
    customs, warmed = [], []

    def buffer_call(name, inputs, out_shape, dtype, command_buffer, run, on_call=None):
        customs.append(SimpleNamespace(name=name, inputs=inputs, out_shape=out_shape, dtype=dtype,
                                       command_buffer=command_buffer, run=run, on_call=on_call))
        return SimpleNamespace(shape=tuple(out_shape), dtype=dtype)

    monkeypatch.setattr(fj, "_buffer_call", buffer_call)
    monkeypatch.setattr(fj.TPOps, "_warm_up", lambda self, op, key, path: warmed.append((key, path)))
    tp = fj.TPOps(SimpleNamespace(size=2, rank=0, device_id=0))
    return tp, customs, warmed


def _arr(*shape, dtype=fluxrt.bfloat16):
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


def test_tpops_make_one_op_per_shape_and_call_its_forward(tpops):
    tp, customs, warmed = tpops
    y = tp.ag_gemm(_arr(64, 256), _arr(256, 384))
    assert y.shape == (128, 384) and customs[-1].name == "ag_gemm" and not customs[-1].command_buffer
    (op,) = _FakeOp.made
    assert type(op).__name__ == "AllGatherGemm" and op.args == (128, 384, 256, "bfloat16") and op.kw == {"trans_b": False}
    assert warmed == [(("ag_gemm", 128, 384, 256, "bfloat16", False), None)]
    tp.ag_gemm(_arr(64, 256), _arr(256, 384))              # a second trace of the same shape: the same op
    assert len(_FakeOp.made) == 1 and len(warmed) == 1 and len(customs) == 2
    customs[-1].run(7, "out", "a", "b")                      # XLA's stream, its output buffer, the inputs
    assert op.calls == [(("a", "b"), "out", 7, None)]
    y = tp.ag_gemm(_arr(32, 256), _arr(384, 256), trans_b=True)   # another M and layout: another op
    assert y.shape == (64, 384) and len(_FakeOp.made) == 2 and _FakeOp.made[1].kw == {"trans_b": True}
    y = tp.gemm_rs(_arr(256, 192), _arr(192, 512), path="fused")
    assert y.shape == (128, 512) and _FakeOp.made[2].args == (256, 512, 192, "bfloat16")
    customs[-1].run(7, "o", "a", "w")
    assert _FakeOp.made[2].calls[0][3] == "fused" and warmed[-1][1] == "fused"
    y = tp.mlp(_arr(64, 256, dtype=np.float16), _arr(256, 384, dtype=np.float16), _arr(192, 256, dtype=np.float16))
    assert y.shape == (64, 256) and type(_FakeOp.made[3]).__name__ == "TPMLP"
    assert _FakeOp.made[3].args == (128, 256, 192, "float16")
    assert [k[0] for k in tp.ops] == ["ag_gemm", "ag_gemm", "gemm_rs", "mlp"]
    _FakeOp.made[3].ag = _FakeOp.made[3].rs = _FakeOp.made[0]   # the block's two ops
    paths = tp.paths()
    assert paths[(("gemm_rs", 256, 512, 192, "bfloat16", False), "fused")] == "fused"
    assert paths[(("mlp", 128, 256, 192, "float16", False), None)] == "fused/fused"
    tp.free()
    assert all(op.freed for op in _FakeOp.made) and not tp.ops


def test_tpops_in_a_command_buffer_take_the_decomposed_path(tpops):
    import fluxrt.jax as fj

    tp, customs, warmed = tpops
    tp.gemm_rs(_arr(256, 192), _arr(192, 512), command_buffer=True)
    assert customs[-1].command_buffer and warmed[-1][1] == "decomposed"
    customs[-1].run(5, "o", "a", "w")
    assert _FakeOp.made[0].calls[0][3] == "decomposed"
    with pytest.raises(fluxrt.GraphCaptureError, match="cannot be replayed"):
        tp.mlp(_arr(64, 256), _arr(256, 384), _arr(192, 256), path="fused", command_buffer=True)
    assert len(_FakeOp.made) == 1   # refused before an op was made
    cb = fj.TPOps(tp.world, command_buffer=True)
    cb.ag_gemm(_arr(64, 256), _arr(256, 384))
    assert customs[-1].command_buffer


def test_tpops_count_the_callbacks_that_ran_in_a_capture(tpops, monkeypatch):
    import fluxrt.jax as fj

    tp, customs, _ = tpops
    monkeypatch.setattr(fj, "as_cupy_stream", lambda s: SimpleNamespace(is_capturing=lambda: s == "capturing"))
    tp.ag_gemm(_arr(64, 256), _arr(256, 384))
    customs[-1].on_call("plain")
    customs[-1].on_call("capturing")
    assert (tp.calls, tp.captured) == (2, 1)


@pytest.mark.parametrize("call, match", [
    (lambda tp: tp.ag_gemm(_arr(64, 256), _arr(192, 384)), "K=192"),
    (lambda tp: tp.ag_gemm(_arr(64, 256), _arr(256, 384, dtype=np.float32)), "bf16 or all fp16"),
    (lambda tp: tp.ag_gemm(_arr(64, 256, dtype=np.float16), _arr(256, 384)), "bf16 or all fp16"),
    (lambda tp: tp.ag_gemm(_arr(64), _arr(256, 384)), "2-D"),
    (lambda tp: tp.gemm_rs(_arr(255, 192), _arr(192, 512)), "split into 2 ranks"),
    (lambda tp: tp.gemm_rs(_arr(256, 192), _arr(192, 512), path="fast"), "path='fast'"),
    (lambda tp: tp.mlp(_arr(64, 256), _arr(256, 385), _arr(192, 256)), "gate and up"),
    (lambda tp: tp.mlp(_arr(64, 256), _arr(256, 384), _arr(192, 128)), "back to hidden=256"),
    (lambda tp: tp.mlp(_arr(64, 256), _arr(384, 256), _arr(128, 192), trans_b=True), "back to hidden"),
])
def test_tpops_refuse_bad_inputs_before_making_an_op(tpops, call, match):
    tp, customs, warmed = tpops
    with pytest.raises(fluxrt.ops.OpsArgumentError, match=match):
        call(tp)
    assert not _FakeOp.made and not customs and not warmed


def test_jax_device_is_the_worlds_gpu(monkeypatch):
    import fluxrt.jax as fj

    devs = [SimpleNamespace(id=i, local_hardware_id=i) for i in range(4)]
    fake = SimpleNamespace(local_devices=lambda backend=None: devs)
    monkeypatch.setattr(fj, "_api", lambda: (fake, None))
    assert fj.device(SimpleNamespace(device_id=2)) is devs[2]
    with pytest.raises(RuntimeError, match="CUDA ordinal 7"):
        fj.device(SimpleNamespace(device_id=7))


def test_jax_mlp_bench_times_rounds_and_rejects_bad_flags(capsys):
    from fluxrt.perf import cli, jax_mlp

    assert cli.BENCHES["jax_mlp"] == "fluxrt.perf.jax_mlp" and "jax_mlp" in cli.SUMMARIES
    waits = []
    comm = SimpleNamespace(Barrier=lambda: None, allgather=lambda v: [v, 3 * v])
    world = SimpleNamespace(comm=comm, check_errors=lambda: None)
    steps = {"a": (lambda: "out", waits.append)}
    t = jax_mlp.time_rounds(world, steps, iters=4, rounds=3, warmup=2, average=3)   # -a 3: the slowest rank
    assert waits == ["out"] * 4 and t["a"] > 0   # one wait after the warm-up, one per round
    assert jax_mlp.main(["--variants", "jit,bogus"]) == 2 and "bogus" in capsys.readouterr().err
    assert jax_mlp.main(["-d", "fp32"]) == 2
    lines = jax_mlp.format_table([{"m": 8, "hidden": 16, "ffn": 32, "jit_ms": 1.0, "eager_ms": 2.0,
                                   "eager_over_jit": 2.0, "captured": 0, "paths": "ag_gemm:fused"}])
    assert "N/A" in lines[1] and "2.000" in lines[1] and "ag_gemm:fused" in lines[1]
