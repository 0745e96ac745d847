"""MoE benchmarks: ``fluxrt-perf moe_dispatch``, ``moe_combine`` and ``moe_layer``.

Cases (``--models``, ``--tokens``, ``--routing``): DeepSeek-V3-like (hidden 7168, 256 experts, top-8) at 4096
tokens per rank (prefill) and 128 (decode); Mixtral-like (hidden 4096, 8 experts, top-2) at the same token
counts; experts spread evenly over the ranks; routing uniform (k distinct experts per token, each equally
likely) or Zipf (expert popularity 1 / (i + 1)^s over a fixed random order of the experts, s = --zipf-s,
k distinct per token by Gumbel top-k).

Per case, under mpirun with one GPU per rank, each timed iteration starts with every rank synchronized and a
short GPU delay, then CUDA events around dispatch and around combine (combine of the receive buffer in place,
as an expert that writes its output over its input leaves it; no staging copy):

    dispatch_us / combine_us   median per rank, reduced over ranks by -a (default 1: mean; 3: max)
    dispatch_gbps              DeepEP's definition: bytes of the tokens this rank receives (a token counted
                               once per receiving rank, however many of its experts are there) / time
    combine_gbps               the same bytes / combine time (DeepEP: combine sends what dispatch received)
    moved_gbps                 the rows fluxrt lands in this rank's receive buffer (one per (token, expert)
                               slot; with --dedupe one per (token, rank), the owner copies the rest) / time
    sent_gbps                  the bytes this rank's dispatch pushed over NVLink to the other ranks, as the
                               Dispatcher counted them (DispatchHandle.bytes_sent()) / time
    nccl_us / nccl_gbps        NCCL all-to-all-v (grouped send/recv) of the same rows, already sorted by
                               destination (the sort is not timed); the reverse exchange for combine

``--fp8 token|block`` measures FP8 dispatch (bytes: e4m3 rows and their scales; no NCCL baseline).
``--dedupe`` sends a token once per destination rank (DispatcherOptions(dedupe=True), as DeepEP does).

``moe_layer``: the whole layer (fluxrt.moe.MoELayer: dispatch -> grouped GEMM gate/up -> SiLU * up -> grouped
GEMM down -> combine, one stream), expert FFN size ``--ffn`` (default the model's: DeepSeek-V3 2048, Mixtral
14336), bf16, random weights; per case, calls timed in turns (fluxrt.perf.tp_ops.Timer):

    layer_us          MoELayer.forward, eager (the sequential layer: every stage after the other on one stream)
    graph_us          the same call captured in a CUDA graph, one replay
    overlap_us, overlap_graph_us   the overlapped layer (MoELayerOptions(overlap=True): the gate/up GEMM beside
                      the dispatch's push, each expert's tiles once its rows arrived; the combine beside the down
                      GEMM, whose tiles' rows go straight to their home ranks), eager and replayed
                      (throughput mode only; its push and combine use --blocks or OVERLAP_PUSH_BLOCKS SMs)
    overlap_speedup   layer_us / overlap_us; overlap_bitwise: with -c 1, both layers gave the same bits
    dispatch_us, experts_us, combine_us   the eager call's stages (events between them, separate iterations)
    baseline_us       NCCL all-to-all-v of the rows sorted by expert -> a gather into expert order -> per
                      local expert cuBLAS gate/up -> SiLU * up (the same kernel) -> per expert cuBLAS down ->
                      the gather back -> the reverse all-to-all-v -> the weighted sum per token (the
                      Dispatcher's combine kernel over the local rows); the host knows the layout (not timed)
    speedup           baseline_us / layer_us; overlap_vs_baseline: baseline_us / overlap_us
    experts_tflops    the experts' GEMM flops (6 F H per received row) / experts_us
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
from typing import TYPE_CHECKING

import numpy as np

from .baselines import device_info, library_versions, machine, nccl_communicator, nccl_datatype, worst_rel_err
from .report import device_lines, results_document, version_line, write_json
from .sweep import AVERAGE_MODES, add_average_argument, add_timeout_argument, reduce_over_ranks

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger(__name__)

BENCHES = ("moe_dispatch", "moe_combine", "moe_layer")
MODELS = {   # hidden, experts, top-k
    "deepseek": (7168, 256, 8),
    "mixtral": (4096, 8, 2),
}
FFN = {"deepseek": 2048, "mixtral": 14336}   # an expert's intermediate size (moe_layer)
ROUTINGS = ("uniform", "zipf")
DEFAULT_TOKENS = (4096, 128)
LAUNCH_SLACK_S = 200e-6
KERNEL_SOURCE_MOE = "moe/dispatch.cu"


def route(rng: np.random.Generator, tokens: int, experts: int, k: int, routing: str, zipf_s: float = 1.0,
          order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(topk_idx int32 [tokens, k], topk_weights float32 [tokens, k]): k distinct experts per token."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} not in {ROUTINGS}")
    if routing == "uniform":
        logp = np.zeros(experts)
    else:
        order = np.arange(experts) if order is None else order
        logp = np.empty(experts)
        logp[order] = -zipf_s * np.log(np.arange(1, experts + 1))
    keys = logp[None, :] + rng.gumbel(size=(tokens, experts))
    idx = np.argsort(-keys, axis=1)[:, :k].astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32) + 0.05
    return idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def layout_bytes(idxs: list[np.ndarray], experts: int, world: int, rank: int, hidden: int,
                 itemsize: float = 2, dedupe: bool = False) -> dict:
    """Bytes rank `rank` receives, from every rank's routing: DeepEP's (a token once per receiving rank) and the
    rows fluxrt moves (once per expert slot; with dedupe once per receiving rank, DeepEP's); and the rows each
    rank sends to each rank."""
    el = experts // world
    unique = rows = 0
    matrix = np.zeros((world, world), np.int64)   # [source, owner] rows
    for s, idx in enumerate(idxs):
        owners = np.where(idx >= 0, idx // el, -1)
        for r in range(world):
            matrix[s, r] = int((owners == r).sum())
        mine = owners == rank
        rows += int(mine.sum())
        unique += int(mine.any(axis=1).sum())
    moved = unique if dedupe else rows
    return {"recv_bytes": int(unique * hidden * itemsize), "moved_bytes": int(moved * hidden * itemsize),
            "matrix": matrix}


def build_parser(bench: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fluxrt-perf {bench}", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="deepseek,mixtral", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per rank, comma list")
    p.add_argument("--routing", default="uniform,zipf", help=f"comma list of {ROUTINGS}")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of the skewed router")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup-iters", type=int, default=5)
    p.add_argument("--blocks", type=int, default=0, help="push/combine grid (0: one block per SM)")
    p.add_argument("--threads", type=int, default=512)
    if bench == "moe_layer":
        p.add_argument("--ffn", type=int, default=0, help="an expert's intermediate size (0: the model's, "
                       + ", ".join(f"{m} {f}" for m, f in FFN.items()) + ")")
        p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                       help="compare the layer's output with the NCCL + cuBLAS baseline's once (default 1)")
        p.set_defaults(fp8="")
    else:
        p.add_argument("--fp8", default="", choices=("", "token", "block"),
                       help="FP8 dispatch (e4m3 with per-token or 1x128 scales); bytes then count e4m3 rows and "
                            "scales")
    p.add_argument("--mode", default="throughput", choices=("throughput", "low_latency"),
                   help="the Dispatcher's mode (low_latency: decode batches, one flag round trip per dispatch)")
    p.add_argument("--dedupe", action="store_true",
                   help="send a token once per destination rank (DispatcherOptions(dedupe=True))")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all-to-all-v baseline")
    p.add_argument("--check-args", action="store_true", help="compare arguments across ranks on every call")
    p.add_argument("--device", type=int, default=None,
                   help="every rank on this GPU (a correctness run under CUDA MPS: its timings mean nothing)")
    add_average_argument(p)
    add_timeout_argument(p)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None)
    return p


def _cases(args) -> list[tuple[str, int, str]]:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    bad = [m for m in models if m not in MODELS] + [r for r in routings if r not in ROUTINGS]
    if bad:
        raise SystemExit(f"unknown model or routing {bad}: models {sorted(MODELS)}, routings {ROUTINGS}")
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    return [(m, t, r) for m in models for t in tokens for r in routings]


class _Nccl:
    """NCCL all-to-all-v (grouped send/recv) of the same rows as the dispatch, sorted by destination."""

    def __init__(self, world: World):
        from cupy.cuda import nccl

        self.nccl, self.comm, self.world = nccl, nccl_communicator(world), world

    def exchange(self, send, send_rows, recv, recv_rows, hidden, dtype, stream) -> None:
        row = hidden * send.itemsize
        dt = nccl_datatype(dtype)
        so = np.concatenate(([0], np.cumsum(send_rows)))
        ro = np.concatenate(([0], np.cumsum(recv_rows)))
        self.nccl.groupStart()
        for p in range(self.world.size):
            if send_rows[p]:
                self.comm.send(send.data.ptr + int(so[p]) * row, int(send_rows[p]) * hidden, dt, p, stream.ptr)
            if recv_rows[p]:
                self.comm.recv(recv.data.ptr + int(ro[p]) * row, int(recv_rows[p]) * hidden, dt, p, stream.ptr)
        self.nccl.groupEnd()

    def close(self) -> None:
        self.comm.destroy()


def measure(world: World, model: str, tokens: int, routing: str, args, stream, nccl: _Nccl | None) -> dict:
    import cupy

    from .. import moe
    from ..ops import common

    hidden, experts, k = MODELS[model]
    rng = np.random.default_rng([tokens, experts, world.rank, ROUTINGS.index(routing)])
    order = np.random.default_rng(experts).permutation(experts)   # the hot experts: the same on every rank
    idx, w = route(rng, tokens, experts, k, routing, args.zipf_s, order)
    x = cupy.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32).astype(_bf16()))
    idxs = world.comm.allgather(idx)
    opts = moe.DispatcherOptions(top_k=k, blocks=args.blocks, threads=args.threads, fp8=args.fp8,
                                mode=args.mode, dedupe=args.dedupe)
    cfg = moe.check_config(world.size, experts, hidden, tokens, "bf16", opts)
    # bytes of one row on the wire, per element (FP8: e4m3 values and their fp32 scales)
    itemsize = (hidden + 4 * cfg.scale_row) / hidden if args.fp8 else 2
    lay = layout_bytes(idxs, experts, world.size, world.rank, hidden, itemsize, dedupe=args.dedupe)
    d = moe.Dispatcher(world, experts, hidden, tokens, "bf16", opts)
    di, dw = cupy.asarray(idx), cupy.asarray(w)
    try:
        def once():
            recv, h = d.dispatch(x, di, dw, stream=stream)
            return d.combine(recv, h, stream=stream)

        for _ in range(args.warmup_iters):
            once()
        stream.synchronize()
        world.check_errors()
        t_d, t_c = [], []
        ev = [cupy.cuda.Event() for _ in range(3)]
        for _ in range(args.iters):
            stream.synchronize()
            world.comm.Barrier()
            common.delay(world, LAUNCH_SLACK_S, stream)
            ev[0].record(stream)
            recv, h = d.dispatch(x, di, dw, stream=stream)
            ev[1].record(stream)
            d.combine(recv, h, stream=stream)
            ev[2].record(stream)
            ev[2].synchronize()
            t_d.append(cupy.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
            t_c.append(cupy.cuda.get_elapsed_time(ev[1], ev[2]) * 1e3)
        world.check_errors()
        n_recv = h.num_recv()
        sent_bytes = h.bytes_sent()   # counted by the dispatch on the device: what crossed NVLink from this rank
    finally:
        d.free()
    red = lambda v: reduce_over_ranks(world.comm.allgather(statistics.median(v)), args.average)  # noqa: E731
    dispatch_us, combine_us = red(t_d), red(t_c)
    row = {"model": model, "mode": args.mode, "fp8": args.fp8, "hidden": hidden, "experts": experts, "top_k": k, "tokens": tokens, "routing": routing,
           "world": world.size, "recv_rows": n_recv, "recv_bytes": lay["recv_bytes"], "moved_bytes": lay["moved_bytes"],
           "dedupe": bool(args.dedupe), "sent_bytes": sent_bytes, "dispatch_us": dispatch_us, "combine_us": combine_us}
    # bandwidths of this rank, then reduced like the times
    row["dispatch_gbps"] = reduce_over_ranks(world.comm.allgather(lay["recv_bytes"] / (statistics.median(t_d) * 1e3)),
                                             1)
    row["combine_gbps"] = reduce_over_ranks(world.comm.allgather(lay["recv_bytes"] / (statistics.median(t_c) * 1e3)),
                                            1)
    row["moved_gbps"] = reduce_over_ranks(world.comm.allgather(lay["moved_bytes"] / (statistics.median(t_d) * 1e3)), 1)
    row["sent_gbps"] = reduce_over_ranks(world.comm.allgather(sent_bytes / (statistics.median(t_d) * 1e3)), 1)
    if nccl is not None:
        row.update(_nccl_times(world, nccl, idx, lay["matrix"], hidden, experts, x, args, stream))
        row["nccl_dispatch_gbps"] = reduce_over_ranks(world.comm.allgather(
            lay["recv_bytes"] / (row.pop("_nccl_d_mine") * 1e3)), 1)
        row["nccl_combine_gbps"] = reduce_over_ranks(world.comm.allgather(
            lay["recv_bytes"] / (row.pop("_nccl_c_mine") * 1e3)), 1)
    return row


def _bf16():
    from ..dtypes import bfloat16

    return bfloat16


def _nccl_times(world: World, nccl: _Nccl, idx, matrix, hidden, experts, x, args, stream) -> dict:
    import cupy

    from ..ops import common

    el = experts // world.size
    owners = np.where(idx >= 0, idx // el, world.size).reshape(-1)
    order = np.argsort(owners, kind="stable")
    tok = order[owners[order] < world.size] // idx.shape[1]
    send = x[cupy.asarray(tok)] if tok.size else cupy.empty((0, hidden), x.dtype)
    send_rows, recv_rows = matrix[world.rank], matrix[:, world.rank]
    recv = cupy.empty((max(1, int(recv_rows.sum())), hidden), x.dtype)
    times = {"d": [], "c": []}
    ev = [cupy.cuda.Event() for _ in range(3)]
    for it in range(args.warmup_iters + args.iters):
        stream.synchronize()
        world.comm.Barrier()
        common.delay(world, LAUNCH_SLACK_S, stream)
        ev[0].record(stream)
        nccl.exchange(send, send_rows, recv, recv_rows, hidden, x.dtype, stream)
        ev[1].record(stream)
        nccl.exchange(recv, recv_rows, send, send_rows, hidden, x.dtype, stream)
        ev[2].record(stream)
        ev[2].synchronize()
        if it >= args.warmup_iters:
            times["d"].append(cupy.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
            times["c"].append(cupy.cuda.get_elapsed_time(ev[1], ev[2]) * 1e3)
    md, mc = statistics.median(times["d"]), statistics.median(times["c"])
    return {"nccl_dispatch_us": reduce_over_ranks(world.comm.allgather(md), args.average),
            "nccl_combine_us": reduce_over_ranks(world.comm.allgather(mc), args.average),
            "_nccl_d_mine": md, "_nccl_c_mine": mc}


# --- moe_layer ------------------------------------------------------------------------------------------
def baseline_layout(idxs: list[np.ndarray], experts: int, world: int, rank: int) -> dict:
    """The NCCL + cuBLAS baseline's layout for rank `rank`, from every rank's routing (host side, not timed):

    send_slots   this rank's valid slots (flat t * k + j) in send order: by expert, then slot (so by owner too)
    send_rows    [world] rows this rank sends to each rank; recv_rows [world] rows it receives from each
    perm         [rows received] the row of the all-to-all's receive buffer (by source, then the source's send
                 order) that row i of the expert-grouped buffer (by local expert, then source) takes
    expert_rows  [E_local] rows of each local expert in the grouped buffer
    slot_pos     int32 [T * k] each slot's row in the send-order buffer (0 for a masked slot)"""
    el = experts // world
    mine = idxs[rank].reshape(-1)
    valid = np.nonzero(mine >= 0)[0]
    send_slots = valid[np.argsort(mine[valid], kind="stable")]
    slot_pos = np.zeros(mine.size, np.int32)
    slot_pos[send_slots] = np.arange(send_slots.size, dtype=np.int32)
    send_rows = np.bincount(mine[send_slots] // el, minlength=world).astype(np.int64)
    # per source: its rows to this rank, in its send order (by expert), as local expert ids
    per_src = []
    for idx in idxs:
        f = idx.reshape(-1)
        ex = np.sort(f[(f >= rank * el) & (f < (rank + 1) * el)], kind="stable")
        per_src.append(ex - rank * el)
    recv_rows = np.array([p.size for p in per_src], np.int64)
    base = np.concatenate(([0], np.cumsum(recv_rows)))
    perm = [base[s] + np.nonzero(per_src[s] == le)[0] for le in range(el) for s in range(world)]
    perm = np.concatenate(perm).astype(np.int64) if perm else np.zeros(0, np.int64)
    expert_rows = np.array([sum(int((p == le).sum()) for p in per_src) for le in range(el)], np.int64)
    return {"send_slots": send_slots, "send_rows": send_rows, "recv_rows": recv_rows, "perm": perm,
            "expert_rows": expert_rows, "slot_pos": slot_pos}


class _LayerBaseline:
    """NCCL all-to-all-v + a loop of cuBLAS calls per local expert, on one stream, with the layer's weights."""

    def __init__(self, world: World, layer, nccl: _Nccl, idx, w, x, idxs, stream):
        import cupy

        from ..ops.common import num_sms
        from ..ops.mlp import SILU_MUL_THREADS, load_silu_mul, silu_mul_grid
        from ..toolchain import load_module
        from .baselines import cublas_gemm

        cfg = layer.cfg
        el, hidden, ffn = cfg.local_experts, cfg.moe.hidden, cfg.ffn
        lay = baseline_layout(idxs, cfg.moe.num_experts, world.size, world.rank)
        self.lay, self.nccl, self.stream, self.hidden = lay, nccl, stream, hidden
        t, k = idx.shape
        n_send, n_recv = int(lay["send_rows"].sum()), int(lay["recv_rows"].sum())
        dt = x.dtype
        tok = cupy.asarray(lay["send_slots"] // k)
        self.x, self.tok = x, tok
        self.send = cupy.empty((max(1, n_send), hidden), dt)
        self.recv = cupy.empty((max(1, n_recv), hidden), dt)
        self.grouped = cupy.empty((max(1, n_recv), hidden), dt)
        self.h = cupy.empty((max(1, n_recv), 2 * ffn), dt)
        self.act = cupy.empty((max(1, n_recv), ffn), dt)
        self.back = cupy.empty((max(1, n_send), hidden), dt)
        self.out = cupy.empty((t, hidden), dt)
        self.perm = cupy.asarray(lay["perm"])
        self.inv = cupy.asarray(np.argsort(lay["perm"]))
        self.n_send, self.n_recv = n_send, n_recv
        off = 0
        gate_up, down = [], []
        for e, m in enumerate(lay["expert_rows"].tolist()):
            if m:
                gate_up.append(cublas_gemm(self.grouped[off:off + m], layer.w_gate_up[e], self.h[off:off + m], True,
                                           stream.ptr))
                down.append(cublas_gemm(self.act[off:off + m], layer.w_down[e], self.grouped[off:off + m], True,
                                        stream.ptr))
            off += m
        self.gate_up, self.down = gate_up, down
        self.silu = load_silu_mul(cfg.moe.dtype)
        self.silu_args = ((silu_mul_grid(n_recv, ffn, num_sms(world)),), (SILU_MUL_THREADS,),
                          (np.uint64(self.h.data.ptr), np.uint64(self.act.data.ptr), np.uint64(n_recv),
                           np.uint64(ffn // 8)))
        # the weighted sum per token: the Dispatcher's combine kernel, every owner's rows in the local buffer
        kind = {"bfloat16": "bf16", "float16": "fp16"}[cfg.moe.dtype]
        ix = {"int32": "i32", "int64": "i64"}[idx.dtype.name]
        self.combine = load_module(KERNEL_SOURCE_MOE).get_function(f"fluxrt_moe_combine_{kind}_{ix}")
        self.table = cupy.full(world.size, self.back.data.ptr, dtype=np.uint64)
        self.pos = cupy.asarray(lay["slot_pos"])
        warps = 512 // 32
        self.combine_args = ((max(1, min(num_sms(world), -(-t // warps))),), (512,),
                             (idx, w, np.uint32(t), np.uint32(k), np.uint32(cfg.moe.num_experts), np.uint32(el),
                              self.pos, self.table, np.uint64(hidden * dt.itemsize), self.out))

    def run(self) -> None:
        import cupy

        s, lay = self.stream, self.lay
        with s:
            if self.n_send:
                cupy.take(self.x.view(np.uint16), self.tok, axis=0, out=self.send[:self.n_send].view(np.uint16))
            self.nccl.exchange(self.send, lay["send_rows"], self.recv, lay["recv_rows"], self.hidden, self.x.dtype, s)
            if self.n_recv:
                cupy.take(self.recv[:self.n_recv].view(np.uint16), self.perm, axis=0,
                          out=self.grouped[:self.n_recv].view(np.uint16))
                for g in self.gate_up:
                    g()
                self.silu(*self.silu_args, stream=s)
                for g in self.down:
                    g()
                cupy.take(self.grouped[:self.n_recv].view(np.uint16), self.inv, axis=0,
                          out=self.recv[:self.n_recv].view(np.uint16))
            self.nccl.exchange(self.recv, lay["recv_rows"], self.back, lay["send_rows"], self.hidden, self.x.dtype, s)
            self.combine(*self.combine_args, stream=s)


def _random_weights(layer, seed: int, stream) -> None:
    """N(0, 1/H) gate/up and N(0, 1/F) down weights, an expert at a time (no full-size fp32 temporary)."""
    import cupy

    cfg = layer.cfg
    g = cupy.random.default_rng(seed)
    with stream:
        for e in range(cfg.local_experts):
            layer.w_gate_up[e] = (g.standard_normal(layer.w_gate_up.shape[1:], dtype=np.float32)
                                  / np.float32(np.sqrt(cfg.moe.hidden))).astype(layer.w_gate_up.dtype)
            layer.w_down[e] = (g.standard_normal(layer.w_down.shape[1:], dtype=np.float32)
                               / np.float32(np.sqrt(cfg.ffn))).astype(layer.w_down.dtype)


def measure_layer(world: World, model: str, tokens: int, routing: str, args, timer, nccl: _Nccl | None) -> dict:
    import cupy
    from mpi4py import MPI

    from .. import moe

    hidden, experts, k = MODELS[model]
    ffn = args.ffn or FFN[model]
    s = timer.stream
    rng = np.random.default_rng([tokens, experts, world.rank, ROUTINGS.index(routing)])
    order = np.random.default_rng(experts).permutation(experts)
    idx, w = route(rng, tokens, experts, k, routing, args.zipf_s, order)
    idxs = world.comm.allgather(idx)
    lay = layout_bytes(idxs, experts, world.size, world.rank, hidden, dedupe=args.dedupe)
    opts = moe.MoELayerOptions(dispatch=moe.DispatcherOptions(top_k=k, blocks=args.blocks, threads=args.threads,
                                                              mode=args.mode, dedupe=args.dedupe))
    layer = moe.MoELayer(world, experts, hidden, ffn, tokens, "bf16", opts)
    over = None
    if args.mode == "throughput":
        try:
            over = moe.MoELayer(world, experts, hidden, ffn, tokens, "bf16",
                                moe.MoELayerOptions(dispatch=opts.dispatch, overlap=True))
        except BaseException:
            layer.free()
            raise
    base = None
    try:
        with s:
            x = cupy.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32).astype(_bf16()))
            di, dw = cupy.asarray(idx), cupy.asarray(w)
            y = cupy.empty((tokens, hidden), dtype=x.dtype)
            y_over = cupy.empty((tokens, hidden), dtype=x.dtype)
        _random_weights(layer, 1000 + world.rank, s)

        def eager():
            layer.forward(x, di, dw, out=y, stream=s)

        def eager_over():
            over.forward(x, di, dw, out=y_over, stream=s)

        calls = {}
        for name, fn in (("layer", eager), ("overlap", eager_over if over is not None else None)):
            if fn is None:
                continue
            fn()   # compiles and loads every kernel outside the capture
            s.synchronize()
            with s:
                s.begin_capture()
                fn()
                graph = s.end_capture()
            calls[name] = fn
            calls["graph" if name == "layer" else "overlap_graph"] = (lambda g: lambda: g.launch(s))(graph)
        check = bitwise = None
        if over is not None:
            over.set_weights(w_gate_up=layer.w_gate_up, w_down=layer.w_down, stream=s)
            if args.check:
                eager()
                eager_over()
                s.synchronize()
                world.check_errors()
                same = bool(cupy.array_equal(y.view(np.uint16), y_over.view(np.uint16)))
                bitwise = bool(world.comm.allreduce(same, op=MPI.LAND))
        if nccl is not None:
            base = _LayerBaseline(world, layer, nccl, di, dw, x, idxs, s)
            calls["baseline"] = base.run
            if args.check:
                eager()
                base.run()
                s.synchronize()
                world.check_errors()
                check = worst_rel_err(world, y, base.out)
                if not check < 3e-2:
                    log.warning("moe_layer %s %d %s: the layer differs from NCCL + cuBLAS: relative error %.3g",
                                model, tokens, routing, check)
        t = timer.many(calls)
        stages = _stage_times(world, layer, x, di, dw, y, s, args)
        n_recv = int(layer.dispatcher.offsets[-1].get())
    finally:
        if over is not None:
            over.free()
        layer.free()
    red = lambda v: reduce_over_ranks(world.comm.allgather(v), 1)   # noqa: E731
    row = {"model": model, "mode": args.mode, "dedupe": bool(args.dedupe), "hidden": hidden, "ffn": ffn,
           "experts": experts, "top_k": k, "tokens": tokens, "routing": routing, "world": world.size, "recv_rows": n_recv,
           "recv_bytes": lay["recv_bytes"], "moved_bytes": lay["moved_bytes"],
           "layer_us": t["layer"] * 1e3, "graph_us": t["graph"] * 1e3, "baseline_us": None, "speedup": None,
           "check_rel_err": check, "overlap_us": None, "overlap_graph_us": None, "overlap_speedup": None,
           "overlap_vs_baseline": None, "overlap_bitwise": bitwise}
    if "overlap" in t:
        row.update(overlap_us=t["overlap"] * 1e3, overlap_graph_us=t["overlap_graph"] * 1e3,
                   overlap_speedup=t["layer"] / t["overlap"])
    row.update({f"{name}_us": v for name, v in stages.items()})
    row["experts_tflops"] = red(6.0 * n_recv * ffn * hidden / (stages["experts"] * 1e-6) / 1e12) \
        if stages["experts"] > 0 else None
    if "baseline" in t:
        row["baseline_us"] = t["baseline"] * 1e3
        row["speedup"] = t["baseline"] / t["layer"]
        if "overlap" in t:
            row["overlap_vs_baseline"] = t["baseline"] / t["overlap"]
    return row


def _stage_times(world: World, layer, x, di, dw, y, s, args) -> dict:
    """Medians of the eager call's stages (events between dispatch, experts and combine), reduced over ranks."""
    import cupy

    from ..ops import common

    ev = [cupy.cuda.Event() for _ in range(4)]
    times = {"dispatch": [], "experts": [], "combine": []}
    for it in range(args.warmup_iters + args.iters):
        s.synchronize()
        world.comm.Barrier()
        common.delay(world, LAUNCH_SLACK_S, s)
        ev[0].record(s)
        h = layer.dispatch(x, di, dw, stream=s)
        ev[1].record(s)
        layer.experts(h, stream=s)
        ev[2].record(s)
        layer.combine(h, out=y, stream=s)
        ev[3].record(s)
        ev[3].synchronize()
        if it >= args.warmup_iters:
            for i, name in enumerate(times):
                times[name].append(cupy.cuda.get_elapsed_time(ev[i], ev[i + 1]) * 1e3)
    world.check_errors()
    return {name: reduce_over_ranks(world.comm.allgather(statistics.median(v)), args.average)
            for name, v in times.items()}


COLUMNS = {
    "moe_dispatch": ("dispatch_us", "dispatch_gbps", "moved_gbps", "sent_gbps", "nccl_dispatch_us",
                     "nccl_dispatch_gbps"),
    "moe_combine": ("combine_us", "combine_gbps", "nccl_combine_us", "nccl_combine_gbps"),
    "moe_layer": ("layer_us", "graph_us", "overlap_us", "overlap_speedup", "dispatch_us", "experts_us", "combine_us",
                  "baseline_us", "speedup", "experts_tflops"),
}


def format_row(bench: str, row: dict | None) -> str:
    head = f"{'model':>9} {'tokens':>6} {'routing':>8} {'recv_MB':>8}"
    if row is None:
        return head + "".join(f" {c:>18}" for c in COLUMNS[bench])
    cells = "".join(f" {row[c]:>18.2f}" if isinstance(row.get(c), float) else f" {'N/A':>18}" for c in COLUMNS[bench])
    return f"{row['model']:>9} {row['tokens']:>6} {row['routing']:>8} {row['recv_bytes'] / 1e6:>8.2f}" + cells


def plot_rows(path: str, bench: str, rows: list[dict], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [f"{r['model']}\n{r['tokens']} {r['routing']}" for r in rows]
    pos = np.arange(len(rows))
    if bench == "moe_layer":
        series = (("fluxrt MoELayer, sequential", "layer_us"), ("graph replay", "graph_us"),
                  ("fluxrt MoELayer, overlapped", "overlap_us"), ("NCCL a2a-v + cuBLAS per expert", "baseline_us"))
        for i, (label, key) in enumerate(series):
            ax.bar(pos + (i - 1.5) * 0.2, [r.get(key) or 0.0 for r in rows], 0.2, label=label)
        ax.set_xticks(pos, labels, fontsize="small")
        ax.set(ylabel="us per layer (lower is better)", title=title)
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
        return
    key = "dispatch" if bench == "moe_dispatch" else "combine"
    ax.bar(pos - 0.2, [r[f"{key}_gbps"] for r in rows], 0.4, label="fluxrt")
    ax.bar(pos + 0.2, [r.get(f"nccl_{key}_gbps") or 0.0 for r in rows], 0.4, label="NCCL all-to-all-v")
    ax.set_xticks(pos, labels, fontsize="small")
    ax.set(ylabel="GB/s per rank (DeepEP's bytes)", title=title)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


def main(argv=None, bench: str = "moe_dispatch") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(bench).parse_args(argv)
    cases = _cases(args)

    import cupy

    import fluxrt

    from .. import moe

    # the largest case's receive buffer (it scales with the ranks: rows = tokens * world * top_k)
    size_probe = max(moe.check_config(1, MODELS[m][1], MODELS[m][0], t, "bf16",
                                      moe.DispatcherOptions(top_k=MODELS[m][2], fp8=args.fp8, mode=args.mode,
                                                            arrivals=bench == "moe_layer",
                                                            returns=bench == "moe_layer" and args.mode == "throughput",
                                                            dedupe=args.dedupe)).symmetric_bytes()
                     for m, t, _ in cases)
    if bench == "moe_layer":   # the sequential and the overlapped layer side by side
        size_probe *= 2
    world_kw = {"timeout_s": args.timeout} if args.timeout > 0 else {}
    from mpi4py import MPI

    n = MPI.COMM_WORLD.Get_size()
    heap = size_probe * n + (64 << 20)
    world = fluxrt.init(device=args.device, options=fluxrt.WorldOptions(heap_size=f"{-(-heap // (1 << 30))}G",
                                                    check_collective_args=args.check_args, **world_kw))
    nccl = None
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        timer = None
        if bench == "moe_layer":
            from .tp_ops import Timer

            timer = Timer(world, stream, args.warmup_iters, args.iters, args.average)
        if args.fp8 and not args.no_nccl:
            log.warning("--fp8: no NCCL baseline (it would move 16-bit rows); its columns are N/A")
        if not args.no_nccl and not args.fp8:
            try:
                nccl = _Nccl(world)
            except Exception as e:   # no libnccl, or ranks sharing a GPU (MPS), which NCCL refuses
                log.warning("NCCL baseline unavailable (%s): its columns are N/A", e)
        versions, devices = library_versions(), device_info(world)
        if world.rank == 0:
            print(f"# fluxrt-perf {bench}: world={world.size} bf16 iters={args.iters} warmup={args.warmup_iters}; "
                  f"times in us (median per rank, {AVERAGE_MODES[args.average]} over ranks), GB/s per rank"
                  + ("; speedup = baseline_us / layer_us" if bench == "moe_layer" else ""))
            print(version_line(versions))
            for line in device_lines(devices):
                print(line)
            print(format_row(bench, None), flush=True)
        rows = []
        for model, tokens, routing in cases:
            if MODELS[model][1] % world.size:
                continue
            if bench == "moe_layer":
                row = measure_layer(world, model, tokens, routing, args, timer, nccl)
            else:
                row = measure(world, model, tokens, routing, args, stream, nccl)
            rows.append(row)
            if world.rank == 0:
                print(format_row(bench, row), flush=True)
        if world.rank == 0:
            if args.json_path:
                options = {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path")}
                doc = results_document(bench, rows, ["fluxrt-perf", bench] + argv, machine=machine(world),
                                       versions=versions, devices=devices,
                                       options=dict(options, average_name=AVERAGE_MODES[args.average]))
                write_json(args.json_path, doc)
            if args.plot_path:
                plot_rows(args.plot_path, bench, rows, f"fluxrt {bench}, {world.size} GPUs, bf16")
    finally:
        if nccl is not None:
            nccl.close()
        world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
