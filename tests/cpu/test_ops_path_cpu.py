"""CPU tests of the fused ops' path choice (fluxrt.ops.cost): when the planner keeps the fused kernel, when
it runs the decomposed path, overrides, capture, and the decomposed path's chunking."""
from __future__ import annotations

import dataclasses

import pytest

from fluxrt.ops import cost as C
from fluxrt.ops import plan as P

RATES = C.OPS_RATES[C.DEFAULT_RATES]


def _ag(m, n, k, world, **plan):
    return C.choose_path("ag_gemm", m, n, k, world, P.AgGemmPlan(**plan).validate())


def _rs(m, n, k, world, **plan):
    return C.choose_path("gemm_rs", m, n, k, world, P.GemmRsPlan(**plan).validate())


@pytest.mark.parametrize("m, n, k, world", [(8192, 7168, 8192, 4), (16384, 6144, 8192, 4), (4096, 7168, 8192, 4),
                                            (8192, 14336, 8192, 2), (16384, 3072, 8192, 8)])
def test_large_tp_shapes_keep_the_fused_kernel(m, n, k, world):
    # the measured issue shapes, where fused beat NCCL + cuBLAS by 10-25 % (perf/results/ag_gemm-*, gemm_rs-*)
    for choice in (_ag(m, n, k, world), _rs(m, k, n, world)):
        assert choice.path == "fused", choice
        assert choice.fused_us < choice.decomposed_us
        assert "fused" in choice.reason and "decomposed" in choice.reason


@pytest.mark.parametrize("m, n, k, world", [(64, 3584, 4096, 4), (256, 3584, 8192, 8), (264, 1024, 8192, 4)])
def test_small_and_padded_shards_fall_back_to_decomposed(m, n, k, world):
    # tiny shards: the fused op pads them to whole 128-row tiles and pays a hand-off per peer chunk
    for choice in (_ag(m, n, k, world), _rs(m, k, n, world)):
        assert choice.path == "decomposed", choice
        assert choice.decomposed_us * RATES.margin < choice.fused_us
        assert "predicted" in choice.reason


def test_the_choice_needs_the_margin():
    tight = dataclasses.replace(RATES, margin=1e9)
    c = C.choose_path("ag_gemm", 64, 3584, 4096, 4, P.AgGemmPlan(), rates=tight)
    assert c.path == "fused"
    loose = dataclasses.replace(RATES, margin=1.0, fused_gemm_factor=10.0)
    c = C.choose_path("ag_gemm", 8192, 7168, 8192, 4, P.AgGemmPlan(), rates=loose)
    assert c.path == "decomposed"


def test_overrides_and_fixed_chunks():
    c = _ag(64, 3584, 4096, 4, path="fused")
    assert c.path == "fused" and "requested" in c.reason
    c = _rs(8192, 8192, 7168, 4, path="decomposed", decomposed_chunks=2)
    assert (c.path, c.chunks) == ("decomposed", 2) and "requested" in c.reason
    assert [x[0] for x in c.candidates] == [2]


def test_capture_always_decomposed_and_refuses_fused():
    c = C.choose_path("ag_gemm", 8192, 7168, 8192, 4, P.AgGemmPlan(), capturing=True)
    assert c.path == "decomposed" and "capture" in c.reason
    with pytest.raises(P.OpsArgumentError, match="capture"):
        C.choose_path("gemm_rs", 8192, 8192, 7168, 4, P.GemmRsPlan(path="fused"), capturing=True)


def test_one_rank_is_a_plain_gemm():
    c = _ag(1024, 1024, 1024, 1)
    assert c.path == "decomposed" and c.chunks in C.DECOMPOSED_CHUNKS


def test_tuned_time_drives_the_model():
    # a cache saying the GEMM is fast makes comm dominate; one saying it is slow hides comm in the GEMM
    fast = C.choose_path("ag_gemm", 256, 3584, 8192, 8, P.AgGemmPlan(), tuned_us=lambda m, n, k: 1.0)
    slow = C.choose_path("ag_gemm", 256, 3584, 8192, 8, P.AgGemmPlan(), tuned_us=lambda m, n, k: 1e5)
    assert fast.fused_us < slow.fused_us
    assert slow.path == "fused"


def test_plan_path_validation():
    with pytest.raises(P.OpsArgumentError, match="path must be one of"):
        P.AgGemmPlan(path="fast").validate()
    with pytest.raises(P.OpsArgumentError, match="decomposed_chunks"):
        P.GemmRsPlan(decomposed_chunks=0).validate()
    with pytest.raises(P.OpsArgumentError, match="unknown op"):
        C.choose_path("mlp", 1024, 1024, 1024, 2, P.AgGemmPlan())


@pytest.mark.parametrize("shard, chunks, want", [(2048, 1, [2048]), (2048, 2, [1024, 1024]), (2048, 4, [512] * 4),
                                                 (1000, 2, [512, 488]), (100, 4, [100]), (300, 4, [128, 128, 44]),
                                                 (129, 2, [128, 1])])
def test_chunk_rows_whole_tiles_cover_the_shard(shard, chunks, want):
    got = C.chunk_rows(shard, chunks)
    assert got == want and sum(got) == shard


def test_model_pieces_behave():
    # more SMs taken from a full-wave GEMM costs time; a GEMM of one partial wave loses nothing
    assert C.gemm_us(8192, 8192, 8192, sms=116) > C.gemm_us(8192, 8192, 8192)
    assert C.gemm_us(128, 256, 4096, sms=116) == C.gemm_us(128, 256, 4096)
    assert C.collective_us(1 << 26, 4, RATES) > C.collective_us(1 << 20, 4, RATES) > RATES.collective_latency_us
    assert C.collective_us(1 << 20, 1, RATES) == 0.0
    # one decomposed chunk is the sequential collective + GEMM
    seq = C.collective_us(8192 * 8192 * 2, 4, RATES) + C.gemm_us(8192, 7168, 8192)
    assert C.ag_decomposed_us(8192, 7168, 8192, 4, "bfloat16", 1, rates=RATES) == pytest.approx(seq)
    # predictions within 10 % of the measured fused and NCCL + cuBLAS times (perf/results/ag_gemm-h200x4-np4-*)
    fused = C.ag_fused_us(8192, 7168, 8192, 4, "bfloat16", chunks_per_rank=2, reserved_sms=1, rates=RATES)
    assert fused == pytest.approx(1268.0, rel=0.1)
    assert seq == pytest.approx(1565.0, rel=0.1)


# --- perf plumbing: the suite sweep and its summary ----------------------------------------------------------

def test_tp_op_suite_shapes():
    from fluxrt.perf import shapes, tp_ops

    for op, layers in shapes.TP_OP_LAYERS.items():
        for tp in (2, 4, 8):
            suite = shapes.tp_op_suite(op, tp)
            assert suite and len({x.key() for x in suite}) == len(suite)
            assert {x.m for x in suite} == set(shapes.TP_OP_SUITES["tp"])
            assert all(x.label.split("/")[1] in layers and x.label.endswith(f"tp{tp}") for x in suite)
            hidden = {h for h, *_ in shapes.MODELS.values()}
            # AllGather+GEMM: K is the hidden size; GEMM+ReduceScatter: N is
            # (DeepSeek-V3's attention projections are the latent ones: see fluxrt.perf.shapes)
            assert all((x.k if op == "ag_gemm" else x.n) in hidden for x in suite if x.label != f"deepseek-v3/qkv/tp{tp}")
    args = tp_ops.build_parser("gemm_rs").parse_args(["--suite", "tp-quick"])
    assert tp_ops.shapes_from_args("gemm_rs", args, 2) == [(x.m, x.n, x.k) for x in shapes.tp_op_suite("gemm_rs", 2,
                                                                                                         "tp-quick")]
    with pytest.raises(ValueError, match="--suite replaces"):
        tp_ops.shapes_from_args("ag_gemm", tp_ops.build_parser("ag_gemm").parse_args(["--suite", "tp", "--M", "8"]))
    assert all(inter % 64 == 0 for _, _, inter, _ in shapes.tp_mlp_suite(8))


def test_baseline_fields_and_summary():
    from fluxrt.perf import tp_ops

    row = tp_ops.overlap_row("ag_gemm", 8192, 7168, 8192, 4, "bfloat16", 1.27, 1.23, 1.22, 0.35, 1.56, 1.41)
    r = tp_ops.baseline_fields(row, {1: 1.6, 2: 1.5, 4: 1.55}, "fused", 2)
    assert (r["decomposed_ms"], r["decomposed_chunks"], r["op_ms"]) == (1.5, 2, 1.27)
    assert r["op_over_best"] == pytest.approx(1.27 / 1.41)
    small = tp_ops.baseline_fields(dict(row, m=64, fused_ms=0.05, sequential_ms=0.04, torch_ms=None),
                                   {1: 0.03}, "decomposed", 1)
    assert small["op_ms"] == 0.03 and small["op_over_best"] == pytest.approx(1.0)
    slow = tp_ops.baseline_fields(dict(row, m=128, fused_ms=2.0), {1: 1.6}, "fused", 1)
    s = tp_ops.summary([r, small, slow])
    assert s["fallback"] == ["64x7168x8192"] and s["over_target"] == ["128x7168x8192"]
    assert s["geomean_sequential_over_op"] == pytest.approx(((1.56 / 1.27) * (0.04 / 0.03) * (1.56 / 2.0)) ** (1 / 3))
    lines = tp_ops.format_table([r, small])
    assert len({len(x) for x in lines}) == 1 and "decomposed" in lines[2]
    assert "128x7168x8192" in tp_ops.summary_lines(s)[1]


def test_call_path_is_agreed_once_per_call_shape(monkeypatch):
    """choose_call_path caches the agreed choice under (M, capturing, path): a second call of the same shape
    neither recomputes nor exchanges, a new M or an override does."""
    import types

    from fluxrt import agreement
    from fluxrt.ops import common

    exchanges = []

    def fake_exchange(world, name, payload):
        exchanges.append((name, payload))
        return [payload]

    monkeypatch.setattr(agreement, "exchange", fake_exchange)
    stream = types.SimpleNamespace(is_capturing=lambda: False)
    world = types.SimpleNamespace(size=4, rank=0, device_id=0)
    op = types.SimpleNamespace(plan=P.AgGemmPlan().validate(), world=world, dtype="bfloat16", trans_b=True,
                               fp8=None, n=7168, k=8192, _sms=132, _rates=RATES, _paths={},
                               _decomposed=object())
    first = common.choose_call_path(op, "ag", "ag_gemm", 8192, stream, None)
    again = common.choose_call_path(op, "ag", "ag_gemm", 8192, stream, None)
    assert again is first and len(exchanges) == 1
    assert set(op._paths) == {(8192, False, None)}
    common.choose_call_path(op, "ag", "ag_gemm", 4096, stream, None)
    forced = common.choose_call_path(op, "ag", "ag_gemm", 8192, stream, "decomposed")
    assert forced.path == "decomposed" and len(exchanges) == 3
    assert set(op._paths) == {(8192, False, None), (4096, False, None), (8192, False, "decomposed")}


@pytest.mark.parametrize("op, fp8", [("ag_gemm", False), ("gemm_rs", False), ("ag_gemm", True)])
@pytest.mark.parametrize("trans_b", [False, True])
def test_the_weights_layout_reaches_every_gemm_estimate(monkeypatch, op, fp8, trans_b):
    seen = []
    real = C.gemm_us

    def spy(*args, **kw):
        seen.append(kw.get("trans_b"))
        return real(*args, **kw)

    monkeypatch.setattr(C, "gemm_us", spy)
    plan = (P.AgGemmPlan() if op == "ag_gemm" else P.GemmRsPlan()).validate()
    C.choose_path(op, 8192, 8200, 8192, 4, plan, trans_b=trans_b, fp8=fp8)
    assert seen and all(tb is trans_b for tb in seen)


def test_decomposed_pieces_load_once_then_meet(monkeypatch):
    from types import SimpleNamespace

    from fluxrt import agreement
    from fluxrt.gemm import launch
    from fluxrt.ops import decomposed

    prepared, met = [], []
    monkeypatch.setattr(launch, "load_plain", lambda plan, i, o, t, dev: prepared.append((plan, o)))
    monkeypatch.setattr(agreement, "meet_after_load", lambda world, name: met.append(name))
    st = object.__new__(decomposed.DecomposedState)
    st.world, st._loaded = SimpleNamespace(device_id=0), set()
    st.plan = lambda rows, n, k, dtype, trans_b, capped: (rows, capped)
    op = SimpleNamespace(fp8=None, n=512, k=256, dtype="bfloat16", trans_b=True)
    st.load(op, 1536, 3, [(512, True), (172, True), (170, True), (172, True)], "float32")
    assert sorted(prepared) == [((170, True), "float32"), ((172, True), "float32"), ((512, True), "float32")]
    assert len(met) == 1 and "1536 rows in 3 chunk(s)" in met[0]
    st.load(op, 1536, 3, [(512, True)], "float32")   # the same call again: nothing loads, nobody meets
    assert len(prepared) == 3 and len(met) == 1
    st.load(op, 1536, 1, [(1536, False)], "float32")   # another chunking: its own pieces and meeting
    assert prepared[-1] == ((1536, False), "float32") and len(met) == 2
