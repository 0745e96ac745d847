"""The cuBLASLt baseline of the GEMM benchmarks (fluxrt.perf.cublaslt, through nvmath-python): its outputs
against a float64 reference, so a ratio against it is a ratio against a correct GEMM. Skipped without
nvmath-python.

Run on a GPU node: python3 -m pytest tests/gpu/test_perf_cublaslt.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("nvmath.bindings.cublasLt", reason="the cuBLASLt baseline needs nvmath-python")

pytestmark = pytest.mark.hopper   # FP8 cuBLASLt needs sm_89+; the suites run on Hopper

from fluxrt.perf.cublaslt import CublasLt  # noqa: E402

from gemm_checks import NP_DT, TOL, poisoned, rand_fp8, rand_matrix  # noqa: E402


@pytest.fixture(scope="module")
def lt():
    with CublasLt() as h:
        yield h


def _rel_err(got, ref) -> float:
    got = cupy.asnumpy(got).astype(np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("m,n,k", [(256, 512, 384), (333, 200, 136), (1024, 768, 1000)])
def test_lt_gemm_matches_float64(lt, rng, dtype, trans_b, m, n, k):
    a = rand_matrix(rng, (m, k), dtype)
    w = rand_matrix(rng, (n, k) if trans_b else (k, n), dtype)
    ref = a.astype(np.float64) @ (w.astype(np.float64).T if trans_b else w.astype(np.float64))
    c = poisoned((m, n), dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    da, dw = cupy.asarray(a), cupy.asarray(w)
    cupy.cuda.Device().synchronize()
    run = lt.gemm(da, dw, c, trans_b=trans_b, stream=stream)
    c.view(cupy.uint16).fill(0x7FC0 if dtype == "bfloat16" else 0x7E00)   # poison again after the timing
    run()
    stream.synchronize()
    assert 0 <= run.choice.index < run.choice.candidates
    assert _rel_err(c, ref) < TOL[dtype]
    cfg = run.choice.config   # the chosen algorithm's attributes, as the suites record them
    assert cfg["tile"].startswith("TILE_") and cfg["split_k"] >= 0, cfg


@pytest.mark.parametrize("fast", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("m,n,k", [(256, 512, 512), (1000, 384, 2048)])
def test_lt_fp8_per_tensor_matches_float64(lt, rng, fast, m, n, k):
    a8, b8 = rand_fp8(rng, (m, k), "e4m3"), rand_fp8(rng, (n, k), "e4m3")
    sa, sb = np.float32(rng.uniform(0.5, 2.0)), np.float32(rng.uniform(0.5, 2.0))
    ref = float(sa) * float(sb) * (a8.astype(np.float64) @ b8.astype(np.float64).T)
    da, db = cupy.asarray(a8.view(np.uint8)), cupy.asarray(b8.view(np.uint8))
    dsa, dsb = cupy.asarray(sa).reshape(()), cupy.asarray(sb).reshape(())
    c = poisoned((m, n), "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    run = lt.gemm(da, db, c, trans_b=True, stream=stream, fp8_format="e4m3", scale_a=dsa, scale_b=dsb,
                  fast_accum=fast)
    c.view(cupy.uint16).fill(0x7FC0)
    run()
    stream.synchronize()
    assert _rel_err(c, ref) < TOL["bfloat16"]


def test_lt_fp8_needs_scales(lt):
    a = cupy.zeros((128, 128), dtype=cupy.uint8)
    c = cupy.empty((128, 128), dtype=NP_DT["bfloat16"])
    with pytest.raises(ValueError, match="scale_a and scale_b"):
        lt.gemm(a, a, c, trans_b=True, stream=cupy.cuda.Stream(), fp8_format="e4m3")
