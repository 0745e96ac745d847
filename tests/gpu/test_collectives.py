"""GPU tests of the collectives against numpy float64 references (mpirun -n 2|4 python -m pytest tests/gpu).

Every rank runs the same tests in the same order with the same parameters; inputs differ per rank. The
reference gathers every rank's input to the host over MPI. Outputs are poisoned before each call."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multirank

REDUCE_DTYPES = ("bf16", "fp16", "fp32")
MOVE_DTYPES = ("bf16", "fp16", "fp32", "int32")
REDOPS = ("sum", "max", "min")
_EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -10, "fp32": 2.0 ** -22}


def _dtype(name):
    import fluxrt

    return fluxrt.normalize_dtype(name)


def _data(seed: int, world, count: int, dtype: str):
    """Per-rank random input on the device (uniform [-1, 1) floats, or integers)."""
    import cupy

    rng = cupy.random.default_rng(seed * 1009 + world.rank)
    if dtype == "int32":
        return rng.integers(-1000, 1000, size=count, dtype=np.int64).astype(np.int32)
    return rng.uniform(-1.0, 1.0, size=count).astype(_dtype(dtype))


def _poisoned(count: int, dtype: str):
    import cupy

    out = cupy.empty(count, dtype=_dtype(dtype))
    out.fill(-7777 if dtype == "int32" else np.nan)
    return out


def _gather(world, x) -> list[np.ndarray]:
    import cupy

    return [a.astype(np.float64).reshape(-1) for a in world.comm.allgather(cupy.asnumpy(x))]


def _host(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(x).astype(np.float64).reshape(-1)


def _assert_reduced(got: np.ndarray, inputs: list[np.ndarray], redop: str, dtype: str, what: str,
                    algo: str = "auto") -> None:
    """Sums: fp32 accumulation rounded once to the dtype; the ring (algo 'ring') also rounds each of its
    n - 2 partial sums on the way (each off by at most EPS times the sum of magnitudes)."""
    ref = inputs[0].copy()
    if redop == "sum":
        magnitude = np.abs(inputs[0])
        for a in inputs[1:]:
            ref += a
            magnitude += np.abs(a)
        partials = max(0, len(inputs) - 2) if algo == "ring" else 0
        bound = (_EPS[dtype] * np.abs(ref) + (partials * _EPS[dtype] + len(inputs) * 2.0 ** -23) * magnitude
                 + 1e-7)
    else:
        for a in inputs[1:]:
            (np.maximum if redop == "max" else np.minimum)(ref, a, out=ref)
        bound = np.zeros_like(ref)  # max/min of exactly representable values is exact
    err = np.abs(got - ref)
    bad = ~(err <= bound)  # NaN (poison left behind) counts as wrong
    if bad.any():
        i = int(np.argmax(bad))
        pytest.fail(f"{what}: {int(bad.sum())} of {ref.size} wrong; first at {i}: got {got[i]}, want {ref[i]} "
                    f"(bound {bound[i]:.3g})")


def _assert_same_on_every_rank(world, out, what: str) -> None:
    import cupy

    every = world.comm.allgather(cupy.asnumpy(out).tobytes())
    assert all(b == every[0] for b in every), f"{what}: ranks got different bytes"


def _assert_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = ~(got == want)
    if bad.any():
        i = int(np.argmax(bad))
        pytest.fail(f"{what}: {int(bad.sum())} of {want.size} wrong; first at {i}: got {got[i]}, want {want[i]}")


def _symmetric_copy(world, x):
    s = world.empty(x.shape, x.dtype)
    s[...] = x
    return s


# ---------------------------------------------------------------------------------------------- allreduce
def _allreduce_counts():
    from fluxrt.collectives_plan import LL12_TWOSHOT_MAX_BYTES, LL12_TWOSHOT_MIN_BYTES, LL_MAX_BYTES, ONESHOT_MAX_BYTES

    # 1 element, odd sizes on every algorithm, sizes around the LL/LL12 two-shot/two-shot thresholds (bf16),
    # forced LL and LL12 two-shot messages of several rounds, and two-shot and pipelined messages whose blocks
    # reduce more vectors than one unrolled pass (kReduceUnroll x threads) with a remainder
    return [(1, "auto"), (1023, "oneshot"), (4099, "twoshot"), (1023, "twoshot"), (4099, "oneshot"),
            (ONESHOT_MAX_BYTES // 2, "oneshot"), (LL12_TWOSHOT_MAX_BYTES // 2 + 8 * 3 + 1, "auto"),
            (3, "ll"), (4099, "ll"), (LL12_TWOSHOT_MIN_BYTES // 4 - 1, "auto"), (LL_MAX_BYTES // 2 + 5, "auto"), (70_001, "ll"),
            (1, "pipe"), (4099, "pipe"), (300_001, "pipe"), (3, "ll12"), (4099, "ll12"), (70_001, "ll12"),
            (1, "ll12_twoshot"), (4099, "ll12_twoshot"), (300_001, "ll12_twoshot"), (2_500_001, "ll12_twoshot"),
            (3_000_001, "twoshot"), (5_000_001, "pipe"), (1, "ring"), (4099, "ring"), (300_001, "ring"),
            (5_000_001, "ring")]


@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("redop", REDOPS)
@pytest.mark.parametrize("case", range(len(_allreduce_counts())))
def test_allreduce(world, dtype, redop, case):
    import fluxrt

    count, algo = _allreduce_counts()[case]
    x = _data(case, world, count, dtype)
    inputs = _gather(world, x)
    mode = case % 3  # out of place | in place | symmetric input
    if mode == 1:
        out = fluxrt.allreduce(world, x, x, op=redop, algo=algo)
        assert out is x
    else:
        src = _symmetric_copy(world, x) if mode == 2 else x
        out = _poisoned(count, dtype)
        fluxrt.allreduce(world, src, out, op=redop, algo=algo)
    world.synchronize()
    what = f"allreduce {dtype} {redop} count={count} algo={algo} mode={mode}"
    _assert_reduced(_host(out), inputs, redop, dtype, what, algo)
    _assert_same_on_every_rank(world, out, what)
    if mode == 2:
        world.free(src)


@pytest.mark.parametrize("algo", ["ll12", "ll12_twoshot"])
def test_allreduce_ll12_past_the_16_bit_flag_wrap(world, algo):
    """LL12 lines carry a 16-bit flag, (round mod 65535) + 1: more rounds than that stay correct because
    the receivers zero every line they read. Checks every 4096th round and the last 300."""
    import fluxrt

    count, rounds = 4099, 65_800
    x = _data(11, world, count, "bf16")
    inputs = _gather(world, x)
    out = _poisoned(count, "bf16")
    for k in range(rounds):
        check = k % 4096 == 0 or k >= rounds - 300
        if check:
            out.fill(np.nan)
        fluxrt.allreduce(world, x, out, op="sum", algo=algo)
        if check:
            world.synchronize()
            _assert_reduced(_host(out), inputs, "sum", "bf16", f"allreduce {algo} round {k}")


def test_allreduce_ll_algorithms_take_turns_on_one_buffer(world):
    """LL, LL12 and the LL12 two-shot cut the LL buffer's halves differently; rounds of each, one after
    another and of changing sizes, stay correct (every round leaves the buffer zeroed)."""
    import fluxrt

    turns = [("ll", 1000), ("ll12_twoshot", 100_003), ("ll12", 5001), ("ll12_twoshot", 7), ("ll", 77_777),
             ("ll12", 120_001), ("ll12_twoshot", 500_000)]
    xs = [(algo, _data(k, world, count, "bf16")) for k, (algo, count) in enumerate(turns)]
    inputs = [_gather(world, x) for _, x in xs]
    for rep in range(30):
        for k, (algo, x) in enumerate(xs):
            out = _poisoned(x.size, "bf16")
            fluxrt.allreduce(world, x, out, op="sum", algo=algo)
            if rep % 10 == 0 or rep == 29:
                world.synchronize()
                _assert_reduced(_host(out), inputs[k], "sum", "bf16", f"allreduce {algo} turn {k} repeat {rep}")


# ---------------------------------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("redop", REDOPS)
@pytest.mark.parametrize("chunk, in_place, algo", [(1, False, "auto"), (1023, True, "auto"), (4099, False, "auto"),
                                                  (70_001, True, "auto"), (4099, True, "ll"), (70_001, False, "ll"),
                                                  (1023, False, "push"), (1, False, "pipe"), (70_001, True, "pipe"),
                                                  (1_500_007, False, "push"), (1_500_007, True, "pipe"),
                                                  (1, True, "ring"), (4099, False, "ring"), (1_500_007, True, "ring")])
def test_reduce_scatter(world, dtype, redop, chunk, in_place, algo):
    import fluxrt

    n, r = world.size, world.rank
    x = _data(chunk, world, n * chunk, dtype)
    inputs = [a[r * chunk:(r + 1) * chunk] for a in _gather(world, x)]
    out = x[r * chunk:(r + 1) * chunk] if in_place else _poisoned(chunk, dtype)
    fluxrt.reduce_scatter(world, x, out, op=redop, algo=algo)
    world.synchronize()
    _assert_reduced(_host(out), inputs, redop, dtype, f"reduce_scatter {dtype} {redop} chunk={chunk} algo={algo}",
                    algo)


# ---------------------------------------------------------------------------------------------- allgather / alltoall
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("count, mode, algo", [(1, 0, "auto"), (1023, 1, "auto"), (4099, 2, "auto"),
                                              (300_001, 0, "auto"), (1023, 0, "push"), (300_001, 1, "ll"),
                                              (1023, 1, "pipe"), (300_001, 2, "pipe"), (1, 0, "ring"),
                                              (1023, 1, "ring"), (4099, 2, "ring"), (300_001, 0, "ring"),
                                              (1_500_007, 1, "ring"), (1, 0, "pairwise"), (4099, 1, "pairwise"),
                                              (300_001, 2, "pairwise"), (1_500_007, 1, "pairwise")])
def test_allgather(world, dtype, count, mode, algo):
    import fluxrt

    n, r = world.size, world.rank
    x = _data(count, world, count, dtype)
    want = np.concatenate(_gather(world, x))
    if mode == 1:  # in place: x is this rank's chunk of out
        out = _poisoned(n * count, dtype)
        out[r * count:(r + 1) * count] = x
        fluxrt.allgather(world, out[r * count:(r + 1) * count], out, algo=algo)
    else:
        src = _symmetric_copy(world, x) if mode == 2 else x
        out = _poisoned(n * count, dtype)
        fluxrt.allgather(world, src, out, algo=algo)
    world.synchronize()
    _assert_equal(_host(out), want, f"allgather {dtype} count={count} mode={mode} algo={algo}")
    if mode == 2:
        world.free(src)


@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("chunk, in_place, algo", [(1, False, "auto"), (1023, True, "auto"), (4099, False, "auto"),
                                                  (1023, True, "push"), (40_001, True, "ll"), (1, False, "pipe"),
                                                  (40_001, True, "pipe")])
def test_alltoall(world, dtype, chunk, in_place, algo):
    import fluxrt

    n, r = world.size, world.rank
    x = _data(chunk + 17, world, n * chunk, dtype)
    every = _gather(world, x)
    want = np.concatenate([every[p][r * chunk:(r + 1) * chunk] for p in range(n)])
    out = x if in_place else _poisoned(n * chunk, dtype)
    fluxrt.alltoall(world, x, out, algo=algo)
    world.synchronize()
    _assert_equal(_host(out), want, f"alltoall {dtype} chunk={chunk} in_place={in_place} algo={algo}")


def test_alltoall_pairwise_phases(world):
    """The pipelined alltoall in pairwise phases ('pairwise'; 'auto' takes it from pairwise_min_bytes on 3 or
    more ranks, out of place, and keeps the common phase in place), odd sizes, small entries so that every
    pair steps through its ring many times, several calls in a row, against numpy."""
    import fluxrt
    from fluxrt.collectives import Collectives, CollectivesOptions
    from fluxrt.collectives_plan import Tuning

    n, r = world.size, world.rank
    ctx = Collectives(world, CollectivesOptions(workspace_bytes=1 << 20, tuning=Tuning(
        pairwise_min_bytes=1, pairwise_min_step=4096, pairwise_max_step=4096, pipe_max_grid=8)))
    try:
        for i, (chunk, dtype, in_place, algo) in enumerate([(1, "bf16", False, "pairwise"),
                                                            (4099, "int32", False, "pairwise"),
                                                            (300_001, "bf16", False, "auto"),
                                                            (70_001, "fp32", True, "auto"),
                                                            (1_000_003, "fp16", False, "pairwise")]):
            x = _data(900 + i, world, n * chunk, dtype)
            every = _gather(world, x)
            want = np.concatenate([every[p][r * chunk:(r + 1) * chunk] for p in range(n)])
            out = x if in_place else _poisoned(n * chunk, dtype)
            ctx.alltoall(x, out, algo=algo)
            world.synchronize()
            _assert_equal(_host(out), want, f"pairwise alltoall {dtype} chunk={chunk} in_place={in_place} {algo}")
        with pytest.raises(fluxrt.CollectiveArgumentError, match="pairwise"):
            ctx.alltoall(x, x, algo="pairwise")
    finally:
        ctx.free()


@pytest.mark.parametrize("op", ("allgather", "alltoall", "broadcast"))
@pytest.mark.parametrize("count, algo, in_place", [(1, "direct", False), (4099, "direct", True),
                                                   (300_001, "auto", False), (1 << 20, "auto", True)])
def test_direct_exchange_into_symmetric_outputs(world, op, count, algo, in_place):
    """Symmetric outputs: pushes go straight into the peers' outputs ('direct'; 'auto' picks it from
    DIRECT_MIN_BYTES up). In place where the op allows it with direct pushes (allgather, broadcast)."""
    import fluxrt

    n, r = world.size, world.rank
    dtype = "bf16" if count % 2 else "int32"
    total = n * count if op != "broadcast" else count
    x = _data(count + 5, world, count if op == "allgather" else total, dtype)
    every = _gather(world, x)
    out = world.empty(total, _dtype(dtype))
    out.fill(-7777 if dtype == "int32" else np.nan)
    if op == "allgather":
        want = np.concatenate(every)
        if in_place:
            out[r * count:(r + 1) * count] = x
            fluxrt.allgather(world, out[r * count:(r + 1) * count], out, algo=algo)
        else:
            fluxrt.allgather(world, x, out, algo=algo)
    elif op == "alltoall":
        want = np.concatenate([every[p][r * count:(r + 1) * count] for p in range(n)])
        fluxrt.alltoall(world, x, out, algo=algo)  # in place would need staging: not direct
    else:
        root = n - 1
        want = every[root]
        if in_place:
            out[...] = x
            fluxrt.broadcast(world, out, root=root, algo=algo)
        else:
            fluxrt.broadcast(world, x, out, root=root, algo=algo)
    world.synchronize()
    _assert_equal(_host(out), want, f"{op} direct count={count} algo={algo} in_place={in_place}")
    world.free(out)


def _counts_matrix(n: int, seed: int, scale: int) -> np.ndarray:
    """matrix[p][q]: elements rank p sends to rank q; the same on every rank; zeros included."""
    m = np.random.default_rng(seed).integers(0, scale, size=(n, n))
    m[np.random.default_rng(seed + 1).random((n, n)) < 0.25] = 0
    return m


@pytest.mark.parametrize("dtype", ("bf16", "int32"))
@pytest.mark.parametrize("seed, scale, given_recv, gaps, algo", [(1, 7, True, False, "auto"), (2, 5000, False, True, "auto"),
                                                                  (3, 300_000, True, False, "auto"),
                                                                  (4, 20_000, False, True, "ll"),
                                                                  (5, 20_000, True, True, "pipe"),
                                                                  (6, 7, False, False, "pipe")])
def test_alltoallv(world, dtype, seed, scale, given_recv, gaps, algo):
    import fluxrt

    n, r = world.size, world.rank
    m = _counts_matrix(n, seed, scale)
    send, recv = m[r], m[:, r]
    pad = 3 if gaps else 0  # displacements with holes between the blocks
    sd = np.concatenate(([0], np.cumsum(send + pad)[:-1]))
    rd = np.concatenate(([0], np.cumsum(recv + pad)[:-1]))
    x = _data(seed, world, int(send.sum() + pad * n), dtype)
    every = _gather(world, x)
    out = _poisoned(int(recv.sum() + pad * n), dtype)
    fluxrt.alltoallv(world, x, send, recv if given_recv else None, out, send_displs=sd if gaps else None,
                     recv_displs=rd if gaps else None, algo=algo)
    world.synchronize()
    got = _host(out)
    for p in range(n):
        psd = np.concatenate(([0], np.cumsum(m[p] + pad)[:-1]))
        want = every[p][psd[r]:psd[r] + m[p][r]]
        _assert_equal(got[rd[p]:rd[p] + recv[p]], want, f"alltoallv {dtype} seed={seed} from rank {p}")


@pytest.mark.parametrize("dtype", ("bf16", "int32"))
@pytest.mark.parametrize("count, in_place, algo", [(1, True, "auto"), (4099, False, "auto"), (200_003, True, "auto"),
                                                  (4099, True, "push"), (200_003, False, "ll"),
                                                  (4099, True, "pipe"), (200_003, False, "pipe")])
def test_broadcast(world, dtype, count, in_place, algo):
    import fluxrt

    for root in sorted({0, world.size - 1}):
        x = _data(count + root, world, count, dtype)
        want = _gather(world, x)[root]
        if in_place:
            fluxrt.broadcast(world, x, root=root, algo=algo)
            out = x
        else:
            out = _poisoned(count, dtype)
            fluxrt.broadcast(world, x, out, root=root, algo=algo)
        world.synchronize()
        _assert_equal(_host(out), want, f"broadcast {dtype} count={count} root={root}")


# ---------------------------------------------------------------------------------------------- large messages
@pytest.mark.parametrize("algo", ["auto", "twoshot", "ring"])
def test_allreduce_large_bf16(world, algo):
    import fluxrt

    from fluxrt.collectives_plan import choose_algo

    count = 32 << 20  # 64 MiB: one ring launch (auto), or two-shot launches through the workspace
    x = _data(99, world, count, "bf16")
    inputs = _gather(world, x)
    out = _poisoned(count, "bf16")
    fluxrt.allreduce(world, x, out, algo=algo)
    world.synchronize()
    ran = choose_algo("allreduce", 2 * count, world.size, algo)  # the ring rounds at every hop
    _assert_reduced(_host(out), inputs, "sum", "bf16", f"allreduce 64 MiB bf16 algo={algo} ({ran})", ran)


def test_pipelined_rounds_wrap_a_small_ring_many_times(world):
    """A 256 KiB workspace, 8 blocks and 2 ring entries: every block steps through its ring tens of times
    per call, for every pipelined op and the ring rounds (8 KiB entries), 20 calls in a row mixed with
    staged and LL calls on the same context; checked against numpy each time."""
    import cupy

    from fluxrt.collectives import Collectives, CollectivesOptions
    from fluxrt.collectives_plan import Tuning

    n, r = world.size, world.rank
    ctx = Collectives(world, CollectivesOptions(workspace_bytes=256 << 10,
                                                tuning=Tuning(pipe_max_grid=8, pipe_depth=2, ring_max_grid=8,
                                                              ring_depth=5)))
    try:
        for i in range(20):
            count = 200_003 + 8 * i  # odd: the last chunk and the last steps are short
            x = _data(500 + i, world, count, "bf16" if i % 2 else "fp32")
            dt = "bf16" if i % 2 else "fp32"
            inputs = _gather(world, x)
            out = _poisoned(count, dt)
            ctx.allreduce(x, out, algo="pipe")
            ctx.allreduce(x, _poisoned(count, dt), algo="ll" if i % 3 == 0 else "twoshot")
            ring = _poisoned(count, dt)
            ctx.allreduce(x, ring, algo="ring")
            chunk = count // n
            rs = _poisoned(chunk, dt)
            ctx.reduce_scatter(x[:chunk * n], rs, algo="pipe")
            rs_ring = _poisoned(chunk, dt)
            ctx.reduce_scatter(x[:chunk * n], rs_ring, algo="ring")
            ag = _poisoned(n * count, dt)
            ctx.allgather(x, ag, algo="pipe")
            ag_ring = _poisoned(n * count, dt)
            ctx.allgather(x, ag_ring, algo="ring")
            a2a = _poisoned(chunk * n, dt)
            ctx.alltoall(x[:chunk * n], a2a, algo="pipe")
            counts = [(7 * (r + 1) * (q + 2) + i) % 5000 * (q != (r + i) % n) for q in range(n)]
            v = cupy.arange(sum(counts), dtype=cupy.float32) + 1000 * r
            rc = [(7 * (p + 1) * (r + 2) + i) % 5000 * (r != (p + i) % n) for p in range(n)]
            vout = ctx.alltoallv(v, counts, rc, algo="pipe")
            world.synchronize()
            what = f"call {i} {dt} count={count}"
            _assert_reduced(_host(out), inputs, "sum", dt, f"pipe allreduce {what}")
            _assert_same_on_every_rank(world, out, f"pipe allreduce {what}")
            _assert_reduced(_host(ring), inputs, "sum", dt, f"ring allreduce {what}", "ring")
            _assert_same_on_every_rank(world, ring, f"ring allreduce {what}")
            _assert_reduced(_host(rs), [a[r * chunk:(r + 1) * chunk] for a in inputs], "sum", dt,
                            f"pipe reduce_scatter {what}")
            _assert_reduced(_host(rs_ring), [a[r * chunk:(r + 1) * chunk] for a in inputs], "sum", dt,
                            f"ring reduce_scatter {what}", "ring")
            _assert_equal(_host(ag), np.concatenate(inputs), f"pipe allgather {what}")
            _assert_equal(_host(ag_ring), np.concatenate(inputs), f"ring allgather {what}")
            _assert_equal(_host(a2a), np.concatenate([a[r * chunk:(r + 1) * chunk] for a in inputs]),
                          f"pipe alltoall {what}")
            sent = world.comm.allgather(cupy.asnumpy(v))
            want = []
            for p in range(n):
                pc = [(7 * (p + 1) * (q + 2) + i) % 5000 * (q != (p + i) % n) for q in range(n)]
                start = sum(pc[:r])
                want.append(sent[p][start:start + pc[r]])
            _assert_equal(_host(vout), np.concatenate(want).astype(np.float64), f"pipe alltoallv {what}")
    finally:
        ctx.free()


@pytest.mark.parametrize("one_step", [0, 256])
def test_ring_rounds_with_more_blocks_than_flag_slots_per_source(world, one_step):
    """The ring's flags are per slice only: 256 blocks of 256 threads (more than MAX_BLOCKS), allreduce,
    reduce_scatter and allgather, three calls in a row, against numpy; with two steps per stage
    (one_step 0) and with one (each 4 KiB slice in one entry)."""
    from fluxrt import collectives_plan as plan
    from fluxrt.collectives import Collectives, CollectivesOptions
    from fluxrt.collectives_plan import MAX_RING_BLOCKS, Tuning

    n, r = world.size, world.rank
    tuning = Tuning(ring_max_grid=MAX_RING_BLOCKS, ring_threads=256, pipe_bytes_per_block=4 << 10,
                    ring_one_step_max_grid=one_step)
    ctx = Collectives(world, CollectivesOptions(tuning=tuning))
    try:
        geometry = plan.ring_geometry(ctx.half_bytes, n, 2 * (1 << 21) // n, tuning)
        assert geometry.slices == MAX_RING_BLOCKS and geometry.substeps == (1 if one_step else tuning.ring_substeps)
        for i in range(3):
            count = (1 << 21) + 8 * i + 3  # 4 MiB of bf16: 256 slices of a chunk, a short last chunk
            x = _data(700 + i, world, count, "bf16")
            inputs = _gather(world, x)
            out = _poisoned(count, "bf16")
            ctx.allreduce(x, out, algo="ring")
            chunk = count // n
            rs = _poisoned(chunk, "bf16")
            ctx.reduce_scatter(x[:chunk * n], rs, algo="ring")
            ag = _poisoned(n * count, "bf16")
            ctx.allgather(x, ag, algo="ring")
            world.synchronize()
            _assert_equal(_host(ag), np.concatenate(inputs), f"ring allgather, 256 blocks, call {i}")
            _assert_reduced(_host(out), inputs, "sum", "bf16", f"ring allreduce, 256 blocks, call {i}", "ring")
            _assert_same_on_every_rank(world, out, f"ring allreduce, 256 blocks, call {i}")
            _assert_reduced(_host(rs), [a[r * chunk:(r + 1) * chunk] for a in inputs], "sum", "bf16",
                            f"ring reduce_scatter, 256 blocks, call {i}", "ring")
    finally:
        ctx.free()


def test_allgather_large_fp32(world):
    import fluxrt

    n = world.size
    count = (64 << 20) // 4 // n  # 64 MiB gathered
    x = _data(98, world, count, "fp32")
    want = np.concatenate(_gather(world, x))
    out = _poisoned(n * count, "fp32")
    fluxrt.allgather(world, x, out)
    world.synchronize()
    _assert_equal(_host(out), want, "allgather 64 MiB fp32")


# ---------------------------------------------------------------------------------------------- async, repeat, graphs
def test_async_allreduce_overlaps_a_matmul(world):
    import cupy

    import fluxrt

    count = 1 << 20
    x = _data(5, world, count, "fp32")
    inputs = _gather(world, x)
    out = _poisoned(count, "fp32")
    a = cupy.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    compute = cupy.cuda.Stream(non_blocking=True)
    world.device.synchronize()
    handle = fluxrt.allreduce(world, x, out, async_op=True)
    with compute:
        c = a @ a
    assert handle.wait() is out
    world.synchronize()
    assert handle.is_done()
    _assert_reduced(_host(out), inputs, "sum", "fp32", "async allreduce")
    ref = cupy.asnumpy(a).astype(np.float64)
    assert np.allclose(cupy.asnumpy(c), ref @ ref, rtol=1e-3, atol=1e-2)


def test_repeated_small_calls_do_not_drift(world):
    """1000 small allreduces with fresh data each time, interleaved with allgathers (both workspace
    halves, several ops sharing the epoch counter); every result is kept on the device and checked."""
    import cupy

    import fluxrt

    n, r, count, calls = world.size, world.rank, 33, 1000
    results = cupy.empty((calls, count), dtype=np.float32)
    gathered = cupy.empty((calls // 3 + 1, n * count), dtype=np.float32)
    x = cupy.empty(count, dtype=np.float32)
    j = cupy.arange(count, dtype=np.float32)
    for i in range(calls):
        x[...] = (r + 1) * ((j + i) % 7)
        fluxrt.allreduce(world, x, results[i])
        if i % 3 == 0:
            fluxrt.allgather(world, x, gathered[i // 3])
    world.synchronize()
    i = np.arange(calls)[:, None]
    jj = np.arange(count)[None, :]
    want = (n * (n + 1) / 2) * ((jj + i) % 7)
    _assert_equal(cupy.asnumpy(results).astype(np.float64).reshape(-1), want.reshape(-1).astype(np.float64),
                  "1000 allreduces")
    k = np.arange(0, calls, 3)[:, None]
    want_g = np.concatenate([(p + 1) * ((jj + k) % 7) for p in range(n)], axis=1)
    _assert_equal(cupy.asnumpy(gathered).astype(np.float64).reshape(-1), want_g.reshape(-1).astype(np.float64),
                  "interleaved allgathers")


def test_algorithms_interleaved_share_the_epochs(world):
    """300 rounds cycling through every algorithm (LL, one-shot, two-shot, push, LL broadcasts from every
    root: pairs with nothing to send still exchange a marker line), fresh data each time, all results
    kept on the device and checked: LL lines left behind or a half reused too early would show."""
    import cupy

    import fluxrt

    n, r, count, rounds = world.size, world.rank, 1001, 60
    j = cupy.arange(count, dtype=np.float32)
    x = cupy.empty(count, dtype=np.float32)
    sums = cupy.empty((rounds, 3, count), dtype=np.float32)
    gathered = cupy.empty((rounds, n * count), dtype=np.float32)
    bcast = cupy.empty((rounds, count), dtype=np.float32)
    for i in range(rounds):
        x[...] = (r + 1) * ((j + i) % 5)
        for k, algo in enumerate(("ll", "oneshot", "twoshot")):
            fluxrt.allreduce(world, x, sums[i, k], algo=algo)
        fluxrt.allgather(world, x, gathered[i], algo="push" if i % 2 else "ll")
        bcast[i] = x
        fluxrt.broadcast(world, bcast[i], root=i % n, algo="ll")
    world.synchronize()
    i = np.arange(rounds)[:, None]
    pattern = (np.arange(count)[None, :] + i) % 5
    want = np.repeat((n * (n + 1) / 2 * pattern)[:, None, :], 3, axis=1)
    _assert_equal(_host(sums), want.reshape(-1), "interleaved allreduces")
    want_g = np.concatenate([(p + 1) * pattern for p in range(n)], axis=1)
    _assert_equal(_host(gathered), want_g.reshape(-1), "interleaved allgathers")
    want_b = ((i % n) + 1) * pattern
    _assert_equal(_host(bcast), want_b.reshape(-1), "interleaved LL broadcasts")


def test_unchecked_calls_reuse_their_launches(world):
    """With the cross-rank check off, repeated calls on the same arrays reuse cached launch lists and
    alltoallv with max_count makes no MPI call; results stay right when the data changes."""
    import dataclasses

    import fluxrt

    n, r = world.size, world.rank
    saved = world.options
    world.options = dataclasses.replace(saved, check_collective_args=False)
    try:
        x = _data(0, world, 3001, "fp16")
        out = _poisoned(3001, "fp16")
        counts = np.arange(1, n + 1) * 100 + r  # rank p sends (q + 1) * 100 + p to rank q
        recv = (r + 1) * 100 + np.arange(n)
        v = _data(0, world, int(counts.sum()), "int32")
        vout = _poisoned(int(recv.sum()), "int32")
        for step in range(3):
            x[...] = _data(step + 1, world, 3001, "fp16")
            v[...] = _data(step + 1, world, int(counts.sum()), "int32")
            world.device.synchronize()
            inputs, vin = _gather(world, x), _gather(world, v)
            fluxrt.allreduce(world, x, out)
            fluxrt.alltoallv(world, v, counts, recv, vout, max_count=100 * n + n)
            world.synchronize()
            _assert_reduced(_host(out), inputs, "sum", "fp16", f"cached allreduce, step {step}")
            got = _host(vout)
            for p in range(n):
                p_counts = np.arange(1, n + 1) * 100 + p
                start = int(p_counts[:r].sum())
                want = vin[p][start:start + p_counts[r]]
                rstart = int(recv[:p].sum())
                _assert_equal(got[rstart:rstart + recv[p]], want, f"cached alltoallv from {p}, step {step}")
    finally:
        world.options = saved


def test_graph_capture_and_replay(world):
    import cupy

    import fluxrt

    n = world.size
    count = 5000
    x = cupy.empty(count, dtype=fluxrt.bfloat16)
    out = _poisoned(count, "bf16")
    gathered = _poisoned(n * count, "bf16")
    s = cupy.cuda.Stream(non_blocking=True)
    world.device.synchronize()
    fluxrt.allreduce(world, x, out, stream=s)  # an eager call on the capture stream first
    s.synchronize()
    piped = _poisoned(count, "bf16")
    ringed = _poisoned(count, "bf16")
    ring_gathered = _poisoned(n * count, "bf16")
    s.begin_capture()
    fluxrt.allreduce(world, x, out, stream=s)
    fluxrt.allgather(world, x, gathered, stream=s)
    fluxrt.allreduce(world, x, piped, stream=s, algo="pipe")
    fluxrt.allreduce(world, x, ringed, stream=s, algo="ring")
    fluxrt.allgather(world, x, ring_gathered, stream=s, algo="ring")
    graph = s.end_capture()
    for replay in range(3):
        x[...] = _data(replay, world, count, "bf16")
        out.fill(np.nan)
        gathered.fill(np.nan)
        piped.fill(np.nan)
        ringed.fill(np.nan)
        ring_gathered.fill(np.nan)
        world.device.synchronize()
        inputs = _gather(world, x)
        graph.launch(s)
        s.synchronize()
        world.check_errors()
        _assert_reduced(_host(out), inputs, "sum", "bf16", f"graph replay {replay}: allreduce")
        _assert_equal(_host(gathered), np.concatenate(inputs), f"graph replay {replay}: allgather")
        _assert_reduced(_host(piped), inputs, "sum", "bf16", f"graph replay {replay}: pipelined allreduce")
        _assert_reduced(_host(ringed), inputs, "sum", "bf16", f"graph replay {replay}: ring allreduce", "ring")
        _assert_equal(_host(ring_gathered), np.concatenate(inputs), f"graph replay {replay}: ring allgather")


@pytest.mark.parametrize("pdl", [1, 0])
def test_rounds_chained_in_place_back_to_back_and_in_a_graph(world, pdl):
    """Every round reads what the round before it wrote (in place, one stream, no host sync in between):
    with programmatic dependent launch a round's grid is scheduled early and must still wait for the
    previous kernel. Values stay exact in fp32: the first round gives n (n + 1) / 2, each later one
    multiplies by n. Eager calls first, then the same chain captured in a graph and replayed."""
    import fluxrt
    from fluxrt.collectives_plan import Tuning

    ctx = fluxrt.Collectives(world, fluxrt.CollectivesOptions(tuning=Tuning(pdl=pdl)))
    try:
        _chain_rounds(world, ctx, pdl)
    finally:
        ctx.free()


def _chain_rounds(world, ctx, pdl):
    import cupy

    n, r = world.size, world.rank
    algos = ["ll12_twoshot", "ll", "ll12", "oneshot", "twoshot", "ll12_twoshot", "pipe", "ring", "ll12", "ring", "auto"]
    x = cupy.full(60_001, r + 1, dtype=cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    world.device.synchronize()
    rounds = 0

    def chain():
        for algo in algos:
            ctx.allreduce(x, x, stream=s, algo=algo)

    def check(what):
        want = n * (n + 1) / 2 * float(n) ** (rounds - 1)
        got = _host(x)
        bad = got != want
        if bad.any():
            i = int(np.argmax(bad))
            pytest.fail(f"{what} after {rounds} rounds (pdl={pdl}): {int(bad.sum())} wrong; first at {i}: "
                        f"got {got[i]}, want {want}")

    chain()
    rounds += len(algos)
    s.synchronize()
    world.check_errors()
    check("eager chain")
    s.begin_capture()
    chain()
    graph = s.end_capture()
    for replay in range(2):
        x.fill(r + 1)
        rounds = 0
        world.device.synchronize()
        world.comm.Barrier()
        graph.launch(s)
        rounds += len(algos)
        s.synchronize()
        world.check_errors()
        check(f"graph replay {replay}")


# ---------------------------------------------------------------------------------------------- errors
def test_mismatched_count_raises_on_every_rank(world):
    import fluxrt

    count = 8 if world.rank == 0 else 16
    x = _data(1, world, count, "fp32")
    with pytest.raises(fluxrt.CollectiveMismatchError, match="count=8"):
        fluxrt.allreduce(world, x)


def test_mismatched_dtype_and_op_raise_on_every_rank(world):
    import fluxrt

    x = _data(1, world, 64, "fp32" if world.rank == 0 else "bf16")
    with pytest.raises(fluxrt.CollectiveMismatchError, match="different arguments"):
        fluxrt.allgather(world, x)
    y = _data(1, world, 64, "fp32")
    with pytest.raises(fluxrt.CollectiveMismatchError, match="op="):
        fluxrt.allreduce(world, y, op="max" if world.rank == 0 else "sum")


def test_local_error_on_one_rank_raises_on_every_rank(world):
    import fluxrt

    x = _data(1, world, 64, "fp32")
    out = _poisoned(32 if world.rank == world.size - 1 else 64, "fp32")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="too small"):
        fluxrt.allreduce(world, x, out)
    # nothing was launched anywhere: the next call still lines up
    out = _poisoned(64, "fp32")
    fluxrt.allreduce(world, x, out)
    world.synchronize()
    _assert_reduced(_host(out), _gather(world, x), "sum", "fp32", "allreduce after a rejected call")


def test_alltoallv_count_mismatch(world):
    import fluxrt

    n, r = world.size, world.rank
    send = np.full(n, 4)
    recv = np.full(n, 4)
    if r == 0:
        recv[n - 1] = 5
    x = _data(1, world, 4 * n, "int32")
    with pytest.raises(fluxrt.CollectiveMismatchError, match=f"rank {n - 1} sends 4 to rank 0, which expects 5"):
        fluxrt.alltoallv(world, x, send, recv, _poisoned(5 * n, "int32"))


def test_bad_arguments(world):
    import cupy

    import fluxrt

    x = _data(1, world, 64, "fp32")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="C-contiguous"):
        fluxrt.allreduce(world, x.reshape(8, 8)[:, ::2])
    with pytest.raises(fluxrt.CollectiveArgumentError, match="reductions support"):   # no int16 reduction
        fluxrt.allreduce(world, _data(1, world, 64, "int32").astype(np.int16))
    with pytest.raises(fluxrt.CollectiveArgumentError, match="not a multiple"):
        fluxrt.reduce_scatter(world, _data(1, world, world.size * 3 + 1, "fp32"))
    with pytest.raises(fluxrt.CollectiveArgumentError, match="root"):
        fluxrt.broadcast(world, x, root=world.size)
    with pytest.raises(fluxrt.CollectiveArgumentError, match="overlaps"):
        fluxrt.allreduce(world, x[:32], x[16:48])
    if cupy.cuda.runtime.getDeviceCount() > 1:
        other = (world.device_id + 1) % cupy.cuda.runtime.getDeviceCount()
        with cupy.cuda.Device(other):
            y = cupy.ones(64, dtype=np.float32)
        with pytest.raises(fluxrt.CollectiveArgumentError, match="GPU"):
            fluxrt.allreduce(world, y)
    world.synchronize()


# ---------------------------------------------------------------------------------------------- array intake
class _CaiProducer:
    """A Numba-like producer: __cuda_array_interface__ v3 only (no __dlpack__), naming its stream and,
    like Numba, its numpy dtype."""

    def __init__(self, arr, stream=None, readonly: bool = False):
        cai = dict(arr.__cuda_array_interface__)
        cai.update(data=(arr.data.ptr, readonly), version=3, stream=None if stream is None else stream.ptr or 1)
        self.__cuda_array_interface__, self.dtype, self.shape, self._keep = cai, arr.dtype, arr.shape, arr


def test_cai_producer_on_its_own_stream(world):
    """The input is written on the producer's stream right before the call on another stream: the call's
    stream waits for it (CAI v3 'stream'). A read-only out is refused on every rank before any launch."""
    import cupy

    import fluxrt

    n = 1 << 20
    producer, s = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    inputs = [np.full(n, r + 1, dtype=np.float32) for r in range(world.size)]
    x = cupy.empty(n, dtype=np.float32)
    world.synchronize()
    with producer:
        cupy.cuda.runtime.memsetAsync(x.data.ptr, 0, x.nbytes, producer.ptr)
        x += world.rank + 1                       # enqueued behind the memset on the producer's stream
    out = fluxrt.allreduce(world, _CaiProducer(x, producer), stream=s)
    assert isinstance(out, cupy.ndarray)
    world.synchronize(s)
    _assert_reduced(_host(out), inputs, "sum", "fp32", "allreduce of a CAI producer")
    with pytest.raises(fluxrt.CollectiveArgumentError, match="written by this call"):
        fluxrt.allreduce(world, x, _CaiProducer(cupy.empty_like(x), readonly=True))
    world.synchronize()


# ------------------------------------------------------------------------------------------ timeouts
TIMED_OUT = [("allreduce", a) for a in ("ll", "ll12", "oneshot", "twoshot", "ll12_twoshot", "pipe", "ring")] + \
            [("reduce_scatter", a) for a in ("ll", "push", "pipe", "ring")] + \
            [("allgather", a) for a in ("ll", "push", "pipe", "ring")] + [("alltoall", "pipe")]


@pytest.mark.parametrize("op, algo", TIMED_OUT)
def test_a_timed_out_call_leaves_nan_and_a_sticky_error(world, monkeypatch, op, algo):
    """Rank 0 skips the call. On every other rank the wait for rank 0 times out; the output then holds
    NaN wherever the call could not compute the right value (every element that depends on rank 0's
    data, and possibly more), never a number computed from stale data; every later call raises the same
    error until world.reset_error(). The output starts as a finite sentinel, so any NaN is the kernel's."""
    import dataclasses

    import cupy

    import fluxrt

    n, r, count = world.size, world.rank, 8192 * world.size
    monkeypatch.setattr(world, "options", dataclasses.replace(world.options, check_collective_args=False))
    ctx = fluxrt.Collectives(world)   # its own rounds: out of step after the skipped call, then freed
    try:
        x = cupy.full(count, r + 1, dtype=cupy.float32)
        size = {"reduce_scatter": count // n, "allgather": count * n}.get(op, count)
        out = cupy.full(size, 12345.0, dtype=cupy.float32)
        world.synchronize()
        world.comm.Barrier()
        if r != 0:
            getattr(ctx, op)(x, out, algo=algo)
            with pytest.raises(fluxrt.WaitTimeoutError) as err:
                world.synchronize()
            assert err.value.rank == r
            got = _host(out)
            if op in ("allreduce", "reduce_scatter"):
                assert np.isnan(got).all(), f"{op}/{algo}: {int((~np.isnan(got)).sum())} of {got.size} not NaN"
            else:
                chunk = count if op == "allgather" else count // n   # what each rank sends this one
                want = np.concatenate([np.full(chunk, p + 1.0) for p in range(n)])
                assert np.isnan(got[:chunk]).all(), f"{op}/{algo}: rank 0's part is not NaN"
                ok = np.isnan(got) | (got == want)
                assert ok.all(), f"{op}/{algo}: {int((~ok).sum())} elements neither NaN nor right"
            with pytest.raises(fluxrt.WaitTimeoutError):   # sticky: raised before anything launches
                getattr(ctx, op)(x, out, algo=algo)
            with pytest.raises(fluxrt.WaitTimeoutError):
                world.barrier()
            world.reset_error()
            world.check_errors()
        world.comm.Barrier()
    finally:
        world.reset_error()
        ctx.free()


def test_a_context_waits_for_a_rank_still_loading_its_kernels(world, monkeypatch):
    """A rank whose kernel load outlasts the world's timeout (a cold cache of its own: another node) does not make
    its peers' context creation time out in the symmetric allocations that follow: the ranks meet after the load,
    bounded by FLUXRT_LOAD_WAIT_S. The context then reduces correctly."""
    import time

    from fluxrt import toolchain
    from fluxrt.collectives import Collectives

    real = toolchain.load_module

    def slow(*args, **kw):   # rank 1 compiles: the load takes longer than the device waits' bound
        if world.rank == 1:
            time.sleep(float(world.options.timeout_s) + 2.0)
        return real(*args, **kw)

    monkeypatch.setattr(toolchain, "load_module", slow)
    ctx = Collectives(world)
    monkeypatch.setattr(toolchain, "load_module", real)
    try:
        x = _data(77, world, 4099, "fp32")
        every = _gather(world, x)
        out = _poisoned(4099, "fp32")
        ctx.allreduce(x, out)
        world.synchronize()
        _assert_reduced(_host(out), every, "sum", "fp32", "allreduce after a slow load")
    finally:
        ctx.free()
