"""Topology (fluxrt.topology) and the hierarchical path's planning (collectives_plan.choose_path,
fluxrt.collectives_hier), without a GPU."""
import re

import pytest

from fluxrt import collectives_plan as plan
from fluxrt import topology as topo
from fluxrt.collectives_hier import (MAX_NODES, MAX_PUT_BLOCKS, ONESHOT_BYTES, check_rail_reduction, put_grid,
                                     rail_allreduce_algo, rail_geometry, rail_pieces, shard_elems)
from fluxrt.toolchain import kernel_root


def _pointers(node_of, same_gpu=False):
    """NVLink/P2P mappings inside each real node (every pair when the ranks share one node)."""
    n = len(node_of)
    return [[same_gpu or node_of[r] == node_of[q] for q in range(n)] for r in range(n)]


@pytest.mark.parametrize("text, want", [(None, None), ("", None), ("auto", None), (" AUTO ", None),
                                        ("virtual:2x2", (2, 2)), ("virtual:2X1", (2, 1)),
                                        (" virtual : 16 x 8 ", (16, 8))])
def test_parse_setting(text, want):
    got = topo.parse_setting(text)
    assert (None if got is None else (got.nodes, got.ranks_per_node)) == want


@pytest.mark.parametrize("text", ["virtual", "virtual:2", "virtual:0x2", "virtual:2x0", "2x2", "real:2x2",
                                  "virtual:-1x2"])
def test_parse_setting_refuses(text):
    with pytest.raises(topo.TopologyError, match="FLUXRT_TOPOLOGY"):
        topo.parse_setting(text)


def test_virtual_setting_must_fit_the_world():
    with pytest.raises(topo.TopologyError, match="needs 4 ranks, the world has 2"):
        topo.parse_setting("virtual:2x2").node_of(2)
    assert topo.parse_setting("virtual:2x2").node_of(4) == (0, 0, 1, 1)


def test_node_indices_from_leaders():
    assert topo.node_indices([0, 0, 2, 2]) == (0, 0, 1, 1)
    assert topo.node_indices([0, 1, 0, 1]) == (0, 1, 0, 1)     # round-robin placement
    assert topo.node_indices([5, 5, 5]) == (0, 0, 0)


def test_two_real_nodes_of_four():
    leaders = [0] * 4 + [4] * 4
    t = topo.build(5, leaders, _pointers(topo.node_indices(leaders)), [True] * 8, ["IBRC over mlx5_0"] * 8)
    assert t.num_nodes == 2 and t.nodes == ((0, 1, 2, 3), (4, 5, 6, 7)) and not t.virtual
    assert t.node == 1 and t.local_ranks == (4, 5, 6, 7) and t.local_index == 1
    assert t.nvshmem_peers() == (0, 1, 2, 3) and t.rail() == (1, 5) and t.rail(2) == (2, 6)
    assert t.hierarchical and t.uniform
    assert t.reachable(0, 5) == (True, "NVSHMEM remote transport")
    assert t.reachable(4, 6) == (True, "NVLink pointer")
    t.check_reachable()
    text = "\n".join(t.describe())
    assert "node 1: ranks 4-7" in text and "NVSHMEM device API to 0-3" in text and "mlx5_0" in text
    assert plan.choose_path(t)[0] == "hierarchical"


def test_round_robin_placement_rails():
    leaders = [0, 1, 0, 1]   # ranks 0, 2 on one node, 1, 3 on the other
    t = topo.build(3, leaders, _pointers(topo.node_indices(leaders)), [True] * 4)
    assert t.nodes == ((0, 2), (1, 3)) and t.local_ranks == (1, 3) and t.rail() == (2, 3)


def test_unreachable_pair_named_at_init():
    leaders = [0, 0, 2, 2]
    why = ["IBRC over mlx5_0", "IBRC over mlx5_0", "NVSHMEM_REMOTE_TRANSPORT=none", "IBRC over mlx5_0"]
    t = topo.build(0, leaders, _pointers(topo.node_indices(leaders)), [True, True, False, True], why)
    with pytest.raises(topo.TopologyError) as info:
        t.check_reachable()
    msg = str(info.value)
    assert "rank 0 cannot reach rank 2" in msg and "rank 2 cannot reach rank 0" in msg
    assert "rank 1 cannot reach rank 3" not in msg        # both ends have a remote transport
    assert "NVSHMEM_REMOTE_TRANSPORT=none" in msg and "docs/multinode.md" in msg


def test_same_node_without_p2p_needs_a_remote_transport():
    t = topo.build(0, [0, 0], [[True, False], [False, True]], [False, False], ["no HCA", "no HCA"])
    ok, why = t.reachable(0, 1)
    assert not ok and "same node without P2P" in why
    assert t.hierarchical   # NVLink pointers missing inside the node


@pytest.mark.parametrize("setting, n, rail1", [("virtual:2x2", 4, (1, 3)), ("virtual:2x1", 2, (0, 1)),
                                               ("virtual:4x2", 8, (1, 3, 5, 7))])
def test_virtual_nodes_on_one_node(setting, n, rail1):
    v = topo.parse_setting(setting)
    t = topo.build(1, [0] * n, _pointers([0] * n, same_gpu=True), [False] * n, ["no HCA"] * n, v)
    assert t.virtual and t.num_nodes == v.nodes and len(t.local_ranks) == v.ranks_per_node
    assert t.rail() == rail1
    assert set(t.nvshmem_peers()) == set(range(n)) - set(t.local_ranks)
    assert not t.nvlink(0, n - 1)
    assert t.reachable(0, n - 1) == (True, "NVSHMEM P2P transport")   # no remote transport needed
    t.check_reachable()
    assert plan.choose_path(t) == ("hierarchical", f"{v.nodes} virtual nodes of {v.ranks_per_node} ranks: node "
                                   "team over NVLink, between nodes over the NVSHMEM device API")


def test_virtual_nodes_must_not_join_real_ones():
    v = topo.parse_setting("virtual:1x4")
    leaders = [0, 0, 2, 2]
    with pytest.raises(topo.TopologyError, match="spans real nodes"):
        topo.build(0, leaders, _pointers(topo.node_indices(leaders)), [True] * 4, setting=v)


def test_one_node_is_flat():
    t = topo.build(0, [0, 0, 0, 0], _pointers([0] * 4), [False] * 4)
    assert not t.hierarchical and plan.choose_path(t)[0] == "flat" and plan.choose_path(None)[0] == "flat"
    assert topo.single().nvshmem_peers() == ()


def test_uneven_nodes_have_no_rails():
    leaders = [0, 0, 0, 3]
    t = topo.build(0, leaders, _pointers(topo.node_indices(leaders)), [True] * 4)
    assert not t.uniform
    with pytest.raises(topo.TopologyError, match="different sizes"):
        t.rail()


def test_remote_transport(tmp_path):
    hcas = tmp_path / "ib"
    assert topo.remote_transport({"NVSHMEM_REMOTE_TRANSPORT": "none"}, str(hcas)) == \
        (False, "NVSHMEM_REMOTE_TRANSPORT=none")
    ok, why = topo.remote_transport({}, str(hcas))
    assert not ok and "no InfiniBand/RoCE device" in why
    (hcas / "mlx5_0").mkdir(parents=True)
    (hcas / "mlx5_1").mkdir()
    assert topo.remote_transport({}, str(hcas)) == (True, "IBRC over mlx5_0, mlx5_1")
    assert topo.remote_transport({"NVSHMEM_IB_ENABLE_IBGDA": "1"}, str(hcas)) == \
        (True, "IBRC with IBGDA over mlx5_0, mlx5_1")
    assert topo.remote_transport({"NVSHMEM_REMOTE_TRANSPORT": "ucx"}, str(tmp_path / "none"))[0]


# --------------------------------------------------------------------------------- hierarchical planning
def test_rail_geometry_and_pieces():
    half, slot = rail_geometry(64 << 20, 2)
    assert (half, slot) == (32 << 20, 16 << 20)
    half, slot = rail_geometry(1000, 3)
    assert slot % 16 == 0 and 2 * half <= 1000 and half == 3 * slot
    with pytest.raises(ValueError):
        rail_geometry(16, 4)
    assert rail_pieces(0, 64) == [(0, 0)]
    assert rail_pieces(100, 64) == [(0, 64), (64, 36)]
    assert sum(b for _, b in rail_pieces(12345, 1024)) == 12345


def test_put_grid_and_shards():
    assert put_grid(1, 8) == 1 and put_grid(1 << 30, 8) == 8 and put_grid(1 << 30, 99) == MAX_PUT_BLOCKS
    assert shard_elems(1, 2, 4) == 4                      # one 16-byte vector
    assert shard_elems(1001, 2, 2) == 504                 # bf16: 501 -> whole vectors of 8
    for count, g, isz, nodes in [(4096, 2, 4, 1), (3, 1, 4, 2), ((1 << 20) + 3, 2, 2, 4), (10, 8, 2, 16)]:
        s = shard_elems(count, g, isz, nodes)
        assert s * g >= count and (s * isz) % (16 * nodes) == 0


def test_rail_allreduce_algo():
    assert rail_allreduce_algo(1 << 30, 2) == "oneshot"               # 2 nodes: as many bytes, one round
    assert rail_allreduce_algo(ONESHOT_BYTES, 8) == "oneshot"
    assert rail_allreduce_algo(ONESHOT_BYTES + 16, 8) == "rs_ag"
    assert rail_allreduce_algo(16, 2, oneshot_bytes=0) == "rs_ag"     # forced (the GPU test's second context)


def test_rail_reductions_are_the_kernels():
    src = (kernel_root() / "comm" / "nvshmem_hier.cu").read_text()
    built = set(re.findall(r"FLUXRT_RAIL_REDUCE\((\w+)_(\w+), ", src))
    if "FLUXRT_BASE_REDUCTIONS(FLUXRT_RAIL_REDUCE)" in src:   # instantiated from the device library's list
        base = (kernel_root() / "include" / "fluxrt" / "reduce.cuh").read_text()
        built |= set(re.findall(r"X\((\w+)_(\w+), ", base))
    for dt in ("bf16", "fp16", "fp32"):
        for red in ("sum", "max", "min"):
            check_rail_reduction(dt, red)
            assert (dt, red) in built
    with pytest.raises(ValueError, match="across nodes"):
        check_rail_reduction("fp64", "sum")
    with pytest.raises(ValueError, match="across nodes"):
        check_rail_reduction("fp32", "prod")


def test_rail_constants_mirror_the_kernel():
    src = (kernel_root() / "include" / "fluxrt" / "remote.cuh").read_text()
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr u32 (k\w+) = (\d+);", src)}
    assert consts["kMaxRailNodes"] == MAX_NODES and consts["kMaxRailBlocks"] == MAX_PUT_BLOCKS


def test_multinode_doc_tables_are_the_models(capsys):
    """docs/multinode.md shows what perf/multinode_model.py computes from its default inputs."""
    import importlib.util
    import sys

    root = kernel_root().parent
    spec = importlib.util.spec_from_file_location("multinode_model", root / "perf" / "multinode_model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model   # its dataclass looks its module up
    try:
        spec.loader.exec_module(model)
    finally:
        sys.modules.pop(spec.name, None)
    model.main([])
    doc = (root / "docs" / "multinode.md").read_text()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]


def test_hierarchical_methods_take_every_keyword_of_the_single_node_ones():
    """The module-level collectives pass the same keywords to whichever context the world has: the
    hierarchical one must accept every keyword of the single-node one (and refuse what it cannot do)."""
    import inspect

    from fluxrt.collectives import Collectives
    from fluxrt.collectives_hier import HierarchicalCollectives

    for name in ("allreduce", "reduce_scatter", "allgather", "alltoall", "alltoallv", "broadcast"):
        single = set(inspect.signature(getattr(Collectives, name)).parameters)
        hier = set(inspect.signature(getattr(HierarchicalCollectives, name)).parameters)
        assert single <= hier, (name, single - hier)


def test_hierarchical_refuses_compression_before_any_launch():
    import types

    from fluxrt.collectives_hier import _call_checks
    from fluxrt.errors import CollectiveArgumentError, GraphCaptureError

    idle = types.SimpleNamespace(is_capturing=lambda: False)
    _call_checks("allreduce", idle, "auto", None, None)   # the plain call passes
    for compress, feedback in (("fp8", None), ("int8", None), (None, object())):
        with pytest.raises(CollectiveArgumentError, match="across nodes is not implemented"):
            _call_checks("allreduce", idle, "auto", compress, feedback)
    with pytest.raises(CollectiveArgumentError, match="hierarchical"):
        _call_checks("alltoall", idle, "ring")
    with pytest.raises(GraphCaptureError, match="cannot be captured"):
        _call_checks("broadcast", types.SimpleNamespace(is_capturing=lambda: True), "auto")


def _virtual(n_nodes, g, rank=0):
    t = topo.build(rank, [0] * (n_nodes * g), _pointers([0] * (n_nodes * g)), [True] * (n_nodes * g),
                   ["x"] * (n_nodes * g), topo.VirtualNodes(n_nodes, g))
    assert t.hierarchical
    return t


@pytest.mark.parametrize("rank", range(8))
def test_tp_dp_groups_on_two_nodes_of_four(rank):
    t = _virtual(2, 4, rank)
    tp, dp = t.tp_dp_groups()
    node = rank // 4
    assert tp == tuple(range(node * 4, node * 4 + 4)) and dp == (rank % 4, rank % 4 + 4)
    tp2, dp2 = t.tp_dp_groups(2)   # TP of 2 inside the node; DP: the same TP index in every TP group
    assert tp2 == (rank - rank % 2, rank - rank % 2 + 1) and dp2 == tuple(range(rank % 2, 8, 2))
    with pytest.raises(topo.TopologyError, match="tp_size=3 must divide"):
        t.tp_dp_groups(3)


def test_restrict_keeps_nodes_and_links_of_the_members():
    t = _virtual(2, 2, 0)
    tp = t.restrict((0, 1), 0)
    assert tp.num_nodes == 1 and not tp.hierarchical and tp.virtual
    dp = t.restrict((1, 3), 1)     # a rail: one rank of each node, seen from member 1 (world rank 3)
    assert dp.node_of == (0, 1) and dp.hierarchical and dp.rail() == (0, 1) and dp.nvshmem_peers() == (0,)
    mixed = t.restrict((3, 0, 2), 0)   # members in any order: nodes numbered by their lowest member
    assert mixed.node_of == (1, 0, 1) and mixed.nodes == ((1,), (0, 2))
    real = topo.build(2, [0, 0, 2, 2], _pointers((0, 0, 1, 1)), [True] * 4, ["ib"] * 4)
    assert real.restrict((0, 2), 1).remote_why == ("ib", "ib")


def test_cross_node_refusal_names_the_ranks_and_the_split():
    class W:
        topology = _virtual(2, 2, 1)

    with pytest.raises(topo.TopologyError) as info:
        topo.require_one_domain(W(), "AllGatherGemm()")
    msg = str(info.value)
    assert "ranks 2-3 are reached only through NVSHMEM from rank 1" in msg and "tp_dp_split" in msg


def test_tp_dp_split_splits_by_node_then_by_tp_index():
    calls = []

    class W:
        rank, size, topology = 3, 4, _virtual(2, 2, 3)

        def split(self, color, key=None, *, pool_bytes=None, options=None):
            calls.append((color, key))
            return ("world", color)

    tp, dp = topo.tp_dp_split(W())
    assert calls == [(2, 3), (1, 3)] and tp == ("world", 2) and dp == ("world", 1)


def test_remote_rate_pieces_ratios_and_cli():
    from fluxrt.perf import cli
    from fluxrt.perf.remote_rate import PATHS, piece_sizes, pool_bytes, ratio_rows

    assert cli.BENCHES["remote_rate"] == "fluxrt.perf.remote_rate" and "remote_rate" in cli.SUMMARIES
    assert piece_sizes(0, 64) == [0] and piece_sizes(64, 64) == [64] and piece_sizes(130, 64) == [64, 64, 2]
    assert sum(piece_sizes(1 << 30, 64 << 20)) == 1 << 30 and len(piece_sizes(1 << 30, 64 << 20)) == 16
    assert pool_bytes(64 << 20, 2) >= 3 * 2 * (64 << 20) + 2 * (64 << 20)
    rows = [{"bytes": 1 << 30, "path": "nvlink_pointer", "put_blocks": None, "gbps": 100.0},
            {"bytes": 1 << 30, "path": "nvshmem_api", "put_blocks": 8, "gbps": 80.0},
            {"bytes": 1 << 30, "path": "nvshmem_api", "put_blocks": 32, "gbps": 95.0}]
    assert [(r["put_blocks"], r["ratio"]) for r in ratio_rows(rows)] == [(8, 0.8), (32, 0.95)]
    assert PATHS == ("nvlink_pointer", "nvshmem_api")


def test_hierarchical_kernels_take_the_masks():
    """The rail put and gather kernels' masks (one bit per rail member) are in the kernel signature the host
    packs (collectives_hier: _rail_put, _rail_gather)."""
    src = (kernel_root() / "comm" / "nvshmem_hier.cu").read_text()
    put = re.search(r"fluxrt_rail_put\(([^)]*)\)", src).group(1)
    gather = re.search(r"fluxrt_rail_gather\(([^)]*)\)", src).group(1)
    assert put.split(",")[-1].split()[-1] == "put_mask" and len(put.split(",")) == 12
    assert "u64 copy_mask" in gather and len(gather.split(",")) == 16


@pytest.mark.parametrize("nodes, g, c", [(2, 1, 1), (2, 2, 1), (2, 2, 3), (3, 4, 2), (4, 2, 1)])
def test_two_phase_alltoall_layout(nodes, g, c):
    """The hierarchical all-to-all's two phases, simulated with numpy on N x G ranks (node all-to-all of the
    regrouped chunks, then each rank's block d to rail member d at the sender node's block), against the flat
    all-to-all; c = 1 makes the transposes' reshapes views that are not contiguous."""
    import numpy as np

    from fluxrt.collectives_hier import alltoall_node_input, alltoall_rail_blocks

    n = nodes * g
    x = [np.arange(n * c, dtype=np.int32) + 1000 * r for r in range(n)]   # rank r's chunk q: x[r][q c:(q + 1) c]
    want = [np.concatenate([x[p][q * c:(q + 1) * c] for p in range(n)]) for q in range(n)]
    y = [alltoall_node_input(x[r], nodes, g, np) for r in range(n)]            # [G, N, c]
    z = {}
    for k in range(nodes):                                                       # the node all-to-all
        for i in range(g):
            z[k * g + i] = np.stack([y[k * g + j][i] for j in range(g)])          # from local j: its row i
    out = [np.empty(n * c, np.int32) for _ in range(n)]
    for k in range(nodes):
        for i in range(g):
            w = alltoall_rail_blocks(z[k * g + i], nodes, g, np)
            assert w.flags.c_contiguous and w.shape == (nodes, g * c)
            for d in range(nodes):                                                # rail put to member d
                out[d * g + i][k * g * c:(k + 1) * g * c] = w[d]
    for q in range(n):
        assert np.array_equal(out[q], want[q]), q


def _simulate_alltoallv(matrix, members, sds, rds, itemsize, slot, xs, outs):
    """Every rank's alltoallv through the layouts' tables, with numpy byte arrays for x, y, z, the send and
    receive buffers and out; the rail put moves put_bytes[d] of member p's send buffer into member d's slot p."""
    import numpy as np

    from fluxrt.collectives_hier import alltoallv_layout, split_segments

    nodes, g = len(members), len(members[0])

    def copy(table, dst, src):
        for d0, s0, nb in split_segments(table, 7):   # short entries: the cut must keep the bytes in order
            dst[d0:d0 + nb] = src[s0:s0 + nb]

    lay = {r: alltoallv_layout(matrix, members, r, sds[r], rds[r], itemsize, slot)
           for node in members for r in node}
    y = {}
    for r, lt in lay.items():
        y[r] = np.zeros(int(lt.node_send.sum()) * itemsize, np.uint8)
        copy(lt.pack, y[r], xs[r])
    z = {}
    for k, node in enumerate(members):                 # the node stage: local rank j's part for local rank i
        for i, r in enumerate(node):
            parts = []
            for j, q in enumerate(node):
                start = int(lay[q].node_send[:i].sum()) * itemsize
                parts.append(y[q][start:start + int(lay[q].node_send[i]) * itemsize])
                assert lay[r].node_recv[j] == lay[q].node_send[i] and lay[r].node_max == lay[q].node_max
            z[r] = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    for r, lt in lay.items():
        copy(lt.local, outs[r], z[r])
    for i in range(g):                                  # rail i
        rail = [node[i] for node in members]
        counts = {len(lay[r].rounds) for r in rail}
        assert len(counts) == 1, counts
        for rd in range(counts.pop()):
            assert len({lay[r].rounds[rd].grid_bytes for r in rail}) == 1
            send = {}
            for p, r in enumerate(rail):
                rnd = lay[r].rounds[rd]
                assert rnd.put_bytes[p] == 0 and max(rnd.put_bytes, default=0) <= rnd.grid_bytes <= slot
                send[r] = np.zeros(nodes * slot, np.uint8)
                copy(rnd.stage, send[r], z[r])
            recv = {r: np.zeros(nodes * slot, np.uint8) for r in rail}
            for p, r in enumerate(rail):
                for d, q in enumerate(rail):
                    nb = int(lay[r].rounds[rd].put_bytes[d])
                    recv[q][p * slot:p * slot + nb] = send[r][d * slot:d * slot + nb]
            for r in rail:
                copy(lay[r].rounds[rd].recv, outs[r], recv[r])
    return max(len(lt.rounds) for lt in lay.values())


@pytest.mark.parametrize("nodes, g, slot, seed", [(2, 1, 64, 0), (2, 2, 64, 1), (2, 2, 16, 2), (3, 2, 48, 3),
                                                  (2, 4, 512, 4), (4, 2, 32, 5)])
def test_two_phase_alltoallv_layout(nodes, g, slot, seed):
    """The hierarchical all-to-all-v's tables (pack, node stage, local block, rail rounds), simulated with numpy
    on N x G ranks against the flat definition: uneven counts, zero pairs, a rank that sends nothing, custom
    displacements with gaps on one rank, an odd item size, rounds of small slots (several per call), members
    of a node that are not consecutive ranks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n, isz = nodes * g, 2
    order = rng.permutation(n)                            # node d, local j: rank order[d * g + j]
    members = tuple(tuple(int(v) for v in order[d * g:(d + 1) * g]) for d in range(nodes))
    matrix = rng.integers(0, 23, (n, n))
    matrix[rng.random((n, n)) < 0.3] = 0
    matrix[n - 1] = 0                                     # rank n - 1 sends nothing
    big = next(r for r in members[0] if r != n - 1) if g > 1 or members[0][0] != n - 1 else members[1][0]
    matrix[big, members[-1][0] if big in members[0] else members[0][0]] = 3 * slot   # several rail rounds
    sds, rds, xs, outs, want = {}, {}, {}, {}, {}
    for r in range(n):
        sc, rc = matrix[r], matrix[:, r]
        sds[r] = np.concatenate(([0], np.cumsum(sc)[:-1]))
        rds[r] = np.concatenate(([0], np.cumsum(rc)[:-1]))
        if r == 1:                                        # gaps, reversed order
            sds[r] = (np.cumsum(sc[::-1])[::-1] - sc) + (n - 1 - np.arange(n)) * 5
            rds[r] = (np.cumsum(rc[::-1])[::-1] - rc) + (n - 1 - np.arange(n)) * 3
        xs[r] = rng.integers(0, 255, (int((sds[r] + sc).max(initial=0)) * isz,), dtype=np.uint8)
        size = int((rds[r] + rc).max(initial=0)) * isz
        outs[r] = np.full(size, 0xEE, np.uint8)
        want[r] = outs[r].copy()
    for r in range(n):
        for q in range(n):
            c = int(matrix[q][r]) * isz
            want[r][rds[r][q] * isz:rds[r][q] * isz + c] = xs[q][sds[q][r] * isz:sds[q][r] * isz + c]
    assert _simulate_alltoallv(matrix, members, sds, rds, isz, slot, xs, outs) > 1
    for r in range(n):
        assert np.array_equal(outs[r], want[r]), r


def test_alltoallv_count_matrix_and_segments():
    from fluxrt.collectives_hier import check_count_matrix, split_segments
    from fluxrt.errors import CollectiveMismatchError

    m = check_count_matrix([[0, 2], [3, 1]], [None, [2, 1]])
    assert m.tolist() == [[0, 2], [3, 1]]
    with pytest.raises(CollectiveMismatchError, match="rank 1 sends 3 to rank 0, which expects 4"):
        check_count_matrix([[0, 2], [3, 1]], [[0, 4], None])
    t = split_segments([[100, 0, 10], [0, 500, 3]], 4)
    assert t.tolist() == [[100, 0, 4], [104, 4, 4], [108, 8, 2], [0, 500, 3]]
