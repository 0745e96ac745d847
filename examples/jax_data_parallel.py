"""Data-parallel training steps in JAX with fluxrt's allreduce inside jax.jit, checked against the same
steps on the whole batch in one process (jax.numpy, float64 reference on the host).

    fluxrt-run -n 4 -- python examples/jax_data_parallel.py

Every rank holds a shard of the batch; the jitted step computes the local gradient of a least-squares loss,
averages it across ranks with ``fluxrt.jax.allreduce(op="avg")`` on XLA's stream, and updates the weights.
"""
import os

# JAX must not take 75% of the GPU before NVSHMEM's heap exists (docs/embedding.md, "JAX")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import fluxrt  # noqa: E402


def main(steps: int = 5, features: int = 256, rows_per_rank: int = 1024, lr: float = 0.1) -> None:
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size="1G"))   # before JAX allocates
    import jax
    import jax.numpy as jnp

    import fluxrt.jax as fj

    rng = np.random.default_rng(0)   # the same data on every rank; each takes its shard
    n = world.size
    xs = rng.standard_normal((n * rows_per_rank, features)).astype(np.float32)
    true_w = rng.standard_normal(features).astype(np.float32)
    ys = (xs @ true_w + 0.01 * rng.standard_normal(n * rows_per_rank)).astype(np.float32)
    lo, hi = world.rank * rows_per_rank, (world.rank + 1) * rows_per_rank

    def loss(w, x, y):
        return 0.5 * jnp.mean((x @ w - y) ** 2)

    @jax.jit
    def step(w, x, y):
        g = jax.grad(loss)(w, x, y)                       # this rank's shard
        return w - lr * fj.allreduce(g, world=world, op="avg")   # the mean over the shards = full-batch gradient

    w = jnp.zeros(features, jnp.float32)
    x, y = jnp.asarray(xs[lo:hi]), jnp.asarray(ys[lo:hi])
    for _ in range(steps):
        w = step(w, x, y)
    w = np.asarray(jax.block_until_ready(w), dtype=np.float64)
    world.check_errors()

    ref = np.zeros(features)                              # the full batch in float64, one process
    xd, yd = xs.astype(np.float64), ys.astype(np.float64)
    for _ in range(steps):
        ref -= lr * xd.T @ (xd @ ref - yd) / len(yd)
    err = float(np.max(np.abs(w - ref)) / max(1e-12, np.max(np.abs(ref))))
    if world.rank == 0:
        print(f"{n} ranks, {steps} steps: max relative difference to the full-batch float64 reference {err:.2e}")
    assert err < 1e-4, err
    world.finalize()


if __name__ == "__main__":
    main()
