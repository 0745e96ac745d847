"""Element types. bf16 is ``ml_dtypes.bfloat16``, which CuPy 14 stores, computes on and exchanges
through DLPack (kDLBfloat); ``fluxrt.bfloat16`` is that same numpy dtype.

Dtypes of other producers are read by name, so that no framework is imported: ``torch.bfloat16``
prints as 'torch.bfloat16', JAX's bfloat16 is ml_dtypes' own; all of them normalise to 'bfloat16'.
"""
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
_FRAMEWORK_PREFIXES = ("torch.", "jax.numpy.", "jnp.")


def _by_name(name: str) -> np.dtype | None:
    for prefix in _FRAMEWORK_PREFIXES:
        name = name.removeprefix(prefix)
    if name.lower() in _ALIASES:
        return _ALIASES[name.lower()]
    kind = getattr(ml_dtypes, name, None)   # float8_e4m3fn, ... (not registered with numpy by name)
    if kind is not None:
        try:
            return np.dtype(kind)
        except TypeError:
            return None
    try:
        return np.dtype(name)
    except TypeError:
        return None


def normalize_dtype(dtype) -> np.dtype:
    """numpy dtype for a name ('bf16', 'fp16', 'float32', ...), a numpy/ml_dtypes type, a dtype, or a
    framework's dtype object (torch.bfloat16, JAX dtypes)."""
    if isinstance(dtype, np.dtype):
        return dtype
    if isinstance(dtype, str):
        found = _by_name(dtype)
    else:
        try:
            return np.dtype(dtype)
        except TypeError:
            found = _by_name(str(dtype))
    if found is None:
        raise TypeError(f"unsupported dtype {dtype!r}: use bf16, fp16, fp32, int32, uint64 or a numpy dtype")
    return found


def dtype_name(dtype) -> str:
    """The canonical (numpy) name of `dtype`: 'bfloat16', 'float16', ...; an unknown dtype keeps its text."""
    try:
        return normalize_dtype(dtype).name
    except TypeError:
        return str(getattr(dtype, "name", dtype))


def short_name(dtype) -> str:
    d = normalize_dtype(dtype)
    return {bfloat16: "bf16", np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32",
            np.dtype(np.float64): "fp64"}.get(d, d.name)
