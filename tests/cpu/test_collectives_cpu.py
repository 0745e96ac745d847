"""CPU tests of the collectives: algorithm/piece planning, argument validation, cross-rank agreement,
the perf sweep's command line and sizes, and that the kernels compile with every entry point the host uses."""
from __future__ import annotations

import io
import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest

from fluxrt import collectives as coll
from fluxrt import collectives_plan as plan
from fluxrt.errors import CollectiveArgumentError, CollectiveMismatchError
from fluxrt.perf import cli
from fluxrt.perf import collectives as bench
from fluxrt.perf.report import Row, Table
from fluxrt.toolchain import kernel_root

# ---------------------------------------------------------------------------------------------- plan


def _collectives_source() -> str:
    """The collectives' device code: entry points, team, schemes, algorithms and the device library."""
    root = kernel_root()
    files = [root / "comm" / "collectives.cu", *sorted((root / "comm").rglob("*.cuh")),
             *sorted((root / "include" / "fluxrt").glob("*.cuh"))]
    return "\n".join(f.read_text() for f in files)


def test_plan_constants_mirror_the_kernel():
    src = _collectives_source()
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr u32 (k\w+) = (\d+);", src)}
    assert consts["kMaxBlocks"] == plan.MAX_BLOCKS
    assert consts["kMaxRingBlocks"] == plan.MAX_RING_BLOCKS and consts["kBulkThreads"] == plan.THREADS
    assert consts["kMaxWorld"] == plan.MAX_WORLD
    assert consts["kVecBytes"] == plan.VEC_BYTES
    assert consts["kLLData"] == plan.LL_DATA_BYTES and consts["kLLLine"] == plan.LL_LINE_BYTES
    assert consts["kLL12Data"] == plan.LL12_DATA_BYTES
    assert consts["kFlagPhases"] == plan.FLAG_PHASES
    assert re.search(rf"constexpr u64 kStepBits = {plan.PIPE_STEP_BITS};", src)
    assert re.search(rf"constexpr u64 kLineBytes = {plan.PIPE_LINE_BYTES};", src)
    assert plan.PIPE_MAX_GRID <= plan.MAX_BLOCKS
    assert plan.ONESHOT_MAX_GRID <= plan.MAX_BLOCKS and plan.BULK_MAX_GRID <= plan.MAX_BLOCKS


def test_allreduce_switches_from_ll_to_oneshot_to_twoshot_at_the_thresholds():
    ll, t = plan.LL_MAX_BYTES, plan.ONESHOT_MAX_BYTES
    ts_lo, ts_hi = plan.LL12_TWOSHOT_MIN_BYTES, plan.LL12_TWOSHOT_MAX_BYTES
    assert ts_lo <= ll < ts_hi  # the two-shot takes over from LL12 inside the LL range
    assert plan.choose_algo("allreduce", 8, 4) == "ll"
    assert plan.choose_algo("allreduce", plan.DEFAULT_TUNING.ll12_min_bytes - 2, 4) == "ll"
    assert plan.choose_algo("allreduce", plan.DEFAULT_TUNING.ll12_min_bytes, 4) == "ll12"
    assert plan.choose_algo("allreduce", ts_lo - 2, 4) == "ll12"
    assert plan.choose_algo("allreduce", ts_lo, 4) == "ll12_twoshot"
    assert plan.choose_algo("allreduce", ll + 2, 4) == "ll12_twoshot"
    assert plan.choose_algo("allreduce", ts_hi, 4) == "ll12_twoshot"
    assert plan.choose_algo("allreduce", ts_lo, 1) == "oneshot"  # one rank
    no_ts = plan.Tuning(ll12_twoshot_max_bytes=0)
    assert plan.choose_algo("allreduce", ll, 4, tuning=no_ts) == "ll12"
    assert plan.choose_algo("allreduce", ll + 2, 4, tuning=no_ts) == "oneshot"
    assert plan.choose_algo("allreduce", t, 4, tuning=no_ts) == "oneshot"
    assert plan.choose_algo("allreduce", ll + 2, 4, tuning=plan.Tuning(ll_max_bytes=0)) == "oneshot"  # no LL buffer
    assert plan.choose_algo("allreduce", t + 2, 4, tuning=no_ts) == ("twoshot" if t + 2 < plan.PIPE_MIN_BYTES else "pipe")
    assert plan.choose_algo("allreduce", ts_hi + 2, 4) == ("twoshot" if ts_hi + 2 < plan.PIPE_MIN_BYTES else "pipe")
    no_ring = plan.Tuning(ring_min_bytes=0)
    assert plan.choose_algo("allreduce", plan.PIPE_MIN_BYTES, 4, tuning=no_ring) == "pipe"
    assert plan.choose_algo("allreduce", plan.PIPE_MIN_BYTES, 4,
                            tuning=plan.Tuning(pipe_min_bytes=0, ring_min_bytes=0)) == "twoshot"
    assert plan.choose_algo("allreduce", plan.RING_MIN_BYTES - 2, 4) == "twoshot"
    assert plan.choose_algo("allreduce", plan.RING_MIN_BYTES, 4) == "ring"
    assert plan.choose_algo("allreduce", 8, 1) == "oneshot"          # one rank: nothing to exchange
    assert plan.choose_algo("allreduce", 1 << 30, 1) == "oneshot"    # nothing to split
    assert plan.choose_algo("allreduce", 8, 4, "twoshot") == "twoshot"
    for op in ("allgather", "reduce_scatter", "alltoall", "alltoallv", "broadcast"):
        assert plan.choose_algo(op, 4 << 20, 4) == "push"
        assert plan.choose_algo(op, 8, 4) == "ll"
        assert plan.choose_algo(op, plan.PIPE_MIN_BYTES, 4) == (
            {"allgather": "ring", "reduce_scatter": "ring", "alltoall": "pairwise"}.get(op, "pipe"))
        assert plan.choose_algo(op, plan.PIPE_MIN_BYTES, 2, direct_ok=True) == (  # 2 ranks: ring from 32 MiB
            {"reduce_scatter": "ring", "alltoallv": "pipe"}.get(op, "direct"))  # symmetric allgather: 128 MiB


def test_ll_threshold_is_per_pair_of_ranks():
    ll = plan.LL_MAX_BYTES
    for op in ("allgather", "reduce_scatter", "alltoall", "alltoallv"):  # each pair moves a 1/n chunk
        assert plan.pair_bytes(op, 4 * ll, 4) == ll
        assert plan.choose_algo(op, 4 * ll, 4) == "ll"
        assert plan.choose_algo(op, 4 * ll + 16, 4) == "push"
        assert plan.choose_algo(op, 2 * ll + 2, 2) == "push"
    for op in ("allreduce", "broadcast"):                                   # each pair moves the message
        assert plan.pair_bytes(op, ll, 4) == ll
        assert plan.choose_algo(op, ll + 2, 4) != "ll"


def test_tuning_moves_the_thresholds_and_validates():
    tuned = plan.Tuning.parse(["ll_max_bytes=1K", "oneshot_max_bytes=2M", "bulk_max_grid=128"])
    assert (tuned.ll_max_bytes, tuned.oneshot_max_bytes, tuned.bulk_max_grid) == (1024, 2 << 20, 128)
    assert plan.choose_algo("allreduce", 1024, 4, tuning=tuned) == "ll12"
    assert plan.choose_algo("allreduce", 256, 4, tuning=tuned) == "ll"
    assert plan.choose_algo("allreduce", 1040, 4, tuning=tuned) == "oneshot"
    assert plan.choose_algo("allreduce", 1040, 4, tuning=dataclasses.replace(tuned, ll12_twoshot_min_bytes=1040)) == \
        "ll12_twoshot"
    assert plan.choose_algo("allreduce", 2 << 20, 4, tuning=tuned) == "ll12_twoshot"
    assert plan.choose_algo("allreduce", 2 << 20, 4, tuning=dataclasses.replace(tuned, ll12_twoshot_max_bytes=0)) == \
        "oneshot"
    assert plan.bulk_grid(1 << 30, tuned) == 128
    off = plan.Tuning(ll_max_bytes=0)
    assert plan.choose_algo("allreduce", 8, 4, tuning=off) == "oneshot"
    with pytest.raises(ValueError, match="needs an LL buffer"):
        plan.choose_algo("allreduce", 8, 4, "ll", tuning=off)
    with pytest.raises(ValueError, match="key one of"):
        plan.Tuning.parse(["ll_bytes=4"])
    with pytest.raises(ValueError, match=r"in \[1, 128\]"):
        plan.Tuning(bulk_max_grid=0)
    with pytest.raises(ValueError, match="non-negative"):
        plan.Tuning(ll_max_bytes=-1)


@pytest.mark.parametrize("n", [2, 4, 8, 32])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_ll_buffer_holds_the_largest_ll_message_in_one_round(n, itemsize):
    t = plan.DEFAULT_TUNING
    half = t.ll_buffer_bytes(n) // 2
    lay = plan.layout("allreduce", "ll", half, n, itemsize)
    assert lay.slot_bytes * n <= half and lay.slot_bytes % plan.LL_LINE_BYTES == 0
    assert lay.max_elems * itemsize >= t.ll_max_bytes                  # the whole message: one round
    assert lay.max_elems * itemsize % plan.LL_DATA_BYTES == 0          # later pieces start on a line
    lines = -(-lay.max_elems * itemsize // plan.LL_DATA_BYTES)
    assert lines * plan.LL_LINE_BYTES <= lay.slot_bytes                 # two cells per 8 data bytes fit
    (p,) = plan.allreduce_pieces(t.ll_max_bytes // itemsize, itemsize, n, "ll", lay)
    assert p.grid == plan.ll_grid(t.ll_max_bytes)
    assert p.grid * plan.THREADS * plan.LL_DATA_BYTES >= min(t.ll_max_bytes, t.ll_max_grid * plan.THREADS * 8)
    assert plan.ll_grid(8) == 1 and plan.ll_grid(1 << 30) == plan.LL_MAX_GRID
    d = plan.describe("allgather", 64, itemsize, n, 1 << 20, nbytes=64 * n * itemsize)
    assert d["algo"] == "ll"
    big = t.ll_max_bytes // itemsize + 1  # one element past the LL slot per pair
    d = plan.describe("allgather", big, itemsize, n, 1 << 20, nbytes=big * n * itemsize)
    assert d["algo"] == ("pipe" if big * n * itemsize >= t.pipe_min_bytes else "push")


@pytest.mark.parametrize("n", [2, 4, 8, 32])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_ll12_uses_the_ll_slots_and_a_thread_per_12_bytes(n, itemsize):
    t = plan.Tuning(ll12_threads=128, ll12_max_grid=64)
    assert plan.choose_algo("allreduce", 64 << 10, n, tuning=t) == "ll12"
    assert plan.choose_algo("allreduce", 256, n) == "ll"                       # below ll12_min_bytes
    assert plan.choose_algo("allreduce", 512, n) == "ll12"
    assert plan.choose_algo("allgather", 64 << 10, n, tuning=t) == "ll"       # ll12: allreduce only
    assert plan.choose_algo("allreduce", 64 << 10, n, tuning=plan.Tuning(ll12_min_bytes=0)) == "ll"   # off
    half = t.ll_buffer_bytes(n) // 2
    lay = plan.layout("allreduce", "ll12", half, n, itemsize)
    assert lay == plan.layout("allreduce", "ll", half, n, itemsize)
    lines = -(-lay.max_elems * itemsize // plan.LL12_DATA_BYTES)
    assert lines * plan.LL_LINE_BYTES <= lay.slot_bytes                 # a whole piece fits the slot
    assert lay.max_elems * itemsize % 4 == 0                            # later pieces start on a word
    (p,) = plan.allreduce_pieces((64 << 10) // itemsize, itemsize, n, "ll12", lay, t)
    assert p.grid == -(-(-(-(64 << 10) // 12)) // 128) == 43
    assert plan.block_threads("ll12", t) == 128
    assert plan.block_threads("ll", t) == plan.block_threads("oneshot", t) == plan.THREADS
    for bad in (dict(ll12_threads=48), dict(ll12_threads=1024), dict(ll12_threads=0), dict(ll12_max_grid=0),
                dict(ll12_min_bytes=-1)):
        with pytest.raises(ValueError):
            plan.Tuning(**bad)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 32])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_ll12_twoshot_fits_two_regions_of_chunks_in_an_ll_half(n, itemsize):
    t = plan.Tuning(ll12_twoshot_max_bytes=1 << 20, ll12_twoshot_threads=256, ll12_twoshot_max_grid=64)
    half = t.ll_buffer_bytes(n) // 2
    lay = plan.layout("allreduce", "ll12_twoshot", half, n, itemsize)
    assert 2 * n * lay.slot_bytes <= half and lay.slot_bytes % plan.LL_LINE_BYTES == 0
    # the largest message of the two-shot is one launch, and its chunk's lines fit a slot
    (p,) = plan.allreduce_pieces((1 << 20) // itemsize, itemsize, n, "ll12_twoshot", lay, t)
    chunk = plan.ll12_twoshot_chunk(1 << 20, n)
    assert chunk == -(-(-(-(1 << 20) // 12)) // n)
    assert chunk * plan.LL_LINE_BYTES <= lay.slot_bytes
    assert p.grid == min(64, -(-chunk // 256)) and plan.block_threads("ll12_twoshot", t) == 256
    # larger (forced) messages come in pieces that each fit, and later pieces start on a whole line
    count = 3 * half // itemsize + 7
    pieces = plan.allreduce_pieces(count, itemsize, n, "ll12_twoshot", lay, t)
    assert len(pieces) > 1 and sum(q.count for q in pieces) == count
    for q in pieces:
        assert plan.ll12_twoshot_chunk(q.count * itemsize, n) * plan.LL_LINE_BYTES <= lay.slot_bytes
        assert q.start * itemsize % plan.LL12_DATA_BYTES == 0
    # the buffer grows only with the two-shot on, and never below the LL rounds' slots
    assert plan.Tuning(ll12_twoshot_max_bytes=0).ll_buffer_bytes(n) == 2 * n * 2 * plan.LL_MAX_BYTES
    assert t.ll_buffer_bytes(n) >= plan.Tuning(ll12_twoshot_max_bytes=0).ll_buffer_bytes(n)
    assert plan.Tuning(ll_max_bytes=0).ll_buffer_bytes(n) == 2 * n * plan.LL_LINE_BYTES
    for bad in (dict(ll12_twoshot_threads=16), dict(ll12_twoshot_threads=1024), dict(ll12_twoshot_max_grid=129),
                dict(ll12_twoshot_max_bytes=-1)):
        with pytest.raises(ValueError):
            plan.Tuning(**bad)


def test_direct_exchange_needs_a_symmetric_output_and_a_large_message():
    big = plan.DIRECT_MIN_BYTES
    no_ll = plan.Tuning(ll_max_bytes=0)  # LL, where it applies, comes first
    for op in ("allgather", "alltoall", "broadcast"):
        assert plan.choose_algo(op, big, 4, direct_ok=True, tuning=no_ll) == "direct"
        assert plan.choose_algo(op, big - 16, 4, direct_ok=True, tuning=no_ll) == "push"
        assert plan.choose_algo(op, big, 4, direct_ok=False, tuning=no_ll) == "push"
        assert plan.choose_algo(op, 8 * big, 4, direct_ok=True) == "direct"
        assert plan.choose_algo(op, 16, 4, "direct", direct_ok=True) == "direct"
        with pytest.raises(ValueError, match="symmetric output"):
            plan.choose_algo(op, big, 4, "direct", direct_ok=False)
    assert plan.choose_algo("alltoallv", big, 4, direct_ok=True, tuning=no_ll) == "push"
    assert plan.direct_pieces(0, 2) == []
    (p,) = plan.direct_pieces(1 << 28, 2)  # no workspace limit: one launch
    assert (p.start, p.count, p.grid) == (0, 1 << 28, plan.BULK_MAX_GRID)
    d = plan.describe("allgather", 1 << 20, 4, 4, 1 << 20, direct_ok=True, nbytes=4 << 22)
    assert d["algo"] == "direct" and d["launches"] == 1


def test_twoshot_grid_has_its_own_cap():
    """The two-shot takes up to twoshot_max_grid blocks (a block per bulk_bytes_per_block of a chunk); the
    staged exchange rounds keep bulk_max_grid."""
    lay = plan.layout("allreduce", "twoshot", 128 << 20, 4, 2)
    (p,) = plan.pieces("allreduce", "twoshot", 8 << 20, 2, 4, lay)  # 16 MiB of bf16: 4 MiB chunks
    assert p.grid == plan.TWOSHOT_MAX_GRID > plan.BULK_MAX_GRID
    (q,) = plan.pieces("allreduce", "twoshot", 8 << 20, 2, 4, lay, plan.Tuning(twoshot_max_grid=32))
    assert q.grid == 32
    (r,) = plan.pieces("allreduce", "twoshot", 1024, 2, 4, lay)  # 512-byte chunks: one block
    assert r.grid == 1
    (g,) = plan.pieces("allgather", "push", 8 << 20, 2, 4, plan.layout("allgather", "push", 128 << 20, 4, 2))
    assert g.grid == plan.BULK_MAX_GRID
    with pytest.raises(ValueError, match="twoshot_max_grid"):
        plan.Tuning(twoshot_max_grid=plan.MAX_BLOCKS + 1)


def test_choose_algo_rejects_unknown_names():
    with pytest.raises(ValueError, match="algo 'tree'"):
        plan.choose_algo("allreduce", 8, 4, "tree")
    with pytest.raises(ValueError, match="algo 'ring'"):
        plan.choose_algo("alltoall", 8, 4, "ring")
    with pytest.raises(ValueError, match="unknown collective"):
        plan.choose_algo("allreduce_v", 8, 4)


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("count", [1, 7, 1023, 4099, 65536, 3_000_001])
def test_allreduce_pieces_cover_the_message_and_fit_the_workspace(algo, itemsize, n, count):
    half = 1 << 20
    lay = plan.layout("allreduce", algo, half, n, itemsize)
    assert lay.slot_bytes % plan.VEC_BYTES == 0
    assert lay.slot_bytes * (2 * n if algo == "twoshot" else n) <= half
    pieces = plan.allreduce_pieces(count, itemsize, n, algo, lay)
    assert [p.start for p in pieces] == list(range(0, count, lay.max_elems))
    assert sum(p.count for p in pieces) == count
    vec = plan.VEC_BYTES // itemsize
    for p in pieces:
        assert 1 <= p.grid <= plan.MAX_BLOCKS
        assert (p.start * itemsize) % plan.VEC_BYTES == 0  # every piece starts 16-byte aligned
        if algo == "oneshot":
            assert p.count * itemsize <= lay.slot_bytes
        else:
            assert p.chunk % vec == 0 and p.chunk * n >= p.count
            assert p.chunk * itemsize <= lay.slot_bytes


def test_chunked_and_alltoallv_pieces():
    lay = plan.layout("allgather", "push", 1 << 16, 4, 4)
    assert lay.slot_bytes == (1 << 14)
    pieces = plan.chunked_pieces(10_000, 4, lay)
    assert [(p.start, p.count) for p in pieces] == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert plan.chunked_pieces(0, 4, lay) == []
    assert len(plan.alltoallv_pieces(0, 4, lay)) == 1  # every rank still takes part once
    assert [p.start for p in plan.alltoallv_pieces(8193, 4, lay)] == [0, 4096, 8192]


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather", "alltoallv"])
@pytest.mark.parametrize("n", [2, 4, 8, 32])
@pytest.mark.parametrize("count", [0, 1, 4099, 3_000_001, 1 << 28])
def test_pipe_rounds_fit_their_ring_in_the_workspace(op, n, count):
    """One launch of roles x slices blocks (<= the flag slots); `slices` x `depth` entries of `step` bytes
    fit a slot; ring 1 of the allreduce follows ring 0 inside the half; a slice needs < 2**24 steps."""
    half, itemsize, t = 32 << 20, 2, plan.DEFAULT_TUNING
    lay = plan.layout(op, "pipe", half, n, itemsize)
    slots = (n - 1) * (2 if op == "allreduce" else 1)  # a ring has no slot for its own rank
    assert lay.slot_bytes * slots <= half < (lay.slot_bytes + plan.PIPE_STEP_ALIGN) * slots
    ps = plan.pieces(op, "pipe", count, itemsize, n, lay)
    if count == 0 and op != "alltoallv":
        assert ps == []
        return
    (p,) = ps
    roles = plan.pipe_roles(op)
    assert roles == (3 if op == "allreduce" else 2)
    slices = p.grid // roles
    assert p.grid % roles == 0 and p.grid <= plan.MAX_BLOCKS and 1 <= slices <= t.pipe_max_grid
    assert p.start == 0 and p.count == count
    assert p.step % plan.VEC_BYTES == 0 and p.step >= plan.VEC_BYTES
    assert slices * t.pipe_depth * p.step <= lay.slot_bytes
    per_pair = (p.chunk if op == "allreduce" else count) * itemsize
    if op == "allreduce":
        assert p.chunk * n >= count and p.chunk * itemsize % plan.VEC_BYTES == 0
    slice_bytes = -(-per_pair // slices)
    assert -(-slice_bytes // p.step) < (1 << plan.PIPE_STEP_BITS) - 1
    assert p.step % plan.PIPE_STEP_ALIGN == 0 or p.step < plan.PIPE_STEP_ALIGN
    assert lay.slot_bytes % plan.PIPE_STEP_ALIGN == 0  # slots (and so entries) start on whole pages


def test_pipe_tuning_validates_depth_and_grid():
    with pytest.raises(ValueError, match="pipe_depth"):
        plan.Tuning(pipe_depth=1)
    with pytest.raises(ValueError, match="pipe_max_grid"):
        plan.Tuning(pipe_max_grid=plan.MAX_BLOCKS + 1)
    with pytest.raises(ValueError, match="too small"):
        plan.pipe_step(1 << 10, 64, 4, 1 << 20)
    assert plan.Tuning.parse(["pipe_depth=3", "pipe_min_bytes=1M"]).pipe_min_bytes == 1 << 20
    assert plan.pipe_step(1 << 20, 4, 2, 1 << 20) == 128 << 10                    # slot / (slices x depth)
    assert plan.pipe_step(1 << 20, 4, 2, 1 << 20, max_step=32 << 10) == 32 << 10  # capped
    assert plan.pipe_step(100_000, 3, 2, 1 << 20) == 16 << 10                      # whole 4 KiB pages
    assert plan.pipe_step(3000, 3, 2, 1 << 10) == 496                             # small: 16-byte units
    with pytest.raises(ValueError, match=r"allgather of 1048576 elements \(2097152 bytes per pair\), pipelined: "
                                         r"workspace slot .* too small"):
        plan.pieces("allgather", "pipe", 1 << 20, 2, 4, plan.layout("allgather", "pipe", 1 << 10, 4, 2))
    with pytest.raises(ValueError, match=r"2\*\*20 - 1"):
        plan.pipe_step(1 << 20, 1, 2, 16 << 30, max_step=16)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("n", [2, 3, 4, 8, 32])
@pytest.mark.parametrize("count", [1, 4099, 3_000_001, 1 << 28])
@pytest.mark.parametrize("half", [32 << 20, 128 << 20])
def test_ring_rounds_fit_the_workspace_half(op, n, count, half):
    """One launch of a block per slice (<= ring_max_grid); `depth` entries of `step` bytes per block fill
    at most the half; one step per stage only where a slice fits one entry; a block's entries per round
    (2 (n - 1) stages of every piece) stay below the flag values' 2**20 - 1 steps."""
    itemsize, t = 2, plan.DEFAULT_TUNING
    lay = plan.layout(op, "ring", half, n, itemsize)
    assert lay.slot_bytes == half
    (p,) = plan.pieces(op, "ring", count, itemsize, n, lay)
    chunk = p.chunk if op == "allreduce" else count
    assert 1 <= p.grid <= t.ring_max_grid and p.start == 0 and p.count == count
    grids = {max(1, min(g, t.ring_max_grid, -(-chunk * itemsize // t.pipe_bytes_per_block)))
             for g in (t.ring_one_step_max_grid, t.ring_max_grid)}
    assert p.grid in grids if p.substeps == 1 else p.grid == max(grids)
    assert p.step % plan.VEC_BYTES == 0 and plan.VEC_BYTES <= p.step <= t.ring_step
    assert 2 <= p.depth <= t.ring_depth and p.grid * p.depth * p.step <= half
    if op == "allreduce":
        assert p.chunk * n >= count and p.chunk * itemsize % plan.VEC_BYTES == 0
    slice_bytes = -(-chunk * itemsize // p.grid)
    if p.substeps == 1:  # one step per stage: the whole slice in one entry
        assert slice_bytes <= p.step and p.step % plan.PIPE_STEP_ALIGN == 0
    else:
        assert (p.substeps, p.depth) == (t.ring_substeps, t.ring_depth)
    piece = p.step * p.substeps
    assert -(-slice_bytes // piece) * p.substeps * 2 * (n - 1) < (1 << plan.PIPE_STEP_BITS) - 1


def test_ring_geometry_takes_one_step_per_stage_where_a_slice_fits_an_entry():
    """Fewer, fuller blocks first (ring_one_step_max_grid), then ring_max_grid; a half holding fewer than two
    such entries per block, a slice past ring_step or ring_one_step_max_grid=0 keep ring_substeps steps per
    stage with ring_depth entries."""
    t, K, M = plan.DEFAULT_TUNING, 1 << 10, 1 << 20
    g = plan.ring_geometry(128 * M, 4, 8 * M, t)  # 8 MiB chunk over 96 blocks: 87382 -> 88 KiB entries
    assert g == plan.RingGeometry(96, 88 * K, 4, 1)
    assert plan.ring_geometry(128 * M, 4, 32 * M, t) == plan.RingGeometry(128, 256 * K, 4, 1)  # 341 KiB > ring_step
    assert plan.ring_geometry(32 * M, 4, 16 * M, t) == plan.RingGeometry(128, 128 * K, 2, 1)   # 96 x 172 KiB x 2 > half
    assert plan.ring_geometry(32 * M, 4, 8 * M, t) == plan.RingGeometry(96, 88 * K, 3, 1)  # depth: what the half holds
    many = plan.ring_geometry(128 * M, 4, 64 * M, t)  # 512 KiB slices: two entries per stage
    assert many == plan.RingGeometry(128, plan.ring_step(128 * M, 128, 4, 64 * M, t), t.ring_depth, t.ring_substeps)
    off = plan.Tuning(ring_one_step_max_grid=0)
    assert plan.ring_geometry(128 * M, 4, 8 * M, off) == plan.RingGeometry(
        128, plan.ring_step(128 * M, 128, 4, 8 * M, off), off.ring_depth, off.ring_substeps)
    small = plan.Tuning(ring_max_grid=8, ring_one_step_max_grid=64)  # ring_max_grid caps the one-step grid too
    assert plan.ring_geometry(128 * M, 4, 8 * M, small).slices == 8
    with pytest.raises(ValueError, match="ring_one_step_max_grid"):
        plan.Tuning(ring_one_step_max_grid=plan.MAX_RING_BLOCKS + 1)


def test_ring_threshold_and_tuning():
    t = plan.Tuning(ring_min_bytes=32 << 20)
    assert plan.choose_algo("allreduce", 32 << 20, 4, tuning=t) == "ring"
    assert plan.choose_algo("reduce_scatter", 1 << 30, 4, tuning=t) == "ring"
    assert plan.choose_algo("reduce_scatter", 16 << 20, 4, tuning=t) == "push"
    assert plan.choose_algo("allreduce", (32 << 20) - 2, 4, tuning=t) == "twoshot"
    assert plan.choose_algo("alltoall", 1 << 30, 4, tuning=t) == "pairwise"  # no ring for alltoall
    assert plan.choose_algo("allreduce", 1 << 30, 1, tuning=t) == "oneshot"  # one rank: no ring
    two = plan.Tuning(ring_min_bytes=1 << 30, two_rank_ring_min_bytes=64 << 20)
    assert plan.choose_algo("allreduce", 64 << 20, 2, tuning=two) == "ring"
    assert plan.choose_algo("allreduce", 64 << 20, 4, tuning=two) == "pipe"
    assert plan.choose_algo("reduce_scatter", 64 << 20, 2, tuning=two) == "ring"
    assert plan.choose_algo("allreduce", 1 << 30, 2, tuning=plan.Tuning(two_rank_ring_min_bytes=0)) == "pipe"
    assert plan.choose_algo("allreduce", 1 << 30, 4) == ("ring" if plan.DEFAULT_TUNING.ring_min_bytes else "pipe")
    ag = plan.Tuning(allgather_ring_min_bytes=128 << 20, two_rank_allgather_ring_min_bytes=16 << 20)
    assert plan.choose_algo("allgather", 128 << 20, 4, tuning=ag) == "ring"
    assert plan.choose_algo("allgather", 64 << 20, 4, tuning=ag) == "pairwise"
    assert plan.choose_algo("allgather", 1 << 30, 4, direct_ok=True, tuning=ag) == "ring"
    assert plan.choose_algo("allgather", 64 << 20, 4, direct_ok=True) == "direct"  # symmetric: ring from 128 MiB
    assert plan.choose_algo("allgather", 128 << 20, 4, direct_ok=True) == "ring"
    assert plan.choose_algo("allgather", 64 << 20, 4) == "ring"
    assert plan.choose_algo("allgather", 16 << 20, 2, tuning=ag) == "ring"
    assert plan.choose_algo("allgather", (16 << 20) - 2, 2, tuning=ag) == "push"
    assert plan.choose_algo("allgather", 1 << 30, 4, tuning=plan.Tuning(allgather_ring_min_bytes=0)) == "pairwise"
    assert plan.choose_algo("allgather", 1 << 30, 4, tuning=plan.Tuning(allgather_ring_min_bytes=0, pairwise_min_bytes=0)) == "pipe"
    assert plan.choose_algo("reduce_scatter", 32 << 20, 4, tuning=ag) == "push"  # its own threshold
    rs = plan.Tuning(ring_min_bytes=1 << 30, reduce_scatter_ring_min_bytes=16 << 20)
    assert plan.choose_algo("reduce_scatter", 16 << 20, 4, tuning=rs) == "ring"
    assert plan.choose_algo("allreduce", 16 << 20, 4, tuning=rs) == "twoshot"
    with pytest.raises(ValueError, match="ring_depth"):
        plan.Tuning(ring_depth=3, ring_substeps=2)
    with pytest.raises(ValueError, match="ring_depth"):
        plan.Tuning(ring_depth=2, ring_substeps=0)
    with pytest.raises(ValueError, match="ring_max_grid"):
        plan.Tuning(ring_max_grid=plan.MAX_RING_BLOCKS + 1)
    with pytest.raises(ValueError, match="ring_threads"):
        plan.Tuning(ring_threads=100)
    assert plan.block_threads("ring", plan.Tuning(ring_threads=256)) == 256
    with pytest.raises(ValueError, match="ring_step"):
        plan.Tuning(ring_step=8)
    assert plan.ring_step(256 << 20, 64, 4, 1 << 30) == 256 << 10                      # capped at ring_step
    assert plan.ring_step(32 << 20, 64, 4, 1 << 30) == 128 << 10                       # half / (slices x depth)
    assert plan.ring_step(32 << 20, 64, 4, 6 << 20) == 48 << 10                        # slice / substeps
    assert plan.ring_step(200_000, 8, 4, 1 << 30) == 4 << 10                           # whole 4 KiB pages
    assert plan.ring_step(3000, 8, 4, 1 << 10) == 80                                   # small: 16-byte units
    with pytest.raises(ValueError, match=r"allreduce of 1048576 elements, ring: workspace half .* too small"):
        plan.pieces("allreduce", "ring", 1 << 20, 2, 4, plan.layout("allreduce", "ring", 64, 4, 2))
    with pytest.raises(ValueError, match=r"2\*\*20 - 1"):
        plan.ring_step(1 << 10, 1, 4, 16 << 30)


def test_layout_refuses_a_workspace_too_small():
    with pytest.raises(ValueError, match="too small"):
        plan.layout("allreduce", "twoshot", 64, 4, 2)


def test_describe_reports_algo_and_launches():
    d = plan.describe("allreduce", 1 << 24, 2, 4, 32 << 20, algo="twoshot")
    assert d["algo"] == "twoshot" and d["launches"] == 2  # 32 MiB in pieces of half the 32 MiB half
    d = plan.describe("allreduce", 1 << 29, 2, 4, 32 << 20)
    assert d["algo"] == "ring" and d["launches"] == 1     # 1 GiB: the ring recycles, one launch
    d = plan.describe("allreduce", 1 << 25, 2, 4, 32 << 20, algo="pipe")
    assert d["algo"] == "pipe" and d["launches"] == 1     # 64 MiB pipelined: one launch
    assert plan.describe("allreduce", 8, 2, 4, 32 << 20)["launches"] == 1


def test_world_size_limit():
    plan.check_world(plan.MAX_WORLD)
    with pytest.raises(ValueError, match="up to"):
        plan.check_world(plan.MAX_WORLD + 1)


# ---------------------------------------------------------------------------------------------- validation


def test_reduce_dtypes_and_ops():
    assert coll._reduce_dtype("bf16") == "bf16" and coll._reduce_dtype(np.float32) == "fp32"
    assert coll._reduce_dtype("fp16") == "fp16"
    for d, name in ((np.float64, "fp64"), (np.int32, "int32"), (np.int64, "int64"), (np.uint8, "uint8")):
        assert coll._reduce_dtype(d) == name
    with pytest.raises(CollectiveArgumentError, match="int64 and uint8"):
        coll._reduce_dtype(np.int16)
    with pytest.raises(CollectiveArgumentError, match="prod"):
        coll._redop("product")
    assert coll._reduction(np.float64, "avg") == ("fp64", "avg")
    assert coll._reduction(np.uint8, "prod") == ("uint8", "prod")
    with pytest.raises(CollectiveArgumentError, match="floating-point"):
        coll._reduction(np.int32, "avg")
    assert coll._redop("MAX") == "max"
    assert coll._move_dtype("int32") == np.dtype(np.int32)
    with pytest.raises(CollectiveArgumentError):
        coll._move_dtype(np.dtype("U4"))


def test_counts_and_displacements():
    assert coll._counts([1, 0, 3], 3, "send_counts").tolist() == [1, 0, 3]
    with pytest.raises(CollectiveArgumentError, match="needs 4 entries"):
        coll._counts([1, 2, 3], 4, "send_counts")
    with pytest.raises(CollectiveArgumentError, match="negative"):
        coll._counts([1, -2], 2, "recv_counts")
    assert coll._displs(None, np.array([2, 0, 5]), "d").tolist() == [0, 2, 2]
    assert coll._displs([9, 0], np.array([1, 1]), "d").tolist() == [9, 0]
    with pytest.raises(CollectiveArgumentError, match="non-negative"):
        coll._displs([0, -1], np.array([1, 1]), "d")


def _buf(ptr, nbytes):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), nbytes=nbytes)


def test_alias_rules():
    coll._check_alias("allreduce", _buf(0, 64), _buf(64, 64), (0,))       # disjoint
    coll._check_alias("allreduce", _buf(0, 64), _buf(0, 64), (0,))        # in place
    coll._check_alias("allgather", _buf(128, 64), _buf(0, 256), (128,))   # x is out's chunk 2
    with pytest.raises(CollectiveArgumentError, match="overlaps"):
        coll._check_alias("allreduce", _buf(0, 64), _buf(32, 64), (0,))
    with pytest.raises(CollectiveArgumentError, match="overlaps"):
        coll._check_alias("alltoallv", _buf(0, 64), _buf(0, 64), ())


class _FakeComm:
    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine, *self.others]


def _world(others, check=True):
    return SimpleNamespace(size=1 + len(others), comm=_FakeComm(others),
                           options=SimpleNamespace(check_collective_args=check))


def test_agree_passes_matching_calls_and_returns_extras():
    sig = (("count", 8), ("dtype", "bf16"))
    w = _world([(sig, None, "b"), (sig, None, "c")])
    assert coll._agree(w, "allreduce", sig, None, extra="a") == ["a", "b", "c"]


def test_agree_names_the_ranks_that_differ():
    sig = (("count", 8), ("dtype", "bf16"))
    other = (("count", 9), ("dtype", "bf16"))
    w = _world([(sig, None, None), (other, None, None)])
    with pytest.raises(CollectiveMismatchError) as err:
        coll._agree(w, "allreduce", sig, None)
    assert "ranks [0, 1]: count=8" in str(err.value) and "ranks [2]: count=9" in str(err.value)


def test_agree_turns_another_ranks_local_error_into_an_error_here():
    sig = (("count", 8),)
    w = _world([(sig, "CollectiveArgumentError: out too small", None)])
    with pytest.raises(CollectiveArgumentError, match="rank 1: CollectiveArgumentError: out too small"):
        coll._agree(w, "allreduce", sig, None)
    mine = CollectiveArgumentError("x is on GPU 1")
    with pytest.raises(CollectiveArgumentError, match="GPU 1"):
        coll._agree(_world([(sig, None, None)]), "allreduce", sig, mine)


def test_agree_without_checks_raises_local_errors_only():
    w = _world([((("count", 9),), None, None)], check=False)
    coll._agree(w, "allreduce", (("count", 8),), None)  # no MPI call, no comparison
    with pytest.raises(CollectiveArgumentError):
        coll._agree(w, "allreduce", (("count", 8),), CollectiveArgumentError("bad"))


def test_local_wraps_value_errors():
    got, err = coll._local(lambda: (_ for _ in ()).throw(ValueError("nope")))
    assert got is None and isinstance(err, CollectiveArgumentError) and "nope" in str(err)
    assert coll._local(lambda: 3) == (3, None)


# ---------------------------------------------------------------------------------------------- perf sweep


def test_cli_lists_every_collective():
    for op in bench.OPS:
        assert cli.BENCHES[op] == f"fluxrt.perf.collectives:{op}"


def test_cli_passes_the_bench_name(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "main", lambda argv, op: seen.update(argv=argv, op=op) or 0)
    assert cli.main(["alltoall", "-b", "8", "-e", "1M"]) == 0
    assert seen == {"argv": ["-b", "8", "-e", "1M"], "op": "alltoall"}


def test_parser_reads_nccl_tests_flags():
    ns = bench.parser("allreduce").parse_args(
        ["-b", "8", "-e", "1G", "-f", "2", "-n", "50", "-w", "10", "-c", "1", "-d", "bf16", "-o", "max", "-G", "1",
         "--algo", "oneshot", "--json", "r.json", "--plot", "r.png"])
    assert (ns.minbytes, ns.maxbytes, ns.iters, ns.warmup_iters, ns.graph_iters) == (8, 1 << 30, 50, 10, 1)
    assert (ns.datatype, ns.op, ns.algo, ns.json_path, ns.plot_path) == ("bf16", "max", "oneshot", "r.json", "r.png")
    assert ns.impls == "fluxrt,nccl,nccl-win" and not ns.check_args


@pytest.mark.parametrize("argv, op, message", [
    (["--algo", "direct"], "allgather", "add --symmetric"),
    (["--algo", "twoshot"], "allgather", "allgather has ll, push, direct"),
    (["--tune", "bogus=1"], "allreduce", "key one of"),
    (["-d", "int32"], "allreduce", "not int32"),
    (["--impls", "nccl"], "allreduce", "must start with fluxrt"),
])
def test_sweep_rejects_bad_options_before_starting(argv, op, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv, op)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("op, nbytes, expected", [
    ("allreduce", 64, (32, 32)), ("allgather", 64, (8, 32)), ("reduce_scatter", 64, (32, 8)),
    ("alltoall", 64, (32, 32)), ("alltoallv", 64, (32, 32)), ("broadcast", 64, (32, 32)),
])
def test_buffer_elems_follow_nccl_tests_sizes(op, nbytes, expected):
    assert bench.buffer_elems(op, nbytes, 2, 4) == expected
    assert bench.size_align(op, 2, 4) == (8 if op in ("allgather", "reduce_scatter", "alltoall", "alltoallv") else 2)


def test_table_line_with_algo_and_ratio():
    out = io.StringIO()
    t = Table(impls=("fluxrt", "nccl"), out=out, show_algo=True)
    t.header()
    rows = [Row.measured(nbytes=65536, count=32768, dtype="bf16", redop="sum", impl="fluxrt", algo="oneshot",
                         time_us=4.0, busbw_factor=1.5, wrong=0),
            Row.measured(nbytes=65536, count=32768, dtype="bf16", redop="sum", impl="nccl", algo="nccl",
                         time_us=17.6, busbw_factor=1.5, wrong=0)]
    line = t.add(rows).split()
    assert line[:5] == ["65536", "32768", "bf16", "sum", "-1"]
    assert line[5:10] == ["4.00", "16.38", "24.58", "0", "oneshot"]
    assert line[-1] == "4.40"


# ---------------------------------------------------------------------------------------------- kernels


def _reduction_entry_points(dt: str, red: str) -> list[str]:
    names = [f"fluxrt_allreduce_ll_{dt}_{red}", f"fluxrt_allreduce_oneshot_{dt}_{red}",
             f"fluxrt_allreduce_twoshot_{dt}_{red}", f"fluxrt_reduce_scatter_{dt}_{red}",
             f"fluxrt_reduce_scatter_ll_{dt}_{red}", f"fluxrt_allreduce_pipe_{dt}_{red}",
             f"fluxrt_reduce_scatter_pipe_{dt}_{red}", f"fluxrt_allreduce_ring_{dt}_{red}",
             f"fluxrt_reduce_scatter_ring_{dt}_{red}"]
    if plan.ll12_fits(np.dtype(coll._DTYPE_OF[dt]).itemsize):
        names += [f"fluxrt_allreduce_ll12_{dt}_{red}", f"fluxrt_allreduce_ll12_twoshot_{dt}_{red}"]
    return names


def test_kernels_compile_with_every_entry_point():
    """Every kernel the host can name is in the module kernel_module_code routes it to: the base module and
    each element type's extension module."""
    from concurrent.futures import ThreadPoolExecutor

    from fluxrt.toolchain import CompileOptions, compile_cubin

    wanted: dict = {None: ["fluxrt_exchange", "fluxrt_exchange_ll", "fluxrt_exchange_pipe", "fluxrt_allgather_ring"]}
    for dt in coll.EXT_CODES:
        for red in plan.REDUCE_OPS:
            if red == "avg":
                if dt in coll._FLOAT_REDUCE:
                    wanted.setdefault(coll.kernel_module_code(f"fluxrt_divide_{dt}"), []).append(f"fluxrt_divide_{dt}")
                continue
            for name in _reduction_entry_points(dt, red):
                wanted.setdefault(coll.kernel_module_code(name), []).append(name)
    assert set(wanted) == {None, *coll.EXT_CODES.values()}

    def build(code):
        defines = () if code is None else (("FLUXRT_COLL_EXT", str(code)),)
        return code, compile_cubin("comm/collectives.cu", CompileOptions(arch="sm_90a", defines=defines)).read_bytes()

    cubins = dict([build(None)])   # first alone: cuda.core's lazy imports are not safe from several threads at once
    with ThreadPoolExecutor(4) as pool:
        cubins.update(pool.map(build, [c for c in wanted if c is not None]))
    missing = [n for code, names in wanted.items() for n in names if n.encode() + b"\0" not in cubins[code]]
    assert not missing


def _context_stub(check: bool, made_current: list | None = None):
    c = object.__new__(coll.Collectives)
    c.world = SimpleNamespace(options=SimpleNamespace(check_collective_args=check),
                              make_current=lambda: None if made_current is None else made_current.append(1))
    c._fast = {}
    c._run = lambda stream, async_op, launches, result, keep: (launches, result)
    return c


def test_launch_lists_are_reused_only_without_cross_rank_checks(monkeypatch):
    monkeypatch.setattr(coll, "as_cupy_stream", lambda stream: stream)   # no CUDA streams on a CPU node
    planned = []

    def plan_call(stream):
        planned.append(stream)
        return ("launches",), "out"

    c = _context_stub(check=False)
    assert c._call(("k",), plan_call, None, False, None, ()) == (("launches",), "out")
    assert c._call(("k",), plan_call, None, False, "user out", ()) == (("launches",), "user out")
    assert len(planned) == 1                      # second call: cached launches, the caller's out
    c._call(None, plan_call, None, False, None, ())
    assert len(planned) == 2                      # not cacheable: planned again
    checked = _context_stub(check=True)
    checked._call(("k",), plan_call, None, False, None, ())
    checked._call(("k",), plan_call, None, False, None, ())
    assert len(planned) == 4 and checked._fast == {}  # every checked call is compared across ranks


def test_every_call_starts_on_the_worlds_gpu(monkeypatch):
    """A call (cached or planned) first makes the world's GPU current, before it takes the default stream or
    allocates: another library (JAX's GPU client) may have made its own GPU current on this thread."""
    order = []
    monkeypatch.setattr(coll, "as_cupy_stream", lambda stream: order.append("stream") or stream)
    made = []
    c = _context_stub(check=False, made_current=made)
    c.world.make_current = lambda: order.append("current")
    c._call(("k",), lambda s: (("launches",), "out"), None, False, None, ())
    c._call(("k",), lambda s: (("launches",), "out"), None, False, None, ())   # the cached path too
    assert order == ["current", "stream"] * 2


def test_world_make_current_switches_only_when_another_gpu_is_current(monkeypatch):
    import cupy

    from fluxrt.world import World

    used = []
    w = object.__new__(World)
    w.device_id, w.device = 1, SimpleNamespace(use=lambda: used.append(1))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)   # e.g. JAX made GPU 0 current
    w.make_current()
    assert used == [1]
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    w.make_current()
    assert used == [1]                                               # already current: no device switch


# ---------------------------------------------------------------------------------------------- packed launches


def test_packed_launch_keeps_each_argument_at_its_declared_width():
    from fluxrt.packed_launch import PackedLaunch

    table = np.zeros(1, np.dtype([("words", "<u8", (3,))]))
    table["words"] = [[1, 2, 3]]
    launch = PackedLaunch(kernel=None, grid=4, block=512,
                          args=(np.uint64(0x1122334455667788), np.uint32(7), np.int32(-1), table))
    assert launch.packed_bytes() == (np.uint64(0x1122334455667788).tobytes() + np.uint32(7).tobytes()
                                     + np.int32(-1).tobytes() + np.array([1, 2, 3], "<u8").tobytes())
    table["words"] = [[9, 9, 9]]  # packed once: later changes to the caller's array do not leak in
    assert launch.packed_bytes().endswith(np.array([1, 2, 3], "<u8").tobytes())
    with pytest.raises(TypeError, match="argument 1: expected a numpy scalar"):
        PackedLaunch(None, 1, 32, (np.uint64(1), 5))


def test_packed_launch_with_pdl_carries_the_programmatic_serialization_attribute():
    from cuda.bindings import driver

    from fluxrt.packed_launch import PackedLaunch

    launch = PackedLaunch(None, grid=43, block=128, args=(np.uint64(1),), pdl=True)
    config = launch._config
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (43, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (128, 1, 1, 0)
    assert config.numAttrs == 1
    (attr,) = config.attrs
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert PackedLaunch(None, 1, 32, (np.uint64(1),))._config is None          # plain launch
    assert plan.DEFAULT_TUNING.pdl == 1 and plan.Tuning.parse(["pdl=0"]).pdl == 0
    with pytest.raises(ValueError, match="pdl"):
        plan.Tuning(pdl=2)


def test_every_collective_kernel_waits_for_the_previous_grid_before_touching_memory():
    """PDL launches are only correct for kernels that take their round share, trigger the next launch and
    wait (griddepcontrol.wait) before any access to x, out, the workspace, the LL buffer or flags: every
    entry point goes through begin_round, which has both, before its prefetch of the first loads."""
    src = _collectives_source()
    begins = re.findall(r"__device__ __forceinline__ u64 begin_round\(u64\* counter, Constant constant, Prefetch "
                        r"prefetch\) \{.*?\n}\n", src, re.S)
    assert len(begins) == 1
    share, trigger, wait = (begins[0].index(k) for k in ("atomicAdd(counter", "pdl_launch_dependents()", "pdl_wait()"))
    assert share < trigger < wait < begins[0].index("prefetch();")
    for fn in ("allreduce_ll12", "allreduce_ll12_twoshot"):  # their first loads of x run as begin_round's prefetch
        body = re.search(rf"__device__ void {fn}\(.*?\n}}\n", src, re.S).group(0)
        assert re.search(r"begin_round\(\s*// stage begin\s*t\.epoch, \[&\] \{", body)
        assert body.index("begin_round") < body.index("load12(")
        assert body.index("begin_round") < body.index("// stage push")
    for device_fn in re.findall(r"^__device__ void (\w+)\(", src, re.M):
        body = re.search(rf"__device__ void {device_fn}\(.*?\n}}\n", src, re.S).group(0)
        if device_fn in ("copy_block", "reduce_slots", "reduce_step", "push_chunks", "exchange_pipe_pairwise",
                         "norm_row", "poison_received", "poison_block_share"):
            continue  # helpers called after the begin stage
        if device_fn == "add_rmsnorm":
            continue  # a local kernel (no round, no flags), launched without PDL
        assert re.search(r"begin_round|begin_pipe", body), f"{device_fn} never begins a round"


def test_collective_kernel_arguments_match_the_kernel_parameter_lists():
    """The host's team tuple has the fields of FLUXRT_TEAM_PARAMS, in order and width."""
    src = _collectives_source()
    m = re.search(r"#define FLUXRT_TEAM_PARAMS\s*\\\n(.*?)\n#define", src, re.S)
    params = [p.strip() for p in re.sub(r"\\\n", " ", m.group(1)).split(",")]
    widths = [4 if p.startswith("u32") else 8 for p in params]
    import inspect

    init = inspect.getsource(coll.Collectives.__init__)
    base = re.search(r"self\._team_base = \((.*?)\)\n", init, re.S).group(1)
    host = [4 if w == "_u32" else 8 for w in re.findall(r"(_u64|_u32)\(", base)] + [4]  # + the op id (u32)
    assert host == widths, (params, host)


@pytest.mark.parametrize("op", ["allgather", "reduce_scatter", "alltoall", "allreduce"])
def test_pipe_step_caps_per_op(op):
    n, itemsize, half = 4, 2, 128 << 20  # the perf CLI's 256 MiB workspace
    count = (1 << 30) // itemsize // (1 if op == "allreduce" else n)
    lay = plan.layout(op, "pipe", half, n, itemsize)
    (p,) = plan.pieces(op, "pipe", count, itemsize, n, lay)
    slices = p.grid // plan.pipe_roles(op)
    uncapped = plan.pipe_step(lay.slot_bytes, slices, plan.PIPE_DEPTH, 1 << 30)
    assert uncapped > plan.PIPE_MAX_STEP
    # exchange ops and reduce_scatter: 64 KiB entries; allreduce: as large as the workspace allows
    assert p.step == (uncapped if op == "allreduce" else plan.PIPE_MAX_STEP)
    field = "allreduce_pipe_max_step" if op == "allreduce" else "pipe_max_step"
    t = plan.Tuning(**{field: 32 << 10})
    (q,) = plan.pieces(op, "pipe", count, itemsize, n, lay, t)
    assert q.step == 32 << 10


def test_pairwise_alltoall_choice():
    """'auto' takes the pairwise phases for alltoall and allgather from pairwise_min_bytes on 3 or more
    ranks, with an output apart from the input (alltoall), entries of at least pairwise_min_step and
    below the ring (allgather); forcing an in-place alltoall into it is an error."""
    t, big = plan.DEFAULT_TUNING, 128 << 20  # the perf CLI's 256 MiB workspace
    assert plan.choose_algo("alltoall", 32 << 20, 4, half_bytes=big) == "pairwise"
    assert plan.choose_algo("alltoall", 1 << 30, 4, half_bytes=big) == "pairwise"
    assert plan.choose_algo("alltoall", (32 << 20) - 16, 4, half_bytes=big) == "push"
    assert plan.choose_algo("alltoall", 1 << 30, 4, overlaps=True, half_bytes=big) == "pipe"   # in place
    assert plan.choose_algo("alltoall", 1 << 30, 2, half_bytes=big) == "pipe"                  # one peer
    assert plan.choose_algo("alltoall", 1 << 30, 4, direct_ok=True, half_bytes=big) == "direct"
    assert plan.choose_algo("alltoall", 1 << 30, 4, half_bytes=32 << 20) == "pipe"  # 64 MiB workspace: small entries
    assert plan.choose_algo("allgather", 1 << 30, 4, half_bytes=big) == "ring"     # the ring from 32 MiB
    assert plan.choose_algo("allgather", 32 << 20, 4, half_bytes=big) == "ring"
    later = plan.Tuning(allgather_ring_min_bytes=64 << 20)
    assert plan.choose_algo("allgather", 32 << 20, 4, half_bytes=big, tuning=later) == "pairwise"
    assert plan.choose_algo("allgather", 32 << 20, 4, overlaps=False, direct_ok=True, half_bytes=big) == "direct"
    assert plan.choose_algo("allgather", 32 << 20, 2, half_bytes=big) == "ring"  # 2 ranks: the ring from 16 MiB
    assert plan.choose_algo("reduce_scatter", 32 << 20, 4, half_bytes=big) == "push"
    assert plan.choose_algo("alltoall", 1 << 30, 4, tuning=plan.Tuning(pairwise_min_bytes=0)) == "pipe"
    step = plan.pairwise_step(1 << 30, 4, big)
    assert t.pairwise_min_step <= step <= t.pairwise_max_step and step % plan.PIPE_STEP_ALIGN == 0
    lay = plan.layout("alltoall", "pairwise", big, 4, 2)
    (p,) = plan.pieces("alltoall", "pairwise", (1 << 30) // 8, 2, 4, lay)
    assert (p.step, p.depth) == (step, t.pairwise_depth)
    assert (p.grid // 2) * p.depth * p.step <= lay.slot_bytes
    (q,) = plan.pieces("alltoall", "pipe", (1 << 30) // 8, 2, 4, plan.layout("alltoall", "pipe", big, 4, 2))
    assert (q.step, q.depth) == (t.pipe_max_step, t.pipe_depth)
    with pytest.raises(ValueError, match="pairwise"):
        plan.choose_algo("alltoall", 1 << 30, 4, "pairwise", overlaps=True)
    with pytest.raises(ValueError, match="pairwise_depth"):
        plan.Tuning(pairwise_depth=1)


def _scheme_table() -> list[tuple[str, str, list[str], list[str]]]:
    """collectives.cu's comment table: (scheme, collective, expanded entry points, names in parentheses)."""
    text = (kernel_root() / "comm" / "collectives.cu").read_text()
    rows = []
    for m in re.finditer(r"^//\s+(staged|ll12|ll|pipelined|ring)\s+(allreduce|reduce-scatter|exchange|allgather)"
                         r"\s+(\S+)(?:\s+\(([^)]*)\))?\s+\S+\.cuh\s*$", text, re.M):
        entry, names = m.group(3), [n.strip() for n in (m.group(4) or "").split(",") if n.strip()]
        brace = re.search(r"\{([^}]*)\}", entry)
        entries = ([entry[:brace.start()] + alt + entry[brace.end():] for alt in brace.group(1).split(",")]
                   if brace else [entry])
        rows.append((m.group(1), m.group(2), entries, names))
    return rows


def _kernel_name(op: str, algo: str) -> str:
    """The entry point collectives.py launches for (op, algo), dtype/op suffix left as '*'."""
    if op == "allreduce":
        return f"fluxrt_allreduce_{algo}_*"
    if op == "reduce_scatter":
        return "fluxrt_reduce_scatter_" + {"ll": "ll_", "pipe": "pipe_", "ring": "ring_"}.get(algo, "") + "*"
    if op == "allgather" and algo == "ring":
        return "fluxrt_allgather_ring"
    return {"ll": "fluxrt_exchange_ll", "pipe": "fluxrt_exchange_pipe", "pairwise": "fluxrt_exchange_pipe"}.get(
        algo, "fluxrt_exchange")


def test_every_algorithm_name_is_a_scheme_algorithm_pair_of_the_kernel_table():
    """Each name the planner can choose (auto or forced) has a (scheme, algorithm) pair, the pair's scheme and
    kernel collective are a row of collectives.cu's table, and that row's entry point is the kernel
    collectives.py launches for the name (and names it, where the row lists names)."""
    table = _scheme_table()
    assert len(table) == 13, table  # every row of the table parsed
    assert set(plan.ALGO_PAIRS) == {(op, a) for op, names in plan.ALGOS.items() for a in names}
    for (op, algo), (scheme, algorithm) in plan.ALGO_PAIRS.items():
        assert plan.algo_pair(op, algo) == (scheme, algorithm)
        collective = algorithm.split(":")[0]
        rows = [r for r in table if r[:2] == (scheme, collective)]
        assert len(rows) == 1, (op, algo, scheme, collective)
        _, _, entries, names = rows[0]
        assert _kernel_name(op, algo) in entries, (op, algo, entries)
        if names:
            assert algo in names, (op, algo, names)
    with pytest.raises(ValueError, match="no .scheme, algorithm. pair"):
        plan.algo_pair("allreduce", "push")


@pytest.mark.parametrize("op", list(plan.ALGOS))
@pytest.mark.parametrize("nbytes", [64, 4 << 10, 200 << 10, 2 << 20, 64 << 20, 1 << 30])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_describe_shows_the_pair_of_the_chosen_algorithm(op, nbytes, n):
    for direct_ok in (False, True):
        d = plan.describe(op, max(1, nbytes // 4 // n), 4, n, 64 << 20, direct_ok=direct_ok, nbytes=nbytes)
        assert (d["scheme"], d["algorithm"]) == plan.ALGO_PAIRS[(op, d["algo"])]


def test_perf_rows_carry_the_pair():
    r = Row.measured(nbytes=1024, count=256, dtype="float", redop="sum", impl="fluxrt", algo="twoshot",
                     time_us=10.0, busbw_factor=1.5, scheme="staged", algorithm="allreduce: reduce-scatter+allgather")
    d = dataclasses.asdict(r)
    assert (d["scheme"], d["algorithm"]) == ("staged", "allreduce: reduce-scatter+allgather")
    assert Row.measured(nbytes=1, count=1, dtype="float", redop="sum", impl="nccl", algo="nccl", time_us=1.0,
                        busbw_factor=1.0).scheme == ""
