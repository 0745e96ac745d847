"""Grouped GEMM (MoE experts) on a GPU: every group against a float64 reference, with M tails, empty groups, K
shorter than one ring stage, both weight layouts, int32/int64 offsets, rows outside every group left alone, and
a CUDA-graph capture with the offsets changed between replays.

Run on an H100/H200: python3 -m pytest tests/gpu/test_grouped_gemm.py -q
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.hopper   # skipped off Hopper, with the reason (conftest.py)

from fluxrt.gemm import GemmArgumentError, grouped_gemm  # noqa: E402
from fluxrt.gemm.grouped import grouped_plan  # noqa: E402
from fluxrt.gemm.plan import GemmPlan  # noqa: E402

from gemm_checks import BF16, NAN_BITS, TOL, poisoned, rand_matrix  # noqa: E402


def offsets_of(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def check_groups(out, a: np.ndarray, b: np.ndarray, offs: np.ndarray, trans_b: bool, out_dtype: str) -> None:
    """Every group's rows against float64 a[rows] @ b[g] (relative Frobenius error per group); rows past
    offsets[G] must still hold the poison."""
    c = cupy.asnumpy(out).astype(np.float64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for g in range(len(offs) - 1):
        r0, r1 = int(offs[g]), int(offs[g + 1])
        if r1 == r0:
            continue
        ref = a64[r0:r1] @ (b64[g].T if trans_b else b64[g])
        got = c[r0:r1]
        assert not np.isnan(got).any(), f"group {g}: {np.isnan(got).sum()} elements never written"
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < TOL[out_dtype], f"group {g} rows [{r0}, {r1}): relative error {err:.3g}"
    assert np.isnan(c[int(offs[-1]):]).all(), "rows outside every group were written"


def run_case(sizes, n, k, *, trans_b=False, in_dtype="bfloat16", out_dtype="bfloat16", offsets_dtype="int32",
             extra_rows=0, plan=None, seed=0):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    offs = offsets_of(sizes)
    m = int(offs[-1]) + extra_rows
    a = rand_matrix(rng, (m, k), in_dtype)
    b = rand_matrix(rng, (g, n, k) if trans_b else (g, k, n), in_dtype)
    out = poisoned((m, n), out_dtype)
    res = grouped_gemm(cupy.asarray(a), cupy.asarray(b), cupy.asarray(offs.astype(offsets_dtype)), out,
                       trans_b=trans_b, plan=plan)
    assert res is out
    cupy.cuda.get_current_stream().synchronize()
    check_groups(out, a, b, offs, trans_b, out_dtype)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float16"])
def test_tails_and_empty_groups(trans_b, in_dtype):
    # tails of every kind: 1 row, 127, 128, 129, 300; empty groups first, between and last
    sizes = [0, 1, 127, 0, 128, 129, 0, 300, 5, 0]
    run_case(sizes, n=384, k=320, trans_b=trans_b, in_dtype=in_dtype, out_dtype=in_dtype)


@pytest.mark.parametrize("trans_b", [False, True])
def test_k_shorter_than_one_stage_and_n_tail(trans_b):
    # K = 40 < one 64-wide K block (zero-filled by TMA within the group's own B), N = 200: a partial N tile
    run_case([3, 200, 0, 64], n=200, k=40, trans_b=trans_b)


@pytest.mark.parametrize("offsets_dtype", ["int32", "int64"])
def test_offsets_dtypes_and_rows_outside_groups(offsets_dtype):
    run_case([70, 0, 190], n=256, k=128, offsets_dtype=offsets_dtype, extra_rows=77)


def test_fp32_out_and_128x128_plan():
    run_case([0, 33, 250, 1], n=128, k=192, out_dtype="float32")
    run_case([131, 2, 0, 400], n=512, k=256, plan=GemmPlan(block_n=128, stages=4))


def test_many_groups_skewed():
    rng = np.random.default_rng(7)
    sizes = (rng.zipf(1.6, size=256) - 1).clip(0, 700)   # G = 256, many empty, a few long
    sizes[:8] = 0
    run_case(list(sizes), n=256, k=256, trans_b=True, seed=3)


@pytest.mark.parametrize("trans_b", [False, True])
def test_last_tiles_of_at_most_64_rows(trans_b):
    # last tiles with 1, 63, 64 rows (the second consumer's rows all past the group's end) and 65, 127; K = 1000
    # runs each tile over several rounds of the ring, with a K tail
    sizes = [65, 64, 1, 0, 192, 193, 63, 127, 128, 320, 1, 64] * 3
    run_case(sizes, n=512, k=1000, trans_b=trans_b, seed=11)


# Ping-pong plans: each consumer computes whole tiles; a tile that ends past its group leaves through the storer's
# row-masked stores from that consumer's region (per consumer) or the region the consumers pass between them (shared)
PINGPONG_PLANS = [GemmPlan(block_n=128, stages=5, c_staging="shared", pingpong=True),
                  GemmPlan(block_n=128, stages=4, pingpong=True),
                  GemmPlan(block_n=192, stages=4, c_staging="shared", pingpong=True)]


@pytest.mark.parametrize("plan", PINGPONG_PLANS, ids=lambda p: p.describe().replace(" ", "_"))
@pytest.mark.parametrize("trans_b", [False, True])
def test_pingpong_plans(plan, trans_b):
    # last tiles of 1, 64, 65, 127 rows, whole tiles, empty groups; N = 456 (a partial last tile of 128 and of 192);
    # K = 1000 (several rounds of the ring per tile, a K tail); then K = 40, shorter than one K block
    sizes = [0, 1, 127, 0, 128, 129, 65, 64, 300, 5, 0, 257]
    run_case(sizes, n=456, k=1000, trans_b=trans_b, plan=plan, seed=21)
    run_case([3, 200, 0, 64], n=200, k=40, trans_b=trans_b, plan=plan, seed=22)


def test_pingpong_fp32_and_fp16_out():
    run_case([0, 33, 250, 1, 129], n=256, k=192, out_dtype="float32", seed=23,
             plan=GemmPlan(block_n=128, stages=4, c_staging="shared", pingpong=True))
    run_case([0, 33, 250, 1, 129], n=264, k=320, in_dtype="float16", out_dtype="float16", trans_b=True, seed=24,
             plan=GemmPlan(block_n=128, stages=4, pingpong=True))


# Small case for compute-sanitizer (memcheck, racecheck): a ping-pong plan with shared staging, a group tail and an
# empty group; two CTAs taking turns on the tiles, or one CTA per tile. racecheck runs the second only: a region read
# by the storer's row-masked stores goes back to a consumer through an mbarrier, which racecheck does not model
# (as for the fp8 grouped case, test_grouped_gemm_fp8.py).
@pytest.mark.parametrize("ctas", ["two_ctas", "one_tile_each"])
def test_pingpong_sanitize_small(ctas):
    sizes, n = [100, 0, 200], 256
    tiles = sum(-(-g // 128) for g in sizes) * (n // 128)
    plan = GemmPlan(block_n=128, stages=4, c_staging="shared", pingpong=True,
                    max_ctas=2 if ctas == "two_ctas" else tiles)
    run_case(sizes, n=n, k=200, trans_b=True, plan=plan, seed=25)


def test_one_consumer_plan():
    run_case([5, 64, 65, 0, 200], n=256, k=128, plan=GemmPlan(block_m=64, consumers=1, stages=4))


def test_no_rows_launches_nothing():
    a = cupy.empty((0, 64), dtype=BF16)
    b = cupy.asarray(rand_matrix(np.random.default_rng(1), (3, 64, 128), "bfloat16"))
    offs = cupy.zeros((4,), dtype=cupy.int32)
    out = grouped_gemm(a, b, offs)
    assert out.shape == (0, 128) and out.dtype == BF16


def test_graph_capture_reads_offsets_on_device():
    """Captured once with out= given, replayed with other offsets written into the same device array: the
    replay computes the new groups (the host never read them)."""
    rng = np.random.default_rng(11)
    g, n, k, m = 8, 256, 256, 1024
    a = rand_matrix(rng, (m, k), "bfloat16")
    b = rand_matrix(rng, (g, k, n), "bfloat16")
    da, db = cupy.asarray(a), cupy.asarray(b)
    offs_dev = cupy.asarray(offsets_of([128] * g).astype(np.int32))
    out = poisoned((m, n), "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grouped_gemm(da, db, offs_dev, out, stream=stream)   # first call builds the launch outside the capture
        stream.begin_capture()
        grouped_gemm(da, db, offs_dev, out, stream=stream)
        graph = stream.end_capture()
    for sizes in ([0, 500, 3, 0, 129, 128, 0, 264], [1024, 0, 0, 0, 0, 0, 0, 0], [0] * 7 + [1000]):
        offs = offsets_of(sizes)
        offs_dev.set(offs.astype(np.int32), stream=stream)
        out.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
        graph.launch(stream)
        stream.synchronize()
        check_groups(out, a, b, offs, False, "bfloat16")


@pytest.mark.parametrize("plan", [None, GemmPlan(block_n=128, stages=4, c_staging="shared"),
                                  GemmPlan(block_m=64, consumers=1, stages=4)], ids=["default", "shared", "64rows"])
def test_scatter_sends_every_row_to_its_home_and_counts_it(plan):
    """GroupScatter (hook 2 of the grouped GEMM, the MoE layer's down projection): every row of the groups goes to
    row `entry` of its home's buffer (three local buffers standing in for three ranks), bit for bit what the
    plain grouped GEMM computes for that row; each home's counter grows by (its rows) x N per call; out, rows no
    descriptor names, and a row whose entry is out of range are left alone (that row is not counted either)."""
    from fluxrt.gemm import GroupScatter

    rng = np.random.default_rng(5)
    sizes, n, k, homes, entries = [0, 1, 127, 129, 0, 300, 5], 200, 136, 3, 700
    offs = offsets_of(sizes)
    m = int(offs[-1]) + 9   # rows past the groups: never read, never sent
    a = cupy.asarray(rand_matrix(rng, (m, k), "bfloat16"))
    b = cupy.asarray(rand_matrix(rng, (len(sizes), n, k), "bfloat16"))
    doffs = cupy.asarray(offs.astype(np.int32))
    ref = grouped_gemm(a, b, doffs, poisoned((m, n), "bfloat16"), trans_b=True, plan=plan).get()
    rows = int(offs[-1])
    home = rng.integers(0, homes, size=rows)
    entry = np.zeros(rows, np.int64)
    for h in range(homes):   # distinct entries per home, in random order
        mine = np.nonzero(home == h)[0]
        entry[mine] = rng.permutation(entries)[:mine.size]
    bad = 17 if rows > 17 else 0   # one row names an entry past the buffers
    desc = np.concatenate([entry * homes + home, np.zeros(m - rows, np.int64)]).astype(np.int32)
    desc[bad] = entries * homes + home[bad]
    ddesc = cupy.asarray(desc)
    bufs = [poisoned((entries, n + 8), "bfloat16") for _ in range(homes)]   # ld > N: row padding left alone
    counters = cupy.zeros((homes,), dtype=cupy.uint64)
    dsts = cupy.asarray(np.array([x.data.ptr for x in bufs], np.uint64))
    flags = cupy.asarray(np.array([counters.data.ptr + 8 * h for h in range(homes)], np.uint64))
    scatter = GroupScatter(rows=ddesc.data.ptr, dsts=dsts.data.ptr, flags=flags.data.ptr, homes=homes, ld=n + 8,
                           entries=entries)
    out = poisoned((m, n), "bfloat16")
    for call in (1, 2):   # the counters only grow
        grouped_gemm(a, b, doffs, out, trans_b=True, plan=plan, scatter=scatter)
        cupy.cuda.get_current_stream().synchronize()
        want = [int(((home == h) & (np.arange(rows) != bad)).sum()) * n * call for h in range(homes)]
        assert counters.get().tolist() == want
    assert (out.view(cupy.uint16) == NAN_BITS["bfloat16"]).all(), "scatter wrote out"
    got = [x.get().view(np.uint16) for x in bufs]
    sent = np.zeros((homes, entries), bool)
    for r in range(rows):
        if r == bad:
            continue
        h, e = home[r], entry[r]
        sent[h, e] = True
        assert np.array_equal(got[h][e, :n], ref[r].view(np.uint16)), f"row {r} at home {h} entry {e}"
    for h in range(homes):
        assert (got[h][~sent[h]] == NAN_BITS["bfloat16"]).all(), f"home {h}: rows no descriptor names were written"
        assert (got[h][:, n:] == NAN_BITS["bfloat16"]).all(), f"home {h}: the row padding past N was written"


def test_bad_plans_and_shapes_raise():
    a = cupy.zeros((64, 64), dtype=BF16)
    b = cupy.zeros((2, 64, 64), dtype=BF16)
    offs = cupy.zeros((3,), dtype=cupy.int32)
    with pytest.raises(GemmArgumentError, match="cluster=1"):
        grouped_gemm(a, b, offs, plan=dataclasses.replace(grouped_plan(64, 64, 64, 2), cluster=2))
    with pytest.raises(GemmArgumentError, match=r"\[G \+ 1\]"):
        grouped_gemm(a, b, cupy.zeros((2,), dtype=cupy.int32))
