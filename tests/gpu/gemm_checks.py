"""Shared pieces of the GEMM tests (dense, grouped, fp8): random operands, NaN-poisoned outputs and the
relative-error bounds per output type."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from fluxrt.gemm.plan import FP8_FORMATS  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
NP_DT = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-3}
NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00}


def rand_matrix(rng, shape, dtype: str) -> np.ndarray:
    """Random values in +-[0.25, 1): never zero, exactly representable once rounded to `dtype`."""
    mag = rng.uniform(0.25, 1.0, size=shape)
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(NP_DT[dtype])


def rand_fp8(rng, shape, fmt: str) -> np.ndarray:
    """Random fp8 values (never zero, magnitudes over 2^-3 .. 2^2): the numpy float8 array itself."""
    mag = rng.uniform(1.0, 2.0, size=shape) * np.exp2(rng.integers(-3, 2, size=shape))
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.dtype(getattr(ml_dtypes, FP8_FORMATS[fmt])))


def poisoned(shape, dtype: str):
    """Output buffer filled with NaN so unwritten elements are caught."""
    out = cupy.empty(shape, dtype=NP_DT[dtype])
    if dtype == "float32":
        out.fill(np.nan)
    else:
        out.view(cupy.uint16).fill(NAN_BITS[dtype])
    return out
