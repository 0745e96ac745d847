"""CPU tests of the fused allreduce + RMSNorm and the compressed collectives: planning, argument checks and
the error of the block-scaled formats (a numpy model of the kernels' arithmetic)."""
from __future__ import annotations

import numpy as np
import pytest

from fluxrt import collectives_plan as plan
from fluxrt import compressed, fused
from fluxrt.errors import CollectiveArgumentError

TUNING = plan.Tuning()
HALF = 128 << 20


def _plan(rows, cols, n, algo="auto", half=HALF):
    return fused.plan_allreduce_rmsnorm(rows, cols, n, 2, half, TUNING.ll_buffer_bytes(n) // 2, TUNING, algo)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 8, 32, 128, 512, 2048, 8192])
@pytest.mark.parametrize("cols", [4096, 7168, 8192, 4097, 1])
def test_plan_covers_every_row_once_and_fits(n, rows, cols):
    p = _plan(rows, cols, n)
    lines = -(-cols * 2 // 8)
    assert p.threads % 32 == 0 and 32 <= p.threads <= fused.MAX_THREADS
    covered = [r for piece in p.pieces for r in range(piece.row, piece.row + piece.rows)]
    assert covered == list(range(rows))
    if p.algo == "ll":
        assert rows * cols * 2 <= TUNING.ll_max_bytes and rows * lines * 16 <= p.slot_bytes
        assert len(p.pieces) == 1
    else:
        assert p.row_pitch == lines * 8 and p.slot_bytes % 16 == 0
        assert 2 * n * p.slot_bytes <= HALF
        for piece in p.pieces:
            assert fused.piece_chunk_rows(piece, n) * p.row_pitch <= p.slot_bytes
            assert 1 <= piece.grid <= plan.MAX_BLOCKS


def test_small_messages_take_ll_large_take_twoshot():
    assert _plan(1, 8192, 4).algo == "ll"
    assert _plan(16, 8192, 4).algo == "ll"
    assert _plan(128, 8192, 4).algo == "twoshot"
    assert _plan(1, 8192, 4, algo="twoshot").algo == "twoshot"


def test_plan_refusals_name_the_cause():
    with pytest.raises(CollectiveArgumentError, match="LL buffer"):
        _plan(8192, 8192, 4, algo="ll")
    with pytest.raises(CollectiveArgumentError, match="workspace"):
        _plan(4, 1 << 20, 4, half=1 << 20)
    with pytest.raises(CollectiveArgumentError, match="algo"):
        _plan(4, 64, 4, algo="ring")


def test_scales_shape():
    assert fused.scales_shape(5, 1000, None) is None
    assert fused.scales_shape(5, 1000, "per_token") == (5,)
    assert fused.scales_shape(5, 1000, "per_block") == (5, 8)


class _Arr:
    def __init__(self, ptr, nbytes):
        self.data = type("D", (), {"ptr": ptr})()
        self.nbytes = nbytes


def test_aliasing_allows_only_the_in_place_pairs():
    x, res, out = _Arr(0, 100), _Arr(1000, 100), _Arr(0, 100)
    fused.check_aliasing({"x": x, "residual": res, "out": out}, {("x", "out")})
    with pytest.raises(CollectiveArgumentError, match="overlaps"):
        fused.check_aliasing({"x": x, "residual": res, "out": _Arr(1050, 100)}, {("x", "out")})
    with pytest.raises(CollectiveArgumentError, match="overlaps"):  # the same start but not the same view
        fused.check_aliasing({"x": x, "out": _Arr(0, 50)}, {("x", "out")})


@pytest.mark.parametrize("op", compressed.COMPRESSED_OPS)
@pytest.mark.parametrize("count", [1, 127, 128, 1000, 1 << 20, (1 << 29) + 5])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_compressed_pieces_cover_and_fit(op, count, n):
    pieces = compressed.compressed_pieces(op, count, n, HALF)
    assert sum(p.count for p in pieces) == count
    assert [p.start for p in pieces] == list(np.cumsum([0] + [p.count for p in pieces[:-1]]))
    areas = 2 if op == "allreduce" else 1
    for p in pieces:
        assert areas * n * compressed.slot_bytes(p.chunk) <= HALF
        assert 1 <= p.grid <= plan.MAX_BLOCKS
        if op == "allreduce":
            assert p.chunk % compressed.GROUP == 0 and p.chunk * n >= p.count
        else:
            assert p.chunk == p.count


def test_compress_validation():
    assert compressed.validate_compress("FP8", "allreduce") == "fp8"
    with pytest.raises(CollectiveArgumentError, match="compress"):
        compressed.validate_compress("fp4", "allreduce")
    with pytest.raises(CollectiveArgumentError, match="sums"):
        compressed.validate_compress("int8", "allreduce", "max")
    with pytest.raises(CollectiveArgumentError, match="algo"):
        compressed.validate_compress("int8", "allreduce", "sum", "ring")
    assert compressed.wire_bytes(1024, 2) == (2048, 1024 + 32)


def _quantized(v, fmt):
    import ml_dtypes

    g = v.astype(np.float32).reshape(-1, 128)
    scale = (np.abs(g).max(axis=1, keepdims=True) / np.float32(448 if fmt == "fp8" else 127)).astype(np.float32)
    s = (g / scale).astype(np.float32)
    c = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) if fmt == "fp8" else np.clip(np.rint(s), -127, 127)
    return (c * scale).reshape(-1)


@pytest.mark.parametrize("fmt, one, two", [("fp8", 2.6e-2, 3.6e-2), ("int8", 6.5e-3, 9.2e-3)])
def test_documented_errors_of_the_formats(fmt, one, two):
    """The table in fluxrt.compressed's docstring: one quantization (allgather, reduce_scatter) and two
    (allreduce) of normal data, relative to the float64 sum, within 5 %."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(1 << 16).astype(np.float32) for _ in range(4)]
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    rs = np.sum([_quantized(x, fmt) for x in xs], axis=0, dtype=np.float32)
    ar = _quantized(rs, fmt)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(rs, ref) == pytest.approx(one, rel=0.05)
    assert rel(ar, ref) == pytest.approx(two, rel=0.05)


def test_perf_allreduce_rmsnorm_is_a_subcommand_with_checked_flags():
    from fluxrt.perf import cli
    from fluxrt.perf import fused as perf_fused

    assert cli.BENCHES["allreduce_rmsnorm"] == "fluxrt.perf.fused" and "allreduce_rmsnorm" in cli.SUMMARIES
    args = perf_fused.parse_options(["-T", "1,8", "-H", "4097", "--impls", "fused,fluxrt_ar"])
    assert args.tokens == (1, 8) and args.hidden == (4097,) and args.impl_list == ["fused", "fluxrt_ar"]
    for bad in (["--impls", "fused,cublas"], ["-T", "0"], ["--algo", "ring"], ["-n", "0"]):
        with pytest.raises(SystemExit):
            perf_fused.parse_options(bad)
    r = perf_fused.ratios({"fused": 10.0, "fluxrt_ar": 9.8, "nccl_ar+norm": 20.0, "fused_fp8": 10.2})
    assert r["fused_over_fluxrt_ar"] == pytest.approx(10 / 9.8) and r["nccl_norm_over_fused"] == 2.0
    assert r["fp8_over_fused"] == pytest.approx(1.02) and r["fluxrt_norm_over_fused"] is None


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter"])
def test_collective_sweeps_take_compress(op):
    from fluxrt.perf import collectives as perf_coll

    _, args, _, _ = perf_coll.parse_options(op, ["--compress", "int8"])
    assert args.compress == "int8"
    with pytest.raises(SystemExit):
        perf_coll.parse_options(op, ["--compress", "fp4"])
    with pytest.raises(SystemExit):   # not on the ops without a compressed form
        perf_coll.parse_options("alltoall", ["--compress", "fp8"])


def test_fast_path_key_is_hashable_and_tells_calls_apart(monkeypatch):
    """The key under which a call's launches are reused (the world's cross-rank check off): addresses and
    layouts only, so it hashes; any other array or option is another key; missing outputs: no key."""
    import cupy

    class Fake:
        def __init__(self, ptr, shape=(4, 64), dtype=np.uint16):
            self.data = type("D", (), {"ptr": ptr})()
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.strides = (shape[-1] * self.dtype.itemsize, self.dtype.itemsize)

    monkeypatch.setattr(cupy, "ndarray", Fake)
    x, res, w, out, ro = Fake(0x1000), Fake(0x2000), Fake(0x3000, (64,)), Fake(0x4000), Fake(0x5000)
    key = fused.call_key(x, out, res, w, ro, None, 1e-6, None, "auto")
    assert hash(key) == hash(fused.call_key(x, out, res, w, ro, None, 1e-6, None, "auto"))
    others = [fused.call_key(x, out, Fake(0x6000), w, ro, None, 1e-6, None, "auto"),
              fused.call_key(x, out, res, w, ro, None, 1e-5, None, "auto"),
              fused.call_key(x, out, res, w, ro, None, 1e-6, None, "ll"),
              fused.call_key(x, out, res, w, ro, Fake(0x7000, (4,), np.float32), 1e-6, "per_token", "auto")]
    assert all(k is not None and k != key for k in others) and len({hash(k) for k in others}) == 4
    assert fused.call_key(x, None, res, w, ro, None, 1e-6, None, "auto") is None
    assert fused.call_key(x, out, res, w, ro, None, 1e-6, "per_token", "auto") is None
    assert fused.call_key(x, out, res, [1.0], ro, None, 1e-6, None, "auto") is None


def test_example_weight_quantization_round_trips():
    """examples/norm_fp8_ag_gemm.py's 128 x 128 block quantization of the weight: every element within half an
    e4m3 ulp (2^-4 relative, subnormal steps of the block scale) of the float64 value, scales absmax / 448."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "norm_fp8_ag_gemm.py"
    spec = importlib.util.spec_from_file_location("norm_fp8_ag_gemm", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((200, 300)) * np.exp2(rng.integers(-6, 6, size=(200, 1)))
    codes, scales = ex.quantize_blocks(w)
    assert codes.dtype == np.uint8 and codes.shape == w.shape and scales.shape == (2, 3)
    assert np.isclose(scales[1, 2], np.abs(w[128:, 256:]).max() / 448.0, rtol=1e-6)
    back = ex.dequantize(codes, scales, 128)
    full = np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:200, :300]
    assert np.all(np.abs(back - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * full)


def test_fused_kernels_meet_the_other_ranks_at_their_first_collective_use(monkeypatch):
    from types import SimpleNamespace

    from fluxrt.registry import Registry

    monkeypatch.setattr(fused._Kernels, "__init__", lambda self: setattr(self, "met", False))
    exchanges = []
    comm = SimpleNamespace(allgather=lambda payload: exchanges.append(payload) or [payload, payload])
    world = SimpleNamespace(registry=Registry(), comm=comm, rank=0, size=2, options=SimpleNamespace(timeout_s=5.0))
    k = fused.kernels(world, collective=False)   # add_rmsnorm: local, so no meeting
    assert exchanges == []
    assert fused.kernels(world) is k and len(exchanges) == 1   # the first collective call meets once
    assert fused.kernels(world) is k and len(exchanges) == 1   # later calls do not
    single = SimpleNamespace(registry=Registry(), comm=None, rank=0, size=1, options=SimpleNamespace(timeout_s=5.0))
    fused.kernels(single)   # one rank: nobody to meet
    assert len(exchanges) == 1
