"""The next layer's AllGather+GEMM reading the FP8 output of the fused allreduce + residual + RMSNorm.

    fluxrt-run -n 4 -- python examples/norm_fp8_ag_gemm.py [--T 4096] [--hidden 7168] [--N 4608]

Each rank holds a partial sum x [T, H] of the previous layer's row-parallel GEMM (tensor parallelism) and the
replicated residual. ``fluxrt.fused.allreduce_rmsnorm(..., quant="per_block")`` sums the partials, adds the
residual and normalises in one launch, writing e4m3 codes [T, H] and one fp32 scale per 1 x 128 block. Every
rank then takes its T / world rows of those codes and scales as its shard of the next layer's input, and
``AllGatherGemm(..., fp8=Fp8Options("e4m3", "block"))`` gathers the fp8 bytes (half of bf16's) and their
scales and multiplies them with this rank's weight columns [N, H] (e4m3 with 128 x 128 block scales). Nothing
is converted back to bf16 between the two ops.

The result is checked against float64 numpy on every rank (the same chain without any quantization), and
the GEMM alone against the dequantized codes it was given.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

log = logging.getLogger("norm_fp8_ag_gemm")


def quantize_blocks(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 codes (uint8) of w [N, K] and fp32 scales [ceil(N/128), ceil(K/128)], one per 128 x 128 block
    (scale = absmax / 448, the largest finite e4m3 value)."""
    import ml_dtypes

    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = np.zeros((nb * block, kb * block))
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(nb, block, kb, block)).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    codes = (w / np.repeat(np.repeat(scales, block, 0), block, 1)[:n, :k]).astype(ml_dtypes.float8_e4m3fn)
    return codes.view(np.uint8), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, rows_per_scale: int) -> np.ndarray:
    """float64 values of e4m3 codes [R, K] with scales [ceil(R/rows_per_scale), ceil(K/128)]."""
    import ml_dtypes

    x = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.repeat(np.repeat(scales.astype(np.float64), rows_per_scale, 0), 128, 1)
    return x * s[:x.shape[0], :x.shape[1]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=4096, help="tokens (rows) over all ranks")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--N", type=int, default=4608, help="this rank's output columns of the next layer")
    ap.add_argument("--eps", type=float, default=1e-6)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import cupy

    import fluxrt
    from fluxrt.ops import AllGatherGemm, Fp8Options

    with fluxrt.init() as world:
        w, me = world.size, world.rank
        if args.T % w:
            raise SystemExit(f"--T must be a multiple of the world size {w}")
        t, h, n, shard = args.T, args.hidden, args.N, args.T // w
        rng = np.random.default_rng(1234 + me)
        shared = np.random.default_rng(99)   # residual and norm weight: replicated
        x = rng.standard_normal((t, h)).astype(np.float32) / w
        residual = shared.standard_normal((t, h)).astype(np.float32)
        weight = (1.0 + 0.1 * shared.standard_normal(h)).astype(np.float32)
        w_next = rng.standard_normal((n, h)) / h ** 0.5   # this rank's columns of the next layer, [N, H]
        w8, w_scales = quantize_blocks(w_next)

        bf16 = fluxrt.bfloat16
        x_d, res_d, wt_d = (cupy.asarray(a.astype(bf16)) for a in (x, residual, weight))
        codes = cupy.empty((t, h), dtype=cupy.uint8)
        scales = cupy.empty((t, -(-h // 128)), dtype=cupy.float32)
        res_out = cupy.empty((t, h), dtype=bf16)
        out = cupy.empty((t, n), dtype=bf16)
        w8_d, w_scales_d = cupy.asarray(w8), cupy.asarray(w_scales)
        ag = AllGatherGemm(world, t, n, h, "bfloat16", trans_b=True, fp8=Fp8Options("e4m3", "block"))
        s = cupy.cuda.Stream(non_blocking=True)

        fluxrt.fused.allreduce_rmsnorm(world, x_d, res_d, wt_d, args.eps, out=codes, residual_out=res_out,
                                       quant="per_block", scales_out=scales, stream=s)
        rows = slice(me * shard, (me + 1) * shard)   # this rank's shard of the next layer's input
        ag.forward(codes[rows], w8_d, out=out, stream=s, scale_a=scales[rows], scale_b=w_scales_d)
        world.synchronize(s)

        # float64 reference of the whole chain, without quantization (every rank's partials over MPI)
        total = np.sum(world.comm.allgather(x.astype(bf16).astype(np.float64)), axis=0)
        hid = total + residual.astype(bf16).astype(np.float64)
        y = hid / np.sqrt(np.mean(hid * hid, axis=1, keepdims=True) + args.eps) * weight.astype(bf16).astype(np.float64)
        want = y @ w_next.T
        got = cupy.asnumpy(out).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        # the GEMM alone against the codes and scales it gathered (every rank's shard is this rank's rows of
        # the same allreduced output, so the local copy is the whole gathered input)
        a_deq = dequantize(cupy.asnumpy(codes), cupy.asnumpy(scales), 1)
        gemm_err = np.linalg.norm(got - a_deq @ dequantize(w8, w_scales, 128).T) / np.linalg.norm(want)
        errs = world.comm.allgather((err, gemm_err))
        if me == 0:
            for r, (e, g) in enumerate(errs):
                log.info("rank %d: relative error %.2e against float64 (fp8 e4m3 input and weight), %.2e of the "
                         "GEMM against its dequantized inputs", r, e, g)
        ag.free()
        bad = [r for r, (e, g) in enumerate(errs) if not (e < 6e-2 and g < 1e-2)]
        if bad:
            raise SystemExit(f"ranks {bad}: error above the bounds (6e-2 whole chain, 1e-2 GEMM)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
