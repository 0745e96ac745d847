"""GPU tests of what codes that embed fluxrt need (mpirun -n 2|4 python -m pytest tests/gpu/test_embedding.py):
fp64 and integer reductions with prod and avg against numpy, sub-worlds (a TP x DP layout of 2 x 2 on 4 ranks,
a second fluxrt.init), the first call of a world inside a CUDA graph capture, host waits on async handles,
arrays of other producers when they are installed (numba, torch, JAX), and the collectives and fused ops
inside jax.jit (fluxrt.jax).

Every rank runs the same tests in the same order; inputs differ per rank and the references gather them to
the host over MPI. Outputs are poisoned before each call."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multirank

SUB_WS = 32 << 20   # a sub-world's collectives workspace: several contexts share the sub-world pool
WIDE = {"fp64": np.float64, "fp32": np.float32, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


def _np(dtype: str):
    import fluxrt

    return WIDE.get(dtype) or fluxrt.normalize_dtype(dtype)


def _data(seed: int, rank: int, count: int, dtype: str, op: str):
    """Per-rank random input on the device: sums of integers that wrap (int32, uint8 full range; int64 near
    its limits), products of small integers and of floats near 1, uniform [-1, 1) floats otherwise."""
    import cupy

    rng = np.random.default_rng(seed * 1009 + rank)
    d = np.dtype(_np(dtype))
    if d.kind in "iu":
        if op == "prod":
            v = rng.integers(0 if d.kind == "u" else -5, 6, count)
        elif d.itemsize < 8:   # the whole range: sums wrap
            v = rng.integers(np.iinfo(d).min, np.iinfo(d).max, count, dtype=np.int64, endpoint=True)
        else:                  # +-2^62: sums of 4 ranks may wrap
            v = rng.integers(np.iinfo(np.int64).min // 2, np.iinfo(np.int64).max // 2, count)
        return cupy.asarray(v.astype(d))
    lo, hi = (0.5, 1.5) if op == "prod" else (-1.0, 1.0)
    return cupy.asarray(rng.uniform(lo, hi, count).astype(d))


def _poisoned(count: int, dtype: str):
    import cupy

    d = np.dtype(_np(dtype))
    out = cupy.empty(count, dtype=d)
    out.fill(np.array(-77).astype(d) if d.kind in "iu" else np.nan)
    return out


def _allgather(world, payload, what: str) -> list:
    """Every rank's payload through fluxrt's bounded exchange rather than a bare MPI allgather: a rank that
    left a test early (a failed check, an exception) makes the others fail with an error naming the ranks
    and calls, instead of blocking in MPI or pairing with the next test's exchange."""
    from fluxrt import agreement

    return agreement.exchange(world, f"test_embedding {what}", payload)


def _gather(world, x) -> list[np.ndarray]:
    import cupy

    return [a.reshape(-1) for a in _allgather(world, cupy.asnumpy(x), "inputs")]


def _check(got, inputs: list[np.ndarray], op: str, dtype: str, what: str) -> None:
    """Integers: exact, wrapping as two's complement (the reference folds in the element type, as numpy
    arrays wrap). Floats: within n eps of the sum of magnitudes (fp32 accumulation for 16/32-bit, fp64 for
    fp64), max/min exact."""
    import cupy

    got = cupy.asnumpy(got).reshape(-1)
    d = np.dtype(_np(dtype))
    n = len(inputs)
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    if d.kind in "iu":
        ref = inputs[0].copy()
        with np.errstate(over="ignore"):
            for a in inputs[1:]:
                ref = fn(ref, a).astype(d)
        np.testing.assert_array_equal(got, ref, err_msg=what)
        return
    wide = [a.astype(np.float64) for a in inputs]
    ref, mag = wide[0].copy(), np.abs(wide[0])
    for a in wide[1:]:
        ref = fn(ref, a)
        mag = mag * np.abs(a) if op == "prod" else mag + np.abs(a)
    if op == "avg":
        ref, mag = ref / n, mag / n
    eps = {np.dtype(np.float64): 2.0 ** -52}.get(d, 2.0 ** -23)
    own = 0.0 if d.itemsize >= 4 else 2.0 ** (-8 if str(d) == "bfloat16" else -11)   # rounding to a 16-bit type
    bound = (n + 1) * eps * mag + own * np.abs(ref) + (0 if op in ("max", "min") else 1e-300)
    err = np.abs(got.astype(np.float64) - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = int(np.argmax(bad))
        pytest.fail(f"{what}: {int(bad.sum())} of {ref.size} wrong; first at {i}: got {got[i]!r}, want {ref[i]!r} "
                    f"(bound {bound[i]:.3g})")


def _same_everywhere(world, out, what: str) -> None:
    import cupy

    every = _allgather(world, cupy.asnumpy(out).tobytes(), "outputs")
    assert all(b == every[0] for b in every), f"{what}: ranks got different bytes"


# ---------------------------------------------------------------------------------------------- reductions
def _algos(dtype: str) -> tuple[str, ...]:
    base = ("auto", "ll", "oneshot", "twoshot", "pipe", "ring")
    return base + (("ll12", "ll12_twoshot") if np.dtype(_np(dtype)).itemsize <= 4 else ())


_CASES = [(dt, op, algo) for dt in ("fp64", "int32", "int64", "uint8") for op in ("sum", "prod", "max", "min")
          for algo in _algos(dt)]


@pytest.mark.parametrize("dtype, op, algo", _CASES)
def test_allreduce_wide_types(world, dtype, op, algo):
    import fluxrt

    count = 4099
    x = _data(len(algo), world.rank, count, dtype, op)
    inputs = _gather(world, x)
    out = _poisoned(count, dtype)
    assert fluxrt.allreduce(world, x, out, op=op, algo=algo) is out
    world.synchronize()
    _check(out, inputs, op, dtype, f"allreduce {dtype} {op} {algo}")
    _same_everywhere(world, out, f"allreduce {dtype} {op} {algo}")


@pytest.mark.parametrize("dtype, op", [("fp64", "sum"), ("fp64", "avg"), ("fp32", "avg"), ("bf16", "avg"),
                                       ("fp32", "prod"), ("int32", "sum"), ("uint8", "max")])
@pytest.mark.parametrize("count", [1, 70_001, 600_001])
def test_allreduce_sizes_and_avg(world, dtype, op, count):
    """auto's choice across the size range (LL, LL12 where the element fits, two-shot); avg divides the
    sum once; fp64 sums are the same bits on every rank."""
    import fluxrt

    x = _data(count % 97, world.rank, count, dtype, op)
    inputs = _gather(world, x)
    out = fluxrt.allreduce(world, x, op=op)
    world.synchronize()
    _check(out, inputs, op, dtype, f"allreduce {dtype} {op} count {count}")
    _same_everywhere(world, out, f"allreduce {dtype} {op} count {count}")


@pytest.mark.parametrize("dtype, op", [("fp64", "sum"), ("int64", "max"), ("uint8", "sum"), ("fp32", "avg")])
@pytest.mark.parametrize("algo", ["auto", "ll", "push", "pipe", "ring"])
def test_reduce_scatter_wide_types(world, dtype, op, algo):
    import fluxrt

    n, chunk = world.size, 3001
    x = _data(7, world.rank, n * chunk, dtype, op)
    inputs = _gather(world, x)
    out = _poisoned(chunk, dtype)
    fluxrt.reduce_scatter(world, x, out, op=op, algo=algo)
    world.synchronize()
    mine = [a[world.rank * chunk:(world.rank + 1) * chunk] for a in inputs]
    _check(out, mine, op, dtype, f"reduce_scatter {dtype} {op} {algo}")


def test_unsupported_reductions_are_refused_on_every_rank(world):
    import cupy

    import fluxrt

    with pytest.raises(fluxrt.CollectiveArgumentError, match="floating-point"):
        fluxrt.allreduce(world, cupy.ones(8, np.int32), op="avg")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="int16"):
        fluxrt.allreduce(world, cupy.ones(8, np.int16))
    with pytest.raises(fluxrt.CollectiveArgumentError, match="12-byte line"):
        fluxrt.allreduce(world, cupy.ones(8, np.float64), algo="ll12")


# ---------------------------------------------------------------------------------------------- handles
def test_async_handles_wait_on_the_host(world):
    import fluxrt

    xs = [_data(11, world.rank, 50_000, "fp64", "sum"), _data(12, world.rank, 9_000, "int32", "sum")]
    inputs = [_gather(world, x) for x in xs]
    world.device.synchronize()
    handles = [fluxrt.allreduce(world, x, async_op=True) for x in xs]
    outs = fluxrt.wait_all(handles, host=True)   # the host blocks: no stream sync needed to read them
    assert all(h.test() for h in handles)
    _check(outs[0], inputs[0], "sum", "fp64", "async fp64 allreduce")
    _check(outs[1], inputs[1], "sum", "int32", "async int32 allreduce")


# ---------------------------------------------------------------------------------------------- sub-worlds
def test_split_world_of_all_ranks_runs_beside_its_root(world):
    import cupy

    import fluxrt

    sub = world.split(0)
    try:
        assert sub.is_subworld and (sub.rank, sub.size) == (world.rank, world.size) and sub.pes == list(range(world.size))
        fluxrt.prepare(sub, options=fluxrt.CollectivesOptions(workspace_bytes=SUB_WS))
        a, b = _data(21, world.rank, 100_000, "fp32", "sum"), _data(22, world.rank, 100_000, "fp64", "sum")
        ia, ib = _gather(world, a), _gather(world, b)
        s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        world.device.synchronize()
        oa = fluxrt.allreduce(world, a, stream=s1)    # root and sub-world at the same time, on two streams
        ob = fluxrt.allreduce(sub, b, stream=s2)
        s1.synchronize()
        s2.synchronize()
        world.check_errors()
        sub.check_errors()
        _check(oa, ia, "sum", "fp32", "root allreduce beside a sub-world")
        _check(ob, ib, "sum", "fp64", "sub-world allreduce beside its root")
    finally:
        sub.finalize()
    assert not sub.active and world.active


def test_tp_by_dp_layout_on_four_ranks(world):
    """2 x 2: TP groups {0, 1} {2, 3} and DP groups {0, 2} {1, 3}, each a sub-world on the one heap; allreduce
    in both at once (TP in fp32 on one stream, DP in fp64 on another), checked against float64 references."""
    import cupy

    import fluxrt

    if world.size != 4:
        pytest.skip(f"the 2 x 2 layout needs 4 ranks, got {world.size}")
    r = world.rank
    tp, dp = world.split(r // 2), world.split(r % 2)
    try:
        assert (tp.size, dp.size) == (2, 2) and tp.pes == [2 * (r // 2), 2 * (r // 2) + 1] and dp.pes == [r % 2, r % 2 + 2]
        for w in (tp, dp):
            fluxrt.prepare(w, dtypes=["fp64"], options=fluxrt.CollectivesOptions(workspace_bytes=SUB_WS))
        for rep, count in enumerate((1000, 70_001, 400_001)):
            a, b = _data(30 + rep, r, count, "fp32", "sum"), _data(40 + rep, r, count, "fp64", "sum")
            ia, ib = _gather(tp, a), _gather(dp, b)
            ts, ds = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
            world.device.synchronize()
            oa = fluxrt.allreduce(tp, a, stream=ts)
            ob = fluxrt.allreduce(dp, b, stream=ds)
            og = fluxrt.allgather(dp, a, stream=ds)
            ts.synchronize()
            ds.synchronize()
            tp.check_errors()
            dp.check_errors()
            _check(oa, ia, "sum", "fp32", f"TP allreduce {count}")
            _check(ob, ib, "sum", "fp64", f"DP allreduce {count}")
            np.testing.assert_array_equal(cupy.asnumpy(og), np.concatenate(_gather(dp, a)))
        # the whole job's view of the same inputs: TP then DP sums equal the world sum
        x = _data(50, r, 5000, "fp64", "sum")
        every = _gather(world, x)
        y = fluxrt.allreduce(dp, fluxrt.allreduce(tp, x))
        world.synchronize()
        np.testing.assert_allclose(cupy.asnumpy(y), np.sum(every, axis=0), rtol=1e-12, atol=1e-12)
    finally:
        dp.finalize()
        tp.finalize()


def test_second_init_makes_a_subworld_with_its_own_communicator(world):
    from mpi4py import MPI

    import fluxrt

    world.split(None)   # reserves the sub-world pool if no split has yet (every rank gets None)
    half = MPI.COMM_WORLD.Split(world.rank % 2, world.rank)
    try:
        sub = fluxrt.init(half)
        assert sub.is_subworld and sub.size == half.Get_size() and fluxrt.current() is world
        assert sub.comm.Compare(half) == MPI.CONGRUENT   # a duplicate, not the program's own
        fluxrt.prepare(sub, options=fluxrt.CollectivesOptions(workspace_bytes=SUB_WS))
        x = _data(60, world.rank, 10_000, "int64", "sum")
        inputs = _gather(sub, x)
        out = fluxrt.allreduce(sub, x)
        sub.synchronize()
        _check(out, inputs, "sum", "int64", "allreduce in a second init's world")
        sub.finalize()
    finally:
        half.Free()
    assert world.active and not sub.active


# ---------------------------------------------------------------------------------------------- graph capture
def test_first_call_inside_a_capture(world):
    """A world's first collective inside a capture raises GraphCaptureError and leaves the capture intact;
    after fluxrt.prepare the first call (fp64, avg: an extension module and the division) is captured and
    replays correctly."""
    import cupy

    import fluxrt

    sub = world.split(0)
    try:
        count = 20_000
        x = cupy.empty(count, np.float64)
        out, out2 = _poisoned(count, "fp64"), _poisoned(count, "fp64")
        s = cupy.cuda.Stream(non_blocking=True)
        world.device.synchronize()
        s.begin_capture()
        out.fill(0)   # something captured before the refused call
        with pytest.raises(fluxrt.GraphCaptureError, match="prepare"):
            fluxrt.allreduce(sub, x, out, stream=s)
        empty = s.end_capture()   # the capture survived the refused call
        del empty
        fluxrt.prepare(sub, dtypes=["fp64"], ops=["sum", "avg"], options=fluxrt.CollectivesOptions(workspace_bytes=SUB_WS))
        s.begin_capture()
        fluxrt.allreduce(sub, x, out, op="avg", stream=s)
        fluxrt.allreduce(sub, x, out2, stream=s, algo="twoshot")
        graph = s.end_capture()
        for replay in range(3):
            x[...] = _data(70 + replay, world.rank, count, "fp64", "sum")
            out.fill(np.nan)
            out2.fill(np.nan)
            world.device.synchronize()
            inputs = _gather(world, x)
            graph.launch(s)
            s.synchronize()
            sub.check_errors()
            _check(out, inputs, "avg", "fp64", f"graph replay {replay}: avg")
            _check(out2, inputs, "sum", "fp64", f"graph replay {replay}: sum")
    finally:
        sub.finalize()


# ---------------------------------------------------------------------------------------------- other producers
def test_numba_arrays_in_and_out(world):
    numba_cuda = pytest.importorskip("numba.cuda", reason="numba-cuda not installed on this machine")
    import cupy

    import fluxrt

    x = _data(80, world.rank, 3000, "fp64", "sum")
    inputs = _gather(world, x)
    nx = numba_cuda.as_cuda_array(x)          # a __cuda_array_interface__ producer
    nout = numba_cuda.device_array(3000, dtype=np.float64)
    fluxrt.allreduce(world, nx, nout)
    world.synchronize()
    _check(cupy.asarray(nout), inputs, "sum", "fp64", "numba in, numba out")


def test_jax_arrays_in_and_readonly_out_refused(world):
    import os

    # JAX would otherwise take 75% of the GPU at its first use, starving the other ranks' NVSHMEM heaps
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax", reason="jax not installed on this machine")
    import cupy

    import fluxrt

    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax has no GPU backend here")
    import fluxrt.jax as fjax

    dev = fjax.device(world)   # this rank's GPU, not JAX's first one
    with world.device:   # JAX's GPU client made another GPU current when it started: CuPy allocates on the world's
        x = _data(81, world.rank, 3000, "fp32", "sum")
    inputs = _gather(world, x)
    jx = jax.device_put(cupy.asnumpy(x), dev)
    cupy.cuda.Device((world.device_id + 1) % cupy.cuda.runtime.getDeviceCount()).use()   # as JAX leaves it
    out = fluxrt.allreduce(world, jx)   # on the world's GPU all the same (World.make_current)
    world.synchronize()
    _check(out, inputs, "sum", "fp32", "jax in")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="immutable JAX array"):
        fluxrt.allreduce(world, x, jx)


def test_collectives_inside_jax_jit(world):
    """fluxrt.jax: allreduce, allgather and reduce_scatter (avg) as buffer callbacks inside jax.jit, on XLA's
    stream and buffers, with JAX computing around them; and an allreduce in XLA's command buffer, replayed
    with new inputs."""
    jax = _jax()
    import cupy

    import fluxrt.jax as fj

    dev = fj.device(world)
    n, chunk = world.size, 2048
    x = cupy.asnumpy(_data(90, world.rank, n * chunk, "fp32", "sum"))
    inputs = _allgather(world, x, "jit inputs")
    jx = jax.device_put(x, dev)
    y = jax.jit(lambda a: fj.allreduce(a, world=world) * 2.0)(jx)
    g = jax.jit(lambda a: fj.allgather(a[:chunk] + 1.0, world=world))(jx)
    r = jax.jit(lambda a: fj.reduce_scatter(a, world=world, op="avg"))(jx)
    jax.block_until_ready((y, g, r))
    world.check_errors()
    _check(cupy.asarray(np.asarray(y) / 2.0), inputs, "sum", "fp32", "jit allreduce")
    np.testing.assert_array_equal(np.asarray(g), np.concatenate([a[:chunk] + np.float32(1.0) for a in inputs]))
    _check(cupy.asarray(np.asarray(r)), [a[world.rank * chunk:(world.rank + 1) * chunk] for a in inputs], "avg",
           "fp32", "jit reduce_scatter avg")
    step = jax.jit(lambda a: fj.allreduce(a * 2.0, world=world, command_buffer=True))
    for rep in range(2):
        v = cupy.asnumpy(_data(91 + rep, world.rank, 4096, "fp32", "sum"))
        out = step(jax.device_put(v, dev))
        out.block_until_ready()
        world.check_errors()
        _check(cupy.asarray(np.asarray(out) / 2.0), _allgather(world, v, "command buffer inputs"), "sum", "fp32",
               f"command buffer call {rep}")


# ---------------------------------------------------------------------------------------------- fused ops in jax.jit
def _jax():
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax", reason="jax not installed on this machine")
    pytest.importorskip("jax.experimental.buffer_callback", reason="this JAX has no buffer_callback")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax has no GPU backend here")
    return jax


def _bf16(rng, shape, scale=1.0):
    import fluxrt

    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(fluxrt.bfloat16)


def _round_bf16(x):
    import fluxrt

    return x.astype(np.float32).astype(fluxrt.bfloat16).astype(np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp_refs(world, x, gu, d, a, shard, ffn):
    """float64 references of one step of test_fused_ops_inside_jax_jit: AllGather+GEMM, GEMM+ReduceScatter
    of (a, d), and the MLP block (its hidden and activation rounded to bf16 as the ops store them). Every
    rank runs every MPI step."""
    from op_checks import f64

    me = world.rank
    rows = slice(me * shard, (me + 1) * shard)
    x_full = np.concatenate([f64(v) for v in world.comm.allgather(np.ascontiguousarray(x))])
    h = x_full @ f64(gu)
    rs = sum(world.comm.allgather(f64(a) @ f64(d)))[rows]
    hb = _round_bf16(h)
    act = _round_bf16(_silu(hb[:, :ffn]) * hb[:, ffn:])
    mlp = sum(world.comm.allgather(act @ f64(d)))[rows]
    return h, rs, mlp


_JAX_OP_CASES = [  # path (None: each op's cost model), rows per rank, trans_b
    (None, 128, False), ("fused", 128, True), ("decomposed", 128, False), ("fused", 72, False), ("decomposed", 72, True)]


@pytest.mark.parametrize("path, shard, trans_b", _JAX_OP_CASES)
def test_fused_ops_inside_jax_jit(world, path, shard, trans_b):
    """fluxrt.jax.TPOps inside jax.jit: AllGather+GEMM, GEMM+ReduceScatter, the MLP block as one call, and
    AllGather+GEMM -> SiLU-and-multiply in XLA -> GEMM+ReduceScatter in one jitted function, against float64
    numpy; whole-tile and padded shards, both weight layouts. A second step with new inputs reuses the
    jitted functions and the ops made when they were traced."""
    jax = _jax()
    import jax.numpy as jnp
    from op_checks import Problems

    import fluxrt.jax as fj

    rng = np.random.default_rng(1000 + 7 * shard + world.rank + 3 * trans_b)
    hidden, ffn = 256, 192
    m = shard * world.size
    dev = fj.device(world)
    tp = fj.TPOps(world, path=path)

    def block(x, gu, d):
        h = tp.ag_gemm(x, gu, trans_b=trans_b)
        act = (jax.nn.silu(h[:, :ffn].astype(jnp.float32)) * h[:, ffn:].astype(jnp.float32)).astype(h.dtype)
        return tp.gemm_rs(act, d, trans_b=trans_b)

    fns = [jax.jit(lambda x, gu: tp.ag_gemm(x, gu, trans_b=trans_b)),
           jax.jit(lambda a, d: tp.gemm_rs(a, d, trans_b=trans_b)),
           jax.jit(lambda x, gu, d: tp.mlp(x, gu, d, trans_b=trans_b)),
           jax.jit(block)]
    layout = (lambda v: np.ascontiguousarray(v.T)) if trans_b else (lambda v: v)
    problems = Problems()
    try:
        for step in range(2):
            x = _bf16(rng, (shard, hidden))
            gu = _bf16(rng, (hidden, 2 * ffn), hidden ** -0.5)
            d = _bf16(rng, (ffn, hidden), ffn ** -0.5)
            a = _bf16(rng, (m, ffn))
            jx, jgu, jd, ja = (jax.device_put(v, dev) for v in (x, layout(gu), layout(d), a))
            outs = [fns[0](jx, jgu), fns[1](ja, jd), fns[2](jx, jgu, jd), fns[3](jx, jgu, jd)]
            outs = [np.asarray(o) for o in jax.block_until_ready(outs)]
            world.check_errors()
            h, rs, mlp = _mlp_refs(world, x, gu, d, a, shard, ffn)
            for got, ref, what in zip(outs, (h, rs, mlp, mlp), ("ag_gemm", "gemm_rs", "mlp", "ag_gemm+silu+gemm_rs")):
                problems.check(got, ref, "bfloat16", f"{what} in jax.jit, step {step}")
        problems.assert_none()
        # one op per shape: the block's two calls reuse the ag_gemm's and gemm_rs's objects; one callback a call
        assert sorted(k[0] for k in tp.ops) == ["ag_gemm", "gemm_rs", "mlp"], tp.ops
        assert tp.calls == 2 * 5 and tp.captured == 0
        if path is not None:   # the MLP block's two ops report 'fused/fused' or 'decomposed/decomposed'
            assert set(tp.paths().values()) == {path, f"{path}/{path}"}, tp.paths()
    finally:
        tp.free()


def test_jax_fused_ops_in_an_xla_command_buffer(world):
    """TPOps(command_buffer=True): the block traced into XLA's command buffer on the decomposed path,
    replayed with new inputs, against float64 numpy. Whether XLA forms a command buffer around the call is
    its own choice (xla_gpu_graph_min_graph_size, the command types enabled): ``captured`` says whether the
    callback ran inside a capture; a warning says when it did not."""
    import warnings

    jax = _jax()
    import jax.numpy as jnp
    from op_checks import Problems

    import fluxrt.jax as fj

    rng = np.random.default_rng(2000 + world.rank)
    hidden, ffn, shard = 256, 192, 128
    dev = fj.device(world)
    tp = fj.TPOps(world, command_buffer=True)

    @jax.jit
    def block(x, gu, d):
        h = tp.ag_gemm(x * 1.0, gu)
        act = (jax.nn.silu(h[:, :ffn].astype(jnp.float32)) * h[:, ffn:].astype(jnp.float32)).astype(h.dtype)
        return tp.gemm_rs(act, d) + 0.0

    problems = Problems()
    try:
        for rep in range(3):
            x = _bf16(rng, (shard, hidden))
            gu = _bf16(rng, (hidden, 2 * ffn), hidden ** -0.5)
            d = _bf16(rng, (ffn, hidden), ffn ** -0.5)
            y = np.asarray(jax.block_until_ready(block(*(jax.device_put(v, dev) for v in (x, gu, d)))))
            world.check_errors()
            _, _, ref = _mlp_refs(world, x, gu, d, np.zeros((shard * world.size, ffn), np.float32), shard, ffn)
            problems.check(y, ref, "bfloat16", f"command buffer step {rep}")
        problems.assert_none()
        assert all(k[0] in ("ag_gemm", "gemm_rs") for k in tp.ops)
        if tp.captured == 0:
            warnings.warn(f"XLA ran the fused ops' callbacks outside a command buffer ({tp.calls} calls); the "
                          "replay path was not exercised (XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 forces it)")
    finally:
        tp.free()


def test_jax_tpops_refuse_bad_inputs_when_traced(world):
    jax = _jax()
    import jax.numpy as jnp

    import fluxrt
    import fluxrt.jax as fj

    tp = fj.TPOps(world)
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    with pytest.raises(fluxrt.ops.OpsArgumentError, match="K=192"):
        jax.eval_shape(lambda a, b: tp.ag_gemm(a, b), x, jax.ShapeDtypeStruct((192, 64), jnp.bfloat16))
    with pytest.raises(fluxrt.ops.OpsArgumentError, match="bf16 or all fp16"):
        jax.eval_shape(lambda a, b: tp.ag_gemm(a, b), x, jax.ShapeDtypeStruct((256, 64), jnp.float32))
    with pytest.raises(fluxrt.GraphCaptureError, match="replayed"):
        jax.eval_shape(lambda a, b: tp.gemm_rs(a, b, path="fused", command_buffer=True), x,
                       jax.ShapeDtypeStruct((256, 64), jnp.bfloat16))
    assert not tp.ops


# ---------------------------------------------------------------------------------------------- torch tensors
def test_torch_tensors_in_and_out_of_gemm_collective_and_fused_op(world):
    """torch tensors (DLPack) as inputs and outputs of fluxrt.gemm, allreduce and AllGatherGemm on a torch
    stream, against float64 numpy; results fluxrt allocates go back to torch without a copy."""
    torch = pytest.importorskip("torch", reason="torch not installed on this machine")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    import cupy
    from op_checks import Problems

    import fluxrt
    from fluxrt.gemm import gemm
    from fluxrt.ops import AllGatherGemm

    rng = np.random.default_rng(3000 + world.rank)
    dev = torch.device("cuda", world.device_id)
    stream = torch.cuda.Stream(dev)
    raw = stream.cuda_stream

    def tensor(shape, dtype, scale=1.0):
        return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(dev).to(dtype)

    def host(t):
        return t.float().cpu().numpy().astype(np.float64)

    problems = Problems()
    shard, k, n = 128, 256, 192
    with torch.cuda.stream(stream):
        # single-GPU GEMM: torch in, torch out (NaN-poisoned)
        a, b = tensor((shard, k), torch.bfloat16), tensor((k, n), torch.bfloat16, k ** -0.5)
        c = torch.full((shard, n), float("nan"), dtype=torch.bfloat16, device=dev)
        gemm(a, b, c, stream=raw)
        # allreduce: fp32 torch in and out, then one whose result fluxrt allocates
        x = tensor((4099,), torch.float32)
        y = torch.full_like(x, float("nan"))
        fluxrt.allreduce(world, x, y, stream=raw)
        z = torch.from_dlpack(fluxrt.allreduce(world, x, stream=raw))
        # AllGather+GEMM: torch shard and weight in, torch output
        xs, w = tensor((shard, k), torch.bfloat16), tensor((k, n), torch.bfloat16, k ** -0.5)
        out = torch.full((shard * world.size, n), float("nan"), dtype=torch.bfloat16, device=dev)
        ag = AllGatherGemm(world, shard * world.size, n, k, "bf16")
        try:
            ret = ag.forward(xs, w, out=out, stream=raw)
            stream.synchronize()
            world.check_errors()
        finally:
            ag.free()
    assert isinstance(ret, cupy.ndarray) and ret.data.ptr == out.data_ptr()   # a view of the torch tensor
    assert z.device == dev
    problems.check(host(c), host(a) @ host(b), "bfloat16", "gemm torch in/out")
    inputs = world.comm.allgather(host(x))
    xs_all = np.concatenate(world.comm.allgather(host(xs)))
    problems.check(host(out), xs_all @ host(w), "bfloat16", "AllGatherGemm torch in/out")
    problems.assert_none()
    for got, what in ((y, "allreduce torch out"), (z, "allreduce to torch by dlpack")):
        _check(cupy.asarray(got), [v.astype(np.float32) for v in inputs], "sum", "fp32", what)
