"""The paper model of docs/multinode.md: hierarchical allreduce bandwidth and data-parallel overlap for N nodes
of G GPUs with one InfiniBand NIC per GPU. Prints the tables the doc shows (`python perf/multinode_model.py`);
every input is a `Machine` field, so calibration numbers replace the defaults without touching the formulas.

    T_node     = 2 * alpha_nvl + 2 (G-1)/G * S / B_nvl              node reduce-scatter + node all-gather
    T_rail     = alpha_ib + (N-1) * (S/G) / (eta * B_ib)            one-shot rail (every member to every member)
               = 2 alpha_ib + 2 (N-1)/N * (S/G) / (eta * B_ib)      reduce-scatter + all-gather along the rail
    as built:  T = T_node + T_rail                                  (stages one after another)
    pipelined: T = max(T_node, T_rail) + alpha terms                (slices flow through the three stages)
    busbw      = S / T * 2 (n-1)/n,  n = N G                        (nccl-tests' convention)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Machine:
    gpus_per_node: int = 8
    b_nvl: float = 360 * GB       # per-GPU NVLink collective rate (busbw): fluxrt ring allreduce, 4x H200, 1 GiB
    b_ib: float = 46 * GB         # per-NIC NDR 400 Gb/s rate NCCL reaches (46-48 GB/s, nccl-tests issue 290)
    eta: float = 1.0              # NVSHMEM rail path / raw rate (calibration: virtual topology, target >= 0.85)
    alpha_nvl: float = 10e-6      # one node stage (fluxrt small allreduce, 4x H200: ~10 us)
    alpha_ib: float = 8e-6        # one rail round (placeholder until measured on IB)
    oneshot_bytes: int = 256 << 10  # collectives_hier.ONESHOT_BYTES


def rail_time(m: Machine, nodes: int, shard: float, algo: str) -> float:
    b = m.eta * m.b_ib
    if nodes == 1:
        return 0.0
    if algo == "oneshot":
        return m.alpha_ib + (nodes - 1) * shard / b
    return 2 * m.alpha_ib + 2 * (nodes - 1) / nodes * shard / b


def rail_algo(m: Machine, nodes: int, shard: float) -> str:
    return "oneshot" if nodes <= 2 or shard <= m.oneshot_bytes else "rs_ag"


def allreduce_time(m: Machine, nodes: int, size: float, pipelined: bool = False) -> float:
    g = m.gpus_per_node
    node = 2 * m.alpha_nvl + 2 * (g - 1) / g * size / m.b_nvl
    shard = size / g
    if pipelined:
        rail = rail_time(m, nodes, shard, "rs_ag" if nodes > 2 else "oneshot")
        return max(node, rail) + 2 * m.alpha_nvl + 2 * m.alpha_ib
    return node + rail_time(m, nodes, shard, rail_algo(m, nodes, shard))


def busbw(m: Machine, nodes: int, size: float, pipelined: bool = False) -> float:
    n = nodes * m.gpus_per_node
    return size / allreduce_time(m, nodes, size, pipelined) * 2 * (n - 1) / n


def dp_overlap(m: Machine, nodes: int, grad_bytes: float, backward_s: float) -> tuple[float, float, float]:
    """(rail allreduce time, hidden fraction, exposed time) of one layer's gradients when TP fills the node and
    the data-parallel group is the rail (the gradients of a TP shard cross nodes only)."""
    t = rail_time(m, nodes, grad_bytes, rail_algo(m, nodes, grad_bytes))
    return t, min(1.0, backward_s / t) if t else 1.0, max(0.0, t - backward_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eta", type=float, default=1.0, help="NVSHMEM rail efficiency (calibration)")
    ap.add_argument("--b-nvl", type=float, default=360, help="GB/s")
    ap.add_argument("--b-ib", type=float, default=46, help="GB/s per NIC")
    args = ap.parse_args(argv)
    m = Machine(b_nvl=args.b_nvl * GB, b_ib=args.b_ib * GB, eta=args.eta)
    sizes = [(64 << 20, "64 MiB"), (1 << 30, "1 GiB"), (4 << 30, "4 GiB")]
    print("| nodes | ranks | " + " | ".join(f"{s} as built | {s} pipelined" for _, s in sizes) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in sizes) + " |")
    for nodes in (2, 4, 8, 16):
        cells = [f"{busbw(m, nodes, s) / GB:.0f} | {busbw(m, nodes, s, True) / GB:.0f}" for s, _ in sizes]
        print(f"| {nodes} | {nodes * m.gpus_per_node} | " + " | ".join(cells) + " |")
    # a 70B-class layer (hidden 8192, 64 query / 8 KV heads, FFN 28672), TP 8 inside the node, bf16 gradients,
    # 8192 tokens per data-parallel replica, backward at 700 TFLOP/s per GPU
    params = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    grad = params / 8 * 2
    backward = 4 * 8192 * params / 8 / 700e12
    print(f"\nlayer: {params / 1e6:.0f} M parameters, {grad / 1e6:.0f} MB of bf16 gradients per GPU, "
          f"backward {backward * 1e3:.2f} ms per GPU")
    print("| nodes | rail allreduce ms | hidden fraction | exposed ms per layer |")
    print("| --- | --- | --- | --- |")
    for nodes in (2, 4, 8, 16):
        t, h, exposed = dp_overlap(m, nodes, grad, backward)
        print(f"| {nodes} | {t * 1e3:.2f} | {h:.2f} | {exposed * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
