"""MoE dispatcher without a GPU: argument checks, buffer sizing and the heap check, the kernel's constants,
and a numpy model of the layout kernel's arithmetic (chunked ranking, count matrix, destination rows) against
the grouping the GPU tests expect."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import fluxrt
from fluxrt import moe
from fluxrt.moe import dispatcher as dmod

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=6), "multiple of the 4 ranks"),
    (dict(num_experts=512), r"num_experts must be in \[1, 256\]"),
    (dict(hidden=100), "multiple of 8"),
    (dict(max_tokens_per_rank=0), "positive"),
    (dict(dtype="float32"), "bf16 or fp16"),
    (dict(dtype="no such type"), "not understood"),
    (dict(options=moe.DispatcherOptions(top_k=0)), "top_k"),
    (dict(options=moe.DispatcherOptions(threads=100)), "multiple of 32"),
    (dict(options=moe.DispatcherOptions(blocks=-1)), "blocks"),
    (dict(options=moe.DispatcherOptions(fp8="e5m2")), "fp8="),
    (dict(options=moe.DispatcherOptions(mode="fast")), "mode="),
    (dict(options=moe.DispatcherOptions(mode="low_latency", fp8="token")), "throughput' only"),
    (dict(options=moe.DispatcherOptions(mode="low_latency", arrivals=True)), "arrivals=True"),
    (dict(options=moe.DispatcherOptions(arrivals=1)), "arrivals must be a bool"),
    (dict(options=moe.DispatcherOptions(dedupe="yes")), "dedupe must be a bool"),
    (dict(options=moe.DispatcherOptions(returns=1)), "returns must be a bool"),
    (dict(options=moe.DispatcherOptions(mode="low_latency", returns=True)), "returns=True"),
    (dict(hidden=4104, options=moe.DispatcherOptions(fp8="block")), "multiple of 128"),
    (dict(hidden=4104, options=moe.DispatcherOptions(fp8="token")), "multiple of 16"),
])
def test_bad_configurations_are_named(kwargs, match):
    args = dict(world_size=4, num_experts=8, hidden=4096, max_tokens_per_rank=128, dtype="bf16") | kwargs
    with pytest.raises(moe.MoEArgumentError, match=match):
        moe.check_config(**args)


def test_receive_buffers_hold_the_worst_case():
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16")
    assert (cfg.local_experts, cfg.recv_rows, cfg.row_bytes) == (64, 4096 * 4 * 8, 14336)
    assert cfg.symmetric_bytes() == 4096 * 4 * 8 * 14336 + 4 * 256 * 4 + 3 * 4 * 8


def test_fp8_buffers_are_counted():
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16", moe.DispatcherOptions(fp8="block"))
    rows = 4096 * 4 * 8
    assert cfg.scale_row == 56 and cfg.symmetric_bytes() == rows * (14336 + 7168 + 56 * 4) + 4 * 256 * 4 + 96
    assert moe.check_config(2, 8, 4096, 128, "bf16", moe.DispatcherOptions(fp8="token")).scale_row == 1


def test_low_latency_staging_is_counted():
    cfg = moe.check_config(4, 256, 7168, 128, "bf16", moe.DispatcherOptions(mode="low_latency"))
    assert cfg.staging_rows == 256 * 128
    assert cfg.symmetric_bytes() == (128 * 4 * 8 + 256 * 128) * 14336 + 4 * 256 * 4 + 96


def test_heap_exhausted_names_the_size_to_ask_for():
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16")
    with pytest.raises(fluxrt.HeapExhaustedError, match=r"heap_size='3G'.*max_tokens_per_rank"):
        dmod.check_heap(cfg, capacity=1 << 30, used=0, rank=1)
    dmod.check_heap(cfg, capacity=4 << 30, used=0, rank=1)


def test_constructor_checks_before_any_allocation():
    world = SimpleNamespace(size=2, rank=0, options=SimpleNamespace(check_collective_args=False),
                            check_active=lambda: None, heap=SimpleNamespace(capacity=1 << 30, used=0))
    with pytest.raises(moe.MoEArgumentError, match="multiple of the 2 ranks"):
        moe.Dispatcher(world, num_experts=3, hidden=64, max_tokens_per_rank=8)


def test_arrival_flags_are_counted():
    plain = moe.check_config(4, 256, 7168, 4096, "bf16")
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16", moe.DispatcherOptions(arrivals=True))
    assert cfg.arrivals and cfg.symmetric_bytes() == plain.symmetric_bytes() + 64 * 4 * 8   # [E_local, world] u64


def test_dedupe_descriptors_are_counted():
    plain = moe.check_config(4, 256, 7168, 4096, "bf16")
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16", moe.DispatcherOptions(dedupe=True))
    assert cfg.dedupe and cfg.symmetric_bytes() == plain.symmetric_bytes() + 4 * cfg.recv_rows   # int32 per row
    ll = moe.check_config(4, 256, 7168, 128, "bf16", moe.DispatcherOptions(dedupe=True, mode="low_latency"))
    assert ll.descriptor_rows == ll.staging_rows
    fp8 = moe.check_config(4, 256, 7168, 4096, "bf16", moe.DispatcherOptions(fp8="block"))
    assert fp8.wire_row_bytes == 7168 + 4 * 56 and plain.wire_row_bytes == 2 * 7168


def test_returns_are_counted():
    """Home descriptors (int32 per receive row), the return buffer (a row per (token, slot) of this rank) and
    the landed counters (u64 per owner) are symmetric; the heap check asks for them."""
    plain = moe.check_config(4, 256, 7168, 4096, "bf16")
    cfg = moe.check_config(4, 256, 7168, 4096, "bf16", moe.DispatcherOptions(returns=True))
    assert cfg.returns and cfg.return_rows == 4096 * 8 and plain.return_rows == 0 == plain.returns_bytes
    assert cfg.symmetric_bytes() == plain.symmetric_bytes() + 4 * cfg.recv_rows + 4096 * 8 * 14336 + 4 * 8
    with pytest.raises(fluxrt.HeapExhaustedError, match="heap_size='3G'"):
        dmod.check_heap(cfg, capacity=2 << 30, used=0, rank=0)
    dmod.check_heap(cfg, capacity=4 << 30, used=0, rank=0)


def test_kernel_constants_match_the_host():
    src = (ROOT / "kernels/moe/dispatch.cu").read_text()
    consts = dict(re.findall(r"\b(k\w+) = (\d+)[;,]", src))
    assert int(consts["kMaxExperts"]) == moe.MAX_EXPERTS
    assert int(consts["kMaxTopK"]) == moe.MAX_TOP_K
    assert int(consts["kChunks"]) == dmod.CHUNKS == dmod.LAYOUT_THREADS // 32
    assert [int(consts[k]) for k in ("kNotify", "kData", "kReady")] == list(range(dmod.FLAG_KINDS))


# --- a numpy model of fluxrt_moe_layout and fluxrt_moe_push's row arithmetic ------------------------------
def _model_rows(idxs, num_experts, world):
    """For every rank s: the destination row of each of its entries (-1: masked), as the kernels compute it."""
    el = num_experts // world
    chunk_base, totals, pos = [], [], []
    for idx in idxs:
        flat = idx.reshape(-1)
        n = flat.size
        per = -(-n // dmod.CHUNKS)
        cnt = np.zeros((dmod.CHUNKS, num_experts), np.int64)
        p = np.full(n, -1, np.int64)
        for c in range(dmod.CHUNKS):
            for i in range(min(c * per, n), min(c * per + per, n)):   # lanes in order == entries in order
                x = flat[i]
                if 0 <= x < num_experts:
                    p[i] = cnt[c, x]
                    cnt[c, x] += 1
        base = np.cumsum(cnt, axis=0) - cnt
        chunk_base.append(base)
        totals.append(cnt.sum(axis=0))
        pos.append((p, per))
    matrix = np.stack(totals)            # matrix[s, e]: rows s sends to expert e
    total = matrix.sum(axis=0)
    rows = []
    for s, idx in enumerate(idxs):
        before = matrix[:s].sum(axis=0)
        dst_base = np.array([total[e // el * el:e].sum() + before[e] for e in range(num_experts)])
        p, per = pos[s]
        flat = idx.reshape(-1)
        r = np.full(flat.size, -1, np.int64)
        for i, x in enumerate(flat):
            if 0 <= x < num_experts:
                r[i] = dst_base[x] + chunk_base[s][i // per, x] + p[i]
        rows.append(r)
    return rows, total


@pytest.mark.parametrize("world, num_experts, k, masked", [(2, 8, 2, 0.0), (4, 16, 4, 0.2), (4, 4, 3, 0.1),
                                                             (3, 12, 8, 0.0)])
def test_layout_model_groups_rows_by_expert_then_source_then_entry(world, num_experts, k, masked):
    rng = np.random.default_rng(world * 100 + k)
    el = num_experts // world
    idxs = []
    for s in range(world):
        t = int(rng.integers(0, 300))
        idx = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(t)]).reshape(t, k)
        idxs.append(np.where(rng.random((t, k)) < masked, -1, idx))
    rows, total = _model_rows(idxs, num_experts, world)
    for r in range(world):
        expect = [(s, i) for le in range(el) for s in range(world)
                  for i, x in enumerate(idxs[s].reshape(-1)) if x == r * el + le]
        got = sorted(((int(rows[s][i]), s, i) for s in range(world) for i, x in enumerate(idxs[s].reshape(-1))
                      if x >= 0 and x // el == r))
        assert [(s, i) for _, s, i in got] == expect
        assert [row for row, _, _ in got] == list(range(len(expect)))   # dense rows 0 .. R-1
        assert len(expect) <= max(len(i) for i in idxs) * world * k      # within the worst-case buffer
    assert total.sum() == sum(int((i >= 0).sum()) for i in idxs)
    # low latency: position among the source's earlier entries of the expert (ll_push), final row base + position
    # (ll_compact, source side), and the owner's placement of slot (source, expert, position): the same rows
    matrix = np.stack([np.bincount(i[i >= 0].ravel(), minlength=num_experts) for i in idxs])
    for s, idx in enumerate(idxs):
        flat = idx.reshape(-1)
        for i, x in enumerate(flat):
            if x < 0:
                continue
            p = int((flat[:i] == x).sum())
            owner, l = divmod(int(x), el)
            first = owner * el
            placed = matrix[:, first:first + l].sum() + matrix[:s, first + l].sum() + p
            base = matrix[:, first:x].sum() + matrix[:s, x].sum()
            assert base + p == placed == rows[s][i]


# --- dedupe: one row per (token, destination rank), the owner copies it into the token's other slots there ----
def _model_dedupe(idxs, rows, num_experts, world):
    """What fluxrt_moe_push writes with dedupe, per source s: for each entry the row it pushes (-1: none), the
    descriptor at its row (the row of the token's first slot on that owner, or -1), and rows pushed per owner."""
    el = num_experts // world
    pushed, desc, moved = [], [], []
    for s, idx in enumerate(idxs):
        t, k = idx.shape
        p = np.full(t * k, -1, np.int64)
        d = np.full(t * k, -1, np.int64)
        m = np.zeros(world, np.int64)
        for i in range(t * k):
            x = idx.reshape(-1)[i]
            if x < 0:
                continue
            tok, j = divmod(i, k)
            first = [q for q in range(j) if idx[tok, q] >= 0 and idx[tok, q] // el == x // el]
            if first:
                d[i] = rows[s][tok * k + first[0]]
            else:
                p[i] = rows[s][i]
                m[x // el] += 1
        pushed.append(p)
        desc.append(d)
        moved.append(m)
    return pushed, desc, moved


@pytest.mark.parametrize("world, num_experts, k, masked", [(2, 8, 4, 0.0), (4, 16, 4, 0.2), (2, 4, 4, 0.1),
                                                             (3, 12, 8, 0.0), (1, 4, 3, 0.0)])
def test_dedupe_model_rebuilds_the_layout_of_one_row_per_slot(world, num_experts, k, masked):
    """Pushing one row per (token, owner) into its first slot's row and copying it, on the owner, to the rows
    whose descriptors name it gives exactly the layout of one row per slot; descriptors name pushed rows of
    the same token (so the copies of one owner can run in any order); rows moved = tokens per owner."""
    rng = np.random.default_rng(world * 31 + k)
    el = num_experts // world
    idxs, xs = [], []
    for s in range(world):
        t = int(rng.integers(0, 200))
        owners = rng.integers(0, world, size=t)   # bias: many tokens with several slots on one rank
        idx = np.stack([rng.choice(num_experts, size=k, replace=False) if rng.random() < 0.5 else
                        np.concatenate([o * el + rng.choice(el, size=min(k, el), replace=False),
                                        rng.choice([e for e in range(num_experts) if e // el != o] or [-1],
                                                   size=k - min(k, el))])[rng.permutation(k)]
                        for o in owners]).reshape(t, k)
        idxs.append(np.where(rng.random((t, k)) < masked, -1, idx).astype(np.int64))
        xs.append(rng.standard_normal((t, 5)))
    rows, total = _model_rows(idxs, num_experts, world)
    pushed, desc, moved = _model_dedupe(idxs, rows, num_experts, world)
    for r in range(world):
        n = int(total[r * el:(r + 1) * el].sum())
        plain = np.full((n, 5), np.nan)
        recv = np.full((n, 5), np.nan)
        src_of = np.full(n, -7, np.int64)    # poison: every received row gets a descriptor
        for s in range(world):
            k_ = idxs[s].shape[1]
            for i, x in enumerate(idxs[s].reshape(-1)):
                if x < 0 or x // el != r:
                    continue
                plain[rows[s][i]] = xs[s][i // k_]
                src_of[rows[s][i]] = desc[s][i]
                if pushed[s][i] >= 0:
                    assert desc[s][i] == -1 and pushed[s][i] == rows[s][i]
                    recv[pushed[s][i]] = xs[s][i // k_]
        assert (src_of >= -1).all()
        assert (src_of[src_of >= 0] < n).all() and (src_of[src_of[src_of >= 0]] == -1).all()   # no chains
        for row in np.flatnonzero(src_of >= 0)[::-1]:   # the expand kernel: any order
            recv[row] = recv[src_of[row]]
        np.testing.assert_array_equal(recv, plain)
        for s in range(world):   # rows moved from s to r: its tokens with any slot on r
            owners = np.where(idxs[s] >= 0, idxs[s] // el, -1)
            assert moved[s][r] == int((owners == r).any(axis=1).sum())


def test_dedupe_low_latency_slots_name_pushed_slots():
    """Low latency with dedupe: the staging slot of a token's later slot on an owner names the slot of its first
    slot there (same source, same owner), which was pushed; compaction reads through it."""
    world, num_experts, k, max_tokens = 2, 8, 4, 50
    el = num_experts // world
    rng = np.random.default_rng(7)
    idx = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(40)])
    flat = idx.reshape(-1)
    slot = {}
    for i, x in enumerate(flat):
        p = int((flat[:i] == x).sum())   # ll_push's ballot scan
        slot[i] = (x % el) * max_tokens + p   # source 0: slots [0][local expert][position]
    for i, x in enumerate(flat):
        tok, j = divmod(i, k)
        first = [q for q in range(j) if idx[tok, q] // el == x // el]
        if first:
            src = slot[tok * k + first[0]]
            assert src != slot[i] and src // max_tokens != slot[i] // max_tokens   # another expert's slot
            assert not [q for q in range(first[0]) if idx[tok, q] // el == x // el]   # itself pushed


def _model_push_order(idx, rank, world, num_experts):
    """fluxrt_moe_layout's push order (arrival flags): entries sorted by (local expert, owner counted from
    rank + 1), inside an expert in entry order; -1 past the valid entries."""
    el = num_experts // world
    flat = idx.reshape(-1)
    key = lambda x: (x % el) * world + (x // el + world - rank - 1) % world   # noqa: E731
    valid = [i for i, x in enumerate(flat) if 0 <= x < num_experts]
    return sorted(valid, key=lambda i: (key(int(flat[i])), i)) + [-1] * (flat.size - len(valid))


@pytest.mark.parametrize("world, num_experts, k", [(2, 8, 2), (4, 16, 4), (3, 12, 8)])
def test_push_order_goes_expert_by_expert_and_covers_every_entry_once(world, num_experts, k):
    """The push order of the arrival-flag dispatch, as the layout kernel computes it (rows of experts before
    in push order + the entry's chunk base + its position), against the sort it stands for: every valid entry
    once, every owner's local expert 0 first, then 1, ..., so that experts complete one after another."""
    rng = np.random.default_rng(world * 10 + k)
    el = num_experts // world
    for rank in range(world):
        t = int(rng.integers(0, 200))
        idx = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(t)]).reshape(t, k)
        idx = np.where(rng.random((t, k)) < 0.15, -1, idx)
        flat = idx.reshape(-1)
        n = flat.size
        per = -(-n // dmod.CHUNKS) if n else 1
        cnt = np.zeros((dmod.CHUNKS, num_experts), np.int64)
        pos = np.full(n, -1, np.int64)
        for i, x in enumerate(flat):
            if x >= 0:
                pos[i] = cnt[i // per, x]
                cnt[i // per, x] += 1
        chunk_base = np.cumsum(cnt, axis=0) - cnt
        total = cnt.sum(axis=0)
        key = [(x % el) * world + (x // el + world - rank - 1) % world for x in range(num_experts)]
        before = [sum(int(total[y]) for y in range(num_experts) if key[y] < key[x]) for x in range(num_experts)]
        order = np.full(n, -2, np.int64)
        valid = int(total.sum())
        for i, x in enumerate(flat):
            if x >= 0:
                order[before[x] + chunk_base[i // per, x] + pos[i]] = i
            if i >= valid:
                order[i] = -1
        assert order.tolist() == _model_push_order(idx, rank, world, num_experts)
        local = [int(flat[i]) % el for i in order[:valid]]
        assert local == sorted(local)   # local expert 0 of every owner first


# --- fluxrt-perf moe_dispatch / moe_combine without a GPU -------------------------------------------------
def test_perf_routers_pick_distinct_experts_and_zipf_is_skewed():
    from fluxrt.perf import moe as pm

    rng = np.random.default_rng(3)
    order = np.random.default_rng(1).permutation(256)
    for routing in pm.ROUTINGS:
        idx, w = pm.route(rng, 2048, 256, 8, routing, 1.0, order)
        srt = np.sort(idx, axis=1)
        assert idx.shape == (2048, 8) and idx.dtype == np.int32 and (srt[:, 1:] != srt[:, :-1]).all()
        assert np.allclose(w.sum(axis=1), 1.0, atol=1e-5) and (w > 0).all()
        load = np.bincount(idx.ravel(), minlength=256)
        if routing == "zipf":
            assert load[order[0]] == load.max() and load.max() > 8 * load.mean()
        else:
            assert load.max() < 2 * load.mean()


def test_perf_layout_bytes_count_deepep_tokens_and_moved_rows():
    from fluxrt.perf import moe as pm

    idx = [np.array([[0, 1], [2, 3], [0, -1]]), np.array([[3, 2]])]   # 4 experts on 2 ranks: 2 each
    lay = pm.layout_bytes(idx, 4, 2, 0, hidden=8)
    # rank 0 gets: from rank 0 tokens 0 (twice) and 2 -> 2 tokens, 3 rows; from rank 1 nothing
    assert lay["recv_bytes"] == 2 * 8 * 2 and lay["moved_bytes"] == 3 * 8 * 2
    assert lay["matrix"].tolist() == [[3, 2], [0, 2]]
    # dedupe: token 0 crosses once (its two slots on rank 0)
    assert pm.layout_bytes(idx, 4, 2, 0, hidden=8, dedupe=True)["moved_bytes"] == 2 * 8 * 2


def test_perf_subcommands_are_listed():
    from fluxrt.perf import cli

    assert {"moe_dispatch", "moe_combine"} <= set(cli.BENCHES) and set(cli.SUMMARIES) == set(cli.BENCHES)


# --- MoELayer without a GPU: argument checks, buffer sizing, the device-bounded activation -------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(ffn_hidden=100), "ffn_hidden=100 must be a positive multiple of 8"),
    (dict(ffn_hidden=0), "ffn_hidden=0"),
    (dict(ffn_hidden=512.0), "ffn_hidden=512.0"),
    (dict(options=moe.MoELayerOptions(dispatch=moe.DispatcherOptions(fp8="block"))), "FP8 dispatch"),
    (dict(options=moe.DispatcherOptions()), "must be a MoELayerOptions"),
    (dict(options=moe.MoELayerOptions(dispatch=None)), "must be a DispatcherOptions"),
    (dict(options=moe.MoELayerOptions(dispatch=moe.DispatcherOptions(top_k=0))), "top_k"),
    (dict(num_experts=6), "multiple of the 4 ranks"),
    (dict(dtype="float32"), "bf16 or fp16"),
    (dict(options=moe.MoELayerOptions(gate_up_plan="fast")), "gate_up_plan must be a fluxrt.gemm.GemmPlan"),
    (dict(options=moe.MoELayerOptions(overlap=1)), "overlap must be a bool"),
    (dict(options=moe.MoELayerOptions(overlap=True, dispatch=moe.DispatcherOptions(mode="low_latency"))),
     "overlap=True needs DispatcherOptions"),
])
def test_layer_bad_configurations_are_named(kwargs, match):
    args = dict(world_size=4, num_experts=8, hidden=4096, ffn_hidden=1024, max_tokens_per_rank=128,
                dtype="bf16") | kwargs
    with pytest.raises(moe.MoEArgumentError, match=match):
        moe.check_layer_config(**args)


def test_layer_plans_are_checked_for_the_grouped_kernel():
    from fluxrt.gemm import GemmPlan

    bad = moe.MoELayerOptions(down_plan=GemmPlan(split_k=2))
    with pytest.raises(moe.MoEArgumentError, match="options.down_plan: grouped_gemm"):
        moe.check_layer_config(2, 8, 4096, 1024, 128, "bf16", bad)
    from fluxrt.gemm.grouped import grouped_plan

    good = moe.MoELayerOptions(gate_up_plan=grouped_plan(4096, 2048, 4096, 4))
    assert moe.check_layer_config(2, 8, 4096, 1024, 128, "bf16", good).ffn == 1024


def test_layer_buffers_hold_the_worst_case():
    opts = moe.MoELayerOptions(dispatch=moe.DispatcherOptions(top_k=8))
    cfg = moe.check_layer_config(4, 256, 7168, 2048, 4096, "bf16", opts)
    rows = 4096 * 4 * 8                       # max_tokens x world x top_k: nothing is dropped
    assert cfg.moe.recv_rows == rows and cfg.local_experts == 64
    assert cfg.weight_bytes() == 64 * (2 * 2048 * 7168 + 7168 * 2048) * 2
    assert cfg.intermediate_bytes() == (rows * (2 * 2048 + 2048) + 4096 * 7168) * 2   # h, act, default out
    assert cfg.device_bytes() == cfg.weight_bytes() + cfg.intermediate_bytes()
    # the GEMMs' output y lives in the Dispatcher's receive buffer: no symmetric bytes beyond the Dispatcher's
    assert cfg.symmetric_bytes() == moe.check_config(4, 256, 7168, 4096, "bf16", opts.dispatch).symmetric_bytes()
    assert cfg.expert_flops(10) == 6 * 10 * 2048 * 7168


def test_overlapped_layer_dispatches_with_arrival_flags():
    from fluxrt.moe import layer as lmod

    opts = moe.MoELayerOptions(overlap=True)
    d = lmod.overlap_dispatch_options(opts)
    assert d.arrivals and d.returns and d.blocks == lmod.OVERLAP_PUSH_BLOCKS
    assert lmod.overlap_dispatch_options(moe.MoELayerOptions(overlap=True, dispatch=moe.DispatcherOptions(
        blocks=16))).blocks == 16
    assert lmod.overlap_dispatch_options(moe.MoELayerOptions()) == moe.DispatcherOptions()
    seq = moe.check_layer_config(4, 256, 7168, 2048, 4096, "bf16")
    ov = moe.check_layer_config(4, 256, 7168, 2048, 4096, "bf16", opts)
    # the arrival flags, and the returns: home descriptors, return buffer, landed counters
    assert ov.symmetric_bytes() == seq.symmetric_bytes() + 64 * 4 * 8 + ov.moe.returns_bytes
    assert ov.moe.returns_bytes == 4 * 4096 * 4 * 8 + 4096 * 8 * 7168 * 2 + 4 * 8
    assert ov.device_bytes() == seq.device_bytes()


def test_returned_combine_shares_the_sequential_combines_sums():
    """Both combines are one weighted-sum loop (the same bits from the same rows); the returned one waits on the
    landed counters with the device library's bounded wait and re-bases after every round (never resets)."""
    src = (ROOT / "kernels/moe/dispatch.cu").read_text()
    assert src.count("fold_vec_weighted<E>(") == 1 and src.count("weighted_sums<E>(") == 2
    body = src[src.index("__device__ void combine_returned("):src.index("// FP8 dispatch")]
    assert "wait_ge(landed + q, target[q], watch, q)" in body and "landed_base[q] = ld_acquire_sys(landed + q)" in body
    assert "landed[q] = 0" not in body and "landed + q) = 0" not in body
    epi = (ROOT / "kernels/gemm/epilogue.cuh").read_text()
    scatter = epi[epi.index("struct GroupedScatterEpilogue"):epi.index("// Hook 2: destination row r")]
    # every lane fences its own NVLink stores before the counts are released (sync.cuh's functions only)
    assert scatter.index("fluxrt::warp_publish()") < scatter.index("fluxrt::red_release_sys_add(")
    assert "asm" not in scatter


def test_layer_constructor_checks_before_any_allocation():
    world = SimpleNamespace(size=2, rank=0, options=SimpleNamespace(check_collective_args=False),
                            check_active=lambda: None, heap=SimpleNamespace(capacity=1 << 30, used=0))
    with pytest.raises(moe.MoEArgumentError, match="ffn_hidden"):
        moe.MoELayer(world, num_experts=4, hidden=64, ffn_hidden=12, max_tokens_per_rank=8)
    with pytest.raises(moe.MoEArgumentError, match="FP8"):
        moe.MoELayer(world, 4, 64, 64, 8, options=moe.MoELayerOptions(dispatch=moe.DispatcherOptions(fp8="token")))


def test_grouped_gemm_over_the_receive_buffer_touches_only_received_rows():
    """The layer runs its GEMMs with M = the receive buffer's rows and the groups' offsets from the dispatch,
    whose last entry (the received rows) is below M: the grouped kernel's tile rows (its host mirror) cover
    exactly rows [0, offsets[-1]), each tile inside one group; the CTAs still fill the SMs."""
    from fluxrt.gemm.grouped import group_tiles, grouped_grid, grouped_plan

    m = 4096 * 2 * 4
    for offsets in ([0, 3, 3, 200, 457], [0, 0, 0, 0, 0], [0, 128, 256, 384, 512], [0, 1, 130, 130, 131]):
        plan = grouped_plan(m, 2048, 4096, 4)
        tiles = group_tiles(offsets, m, plan.block_m)
        covered = sorted(r for _, first, end in tiles for r in range(first, min(first + plan.block_m, end)))
        assert covered == list(range(offsets[-1]))
        for g, first, end in tiles:
            assert offsets[g] <= first < end <= offsets[g + 1]
        assert grouped_grid(plan, m, 2048, 4, 132) == 132


def test_layer_activation_is_the_mlp_kernel_with_a_device_row_bound():
    from fluxrt.ops import mlp

    src = (ROOT / "kernels/ops/mlp.cu").read_text()
    assert src.count("silu(E::lo(gw[k]))") == 1          # one body, two entries
    for entry in ("fluxrt_silu_mul", "fluxrt_silu_mul_bounded"):
        assert re.search(rf"__launch_bounds__\({mlp.SILU_MUL_THREADS}\) {entry}\(", src)
    layer_src = (ROOT / "fluxrt/moe/layer.py").read_text()
    assert "load_silu_mul(" in layer_src and "__global__" not in layer_src and "RawKernel" not in layer_src
    assert mlp.silu_mul_grid(0, 64, 132) == 1 and mlp.silu_mul_grid(1 << 20, 2048, 132) == 8 * 132


def test_layer_forward_checks_its_arguments_before_the_dispatch(monkeypatch):
    """Bad arguments raise from forward's own (agreed) checks, before dispatch launches anything."""
    from fluxrt.moe import layer as lmod

    monkeypatch.setattr(lmod, "as_cupy_stream", lambda s: s)
    layer = moe.MoELayer.__new__(moe.MoELayer)
    cfg = moe.check_layer_config(2, 4, 64, 64, 8, "bf16")
    calls = []
    world = SimpleNamespace(size=1, rank=0, options=SimpleNamespace(check_collective_args=False),
                            check_active=lambda: None, check_errors=lambda: None, device_id=0, make_current=lambda: None)
    layer.world, layer.cfg, layer._freed = world, cfg, False
    layer.options, layer._overlap = moe.MoELayerOptions(), None
    layer.dispatch = lambda *a, **k: calls.append("dispatch")
    with pytest.raises(moe.MoEArgumentError, match="moe_layer on rank 0: x is a host numpy array"):
        layer.forward(np.zeros((4, 64), np.float32), None, None)
    with pytest.raises(moe.MoEArgumentError, match="overlap=True needs a layer made with"):
        layer.forward(np.zeros((4, 64), np.float32), None, None, overlap=True)
    assert calls == []


# --- fluxrt-perf moe_layer without a GPU ----------------------------------------------------------------------
def test_perf_layer_baseline_layout_groups_rows_by_expert():
    """The NCCL + cuBLAS baseline's host layout: what each rank sends (by expert), receives (by source), the
    gather into expert order, and each slot's row in the send-order buffer, checked by simulating the
    all-to-all-v in numpy."""
    from fluxrt.perf import moe as pm

    world, experts, k = 3, 6, 2
    el = experts // world
    rng = np.random.default_rng(7)
    idxs = []
    for s in range(world):
        t = [5, 0, 9][s]   # a rank without tokens too
        idx = np.array([rng.choice(experts, size=k, replace=False) for _ in range(t)], np.int64).reshape(t, k)
        idxs.append(np.where(rng.random((t, k)) < 0.2, -1, idx).astype(np.int32))
    lays = [pm.baseline_layout(idxs, experts, world, r) for r in range(world)]
    # a slot's "row" is (source, slot); the send buffers and the all-to-all-v, simulated
    send = [[(s, int(i)) for i in lays[s]["send_slots"]] for s in range(world)]
    for r in range(world):
        lay = lays[r]
        recv = []
        for s in range(world):
            first = int(lays[s]["send_rows"][:r].sum())
            recv += send[s][first:first + int(lays[s]["send_rows"][r])]
            assert lay["recv_rows"][s] == lays[s]["send_rows"][r]
        grouped = [recv[i] for i in lay["perm"]]
        expect = [(s, i) for le in range(el) for s in range(world)
                  for i in range(idxs[s].size) if idxs[s].reshape(-1)[i] == r * el + le]
        assert sorted(grouped) == sorted(expect)
        experts_of = [int(idxs[s].reshape(-1)[i]) - r * el for s, i in grouped]
        assert experts_of == sorted(experts_of)                      # grouped by local expert
        assert lay["expert_rows"].tolist() == [experts_of.count(le) for le in range(el)]
        assert sorted(lay["perm"].tolist()) == list(range(len(recv)))  # a permutation
    for s in range(world):   # slot_pos: each valid slot's row in its send buffer
        flat = idxs[s].reshape(-1)
        for i in np.nonzero(flat >= 0)[0]:
            assert send[s][lays[s]["slot_pos"][i]] == (s, int(i))
        owners = [int(flat[i]) // el for _, i in send[s]]
        assert owners == sorted(owners)


def test_perf_layer_subcommand_and_columns():
    from fluxrt.perf import cli
    from fluxrt.perf import moe as pm

    assert "moe_layer" in cli.BENCHES and cli.BENCHES["moe_layer"] == "fluxrt.perf.moe:moe_layer"
    args = pm.build_parser("moe_layer").parse_args(["--ffn", "512"])
    assert args.ffn == 512 and args.fp8 == "" and args.check == 1
    assert set(pm.FFN) == set(pm.MODELS)
    row = {"model": "mixtral", "tokens": 128, "routing": "zipf", "recv_bytes": 1e6, "layer_us": 10.0,
           "graph_us": 8.0, "dispatch_us": 2.0, "experts_us": 5.0, "combine_us": 3.0, "baseline_us": None,
           "speedup": None, "experts_tflops": 1.0}
    line = pm.format_row("moe_layer", row)
    assert "N/A" in line and "10.00" in line
    assert len(pm.format_row("moe_layer", None).split()) == 4 + len(pm.COLUMNS["moe_layer"])
