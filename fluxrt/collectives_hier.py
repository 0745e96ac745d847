"""Hierarchical collectives: NVLink inside a node, NVSHMEM's device API between nodes.

Chosen by ``collectives_plan.choose_path`` when the world's topology (``fluxrt.topology``) has ranks without
NVLink pointers to each other (several nodes, or ``FLUXRT_TOPOLOGY=virtual:NxG`` on one node). The world is
seen as nodes of G ranks and rails (the ranks with the same local index, one per node):

    allreduce       reduce-scatter in the node (the NVLink collectives on the node team)
                    -> allreduce of each rank's shard along its rail (NVSHMEM put-with-signal, bounded wait,
                       fixed node order) -> all-gather in the node
    reduce_scatter  reduce-scatter along the rail of the node blocks (G chunks each) -> reduce-scatter in the node
    allgather       all-gather in the node -> all-gather of the node's block along the rail
    alltoall(v)     all-to-all in the node of the chunks regrouped by destination local index -> one block per
                    remote node along the rail (alltoallv: byte layout from the count matrix agreed on the host)

Each rail round (kernels/comm/nvshmem_hier.cu) puts one piece from the symmetric send buffer into every rail
member's receive slot and raises one signal word per put block; the receivers wait for all of them (bounded
by the world's timeout, naming the rank that never signalled) and reduce the slots in node order 0, 1, ...,
so every rank gets bitwise the same allreduce result. Sources are staged in symmetric memory because the
InfiniBand transports put only from registered memory.

The node stages run the NVLink collectives on a ``NodeTeam``: the node's ranks as a world of their own,
whose symmetric arrays map only the node's members. Epochs of the rail rounds are counted on the host, so
these calls are not graph-capturable.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .agreement import agree as _agree
from .agreement import barrier as _barrier
from .agreement import local as _local
from .collectives import (CollectiveHandle, Collectives, CollectivesOptions, _as_array, _check_alias,
                          _displs, _move_dtype, _reduce_dtype, _redop, alltoallv_local_args)
from .errors import CollectiveArgumentError, CollectiveMismatchError, FluxrtError, GraphCaptureError, op_id
from .nvtx import annotate as _nvtx
from .packed_launch import PackedLaunch
from .registry import Registry
from .streams import as_cupy_stream
from .symmetric import _Allocation

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger(__name__)

KERNEL_SOURCE = "comm/nvshmem_hier.cu"
KEY = "fluxrt.collectives.hierarchical"
MAX_NODES = 64        # remote::kMaxRailNodes
MAX_PUT_BLOCKS = 32   # remote::kMaxRailBlocks
THREADS = 512
VEC = 16
ONESHOT_BYTES = 256 << 10   # rail allreduce: one round up to this shard size (a latency choice; not measured)
SEGMENT_BYTES = 64 << 10    # alltoallv copy tables: entries cut to this so that the blocks share long segments
_PES_DTYPE = np.dtype([("pe", "<i4", (MAX_NODES,))])   # struct RailPes, by value
_BYTES_DTYPE = np.dtype([("n", "<u8", (MAX_NODES,))])  # struct RailBytes, by value
RAIL_DTYPES = ("bf16", "fp16", "fp32")   # the rail reduce kernels (kernels/comm/nvshmem_hier.cu)
RAIL_OPS = ("sum", "max", "min")
_u64, _u32 = np.uint64, np.uint32


@dataclass(frozen=True)
class HierarchicalOptions:
    """rail_bytes: symmetric receive buffer per rank, two halves of `nodes` slots (a rail round moves at most
    one slot per member; larger messages go in several rounds); the send buffer is one half more.
    put_blocks: blocks (and signal words) per rail member of a round; reduce_blocks: blocks of the reduce.
    oneshot_bytes: the rail allreduce of a shard up to this size is one round (``rail_allreduce_algo``; None:
    its rule).
    node: options of the node team's NVLink collectives."""

    rail_bytes: int = 64 << 20
    put_blocks: int = 8
    reduce_blocks: int = 64
    oneshot_bytes: int | None = None
    node: CollectivesOptions | None = None


def rail_geometry(rail_bytes: int, nodes: int) -> tuple[int, int]:
    """(half_bytes, slot_bytes) of the receive buffer: two halves of `nodes` slots of whole 16-byte vectors."""
    slot = (int(rail_bytes) // 2 // nodes) // VEC * VEC
    if slot < VEC:
        raise CollectiveArgumentError(f"rail_bytes={rail_bytes} is too small for {nodes} nodes")
    return slot * nodes, slot


def rail_pieces(nbytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of the rail rounds of an `nbytes` message: at least one round (every member takes part
    in every round, even an empty one), each at most a slot."""
    if nbytes <= 0:
        return [(0, 0)]
    return [(s, min(slot_bytes, nbytes - s)) for s in range(0, nbytes, slot_bytes)]


def put_grid(nbytes: int, put_blocks: int) -> int:
    """Blocks per rail member of a round: at most `put_blocks`, at least 64 KiB each (one for small pieces)."""
    return max(1, min(int(put_blocks), MAX_PUT_BLOCKS, math.ceil(nbytes / (64 << 10))))


def reduce_grid(nvec: int, reduce_blocks: int) -> int:
    return max(1, min(int(reduce_blocks), math.ceil(nvec / (4 * THREADS))))


def shard_elems(count: int, ranks_per_node: int, itemsize: int, nodes: int = 1) -> int:
    """Elements of each rank's shard of an allreduce of `count` over nodes of `ranks_per_node` ranks: whole
    16-byte vectors, `nodes` chunks of them (the rail's reduce-scatter), the message padded up to G shards."""
    unit = max(1, VEC // itemsize) * nodes
    return max(unit, math.ceil(math.ceil(count / ranks_per_node) / unit) * unit)


def rail_allreduce_algo(shard_bytes: int, nodes: int, oneshot_bytes: int | None = None) -> str:
    """'oneshot' (every member puts its whole shard to every member: one round, (N-1) shards sent) or 'rs_ag'
    (reduce-scatter, then all-gather along the rail: two rounds, 2 (N-1) / N shards sent). oneshot_bytes None:
    one-shot on 2 nodes (as many bytes as the two rounds) and for shards up to ONESHOT_BYTES; otherwise
    one-shot exactly up to `oneshot_bytes`."""
    if oneshot_bytes is None:
        return "oneshot" if nodes <= 2 or shard_bytes <= ONESHOT_BYTES else "rs_ag"
    return "oneshot" if shard_bytes <= oneshot_bytes else "rs_ag"


# ------------------------------------------------------------------------------------------ the node team
class _TeamHeap:
    """The world's heap seen from a node team: the same allocations, peer tables of the members only."""

    def __init__(self, heap, members: tuple[int, ...], team: "NodeTeam"):
        self._heap, self.members, self.world = heap, members, team
        self._allocs: dict[int, _Allocation] = {}

    def find(self, ptr: int, nbytes: int):
        a = self._heap.find(ptr, nbytes)
        if a is None:
            return None
        t = self._allocs.get(a.base)
        if t is None or t.nbytes != a.nbytes:
            t = self._allocs[a.base] = _Allocation(a.base, a.nbytes, [a.peer_bases[m] for m in self.members])
        return t


class NodeTeam:
    """One node's ranks as a world of their own, for the NVLink collectives: rank is the local index and
    symmetric arrays map only the members. Symmetric allocation stays world-collective (nvshmem_malloc is),
    so every node's team allocates in the same order at the same time."""

    def __init__(self, world: World, members: tuple[int, ...], comm):
        self.world, self.members = world, tuple(members)
        self.rank, self.size = self.members.index(world.rank), len(self.members)
        self.comm, self.agree_comm = comm, comm.Dup()
        self.options, self.device, self.device_id = world.options, world.device, world.device_id
        self.error_record = world.error_record
        self.registry = Registry()
        self.heap = _TeamHeap(world.heap, self.members, self)

    @property
    def timeout_ns(self) -> int:
        return self.world.timeout_ns

    @property
    def active(self) -> bool:
        return self.world.active

    def check_active(self) -> None:
        self.world.check_active()

    def check_errors(self) -> None:
        self.world.check_errors()

    def empty(self, shape, dtype="float32"):
        arr = self.world.heap.empty(shape, dtype)
        arr._heap = self.heap
        return arr

    def zeros(self, shape, dtype="float32"):
        import cupy

        arr = self.empty(shape, dtype)
        cupy.cuda.runtime.memset(arr.data.ptr, 0, arr.nbytes)
        self.device.synchronize()
        _barrier(self.world, "world.zeros")
        return arr

    def free(self, arr) -> None:
        arr._heap = self.world.heap
        self.world.heap.free(arr)

    def close(self) -> None:
        self.registry.close()
        self.agree_comm.Free()
        self.comm.Free()


# ------------------------------------------------------------------------------------------ the context
class HierarchicalCollectives:
    """Per-world state of the hierarchical path: the node team's NVLink collectives, the rail's symmetric
    send and receive buffers, its signal words and the NVSHMEM-API kernels. Collective to create."""

    def __init__(self, world: World, options: HierarchicalOptions | None = None):
        import cupy

        from .toolchain import load_nvshmem_module

        world.check_active()
        topo = world.topology
        if not topo.uniform:
            raise CollectiveArgumentError(f"hierarchical collectives need nodes of equal size, got "
                                          f"{[len(n) for n in topo.nodes]} ranks per node")
        if topo.num_nodes > MAX_NODES:
            raise CollectiveArgumentError(f"hierarchical collectives support up to {MAX_NODES} nodes, got "
                                          f"{topo.num_nodes}")
        self.world, self.options = world, options or HierarchicalOptions()
        self.nodes, self.ranks_per_node = topo.num_nodes, len(topo.local_ranks)
        self.node_index, self.rail = topo.node, topo.rail()
        self.team = NodeTeam(world, topo.local_ranks, world.comm.Split(topo.node, key=world.rank))
        self.node = Collectives(self.team, self.options.node) if self.ranks_per_node > 1 else None
        self.half_bytes, self.slot_bytes = rail_geometry(self.options.rail_bytes, self.nodes)
        self.recv = world.empty((2 * self.half_bytes,), np.uint8)
        self.send = world.empty((self.half_bytes,), np.uint8)
        self.sig = world.zeros((2 * MAX_NODES * MAX_PUT_BLOCKS,), np.uint64)   # zero: no round yet
        self.module = load_nvshmem_module(KERNEL_SOURCE)
        self._put = self.module.get_function("fluxrt_rail_put")
        self._gather = self.module.get_function("fluxrt_rail_gather")
        self._putv = self.module.get_function("fluxrt_rail_putv")
        self._gather_segments = self.module.get_function("fluxrt_rail_gather_segments")
        self._copy_segments = self.module.get_function("fluxrt_copy_segments")
        self._pes = np.zeros(1, _PES_DTYPE)
        self._pes["pe"][0, :self.nodes] = [world.pe(r) for r in self.rail]   # a sub-world's rank is not its PE
        self._all = (1 << self.nodes) - 1   # put and copy masks: every rail member
        self.epoch = 0
        self.side_stream = cupy.cuda.Stream(non_blocking=True)
        self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        self._last_stream = None
        self._freed = False
        world.device.synchronize()
        if KEY not in world.registry:   # the first one made is the world's (as Collectives)
            world.registry.put(KEY, self, teardown=HierarchicalCollectives.free)
        if world.rank == 0:
            log.info("collectives: hierarchical, %d nodes x %d ranks; node team over NVLink, rails over NVSHMEM "
                     "(%d-byte slots)", self.nodes, self.ranks_per_node, self.slot_bytes)

    def prepare(self, dtypes=(), ops=("sum",)) -> None:
        """``fluxrt.prepare`` on a world of several nodes: refuse now the reductions the rail kernels do not have
        (they are all loaded with the context). Local."""
        for d in dtypes:
            for o in ops:
                check_rail_reduction(_reduce_dtype(d), _redop(o))

    def free(self) -> None:
        """Collective: release the node team's context and the rail buffers."""
        if self._freed:
            return
        self._freed = True
        if self.world.active:
            self.team.close()   # the node context's teardown frees its symmetric memory
            for a in (self.sig, self.send, self.recv):
                self.world.free(a)
        if self.world.registry.get(KEY) is self:
            self.world.registry.pop(KEY)

    # --- plumbing ---------------------------------------------------------------------------------
    def _begin(self, stream, async_op: bool):
        """The stream the call runs on (the side stream after `stream` for async calls), ordered after the
        previous call, which shares the rail buffers."""
        world = self.world
        if self._freed or not world.active:
            world.check_active()
            raise FluxrtError("this hierarchical collectives context has been freed")
        world.check_errors()
        caller = as_cupy_stream(stream)
        s = caller
        if async_op:
            self._events[0].record(caller)
            s = self.side_stream
            s.wait_event(self._events[0])
        last = self._last_stream
        if last is not None and last.ptr != s.ptr:
            self._events[1].record(last)
            s.wait_event(self._events[1])
        self._last_stream = s
        return caller, s

    def _end(self, s, async_op: bool, result, keep):
        import cupy

        if not async_op:
            return result
        done = cupy.cuda.Event(disable_timing=True)
        done.record(s)
        return CollectiveHandle(self.world, done, result, keep)

    def _rail_put(self, s, src_stride: int, nbytes: int, put_mask: int | None = None) -> tuple[int, int]:
        """One rail round's puts from the send buffer (member d's piece at send + d * src_stride) to the members
        in `put_mask` (bit d: member d; None: all); the others get the round's signal alone. `nbytes` must be
        the same on every member (it sets the round's blocks). Returns (epoch, blocks per member)."""
        self.epoch += 1
        blocks = put_grid(nbytes, self.options.put_blocks)
        mask = self._all if put_mask is None else put_mask
        args = (self._pes, _u32(self.node_index), _u32(blocks), _u64(self.send.data.ptr), _u64(src_stride),
                _u64(nbytes), _u64(self.recv.data.ptr), _u64(self.half_bytes), _u64(self.slot_bytes),
                _u64(self.sig.data.ptr), _u64(self.epoch), _u64(mask))
        PackedLaunch(self._put, blocks * self.nodes, THREADS, args).launch(s.ptr)
        return self.epoch, blocks

    def _rail_gather(self, s, e: int, blocks: int, out_ptr: int, out_stride: int, nbytes: int, copy_mask: int,
                     name: str) -> None:
        """Wait (bounded, named `name`) for round e's signals from every member, then copy the slots in
        `copy_mask` to out_ptr + p * out_stride (0: the wait alone)."""
        args = (self._pes, _u32(self.nodes), _u32(blocks), _u64(self.recv.data.ptr), _u64(self.half_bytes),
                _u64(self.slot_bytes), _u64(self.sig.data.ptr), _u64(e), _u64(out_ptr), _u64(out_stride),
                _u64(nbytes), _u64(copy_mask)) + self._watch(name)
        grid = max(1, min(self.options.reduce_blocks, math.ceil(nbytes / (64 << 10)))) if copy_mask else 1
        PackedLaunch(self._gather, grid, THREADS, args).launch(s.ptr)

    def _watch(self, name: str) -> tuple:
        w = self.world
        return _u64(w.timeout_ns), _u64(w.error_record), _u32(op_id(name)), _u32(w.rank)

    def _reduce_launch(self, fn, e: int, blocks: int, out_ptr: int, count: int, nbytes: int, name: str) -> tuple:
        return (fn, reduce_grid(nbytes // VEC, self.options.reduce_blocks),
                (self._pes, _u32(self.nodes), _u32(blocks), _u64(self.recv.data.ptr), _u64(self.half_bytes),
                 _u64(self.slot_bytes), _u64(self.sig.data.ptr), _u64(e), _u64(out_ptr), _u64(count))
                + self._watch(name))

    def _rail_oneshot(self, buf, dt: str, red: str, s, name: str) -> None:
        """buf (whole 16-byte vectors) <- its reduction along the rail, in place, in node order: every member
        puts its whole buffer to every member and reduces all of them."""
        import cupy

        fn = self.module.get_function(f"fluxrt_rail_reduce_{dt}_{red}")
        for start, nbytes in rail_pieces(buf.nbytes, self.slot_bytes):
            if nbytes:
                cupy.cuda.runtime.memcpyAsync(self.send.data.ptr, buf.data.ptr + start, nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            e, blocks = self._rail_put(s, 0, nbytes)
            f, grid, args = self._reduce_launch(fn, e, blocks, buf.data.ptr + start, nbytes // buf.itemsize, nbytes,
                                                name)
            PackedLaunch(f, grid, THREADS, args).launch(s.ptr)

    def _rail_reduce_scatter(self, src, out, dt: str, red: str, s, name: str) -> None:
        """out (q elements, contiguous) <- the reduction over the rail of every member's src[me], in node
        order; src: (nodes, q), row d going to member d (may be strided)."""
        import cupy

        fn = self.module.get_function(f"fluxrt_rail_reduce_{dt}_{red}")
        isz, q = out.itemsize, out.size
        for start, nbytes in rail_pieces(q * isz, self.slot_bytes):
            elems, st = nbytes // isz, start // isz
            stride = -(-nbytes // VEC) * VEC   # every member's piece starts 16-byte aligned in the send buffer
            if elems:
                view = cupy.ndarray((self.nodes, stride // isz), out.dtype, self.send.data)[:, :elems]
                view[...] = src[:, st:st + elems]
            e, blocks = self._rail_put(s, stride, nbytes)
            f, grid, args = self._reduce_launch(fn, e, blocks, out.data.ptr + start, elems, nbytes, name)
            PackedLaunch(f, grid, THREADS, args).launch(s.ptr)

    def _rail_allgather(self, out_ptr: int, block_bytes: int, s, name: str) -> None:
        """The rail's all-gather of blocks of `block_bytes` at out_ptr + d * block_bytes: this member's block d
        = node index is in place; the others arrive from their members."""
        import cupy

        mine = out_ptr + self.node_index * block_bytes
        others = self._all & ~(1 << self.node_index)
        for start, nbytes in rail_pieces(block_bytes, self.slot_bytes):
            if nbytes:
                cupy.cuda.runtime.memcpyAsync(self.send.data.ptr, mine + start, nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            e, blocks = self._rail_put(s, 0, nbytes, others)
            self._rail_gather(s, e, blocks, out_ptr + start, block_bytes, nbytes, others, name)

    def _rail_allreduce(self, buf, dt: str, red: str, s, name: str) -> str:
        """buf (nodes chunks of whole 16-byte vectors) <- its reduction along the rail, in place, every member
        the same bits; returns the algorithm (``rail_allreduce_algo``)."""
        import cupy

        algo = rail_allreduce_algo(buf.nbytes, self.nodes, self.options.oneshot_bytes)
        if algo == "oneshot":
            self._rail_oneshot(buf, dt, red, s, name)
            return algo
        q = buf.size // self.nodes
        reduced = cupy.empty(q, buf.dtype)
        self._rail_reduce_scatter(buf.reshape(self.nodes, q), reduced, dt, red, s, name)
        buf[self.node_index * q:(self.node_index + 1) * q] = reduced
        self._rail_allgather(buf.data.ptr, q * buf.itemsize, s, name)
        return algo

    def _output(self, out, dtype, count: int, shape, op: str, stream):
        import cupy

        if out is None:
            return cupy.empty(shape, dtype=dtype)
        o = _as_array(out, "out", op, self.world, stream, writable=True)
        if o.dtype != dtype:
            raise CollectiveArgumentError(f"out has dtype {o.dtype}, the input {dtype}")
        if o.size < count:
            raise CollectiveArgumentError(f"out too small: {o.size} elements, the result needs {count}")
        return o

    # --- collectives ------------------------------------------------------------------------------
    @_nvtx("hier.allreduce")
    def allreduce(self, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False, algo: str = "auto",
                  compress: str | None = None, error_feedback=None):
        """As ``Collectives.allreduce``: node reduce-scatter, rail allreduce over NVSHMEM, node all-gather.
        The sum runs over the node's ranks first, then over nodes in node order (every rank the same bits)."""
        import cupy

        world, g = self.world, self.ranks_per_node
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("allreduce", s0, algo, compress, error_feedback)
            a = _as_array(x, "x", "allreduce", world, s0)
            dt, red = _reduce_dtype(a.dtype), _redop(op)
            check_rail_reduction(dt, red)
            o = self._output(out, a.dtype, a.size, a.shape, "allreduce", s0)
            _check_alias("allreduce", a, o, (0,))
            return a, o, dt, red

        got, err = _local(prepare)
        _agree(world, "allreduce", (("count", None if got is None else got[0].size),
                                    ("dtype", None if got is None else got[2]),
                                    ("op", None if got is None else got[3]), ("algo", "hierarchical")), err)
        a, o, dt, red = got
        caller, s = self._begin(stream, async_op)
        with s:
            count, isz = a.size, a.itemsize
            shard = shard_elems(count, g, isz, self.nodes)
            flat = a.reshape(-1)
            if shard * g == count:
                xin = flat
            else:
                xin = cupy.zeros(shard * g, a.dtype)
                xin[:count] = flat
            mine = cupy.empty(shard, a.dtype)
            if self.node is not None:
                self.node.reduce_scatter(xin, mine, op=op, stream=s)
            else:
                mine[...] = xin
            rail_algo = self._rail_allreduce(mine, dt, red, s, "hier.allreduce")
            o_flat = o.reshape(-1)
            if self.node is None:
                o_flat[:count] = mine[:count]
            elif shard * g == count:
                self.node.allgather(mine, o_flat, stream=s)
            else:
                full = cupy.empty(shard * g, a.dtype)
                self.node.allgather(mine, full, stream=s)
                o_flat[:count] = full[:count]
        log.info("rank %d: hierarchical allreduce of %d x %s: node reduce-scatter, rail allreduce (%s) of %d, "
                 "node all-gather", world.rank, count, a.dtype, rail_algo, shard)
        return self._end(s, async_op, o, (a, o))

    @_nvtx("hier.reduce_scatter")
    def reduce_scatter(self, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False,
                       algo: str = "auto", compress: str | None = None, error_feedback=None):
        """As ``Collectives.reduce_scatter``: the rail reduce-scatters the node blocks (G chunks each), then the
        node reduce-scatters its block."""
        import cupy

        world, n, g, nodes = self.world, self.world.size, self.ranks_per_node, self.nodes
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("reduce_scatter", s0, algo, compress, error_feedback)
            a = _as_array(x, "x", "reduce_scatter", world, s0)
            dt, red = _reduce_dtype(a.dtype), _redop(op)
            check_rail_reduction(dt, red)
            if a.size % n:
                raise CollectiveArgumentError(f"reduce_scatter: x has {a.size} elements, not a multiple of {n} ranks")
            c = a.size // n
            shape = (a.shape[0] // n, *a.shape[1:]) if a.ndim and a.shape[0] % n == 0 else (c,)
            o = self._output(out, a.dtype, c, shape, "reduce_scatter", s0)
            _check_alias("reduce_scatter", a, o, (-world.rank * c * a.itemsize,))
            return a, o, dt, red, c

        got, err = _local(prepare)
        _agree(world, "reduce_scatter", (("count", None if got is None else got[0].size),
                                         ("dtype", None if got is None else got[2]),
                                         ("op", None if got is None else got[3]), ("algo", "hierarchical")), err)
        a, o, dt, red, c = got
        caller, s = self._begin(stream, async_op)
        with s:
            block = g * c                         # elements of one node's block
            xb = a.reshape(-1).reshape(nodes, block)
            mine = cupy.empty(block, a.dtype)      # this node's block, reduced along the rail
            self._rail_reduce_scatter(xb, mine, dt, red, s, "hier.reduce_scatter")
            o_flat = o.reshape(-1)
            if self.node is not None:
                self.node.reduce_scatter(mine, o_flat[:c], op=op, stream=s)
            else:
                o_flat[:c] = mine
        log.info("rank %d: hierarchical reduce_scatter of %d x %s: rail reduce-scatter of %d node blocks, node "
                 "reduce-scatter of %d", world.rank, a.size, a.dtype, nodes, block)
        return self._end(s, async_op, o, (a, o))

    @_nvtx("hier.allgather")
    def allgather(self, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto",
                  compress: str | None = None, error_feedback=None):
        """As ``Collectives.allgather``: the node gathers its block into out, then the rail exchanges blocks."""
        world, n, g = self.world, self.world.size, self.ranks_per_node
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("allgather", s0, algo, compress, error_feedback)
            a = _as_array(x, "x", "allgather", world, s0)
            _move_dtype(a.dtype)
            shape = (n * a.shape[0], *a.shape[1:]) if a.ndim else (n,)
            o = self._output(out, a.dtype, n * a.size, shape, "allgather", s0)
            _check_alias("allgather", a, o, (world.rank * a.nbytes,))
            return a, o

        got, err = _local(prepare)
        _agree(world, "allgather", (("count", None if got is None else got[0].size),
                                    ("dtype", None if got is None else got[0].dtype.str),
                                    ("algo", "hierarchical")), err)
        a, o = got
        caller, s = self._begin(stream, async_op)
        with s:
            block_bytes = g * a.nbytes
            o_bytes = o.reshape(-1).view(np.uint8)
            mine = o_bytes[self.node_index * block_bytes:(self.node_index + 1) * block_bytes]
            if self.node is not None:
                self.node.allgather(a.reshape(-1).view(np.uint8), mine, stream=s)
            elif mine.data.ptr != a.data.ptr:
                mine[...] = a.reshape(-1).view(np.uint8)
            self._rail_allgather(o_bytes.data.ptr, block_bytes, s, "hier.allgather")
        log.info("rank %d: hierarchical allgather of %d x %s: node all-gather, rail all-gather of %d-byte node "
                 "blocks", world.rank, a.size, a.dtype, block_bytes)
        return self._end(s, async_op, o, (a, o))

    @_nvtx("hier.alltoall")
    def alltoall(self, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto"):
        """As ``Collectives.alltoall``, in two phases (the PXN scheme): an all-to-all inside the node gives
        rank (k, i) (node k, local index i) every chunk its node sends to rank i of every node; then one rail
        round per slot puts to each rail member d the G chunks node k sends to rank (d, i), which land in out
        in world-rank order. Every byte crosses the rail once, in one put per remote node."""
        import cupy

        world, n, g, nodes = self.world, self.world.size, self.ranks_per_node, self.nodes
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("alltoall", s0, algo)
            a = _as_array(x, "x", "alltoall", world, s0)
            _move_dtype(a.dtype)
            if a.size % n:
                raise CollectiveArgumentError(f"alltoall: x has {a.size} elements, not a multiple of {n} ranks")
            o = self._output(out, a.dtype, a.size, a.shape, "alltoall", s0)
            _check_alias("alltoall", a, o, (0,))
            return a, o

        got, err = _local(prepare)
        _agree(world, "alltoall", (("count", None if got is None else got[0].size),
                                   ("dtype", None if got is None else got[0].dtype.str),
                                   ("algo", "hierarchical")), err)
        a, o = got
        caller, s = self._begin(stream, async_op)
        with s:
            c = a.size // n
            if c:
                # y[j] = the chunks for local index j on every node (N chunks); after the node's all-to-all,
                # z[j] = what local rank j sends to rank i of every node
                y = alltoall_node_input(a, nodes, g, cupy)
                if self.node is not None:
                    z = cupy.empty_like(y)
                    self.node.alltoall(y.reshape(-1), z.reshape(-1), stream=s)
                else:
                    z = y
                w = alltoall_rail_blocks(z, nodes, g, cupy).view(np.uint8)   # w[d]: to rail member d
                o_bytes = o.reshape(-1).view(np.uint8)
                self._rail_exchange(w, o_bytes, s, "hier.alltoall")
        log.info("rank %d: hierarchical alltoall of %d x %s: node all-to-all, rail exchange of %d-byte blocks",
                 world.rank, a.size, a.dtype, g * (a.size // n) * a.itemsize)
        return self._end(s, async_op, o, (a, o))

    def _rail_exchange(self, w, o_bytes, s, name: str) -> None:
        """The rail's all-to-all of byte blocks: w (nodes, B) row d goes to member d and lands in member d's
        o_bytes at node_index * B; this member's own row is copied locally."""
        import cupy

        nodes, me = self.nodes, self.node_index
        block = w.shape[1]
        o_bytes[me * block:(me + 1) * block] = w[me]
        others = self._all & ~(1 << me)
        for start, nbytes in rail_pieces(block, self.slot_bytes):
            stride = -(-nbytes // VEC) * VEC   # every member's piece starts 16-byte aligned in the send buffer
            if nbytes:
                view = cupy.ndarray((nodes, stride), np.uint8, self.send.data)[:, :nbytes]
                view[...] = w[:, start:start + nbytes]
            e, blocks = self._rail_put(s, stride, nbytes, others)
            self._rail_gather(s, e, blocks, o_bytes.data.ptr + start, block, nbytes, others, name)

    @_nvtx("hier.broadcast")
    def broadcast(self, x, out=None, *, root: int = 0, stream=None, async_op: bool = False, algo: str = "auto"):
        """As ``Collectives.broadcast``: the root puts x to its rail (one rank of every node, the ranks with the
        root's local index) over NVSHMEM, then every node broadcasts from that rank over NVLink."""
        world, n = self.world, self.world.size
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("broadcast", s0, algo)
            if not 0 <= int(root) < n:
                raise CollectiveArgumentError(f"broadcast: root {root} outside world of size {n}")
            a = _as_array(x, "x", "broadcast", world, s0, writable=out is None)
            _move_dtype(a.dtype)
            o = a if out is None else self._output(out, a.dtype, a.size, a.shape, "broadcast", s0)
            _check_alias("broadcast", a, o, (0,))
            return a, o

        got, err = _local(prepare)
        _agree(world, "broadcast", (("count", None if got is None else got[0].size),
                                    ("dtype", None if got is None else got[0].dtype.str), ("root", int(root)),
                                    ("algo", "hierarchical")), err)
        a, o = got
        topo, r0 = world.topology, int(root)
        root_node, root_local = topo.node_of[r0], topo.nodes[topo.node_of[r0]].index(r0)
        caller, s = self._begin(stream, async_op)
        with s:
            o_bytes = o.reshape(-1).view(np.uint8)
            if world.rank == r0 and o.data.ptr != a.data.ptr:
                o_bytes[...] = a.reshape(-1).view(np.uint8)
            if topo.local_index == root_local:   # the root's rail: NVSHMEM from the root to one rank per node
                self._rail_broadcast(o_bytes, root_node, s, "hier.broadcast")
            if self.node is not None:
                self.node.broadcast(o.reshape(-1), root=root_local, stream=s)
        log.info("rank %d: hierarchical broadcast of %d x %s from rank %d: rail from node %d, node broadcast from "
                 "local rank %d", world.rank, a.size, a.dtype, r0, root_node, root_local)
        return self._end(s, async_op, o, (a, o))

    def _rail_broadcast(self, buf, root_node: int, s, name: str) -> None:
        """buf (bytes) of rail member root_node to every member, in place: the root puts, the others send the
        round's signals alone (the buffer halves need every member's signal in every round)."""
        import cupy

        me = self.node_index
        for start, nbytes in rail_pieces(buf.nbytes, self.slot_bytes):
            if me == root_node:
                if nbytes:
                    cupy.cuda.runtime.memcpyAsync(self.send.data.ptr, buf.data.ptr + start, nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
                e, blocks = self._rail_put(s, 0, nbytes, self._all & ~(1 << me))
                self._rail_gather(s, e, blocks, 0, 0, nbytes, 0, name)
            else:
                e, blocks = self._rail_put(s, 0, nbytes, 0)
                self._rail_gather(s, e, blocks, buf.data.ptr + start, 0, nbytes, 1 << root_node, name)

    def rail_round(self, nbytes: int, peer_mask: int | None = None, stream=None, name: str = "hier.rail_round"):
        """One bare rail round (for ``fluxrt-perf remote_rate`` and tests): put `nbytes` (at most a slot) from the
        send buffer to the members in `peer_mask` (default: every other member) and wait (bounded) for every
        member's signals; nothing is copied out (the data stays in the receive slots). Collective over the
        rail. Returns (epoch, blocks)."""
        if nbytes > self.slot_bytes:
            raise CollectiveArgumentError(f"rail_round: {nbytes} bytes exceed a slot ({self.slot_bytes})")
        self.world.check_errors()
        s = as_cupy_stream(stream)
        mask = self._all & ~(1 << self.node_index) if peer_mask is None else int(peer_mask)
        e, blocks = self._rail_put(s, 0, nbytes, mask)
        self._rail_gather(s, e, blocks, 0, 0, nbytes, 0, name)
        return e, blocks

    def received(self, epoch: int, member: int, nbytes: int):
        """The bytes rail member `member` put in round `epoch` (a view of the receive slot; valid until the
        round after next)."""
        import cupy

        start = (epoch & 1) * self.half_bytes + member * self.slot_bytes
        return cupy.ndarray((nbytes,), np.uint8, self.recv.data + start)

    @_nvtx("hier.alltoallv")
    def alltoallv(self, x, send_counts, recv_counts=None, out=None, *, send_displs=None, recv_displs=None,
                  max_count: int | None = None, stream=None, async_op: bool = False, algo: str = "auto"):
        """As ``Collectives.alltoallv``, in the two phases of ``alltoall``. The count matrix is always exchanged
        on the host (every rank's layout of the node and rail stages depends on all of it), so ``max_count``
        only bounds the counts here; recv_counts, when given, are checked against the senders'. Rank (k, i)
        packs x by destination local index, the node's all-to-all-v gives it what its node sends to rank i of
        every node, and the rail rounds move, to each remote member d, the bytes node k sends to rank (d, i)
        (one put per member and round, sized to that pair: no padding crosses nodes); the receiver copies
        them from its slots straight into out at recv_displs."""
        import cupy

        world = self.world
        s0 = as_cupy_stream(stream)

        def prepare():
            _call_checks("alltoallv", s0, algo)
            return alltoallv_local_args(x, send_counts, recv_counts, send_displs, max_count, world, s0)

        got, err = _local(prepare)
        sig = (("dtype", None if got is None else got[0].dtype.str), ("max_count", max_count),
               ("algo", "hierarchical"))
        extra = ([], None) if got is None else (got[1].tolist(), None if got[3] is None else got[3].tolist())
        every = _agree(world, "alltoallv", sig, err, extra=extra)
        a, sc, sd, _ = got
        matrix = check_count_matrix([e[0] for e in every], [e[1] for e in every])
        rc = matrix[:, world.rank].copy()

        def prepare_out():
            rd = _displs(recv_displs, rc, "recv_displs")
            need = int((rd + rc).max(initial=0))
            o = self._output(out, a.dtype, need, (need,), "alltoallv", s0)
            _check_alias("alltoallv", a, o, ())
            return rd, o

        got2, err2 = _local(prepare_out)
        _agree(world, "alltoallv", sig, err2)
        rd, o = got2
        lay = alltoallv_layout(matrix, world.topology.nodes, world.rank, sd, rd, a.itemsize, self.slot_bytes)
        caller, s = self._begin(stream, async_op)
        with s:
            y = cupy.empty(max(1, int(lay.node_send.sum())), a.dtype)
            z = y if self.node is None else cupy.empty(max(1, int(lay.node_recv.sum())), a.dtype)
            first = self.epoch + 1
            send_half = [self.send.data.ptr] * len(lay.rounds)
            recv_half = [self.recv.data.ptr + ((first + r) & 1) * self.half_bytes for r in range(len(lay.rounds))]
            tables = [(lay.pack, y.data.ptr, a.data.ptr), (lay.local, o.data.ptr, z.data.ptr)]
            tables += [(r.stage, p, z.data.ptr) for r, p in zip(lay.rounds, send_half)]
            tables += [(r.recv, o.data.ptr, p) for r, p in zip(lay.rounds, recv_half)]
            dev, spans = upload_tables(tables, cupy)
            pack, local, stage, recv = spans[0], spans[1], spans[2:2 + len(lay.rounds)], spans[2 + len(lay.rounds):]
            self._copy_table(s, dev, pack)
            if self.node is not None:
                self.node.alltoallv(y, lay.node_send, lay.node_recv, z, max_count=lay.node_max, stream=s)
            self._copy_table(s, dev, local)
            for r, rnd in enumerate(lay.rounds):
                self._copy_table(s, dev, stage[r])
                e, blocks = self._rail_putv(s, rnd.put_bytes, rnd.grid_bytes)   # epoch first + r
                self._rail_gather_table(s, e, blocks, dev, recv[r], "hier.alltoallv")
        log.info("rank %d: hierarchical alltoallv of %d x %s: node all-to-all-v, %d rail round(s)", world.rank,
                 int(sc.sum()), a.dtype, len(lay.rounds))
        return self._end(s, async_op, o, (a, o, y, z, dev))

    def _copy_table(self, s, dev, span: tuple[int, int]) -> None:
        start, count = span
        if count:
            grid = max(1, min(self.options.reduce_blocks, count))
            PackedLaunch(self._copy_segments, grid, THREADS,
                         (_u64(dev.data.ptr + 24 * start), _u64(count))).launch(s.ptr)

    def _rail_putv(self, s, put_bytes, grid_bytes: int) -> tuple[int, int]:
        """One rail round of alltoallv: put_bytes[d] bytes from send + d * slot_bytes to member d (0: the signal
        alone). grid_bytes, the largest piece of the round on the whole rail, sets the blocks on every member."""
        self.epoch += 1
        blocks = put_grid(grid_bytes, self.options.put_blocks)
        nbytes = np.zeros(1, _BYTES_DTYPE)
        nbytes["n"][0, :self.nodes] = put_bytes
        args = (self._pes, _u32(self.node_index), _u32(blocks), _u64(self.send.data.ptr), _u64(self.slot_bytes),
                nbytes, _u64(self.recv.data.ptr), _u64(self.half_bytes), _u64(self.slot_bytes),
                _u64(self.sig.data.ptr), _u64(self.epoch))
        PackedLaunch(self._putv, blocks * self.nodes, THREADS, args).launch(s.ptr)
        return self.epoch, blocks

    def _rail_gather_table(self, s, e: int, blocks: int, dev, span: tuple[int, int], name: str) -> None:
        """Wait (bounded, named `name`) for round e's signals from every member, then copy the table's segments
        (out of the receive slots)."""
        start, count = span
        args = (self._pes, _u32(self.nodes), _u32(blocks), _u64(self.sig.data.ptr), _u64(e),
                _u64(dev.data.ptr + 24 * start), _u64(count)) + self._watch(name)
        grid = max(1, min(self.options.reduce_blocks, count))
        PackedLaunch(self._gather_segments, grid, THREADS, args).launch(s.ptr)


def alltoall_node_input(x, nodes: int, g: int, xp):
    """Phase 1's input: x's chunks (one per world rank, node-major) regrouped by destination local index,
    [G, N, c] contiguous, so the node's all-to-all sends local rank j the N chunks for rank j of every node."""
    return xp.ascontiguousarray(x.reshape(nodes, g, -1).transpose(1, 0, 2))


def alltoall_rail_blocks(z, nodes: int, g: int, xp):
    """Phase 2's blocks: z ([G, N, c], row j from local rank j) as [N, G c] contiguous; row d, the G chunks this
    node sends to rank (d, i), goes to rail member d and lands at this node's block of its output."""
    return xp.ascontiguousarray(z.reshape(g, nodes, -1).transpose(1, 0, 2)).reshape(nodes, -1)


@dataclass(frozen=True)
class RailRoundV:
    """One rail round of an alltoallv, seen from one member. Tables: int64 rows (destination offset, source
    offset, bytes). stage: z -> send buffer (member d's piece at d * slot); recv: receive half -> out."""

    put_bytes: np.ndarray   # (nodes,) bytes put to member d (0 for itself)
    grid_bytes: int         # the round's largest piece on the whole rail (sets the put blocks everywhere)
    stage: np.ndarray
    recv: np.ndarray


@dataclass(frozen=True)
class AlltoallvLayout:
    """One rank's byte layout of a two-phase all-to-all-v, computed from the agreed count matrix (so every rank
    of a rail agrees on the rounds and their blocks). Tables as ``RailRoundV``'s.

    y (the node stage's input): for each local index j, for each node d, what this rank sends to rank (d, j).
    z (its output): for each local j, for each node d, what rank (k, j) sends to rank (d, i); the block to rail
    member d is the d parts of every j, in j order, cut into slot-sized rounds."""

    node_send: np.ndarray   # (G,) elements to local rank j in the node stage
    node_recv: np.ndarray   # (G,) elements from local rank j
    node_max: int           # the node stage's largest pair on this node
    pack: np.ndarray        # x -> y
    local: np.ndarray       # z -> out: this node's own block
    rounds: tuple[RailRoundV, ...]


def check_count_matrix(sends, recvs) -> np.ndarray:
    """The count matrix ([p][q]: elements rank p sends to rank q) from every rank's send counts, checked
    against the recv counts the ranks gave (None: not given). Raises CollectiveMismatchError naming pairs."""
    matrix = np.array(sends, dtype=np.int64)
    n = matrix.shape[0]
    bad = [(p, r, int(matrix[p][r]), e[p]) for r, e in enumerate(recvs) if e is not None
           for p in range(n) if e[p] != matrix[p][r]]
    if bad:
        detail = "; ".join(f"rank {p} sends {s} to rank {r}, which expects {e}" for p, r, s, e in bad[:8])
        raise CollectiveMismatchError(f"alltoallv counts do not match across ranks ({detail})")
    return matrix


def _exclusive(c, axis=None):
    """Exclusive running sums (axis None: of the flattened array, in C order, reshaped back)."""
    c = np.asarray(c, dtype=np.int64)
    if axis is None:
        return (np.cumsum(c.reshape(-1)) - c.reshape(-1)).reshape(c.shape)
    return np.cumsum(c, axis=axis) - c


def _table(dst, src, nbytes) -> np.ndarray:
    t = np.stack([np.asarray(v, np.int64).reshape(-1) for v in (dst, src, nbytes)], axis=1)
    return t[t[:, 2] > 0]


def _window(pos, length, lo: int, hi: int):
    """The parts of segments [pos, pos + length) of a block inside the round's window [lo, hi): (start in the
    window, start in the segment, bytes)."""
    s, e = np.maximum(pos, lo), np.minimum(pos + length, hi)
    return s - lo, s - pos, np.maximum(e - s, 0)


def alltoallv_layout(matrix, members, rank: int, send_displs, recv_displs, itemsize: int,
                     slot_bytes: int) -> AlltoallvLayout:
    """The layout of `rank`'s alltoallv (``AlltoallvLayout``); members[d][j]: world rank of local j on node d.
    Displacements and the matrix are in elements, the tables in bytes."""
    m = np.asarray(matrix, dtype=np.int64)
    mem = np.asarray(members, dtype=np.int64)
    nodes, g = mem.shape
    k, i = (int(v[0]) for v in np.nonzero(mem == rank))
    sd, rd, isz = np.asarray(send_displs, np.int64), np.asarray(recv_displs, np.int64), int(itemsize)

    to = mem.T                                   # to[j][d]: rank (d, j)
    send = m[rank][to]                           # [j][d]: elements to rank (d, j)
    pack = _table(_exclusive(send) * isz, sd[to] * isz, send * isz)
    node = m[np.ix_(mem[k], mem.reshape(-1))].reshape(g, nodes, g).sum(1)   # [j][i']: node stage, j -> i'
    zc = m[np.ix_(mem[k], mem[:, i])]            # [j][d]: elements rank (k, j) sends to rank (d, i)
    zoff = _exclusive(zc) * isz                  # z is laid out [j][d]
    pos = _exclusive(zc, axis=0) * isz           # in the block to member d
    local = _table(rd[mem[k]] * isz, zoff[:, k], zc[:, k] * isz)

    # rail i's blocks: rail[p][d] bytes from member p to member d (every member computes the same)
    came = m[np.ix_(mem.reshape(-1), mem[:, i])].reshape(nodes, g, nodes)   # [p][j][d]
    rail = came.sum(1) * isz
    np.fill_diagonal(rail, 0)
    mine = m[mem.reshape(-1), rank].reshape(nodes, g) * isz                   # [p][j]: to this rank, bytes
    mine_pos = _exclusive(mine, axis=1)
    rounds = []
    for r in range(max(1, -(-int(rail.max(initial=0)) // slot_bytes))):
        lo, hi = r * slot_bytes, (r + 1) * slot_bytes
        piece = np.clip(rail - lo, 0, slot_bytes)
        w, off, nb = _window(pos, zc * isz, lo, hi)
        nb[:, k] = 0                              # this node's block is copied locally
        stage = _table(w + np.arange(nodes) * slot_bytes, zoff + off, nb)
        w, off, nb = _window(mine_pos, mine, lo, hi)
        nb[k] = 0
        recv = _table(rd[mem] * isz + off, w + (np.arange(nodes) * slot_bytes)[:, None], nb)
        rounds.append(RailRoundV(piece[k].copy(), int(piece.max(initial=0)), stage, recv))
    return AlltoallvLayout(send.sum(1), zc.sum(1), int(node.max(initial=0)), pack,
                           local, tuple(rounds))


def upload_tables(tables, xp):
    """One device array (uint64, three per entry: destination, source, bytes) of several tables given as
    (rows, destination base, source base), entries cut to SEGMENT_BYTES; returns it and each table's
    (first entry, entries)."""
    parts, spans, at = [], [], 0
    for rows, dst_base, src_base in tables:
        t = split_segments(rows)
        t[:, 0] += dst_base
        t[:, 1] += src_base
        parts.append(t.astype(np.uint64))
        spans.append((at, len(t)))
        at += len(t)
    host = np.concatenate(parts) if at else np.zeros((1, 3), np.uint64)
    return xp.asarray(host.reshape(-1)), spans


def split_segments(rows, most: int = SEGMENT_BYTES) -> np.ndarray:
    """Table rows (destination, source, bytes) cut into entries of at most `most` bytes, in order."""
    rows = np.asarray(rows, np.int64).reshape(-1, 3)
    parts = np.maximum(1, -(-rows[:, 2] // most))
    idx = np.repeat(np.arange(len(rows)), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    step = (np.arange(len(idx)) - first) * most
    out = rows[idx].copy()
    out[:, 0] += step
    out[:, 1] += step
    out[:, 2] = np.minimum(rows[idx, 2] - step, most)
    return out


def check_rail_reduction(dt: str, red: str) -> None:
    """Refuse, before any launch, a reduction the rail kernels do not have."""
    if dt not in RAIL_DTYPES or red not in RAIL_OPS:
        raise CollectiveArgumentError(f"reductions across nodes support {RAIL_DTYPES} with {RAIL_OPS}, got {dt} "
                                      f"{red}")


def _not_capturing(name: str, stream) -> None:
    """Rail epochs are counted on the host: a captured rail round would replay with a stale epoch."""
    if stream.is_capturing():
        raise GraphCaptureError(f"{name} across nodes cannot be captured in a CUDA graph (the rail rounds' epochs "
                                "are counted on the host); call it outside the capture")


def _check_algo(algo: str) -> None:
    if algo not in ("auto", "hierarchical"):
        raise CollectiveArgumentError(f"algo={algo!r}: a world of several nodes runs the hierarchical path "
                                      "('auto' or 'hierarchical')")


def _call_checks(name: str, stream, algo: str, compress=None, error_feedback=None) -> None:
    """What every collective across nodes refuses before anything launches: a graph capture, an algorithm other
    than the hierarchical one, and compressed payloads (single-node kernels)."""
    _not_capturing(name, stream)
    _check_algo(algo)
    if compress is not None or error_feedback is not None:
        raise CollectiveArgumentError(f"{name}: compress={compress!r} across nodes is not implemented (the "
                                      "compressed kernels run within one node); call without compress")


def context(world: World, options: HierarchicalOptions | None = None) -> HierarchicalCollectives:
    """The world's hierarchical context (in its registry), made collectively on first use (with `options`)."""
    ctx = world.registry.get(KEY)
    if ctx is None:
        ctx = HierarchicalCollectives(world, options)   # registers itself
    return ctx


__all__ = ["AlltoallvLayout", "HierarchicalCollectives", "HierarchicalOptions", "NodeTeam", "RailRoundV",
           "alltoall_node_input", "alltoall_rail_blocks", "alltoallv_layout", "check_count_matrix",
           "check_rail_reduction", "split_segments", "upload_tables", "context", "put_grid",
           "rail_allreduce_algo", "rail_geometry", "rail_pieces", "reduce_grid", "shard_elems"]
