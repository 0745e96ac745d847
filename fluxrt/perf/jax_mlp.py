"""``fluxrt-perf jax_mlp``: the tensor-parallel MLP step in JAX with fluxrt's fused ops inside ``jax.jit``
(fluxrt.jax.TPOps), against the same step driven eagerly from Python and against JAX's own collectives.

Per shape (M rows over all ranks, hidden size H, intermediate size I over all ranks; each rank holds
I/world intermediate columns), under mpirun with one GPU per rank. One rank works too (JAX cannot run
several processes on one GPU; its collectives are then no-ops and the fluxrt ops plain GEMMs):

    jit_ms        jax.jit of TPOps.ag_gemm -> SiLU-and-multiply in XLA -> TPOps.gemm_rs
    jit_mlp_ms    jax.jit of TPOps.mlp (the block as one custom call, fluxrt's SiLU-and-multiply kernel)
    jit_cb_ms     jit_ms's step with command_buffer=True (the decomposed path; XLA may replay it as a graph)
    eager_ms      TPMLP.forward on CuPy arrays, called from Python on one CuPy stream (no JAX)
    shard_map_ms  jax.jit(shard_map) of all_gather -> dot -> SiLU-and-multiply -> dot -> psum_scatter
                  (XLA's NCCL collectives; several processes through jax.distributed)
    eager_over_jit, shard_map_over_jit   those times over jit_ms (above 1: the jitted fluxrt step is faster)

Timing: a round runs -n steps of a variant back to back and waits for the last one (block_until_ready, or
the CuPy stream); the host's wall clock over the round gives the time per step. CUDA events cannot bracket a
jitted step (XLA runs it on its own stream), so every column is timed this way. Ranks meet at a barrier
before each round; rounds go in turns over the variants; the median of --rounds rounds per rank, reduced
over ranks by -a. -c 1 checks the fluxrt steps against the shard_map step (or against each other without it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

from .baselines import device_info, library_versions, machine
from .report import column_table, device_lines, environment, results_document, version_line, write_json
from .sweep import AVERAGE_MODES, add_average_argument, add_timeout_argument, normalize_datatype, reduce_over_ranks
from .tp_ops import _DTYPES, parse_shapes

if TYPE_CHECKING:
    from ..world import World

DEFAULT_SHAPES = "4096x4096x14336,8192x8192x28672"   # llama3-8b's and llama3-70b's MLP
TOLERANCE = 3e-2   # max |err| / max |ref| between two bf16 steps that round their intermediates differently
VARIANTS = ("jit", "jit_mlp", "jit_cb", "eager", "shard_map")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluxrt-perf jax_mlp", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"MxHxI,... (default {DEFAULT_SHAPES})")
    p.add_argument("-d", "--datatype", default="bf16", type=normalize_datatype, help="bf16|fp16 (default bf16)")
    p.add_argument("-n", "--iters", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per variant (median)")
    p.add_argument("-w", "--warmup_iters", type=int, default=3)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    add_average_argument(p)
    add_timeout_argument(p)
    p.add_argument("--json", dest="json_path", default=None)
    return p


def time_rounds(world: World, steps: dict, iters: int, rounds: int, warmup: int, average: int) -> dict:
    """Milliseconds per step of each ``steps[name] = (step, wait)``: ``step()`` enqueues one step and returns
    its output, ``wait(out)`` blocks the host until it is done."""
    for step, wait in steps.values():
        out = None
        for _ in range(warmup):
            out = step()
        wait(out)
    world.check_errors()
    times: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, wait) in steps.items():
            world.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                out = step()
            wait(out)
            times[name].append((time.perf_counter() - t0) * 1e3 / iters)
    world.check_errors()
    return {name: reduce_over_ranks(world.comm.allgather(statistics.median(t)), average) for name, t in times.items()}


def jax_distributed(world: World) -> str | None:
    """Start jax.distributed over the world's ranks (one local GPU each, the world's), before JAX touches
    a GPU; None, or why not (the shard_map column is then left out)."""
    import socket

    import jax

    addr = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = f"{socket.gethostname()}:{s.getsockname()[1]}"
    addr = world.comm.bcast(addr, root=0)
    try:
        jax.distributed.initialize(coordinator_address=addr, num_processes=world.size, process_id=world.rank,
                                   local_device_ids=[world.device_id])
        why = None
    except Exception as e:   # noqa: BLE001 - reported as a note, the fluxrt columns still run
        why = f"jax.distributed.initialize failed: {type(e).__name__}: {e}"
    whys = [w for w in world.comm.allgather(why) if w]
    return whys[0] if whys else None


def _shard_map():
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def measure(world: World, m: int, hidden: int, inter: int, dtype: str, args, variants: set, notes: list) -> dict:
    import cupy
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fluxrt.jax as fj

    from ..dtypes import normalize_dtype

    w, me = world.size, world.rank
    f, shard = inter // w, m // w
    dt = normalize_dtype(dtype)
    rng = np.random.default_rng(100 + me)   # every rank its own rows and weight columns
    x = (rng.standard_normal((shard, hidden), dtype=np.float32)).astype(dt)
    gu = (rng.standard_normal((hidden, 2 * f), dtype=np.float32) / hidden ** 0.5).astype(dt)
    d = (rng.standard_normal((f, hidden), dtype=np.float32) / inter ** 0.5).astype(dt)
    dev = fj.device(world)
    jx, jgu, jd = (jax.device_put(v, dev) for v in (x, gu, d))

    def block(tp):
        def step(xs, wgu, wd):
            h = tp.ag_gemm(xs, wgu)
            a = (jax.nn.silu(h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)).astype(h.dtype)
            return tp.gemm_rs(a, wd)
        return jax.jit(step)

    tp, tp_cb = fj.TPOps(world), fj.TPOps(world, command_buffer=True)
    steps, outs = {}, {}
    wait = jax.block_until_ready
    if "jit" in variants:
        jit = block(tp)
        steps["jit"] = (lambda: jit(jx, jgu, jd), wait)
    if "jit_mlp" in variants or "eager" in variants:
        jit_mlp = jax.jit(lambda xs, wgu, wd: tp.mlp(xs, wgu, wd))
        wait(jit_mlp(jx, jgu, jd))   # traced: makes the TPMLP the eager column also calls
        if "jit_mlp" in variants:
            steps["jit_mlp"] = (lambda: jit_mlp(jx, jgu, jd), wait)
    if "jit_cb" in variants:
        jit_cb = block(tp_cb)
        steps["jit_cb"] = (lambda: jit_cb(jx, jgu, jd), wait)
    if "eager" in variants:
        mlp = tp.ops[("mlp", m, hidden, f, dt.name, False)]
        s = cupy.cuda.Stream(non_blocking=True)
        with world.device, s:
            cx, cgu, cd = cupy.asarray(x), cupy.asarray(gu), cupy.asarray(d)
            cy = cupy.empty((shard, hidden), dtype=dt)

        def eager():
            mlp.forward(cx, cgu, cd, out=cy, stream=s)
            return cy

        steps["eager"] = (eager, lambda _: s.synchronize())
    if "shard_map" in variants:
        try:
            steps["shard_map"] = (_shard_map_step(world, x, gu, d, f), wait)
        except Exception as e:   # noqa: BLE001 - a JAX without multi-process collectives here: a note
            notes.append(f"shard_map at {m}x{hidden}x{inter}: {type(e).__name__}: {e}")
    for name, (step, done) in steps.items():   # traced, warmed up and checked once
        out = step()
        done(out)
        if name == "shard_map":
            out = out.addressable_shards[0].data   # this rank's rows
        outs[name] = np.asarray(cupy.asnumpy(out) if name == "eager" else out).astype(np.float32)
    world.check_errors()
    errs, ref_name, scale = {}, None, None
    if args.check and outs:
        ref_name = "shard_map" if "shard_map" in outs else next(iter(outs))
        ref = outs[ref_name]
        scale = max(float(np.abs(ref).max()), 1e-30)
        if not scale > 1e-30:
            raise RuntimeError(f"jax_mlp {m}x{hidden}x{inter}: {ref_name}'s output is all zeros")
        for name, got in outs.items():
            if name != ref_name:
                err = float(np.abs(got - ref).max()) / scale
                errs[name] = max(world.comm.allgather(err))
        bad = {k: v for k, v in errs.items() if not v < TOLERANCE}
        if bad:
            raise RuntimeError(f"jax_mlp {m}x{hidden}x{inter}: steps differ from {ref_name}: {bad}")
    t = time_rounds(world, steps, args.iters, args.rounds, args.warmup_iters, args.average)
    paths = ",".join(f"{key[0]}:{p}" for (key, _), p in tp.paths().items())
    row = {"m": m, "hidden": hidden, "ffn": inter, "world": w, "dtype": dtype, "paths": paths,
           "captured": tp_cb.captured, "cb_calls": tp_cb.calls,
           **{f"{v}_ms": t.get(v) for v in VARIANTS},
           "check_against": ref_name, "ref_max_abs": scale,
           **{f"rel_err_{k}": v for k, v in errs.items()},
           "max_rel_err": max(errs.values()) if errs else None}
    base = t.get("jit")
    row["eager_over_jit"] = t["eager"] / base if base and t.get("eager") else None
    row["shard_map_over_jit"] = t["shard_map"] / base if base and t.get("shard_map") else None
    steps.clear()
    tp.free()
    tp_cb.free()
    return row


def _shard_map_step(world: World, x, gu, d, f: int):
    """The block as JAX writes it over a one-axis mesh of every rank's GPU: a jitted shard_map whose
    all_gather and psum_scatter are XLA's (NCCL) collectives. Returns the step (the arrays bound; it returns
    the global [M, H] array, of which this rank holds its rows)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import fluxrt.jax as fj

    w = world.size
    devs = sorted(jax.devices(), key=lambda dv: dv.process_index) if w > 1 else [fj.device(world)]
    mesh = Mesh(np.array(devs), ("tp",))

    def glob(local, spec, axis):
        shape = list(local.shape)
        shape[axis] *= w
        return jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, spec),
                                                        [jax.device_put(local, fj.device(world))])

    gx, ggu, gd = glob(x, P("tp", None), 0), glob(gu, P(None, "tp"), 1), glob(d, P("tp", None), 0)

    def local_block(xs, wgu, wd):
        xf = jax.lax.all_gather(xs, "tp", axis=0, tiled=True)
        h = jnp.dot(xf, wgu, preferred_element_type=jnp.float32).astype(xs.dtype)
        a = (jax.nn.silu(h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)).astype(xs.dtype)
        p = jnp.dot(a, wd, preferred_element_type=jnp.float32).astype(xs.dtype)
        return jax.lax.psum_scatter(p, "tp", scatter_dimension=0, tiled=True)

    step = jax.jit(_shard_map()(local_block, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
                                out_specs=P("tp", None)))

    return lambda: step(gx, ggu, gd)


_COLUMNS = (("M", "m", 6, None), ("H", "hidden", 6, None), ("I", "ffn", 6, None),
            ("jit", "jit_ms", 8, 3), ("jit_mlp", "jit_mlp_ms", 8, 3), ("jit_cb", "jit_cb_ms", 8, 3),
            ("eager", "eager_ms", 8, 3), ("shard_map", "shard_map_ms", 9, 3),
            ("eager/jit", "eager_over_jit", 9, 3), ("smap/jit", "shard_map_over_jit", 9, 3),
            ("captured", "captured", 8, None), ("paths", "paths", 30, None))


def format_table(rows: list[dict]) -> list[str]:
    return column_table(_COLUMNS, rows)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    dtype = _DTYPES.get(args.datatype)
    if dtype is None:
        print(f"fluxrt-perf jax_mlp: datatype {args.datatype} not supported (bf16 or fp16)", file=sys.stderr)
        return 2
    variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    if not variants or variants - set(VARIANTS):
        print(f"fluxrt-perf jax_mlp: --variants {args.variants!r}: choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    shapes = parse_shapes(args.shapes)
    # JAX must not take 75% of the GPU before NVSHMEM's heap exists (docs/embedding.md, "JAX")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import fluxrt

    # three sets of ops (jit, jit_mlp, jit_cb), each a gathered A and GEMM+ReduceScatter's partials
    heap = max(3 * 10 * m * h for m, h, _ in shapes) + (256 << 20)
    world_kw = {"timeout_s": args.timeout} if args.timeout > 0 else {}
    world = fluxrt.init(options=fluxrt.WorldOptions(heap_size=f"{-(-heap // (1 << 30))}G", check_collective_args=False,
                                                    **world_kw))
    notes: list = []
    try:
        for m, h, inter in shapes:
            if m % world.size or inter % (8 * world.size):
                raise ValueError(f"jax_mlp: M={m} must be a multiple of {world.size} and I={inter} of {8 * world.size}")
        if "shard_map" in variants and world.size > 1:
            why = jax_distributed(world)
            if why:
                notes.append(why)
                variants.discard("shard_map")
        import jax

        versions, devices = library_versions(), device_info(world)
        versions["jax"] = jax.__version__
        rows = []
        if world.rank == 0:
            print(f"# fluxrt-perf jax_mlp: world={world.size} dtype={args.datatype} steps={args.iters} "
                  f"rounds={args.rounds} warmup={args.warmup_iters}; ms per step, host wall clock "
                  f"({AVERAGE_MODES[args.average]} over ranks)")
            print(version_line(versions) + f" | JAX {jax.__version__}")
            for line in device_lines(devices):
                print(line)
            print(format_table([])[0], flush=True)
        for m, h, inter in shapes:
            row = measure(world, m, h, inter, dtype, args, variants, notes)
            rows.append(row)
            if world.rank == 0:
                print(format_table([row])[1], flush=True)
        if world.rank == 0:
            for note in notes:
                print(f"# {note}")
            if args.json_path:
                doc = results_document("jax_mlp", rows, ["fluxrt-perf", "jax_mlp"] + argv, machine=machine(world),
                                       versions=versions, devices=devices, options=vars(args), notes=notes)
                doc["environment"].update(environment(prefixes=("XLA_", "JAX_")))   # command buffers, memory
                write_json(args.json_path, doc)
    finally:
        world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
