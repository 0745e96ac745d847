"""The tensor-parallel MLP block as a user writes it: AllGather+GEMM (gate and up) -> SiLU-and-multiply ->
GEMM+ReduceScatter (down), on one stream.

    mlp = fluxrt.ops.TPMLP(world, max_m=8192, hidden=8192, ffn=28672 // world.size, dtype="bf16")
    y = mlp.forward(x_shard, w_gate_up, w_down, stream=s)   # x_shard [M/world, hidden] -> y [M/world, hidden]

Rank r holds ``ffn`` columns of the intermediate layer (the intermediate size over world): ``w_gate_up``
[hidden, 2 ffn] (gate columns, then up columns; [2 ffn, hidden] with trans_b) and ``w_down`` [ffn, hidden]
([hidden, ffn] with trans_b). The block is

    h = allgather(x_shard) @ w_gate_up               AllGatherGemm    [M, 2 ffn]
    a = silu(h[:, :ffn]) * h[:, ffn:]                kernels/ops/mlp.cu [M, ffn]
    y = reduce_scatter(a @ w_down)                   GemmReduceScatter [M/world, hidden]

Each op picks its path per M (fluxrt.ops.cost: the fused kernel, or the decomposed path where the fused
one is predicted to lose); inside a CUDA-graph capture both take the decomposed path, whose collectives
keep their epochs on the device, so a captured block can be replayed. The intermediates live in buffers of
the block (sized for max_m), so a graph keeps pointing at live memory; the result is a view of the block's
output buffer (overwritten by the next call) unless ``out`` is given. Before capturing, run the block once
with ``path="decomposed"`` (and the capture's M) so that its kernels are compiled and loaded outside the
capture.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ..nvtx import annotate as _nvtx
from ..streams import as_cupy_stream
from . import common
from .ag_gemm import AllGatherGemm
from .gemm_rs import GemmReduceScatter
from .plan import AgGemmPlan, GemmRsPlan, OpsArgumentError

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

OP = "TPMLP"
KERNEL_SOURCE = "ops/mlp.cu"
_THREADS = 256
SILU_MUL_THREADS = _THREADS   # threads per block of both activation entries (their __launch_bounds__)
_DTYPE_CODE = {"bfloat16": 0, "float16": 1}


def load_silu_mul(dtype: str, *, bounded: bool = False):
    """The activation kernel of kernels/ops/mlp.cu for `dtype` ('bfloat16' or 'float16'): ``fluxrt_silu_mul``
    (rows given by the host) or ``fluxrt_silu_mul_bounded`` (rows bounded by an int32 on the device: the MoE
    layer's received rows). Loaded on the current device."""
    from ..toolchain import CompileOptions, load_module

    opts = CompileOptions(defines=(("FLUXRT_MLP_DTYPE", str(_DTYPE_CODE[dtype])),))
    return load_module(KERNEL_SOURCE, opts).get_function("fluxrt_silu_mul_bounded" if bounded else "fluxrt_silu_mul")


def silu_mul_grid(rows: int, ffn: int, sms: int) -> int:
    """Blocks of an activation launch over `rows` rows of `ffn` outputs (a grid-stride loop: at most 8 per SM)."""
    return max(1, min(-(-rows * (ffn // 8) // _THREADS), 8 * sms))


class TPMLP:
    """``forward(x_shard [M/world, hidden], w_gate_up, w_down) -> [M/world, hidden]``: the MLP block of the
    module docstring. Collective, like its two ops (same arguments and calls on every rank)."""

    def __init__(self, world: World, max_m: int, hidden: int, ffn: int, dtype="bf16", *, trans_b: bool = False,
                 ag_plan: AgGemmPlan | None = None, rs_plan: GemmRsPlan | None = None):
        import cupy

        if ffn <= 0 or ffn % 8:
            raise OpsArgumentError(f"{OP}: ffn={ffn} must be a positive multiple of 8 (16-byte rows for TMA)")
        self.world = world
        self.ag = AllGatherGemm(world, max_m, 2 * ffn, hidden, dtype, trans_b=trans_b, plan=ag_plan)
        self.rs = GemmReduceScatter(world, max_m, hidden, ffn, dtype, trans_b=trans_b, plan=rs_plan)
        self.dtype, self.max_m, self.hidden, self.ffn = self.ag.dtype, self.ag.max_m, hidden, ffn
        dt = np.dtype(self.ag.a_full.dtype)
        with world.device:
            self.h = cupy.empty((self.max_m, 2 * ffn), dtype=dt)
            self.act = cupy.empty((self.max_m, ffn), dtype=dt)
            self.y = cupy.empty((self.max_m // world.size, hidden), dtype=dt)
            self._silu_mul = load_silu_mul(self.dtype)
        self._sms = common.num_sms(world)

    @_nvtx("tp_mlp.forward")
    def forward(self, x_shard, w_gate_up, w_down, out=None, stream=None, *, path: str | None = None):
        """y [M/world, hidden] of this rank, stream-ordered on `stream`. path: None (each op's plan), 'fused'
        or 'decomposed' for both ops of this call."""
        self.world.make_current()
        s = as_cupy_stream(stream)
        rows = getattr(x_shard, "shape", (None,))[0]
        if rows is None or rows <= 0:
            raise OpsArgumentError(f"{OP}: x_shard must be a 2-D [M/world, hidden] array")
        m = int(rows) * self.world.size
        if m > self.max_m:
            raise OpsArgumentError(f"{OP}: M={m} exceeds max_m={self.max_m} given at construction")
        h, act = self.h[:m], self.act[:m]
        self.ag.forward(x_shard, w_gate_up, out=h, stream=s, path=path)
        self.silu_mul(h, act, s)
        if out is None:
            out = self.y[:m // self.world.size]
        return self.rs.forward(act, w_down, out=out, stream=s, path=path)

    __call__ = forward

    def silu_mul(self, h, act, stream) -> None:
        """act [rows, ffn] = silu(h[:, :ffn]) * h[:, ffn:] on `stream` (the block's own buffers)."""
        rows = int(h.shape[0])
        vecs = self.ffn // 8
        grid = silu_mul_grid(rows, self.ffn, self._sms)
        with self.world.device:
            self._silu_mul((grid,), (_THREADS,), (np.uint64(h.data.ptr), np.uint64(act.data.ptr), np.uint64(rows),
                                                  np.uint64(vecs)), stream=stream)

    def free(self) -> None:
        """Collective: return both ops' symmetric buffers."""
        self.ag.free()
        self.rs.free()

    def __repr__(self) -> str:
        return (f"TPMLP(max_m={self.max_m}, hidden={self.hidden}, ffn={self.ffn}, dtype={self.dtype}, "
                f"world={self.world.size})")
