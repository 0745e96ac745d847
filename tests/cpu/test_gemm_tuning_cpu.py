"""The GEMM shape suite, the heuristic planner and the autotune cache, without a GPU."""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import subprocess
import sys

import pytest

from fluxrt.gemm import autotune as _autotune_fn  # noqa: F401  (the package exports the function)
from fluxrt.gemm.plan import (SMEM_LIMIT_BYTES, TILE_RATE, GemmPlan, heuristic_plan, tile_cost, tile_shapes)
from fluxrt.gemm import plan as P
from fluxrt.perf import shapes as S

tuning = sys.modules["fluxrt.gemm.autotune"]


# --- shape suite -------------------------------------------------------------------------------------

def test_full_suite_covers_every_model_layer_tp_m_and_layout():
    full = S.full_suite()
    keys = {s.key() for s in full}   # a layer two models share appears once, under the first model's label
    for model in S.MODELS:
        for tp in S.TPS:
            dims = S.layer_dims(model, tp)
            assert set(dims) == {"qkv", "o", "gate_up", "down"}
            for n, k in dims.values():
                assert all((m, n, k, layout) in keys for m in S.MS for layout in ("NK", "KN"))
    assert {s.m for s in full} == set(S.MS)
    assert {s.layout for s in full} == {"NK", "KN"}
    assert len({s.key() for s in full}) == len(full)


def test_core_suite_is_a_capped_subset_that_still_covers_every_axis():
    full = {s.key() for s in S.full_suite()}
    core = S.core_suite()
    assert len(core) >= 60
    assert all(s.key() in full for s in core)
    assert all(s.flop <= S.CORE_MAX_FLOP for s in core)
    for model in S.MODELS:
        mine = [s for s in core if s.label.startswith(model + "/")]
        assert {s.layout for s in mine} == {"NK", "KN"}
        assert {s.label.split("/")[2] for s in mine} == {f"tp{t}" for t in S.TPS}
    assert {s.m for s in core} == set(S.MS)


def test_tp_sharding_of_the_layers():
    h, inter, q, kv, d = S.MODELS["llama3-70b"]
    for tp in S.TPS:
        dims = S.layer_dims("llama3-70b", tp)
        assert dims["qkv"] == ((q + 2 * kv) * d // tp, h)
        assert dims["o"] == (h, q * d // tp)
        assert dims["gate_up"] == (2 * inter // tp, h)
        assert dims["down"] == (h, inter // tp)


def test_random_suite_is_seeded_and_off_the_64_grid_with_16_byte_rows():
    a, b = S.random_suite(), S.random_suite()
    assert a == b
    assert a != S.random_suite(seed=1)
    for s in a:
        assert s.m % 64 and s.n % 64 and s.k % 64
        assert s.n % 8 == 0 and s.k % 8 == 0


def test_shape_suite_cli_prints_the_suite():
    out = subprocess.run([sys.executable, "-m", "fluxrt.perf.shapes", "--suite", "random"], capture_output=True,
                         text=True, check=True).stdout
    assert f"# random: {len(S.random_suite())} shapes" in out


# --- heuristic planner -------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(256, 2560, 8192), (1024, 4096, 768), (8192, 8192, 8192), (461, 9128, 13208),
                                   (16384, 3584, 4096), (65, 72, 8)])
def test_heuristic_plan_minimises_the_model_and_fits(m, n, k):
    from fluxrt.gemm.plan import plain_plans, plan_cost, split_plans

    plan = heuristic_plan(m, n, k)
    assert isinstance(plan, GemmPlan)
    assert plan.smem_bytes("float32" if plan.split_k > 1 else "bfloat16") <= SMEM_LIMIT_BYTES
    chosen = plan_cost(plan, m, n, k)
    for other in plain_plans(m) + split_plans(m, n, k):
        assert chosen <= plan_cost(other, m, n, k) * 1.001
    for bm, bn, cl in tile_shapes(m):
        assert chosen <= tile_cost(m, n, k, bm, bn, cl) * 1.001
    rows = plan.split_k * m
    assert plan.group_m == max(1, min(math.ceil(rows / plan.block_m), 16))


def test_tile_cost_counts_whole_waves():
    one_wave = tile_cost(128 * 132, 256, 1024, 128, 256)
    assert tile_cost(128 * 133, 256, 1024, 128, 256) == pytest.approx(2 * one_wave)
    assert tile_cost(128 * 100, 256, 1024, 128, 256) == pytest.approx(one_wave)


def test_small_problems_get_more_tiles_than_the_largest_tile_gives():
    # 256 x 2560: 2 x 10 = 20 tiles of 128 x 256 on 132 SMs; a smaller tile does the same work in one wave
    plan = heuristic_plan(256, 2560, 8192)
    assert (plan.block_m, plan.block_n) != (128, 256)
    assert math.ceil(256 / plan.block_m) * math.ceil(2560 / plan.block_n) > 20


def test_cluster_plans_only_with_enough_tile_rows():
    from fluxrt.gemm.plan import CLUSTER_MIN_TILE_ROWS as rows

    assert all(cl == 1 for *_, cl in tile_shapes(128 * (rows - 1)))
    assert any(cl == 2 for *_, cl in tile_shapes(128 * rows))
    assert all(key in TILE_RATE for key in tile_shapes(1 << 14))


@pytest.mark.parametrize("n,k,trans_b,pitch", [(8192, 8200, True, 16400), (8200, 8192, False, 16400),
                                                (8200, 8192, True, 16384), (7392, 8192, False, 14784),
                                                (8192, 7392, True, 14784), (1000, 7952, True, 15904),
                                                (2072, 12464, False, 4144)])
def test_misaligned_b_rows_is_the_pitch_of_b_in_32_byte_sectors(n, k, trans_b, pitch):
    from fluxrt.gemm.plan import misaligned_b_rows

    assert misaligned_b_rows(n, k, trans_b) == (pitch % 32 != 0)


@pytest.mark.parametrize("m,n,k,trans_b", [(8192, 8192, 8200, True), (8200, 8200, 8192, False),
                                           (7179, 10480, 8024, True), (6952, 9344, 5400, True)])
def test_misaligned_b_rows_cost_cluster_1_plans_more_and_the_heuristic_shares_b(m, n, k, trans_b):
    from fluxrt.gemm.plan import MISALIGNED_B_CLUSTER1_RATE as f
    from fluxrt.gemm.plan import UNALIGNED_K_CLUSTER1_RATE as fk
    from fluxrt.gemm.plan import split_cost, stream_k_cost

    raw = tile_cost(m, n, k, 128, 256, 1, trans_b=trans_b, misaligned=False)
    assert tile_cost(m, n, k, 128, 256, 1, trans_b=trans_b) == pytest.approx(raw / f)
    # the other layout of the same problem has B rows of whole sectors: at most the K % 64 factor, plain plans only
    other = tile_cost(m, n, k, 128, 256, 1, trans_b=not trans_b, misaligned=False)
    assert tile_cost(m, n, k, 128, 256, 1, trans_b=not trans_b) == pytest.approx(other / (fk if k % 64 else 1.0))
    assert stream_k_cost(m, n, k, 128, 256, trans_b=trans_b) == pytest.approx(
        stream_k_cost(m, n, k, 128, 256, trans_b=not trans_b) / f)
    assert split_cost(m, n, k, 128, 128, 2, trans_b=trans_b) > split_cost(m, n, k, 128, 128, 2, trans_b=not trans_b)
    assert tile_cost(m, n, k, 128, 256, 2, trans_b=trans_b) == tile_cost(m, n, k, 128, 256, 2, trans_b=not trans_b)
    assert heuristic_plan(m, n, k, trans_b=trans_b).cluster == 2


def test_b_rows_of_whole_sectors_scale_plain_plans_by_k_alignment_alone():
    from fluxrt.gemm.plan import UNALIGNED_K_CLUSTER1_RATE as fk

    # K = 7392: rows of 14784 B, whole 32-byte sectors though not whole 128-byte lines
    for trans_b in (True, False):
        raw = tile_cost(2048, 8192, 7392, 128, 256, 1, trans_b=trans_b, misaligned=False)
        assert tile_cost(2048, 8192, 7392, 128, 256, 1, trans_b=trans_b) == pytest.approx(raw / fk)
        # K = 8192 and N = 8192: every row whole lines
        raw = tile_cost(2048, 8192, 8192, 128, 256, 1, trans_b=trans_b, misaligned=False)
        assert tile_cost(2048, 8192, 8192, 128, 256, 1, trans_b=trans_b) == pytest.approx(raw)


def test_candidates_include_the_heuristic_and_every_known_tile_shape():
    cands = tuning.candidates(4096, 4096, 4096)
    shapes = {(p.block_m, p.block_n, p.cluster) for p in cands}
    assert set(tile_shapes(4096)) <= shapes
    assert heuristic_plan(4096, 4096, 4096) in cands
    assert all(p.smem_bytes("bfloat16") <= SMEM_LIMIT_BYTES for p in cands)
    deep = {(p.block_n, p.stages, p.cluster) for p in cands if p.c_staging == "shared"}
    assert {(256, 4, 1), (192, 5, 1), (256, 4, 2), (192, 5, 2)} <= deep   # one stage more than per-consumer staging
    assert len(set(cands)) == len(cands)
    # 2 x 2 clusters (A shared along N as well) are candidates only, never the model's pick
    assert {(p.block_n, p.cluster) for p in cands if p.cluster_n == 2 and p.block_m == 128} == \
        {(256, 2), (192, 2), (128, 2)}
    # 256-row tiles in pairs along N, every width (and the direct epilogue where staging leaves 3 stages)
    tall = {(p.block_n, p.epilogue) for p in cands if p.cluster_n == 2 and p.block_m == 256 and p.cluster == 1}
    assert {(bn, "tma") for bn in P.TALL_WIDTHS} | {(bn, "direct") for bn in (144, 160, 176, 192)} == tall
    # and in 2 x 2 clusters with the direct epilogue, every width
    tall22 = {(p.block_n, p.epilogue) for p in cands if p.cluster_n == 2 and p.block_m == 256 and p.cluster == 2}
    assert {(bn, "direct") for bn in P.TALL_WIDTHS} == tall22
    assert not any(p.cluster_n == 2 for p in tuning.candidates(100, 4096, 4096))   # one tile row: no pair
    # one tile column: no pair (but two columns of the 96 wide 256-row tiles)
    assert {p.block_n for p in tuning.candidates(4096, 128, 4096) if p.cluster_n == 2} == {96}
    # the tiles of small stages also at rings up to 8 stages
    assert {(p.block_m, p.block_n, p.stages) for p in cands if p.stages > 6} == {(64, 64, 8), (64, 128, 8),
                                                                                  (128, 64, 8)}
    with pytest.raises(ValueError, match="clusters along N"):
        P.plan_cost(GemmPlan(cluster=2, cluster_n=2), 4096, 4096, 4096)
    assert all(heuristic_plan(m, 4096, 4096).cluster_n == 1 for m in (256, 4096, 16384))


def test_plan_describe():
    assert GemmPlan().describe() == "128x256x64 s3 grouped/g16 epi=tma x1"


# --- autotune cache ----------------------------------------------------------------------------------

def test_problem_key_names_shape_types_and_layout():
    assert tuning.problem_key(1, 2, 3, "bfloat16", "float32", True) == "1x2x3:bfloat16:float32:NK"
    assert tuning.problem_key(1, 2, 3, "float16", "float16", False) == "1x2x3:float16:float16:KN"


def _entry(plan: GemmPlan, us: float) -> dict:
    import dataclasses

    return {"plan": dataclasses.asdict(plan), "us": us}


def test_store_merges_and_round_trips_plans(tmp_path):
    path = tmp_path / "gpu.json"
    p1, p2 = GemmPlan(block_n=128, stages=6), GemmPlan(block_m=64, consumers=1, block_n=64, stages=6, group_m=4)
    tuning.store(path, {"a": _entry(p1, 10.0)})
    tuning.store(path, {"b": _entry(p2, 20.0)})
    doc = json.loads(path.read_text())
    assert set(doc["plans"]) == {"a", "b"}
    assert tuning._plan_from(doc["plans"]["a"]["plan"]) == p1
    assert tuning._plan_from(doc["plans"]["b"]["plan"]) == p2
    assert tuning._table(path)["b"]["us"] == 20.0


def _writer(path, i):
    import dataclasses

    from fluxrt.gemm import autotune  # noqa: F401
    t = sys.modules["fluxrt.gemm.autotune"]
    for j in range(10):
        t.store(path, {f"w{i}-{j}": {"plan": dataclasses.asdict(GemmPlan()), "us": float(j)}})


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "gpu.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    plans = json.loads(path.read_text())["plans"]
    assert set(plans) == {f"w{i}-{j}" for i in range(4) for j in range(10)}


def test_unreadable_cache_is_ignored_not_fatal(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    assert tuning._read(path) == {}
    tuning.store(path, {"a": _entry(GemmPlan(), 1.0)})
    assert set(json.loads(path.read_text())["plans"]) == {"a"}


def test_plan_for_without_a_gpu_is_the_heuristic():
    assert tuning.plan_for(1024, 4096, 768) == heuristic_plan(1024, 4096, 768)


def test_cli_help_lists_tune_and_cache():
    out = subprocess.run([sys.executable, "-m", "fluxrt.gemm", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "tune" in out and "cache" in out


def test_split_plans_slice_any_k_and_only_where_tiles_are_few():
    from fluxrt.gemm.plan import SPLIT_MIN_K, split_plans, split_slices

    for k in (8192, 8200, 13208, 7000):   # 8200, 13208, 7000: no slice count divides K into 16-byte pieces
        plans = split_plans(256, 2560, k)
        assert plans and all(p.split_k > 1 and k // p.split_k >= SPLIT_MIN_K for p in plans)
        assert all(split_slices(k, p.split_k, p.block_k)[1] == p.split_k for p in plans)   # no slice left empty
        for p in plans:
            p.validate()
    assert {p.split_k for p in split_plans(256, 2560, 8200)} >= {2, 3, 4}
    assert split_plans(8192, 8192, 8192) == []          # thousands of tiles: nothing to gain
    assert split_plans(256, 2560, 1000) == []           # slices shorter than SPLIT_MIN_K


@pytest.mark.parametrize("k", [1, 8, 40, 64, 136, 200, 320, 448, 1000, 1544, 4104, 5000, 8192, 13208])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 6, 8])
def test_split_slices_cover_k_once_in_whole_blocks(k, splits):
    """Slices of whole 64-column blocks, consecutive, covering [0, K) once: each but the last ends on a block
    boundary inside K, the last holds 1 .. k_slice columns, and there are at most `splits` of them."""
    from fluxrt.gemm.plan import split_slices

    k_slice, count = split_slices(k, splits)
    assert k_slice % 64 == 0 and 1 <= count <= splits
    bounds = [(s * k_slice, min((s + 1) * k_slice, k)) for s in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == k
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(bounds, bounds[1:]))
    assert all(hi - lo == k_slice for lo, hi in bounds[:-1]) and 1 <= bounds[-1][1] - bounds[-1][0] <= k_slice
    # the kernel's per-band count of K blocks (KSlices::blocks) adds up to K's blocks
    assert sum(-(-(hi - lo) // 64) for lo, hi in bounds) == -(-k // 64)
    if k % (8 * splits) == 0 and (k // splits) % 64 == 0:   # K cuts evenly into whole blocks: equal slices
        assert (k_slice, count) == (k // splits, splits)


def test_split_slices_examples_and_checks():
    from fluxrt.gemm import GemmArgumentError
    from fluxrt.gemm.plan import split_slices
    from fluxrt.gemm.split_k import MAX_WORKSPACE_BYTES, check_split

    assert split_slices(13208, 2) == (6656, 2)     # 207 blocks: 104 + 103 (the last 6552 columns)
    assert split_slices(1000, 3) == (384, 3)       # 384 + 384 + 232
    assert split_slices(448, 4) == (128, 4)        # 7 blocks: 2 + 2 + 2 + 1
    assert split_slices(320, 4) == (128, 3)        # 5 blocks: 2 + 2 + 1, three slices
    assert split_slices(40, 2) == (64, 1)          # less than one block
    assert split_slices(1000, 3, 128) == (384, 3)  # 128-column blocks (fp8's block_k)
    with pytest.raises(ValueError):
        split_slices(0, 2)
    assert check_split(GemmPlan(block_n=128, stages=4, split_k=3), 100, 264, 1000) == (384, 3)
    assert check_split(GemmPlan(block_n=128, stages=4, split_k=4), 64, 128, 320) == (128, 3)
    with pytest.raises(GemmArgumentError, match="fp32 partials"):
        check_split(GemmPlan(block_n=128, stages=4, split_k=8), 8192, MAX_WORKSPACE_BYTES // (8 * 4 * 8192) + 8, 8192)


def test_split_plan_validation():
    with pytest.raises(ValueError, match="split_k"):
        GemmPlan(split_k=0).validate()
    with pytest.raises(ValueError, match="cluster=1"):
        GemmPlan(split_k=2, cluster=2).validate()
    assert "k4" in GemmPlan(block_n=128, stages=4, split_k=4).describe()


def test_split_defines_only_when_split():
    from fluxrt.gemm import kernel_defines

    plain = dict(kernel_defines(GemmPlan(), "bfloat16", "bfloat16", True))
    assert "FLUXRT_GEMM_SPLIT_K" not in plain
    split = dict(kernel_defines(GemmPlan(block_n=128, stages=4, split_k=2), "bfloat16", "float32", True, bands=2))
    assert split["FLUXRT_GEMM_SPLIT_K"] == "1" and split["FLUXRT_GEMM_OUT"] == "2"


@pytest.mark.parametrize("trans_b", [False, True])
def test_split_k_kernels_compile(trans_b, tmp_path, monkeypatch):
    from fluxrt.gemm import compile_options, kernel_defines
    from fluxrt.toolchain import CompileOptions, compile_cubin

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan = GemmPlan(block_m=64, consumers=1, block_n=192, stages=5, split_k=2)
    path = compile_cubin("gemm/hopper_gemm.cu", compile_options(kernel_defines(plan, "bfloat16", "float32", trans_b,
                                                                               bands=2), arch="sm_90a"))
    assert b"fluxrt_gemm" in path.read_bytes()
    for out in (0, 1, 2):
        red = compile_cubin("gemm/splitk_reduce.cu", CompileOptions(arch="sm_90a", defines=(("FLUXRT_SPLITK_OUT", str(out)),)))
        assert b"fluxrt_splitk_reduce" in red.read_bytes()


def test_every_candidate_of_a_tuning_compiles(tmp_path, monkeypatch):
    """build_candidates compiles what autotune will time (split-K as fp32 partials into banded C, stream-K,
    fitted widths, deep rings), and a later plain call finds each kernel in the cache."""
    from fluxrt import toolchain
    from fluxrt.gemm.kernel import KERNEL_SOURCE, compile_options, plain_defines

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(toolchain, "_resolve_arch", lambda options: options.arch or "sm_90a")
    problems = [(256, 7168, 8192, "bfloat16", "bfloat16", True), (461, 9128, 13208, "float16", "float16", False)]
    plans = {(p, pr[3], pr[5]) for pr in problems
             for p in tuning.candidates(pr[0], pr[1], pr[2], pr[4], trans_b=pr[5])}
    assert any(p.split_k > 1 for p, _, _ in plans) and any(p.stream_k for p, _, _ in plans)
    assert any(p.fitted_n for p, _, _ in plans)
    n, failed = tuning.build_candidates(problems, jobs=2)
    assert failed == 0 and n == len(list(tmp_path.glob("hopper_gemm-*.cubin")))
    for plan, dt, trans_b in plans:
        cubin = toolchain.compile_cubin(KERNEL_SOURCE, compile_options(plain_defines(plan, dt, dt, trans_b)))
        assert cubin.parent == tmp_path and b"fluxrt_gemm" in cubin.read_bytes()
    assert n == len(list(tmp_path.glob("hopper_gemm-*.cubin")))   # nothing compiled twice


def test_partial_wave_split_plans_fill_ragged_waves():
    """The autotuner's wider split-K set: slices only where a few waves of tiles leave the last one mostly idle,
    each fills the waves better than the unsplit tiles, and the heuristic's own set stays a subset."""
    import math

    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.plan import H100_H200_SMS as SMS
    from fluxrt.gemm.plan import SPLIT_WAVES_MAX, _wave_fill, split_plans, split_slices

    m, n, k = 256, 9216, 7168     # 64x192 tiles: 192 of them, 1.45 waves
    narrow, wide = split_plans(m, n, k), split_plans(m, n, k, partial_waves=True)
    assert set(narrow) < set(wide)
    assert set(wide) <= set(candidates(m, n, k))
    for p in set(wide) - set(narrow):
        tiles = math.ceil(m / p.block_m) * math.ceil(n / p.block_n)
        assert tiles >= SMS and _wave_fill(p.split_k * tiles, SMS) > _wave_fill(tiles, SMS)
        assert p.split_k * tiles <= SPLIT_WAVES_MAX * SMS and split_slices(k, p.split_k)[1] == p.split_k
    assert 3 in {p.split_k for p in wide}    # 7168 / 3 is not a whole number of 16-byte pieces: whole blocks
    assert split_plans(8192, 8192, 8192, partial_waves=True) == []   # 2048 tiles of 128x256: many waves
    # 461x9128x13208 (K % 16 == 8; 1.09 waves of 128x256 tiles): no slice count divides K, split plans anyway
    wide = split_plans(461, 9128, 13208, partial_waves=True)
    assert wide and set(wide) <= set(candidates(461, 9128, 13208))


# --- stream-K ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tiles,k_blocks,ctas", [(72, 112, 132), (216, 202, 132), (450, 195, 132), (144, 207, 132),
                                                 (5, 1, 132), (3, 7, 8), (264, 50, 132), (133, 3, 132), (56, 128, 132),
                                                 (9, 47, 132), (64, 16, 8), (3, 3, 5)])
def test_stream_k_units_cover_every_k_block_once_and_wait_only_backward(tiles, k_blocks, ctas):
    """The kernel's units (host mirror) with the planner's cut: every (tile, K block) once; whole waves of whole
    tiles first; a cut tile's pieces have piece_blocks blocks (the last fewer, none empty), and its last piece (the
    finisher, which waits for the others) has the largest unit index of them, so every wait points to units of
    smaller index (a CTA runs its units in increasing index: no cycle of waits)."""
    from fluxrt.gemm.plan import stream_k_geometry
    from fluxrt.gemm.stream_k import units

    dp, pieces, pb = stream_k_geometry(tiles, k_blocks, ctas)
    assert dp % ctas == 0 and 0 <= dp <= tiles and tiles - dp < 2 * ctas
    assert pieces >= 1 and (pieces - 1) * pb < k_blocks <= pieces * pb
    per_cta = units(tiles, k_blocks, ctas, dp, pieces, pb)
    seen = {}
    index = {}   # (tile, piece) -> unit index (round robin after the whole tiles)
    cut = tiles - dp
    for b, us in enumerate(per_cta):
        for t, kb0, n in us:
            assert n >= 1 and kb0 + n <= k_blocks
            for kb in range(kb0, kb0 + n):
                assert (t, kb) not in seen
                seen[(t, kb)] = b
            if t >= dp:
                u = kb0 // pb * cut + (t - dp)
                assert u % ctas == b
                index[(t, kb0 // pb)] = u
    assert len(seen) == tiles * k_blocks
    for t in range(dp, tiles):
        last = index[(t, pieces - 1)]
        assert all(index[(t, j)] < last for j in range(pieces - 1))


def test_stream_k_geometry_fills_waves():
    from fluxrt.gemm.plan import stream_k_geometry

    assert stream_k_geometry(2048, 128, 132)[1] > 1              # 15.5 waves: the last one cut
    assert stream_k_geometry(264, 128, 132) == (264, 1, 128)     # whole waves: nothing to cut
    dp, pieces, pb = stream_k_geometry(56, 128, 132)             # 256x7168x8192 at 128x256: 56 tiles
    assert dp == 0 and pieces == 2 and pb == 64                  # 112 units in one wave
    dp, pieces, pb = stream_k_geometry(144, 207, 132)            # 461x9128x13208: 12 tiles past one wave
    assert dp == 132 and 12 * pieces <= 132 and pieces > 1
    assert stream_k_geometry(5, 1, 132)[1] == 1                  # one K block: nothing to cut


def test_stream_k_plan_validation_defines_and_grid():
    from fluxrt.gemm import kernel_defines

    with pytest.raises(ValueError, match="stream_k"):
        GemmPlan(stream_k=True, split_k=2).validate()
    with pytest.raises(ValueError, match="stream_k"):
        GemmPlan(stream_k=True, cluster_n=2).validate()
    with pytest.raises(ValueError, match="stream_k"):
        GemmPlan(stream_k=True, epilogue="direct").validate()
    pair = GemmPlan(stream_k=True, cluster=2).validate()
    assert pair.describe().endswith(" x2 sk") and pair.grid(128, 256, 132) == 132   # one item, cut over every pair
    assert pair.grid(128, 256, 132, max_clusters=40) == 80
    sk = GemmPlan(stream_k=True)
    assert sk.describe().endswith(" sk")
    assert dict(kernel_defines(sk, "bfloat16", "bfloat16", True))["FLUXRT_GEMM_STREAM_K"] == "1"
    assert "FLUXRT_GEMM_STREAM_K" not in dict(kernel_defines(GemmPlan(), "bfloat16", "bfloat16", True))
    # the K blocks are cut over every SM, however few the tiles
    assert sk.grid(256, 9216, 132) == 132 and GemmPlan().grid(256, 9216, 132) == 72
    assert GemmPlan(stream_k=True, max_ctas=100).grid(256, 9216, 132) == 100


def test_stream_k_workspace_sizes():
    from fluxrt.gemm.plan import stream_k_geometry
    from fluxrt.gemm.stream_k import MAX_CTAS, counter_bytes, geometry, partial_bytes, workspace_bytes

    plan = GemmPlan(stream_k=True)
    # counters of any call (< 2 x MAX_CTAS cut tiles, 2 warpgroups each) first, then one fp32 tile per piece of a
    # cut tile but its last
    assert counter_bytes() == 2 * MAX_CTAS * 2 * 8 and counter_bytes() % 16 == 0   # the partials' float4 alignment
    assert geometry(plan, 256, 7168, 8192, 132) == (0, 2, 64)
    assert partial_bytes(plan, 256, 7168, 8192, 132) == 56 * 1 * 128 * 256 * 4
    assert workspace_bytes(plan, 256, 7168, 8192, 132) == counter_bytes() + 56 * 128 * 256 * 4
    assert partial_bytes(plan, 256, 256, 40, 132) == 0   # one K block: nothing cut
    # a cluster of 2 along M: the items are pairs of M tiles (3 M tiles: 2 pairs, one with a phantom) on 66
    # clusters; each cut item has a partial tile per CTA of its pair
    pair = GemmPlan(stream_k=True, cluster=2)
    assert geometry(pair, 384, 4096, 8192, 132) == stream_k_geometry(2 * 16, 128, 66, 2 * 128 * 256 * 4)
    dp, pieces, _ = geometry(pair, 384, 4096, 8192, 132)
    assert dp == 0 and pieces == 2                       # 32 items: 64 units on 66 pairs
    assert partial_bytes(pair, 384, 4096, 8192, 132) == 32 * 2 * 1 * 128 * 256 * 4


def test_stream_k_plans_where_waves_are_partial():
    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.plan import H100_H200_SMS as SMS
    from fluxrt.gemm.plan import (STREAM_K_MAX_FILL, STREAM_K_MIN_K, STREAM_K_TUNE_MAX_FILL, _wave_fill,
                                  stream_k_plans)

    for m, n, k in [(256, 9216, 7168), (9166, 664, 12896), (461, 9128, 13208)]:
        plans = stream_k_plans(m, n, k)
        assert plans and set(plans) <= set(candidates(m, n, k))
        for p in plans:
            p.validate()
            tiles = math.ceil(m / p.block_m) * math.ceil(n / p.block_n)
            assert p.stream_k and p.split_k == 1 and p.cluster == 1 and _wave_fill(tiles, SMS) < STREAM_K_MAX_FILL
        # the autotuner also times pairs of M tiles sharing B (where M has two tile rows), by the pairs' waves
        pairs = [p for p in stream_k_plans(m, n, k, every_shape=True) if p.cluster == 2]
        assert pairs and set(pairs) <= set(candidates(m, n, k))
        for p in pairs:
            items = math.ceil(math.ceil(m / p.block_m) / 2) * math.ceil(n / p.block_n)
            assert p.validate().cluster_n == 1 and _wave_fill(items, SMS // 2) < STREAM_K_TUNE_MAX_FILL
    # 7179 x 10480: 29 x 41 pairs of 128x256 tiles = 1189 items, 18 waves of 66 pairs and one more item (fill
    # 0.948): stream-K for the autotuner only, also with the deeper ring of shared C staging
    tune = [p for p in candidates(7179, 10480, 8024, trans_b=True) if p.stream_k and p.cluster == 2]
    assert GemmPlan(stages=3, cluster=2, group_m=16, stream_k=True) in tune
    assert GemmPlan(stages=4, cluster=2, group_m=16, stream_k=True, c_staging="shared") in tune
    assert not [p for p in stream_k_plans(7179, 10480, 8024) if p.cluster == 2]   # pairs: autotuner only
    # 128x192 pairs fill 24.2 waves (0.966): between the two fills only the STREAM_K_TUNE_TILE tile
    assert not [p for p in tune if p.block_n == 192]
    # 8192^3 with 128x256 tiles: 2048 tiles fill 0.970 of 16 waves: the autotuner's set only
    assert GemmPlan(stages=3, group_m=16, stream_k=True) in stream_k_plans(8192, 8192, 8192, every_shape=True)
    assert not [p for p in stream_k_plans(100, 9216, 8192, every_shape=True) if p.cluster == 2]   # one tile row
    assert all(p.block_n != 256 or p.block_m != 128 for p in stream_k_plans(8192, 8192, 8192))   # 2048 tiles: 97 %
    assert stream_k_plans(256, 9216, STREAM_K_MIN_K - 64) == []


def test_heuristic_stream_k_tiles_and_the_autotuner_set():
    """The heuristic considers stream-K only with tiles of at least STREAM_K_MIN_TILE; the autotuner times every
    shape; the heuristic without stream-K (stream_k=False) never returns one."""
    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.plan import STREAM_K_MIN_TILE, stream_k_plans

    m, n, k = 256, 1280, 8192
    narrow, every = stream_k_plans(m, n, k), stream_k_plans(m, n, k, every_shape=True)
    assert all((p.block_m, p.block_n) >= STREAM_K_MIN_TILE for p in narrow) and set(narrow) < set(every)
    assert set(every) <= set(candidates(m, n, k))
    assert heuristic_plan(461, 9128, 13208, trans_b=False).stream_k
    assert not heuristic_plan(461, 9128, 13208, trans_b=False, stream_k=False).stream_k


# --- choosing among timed candidates ---------------------------------------------------------------------

class _Scripted:
    """A stand-in for one candidate's graph replay: returns its scripted times in turn (the selection logic is
    plain Python; the GPU test times real graphs)."""

    def __init__(self, plan, times):
        self.plan, self._times, self.calls = plan, list(times), 0

    def us(self):
        self.calls += 1
        return self._times[(self.calls - 1) % len(self._times)]


def _plans(n):
    return [GemmPlan(block_n=bn, stages=s) for bn, s in [(256, 3), (192, 4), (128, 6), (64, 6), (128, 5)][:n]]


def test_pick_confirms_finalists_and_keeps_the_lowest_median():
    p = _plans(4)
    a = _Scripted(p[0], [10.0, 10.0, 13.0])        # screen's best, but median 10.0
    b = _Scripted(p[1], [9.5, 9.6, 30.0])          # one slow replay, median 9.6: the winner
    c = _Scripted(p[2], [11.0])                    # outside the 5 % band: never re-timed
    d = _Scripted(p[3], [10.3])
    screen = [(a, 9.9), (b, 10.2), (c, 11.0), (d, 10.3)]
    win, us, med = tuning._pick(screen, default_plan=None, confirm_rounds=3)
    assert win is b and us == pytest.approx(9.6)
    assert c.calls == 0 and a.calls == b.calls == d.calls == 3
    assert set(med) == {id(a), id(b), id(d)}


def test_pick_keeps_the_heuristic_plan_on_a_near_tie_and_always_confirms_it():
    p = _plans(3)
    fast = _Scripted(p[0], [10.0])
    heur = _Scripted(p[1], [10.05])                # 0.5 % slower: inside HEURISTIC_TIE
    far = _Scripted(p[2], [10.5])
    win, us, _ = tuning._pick([(fast, 10.0), (heur, 12.0), (far, 10.5)], default_plan=p[1], confirm_rounds=5)
    assert heur.calls == 5 and win is heur and us == pytest.approx(10.05)   # 12.0 on the screen: confirmed anyway
    slow = _Scripted(p[1], [10.0 * (1 + 2 * tuning.HEURISTIC_TIE)])
    fast2 = _Scripted(p[0], [10.0])
    win, _, _ = tuning._pick([(fast2, 10.0), (slow, 10.2)], default_plan=p[1], confirm_rounds=3)
    assert win is fast2


def test_pick_takes_the_screen_alone_when_nothing_is_close():
    p = _plans(3)
    only = _Scripted(p[0], [1.0])
    win, us, med = tuning._pick([(only, 5.0), (_Scripted(p[1], [9.0]), 9.0)], default_plan=p[0], confirm_rounds=7)
    assert win is only and us == 5.0 and med == {} and only.calls == 0
    cap = [(_Scripted(GemmPlan(block_n=64 + 8 * i, stages=4), [10.0 + i / 100]), 10.0 + i / 100) for i in range(9)]
    win, _, med = tuning._pick(cap, default_plan=None, confirm_rounds=2)
    assert len(med) == tuning.MAX_FINALISTS and win is cap[0][0]


def test_pick_without_confirmation_still_keeps_the_heuristic_plan_on_a_near_tie():
    p = _plans(3)
    fast, heur, far = _Scripted(p[0], [1.0]), _Scripted(p[1], [1.0]), _Scripted(p[2], [1.0])
    tie = 10.0 * (1 + tuning.HEURISTIC_TIE / 2)
    win, us, med = tuning._pick([(fast, 10.0), (heur, tie), (far, 10.2)], default_plan=p[1], confirm_rounds=0)
    assert win is heur and us == tie and med == {} and fast.calls == heur.calls == 0
    clear = 10.0 * (1 + 2 * tuning.HEURISTIC_TIE)
    win, us, _ = tuning._pick([(fast, 10.0), (heur, clear)], default_plan=p[1], confirm_rounds=0)
    assert win is fast and us == 10.0


def test_band_variants_are_the_other_orders_of_a_whole_tile_plan_of_two_waves_or_more():
    base = GemmPlan(stages=4, group_m=16)
    # 7179 x 10480: 57 x 41 tiles; every other height of ORDER_BANDS is another order
    got = tuning.band_variants(base, 7179, 10480, 132)
    assert [p.group_m for p in got] == [g for g in tuning.ORDER_BANDS if g != 16]
    assert all(dataclasses.replace(p, group_m=16) == base for p in got)
    # 20 tile rows: a band of 32 covers them all, the same order as 20, so 32 is not another order
    assert [p.group_m for p in tuning.band_variants(GemmPlan(stages=4, group_m=20), 2560, 10480, 132)] == [4, 8, 16]
    # a cluster of 2 along M: a band is group_m // 2 slot rows, 1 at least (g 4 -> 2 slot rows, g 2 -> 1)
    pair = GemmPlan(stages=4, cluster=2, group_m=2)
    assert [p.group_m for p in tuning.band_variants(pair, 7179, 10480, 132)] == [4, 8, 16, 32]
    assert [p.group_m for p in tuning.band_variants(dataclasses.replace(pair, group_m=8), 7179, 10480, 132)] == \
        [4, 16, 32]
    # waves: 16 x 16 tiles = 256 < 2 x 132 (nothing); 16 x 17 = 272 (bands of 16 and 32 are both all 16 rows)
    assert tuning.band_variants(GemmPlan(stages=4, group_m=16), 2048, 4096, 132) == []
    assert [p.group_m for p in tuning.band_variants(GemmPlan(stages=4, group_m=16), 2048, 4352, 132)] == [4, 8]
    # pairs: 8 slot rows x 17 = 136 items >= 2 x 66 clusters; bands of 16 and 32 tile rows are both all 8 slot rows
    assert [p.group_m for p in tuning.band_variants(pair, 2048, 4352, 132)] == [4, 8, 16]
    assert tuning.band_variants(pair, 2048, 3840, 132) == []   # 8 x 15 = 120 items
    # 2 x 2 clusters: 29 x 21 slots = 609 items on 33 clusters; 8 x 8 = 64 < 66
    quad = GemmPlan(stages=4, cluster=2, cluster_n=2, group_m=16)
    assert [p.group_m for p in tuning.band_variants(quad, 7179, 10480, 132)] == [4, 8, 32]
    assert tuning.band_variants(quad, 2048, 4096, 132) == []
    # one slot column: every band height walks the rows in the same order
    assert tuning.band_variants(GemmPlan(block_n=128, stages=6), 65536, 128, 132) == []
    for other in (dataclasses.replace(base, stream_k=True), dataclasses.replace(base, order="hilbert"),
                  GemmPlan(block_m=64, consumers=1, block_n=128, stages=6, split_k=2)):
        assert tuning.band_variants(other, 7179, 10480, 132) == []


def test_refine_bands_replaces_the_winner_only_past_the_tie():
    p = _plans(1)[0]
    win = _Scripted(p, [10.0, 10.0, 10.0])
    near = _Scripted(dataclasses.replace(p, group_m=8), [10.0 * (1 - tuning.BAND_TIE / 2)])
    kept, us, med, dropped = tuning._refine_bands(win, [near], 3)
    assert kept is win and us == 10.0 and med == {id(win): 10.0, id(near): pytest.approx(9.95)} and dropped == []
    assert win.calls == near.calls == 3
    old = _Scripted(p, [10.0])
    fast = _Scripted(dataclasses.replace(p, group_m=4), [9.0, 9.2, 30.0])   # one slow replay: median 9.2
    kept, us, med, _ = tuning._refine_bands(old, [near, fast], 3)
    assert kept is fast and us == pytest.approx(9.2) and set(med) == {id(old), id(near), id(fast)}


class _Failing(_Scripted):
    """Replays at 1.0 us once, then raises (a launch that fails on a later replay)."""

    def us(self):
        self.calls += 1
        if self.calls >= 2:
            raise RuntimeError("launch failed")
        return 1.0


def test_refine_bands_drops_a_variant_that_fails_and_fails_with_the_winner():
    p = _plans(1)[0]
    win, bad = _Scripted(p, [10.0]), _Failing(dataclasses.replace(p, group_m=8), [])
    kept, us, med, dropped = tuning._refine_bands(win, [bad], 3)   # 1.0 in the first round, then it raises
    assert kept is win and us == 10.0 and dropped == [bad] and set(med) == {id(win)} and win.calls == 3
    with pytest.raises(RuntimeError, match="launch failed"):
        tuning._refine_bands(_Failing(p, []), [_Scripted(dataclasses.replace(p, group_m=8), [1.0])], 3)


def test_release_workspaces_drops_one_streams_buffers_only(monkeypatch):
    from fluxrt.gemm import split_k

    table = {(0, 111): ["partials"], (0, 111, True): ["counters"], (0, 222): ["other stream"],
             (1, 111): ["other device"]}
    monkeypatch.setattr(split_k, "_workspaces", dict(table))
    split_k.release_workspaces(0, 111)
    assert split_k._workspaces == {(0, 222): ["other stream"], (1, 111): ["other device"]}
    split_k.release_workspaces(0, 111)   # nothing left to drop: no error
    assert len(split_k._workspaces) == 2
    monkeypatch.setattr(split_k, "_workspaces", dict(table))
    split_k.release_workspaces(0, 111, zeroed_only=True)   # a stream-K timeout: the counters alone
    assert (0, 111, True) not in split_k._workspaces and split_k._workspaces[(0, 111)] == ["partials"]


def test_fitted_width_plans_for_b_as_n_by_k():
    # 256 rows, B [N, K]: 128x128 tiles make 2 x 72 = 144 tiles (a second wave of 12); 144-wide tiles make 128
    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.plan import FIT_WIDTHS, fitted_plans

    p = heuristic_plan(256, 9216, 7168, trans_b=True)
    assert p.fitted_n and p.block_n == 144 and p.epilogue == "tma"
    assert math.prod(p.tiles(256, 9216)) <= 132
    assert p in candidates(256, 9216, 7168, trans_b=True)
    assert not heuristic_plan(256, 9216, 7168, trans_b=False).fitted_n          # B [K, N]: the autotuner's only
    kn = [c for c in candidates(256, 9216, 7168) if c.fitted_n]                   # trans_b=False: whole 64-column
    assert {c.block_n for c in kn if not c.stream_k} == set(FIT_WIDTHS)          # slabs of B, so rings of their own
    for c in kn:
        assert c.smem_bytes("bfloat16", b_kmajor=False) <= SMEM_LIMIT_BYTES
        assert c.validate("bfloat16", b_kmajor=False) is c
    p144 = GemmPlan(block_n=144, stages=5)   # 144 columns of B as [N, K], 192 as [K, N]
    assert p144.smem_bytes(b_kmajor=False) - p144.smem_bytes() == 5 * 48 * 128
    assert not heuristic_plan(8192, 8192, 8200, trans_b=True).fitted_n          # B's rows off the 32-byte sectors
    assert not heuristic_plan(461, 9128, 13208, trans_b=True).fitted_n          # B's rows off the 32-byte sectors
    fits = fitted_plans(4096, "float32")
    assert [f.block_n for f in fits] == list(FIT_WIDTHS) and all(f.fitted_n for f in fits)
    for f in fits:
        assert f.validate("float32").stages >= 2


def test_decomposed_pieces_beside_a_collective_cap_stream_k_pairs():
    """A tuned stream-K pair plan beside a collective leaves the collective's SMs free as a one-CTA plan does (its
    fixups wait for pieces of clusters the collective would delay); a plain cluster plan keeps its grid."""
    from fluxrt.ops.decomposed import DecomposedState

    st = object.__new__(DecomposedState)
    st.num_sms, st.comm_sms = 132, 16
    pair = GemmPlan(stream_k=True, cluster=2)
    capped = st._cap(pair, True)
    assert capped.max_ctas == 116 and capped.grid(4096, 4096, 132, max_clusters=66) == 116
    assert st._cap(pair, False).max_ctas is None
    assert st._cap(GemmPlan(cluster=2), True).max_ctas is None
    assert st._cap(GemmPlan(), True).max_ctas == 116


def test_tile_rate_interpolates_between_neighbours_and_refuses_outside_the_table():
    """Widths between two of TILE_RATE's (same rows, same cluster) get the linear rate between them; widths
    outside the table's range for their cluster are refused (ValueError, not a KeyError), in the stream-K cost
    too, which costs pair plans at their cluster-2 rate."""
    from fluxrt.gemm.plan import stream_k_cost, tile_rate

    lo, hi = TILE_RATE[(128, 128, 2)], TILE_RATE[(128, 192, 2)]
    assert tile_rate(128, 160, 2) == pytest.approx((lo + hi) / 2)
    assert tile_rate(64, 160, 1) == pytest.approx((TILE_RATE[(64, 128, 1)] + TILE_RATE[(64, 192, 1)]) / 2)
    assert tile_rate(128, 144, 1) == P.FIT_RATE[144]
    for bm, bn, cluster in ((128, 64, 2), (64, 128, 2), (128, 96, 2)):
        with pytest.raises(ValueError, match=f"{bm}x{bn} tiles in clusters of {cluster}"):
            tile_rate(bm, bn, cluster)
        with pytest.raises(ValueError, match="autotune candidates only"):
            stream_k_cost(4096, 4096, 8192, bm, bn, cluster=cluster)
    pair = stream_k_cost(4096, 4096, 8192, 128, 160, cluster=2)
    assert stream_k_cost(4096, 4096, 8192, 128, 128, cluster=2) > pair > 0


def test_stream_k_pairs_need_the_resident_cluster_count(monkeypatch):
    """A stream-K pair plan whose resident-cluster count the driver cannot give is refused before any launch
    (its finishers would wait for clusters that never run); a plain cluster plan falls back to every SM pairing
    up, with a warning."""
    drv = pytest.importorskip("cuda.bindings.driver", reason="cuda-python's driver bindings are not installed")
    from fluxrt.errors import GemmArgumentError
    from fluxrt.gemm import kernel as K

    fail = drv.CUresult.CUDA_ERROR_NOT_SUPPORTED
    monkeypatch.setattr(drv, "cuOccupancyMaxActiveClusters", lambda func, cfg: (fail, 0))
    monkeypatch.setattr(drv, "CUfunction", lambda ptr: ptr)
    monkeypatch.setattr(K, "_num_sms", lambda dev: 132)
    monkeypatch.setattr(K, "_cluster_caps", {})

    class Kern:   # what _max_clusters reads of a loaded kernel: its function handle
        class kernel:
            ptr = 1234

    with pytest.raises(GemmArgumentError, match="cuOccupancyMaxActiveClusters failed"):
        K._max_clusters(Kern, GemmPlan(stream_k=True, cluster=2), 200_000, 0)
    assert K._max_clusters(Kern, GemmPlan(cluster=2), 200_000, 0) is None
    assert GemmPlan(cluster=2).grid(8192, 8192, 132, None) == 132
    ok = drv.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(drv, "cuOccupancyMaxActiveClusters", lambda func, cfg: (ok, 60))
    monkeypatch.setattr(K, "_cluster_caps", {})
    assert K._max_clusters(Kern, GemmPlan(stream_k=True, cluster=2), 200_000, 0) == 60
    assert GemmPlan(stream_k=True, cluster=2).grid(8192, 8192, 132, 60) == 120


def test_plan_descriptions_parse_back_to_their_plans():
    """GemmPlan.parse inverts describe on every plan the autotuner times (tile shapes, fitted widths, rings, shared
    staging, clusters along M and N, split-K, stream-K) and on the other order and epilogue; other text is refused."""
    from fluxrt.gemm.autotune import candidates

    plans = set()
    for m, n, k, trans_b in ((8192, 8192, 8192, True), (461, 9128, 13208, True), (1024, 1024, 6144, False),
                             (256, 4096, 6144, True), (4096, 1280, 8192, False)):
        plans.update(candidates(m, n, k, "bfloat16", trans_b=trans_b))
    plans.update({GemmPlan(order="hilbert", epilogue="direct", stages=4), GemmPlan(cluster_n=2, block_n=64, stages=8),
                  GemmPlan(block_n=128, stages=6, c_staging="shared", cluster=2, pingpong=True)})
    assert len(plans) > 40
    assert {p.split_k > 1 for p in plans} == {True, False} and any(p.stream_k for p in plans)
    assert any(p.fitted_n for p in plans) and any(p.cluster_n == 2 for p in plans)
    for p in plans:
        assert GemmPlan.parse(p.describe()) == dataclasses.replace(p, m_tile_offset=0, max_ctas=None), p.describe()
    assert GemmPlan.parse("128x128x128 s5 grouped/g16 epi=tma x1 pp").pingpong
    for bad in ("128x256 s3", "128x256x64 s3 grouped/g16 epi=tma x1 k2 sk", "128x256x64 s3 grouped/g16 epi=tma x1 ppp",
                "big", ""):
        with pytest.raises(ValueError, match="not a GemmPlan description"):
            GemmPlan.parse(bad)


def test_pingpong_plans_validate_and_size_their_staging():
    """Ping-pong plans: a whole tile of C staging per consumer (or one shared region), two barrier pairs, the
    FLUXRT_GEMM_PINGPONG macro only where on (other configurations keep their macros), and the refusals."""
    from fluxrt.gemm.kernel import kernel_defines
    from fluxrt.gemm.plan import max_stages

    pp = GemmPlan(block_n=128, stages=5, pingpong=True).validate("bfloat16")
    coop = GemmPlan(block_n=128, stages=5)
    assert pp.c_turns == 2 and coop.c_turns == 1
    assert pp.c_staging_bytes("bfloat16") == 2 * 128 * 2 * 128 == 2 * coop.c_staging_bytes("bfloat16")
    shared = GemmPlan(block_n=128, stages=6, c_staging="shared", pingpong=True)
    assert shared.c_staging_bytes("bfloat16") == 128 * 2 * 128
    assert shared.smem_bytes("bfloat16") == 6 * 256 * 128 + 128 * 256 + 8 * (2 * 6 + 2 * 2) + 1024
    d = dict(kernel_defines(pp, "bfloat16", "bfloat16", True))
    assert d["FLUXRT_GEMM_PINGPONG"] == "1" and d["FLUXRT_GEMM_C_SHARED"] == "0"
    assert dict(kernel_defines(shared, "bfloat16", "bfloat16", True))["FLUXRT_GEMM_C_SHARED"] == "1"
    assert "FLUXRT_GEMM_PINGPONG" not in dict(kernel_defines(coop, "bfloat16", "bfloat16", True))
    assert max_stages(128, 128, "bfloat16", pingpong=True) == 5 < max_stages(128, 128, "bfloat16")
    for bad in (dict(block_n=256), dict(block_n=208), dict(consumers=1, block_m=64), dict(stream_k=True),
                dict(split_k=2), dict(epilogue="direct"), dict(cluster_n=2)):
        with pytest.raises(ValueError, match="pingpong"):
            dataclasses.replace(GemmPlan(block_n=128, stages=4, pingpong=True), **bad).validate("bfloat16")


def test_tall_tile_plans():
    """256-row tiles: two consumers of two 64-row wgmma blocks; staging, smem and defines follow; the restrictions raise
    before any launch; the autotuner's candidates only where M has more than 256 rows."""
    from fluxrt.gemm.autotune import candidates
    from fluxrt.gemm.kernel import kernel_defines
    from fluxrt.gemm.plan import TALL_WIDTHS, tall_plans

    p = GemmPlan(block_m=256, block_n=128, stages=4, c_staging="shared").validate("bfloat16")
    assert (p.consumers, p.row_blocks, p.threads) == (2, 2, 384)
    assert GemmPlan.parse(p.describe()) == p and p.describe().startswith("256x128x64 s4")
    assert p.c_staging_bytes("bfloat16") == 128 * 2 * 128              # one region: 128 rows x 2 slabs of 128 B
    assert dataclasses.replace(p, c_staging="per_consumer").c_staging_bytes("bfloat16") == 2 * 128 * 2 * 128
    assert p.stage_bytes() == (256 + 128) * 128
    assert p.smem_bytes() <= SMEM_LIMIT_BYTES < dataclasses.replace(p, stages=5).smem_bytes()
    assert dict(kernel_defines(p, "bfloat16", "bfloat16", True))["FLUXRT_GEMM_ROW_BLOCKS"] == "2"
    assert "FLUXRT_GEMM_ROW_BLOCKS" not in dict(kernel_defines(GemmPlan(), "bfloat16", "bfloat16", True))
    assert GemmPlan(block_n=128, pingpong=True).row_blocks == 1 and GemmPlan().row_blocks == 1
    for bad in (dict(block_n=256), dict(pingpong=True), dict(split_k=2),
                dict(block_k=128), dict(block_n=192, stream_k=True)):
        with pytest.raises(ValueError, match="block_m=256"):
            dataclasses.replace(GemmPlan(block_m=256, block_n=128, stages=2), **bad).validate("bfloat16")
    # in clusters along N (A multicast), also of a fitted width, not in stream-K form
    assert GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared", cluster=2, cluster_n=2).validate()
    assert GemmPlan(block_n=144, stages=4, c_staging="shared", cluster_n=2).validate()
    with pytest.raises(ValueError, match="cluster_n=1"):
        GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared", cluster_n=2, stream_k=True).validate()
    with pytest.raises(ValueError, match="block_m"):
        GemmPlan(block_m=256, consumers=1, block_n=128, stages=2).validate("bfloat16")
    assert GemmPlan(block_m=256, block_n=176, stages=3, c_staging="shared", stream_k=True).validate("bfloat16")
    direct = GemmPlan(block_m=256, block_n=192, stages=4, epilogue="direct").validate("bfloat16")   # no C staging:
    assert direct.c_staging_bytes("bfloat16") == 0 and direct.smem_bytes() <= SMEM_LIMIT_BYTES      # a 4th stage

    assert tall_plans(256, 4096, 6144) == []
    few = tall_plans(461, 9128, 13208)           # 2 tile rows: pairs along M only in 2 x 2 clusters; stream-K forms
    assert {q.block_n for q in few} == set(TALL_WIDTHS)
    assert all(q.cluster_n == 2 and q.epilogue == "direct" for q in few if q.cluster == 2)
    assert {q.block_n for q in few if q.cluster == 2} == set(TALL_WIDTHS)
    # one tile column of a width: no pair along N, so no 2 x 2 either (N = 96: every width is one column)
    assert not any(q.cluster_n == 2 for q in tall_plans(461, 96, 13208))
    assert all(q.block_n <= 176 for q in few if q.stream_k) and any(q.stream_k for q in few)
    many = tall_plans(9166, 664, 12896)          # 36 tile rows: pairs too
    assert any(q.cluster == 2 for q in many)
    for kmajor, plans in ((True, few + many), (False, tall_plans(11603, 3408, 11800, b_kmajor=False))):
        for q in plans:   # each ring fits beside B's stage of its own layout
            assert q.block_m == 256 and q.row_blocks == 2 and q.stages >= 2
            assert q.validate("bfloat16", b_kmajor=kmajor) is q and q.validate("float16", b_kmajor=kmajor) is q
    assert set(many) <= set(candidates(9166, 664, 12896, trans_b=True))
    assert not any(c.block_m == 256 for c in candidates(256, 4096, 6144, trans_b=True))
    assert not any(q.block_m == 256 for q in P.plain_plans(9166))   # not in the cost model
    assert heuristic_plan(9166, 664, 12896, trans_b=True).block_m == 128
