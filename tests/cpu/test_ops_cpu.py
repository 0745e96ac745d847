"""CPU tests of the fused ops' planners (tile order, chunk/flag layout, comm mode) and validation."""
from __future__ import annotations

import dataclasses

import pytest

from fluxrt.errors import FluxrtError
from fluxrt.gemm.plan import GemmPlan, tile_order
from fluxrt.ops import plan as P


# --- row rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("m, world, shard", [(1024, 4, 256), (8192, 4, 2048), (256, 2, 128), (800, 4, 200), (6, 2, 3)])
def test_check_rows_accepts_multiples_of_world(m, world, shard):
    assert P.check_rows("op", m, world) == shard


@pytest.mark.parametrize("m, world", [(1001, 4), (129, 2), (4096 + 2, 4)])
def test_check_rows_names_the_rule(m, world):
    with pytest.raises(P.OpsArgumentError, match=rf"M={m} must be a multiple of world = {world}") as err:
        P.check_rows("AllGatherGemm", m, world)
    assert isinstance(err.value, FluxrtError) and isinstance(err.value, ValueError)
    assert "AllGatherGemm" in str(err.value)


def test_check_rows_max_m_and_nonpositive():
    with pytest.raises(P.OpsArgumentError, match="exceeds max_m=1024"):
        P.check_rows("op", 2048, 2, max_m=1024)
    with pytest.raises(P.OpsArgumentError, match="positive"):
        P.check_rows("op", 0, 2)


@pytest.mark.parametrize("shard, mult, pad", [(256, 128, 256), (200, 128, 256), (1, 128, 128), (300, 256, 512),
                                              (512, 256, 512), (129, 128, 256)])
def test_padded_shard_is_the_next_whole_multiple(shard, mult, pad):
    assert P.padded_shard(shard, mult) == pad


@pytest.mark.parametrize("max_m, world, mult, cap", [(8192, 4, 128, 8192), (1200, 4, 128, 1536), (1201, 4, 128, 1536),
                                                     (8192, 4, 256, 8192), (8193, 4, 256, 8192), (300, 2, 256, 512),
                                                     (513, 4, 128, 512), (4, 4, 128, 512)])
def test_capacity_holds_every_padded_call_and_no_more(max_m, world, mult, cap):
    assert P.capacity_rows(max_m, world, mult) == cap
    fits = [world * P.padded_shard(m // world, mult) for m in range(world, max_m + 1, world)]
    assert max(fits) == cap   # every allowed M fits once its shards are padded, the largest exactly




# --- AllGather+GEMM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_pull_order_nearest_first_and_complete(world):
    for rank in range(world):
        order = P.pull_order(rank, world)
        assert order == [(rank + d) % world for d in range(1, world)]
        assert sorted(order + [rank]) == list(range(world))
    # at each step, every rank reads a different peer (no hot spot)
    for step in range(world - 1):
        assert len({P.pull_order(r, world)[step] for r in range(world)}) == world


@pytest.mark.parametrize("world, cpr", [(2, 1), (4, 2), (8, 4)])
def test_ag_pad_layout_slots_are_distinct_and_match_gemm_chunks(world, cpr):
    L = P.ag_pad_layout(world, cpr)
    slots = ([L.chunk(r, c) for r in range(world) for c in range(cpr)] + [L.copied(c) for c in range(cpr)]
             + [L.done(r) for r in range(world)])
    assert sorted(slots) == list(range(L.slots))
    # the GEMM's hook reads flags[m0 // chunk_rows] and names peer chunk // chunks_per_rank
    shard = 128 * cpr * 3
    chunk_rows = shard // cpr
    for r in range(world):
        for c in range(cpr):
            m0 = r * shard + c * chunk_rows
            assert m0 // chunk_rows == L.chunk(r, c)
            assert L.chunk(r, c) // cpr == r


def test_ag_gemm_plan_starts_at_own_shard_and_leaves_comm_sms():
    plan = P.AgGemmPlan(chunks_per_rank=2, comm_mode="pull", comm_sms=1)
    m, world = 4096, 4
    for rank in range(world):
        g = P.ag_gemm_plan(plan, m, 1024, 512, rank, world, "bfloat16", num_sms=132)
        assert g.max_ctas == 131
        order = tile_order(g, m, 1024)
        first_rows = order[0][0] * g.block_m
        assert first_rows == rank * m // world          # own rows first
        assert g.block_m == P.TILE_ROWS


def test_ag_gemm_plan_push_leaves_push_blocks():
    plan = P.AgGemmPlan(comm_mode="push", push_blocks=8)
    assert plan.reserved_sms == 8
    assert P.ag_gemm_plan(plan, 2048, 1024, 512, 0, 2, "bfloat16", num_sms=132).max_ctas == 124
    with pytest.raises(P.OpsArgumentError, match="comm_sms=1 leaves too few SMs"):
        P.AgGemmPlan(comm_mode="push", push_blocks=8, comm_sms=1).validate()


def test_ag_plan_override_keeps_its_tiles():
    g = GemmPlan(block_n=128, stages=4, group_m=4)
    plan = P.AgGemmPlan(gemm=g)
    got = P.ag_gemm_plan(plan, 2048, 1024, 512, 1, 2, "bfloat16")
    assert (got.block_n, got.stages, got.group_m, got.m_tile_offset) == (128, 4, 4, 1024 // 128)
    with pytest.raises(P.OpsArgumentError, match="128 rows"):
        P.AgGemmPlan(gemm=GemmPlan(block_m=64, consumers=1)).validate()
    with pytest.raises(P.OpsArgumentError, match="epilogue='tma'"):
        P.AgGemmPlan(gemm=GemmPlan(epilogue="direct")).validate()
    with pytest.raises(P.OpsArgumentError, match="cluster_n=2"):
        P.AgGemmPlan(gemm=GemmPlan(cluster=2, cluster_n=2)).validate()
    with pytest.raises(P.OpsArgumentError, match="cluster_n=2"):
        P.GemmRsPlan(gemm=GemmPlan(cluster_n=2), reduce_mode="after").validate()
    with pytest.raises(P.OpsArgumentError, match="cluster=1x2"):
        P.GemmRsPlan(gemm=GemmPlan(cluster_n=2), reduce_mode="tail").validate()


@pytest.mark.parametrize("bad", [dict(chunks_per_rank=0), dict(comm_mode="ce"), dict(push_blocks=0)])
def test_ag_plan_validation(bad):
    with pytest.raises(P.OpsArgumentError):
        P.AgGemmPlan(**bad).validate()


def test_default_ag_plan_chunking():
    assert P.plan_ag_gemm(8192, 7168, 8192, 4).chunks_per_rank == 2      # 2048-row shards
    assert P.plan_ag_gemm(1024, 1024, 1024, 4).chunks_per_rank == 1      # 256-row shards
    assert P.plan_ag_gemm(8192, 7168, 8192, 4).row_multiple == 256


# --- GEMM+ReduceScatter ------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4, 8])
def test_rs_tile_order_peers_first_own_rows_last(world):
    m, n = 128 * 4 * world, 1024
    shard = m // world
    for rank in range(world):
        g = P.rs_gemm_plan(P.GemmRsPlan(), m, n, 256, rank, world, "bfloat16")
        order = tile_order(g, m, n)
        owners = [mt * g.block_m // shard for mt, _ in order]
        assert owners[0] == (rank + 1) % world
        n_own = (shard // g.block_m) * g.tiles(m, n)[1]
        assert set(owners[-n_own:]) == {rank}                # own rows come last
        assert sorted(order) == sorted({(a, b) for a, b in order})  # every tile exactly once


def test_rs_gemm_leaves_the_sms_its_mode_needs():
    g = P.rs_gemm_plan(P.GemmRsPlan(comm_mode="sm", reduce_mode="concurrent", reduce_blocks=6), 1024, 1024, 256, 0,
                       2, "bfloat16", num_sms=132)
    assert g.max_ctas == 126
    # 'ce': one SM for the comm stream's wait kernels beside the GEMM; 'sm' + 'after': every SM
    assert P.rs_gemm_plan(P.GemmRsPlan(), 1024, 1024, 256, 0, 2, "bfloat16", num_sms=132).max_ctas == 131
    assert P.rs_gemm_plan(P.GemmRsPlan(comm_mode="sm"), 1024, 1024, 256, 0, 2, "bfloat16").max_ctas is None


@pytest.mark.parametrize("n, block_n, groups, want", [
    (8192, 256, 4, (8, 4)),      # 32 tile columns in 4 groups of 8
    (7168, 256, 4, (7, 4)),
    (6144, 256, 5, (5, 5)),      # 24 columns: 5 groups of 5, the last of 4
    (320, 128, 4, (1, 3)),       # fewer columns than groups: one per group
    (8192, 256, 1, (32, 1)),
])
def test_rs_ce_groups_cover_every_column_once(n, block_n, groups, want):
    group_n, count = P.rs_ce_groups(P.GemmRsPlan(ce_groups=groups), n, block_n)
    assert (group_n, count) == want
    n_tiles = -(-n // block_n)
    covered = [t // group_n for t in range(n_tiles)]
    assert sorted(set(covered)) == list(range(count)) and count <= groups
    assert count <= P.rs_flag_layout(128 * 4, n, 4).tiles_per_source   # a flag slot per group


def test_rs_fp32_partials_plan_fits():
    g = P.rs_gemm_plan(P.GemmRsPlan(partial_dtype="float32"), 2048, 2048, 256, 0, 2, "bfloat16")
    g.validate("float32")
    assert g.block_n == 128


@pytest.mark.parametrize("world", [2, 4])
def test_rs_flag_layout_covers_every_tile_without_overlap(world):
    max_m, n = 128 * 4 * world, 1000 // 8 * 8
    L = P.rs_flag_layout(max_m, n, world)
    seen = set()
    for block_n in (64, 128, 256):
        for m in (128 * world, max_m):
            shard = m // world
            n_tiles = -(-n // block_n)
            slots = {L.slot(q, s, mt, nt, n_tiles) for q in range(2) for s in range(world)
                     for mt in range(shard // 128) for nt in range(n_tiles)}
            assert len(slots) == 2 * world * (shard // 128) * n_tiles
            assert max(slots) < L.slots
            seen |= slots
    # parities and sources are disjoint ranges
    assert L.base(1, 0) == world * L.tiles_per_source
    with pytest.raises(IndexError):
        L.slot(0, 0, max_m // world // 128, 0, -(-n // 64))


def test_rs_reduce_grid():
    assert P.rs_reduce_grid(P.GemmRsPlan(), 256, 512, 256, num_sms=132) == 4
    assert P.rs_reduce_grid(P.GemmRsPlan(), 4096, 8192, 256, num_sms=132) == 528
    assert P.rs_reduce_grid(P.GemmRsPlan(), 2048, 8192, 256, num_sms=132) == 512
    assert P.rs_reduce_grid(P.GemmRsPlan(comm_mode="sm", reduce_mode="concurrent", reduce_blocks=8), 4096, 8192,
                            256) == 8


@pytest.mark.parametrize("bad, match", [
    (dict(reduce_mode="atomic"), "reduce_mode"), (dict(reduce_blocks=0), "reduce_blocks"),
    (dict(partial_dtype="fp8"), "partial_dtype"), (dict(comm_mode="nvls"), "comm_mode"),
    (dict(ce_groups=0), "ce_groups"), (dict(reduce_mode="concurrent"), "needs comm_mode='sm'"),
    (dict(partial_dtype="float32", reduce_mode="epilogue"), "needs reduce_mode='after'"),
    (dict(partial_dtype="float32", reduce_mode="tail"), "needs reduce_mode='after'"),
    (dict(reduce_mode="tail", gemm=GemmPlan(cluster=2)), "tail' needs a cluster-1 GEMM plan in grouped order"),
])
def test_rs_plan_validation(bad, match):
    with pytest.raises(P.OpsArgumentError, match=match):
        P.GemmRsPlan(**bad).validate()


def test_plans_are_frozen_and_printable():
    plan = P.plan_gemm_rs(8192, 8192, 1792, 4)
    assert "comm_mode='ce'" in repr(plan) and "reduce_mode='tail'" in repr(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reduce_mode = "concurrent"


# --- op validation without a GPU ---------------------------------------------------------------------

class _FakeWorld:
    size, rank, device_id = 4, 0, 0

    class options:
        check_collective_args = False


def test_ops_reject_bad_construction_before_touching_the_device():
    from fluxrt.ops import AllGatherGemm, GemmReduceScatter

    w = _FakeWorld()
    with pytest.raises(P.OpsArgumentError, match="bf16 or fp16"):
        AllGatherGemm(w, 1024, 1024, 1024, "float32")
    with pytest.raises(P.OpsArgumentError, match="must be positive"):
        AllGatherGemm(w, 0, 1024, 1024, "bf16")
    with pytest.raises(P.OpsArgumentError, match="GemmReduceScatter: max_m=3 is below world = 4"):
        GemmReduceScatter(w, 3, 1024, 1024, "bf16")
    with pytest.raises(P.OpsArgumentError, match="multiples of 8"):
        GemmReduceScatter(w, 1024, 1020, 1024, "fp16")
    with pytest.raises(P.OpsArgumentError, match="comm_mode"):
        GemmReduceScatter(w, 1024 + 64, 1024, 1024, "bf16", plan=P.GemmRsPlan(comm_mode="tcp"))


@pytest.mark.parametrize("cpr", [1, 2])
def test_ag_tile_order_own_chunk_first_bands_within_chunks(cpr):
    world, m, n = 4, 128 * 12 * 4, 2048
    shard = m // world
    chunk_rows = shard // cpr
    for rank in range(world):
        g = P.ag_gemm_plan(P.AgGemmPlan(chunks_per_rank=cpr), m, n, 512, rank, world, "bfloat16")
        order = tile_order(g, m, n)
        chunks = [mt * g.block_m // chunk_rows for mt, _ in order]
        n_chunk_tiles = (chunk_rows // g.block_m) * g.tiles(m, n)[1]
        assert set(chunks[:n_chunk_tiles]) == {rank * cpr}    # the first chunk's tiles, nothing else
        # chunks are visited in contiguous runs: each chunk's flag is waited for once
        runs = [c for i, c in enumerate(chunks) if i == 0 or c != chunks[i - 1]]
        assert len(runs) == world * cpr


def test_aligned_group_m():
    assert P.aligned_group_m(16, 32) == 16
    assert P.aligned_group_m(16, 12) == 12
    assert P.aligned_group_m(16, 18) == 9
    assert P.aligned_group_m(16, 17) == 1


# --- perf: tp_ops sweep helpers ----------------------------------------------------------------------

def test_tp_ops_shapes_and_parser():
    from fluxrt.perf import tp_ops

    assert tp_ops.parse_shapes("8192x7168x8192, 4096X7168x8192") == [(8192, 7168, 8192), (4096, 7168, 8192)]
    for bad in ("8192x7168", "0x1x1", "axbxc"):
        with pytest.raises(ValueError, match="MxNxK"):
            tp_ops.parse_shapes(bad)
    args = tp_ops.build_parser("ag_gemm").parse_args("--M 8192 --N 7168 --K 8192 -d bf16 -n 7 -w 2".split())
    assert tp_ops.shapes_from_args("ag_gemm", args) == [(8192, 7168, 8192)]
    assert (args.iters, args.warmup_iters, args.datatype) == (7, 2, "bf16")
    assert tp_ops.shapes_from_args("gemm_rs", tp_ops.build_parser("gemm_rs").parse_args([]), 4) == \
        list(tp_ops.DEFAULT_SHAPES["gemm_rs"])
    # TP=2: same model, so the sharded dimension doubles (AG: N, RS: K)
    assert tp_ops.default_shapes("ag_gemm", 2)[0] == (8192, 14336, 8192)
    assert tp_ops.default_shapes("gemm_rs", 2)[0] == (8192, 8192, 14336)
    with pytest.raises(ValueError, match="all of --M, --N and --K"):
        tp_ops.shapes_from_args("ag_gemm", tp_ops.build_parser("ag_gemm").parse_args(["--M", "8192"]))


def test_tp_ops_overlap_row_and_table():
    from fluxrt.perf import tp_ops

    # the numbers: torch async-TP at 1.386 ms has overlap 1 - (1.386-1.289)/(1.581-1.289) = 0.668
    r = tp_ops.overlap_row("ag_gemm", 8192, 7168, 8192, 4, "bfloat16", fused_ms=1.386, gemm_fluxrt=1.30,
                           gemm_cublas=1.289, comm_ms=0.368, sequential_ms=1.581, torch_ms=1.386)
    assert r["overlap_eff"] == pytest.approx(1 - 0.097 / 0.292, rel=1e-9)
    assert r["tflops"] == pytest.approx(2 * 8192 * 7168 * 8192 / 1.386e-3 / 1e12)
    assert set(r) == {"op", "m", "n", "k", "world", "dtype", "fused_ms", "gemm_ms_fluxrt", "gemm_ms_cublas",
                      "comm_ms_nccl", "comm_ms_nccl_win", "sequential_ms", "sequential_ms_win", "torch_ms",
                      "overlap_eff", "tflops"}
    # NCCL on registered windows: the overlap is taken against the faster sequential baseline
    w = tp_ops.overlap_row("ag_gemm", 8192, 7168, 8192, 4, "bfloat16", fused_ms=1.386, gemm_fluxrt=1.30,
                           gemm_cublas=1.289, comm_ms=0.368, sequential_ms=1.581, torch_ms=1.386,
                           comm_win_ms=0.30, sequential_win_ms=1.50)
    assert w["overlap_eff"] == pytest.approx(1 - 0.097 / (1.50 - 1.289), rel=1e-9)
    assert tp_ops.overlap_row("ag_gemm", 8192, 7168, 8192, 4, "bfloat16", fused_ms=1.386, gemm_fluxrt=1.30,
                              gemm_cublas=1.289, comm_ms=0.368, sequential_ms=1.581, torch_ms=None,
                              sequential_win_ms=1.7)["overlap_eff"] == pytest.approx(r["overlap_eff"])
    w = tp_ops.baseline_fields(w, {1: 1.5}, "fused", 1)
    assert w["best_baseline_ms"] == 1.386          # torch; the window sequential 1.50 beats the plain 1.581
    lines = tp_ops.format_table([w, dict(w, torch_ms=None)])
    assert lines[0].startswith("#") and "overlap" in lines[0] and "nccl-win" in lines[0] and "seq-win" in lines[0]
    assert len({len(x) for x in lines}) == 1          # columns line up
    assert "N/A" in lines[2] and "N/A" not in lines[1]
    assert "N/A" in tp_ops.format_table([r])[1]       # no window columns measured: N/A


class _FakeComm:
    """allgather that returns what the other (simulated) ranks would send: (signature, error, extra)."""

    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine, *self.others]


def _checked_world(others):
    w = _FakeWorld()
    w.size = 1 + len(others)
    w.options = type("o", (), {"check_collective_args": True})
    w.comm = _FakeComm(others)
    return w


def test_a_rank_rejecting_its_arguments_makes_every_rank_raise():
    from fluxrt.errors import CollectiveMismatchError
    from fluxrt.ops import common

    ok = (("m", 1024),)
    # another rank failed its local checks: this rank raises too instead of going on to wait for it
    w = _checked_world([(ok, None, None), ((), "OpsArgumentError: AllGatherGemm: out has shape (3, 3)", None)])
    with pytest.raises(P.OpsArgumentError, match=r"rank 2: OpsArgumentError: AllGatherGemm: out has shape"):
        common.checked_on_every_rank(w, "AllGatherGemm.forward", lambda: ("result", {"m": 1024}))
    # this rank failed: its own error, after the exchange the others take part in
    w = _checked_world([(ok, None, None)])

    def bad():
        raise P.OpsArgumentError("AllGatherGemm: a_shard must be 2-D")

    with pytest.raises(P.OpsArgumentError, match="must be 2-D"):
        common.checked_on_every_rank(w, "AllGatherGemm.forward", bad)
    # same problem everywhere: the local result comes back; a different one: a mismatch on every rank
    assert common.checked_on_every_rank(_checked_world([(ok, None, None)]), "op", lambda: ("r", {"m": 1024})) == "r"
    with pytest.raises(CollectiveMismatchError, match="rank 1: m=512"):
        common.checked_on_every_rank(_checked_world([((("m", 512),), None, None)]), "op", lambda: ("r", {"m": 1024}))
