"""Expert parallelism: MoE dispatch and combine over NVLink (``Dispatcher``).

    d = fluxrt.moe.Dispatcher(world, num_experts=256, hidden=7168, max_tokens_per_rank=4096, dtype="bf16")
    x_recv, h = d.dispatch(x, topk_idx, topk_weights)      # rows grouped by local expert; h.offsets on the GPU
    y = experts(x_recv, h.offsets)                          # e.g. a grouped GEMM over [offsets[i], offsets[i+1])
    out = d.combine(y, h)                                   # [T, H]: sum_j w[t, j] * y[row of (t, j)]

and the layer built on it (``MoELayer``: dispatch -> grouped GEMM gate/up -> SiLU * up -> grouped GEMM down ->
combine, one stream, no host sync, graph-capturable):

    layer = fluxrt.moe.MoELayer(world, 256, hidden=7168, ffn_hidden=2048, max_tokens_per_rank=4096, dtype="bf16")
    layer.set_weights(w_gate_up=wgu, w_down=wd)             # [E_local, 2 F, H], [E_local, H, F]
    y = layer.forward(x, topk_idx, topk_weights)            # [T, H]
"""
from .dispatcher import (MAX_EXPERTS, MAX_TOP_K, DispatchHandle, Dispatcher, DispatcherOptions, MoEArgumentError,
                         MoEConfig, check_config)
from .layer import MoELayer, MoELayerConfig, MoELayerOptions, check_layer_config

__all__ = ["Dispatcher", "DispatcherOptions", "DispatchHandle", "MoEArgumentError", "MoEConfig", "check_config",
           "MAX_EXPERTS", "MAX_TOP_K",
           "MoELayer", "MoELayerOptions", "MoELayerConfig", "check_layer_config"]
