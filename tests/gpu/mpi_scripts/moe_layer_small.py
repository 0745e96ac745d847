"""A small MoE layer on however many ranks start it (one is enough), overlapped (with and without dedupe: the
dispatch beside the gate/up GEMM, the down GEMM's rows pushed back to their homes beside the combine) and
sequential, against a float64
reference: the case the compute sanitizers run (launch/gpu-check.sh "sanitize", launch/mps-check.sh users).

    compute-sanitizer --tool memcheck python3 tests/gpu/mpi_scripts/moe_layer_small.py

Exits 0 and prints "moe_layer_small: ok" when every output is within the bound; 1 otherwise."""
import os
import sys

import numpy as np

import fluxrt
import fluxrt.moe as moe

HIDDEN, FFN, TOKENS, K = 264, 200, 48, 3
TOL = 3e-2


def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def reference(x, idx, w, wgu, wd):
    out = np.zeros(x.shape, np.float64)
    x64, f = x.astype(np.float64), wd.shape[2]
    for e in np.unique(idx[idx >= 0]):
        t, j = np.nonzero(idx == e)
        h = x64[t] @ wgu[e].T
        g = h[:, :f]
        y = (g / (1.0 + np.exp(-g)) * h[:, f:]) @ wd[e].T
        np.add.at(out, t, w[t, j].astype(np.float64)[:, None] * y)
    return out


def main() -> int:
    import cupy

    device = os.environ.get("FLUXRT_TEST_DEVICE")
    bad = 0
    with fluxrt.init(device=int(device) if device else None,
                     options=fluxrt.WorldOptions(heap_size="512M", timeout_s=20)) as world:
        e = 4 * world.size
        g = np.random.default_rng(7)
        wgu = (g.standard_normal((e, 2 * FFN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32).astype(bf16())
        wd = (g.standard_normal((e, HIDDEN, FFN)) / np.sqrt(FFN)).astype(np.float32).astype(bf16())
        el, r = e // world.size, world.rank
        rng = np.random.default_rng([11, r])
        cases = []
        for t in (TOKENS, 1, 0, 29):
            x = rng.standard_normal((t, HIDDEN)).astype(np.float32).astype(bf16())
            idx = np.array([rng.choice(e, size=K, replace=False) for _ in range(t)], np.int32).reshape(t, K)
            idx[rng.random((t, K)) < 0.2] = -1
            cases.append((x, idx, (rng.random((t, K)) + 0.1).astype(np.float32)))
        outs = {}
        for overlap, dedupe in ((True, False), (True, True), (False, False)):
            layer = moe.MoELayer(world, e, HIDDEN, FFN, TOKENS, "bf16", moe.MoELayerOptions(
                dispatch=moe.DispatcherOptions(top_k=K, blocks=4, threads=256, dedupe=dedupe), overlap=overlap))
            layer.set_weights(w_gate_up=cupy.asarray(wgu[r * el:(r + 1) * el]),
                              w_down=cupy.asarray(wd[r * el:(r + 1) * el]))
            for c, (x, idx, w) in enumerate(cases):
                got = layer.forward(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w)).get()
                world.synchronize()
                outs[overlap, dedupe, c] = got
                ref = reference(x, idx, w, wgu.astype(np.float64), wd.astype(np.float64))
                got = got.astype(np.float64)
                err = np.abs(got - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-30)
                if not (np.isfinite(got).all() and err < TOL):
                    print(f"moe_layer_small: rank {r} overlap={overlap} dedupe={dedupe} T={x.shape[0]}: relative "
                          f"error {err:.3g}", flush=True)
                    bad += 1
            layer.free()
        for c in range(len(cases)):   # the same kernels and the same order of every sum: the same bits
            for dedupe in (False, True):
                if not np.array_equal(outs[True, dedupe, c].view(np.uint16), outs[False, False, c].view(np.uint16)):
                    print(f"moe_layer_small: rank {r} case {c}: overlapped (dedupe={dedupe}) and sequential outputs "
                          "differ", flush=True)
                    bad += 1
    if bad == 0:
        print("moe_layer_small: ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
