"""Element types. bf16 is ``ml_dtypes.bfloat16``, which CuPy 14 stores, computes on and exchanges
through DLPack (kDLBfloat); ``fluxrt.bfloat16`` is that same numpy dtype."""
from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

_ALIASES = {
    "bf16": bfloat16, "bfloat16": bfloat16,
    "fp16": np.dtype(np.float16), "half": np.dtype(np.float16), "float16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32), "float": np.dtype(np.float32), "float32": np.dtype(np.float32),
    "fp64": np.dtype(np.float64), "double": np.dtype(np.float64), "float64": np.dtype(np.float64),
}


def normalize_dtype(dtype) -> np.dtype:
    """numpy dtype for a name ('bf16', 'fp16', 'float32', ...), a numpy/ml_dtypes type, or a dtype."""
    if isinstance(dtype, str) and dtype.lower() in _ALIASES:
        return _ALIASES[dtype.lower()]
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"unsupported dtype {dtype!r}: use bf16, fp16, fp32, int32, uint64 or a numpy dtype") from e


def short_name(dtype) -> str:
    d = normalize_dtype(dtype)
    return {bfloat16: "bf16", np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32",
            np.dtype(np.float64): "fp64"}.get(d, d.name)
