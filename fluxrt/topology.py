"""Which ranks share a node, which peers NVLink pointers reach, and which only NVSHMEM's transports reach.

A world's ``topology`` (made at ``fluxrt.init``) records, for every rank, its node (from the
``COMM_TYPE_SHARED`` split of the world's communicator: the ranks NVSHMEM would put in its node team) and
the peers it holds an NVLink/P2P pointer to (``nvshmem_ptr`` != 0). Peers without such a pointer are
reached only through NVSHMEM's device API (put-with-signal over IBGDA/IBRC/UCX, or its P2P transport).

``FLUXRT_TOPOLOGY=virtual:NxG`` makes one node behave as N nodes of G ranks (ranks 0..G-1 are node 0, ...):
peers in another virtual node are treated as having no NVLink pointer, so every "inter-node" transfer goes
through the NVSHMEM device API and the hierarchical collectives run, and are checked, on one node.

A rank that reaches a peer by no transport (another node and no remote transport on either side) makes
``fluxrt.init`` fail on every rank with an error naming both ranks.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import FluxrtError

ENV = "FLUXRT_TOPOLOGY"
_VIRTUAL_RE = re.compile(r"^\s*virtual\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")
# NVSHMEM_REMOTE_TRANSPORT values that need no InfiniBand device in /sys/class/infiniband
_NON_IB_TRANSPORTS = ("ucx", "libfabric")
_IB_SYSFS = "/sys/class/infiniband"


class TopologyError(FluxrtError, ValueError):
    """FLUXRT_TOPOLOGY cannot be read or does not fit the world, or a rank cannot reach a peer."""


@dataclass(frozen=True)
class VirtualNodes:
    """FLUXRT_TOPOLOGY=virtual:NxG: `nodes` nodes of `ranks_per_node` ranks each."""

    nodes: int
    ranks_per_node: int

    def node_of(self, size: int) -> tuple[int, ...]:
        if self.nodes * self.ranks_per_node != size:
            raise TopologyError(f"{ENV}=virtual:{self.nodes}x{self.ranks_per_node} needs "
                                f"{self.nodes * self.ranks_per_node} ranks, the world has {size}")
        return tuple(r // self.ranks_per_node for r in range(size))


def parse_setting(text: str | None) -> VirtualNodes | None:
    """The FLUXRT_TOPOLOGY value: None for unset, '' or 'auto' (the real nodes); virtual:NxG otherwise."""
    if text is None or text.strip().lower() in ("", "auto"):
        return None
    m = _VIRTUAL_RE.match(text)
    if not m:
        raise TopologyError(f"{ENV}={text!r}: expected 'auto' or 'virtual:NxG' (N nodes of G ranks, e.g. virtual:2x2)")
    n, g = int(m.group(1)), int(m.group(2))
    if n < 1 or g < 1:
        raise TopologyError(f"{ENV}={text!r}: N and G must be at least 1")
    return VirtualNodes(n, g)


def setting_from_env(env=None) -> VirtualNodes | None:
    env = os.environ if env is None else env
    return parse_setting(env.get(ENV))


def remote_transport(env=None, ib_sysfs: str = _IB_SYSFS) -> tuple[bool, str]:
    """(whether this rank's NVSHMEM can reach other nodes, why): NVSHMEM_REMOTE_TRANSPORT=none says no;
    ucx/libfabric are taken at their word; the InfiniBand transports (IBRC, the default, and IBGDA) need an
    HCA in /sys/class/infiniband (InfiniBand or RoCE)."""
    env = os.environ if env is None else env
    chosen = env.get("NVSHMEM_REMOTE_TRANSPORT", "ibrc").strip().lower()
    if chosen == "none":
        return False, "NVSHMEM_REMOTE_TRANSPORT=none"
    if chosen in _NON_IB_TRANSPORTS:
        return True, f"NVSHMEM_REMOTE_TRANSPORT={chosen}"
    try:
        hcas = sorted(os.listdir(ib_sysfs))
    except OSError:
        hcas = []
    if not hcas:
        return False, f"no InfiniBand/RoCE device in {ib_sysfs} (NVSHMEM {chosen.upper()} needs one)"
    gda = " with IBGDA" if env.get("NVSHMEM_IB_ENABLE_IBGDA", "0").strip().lower() in ("1", "true", "yes") else ""
    return True, f"{chosen.upper()}{gda} over {', '.join(hcas[:8])}"


def node_indices(leaders) -> tuple[int, ...]:
    """Node index of every rank from the lowest world rank of its node (its node leader), numbered in order of
    the leaders."""
    order = {lead: i for i, lead in enumerate(sorted(set(int(x) for x in leaders)))}
    return tuple(order[int(x)] for x in leaders)


@dataclass(frozen=True)
class Topology:
    """Nodes and links of a world, the same on every rank (made from allgathered facts).

    node_of[r]: the node of rank r (virtual nodes under FLUXRT_TOPOLOGY=virtual:NxG).
    pointer[r][q]: rank r maps rank q's heap (nvshmem_ptr != 0: NVLink/P2P, NVSHMEM's P2P transport).
    remote[r]: rank r's NVSHMEM has a transport to other nodes; remote_why[r] says which, or why not.
    virtual: the nodes are virtual (one real node split): pointers to another virtual node are not used.
    """

    rank: int
    node_of: tuple[int, ...]
    pointer: tuple[tuple[bool, ...], ...]
    remote: tuple[bool, ...]
    remote_why: tuple[str, ...] = ()
    virtual: bool = False

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of every node, nodes in index order, ranks ascending."""
        return tuple(tuple(r for r in range(self.size) if self.node_of[r] == k) for k in range(self.num_nodes))

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The node-local team: this rank's node."""
        return self.nodes[self.node]

    @property
    def local_index(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def uniform(self) -> bool:
        """Every node has as many ranks."""
        return len({len(n) for n in self.nodes}) == 1

    def nvlink(self, r: int, q: int) -> bool:
        """Whether rank r moves data to q through NVLink pointers: same (virtual) node and a mapping."""
        return r == q or (self.node_of[r] == self.node_of[q] and self.pointer[r][q])

    def nvshmem_peers(self, r: int | None = None) -> tuple[int, ...]:
        """The peers rank r (default: this rank) reaches only through NVSHMEM's device API."""
        r = self.rank if r is None else r
        return tuple(q for q in range(self.size) if not self.nvlink(r, q))

    @property
    def hierarchical(self) -> bool:
        """Some pair of ranks has no NVLink pointer: collectives go node team + NVSHMEM between nodes."""
        return any(self.nvshmem_peers(r) for r in range(self.size))

    def rail(self, r: int | None = None) -> tuple[int, ...]:
        """The ranks with rank r's local index, one per node in node order (r's peers across nodes)."""
        if not self.uniform:
            raise TopologyError(f"nodes of different sizes {[len(n) for n in self.nodes]}: no rails")
        r = self.rank if r is None else r
        i = self.nodes[self.node_of[r]].index(r)
        return tuple(n[i] for n in self.nodes)

    def reachable(self, r: int, q: int) -> tuple[bool, str]:
        """(whether r reaches q by some transport, how or why not)."""
        if r == q:
            return True, "itself"
        if self.nvlink(r, q):
            return True, "NVLink pointer"
        if self.pointer[r][q]:   # another virtual node on the same GPU set: NVSHMEM's P2P transport
            return True, "NVSHMEM P2P transport"
        if self.remote[r] and self.remote[q]:
            return True, "NVSHMEM remote transport"
        why = [f"rank {x}: {self.remote_why[x] if x < len(self.remote_why) else 'no remote transport'}"
               for x in (r, q) if not self.remote[x]]
        where = "on another node" if self.node_of[r] != self.node_of[q] else "on the same node without P2P access"
        return False, f"rank {q} is {where} and has no NVLink/P2P mapping from rank {r}; " + "; ".join(why)

    def unreachable(self) -> list[tuple[int, int, str]]:
        return [(r, q, why) for r in range(self.size) for q in range(self.size)
                for ok, why in [self.reachable(r, q)] if not ok]

    def check_reachable(self) -> None:
        """Raise TopologyError naming every pair (rank, peer) that no transport connects."""
        bad = self.unreachable()
        if bad:
            shown = "; ".join(f"rank {r} cannot reach rank {q}: {why}" for r, q, why in bad[:8])
            more = f" (and {len(bad) - 8} more pairs)" if len(bad) > 8 else ""
            raise TopologyError(f"{shown}{more}. Enable an NVSHMEM remote transport (docs/multinode.md)")

    def restrict(self, members, rank: int) -> "Topology":
        """The topology of a sub-world of `members` (this topology's ranks, in the sub-world's rank order) seen
        from its rank `rank`: nodes renumbered in order of their lowest member, links as here."""
        members = [int(m) for m in members]
        leaders = [min(q for q in members if self.node_of[q] == self.node_of[m]) for m in members]
        return Topology(rank=int(rank), node_of=node_indices(leaders),
                        pointer=tuple(tuple(self.pointer[a][b] for b in members) for a in members),
                        remote=tuple(self.remote[m] for m in members),
                        remote_why=tuple(self.remote_why[m] for m in members) if self.remote_why else (),
                        virtual=self.virtual)

    def tp_dp_groups(self, tp_size: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(this rank's tensor-parallel group, its data-parallel group), as world ranks: TP groups are
        `tp_size` consecutive ranks of one node (default: the whole node), the DP group the ranks with this
        rank's index in every TP group of the world. Raises TopologyError if `tp_size` does not divide every
        node."""
        sizes = sorted({len(n) for n in self.nodes})
        tp = sizes[0] if tp_size is None else int(tp_size)
        bad = [k for k, n in enumerate(self.nodes) if tp < 1 or len(n) % tp]
        if bad:
            raise TopologyError(f"tp_size={tp} must divide the ranks of every node (nodes have "
                                f"{[len(n) for n in self.nodes]} ranks): a tensor-parallel group stays inside one "
                                "node, whose NVLink its fused ops need")
        groups = [n[i:i + tp] for n in self.nodes for i in range(0, len(n), tp)]
        mine = next(g for g in groups if self.rank in g)
        j = mine.index(self.rank)
        return tuple(mine), tuple(g[j] for g in groups)

    def describe(self) -> list[str]:
        """Lines for logs and ``python -m fluxrt.info``."""
        kind = "virtual" if self.virtual else "from the shared-memory split"
        lines = [f"{self.num_nodes} node(s) ({kind}), {self.size} ranks"]
        for k, members in enumerate(self.nodes):
            lines.append(f"  node {k}: ranks {_ranges(members)}")
        if self.hierarchical:
            lines.append(f"  rank {self.rank}: node team {_ranges(self.local_ranks)} over NVLink; "
                         f"NVSHMEM device API to {_ranges(self.nvshmem_peers())}")
        if self.remote_why:
            lines.append(f"  remote transport (rank {self.rank}): {self.remote_why[self.rank]}")
        return lines


def _ranges(ranks) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def build(rank: int, leaders, pointer, remote, remote_why=(), setting: VirtualNodes | None = None) -> Topology:
    """The topology from allgathered facts: every rank's node leader, its pointer row and remote flag. A
    virtual setting must split real nodes, never join them (a virtual node's ranks share a real node)."""
    size = len(leaders)
    real = node_indices(leaders)
    if setting is None:
        node_of, virtual = real, False
    else:
        node_of, virtual = setting.node_of(size), True
        for k in range(setting.nodes):
            members = [r for r in range(size) if node_of[r] == k]
            if len({real[r] for r in members}) > 1:
                raise TopologyError(f"{ENV}=virtual:{setting.nodes}x{setting.ranks_per_node}: virtual node {k} "
                                    f"(ranks {_ranges(members)}) spans real nodes; virtual nodes split one node")
    ptr = tuple(tuple(bool(v) for v in row) for row in pointer)
    return Topology(rank=rank, node_of=tuple(node_of), pointer=ptr, remote=tuple(bool(v) for v in remote),
                    remote_why=tuple(remote_why), virtual=virtual)


def discover(world, node_leader: int, setting: VirtualNodes | None = None) -> Topology:
    """Collective (world init): allgather every rank's node leader, its heap mappings of every peer and its
    remote transport, and build the topology. Raises TopologyError (same on every rank) when the setting
    does not fit or a pair of ranks has no transport."""
    from nvshmem import bindings

    probe = world.heap.empty((1,), "uint64")
    try:
        mine = [bool(bindings.ptr(probe.data.ptr, q)) for q in range(world.size)]
    finally:
        world.heap.free(probe)
    has_remote, why = remote_transport()
    facts = world.comm.allgather((node_leader, mine, has_remote, why))
    topo = build(world.rank, [f[0] for f in facts], [f[1] for f in facts], [f[2] for f in facts],
                 [f[3] for f in facts], setting)
    topo.check_reachable()
    return topo


def single(rank: int = 0) -> Topology:
    """One rank on one node (worlds made by tests without a communicator)."""
    return Topology(rank=rank, node_of=(0,), pointer=((True,),), remote=(False,), remote_why=("",))


def require_one_domain(world, op: str, error=TopologyError) -> None:
    """Refuse, before anything is allocated or launched, an op whose kernels need NVLink pointers between every
    pair of ranks on a world without them (several nodes, or ``FLUXRT_TOPOLOGY=virtual:NxG``). The topology is
    the same on every rank, so every rank raises."""
    topo = getattr(world, "topology", None)
    if topo is None or not topo.hierarchical:
        return
    kind = "virtual " if topo.virtual else ""
    raise error(f"{op} runs over NVLink pointers between every pair of ranks; this world has {topo.num_nodes} "
                f"{kind}nodes (ranks {_ranges(topo.nvshmem_peers())} are reached only through NVSHMEM from rank "
                f"{topo.rank}). Run it on a world of one node: tp, dp = fluxrt.topology.tp_dp_split(world) gives the "
                "node's ranks (tensor parallel, for this op) and the ranks across nodes (data parallel, for "
                "allreduce, reduce_scatter, allgather, alltoall and broadcast; docs/multinode.md)")


def tp_dp_split(world, tp_size: int | None = None, *, pool_bytes=None):
    """Collective: (tp_world, dp_world), sub-worlds of `world` for tensor parallelism inside a node and data
    parallelism across nodes. tp_world: `tp_size` consecutive ranks of this rank's node (default: the whole
    node), one NVLink domain, where the fused ops run; dp_world: the ranks with this rank's TP index in every
    TP group of the world (one per node with the default), whose collectives take the hierarchical path when
    they span nodes. Both share the process's NVSHMEM heap (``world.split``; `pool_bytes` sizes the sub-world
    pool at the first split). On a world of one node: the TP group is the node, the DP group this rank alone
    (or every rank's peer with the same index when ``tp_size`` is smaller)."""
    topo = getattr(world, "topology", None)
    if topo is None:
        topo = single(world.rank) if world.size == 1 else Topology(
            rank=world.rank, node_of=(0,) * world.size, pointer=((True,) * world.size,) * world.size,
            remote=(False,) * world.size, remote_why=("",) * world.size)
    tp, dp = topo.tp_dp_groups(tp_size)
    tp_world = world.split(tp[0], key=world.rank, pool_bytes=pool_bytes)
    dp_world = world.split(tp.index(world.rank), key=world.rank)
    return tp_world, dp_world


__all__ = ["ENV", "Topology", "TopologyError", "VirtualNodes", "build", "discover", "node_indices", "parse_setting",
           "remote_transport", "require_one_domain", "setting_from_env", "single", "tp_dp_split"]
