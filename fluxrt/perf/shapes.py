"""The GEMM shape suite: the linear layers of open LLMs under tensor parallelism, plus seeded odd shapes.

A shape is (M, N, K, layout): C[M, N] = A[M, K] @ W, with the weight W stored [K, N] (layout "KN",
``trans_b=False``) or [N, K] (layout "NK", ``trans_b=True``, as most checkpoints store it).

Layers per model (hidden H, intermediate I, query heads q, key/value heads kv, head dim d):
  qkv     column-parallel: N = (q + 2 kv) d / TP, K = H
  o       row-parallel:    N = H, K = q d / TP
  gate_up column-parallel (gate and up fused): N = 2 I / TP, K = H
  down    row-parallel:    N = H, K = I / TP
DeepSeek-V3's dense layers use multi-head latent attention: its column-parallel attention GEMM is the
query up-projection (K = q_lora_rank 1536, N = 128 heads x 192 / TP) and its row-parallel one the output
projection (K = 128 x 128 / TP, N = 7168).

Suites:
  full     every model x layer x TP {1, 2, 4, 8} x M {256, 1024, 2048, 4096, 8192, 16384} x both layouts,
           duplicates removed
  core     a deterministic subset of full (every model, layer, TP, M and layout appears), capped in FLOPs so
           that one pass fits a benchmark job
  random   seeded shapes whose M, N, K are not multiples of 64 (K and N multiples of 8: 16-byte rows)
  default  core + random

    python -m fluxrt.perf.shapes --suite core       # print a suite (also: python perf/shapes.py)
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

MODELS = {
    # name: (hidden, intermediate, query heads, kv heads, head dim)
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
    "llama3-405b": (16384, 53248, 128, 8, 128),
    "qwen2.5-72b": (8192, 29568, 64, 8, 128),
    "mixtral-8x22b": (6144, 16384, 48, 8, 128),   # one expert's MLP
    "deepseek-v3": (7168, 18432, 128, 128, 128),  # dense layers; attention: see the module docstring
}
TPS = (1, 2, 4, 8)
MS = (256, 1024, 2048, 4096, 8192, 16384)
LAYOUTS = ("NK", "KN")
CORE_MAX_FLOP = 2.5e13     # per call: the largest shapes (405B gate_up at M 16384) take 50+ ms each


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    layout: str = "NK"
    label: str = ""

    @property
    def trans_b(self) -> bool:
        return self.layout == "NK"

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def key(self) -> tuple:
        return (self.m, self.n, self.k, self.layout)


def shape_arg(text: str) -> Shape:
    """M,N,K,NK|KN -> Shape (label 'cli'): the argparse type of the GEMM scripts' shape arguments, which reports
    what is wrong with a malformed one."""
    parts = text.split(",")
    if len(parts) != 4 or parts[3] not in LAYOUTS or not all(p.isdigit() and int(p) > 0 for p in parts[:3]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected M,N,K,NK or M,N,K,KN with positive M, N, K")
    return Shape(int(parts[0]), int(parts[1]), int(parts[2]), layout=parts[3], label="cli")


def layer_dims(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of `model` on one of `tp` ranks."""
    h, inter, q, kv, d = MODELS[model]
    if model == "deepseek-v3":
        return {"qkv": (128 * 192 // tp, 1536), "o": (h, 128 * 128 // tp),
                "gate_up": (2 * inter // tp, h), "down": (h, inter // tp)}
    return {"qkv": ((q + 2 * kv) * d // tp, h), "o": (h, q * d // tp),
            "gate_up": (2 * inter // tp, h), "down": (h, inter // tp)}


def full_suite() -> list[Shape]:
    seen, out = set(), []
    for model in MODELS:
        for tp in TPS:
            for layer, (n, k) in layer_dims(model, tp).items():
                for m in MS:
                    for layout in LAYOUTS:
                        s = Shape(m, n, k, layout, f"{model}/{layer}/tp{tp}")
                        if s.key() not in seen:
                            seen.add(s.key())
                            out.append(s)
    return out


def core_suite() -> list[Shape]:
    """Per model, layer and TP: two values of M (rotating through MS) and alternating layouts, so that
    every M, TP and layout appears for every model; shapes over CORE_MAX_FLOP are left out."""
    out, seen, i = [], set(), 0
    for model in MODELS:
        for tp in TPS:
            for layer, (n, k) in layer_dims(model, tp).items():
                for j in range(2):
                    m = MS[(i + 3 * j) % len(MS)]
                    layout = LAYOUTS[(i + j) % 2]
                    s = Shape(m, n, k, layout, f"{model}/{layer}/tp{tp}")
                    if s.flop <= CORE_MAX_FLOP and s.key() not in seen:
                        seen.add(s.key())
                        out.append(s)
                i += 1
    return out


def random_suite(count: int = 24, seed: int = 2406) -> list[Shape]:
    """Shapes whose M, N and K are not multiples of 64; K and N multiples of 8 (16-byte rows of 16-bit
    elements), M any value."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        m = rng.randrange(65, 12000)
        n = 8 * rng.randrange(9, 1800)
        k = 8 * rng.randrange(9, 1800)
        if m % 64 and n % 64 and k % 64:
            out.append(Shape(m, n, k, LAYOUTS[len(out) % 2], "random"))
    return out


# The fused tensor-parallel ops' sweep (``fluxrt-perf ag_gemm / gemm_rs --suite``): the column-parallel layers
# feed AllGather+GEMM, the row-parallel ones GEMM+ReduceScatter.
TP_OP_LAYERS = {"ag_gemm": ("qkv", "gate_up"), "gemm_rs": ("o", "down")}
TP_OP_SUITES = {"tp": (1024, 2048, 4096, 8192, 16384), "tp-quick": (1024, 4096, 16384)}


def tp_op_suite(op: str, tp: int, name: str = "tp") -> list[Shape]:
    """Per-rank GEMMs of `op` ('ag_gemm' or 'gemm_rs') over every model's layers of TP_OP_LAYERS at TP=`tp`
    (AllGather+GEMM: N per rank, K = hidden; GEMM+ReduceScatter: N = hidden, K per rank), at each M of
    TP_OP_SUITES[name] (M: rows over all ranks), [K, N] weights, duplicates removed."""
    if op not in TP_OP_LAYERS:
        raise KeyError(f"unknown fused op {op!r}; one of {', '.join(TP_OP_LAYERS)}")
    if name not in TP_OP_SUITES:
        raise KeyError(f"unknown TP op suite {name!r}; one of {', '.join(TP_OP_SUITES)}")
    seen, out = set(), []
    for model in MODELS:
        dims = layer_dims(model, tp)
        for layer in TP_OP_LAYERS[op]:
            n, k = dims[layer]
            for m in TP_OP_SUITES[name]:
                s = Shape(m, n, k, "KN", f"{model}/{layer}/tp{tp}")
                if s.key() not in seen and m % tp == 0:
                    seen.add(s.key())
                    out.append(s)
    return out


def tp_mlp_suite(tp: int, name: str = "tp") -> list[tuple[int, int, int, str]]:
    """(M, hidden, intermediate over all ranks, label) of every model's MLP block at TP=`tp`, at each M of
    TP_OP_SUITES[name]."""
    out = []
    for model, (h, inter, *_rest) in MODELS.items():
        if inter % (8 * tp):
            continue
        out += [(m, h, inter, f"{model}/mlp/tp{tp}") for m in TP_OP_SUITES[name] if m % tp == 0]
    return out


SUITES = {
    "full": full_suite,
    "core": core_suite,
    "random": random_suite,
    "default": lambda: core_suite() + random_suite(),
}


def suite(name: str) -> list[Shape]:
    if name not in SUITES:
        raise KeyError(f"unknown shape suite {name!r}; one of {', '.join(SUITES)}")
    return SUITES[name]()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Print a GEMM shape suite.")
    ap.add_argument("--suite", default="default", choices=sorted(SUITES))
    args = ap.parse_args(argv)
    shapes = suite(args.suite)
    print(f"# {args.suite}: {len(shapes)} shapes, {sum(s.flop for s in shapes) / 1e12:.1f} TFLOP per pass")
    print(f"{'M':>6} {'N':>6} {'K':>6} {'W':>2}  label")
    for s in shapes:
        print(f"{s.m:>6} {s.n:>6} {s.k:>6} {s.layout:>2}  {s.label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
