"""Fused tensor-parallel ops with tile-granular communication/computation overlap (FLUX-style).

    AllGatherGemm       C [M, N] = allgather(A shards [M/world, K]) @ B        (column-parallel linear)
    GemmReduceScatter   out [M/world, N] = this rank's rows of sum_r A_r @ B_r   (row-parallel linear)

Each op has a planner (fluxrt.ops.plan: chunking, flag layout, tile order, comm mode) whose plan is a
printable dataclass and can be passed to the constructor to override the default.
"""
from .ag_gemm import AllGatherGemm
from .gemm_rs import GemmReduceScatter
from .plan import AgGemmPlan, GemmRsPlan, OpsArgumentError, plan_ag_gemm, plan_gemm_rs

__all__ = ["AllGatherGemm", "GemmReduceScatter", "AgGemmPlan", "GemmRsPlan", "OpsArgumentError",
           "plan_ag_gemm", "plan_gemm_rs"]
