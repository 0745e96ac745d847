"""A tensor-parallel MLP in JAX with fluxrt's fused ops inside jax.jit, checked against the unsharded MLP in
jax.numpy on one GPU.

    python -m fluxrt.launch -n 4 -- python examples/jax_tp_mlp.py [--M 4096] [--hidden 4096] [--ffn 14336]

Every rank builds the same full weights (W_gate, W_up [hidden, ffn], W_down [ffn, hidden]) from one seed and
keeps its slice of the intermediate layer: rank r holds columns [r f, (r+1) f) of W_gate and W_up (f =
ffn / world), side by side as w_gate_up [hidden, 2 f], and the same rows of W_down [f, hidden]; and M/world
rows of the activations x [M, hidden]. The jitted step is

    h = allgather(x_shard) @ w_gate_up            fluxrt.jax.TPOps.ag_gemm   (AllGather+GEMM)   [M, 2 f]
    a = silu(h[:, :f]) * h[:, f:]                 XLA                                          [M, f]
    y = reduce_scatter(a @ w_down)                fluxrt.jax.TPOps.gemm_rs   (GEMM+ReduceScatter) [M/world, hidden]

and the same block as one call (TPOps.mlp, fluxrt's own SiLU-and-multiply kernel). Rank 0 gathers every
rank's y and compares it with silu(x @ W_gate) * (x @ W_up) @ W_down computed by jax.numpy in float32 on its
GPU (max |err| / max |ref| below --tol).
"""
from __future__ import annotations

import argparse
import os
import time

# JAX must not take 75% of the GPU before NVSHMEM's heap exists (docs/embedding.md, "JAX")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import fluxrt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, default=4096, help="tokens (rows) over all ranks")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336, help="intermediate size over all ranks")
    ap.add_argument("--steps", type=int, default=10, help="jitted steps timed after the checked one")
    ap.add_argument("--tol", type=float, default=2e-2, help="bound on max |err| / max |ref| (bf16 outputs)")
    ap.add_argument("--device", type=int, default=None,
                    help="one GPU for every rank (several ranks on one GPU under CUDA MPS: a correctness run)")
    args = ap.parse_args(argv)

    # two sets of ops (the step's and TPOps.mlp's), each a gathered A and GEMM+ReduceScatter's partials
    heap = 2 * 10 * args.M * args.hidden + (256 << 20)
    with fluxrt.init(device=args.device, options=fluxrt.WorldOptions(heap_size=f"{-(-heap // (1 << 30))}G")) as world:
        import jax
        import jax.numpy as jnp

        import fluxrt.jax as fj

        w, me = world.size, world.rank
        if args.M % w or args.ffn % (8 * w):
            raise SystemExit(f"--M must be a multiple of {w} and --ffn of {8 * w}")
        f, shard, H = args.ffn // w, args.M // w, args.hidden
        rng = np.random.default_rng(1234)   # the same full weights and activations on every rank
        x = rng.standard_normal((args.M, H), dtype=np.float32).astype(fluxrt.bfloat16)
        w_gate = (rng.standard_normal((H, args.ffn), dtype=np.float32) / H ** 0.5).astype(fluxrt.bfloat16)
        w_up = (rng.standard_normal((H, args.ffn), dtype=np.float32) / H ** 0.5).astype(fluxrt.bfloat16)
        w_down = (rng.standard_normal((args.ffn, H), dtype=np.float32) / args.ffn ** 0.5).astype(fluxrt.bfloat16)
        cols = slice(me * f, (me + 1) * f)
        dev = fj.device(world)
        x_shard = jax.device_put(x[me * shard:(me + 1) * shard], dev)
        w_gate_up = jax.device_put(np.concatenate([w_gate[:, cols], w_up[:, cols]], axis=1), dev)
        w_down_r = jax.device_put(np.ascontiguousarray(w_down[cols]), dev)

        tp = fj.TPOps(world)   # the fused ops, one per shape, made when the steps are traced

        @jax.jit
        def step(xs, gu, d):
            h = tp.ag_gemm(xs, gu)
            a = (jax.nn.silu(h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)).astype(h.dtype)
            return tp.gemm_rs(a, d)

        block = jax.jit(lambda xs, gu, d: tp.mlp(xs, gu, d))

        results = {}
        for name, fn in (("ag_gemm + XLA SiLU + gemm_rs", step), ("TPOps.mlp", block)):
            y = jax.block_until_ready(fn(x_shard, w_gate_up, w_down_r))   # traced, warmed up and run
            world.check_errors()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                y = fn(x_shard, w_gate_up, w_down_r)
            jax.block_until_ready(y)
            ms = (time.perf_counter() - t0) * 1e3 / max(args.steps, 1)
            world.check_errors()
            results[name] = (world.comm.gather(np.asarray(y), root=0), ms)

        paths = tp.paths()
        if me == 0:   # the whole MLP, unsharded, on this GPU
            ref = jax.jit(lambda xx, g, u, d: (jax.nn.silu(jnp.dot(xx, g, preferred_element_type=jnp.float32))
                                               * jnp.dot(xx, u, preferred_element_type=jnp.float32))
                          @ d.astype(jnp.float32))
            y_ref = np.asarray(ref(*(jax.device_put(v, dev) for v in (x, w_gate, w_up, w_down))), dtype=np.float64)
            scale = max(float(np.abs(y_ref).max()), 1e-30)
            print(f"# {w} ranks, M={args.M} hidden={H} ffn={args.ffn} (f={f} per rank), bf16; paths "
                  + ", ".join(f"{key[0]} {p}" for (key, _), p in paths.items()))
            worst = 0.0
            for name, (ys, ms) in results.items():
                got = np.concatenate(ys).astype(np.float64)
                err = float(np.abs(got - y_ref).max()) / scale
                worst = max(worst, err)
                print(f"{name:30s} max |err| / max |ref| = {err:.2e}   {ms:.3f} ms per jitted step "
                      f"(host wall clock, {args.steps} steps)")
            ok = worst < args.tol
            print("OK" if ok else f"FAILED: relative error {worst:.3g} >= {args.tol}")
        else:
            ok = None
        ok = world.comm.bcast(ok, root=0)
        tp.free()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
