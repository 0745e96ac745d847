"""When not to fuse: the cost model behind the fused ops' choice of path (pure Python, no CUDA).

Every call of AllGatherGemm / GemmReduceScatter runs one of two paths:

``fused``
    the FLUX-style kernel (one persistent GEMM with flag waits or tile stores, copy-engine transfers beside
    it; ``fluxrt.ops.ag_gemm`` / ``gemm_rs``).
``decomposed``
    plain pieces (``fluxrt.ops.decomposed``): the communication split into ``chunks`` fluxrt collectives
    on the op's second stream, the GEMM of each chunk (``fluxrt.gemm``) as soon as its chunk has landed
    (AllGather+GEMM) or the reduce-scatter of each chunk as soon as its GEMMs have finished
    (GEMM+ReduceScatter), ordered by events. With one chunk it is the sequential collective + GEMM.

:func:`choose_path` predicts both from

* the GEMM time: the autotune cache's measured time of the problem when it has one
  (:func:`fluxrt.gemm.autotune.tuned_entry`), else the GEMM heuristic's modelled cost
  (:func:`fluxrt.gemm.plan.plan_cost` of :func:`~fluxrt.gemm.plan.heuristic_plan`) times
  ``OpsRates.us_per_unit``; a GEMM given fewer SMs is scaled by the SMs it keeps;
* bytes over the measured link rates (:class:`OpsRates`: copy-engine pulls for the fused path, fluxrt's
  collectives for the decomposed one);
* the SMs each path gives to communication (the fused plan's ``reserved_sms``, the decomposed path's
  ``comm_sms``) and the per-chunk hand-off latency of the fused path.

and picks the fused path unless the best decomposed plan is predicted faster by ``OpsRates.margin``.
Calls with fp8 inputs (``fp8=True``: the ops' :class:`~fluxrt.ops.plan.Fp8Options`) always take the
decomposed path, since the fused kernels have no fp8 hooks; the model then only picks its chunk count (fp8
gathered bytes for AllGather+GEMM, output-type partials for GEMM+ReduceScatter, the GEMM times the
autotune cache's fp8 ones or ``fp8_gemm_factor`` of the 16-bit model's). A call inside a CUDA-graph
capture always takes the decomposed path: the fused kernels compare their flags
with per-call epochs the host passes as kernel arguments, so a replayed graph would reuse one call's
epochs and read flags that are already up; the collectives keep their epochs on the device.
``AgGemmPlan.path`` / ``GemmRsPlan.path`` override the choice ("fused" or "decomposed"), and
``decomposed_chunks`` the chunk count. The numbers of :data:`OPS_RATES` and where they come from are in
docs/tuning.md ("Fused or decomposed").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..gemm.plan import H100_H200_SMS, heuristic_plan, plan_cost
from .plan import PATHS, TILE_ROWS, OpsArgumentError, padded_shard

__all__ = ["OpsRates", "OPS_RATES", "PathChoice", "PATHS", "DECOMPOSED_CHUNKS", "choose_path", "gemm_us",
           "collective_us", "ag_fused_us", "rs_fused_us", "ag_decomposed_us", "rs_decomposed_us", "chunk_rows"]

DECOMPOSED_CHUNKS = (1, 2, 4)   # chunk counts the planner considers for the decomposed path


@dataclass(frozen=True)
class OpsRates:
    """Rates of one machine kind that the path choice divides bytes and work by (docs/tuning.md).

    pull_gbps: GB/s one rank receives from copy-engine pulls of peers' symmetric memory (fused path).
    collective_gbps, collective_latency_us: fluxrt allgather / reduce_scatter as latency + bus bytes over
        bandwidth (bus bytes: (world - 1) / world of the whole message), with every SM free.
    collective_gbps_beside_gemm: the same collectives while GEMMs hold all but ``comm_sms`` SMs.
    comm_sms: SMs the decomposed path's GEMMs leave to the collectives (chunks > 1).
    fused_gemm_factor: the fused kernel's time over the plain GEMM's with the same SMs (hooks, flag waits).
    chunk_latency_us: fused path, one chunk's hand-off on the comm stream (counter wait, pull, flag).
    launch_us: one more kernel launch on the GPU (the decomposed path's extra GEMMs and events).
    reduce_gbps: HBM bytes per second of the fused GEMM+ReduceScatter's reduce of its own rows.
    us_per_unit: microseconds per unit of the GEMM heuristic's cost model (fluxrt.gemm.plan.tile_cost).
    margin: the decomposed path is chosen only when predicted faster than fused by this factor.
    fp8_gemm_factor: an fp8 GEMM's time over the 16-bit one's of the same shape, where the autotune cache
        has no fp8 time (the tensor cores' fp8 rate is twice the 16-bit one).
    """
    pull_gbps: float
    collective_gbps: float
    collective_latency_us: float
    collective_gbps_beside_gemm: float
    comm_sms: int
    fused_gemm_factor: float
    chunk_latency_us: float
    launch_us: float
    reduce_gbps: float
    us_per_unit: float
    margin: float
    fp8_gemm_factor: float = 0.5


OPS_RATES = {
    "hopper-nvlink": OpsRates(pull_gbps=370.0, collective_gbps=330.0, collective_latency_us=12.0,
                              collective_gbps_beside_gemm=200.0, comm_sms=16, fused_gemm_factor=1.03,
                              chunk_latency_us=8.0, launch_us=3.0, reduce_gbps=2500.0, us_per_unit=3.3e-7,
                              margin=1.10),
}
DEFAULT_RATES = "hopper-nvlink"


@dataclass(frozen=True)
class PathChoice:
    """The path of one call shape and why: ``fused_us`` / ``decomposed_us`` are the model's predictions
    (None where not computed), ``chunks`` the decomposed path's chunk count, ``reason`` one line for the
    log."""
    path: str
    chunks: int
    reason: str
    fused_us: float | None = None
    decomposed_us: float | None = None
    candidates: tuple = field(default=(), compare=False)   # ((chunks, predicted us), ...)

    def __str__(self) -> str:
        return f"{self.path} (chunks {self.chunks}): {self.reason}"


# --- the pieces of the model ---------------------------------------------------------------------------

def gemm_us(m: int, n: int, k: int, dtype: str = "bfloat16", *, trans_b: bool = False, sms: int = H100_H200_SMS,
            num_sms: int = H100_H200_SMS, rates: OpsRates | None = None, tuned_us=None) -> float:
    """Predicted time of a plain M x N x K GEMM given `sms` of the device's `num_sms` SMs. `tuned_us(m, n, k)`
    returns the autotune cache's measured time or None (then the heuristic's cost model)."""
    if m <= 0:
        return 0.0
    rates = rates or OPS_RATES[DEFAULT_RATES]
    us = tuned_us(m, n, k) if tuned_us is not None else None
    if us is None:
        plan = heuristic_plan(m, n, k, in_dtype=dtype, out_dtype=dtype, trans_b=trans_b, num_sms=num_sms)
        us = plan_cost(plan, m, n, k, num_sms, trans_b) * rates.us_per_unit
    if 0 < sms < num_sms:
        # a persistent GEMM on fewer SMs: as many more waves as it lost SMs (no gain for a partial wave)
        us *= max(1.0, num_sms / sms * min(1.0, _tiles(m, n) / num_sms))
    return us


def _tiles(m: int, n: int) -> int:
    return math.ceil(m / TILE_ROWS) * math.ceil(n / 256)


def collective_us(total_bytes: float, world: int, rates: OpsRates, *, beside_gemm: bool = False) -> float:
    """fluxrt allgather / reduce_scatter of a `total_bytes` message over `world` ranks."""
    if world <= 1 or total_bytes <= 0:
        return 0.0
    gbps = rates.collective_gbps_beside_gemm if beside_gemm else rates.collective_gbps
    return rates.collective_latency_us + total_bytes * (world - 1) / world / (gbps * 1e3)


def chunk_rows(shard: int, chunks: int) -> list[int]:
    """Rows of each chunk of a `shard`-row shard cut into `chunks` pieces of whole 128-row tiles where it
    can (the last one takes the rest); fewer pieces when the shard is too short for `chunks`."""
    if chunks <= 1 or shard <= TILE_ROWS:
        return [shard]
    per = max(TILE_ROWS, padded_shard(math.ceil(shard / chunks), TILE_ROWS))
    out, left = [], shard
    while left > 0:
        out.append(min(per, left))
        left -= out[-1]
    return out


def ag_fused_us(m: int, n: int, k: int, world: int, dtype: str, *, chunks_per_rank: int, reserved_sms: int,
                itemsize: int = 2, num_sms: int = H100_H200_SMS, rates: OpsRates, tuned_us=None,
                trans_b: bool = False) -> float:
    """Fused AllGather+GEMM: the GEMM over the padded rows on all but `reserved_sms` SMs, slowed by its
    hooks; it cannot end before the last peer chunk has been pulled and its rows multiplied."""
    shard = m // world
    pad = padded_shard(shard, TILE_ROWS * chunks_per_rank)
    g = gemm_us(pad * world, n, k, dtype, sms=num_sms - reserved_sms, num_sms=num_sms, rates=rates,
                tuned_us=tuned_us, trans_b=trans_b) * rates.fused_gemm_factor
    chunks = (world - 1) * chunks_per_rank
    comm = (world - 1) * pad * k * itemsize / (rates.pull_gbps * 1e3) + chunks * rates.chunk_latency_us
    return max(g, comm + g / (world * chunks_per_rank))


def rs_fused_us(m: int, n: int, k: int, world: int, dtype: str, *, reserved_sms: int, itemsize: int = 2,
                num_sms: int = H100_H200_SMS, rates: OpsRates, tuned_us=None,
                trans_b: bool = False) -> float:
    """Fused GEMM+ReduceScatter: the GEMM over the padded rows, the owners pulling each peer's partials while
    it runs; the last peer's rows (made just before the own rows) must arrive, then the own rows are summed."""
    shard = m // world
    pad = padded_shard(shard, TILE_ROWS)
    g = gemm_us(pad * world, n, k, dtype, sms=num_sms - reserved_sms, num_sms=num_sms, rates=rates,
                tuned_us=tuned_us, trans_b=trans_b) * rates.fused_gemm_factor
    comm = (world - 1) * pad * n * itemsize / (rates.pull_gbps * 1e3) + (world - 1) * rates.chunk_latency_us
    reduce = world * pad * n * itemsize / (rates.reduce_gbps * 1e3)
    return max(g, comm + g / world) + reduce


def _pipeline(first_gemm: float, comm: list[float], gemm: list[float], comm_first: bool) -> float:
    """End time of alternating comm and GEMM chunks on two streams: AllGather (comm_first) starts chunk i's
    GEMMs when both its comm and the previous GEMMs are done; ReduceScatter starts chunk i's comm when both
    its GEMMs and the previous comm are done."""
    t_c, t_g = 0.0, first_gemm
    for c, g in zip(comm, gemm):
        if comm_first:
            t_c += c
            t_g = max(t_g, t_c) + g
        else:
            t_g += g
            t_c = max(t_c, t_g) + c
    return t_g if comm_first else t_c


def ag_decomposed_us(m: int, n: int, k: int, world: int, dtype: str, chunks: int, *, itemsize: int = 2,
                     num_sms: int = H100_H200_SMS, rates: OpsRates, tuned_us=None,
                     trans_b: bool = False) -> float:
    """Decomposed AllGather+GEMM: own shard's GEMM first, then per chunk an allgather beside the GEMMs and
    (world - 1) GEMMs of the chunk's peer rows (one chunk: allgather, then one GEMM of all M rows)."""
    shard = m // world
    rows = chunk_rows(shard, chunks)
    if len(rows) == 1:
        return collective_us(m * k * itemsize, world, rates) + gemm_us(m, n, k, dtype, num_sms=num_sms, rates=rates,
                                                                      tuned_us=tuned_us, trans_b=trans_b)
    sms = num_sms - rates.comm_sms
    own = gemm_us(shard, n, k, dtype, sms=sms, num_sms=num_sms, rates=rates, tuned_us=tuned_us,
                  trans_b=trans_b) + rates.launch_us
    comm = [collective_us(world * r * k * itemsize, world, rates, beside_gemm=True) for r in rows]
    gemm = [(world - 1) * (gemm_us(r, n, k, dtype, sms=sms, num_sms=num_sms, rates=rates, tuned_us=tuned_us,
                                   trans_b=trans_b)
                           + rates.launch_us) for r in rows]
    return _pipeline(own, comm, gemm, comm_first=True)


def rs_decomposed_us(m: int, n: int, k: int, world: int, dtype: str, chunks: int, *, itemsize: int = 2,
                     num_sms: int = H100_H200_SMS, rates: OpsRates, tuned_us=None,
                     trans_b: bool = False) -> float:
    """Decomposed GEMM+ReduceScatter: per chunk, world GEMMs of the chunk's rows of every owner, then a
    reduce_scatter of them beside the next chunk's GEMMs (one chunk: one GEMM of all M rows, then one
    reduce_scatter)."""
    shard = m // world
    rows = chunk_rows(shard, chunks)
    if len(rows) == 1:
        return gemm_us(m, n, k, dtype, num_sms=num_sms, rates=rates, tuned_us=tuned_us, trans_b=trans_b) + \
            collective_us(m * n * itemsize, world, rates)
    sms = num_sms - rates.comm_sms
    gemm = [world * (gemm_us(r, n, k, dtype, sms=sms, num_sms=num_sms, rates=rates, tuned_us=tuned_us,
                             trans_b=trans_b) + rates.launch_us) for r in rows]
    comm = [collective_us(world * r * n * itemsize, world, rates, beside_gemm=True) for r in rows]
    return _pipeline(0.0, comm, gemm, comm_first=False)


# --- the choice ----------------------------------------------------------------------------------------

def choose_path(op: str, m: int, n: int, k: int, world: int, plan, dtype: str = "bfloat16", *,
                capturing: bool = False, num_sms: int = H100_H200_SMS, rates: OpsRates | None = None,
                tuned_us=None, fp8: bool = False, trans_b: bool = False) -> PathChoice:
    """The path of one call of `op` ('ag_gemm' or 'gemm_rs') with M rows in total on `world` ranks, from
    the op's plan (``plan.path``, ``plan.decomposed_chunks``, its SMs reserved for communication). Pure:
    every rank computes it from the same arguments (the ops still agree on rank 0's choice, since the
    autotune cache is per host). fp8: the call has fp8 inputs (decomposed only; `tuned_us` then gives fp8
    GEMM times). trans_b: the weights are stored [N, K] (the untuned GEMM model's row alignment)."""
    if op not in ("ag_gemm", "gemm_rs"):
        raise OpsArgumentError(f"choose_path: unknown op {op!r}")
    rates = rates or OPS_RATES[DEFAULT_RATES]
    path = getattr(plan, "path", "auto")
    fixed = getattr(plan, "decomposed_chunks", None)
    if fp8:
        return _fp8_choice(op, m, n, k, world, path, fixed, dtype, capturing, num_sms, rates, tuned_us, trans_b)
    if capturing and path == "fused":
        raise OpsArgumentError(f"{op}: path='fused' inside a CUDA-graph capture: the fused kernels take per-call "
                               "epochs from the host, so a replay would reuse them; use path='auto' or 'decomposed'")
    kw = dict(num_sms=num_sms, rates=rates, tuned_us=tuned_us, trans_b=trans_b)
    dec_fn = ag_decomposed_us if op == "ag_gemm" else rs_decomposed_us
    options = (fixed,) if fixed else DECOMPOSED_CHUNKS
    cands = tuple((c, dec_fn(m, n, k, world, dtype, c, **kw)) for c in options)
    best_c, best_us = min(cands, key=lambda x: x[1])
    if world == 1:
        return PathChoice("decomposed", 1, "one rank: a plain GEMM", None, best_us, cands)
    if capturing:
        return PathChoice("decomposed", best_c, "inside a CUDA-graph capture (the fused kernels' flag epochs come "
                          "from the host and would repeat on replay)", None, best_us, cands)
    if op == "ag_gemm":
        fused = ag_fused_us(m, n, k, world, dtype, chunks_per_rank=plan.chunks_per_rank,
                            reserved_sms=plan.reserved_sms, **kw)
    else:
        fused = rs_fused_us(m, n, k, world, dtype, reserved_sms=plan.reserved_sms, **kw)
    if path == "fused":
        return PathChoice("fused", best_c, "path='fused' requested", fused, best_us, cands)
    if path == "decomposed":
        return PathChoice("decomposed", best_c, "path='decomposed' requested", fused, best_us, cands)
    if best_us * rates.margin < fused:
        why = (f"predicted {best_us:.1f} us decomposed ({_chunks(best_c)}) vs {fused:.1f} us fused (decomposed "
               f"must win by {rates.margin:.2f}x)")
        return PathChoice("decomposed", best_c, why, fused, best_us, cands)
    why = f"predicted {fused:.1f} us fused vs {best_us:.1f} us decomposed ({_chunks(best_c)})"
    return PathChoice("fused", best_c, why, fused, best_us, cands)


def _fp8_choice(op: str, m: int, n: int, k: int, world: int, path: str, fixed, dtype: str, capturing: bool,
                num_sms: int, rates: OpsRates, tuned_us, trans_b: bool = False) -> PathChoice:
    if path == "fused":
        raise OpsArgumentError(f"{op}: path='fused' with fp8 inputs: the fused kernels have no fp8 hooks yet; use "
                               "path='auto' or 'decomposed' (the fp8 GEMM per chunk beside chunked collectives)")

    def fp8_us(mm: int, nn: int, kk: int) -> float:
        us = tuned_us(mm, nn, kk) if tuned_us is not None else None
        if us is None:
            us = gemm_us(mm, nn, kk, dtype, num_sms=num_sms, rates=rates, trans_b=trans_b) * rates.fp8_gemm_factor
        return us

    dec_fn = ag_decomposed_us if op == "ag_gemm" else rs_decomposed_us
    # AllGather+GEMM moves fp8 bytes; GEMM+ReduceScatter reduces output-type (16-bit) partials
    itemsize = 1 if op == "ag_gemm" else 2
    cands = tuple((c, dec_fn(m, n, k, world, dtype, c, itemsize=itemsize, num_sms=num_sms, rates=rates,
                             tuned_us=fp8_us, trans_b=trans_b)) for c in ((fixed,) if fixed else DECOMPOSED_CHUNKS))
    best_c, best_us = min(cands, key=lambda x: x[1])
    why = "fp8 inputs: the fused kernels have no fp8 hooks, the fp8 GEMM runs per chunk beside the collectives"
    if world == 1:
        return PathChoice("decomposed", 1, "one rank: a plain fp8 GEMM", None, dict(cands).get(1, best_us), cands)
    if fixed is None and len(cands) > 1:
        why += f" ({_chunks(best_c)} predicted best: {best_us:.1f} us)"
    return PathChoice("decomposed", best_c, why, None, best_us, cands)


def _chunks(c: int) -> str:
    return f"{c} chunk{'s' if c > 1 else ''}"
