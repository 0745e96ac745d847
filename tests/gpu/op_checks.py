"""Checks the fused-op GPU tests share (test_ops, test_ops_decomposed, test_ops_fp8): outputs poisoned with NaN
before a call, and compared with a float64 reference by max |err| / max |ref|."""
from __future__ import annotations

import numpy as np

TOL = {"bfloat16": 1.5e-2, "float16": 4e-3}   # max |err| / max |ref|: output rounding + partial rounding


def np_dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def poisoned(shape, dtype):
    """An output filled with quiet NaNs, so any element the op does not write fails the check."""
    import cupy

    out = cupy.empty(shape, dtype=np_dtype(dtype))
    out.view(np.uint16).fill(0x7FC0 if dtype == "bfloat16" else 0x7E00)   # quiet NaN bit patterns
    return out


def f64(x):
    import cupy

    if isinstance(x, cupy.ndarray):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def problem(got, ref, dtype, what) -> str | None:
    """Why `got` does not match the float64 reference (None when it does)."""
    got = f64(got)
    if got.shape != ref.shape:
        return f"{what}: shape {got.shape} != {ref.shape}"
    if not np.isfinite(got).all():
        return f"{what}: {int((~np.isfinite(got)).sum())} non-finite values (poison not overwritten?)"
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    return f"{what}: relative error {err:.3g} >= {TOL[dtype]}" if not err < TOL[dtype] else None


class Problems(list):
    """Checks inside loops with collective steps: collect, assert once after the loop (a rank that stopped
    early would leave its peers waiting in the next collective)."""

    def check(self, got, ref, dtype, what):
        p = problem(got, ref, dtype, what)
        if p:
            self.append(p)

    def assert_none(self):
        assert not self, "; ".join(self[:5]) + (f" (+{len(self) - 5} more)" if len(self) > 5 else "")
