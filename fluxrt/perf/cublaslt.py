"""cuBLASLt as a GEMM baseline, through nvmath-python's low-level bindings (an optional perf dependency).

cublasGemmEx (the GEMM benchmarks' ``cublas`` column, what cupy.matmul runs) takes cuBLAS's default
algorithm. cuBLASLt offers several per problem; :class:`CublasLt` asks its heuristic for the best few, times
each once on the real operands and keeps the fastest, so the baseline is cuBLAS at its best for that shape
(the GEMM counterpart of running NCCL in its fastest mode). FP8 runs with per-tensor scales, as
``torch._scaled_mm`` does, with fast accumulation on or off (fluxrt's per-tensor FP8 kernel accumulates
each tile's whole K in the wgmma's own fp32 registers, which is cuBLASLt's fast accumulation).

Row-major ``C[M, N] = A[M, K] @ W`` with ``W`` [K, N] or, ``trans_b``, ``W`` [N, K] (``A @ W.T``) is the
column-major ``C^T = W^T @ A^T``: cuBLASLt's first operand is ``W`` (transposed when it is [N, K], the only
FP8 layout cuBLASLt takes on Hopper), its second ``A``. Nothing is allocated per call and the launch is a
single cublasLtMatmul, so the callables can be captured in a CUDA graph.

The wheel: ``pip install nvmath-python`` (it finds cuBLASLt in the nvidia-cublas wheel or the CUDA
toolkit); offline GPU nodes carry it with the other wheels.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .timing import eager_ms

log = logging.getLogger(__name__)

# cudaDataType_t / cublasComputeType_t / cublasOperation_t values (CUDA's library_types.h, cublas_api.h)
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 2, 14, 28, 29
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_TYPES = {"bfloat16": _CUDA_R_16BF, "float16": _CUDA_R_16F, "e4m3": _CUDA_R_8F_E4M3, "e5m2": _CUDA_R_8F_E5M2}


class CublasLtUnavailable(ImportError):
    """nvmath-python (or the cuBLASLt library it loads) is missing: the cuBLASLt baseline cannot run."""


def _bindings():
    try:
        from nvmath.bindings import cublasLt
    except Exception as e:   # not installed, or its libraries do not load
        raise CublasLtUnavailable(f"the cuBLASLt baseline needs nvmath-python ({type(e).__name__}: {e}); "
                                  "pip install nvmath-python") from e
    return cublasLt


@dataclass(frozen=True)
class LtChoice:
    """The algorithm a :meth:`CublasLt.gemm` callable runs: its rank in the heuristic's list, how many were
    timed, and the time of each (us, one call, in the heuristic's order; None where the algorithm failed)."""
    index: int
    candidates: int
    times_us: tuple
    config: dict = None   # the algorithm's configuration attributes (see algo_config), None where unreadable


# cublasLtMatmulAlgoConfigAttributes_t -> the enum that names its values (None: a plain number)
_CONFIG_ATTRS = (("id", "ID", None), ("tile", "TILE_ID", "MatmulTile"), ("stages", "STAGES_ID", "MatmulStages"),
                 ("split_k", "SPLITK_NUM", None), ("reduction", "REDUCTION_SCHEME", "ReductionScheme"),
                 ("swizzle", "CTA_SWIZZLING", None), ("custom", "CUSTOM_OPTION", None),
                 ("inner", "INNER_SHAPE_ID", "MatmulInnerShape"), ("cluster", "CLUSTER_SHAPE_ID", "ClusterShape"))


def algo_config(lt, algo_ptr: int) -> dict:
    """The configuration of the cublasLtMatmulAlgo_t at ``algo_ptr``: kernel id, tile, stages, split-K, reduction
    scheme, CTA swizzle, cluster shape. Tile and cluster are in cuBLASLt's terms: its M is fluxrt's N (C^T)."""
    out = {}
    for key, attr_name, enum_name in _CONFIG_ATTRS:
        attr = getattr(lt.MatmulAlgoConfigAttribute, attr_name, None)
        if attr is None:
            continue
        buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
        written = np.zeros(1, dtype=np.uint64)
        try:
            lt.matmul_algo_config_get_attribute(algo_ptr, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
        except Exception as e:   # an attribute this cuBLASLt does not have
            log.debug("cuBLASLt algorithm attribute %s: %s", attr_name, e)
            continue
        value = int(buf[0])
        enum = getattr(lt, enum_name, None) if enum_name else None
        if enum is not None:
            try:
                value = enum(value).name
            except ValueError:
                pass
        out[key] = value
    return out


def describe_config(cfg: dict | None) -> str:
    """One line for a table: 'TILE_128x256 STAGES_64x4 k1 SHAPE_2x1x1 id 66' (cuBLASLt's M first)."""
    if not cfg:
        return ""
    parts = [str(cfg.get("tile", "")), str(cfg.get("stages", "")), f"k{cfg.get('split_k', 1)}",
             str(cfg.get("cluster", "")), f"id {cfg.get('id', '?')}"]
    return " ".join(p for p in parts if p)


class CublasLt:
    """One cuBLASLt handle and workspace on the current device; :meth:`gemm` builds callables on it.
    :meth:`close` (or use as a context manager) frees the descriptors and the handle."""

    def __init__(self, workspace_bytes: int = 32 << 20):
        import cupy

        self._lt = _bindings()
        self.handle = self._lt.create()
        self.workspace = cupy.empty((workspace_bytes,), dtype=cupy.uint8)
        self._owned: list[tuple] = []   # (destroy function, descriptor)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for destroy, d in reversed(self._owned):
            destroy(d)
        self._owned.clear()
        if self.handle:
            self._lt.destroy(self.handle)
            self.handle = 0

    def version(self) -> int:
        return int(self._lt.get_version())

    # -- descriptors -------------------------------------------------------------------------------------------
    def _set(self, setter, desc, attr, value, dtype) -> None:
        buf = np.array([value], dtype=dtype)
        setter(desc, attr, buf.ctypes.data, buf.nbytes)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        d = self._lt.matrix_layout_create(dtype, rows, cols, ld)
        self._owned.append((self._lt.matrix_layout_destroy, d))
        return d

    def gemm(self, a, w, c, *, trans_b: bool, stream, fp8_format: str | None = None, scale_a=None, scale_b=None,
             fast_accum: bool = True, candidates: int = 8, iters: int = 5) -> "callable":
        """A callable that runs ``c = a @ w`` (or ``a @ w.T``) on ``stream`` (a CuPy stream) through the fastest
        of the heuristic's first ``candidates`` cuBLASLt algorithms, each timed over ``iters`` calls here (the
        operands' contents are overwritten only in ``c``). FP8: ``a`` and ``w`` hold e4m3/e5m2 bytes (uint8),
        ``scale_a`` / ``scale_b`` one float32 each on the device (``c = scale_a * scale_b * (a @ w)``).
        The callable's ``choice`` attribute is an :class:`LtChoice`."""
        lt = self._lt
        m, k = a.shape
        n = c.shape[1]
        in_type = _TYPES[fp8_format] if fp8_format else _TYPES[a.dtype.name]
        out_type = _TYPES[c.dtype.name]
        desc = lt.matmul_desc_create(_COMPUTE_32F, _CUDA_R_32F)
        self._owned.append((lt.matmul_desc_destroy, desc))
        A = lt.MatmulDescAttribute
        self._set(lt.matmul_desc_set_attribute, desc, A.TRANSA, _OP_T if trans_b else _OP_N, np.int32)
        self._set(lt.matmul_desc_set_attribute, desc, A.TRANSB, _OP_N, np.int32)
        if fp8_format:
            if scale_a is None or scale_b is None:
                raise ValueError("FP8 needs scale_a and scale_b (one float32 each on the device)")
            # cuBLASLt's A is fluxrt's W, its B fluxrt's A
            self._set(lt.matmul_desc_set_attribute, desc, A.A_SCALE_POINTER, scale_b.data.ptr, np.int64)
            self._set(lt.matmul_desc_set_attribute, desc, A.B_SCALE_POINTER, scale_a.data.ptr, np.int64)
            self._set(lt.matmul_desc_set_attribute, desc, A.FAST_ACCUM, 1 if fast_accum else 0, np.int8)
        # column-major views: W^T is [N, K] (trans_b: stored [K, N] col-major = W [N, K] row-major), A^T [K, M]
        w_desc = self._layout(in_type, k, n, k) if trans_b else self._layout(in_type, n, k, n)
        a_desc = self._layout(in_type, k, m, k)
        c_desc = self._layout(out_type, n, m, n)

        pref = lt.matmul_preference_create()
        self._owned.append((lt.matmul_preference_destroy, pref))
        self._set(lt.matmul_preference_set_attribute, pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                  self.workspace.nbytes, np.uint64)
        results = np.zeros(candidates, dtype=lt.matmul_heuristic_result_dtype)
        found = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(self.handle, desc, w_desc, a_desc, c_desc, c_desc, pref, candidates,
                                     results.ctypes.data, found.ctypes.data)
        count = int(found[0])
        if count == 0:
            raise RuntimeError(f"cuBLASLt has no algorithm for M={m} N={n} K={k} ({fp8_format or a.dtype.name})")
        alpha, beta = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)
        ws_ptr, ws_size = self.workspace.data.ptr, self.workspace.nbytes

        algo_offset = results.dtype.fields["algo"][1]

        def runner(i: int):
            algo_ptr = results.ctypes.data + i * results.itemsize + algo_offset

            def run() -> None:
                lt.matmul(self.handle, desc, alpha.ctypes.data, w.data.ptr, w_desc, a.data.ptr, a_desc,
                          beta.ctypes.data, c.data.ptr, c_desc, c.data.ptr, c_desc, algo_ptr, ws_ptr, ws_size,
                          stream.ptr)

            return run

        runs, times = [], []
        for i in range(count):
            fn = runner(i)
            try:
                fn()
                times.append(1e3 * eager_ms(fn, iters, stream))
            except Exception as e:   # an algorithm the heuristic offered that does not run here: skipped
                log.debug("cuBLASLt algorithm %d failed: %s", i, e)
                times.append(None)
            runs.append(fn)
        ok = [i for i, t in enumerate(times) if t is not None]
        if not ok:
            raise RuntimeError(f"no cuBLASLt algorithm ran for M={m} N={n} K={k}")
        best = min(ok, key=lambda i: times[i])
        run = runs[best]
        config = algo_config(lt, results.ctypes.data + best * results.itemsize + algo_offset)
        run.choice = LtChoice(best, count, tuple(times), config)
        run.keepalive = (alpha, beta, results)
        return run
