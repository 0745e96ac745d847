"""CPU tests of the fp8 tensor-parallel ops (Fp8Options): option and constructor validation before any device
call, and the planner's choice for fp8 calls (decomposed only, its chunk count, 'fused' refused)."""
from __future__ import annotations

import dataclasses

import pytest

from fluxrt.ops import cost as C
from fluxrt.ops import plan as P

RATES = C.OPS_RATES[C.DEFAULT_RATES]


def test_fp8_options_validate_and_print():
    o = P.Fp8Options().validate()
    assert (o.format, o.scale) == ("e4m3", "tensor")
    assert P.Fp8Options(("e4m3", "e5m2"), "block").validate().scale == "block"
    assert "e5m2" in repr(P.Fp8Options("e5m2"))
    with pytest.raises(P.OpsArgumentError, match="Fp8Options.format"):
        P.Fp8Options("e3m4").validate()
    with pytest.raises(P.OpsArgumentError, match="Fp8Options.scale must be one of"):
        P.Fp8Options(scale="none").validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.scale = "block"


class _FakeWorld:
    size, rank, device_id = 4, 0, 0

    class options:
        check_collective_args = False


@pytest.mark.parametrize("cls", ["AllGatherGemm", "GemmReduceScatter"])
def test_fp8_construction_rejected_before_touching_the_device(cls):
    import fluxrt.ops as ops

    op, w = getattr(ops, cls), _FakeWorld()
    plan = ops.AgGemmPlan if cls == "AllGatherGemm" else ops.GemmRsPlan
    with pytest.raises(P.OpsArgumentError, match="trans_b=True"):
        op(w, 1024, 1024, 1024, fp8=P.Fp8Options())
    with pytest.raises(P.OpsArgumentError, match="multiple of 16"):
        op(w, 1024, 1024, 1032, trans_b=True, fp8=P.Fp8Options())
    with pytest.raises(P.OpsArgumentError, match="no fp8 hooks"):
        op(w, 1024, 1024, 1024, trans_b=True, fp8=P.Fp8Options(), plan=plan(path="fused"))
    with pytest.raises(P.OpsArgumentError, match="must be a fluxrt.ops.Fp8Options"):
        op(w, 1024, 1024, 1024, trans_b=True, fp8="e4m3")
    with pytest.raises(P.OpsArgumentError, match="Fp8Options.scale"):
        op(w, 1024, 1024, 1024, trans_b=True, fp8=P.Fp8Options(scale="row"))
    with pytest.raises(P.OpsArgumentError, match="bf16 or fp16"):   # dtype is the output's: never fp8
        op(w, 1024, 1024, 1024, "uint8", trans_b=True, fp8=P.Fp8Options())


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
@pytest.mark.parametrize("m, n, k, world", [(8192, 7168, 8192, 4), (64, 3584, 4096, 4), (16384, 3072, 8192, 8)])
def test_fp8_calls_take_the_decomposed_path(op, m, n, k, world):
    plan = P.AgGemmPlan() if op == "ag_gemm" else P.GemmRsPlan()
    c = C.choose_path(op, m, n, k, world, plan, fp8=True)
    assert c.path == "decomposed" and "fp8" in c.reason and "no fp8 hooks" in c.reason
    assert c.fused_us is None and c.chunks in C.DECOMPOSED_CHUNKS
    assert c.decomposed_us == min(us for _, us in c.candidates)
    cap = C.choose_path(op, m, n, k, world, plan, fp8=True, capturing=True)
    assert (cap.path, cap.chunks) == ("decomposed", c.chunks)


def test_fp8_fused_refused_and_fixed_chunks():
    with pytest.raises(P.OpsArgumentError, match="no fp8 hooks yet"):
        C.choose_path("ag_gemm", 8192, 7168, 8192, 4, P.AgGemmPlan(path="fused"), fp8=True)
    with pytest.raises(P.OpsArgumentError, match="no fp8 hooks yet"):
        C.choose_path("gemm_rs", 8192, 8192, 7168, 4, P.GemmRsPlan(path="fused"), fp8=True, capturing=True)
    c = C.choose_path("gemm_rs", 8192, 8192, 7168, 4, P.GemmRsPlan(path="decomposed", decomposed_chunks=2), fp8=True)
    assert (c.path, c.chunks) == ("decomposed", 2) and [x[0] for x in c.candidates] == [2]
    one = C.choose_path("ag_gemm", 1024, 1024, 1024, 1, P.AgGemmPlan(decomposed_chunks=4), fp8=True)
    assert (one.path, one.chunks) == ("decomposed", 1) and "one rank" in one.reason


def test_fp8_model_moves_fp8_bytes_and_uses_fp8_gemm_times():
    m, n, k, w = 8192, 7168, 8192, 4
    bf16 = C.choose_path("ag_gemm", m, n, k, w, P.AgGemmPlan(path="decomposed"))
    fp8 = C.choose_path("ag_gemm", m, n, k, w, P.AgGemmPlan(), fp8=True)
    assert fp8.decomposed_us < bf16.decomposed_us
    # one chunk: the sequential allgather of M x K fp8 bytes, then the fp8 GEMM
    seq = dict(C.choose_path("ag_gemm", m, n, k, w, P.AgGemmPlan(decomposed_chunks=1), fp8=True).candidates)[1]
    want = C.collective_us(m * k, w, RATES) + C.gemm_us(m, n, k) * RATES.fp8_gemm_factor
    assert seq == pytest.approx(want)
    # the autotune cache's fp8 time replaces the model's
    tuned = C.choose_path("ag_gemm", m, n, k, w, P.AgGemmPlan(decomposed_chunks=1), fp8=True,
                          tuned_us=lambda mm, nn, kk: 100.0)
    assert tuned.decomposed_us == pytest.approx(C.collective_us(m * k, w, RATES) + 100.0)
    # GEMM+ReduceScatter reduces 16-bit partials: its comm is not halved
    rs = dict(C.choose_path("gemm_rs", m, n, k, w, P.GemmRsPlan(decomposed_chunks=1), fp8=True,
                            tuned_us=lambda mm, nn, kk: 100.0).candidates)[1]
    assert rs == pytest.approx(100.0 + C.collective_us(m * n * 2, w, RATES))



# --- the decomposed fp8 steps on simulated ranks -------------------------------------------------------------
# Threads stand in for ranks, numpy for the device: the collectives exchange through a barrier and the GEMM is
# a float64 product of dequantised bytes. What this checks is the pieces' indexing (which rows, which scales,
# which chunk lands where); the CUDA side is tests/gpu/test_ops_fp8.py.

class _SimComm:
    def __init__(self, world: int):
        import threading

        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: dict = {}

    def exchange(self, rank: int, x):
        self.slots[rank] = x.copy()
        self.barrier.wait()
        got = [self.slots[r] for r in range(self.world)]
        self.barrier.wait()
        return got


def _sim_modules(monkeypatch, comm):
    import contextlib
    import types

    import numpy as np

    from fluxrt.ops import common, decomposed

    def allgather(world, x, out=None, stream=None):
        parts = comm.exchange(world.rank, np.asarray(x).reshape(1, -1) if np.ndim(x) == 0 else np.asarray(x))
        out[...] = np.concatenate(parts, axis=0).reshape(out.shape)

    def reduce_scatter(world, x, out=None, stream=None):
        total = sum(p.astype(np.float64) for p in comm.exchange(world.rank, x))
        r = out.shape[0]
        out[...] = total[world.rank * r:(world.rank + 1) * r]

    def gemm(a, b, out, *, trans_b, stream, fp8_format, scale_a, scale_b, plan):
        assert trans_b and a.dtype == np.uint8 and b.dtype == np.uint8
        out[...] = _deq(a, scale_a, 1, fp8_format) @ _deq(b, scale_b, 128, fp8_format).T

    monkeypatch.setattr(decomposed, "collectives", types.SimpleNamespace(allgather=allgather,
                                                                         reduce_scatter=reduce_scatter))
    monkeypatch.setattr(decomposed, "gemm", gemm)
    monkeypatch.setattr(common, "join", lambda waiter, signaller: None)
    return types.SimpleNamespace(device=contextlib.nullcontext())


def _deq(x8, s, rows_per_scale, fmt):
    import ml_dtypes
    import numpy as np

    x = x8.view(getattr(ml_dtypes, "float8_e4m3fn" if fmt == "e4m3" else "float8_e5m2")).astype(np.float64)
    s = np.asarray(s, dtype=np.float64)
    if s.size == 1:
        return x * float(s.reshape(-1)[0])
    rows, k = x.shape
    return x * np.repeat(np.repeat(s, rows_per_scale, axis=0)[:rows], 128, axis=1)[:, :k]


def _fp8_bytes(rng, shape):
    import ml_dtypes
    import numpy as np

    v = rng.uniform(0.5, 2.0, size=shape) * np.where(rng.random(shape) < 0.5, -1, 1)
    return v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _run_ranks(comm, fn):
    import threading

    results, errors = [None] * comm.world, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:   # reported below; the other ranks leave their barrier wait
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(comm.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("op_name", ["ag_gemm", "gemm_rs"])
@pytest.mark.parametrize("mode, shard, chunks", [("tensor", 256, 1), ("tensor", 300, 3), ("block", 256, 1),
                                                 ("block", 200, 2), ("block", 72, 4)])
def test_decomposed_fp8_pieces_on_simulated_ranks(monkeypatch, op_name, mode, shard, chunks):
    import types

    import numpy as np

    from fluxrt.ops import decomposed

    w, n, k = 3, 136, 272
    m, kbs, nbs = shard * w, -(-k // 128), -(-n // 128)
    comm = _SimComm(w)
    dev = _sim_modules(monkeypatch, comm)
    fp8 = P.Fp8Options("e4m3", mode)
    rngs = [np.random.default_rng([7, r]) for r in range(w)]
    a_rows = shard if op_name == "ag_gemm" else m
    inputs = []
    for rng in rngs:
        a, b = _fp8_bytes(rng, (a_rows, k)), _fp8_bytes(rng, (n, k))
        if mode == "tensor":
            sa, sb = rng.uniform(0.25, 4.0, (1,)), rng.uniform(0.5, 2.0, (1,))
        else:
            sa, sb = rng.uniform(0.01, 2.0, (a_rows, kbs)), rng.uniform(0.01, 2.0, (nbs, kbs))
        inputs.append((a, b, sa.astype(np.float32), sb.astype(np.float32)))

    # every piece a call multiplies was loaded (and met) before its first collective: (rows, capped) per rank
    loaded, multiplied = {r: set() for r in range(w)}, {r: set() for r in range(w)}
    mm = decomposed._mm

    def recording_mm(op, st, a, *args):
        multiplied[op.world.rank].add((a.shape[0], args[3]))
        return mm(op, st, a, *args)

    monkeypatch.setattr(decomposed, "_mm", recording_mm)

    def load(r):
        return lambda op, m_, chunks_, pieces, out_dtype: loaded[r].update(pieces)

    def rank(r):
        world = types.SimpleNamespace(size=w, rank=r, device=dev.device)
        op = types.SimpleNamespace(world=world, n=n, k=k, dtype="bfloat16", in_dtype="uint8", trans_b=True, fp8=fp8,
                                   comm_stream=None)
        a, b, sa, sb = inputs[r]
        if op_name == "ag_gemm":
            st = types.SimpleNamespace(buffer=np.zeros((m, k), np.uint8), fp8_plan=lambda prob, capped: None,
                                       scales=np.zeros((w,) if mode == "tensor" else (m, kbs), np.float32),
                                       load=load(r))
            out = np.full((m, n), np.nan)
            got, _ = decomposed.ag_gemm(op, st, a, b, out, shard, m, chunks, None, scale_a=sa, scale_b=sb)
        else:
            st = types.SimpleNamespace(buffer=np.full((m, n), np.nan), fp8_plan=lambda prob, capped: None, scales=None,
                                       load=load(r))
            out = np.full((shard, n), np.nan)
            got = decomposed.gemm_rs(op, st, a, b, out, shard, m, chunks, None, scale_a=sa, scale_b=sb)
        return got

    results = _run_ranks(comm, rank)
    for r in range(w):
        assert multiplied[r] and multiplied[r] <= loaded[r], (multiplied[r], loaded[r])
        if op_name == "ag_gemm":
            a_full = np.concatenate([_deq(x, s, 1, "e4m3") for x, _, s, _ in inputs], axis=0)
            ref = a_full @ _deq(inputs[r][1], inputs[r][3], 128, "e4m3").T
        else:
            ref = sum(_deq(x, s, 1, "e4m3") @ _deq(y, t, 128, "e4m3").T for x, y, s, t in inputs)
            ref = ref[r * shard:(r + 1) * shard]
        np.testing.assert_allclose(results[r], ref, rtol=1e-12, atol=1e-9, err_msg=f"rank {r}")


# --- fluxrt-perf ag_gemm / gemm_rs --fp8: its pure parts -----------------------------------------------------

def test_fp8_bench_flags_rows_table_and_summary():
    from fluxrt.perf import tp_ops, tp_ops_fp8 as F

    args = tp_ops.build_parser("ag_gemm").parse_args(["--fp8", "block", "--M", "8192", "--N", "7168", "--K", "8192"])
    assert (args.fp8, args.fp8_format) == ("block", "e4m3")
    assert tp_ops.build_parser("gemm_rs").parse_args([]).fp8 is None
    with pytest.raises(SystemExit):
        tp_ops.build_parser("ag_gemm").parse_args(["--fp8", "row"])
    fast = F.fp8_row("ag_gemm", 8192, 7168, 8192, 4, "bfloat16", "e4m3", "block", 1.02, 1.0, 2,
                     {1: 1.3, 2: 1.02, 4: 1.05})
    slow = F.fp8_row("ag_gemm", 4096, 7168, 8192, 4, "bfloat16", "e4m3", "block", 0.6, 0.5, 1, {1: 0.6})
    small = F.fp8_row("ag_gemm", 1024, 7168, 8192, 4, "bfloat16", "e4m3", "block", 0.3, 0.1, 1, {1: 0.3})
    assert fast["op_over_gemm"] == pytest.approx(1.02) and not fast["over_target"]
    assert slow["over_target"] and not small["over_target"] and small["target"] is None
    s = F.fp8_summary([fast, slow, small])
    assert s["over_target"] == ["4096x7168x8192"]
    assert s["geomean_op_over_gemm"] == pytest.approx((1.02 * 1.2) ** 0.5)
    lines = F.format_fp8_table([fast, slow])
    assert len({len(x) for x in lines}) == 1 and "e4m3/block" in lines[1] and "N/A" in lines[2]
