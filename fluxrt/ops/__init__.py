"""Fused tensor-parallel ops with tile-granular communication/computation overlap (FLUX-style).

    AllGatherGemm       C [M, N] = allgather(A shards [M/world, K]) @ B        (column-parallel linear)
    GemmReduceScatter   out [M/world, N] = this rank's rows of sum_r A_r @ B_r   (row-parallel linear)

Each op has a planner (fluxrt.ops.plan: chunking, flag layout, tile order, comm mode) whose plan is a
printable dataclass and can be passed to the constructor to override the default::

    ag = fluxrt.ops.AllGatherGemm(world, max_m=8192, n=7168, k=8192, dtype="bf16")
    rs = fluxrt.ops.GemmReduceScatter(world, max_m=8192, n=8192, k=7168, dtype="bf16")
    h = ag.forward(x_shard, w1, stream=s)        # [8192, 7168] from x_shard [8192/world, 8192]
    y = rs.forward(h_act, w2, stream=s)          # [8192/world, 8192]
    world.synchronize(s)                         # raises WaitTimeoutError naming op, rank and peer

Both are collective (same calls, same shapes, same order on every rank), reusable without re-allocation
and stream-ordered; M must be a multiple of world. Shards of whole 128-row tiles (AllGatherGemm: times
plan.chunks_per_rank) take the fast path, other shards are padded inside the op (fluxrt.ops.plan).
Each call runs the fused kernel or, where a cost model predicts it to lose and inside a CUDA-graph capture,
the decomposed path (chunked collectives beside plain GEMMs; fluxrt.ops.cost, fluxrt.ops.decomposed);
``plan.path`` or ``forward(..., path=...)`` overrides the choice. ``fp8=Fp8Options(format, scale)`` makes
either op take fp8 inputs with per-tensor or block scales (decomposed path only). TPMLP is the MLP block
built on both.
"""
from .ag_gemm import AllGatherGemm
from .cost import PathChoice, choose_path
from .gemm_rs import GemmReduceScatter
from .mlp import TPMLP
from .plan import AgGemmPlan, Fp8Options, GemmRsPlan, OpsArgumentError, plan_ag_gemm, plan_gemm_rs

__all__ = ["AllGatherGemm", "GemmReduceScatter", "TPMLP", "AgGemmPlan", "GemmRsPlan", "Fp8Options", "OpsArgumentError",
           "PathChoice", "choose_path", "plan_ag_gemm", "plan_gemm_rs"]
