"""Hopper GEMM engine: ``C = A @ B`` (or ``A @ B.T``) with a main loop fluxrt owns (kernels/gemm/hopper_gemm.cu).

Public entry point: :func:`gemm` (16-bit inputs, or fp8 with per-tensor / block scales: :mod:`.fp8`). The fused ops (AllGather+GEMM, GEMM+ReduceScatter) use
:func:`gemm_with_hooks`, which compiles the two hooks into the kernel:

* :class:`ArrivalWait`   -- before loading A for a tile, the producer waits (bounded, acquire.sys, then
  fence.proxy.async) until ``flags[m_block_start // chunk_rows] >= epoch``.
* :class:`TileEpilogue`  -- finished tiles of chunk ``row // chunk_rows`` go by TMA store to that chunk's
  destination (:class:`TileDestinations`: row ``row - chunk*chunk_rows`` of a row-major array, e.g. a
  peer's symmetric buffer) and, when ``flag_table`` is given, raise
  ``flag_table[chunk][local_m_tile * n_tiles + n_tile]`` (set to / add ``signal_value``, release.sys),
  issued from the storer warp of the producer warpgroup.
* :class:`ChunkReduce`   -- (with TileEpilogue) the tiles of one chunk instead get the other sources'
  partials of their rows added in the consumers' epilogue, each after its flag, and go to ``out``:
  the reduce of GEMM+ReduceScatter fused into the GEMM that makes the last partial.
* :class:`RowBands`      -- A or C holds the GEMM's rows in bands with padding rows left out: the fused
  ops' padded calls read A in place (TMA fills the padding rows with zeros) or write C in place (TMA
  clips them), instead of copying through a padded buffer.

Mixture-of-experts layers use :func:`grouped_gemm` (module ``grouped``): G problems ``a[rows of g] @ b[g]`` in one
persistent launch, the groups' rows given by a device array of offsets that the host never reads (no host sync,
graph-capturable).

Every argument is validated before the first CUDA call (so mistakes surface as exceptions that name
the shapes, and the checks run on CPU-only machines).

Modules: ``plan`` (tile shape, stages, order: pure Python), ``hooks`` (the fused ops' hook arguments),
``autotune`` (timed plan choice and its on-disk cache), ``checks`` (argument validation), ``kernel`` (compile-time configuration and loaded modules), ``tmaps``
(TMA descriptors and order tables), ``launch`` (one call from arguments to the launch).
"""
from ..errors import GemmArgumentError, GemmTypeError
from .checks import Fp8Problem, validate_fp8_args, validate_gemm_args
from .hooks import (BANDS_A, BANDS_C, DEFAULT_TIMEOUT_NS, REDUCE_WHERE, ArrivalWait, ChunkReduce, GroupArrival,
                    GroupScatter, RowBands, ShardCopy, TileDestinations, TileEpilogue, band_bits, reduce_hook_id)
from .kernel import KERNEL_NAME, KERNEL_SOURCE, compile_options, kernel_defines
from .launch import gemm, gemm_with_hooks
from .autotune import TuneResult, autotune, plan_for, tuned_plan
from .launch import clear_launch_cache
from .plan import FP8_FORMATS, SCALE_MODES, GemmPlan, fp8_heuristic_plan, fp8_plans, heuristic_plan, plan_gemm
from .grouped import clear_grouped_cache, grouped_gemm, grouped_plan, validate_grouped_args

__all__ = ["gemm", "gemm_with_hooks", "grouped_gemm", "grouped_plan", "validate_grouped_args", "clear_grouped_cache",
           "GemmPlan", "plan_gemm", "heuristic_plan", "plan_for", "autotune",
           "tuned_plan", "TuneResult", "clear_launch_cache", "ArrivalWait", "GroupArrival", "GroupScatter",
           "TileEpilogue",
           "TileDestinations",
           "ChunkReduce", "ShardCopy", "RowBands", "GemmArgumentError", "GemmTypeError", "validate_gemm_args",
           "validate_fp8_args", "Fp8Problem", "fp8_plans", "fp8_heuristic_plan", "FP8_FORMATS", "SCALE_MODES",
           "kernel_defines", "compile_options", "band_bits", "reduce_hook_id", "BANDS_A", "BANDS_C",
           "DEFAULT_TIMEOUT_NS", "REDUCE_WHERE", "KERNEL_NAME", "KERNEL_SOURCE"]
