"""Expert parallelism: MoE dispatch and combine over NVLink (``Dispatcher``).

    d = fluxrt.moe.Dispatcher(world, num_experts=256, hidden=7168, max_tokens_per_rank=4096, dtype="bf16")
    x_recv, h = d.dispatch(x, topk_idx, topk_weights)      # rows grouped by local expert; h.offsets on the GPU
    y = experts(x_recv, h.offsets)                          # e.g. a grouped GEMM over [offsets[i], offsets[i+1])
    out = d.combine(y, h)                                   # [T, H]: sum_j w[t, j] * y[row of (t, j)]
"""
from .dispatcher import (MAX_EXPERTS, MAX_TOP_K, DispatchHandle, Dispatcher, DispatcherOptions, MoEArgumentError,
                         MoEConfig, check_config)

__all__ = ["Dispatcher", "DispatcherOptions", "DispatchHandle", "MoEArgumentError", "MoEConfig", "check_config",
           "MAX_EXPERTS", "MAX_TOP_K"]
