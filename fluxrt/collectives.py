"""Collectives over NVLink: allreduce, reduce_scatter, allgather, alltoall, alltoallv, broadcast, barrier.

    import fluxrt
    with fluxrt.init() as world:
        y = fluxrt.allreduce(world, x)                       # x: any CuPy / DLPack GPU array
        h = fluxrt.allgather(world, x, out, async_op=True)   # runs on a side stream
        ...                                                  # overlap compute on other streams
        h.wait()                                             # the current stream waits for it

Calls are collective: every rank makes the same calls, in the same order, with matching arguments.
With ``WorldOptions.check_collective_args`` (the default) each call first compares its arguments across
ranks over MPI and raises the same error on every rank (CollectiveMismatchError, CollectiveArgumentError)
instead of launching mismatched kernels; turn it off for the lowest latency once a program is known good.

Small messages take the LL path: every 8 message bytes travel with their flag in one 16-byte NVLink store,
so a round is one kernel with no fence and no separate signal (``collectives_plan``). Larger ones are
staged through a per-world symmetric workspace (``Collectives``, made collectively on the first
call or explicitly): each launch pushes this rank's data into the peers' workspace slots with SM stores
over NVLink, releases per-block flags, waits for the peers' flags (bounded by the world's timeout) and
reduces or copies locally. Messages larger than a workspace half go in several launches, except on the
pipelined path for bulk messages ('pipe'): one launch streams each slice of the message through a small
ring of steps in the peers' workspace, with a sender, [reducer,] and receiver block per slice, so the
NVLink pushes of one step overlap the local copies of earlier ones. The largest allreduce and
reduce_scatter messages, and the largest allgathers, take the ring ('ring'): chunks travel
rank -> rank + 1 (reduced on the way), so every rank pushes to one peer only. Outputs that
are symmetric arrays (``world.empty``, the same view on every rank) let allgather, alltoall and broadcast
push straight into the peers' outputs instead ('direct': one launch, no staging copy). Epochs live on
the device, so calls can be captured in a CUDA graph and replayed. Algorithms per size are chosen in
``fluxrt.collectives_plan`` (``algo=`` forces one). With the cross-rank check off, repeated calls on the
same arrays reuse their validated launch lists (the small-message path is one kernel launch).

A bounded wait that expires (a peer crashed or skipped a call) is raised as WaitTimeoutError by the next
call, ``handle.wait()`` or ``world.synchronize()``; the context's epochs are then out of step across ranks
and the world should be torn down.

Calls of one context are serialized in issue order, also across streams (a call on another stream waits
for the previous call), because they share the workspace and the epoch counter.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import collectives_plan as plan
from . import compressed as _compressed
from . import log as _log
from . import tuning_tables
from .agreement import agree as _agree
from .agreement import exchange as _exchange
from .agreement import local as _local
from .agreement import load_wait_s as _load_wait_s
from .agreement import meet_after_load as _meet_after_load
from .arrays import as_array
from .dtypes import bfloat16, normalize_dtype
from .errors import (CollectiveArgumentError, CollectiveMismatchError, FluxrtError, GraphCaptureError, NotSymmetricError,
                     op_id)
from .nvtx import annotate as _nvtx
from .packed_launch import PackedLaunch
from .streams import as_cupy_stream

if TYPE_CHECKING:
    from .world import World

log = logging.getLogger(__name__)

KERNEL_SOURCE = "comm/collectives.cu"
_REDUCE_DTYPES = {bfloat16: "bf16", np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32",
                  np.dtype(np.float64): "fp64", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
                  np.dtype(np.uint8): "uint8"}
_FLOAT_REDUCE = ("bf16", "fp16", "fp32", "fp64")   # the element types with avg
_DTYPE_OF = {name: d for d, name in _REDUCE_DTYPES.items()}
# The base module's reductions; every other (element type, op) is in the element type's extension module
# (collectives.cu built with -DFLUXRT_COLL_EXT=<code>), compiled and loaded when first needed.
BASE_REDUCTIONS = frozenset((d, o) for d in ("bf16", "fp16", "fp32") for o in ("sum", "max", "min"))
EXT_CODES = {"bf16": 0, "fp16": 1, "fp32": 2, "fp64": 3, "int32": 4, "int64": 5, "uint8": 6}
EXT_DTYPES = {c: d for d, c in EXT_CODES.items()}
_DIVIDE_THREADS, _DIVIDE_MAX_GRID = 256, 1024
_TABLE_ROWS = 5  # struct ExchangeTable: send_ptr, send_bytes, recv_ptr, recv_bytes, send_dst
_TABLE_DTYPE = np.dtype([("words", "<u8", (_TABLE_ROWS * plan.MAX_WORLD,))])  # passed by value
_u64, _u32 = np.uint64, np.uint32
_KEY = "fluxrt.collectives"  # the world's default context, in its registry
_FAST_CACHE_ENTRIES = 256  # validated launch lists kept per context (keyed by array addresses and arguments)


@dataclass(frozen=True)
class CollectivesOptions:
    """workspace_bytes: symmetric staging memory per rank (two halves alternate between launches);
    a message larger than about half of it (allreduce one-shot: half / ranks) goes in several launches.
    The default, 256 MiB of the symmetric heap per rank (plus the LL buffer, a few MiB), is the workspace
    the default tuning was measured with: a smaller one costs bandwidth on large messages (smaller ring
    entries, more launches).
    tuning: algorithm thresholds and grid sizes (``collectives_plan.Tuning``; the same on every rank).
    None (the default): the table of the machine the world runs on (``machine_tuning_kind``: GPU model and
    whether all pairs are NVLink peers), else ``tuning_tables.DEFAULT_KIND``'s."""

    workspace_bytes: int = tuning_tables.TUNED_WORKSPACE_BYTES
    tuning: plan.Tuning | None = None


def _local_machine_facts(device_id: int) -> tuple[str, str]:
    """(GPU name, PCI bus id) of this rank's device."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return name, cupy.cuda.runtime.deviceGetPCIBusId(device_id)


def _nvlink_peers(device_id: int, bus_ids: list[str]) -> bool | None:
    """Whether this rank's GPU reaches every other GPU of `bus_ids` over NVLink (native peer atomics, which
    PCIe P2P lacks); None where a peer's GPU is not visible here or the query fails."""
    import cupy
    from cuda.bindings import runtime as cr

    mine = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
    try:
        for bus in bus_ids:
            if bus == mine:
                continue
            peer = cupy.cuda.runtime.deviceGetByPCIBusId(bus)
            err, value = cr.cudaDeviceGetP2PAttribute(
                cr.cudaDeviceP2PAttr.cudaDevP2PAttrNativeAtomicSupported, device_id, peer)
            if err != cr.cudaError_t.cudaSuccess:
                return None
            if not value:
                return False
    except Exception:  # a peer GPU hidden by CUDA_VISIBLE_DEVICES: cannot tell
        return None
    return True


def machine_tuning_kind(gpu_names: list[str], nvlink: list[bool | None]) -> tuple[str, str]:
    """The tuning table for a job whose ranks have `gpu_names` and report `nvlink` (each rank: NVLink to every
    other rank's GPU; None: unknown). Returns (kind, why). The same lists on every rank give the same kind.
    Mixed GPU models or an unknown link fall back to ``tuning_tables.DEFAULT_KIND``."""
    if not gpu_names or len(set(gpu_names)) != 1:
        return tuning_tables.DEFAULT_KIND, f"mixed or no GPU models {sorted(set(gpu_names))}: the default table"
    if any(v is None for v in nvlink):
        return tuning_tables.DEFAULT_KIND, f"{gpu_names[0]}, NVLink between ranks unknown: the default table"
    all_nvlink = all(nvlink)
    kind = tuning_tables.machine_kind(gpu_names[0], all_nvlink)
    return kind, f"{len(gpu_names)} x {gpu_names[0]}, {'all' if all_nvlink else 'not all'} pairs NVLink"


def _machine_tuning(world: World) -> plan.Tuning:
    """The default Tuning of `world`'s machine (collective: every rank makes the same calls and gets the same
    table; a rank that cannot query its GPU makes the job fall back to the default table)."""
    try:
        mine = _local_machine_facts(world.device_id)
    except Exception as e:
        log.info("collectives: GPU not identified (%s)", e)
        mine = None
    facts = _exchange(world, "Collectives", mine)   # bounded, like every cross-rank exchange
    link = None
    if all(facts):
        try:
            link = _nvlink_peers(world.device_id, [bus for _, bus in facts])
        except Exception as e:  # cuda.bindings missing or too old
            log.info("collectives: NVLink between ranks not determined (%s)", e)
    links = _exchange(world, "Collectives", link)
    kind, why = machine_tuning_kind([f[0] for f in facts if f], links if all(facts) else [None])
    if world.rank == 0:
        log.info("collectives: tuning table %r (%s)", kind, why)
    return plan.Tuning.for_machine(kind)


class CollectiveHandle:
    """An in-flight ``async_op=True`` collective. ``wait(stream)`` makes `stream` (default: the current
    one) wait for it and returns the result; ``wait(host=True)`` blocks the host until it is done;
    ``test()`` (or ``is_done()``) polls without blocking. All raise a recorded device timeout."""

    def __init__(self, world: World, event, result, keep):
        self._world, self._event, self.result, self._keep = world, event, result, keep

    def wait(self, stream=None, *, host: bool = False):
        """The result, once `stream` (host=False, the default: stream-ordered, the host goes on) or the
        host (host=True) has waited for the call. Every device wait is bounded, so a host wait ends too."""
        if host:
            self._event.synchronize()
            self._keep = None
        else:
            as_cupy_stream(stream).wait_event(self._event)
        self._world.check_errors()
        return self.result

    def test(self) -> bool:
        """Whether the call has completed on the device (no blocking)."""
        done = self._event.done
        if done:
            self._world.check_errors()
            self._keep = None
        return done

    is_done = test


def wait_all(handles, stream=None, *, host: bool = False) -> list:
    """``wait`` on every handle (stream-ordered, or on the host with host=True); their results in order. A
    None in `handles` (a synchronous call's place) is passed through."""
    return [None if h is None else h.wait(stream, host=host) for h in handles]


# ------------------------------------------------------------------------------------------ validation
def _as_array(x, name: str, op: str, world: World, stream, writable: bool = False):
    """A C-contiguous CuPy view on the world's GPU of any CUDA array (fluxrt.arrays), ordered after its
    producer on `stream`."""
    return as_array(x, name=name, op=op, writable=writable, stream=stream, device=world.device_id, contiguous=True,
                    error=CollectiveArgumentError, type_error=CollectiveArgumentError)


def _reduce_dtype(dtype) -> str:
    d = normalize_dtype(dtype)
    if d not in _REDUCE_DTYPES:
        raise CollectiveArgumentError(f"reductions support bf16, fp16, fp32, fp64, int32, int64 and uint8, got {d}")
    return _REDUCE_DTYPES[d]


def _reduction(dtype, op: str) -> tuple[str, str]:
    """(element type, op) names of a reduction, checked: avg is for floating-point types only."""
    dt, red = _reduce_dtype(dtype), _redop(op)
    if red == "avg" and dt not in _FLOAT_REDUCE:
        raise CollectiveArgumentError(f"reduction op 'avg' is for floating-point types, not {dt} (use sum and "
                                      "divide as the program needs)")
    return dt, red


def kernel_module_code(name: str) -> int | None:
    """The FLUXRT_COLL_EXT code of the module holding kernel `name` (None: the base module)."""
    if name.startswith("fluxrt_divide_"):
        return EXT_CODES[name[len("fluxrt_divide_"):]]
    parts = name.rsplit("_", 2)
    if len(parts) == 3 and parts[1] in EXT_CODES and (parts[1], parts[2]) not in BASE_REDUCTIONS:
        return EXT_CODES[parts[1]]
    return None


def _move_dtype(dtype) -> np.dtype:
    d = normalize_dtype(dtype)
    if d != bfloat16 and d.kind not in "fiub":
        raise CollectiveArgumentError(f"unsupported dtype {d}: use bf16, fp16, fp32, int32 or another numeric type")
    return d


def _kernel_op(red: str) -> str:
    """The op of the reduction kernel: avg runs the sum, then divides."""
    return "sum" if red == "avg" else red


def _redop(op: str) -> str:
    name = str(op).lower()
    if name not in plan.REDUCE_OPS:
        raise CollectiveArgumentError(f"reduction op {op!r} not in {plan.REDUCE_OPS}")
    return name


def _span(a) -> tuple[int, int]:
    return a.data.ptr, a.data.ptr + a.nbytes


def _overlap(x, out) -> bool:
    (x0, x1), (o0, o1) = _span(x), _span(out)
    return x.nbytes > 0 and out.nbytes > 0 and x0 < o1 and o0 < x1


def _symmetric_offset(world: World, a) -> int | None:
    """Offset of `a` in its symmetric allocation of this world's heap, or None when it is not one."""
    if getattr(a, "_heap", None) is not world.heap:
        return None
    try:
        return a.offset_bytes
    except NotSymmetricError:
        return None


def _peer_pointers(a, n: int) -> np.ndarray:
    """uint64[n]: `a` as mapped from every rank's heap."""
    return np.array([a.peer_ptr(q) for q in range(n)], dtype=np.uint64)


def _algo_signature(got) -> tuple:
    """The algorithm (and, for direct pushes, the output's heap offset) every rank must agree on."""
    if got is None:
        return (("algo", None),)
    chosen, off = got[-2], got[-1]
    return (("algo", chosen),) + ((("out_offset", off),) if chosen == "direct" else ())


def _check_alias(op: str, x, out, allowed_offsets: tuple[int, ...]) -> None:
    """out may overlap x only exactly in the in-place layouts of `op` (x.ptr - out.ptr in allowed_offsets)."""
    if not _overlap(x, out) or x.data.ptr - out.data.ptr in allowed_offsets:
        return
    raise CollectiveArgumentError(f"{op}: out overlaps the input in an unsupported way (input at "
                                  f"{x.data.ptr - out.data.ptr:+d} bytes from out); use disjoint buffers or the "
                                  "documented in-place layout")


def _fast_key(name: str, x, out, *args):
    """Cache key of a call whose launch list depends only on these arrays' addresses and layouts and on
    `args` (None: not cacheable, e.g. a DLPack object or an output to allocate)."""
    import cupy

    if out is None or not isinstance(x, cupy.ndarray) or not isinstance(out, cupy.ndarray):
        return None
    return (name, x.data.ptr, x.shape, x.strides, x.dtype, type(out), out.data.ptr, out.shape, out.strides,
            out.dtype, *args)


# ------------------------------------------------------------------------------------------ the context
class Collectives:
    """Per-world collectives state: the symmetric workspace, per-block flags, the device epoch counter,
    the side stream of async calls. Collective to create (every rank, same options). The first one made
    for a world becomes the one the module-level functions use; ``free()`` (collective) or the world's
    finalize releases the symmetric memory."""

    def __init__(self, world: World, options: CollectivesOptions | None = None):
        import cupy

        from .toolchain import load_module

        world.check_active()
        if cupy.cuda.get_current_stream().is_capturing():
            raise GraphCaptureError("collectives: the context allocates symmetric memory and synchronizes, which a "
                                    "CUDA graph capture cannot contain; make it before capturing "
                                    "(fluxrt.prepare(world) or Collectives(world))")
        options = options or CollectivesOptions()
        plan.check_world(world.size)
        ws = plan.VEC_BYTES * (int(options.workspace_bytes) // plan.VEC_BYTES)
        if ws < 4 * plan.VEC_BYTES * world.size:
            raise CollectiveArgumentError(f"workspace_bytes={options.workspace_bytes} is too small for "
                                          f"{world.size} ranks")
        self.world, self.options = world, options
        self._freed = False
        n = world.size
        self.module = load_module(KERNEL_SOURCE)
        # a rank that compiled the module on a cold cache is behind: meet before the bounded allocations' exchanges
        _meet_after_load(world, "collectives: context kernels loaded")
        self.epoch = cupy.zeros(1, dtype=np.uint64)  # round counter (kernels: begin_round)
        self.workspace = world.empty((ws,), np.uint8)
        self.flags = world.zeros((plan.FLAG_PHASES * n * plan.MAX_BLOCKS,), np.uint64)  # all zero: no round yet
        self.tuning = options.tuning if options.tuning is not None else _machine_tuning(world)
        self.ll = world.zeros((self.tuning.ll_buffer_bytes(n),), np.uint8)  # LL lines: zero = empty
        self.ll_half_bytes = self.ll.nbytes // 2
        unreachable = [r for r in range(n) if self.workspace.peer_ptr(r) == 0]
        every = world.comm.allgather(unreachable)
        if any(every):
            self.free()
            detail = "; ".join(f"rank {r} cannot reach {u}" for r, u in enumerate(every) if u)
            raise FluxrtError(f"collectives need NVLink/P2P load-store access between all ranks ({detail})")
        self.half_bytes = plan.VEC_BYTES * ((ws // 2) // plan.VEC_BYTES)
        self.side_stream = cupy.cuda.Stream(non_blocking=True)
        self._ready_event = cupy.cuda.Event(disable_timing=True)
        self._order_event = cupy.cuda.Event(disable_timing=True)
        self._last_stream = None
        self._kernels: dict = {}
        self._ext_modules: dict = {}
        self._ext_met: set = set()   # extension modules whose first call met the other ranks
        self._capturing_stream = None
        self._fast: dict = {}
        self._team_base = (_u64(self.epoch.data.ptr), _u64(self.workspace.data.ptr),
                           _u64(self.workspace.peer_table.data.ptr), _u64(self.flags.data.ptr),
                           _u64(self.flags.peer_table.data.ptr), _u64(self.half_bytes),
                           _u64(self.ll.data.ptr), _u64(self.ll.peer_table.data.ptr), _u64(self.ll_half_bytes),
                           _u32(world.rank), _u32(n), _u64(world.timeout_ns), _u64(world.error_record))
        self._teams = {name: self._team_base + (_u32(op_id(name)),) for name in plan.ALGOS}
        world.device.synchronize()
        if _KEY not in world.registry:
            world.registry.put(_KEY, self, teardown=Collectives.free)

    def free(self) -> None:
        """Collective: release the workspace and flags (the world's finalize does it otherwise)."""
        if self.world.active and not self._freed:
            self.world.free(self.ll)
            self.world.free(self.flags)
            self.world.free(self.workspace)
        self._freed = True
        if self.world.registry.get(_KEY) is self:
            self.world.registry.pop(_KEY)

    # --- plumbing ---------------------------------------------------------------------------------
    def _kernel(self, name: str):
        fn = self._kernels.get(name)
        if fn is None:
            code = kernel_module_code(name)
            module = self.module if code is None else self._ext_module(code)
            fn = self._kernels[name] = module.get_function(name)
            if code is not None and code not in self._ext_met:   # the same call on every rank
                self._ext_met.add(code)
                _meet_after_load(self.world, f"collectives: first call of the {EXT_DTYPES[code]} kernels")
        return fn

    def _ext_module(self, code: int):
        """The extension module of element type `code` (compiled on first use: not inside a capture)."""
        mod = self._ext_modules.get(code)
        if mod is None:
            from .toolchain import CompileOptions, load_module

            dt = EXT_DTYPES[code]
            capturing = self._capturing_stream
            if capturing is not None and capturing.is_capturing():
                raise GraphCaptureError(
                    f"collectives: the {dt} reductions beyond bf16/fp16/fp32 sum, max and min are compiled and "
                    "loaded on their first call, which a CUDA graph capture cannot contain; call "
                    f"fluxrt.prepare(world, dtypes=[{dt!r}], ops=[...]) (or Collectives.prepare) before capturing")
            mod = load_module(KERNEL_SOURCE, CompileOptions(defines=(("FLUXRT_COLL_EXT", str(code)),)))
            # RawModule loads its cubin on the first lookup: do it here, outside any capture
            mod.get_function(f"fluxrt_divide_{dt}" if dt in _FLOAT_REDUCE else f"fluxrt_allreduce_oneshot_{dt}_sum")
            self._ext_modules[code] = mod
        return mod

    @staticmethod
    def _ext_code(dt: str, red: str) -> int | None:
        """The extension module a reduction of `dt` with `red` needs (None: the base module's)."""
        return None if (dt, _kernel_op(red)) in BASE_REDUCTIONS and red != "avg" else EXT_CODES[dt]

    def _check_loaded(self, dt: str, red: str) -> None:
        """Before a reduction that needs an extension module inside a capture: load it now, or refuse."""
        code = self._ext_code(dt, red)
        if code is not None and code not in self._ext_modules:
            self._ext_module(code)  # raises GraphCaptureError inside a capture

    def _agree_bound(self, got, dt_index: int) -> float | None:
        """The argument exchange's bound for a reducing call: the load wait while the reduction's extension
        module has not met the other ranks yet (a peer may still be compiling it in its checks), else the
        world's timeout (None). A rank whose own checks failed cannot tell what its peers are loading: it
        waits as long as they may."""
        if got is None:
            return _load_wait_s(self.world)
        code = self._ext_code(got[dt_index], got[dt_index + 1])
        return None if code is None or code in self._ext_met else _load_wait_s(self.world)

    def _divide(self, dt: str, o, count: int) -> PackedLaunch:
        """avg's last launch: out[:count] /= ranks (a plain launch: it does not wait for its predecessor
        with griddepcontrol, so it takes no programmatic dependent launch)."""
        grid = max(1, min(_DIVIDE_MAX_GRID, -(-count // _DIVIDE_THREADS)))
        return self._launch(f"fluxrt_divide_{dt}", grid, (_u64(o.data.ptr), _u64(count), _u32(self.world.size)),
                            block=_DIVIDE_THREADS, pdl=False)

    def prepare(self, dtypes=(), ops=("sum",)) -> None:
        """Load now what calls reducing `dtypes` with `ops` would otherwise compile and load on their first call
        (the reductions outside bf16/fp16/fp32 sum, max and min), so that a first call can be captured in a
        CUDA graph. Local (no communication); everything else a call needs is made with the context."""
        for d in dtypes:
            for o in ops:
                self._check_loaded(*_reduction(d, o))

    def _launch(self, name: str, grid: int, args: tuple, block: int = plan.THREADS, pdl: bool = True) -> PackedLaunch:
        return PackedLaunch(self._kernel(name), grid, block, args, pdl=pdl and bool(self.tuning.pdl))

    def _layout(self, op: str, algo: str, itemsize: int) -> plan.Layout:
        """Slots of the buffer half `algo` uses (LL rounds have their own buffer)."""
        return plan.layout(op, algo, self._half(algo), self.world.size, itemsize)

    def _half(self, algo: str) -> int:
        return self.ll_half_bytes if algo in plan.LL_ALGOS else self.half_bytes

    def _pipe_tail(self, p: plan.Piece, unit: int) -> tuple:
        """The last two arguments of a pipelined kernel: the ring step (in `unit`-byte units: bytes for the
        exchange, elements for the reductions) and the ring depth."""
        return _u64(p.step // unit), _u32(p.depth)

    def _ring_tail(self, p: plan.Piece, itemsize: int) -> tuple:
        """The last arguments of a ring kernel: elements per ring entry, the ring depth, entries per stage."""
        return _u64(p.step // itemsize), _u32(p.depth), _u32(p.substeps)

    def _order_after_previous(self, s) -> None:
        """Make stream `s` wait for the previous call when it ran on another stream (shared workspace)."""
        last = self._last_stream
        if last is not None and last.ptr != s.ptr:
            if last.is_capturing() == s.is_capturing():
                self._order_event.record(last)
                s.wait_event(self._order_event)
            else:
                log.debug("collectives: not ordering across a capture boundary (stream 0x%x after 0x%x)",
                          s.ptr, last.ptr)
        self._last_stream = s

    def _run(self, caller, async_op: bool, launches, result, keep):
        """Enqueue `launches` (PackedLaunch each) on the CuPy stream `caller`, or on the side stream after it."""
        import cupy

        world = self.world
        if self._freed or not world.active:
            world.check_active()
            raise FluxrtError("this collectives context has been freed")
        world.check_errors()
        if async_op:
            # wait_event takes the event's state at enqueue time, so one event serves every call
            self._ready_event.record(caller)
            s = self.side_stream
            s.wait_event(self._ready_event)
        else:
            s = caller
        if self._last_stream is not s:
            self._order_after_previous(s)
        sp = s.ptr
        for launch in launches:
            launch.launch(sp)
        if not async_op:
            return result
        done = cupy.cuda.Event(disable_timing=True)
        done.record(s)
        return CollectiveHandle(world, done, result, keep)

    def _call(self, key, plan_call, stream, async_op, result, keep):
        """Launch a call: from the cache of validated launch lists (same arrays, same arguments, no
        cross-rank check wanted), else validate, agree and plan through `plan_call(stream)` -> (launches,
        out). Every public call comes through here, which makes the world's GPU current and converts its stream
        (once)."""
        self.world.make_current()
        s = as_cupy_stream(stream)
        self._capturing_stream = s
        if self.world.options.check_collective_args:
            key = None  # every call is compared across ranks
        launches = self._fast.get(key) if key is not None else None
        if launches is None:
            launches, out = plan_call(s)
            if log.isEnabledFor(_log.TRACE):
                _log.trace(log, "rank %s: %d launch(es) %s", self.world.rank, len(launches),
                           ", ".join(f"{getattr(p.kernel, 'name', 'kernel')}<<<{p.grid}, {p.block}>>>" for p in launches))
            result = out if result is None else result
            if key is not None:
                if len(self._fast) >= _FAST_CACHE_ENTRIES:
                    self._fast.clear()
                self._fast[key] = launches
        return self._run(s, async_op, launches, result, keep)

    def _output(self, out, name: str, dtype, count: int, default_shape, op: str, stream):
        import cupy

        if out is None:
            return cupy.empty(default_shape, dtype=dtype)
        o = _as_array(out, name, op, self.world, stream, writable=True)
        if o.dtype != dtype:
            raise CollectiveArgumentError(f"{name} has dtype {o.dtype}, the input {dtype}")
        if o.size < count:
            raise CollectiveArgumentError(f"{name} too small: {o.size} elements, the result needs {count}")
        return o

    def _exchange_launches(self, op: str, algo: str, per_peer: int, itemsize: int, lay, table_fn) -> tuple:
        """Launches of an exchange op moving `per_peer` elements per pair (alltoallv: the largest pair of
        all ranks); `table_fn(piece, words)` fills the ExchangeTable rows of each launch ('pairwise': the
        pipelined round in pairwise phases)."""
        pieces = _pieces(op, algo, per_peer, itemsize, self.world.size, lay, self.tuning)
        piped = algo in plan.PIPE_ALGOS
        name = "fluxrt_exchange_pipe" if piped else "fluxrt_exchange_ll" if algo == "ll" else "fluxrt_exchange"
        slot = (_u64(lay.slot_bytes),)
        launches = []
        for p in pieces:
            if piped:
                tail = self._pipe_tail(p, 1) + (np.int32(algo == "pairwise"),)
            else:
                tail = () if algo == "ll" else (np.int32(algo == "direct"),)
            tab = np.zeros(1, _TABLE_DTYPE)
            table_fn(p, tab.view(np.uint64).reshape(_TABLE_ROWS, plan.MAX_WORLD))
            launches.append(self._launch(name, p.grid, self._teams[op] + (tab,) + slot + tail))
        return tuple(launches)

    # --- reductions -------------------------------------------------------------------------------
    @_nvtx("allreduce")
    def allreduce(self, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False, algo: str = "auto",
                  compress: str | None = None, error_feedback=None):
        """out = x[rank 0] op x[rank 1] op ... (elementwise), every rank bitwise the same result: 16- and
        32-bit floats accumulate in fp32, fp64 in fp64, integers wrap (int32, int64, uint8). op: sum, prod, max,
        min, avg (floats: the sum divided by the ranks). out=None allocates; out=x is in place. compress="fp8"
        or "int8": an 8-bit payload with block scales, optionally with an error-feedback buffer
        (``fluxrt.compressed``)."""
        if compress is not None:
            return _compressed.call(self, "allreduce", x, out, compress, error_feedback, op, algo, stream, async_op)
        return self._call(_fast_key("allreduce", x, out, op, algo), lambda s: self._plan_allreduce(x, out, op, algo, s),
                          stream, async_op, out, (x, out))

    def _plan_allreduce(self, x, out, op, algo, stream):
        world = self.world

        def prepare():
            a = _as_array(x, "x", "allreduce", world, stream)
            dt, red = _reduction(a.dtype, op)
            self._check_loaded(dt, red)
            chosen = plan.choose_algo("allreduce", a.nbytes, world.size, algo, tuning=self.tuning, itemsize=a.itemsize)
            o = self._output(out, "out", a.dtype, a.size, a.shape, "allreduce", stream)
            _check_alias("allreduce", a, o, (0,))
            return a, o, dt, red, chosen

        got, err = _local(prepare)
        sig = (("count", None if got is None else got[0].size), ("dtype", None if got is None else got[2]),
               ("op", None if got is None else got[3]), ("algo", None if got is None else got[4]))
        _agree(world, "allreduce", sig, err, timeout_s=self._agree_bound(got, 2))
        a, o, dt, red, chosen = got
        lay, pieces = _allreduce_plan(a.size, a.itemsize, world.size, chosen, self._half(chosen), self.tuning)
        name = f"fluxrt_allreduce_{chosen}_{dt}_{_kernel_op(red)}"
        team = self._teams["allreduce"]
        isz = a.itemsize
        launches = []
        for p in pieces:
            xp, op_ = _u64(a.data.ptr + p.start * isz), _u64(o.data.ptr + p.start * isz)
            if chosen == "twoshot":
                args = team + (xp, op_, _u64(p.count), _u64(p.chunk), _u64(lay.slot_bytes))
            elif chosen == "pipe":
                args = team + (xp, op_, _u64(p.count), _u64(p.chunk), _u64(lay.slot_bytes)) + self._pipe_tail(p, isz)
            elif chosen == "ring":
                args = team + (xp, op_, _u64(p.count), _u64(p.chunk)) + self._ring_tail(p, isz)
            else:
                args = team + (xp, op_, _u64(p.count), _u64(lay.slot_bytes))
            launches.append(self._launch(name, p.grid, args, block=plan.block_threads(chosen, self.tuning)))
        if red == "avg":
            launches.append(self._divide(dt, o, a.size))
        return tuple(launches), o

    @_nvtx("reduce_scatter")
    def reduce_scatter(self, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False,
                       algo: str = "auto", compress: str | None = None, error_feedback=None):
        """x holds world.size chunks of equal size; rank r gets the reduction of every rank's chunk r.
        In place: out = x[r * chunk : (r + 1) * chunk] (flattened). compress: as allreduce's."""
        if compress is not None:
            return _compressed.call(self, "reduce_scatter", x, out, compress, error_feedback, op, algo, stream,
                                    async_op)
        return self._call(_fast_key("reduce_scatter", x, out, op, algo),
                          lambda s: self._plan_reduce_scatter(x, out, op, algo, s), stream, async_op, out, (x, out))

    def _plan_reduce_scatter(self, x, out, op, algo, stream):
        world = self.world
        n = world.size

        def prepare():
            a = _as_array(x, "x", "reduce_scatter", world, stream)
            dt, red = _reduction(a.dtype, op)
            self._check_loaded(dt, red)
            chosen = plan.choose_algo("reduce_scatter", a.nbytes, n, algo, tuning=self.tuning, itemsize=a.itemsize)
            if a.size % n:
                raise CollectiveArgumentError(f"reduce_scatter: x has {a.size} elements, not a multiple of "
                                              f"{n} ranks")
            c = a.size // n
            shape = (a.shape[0] // n, *a.shape[1:]) if a.ndim and a.shape[0] % n == 0 else (c,)
            o = self._output(out, "out", a.dtype, c, shape, "reduce_scatter", stream)
            _check_alias("reduce_scatter", a, o, (-world.rank * c * a.itemsize,))
            return a, o, dt, red, c, chosen

        got, err = _local(prepare)
        sig = (("count", None if got is None else got[0].size), ("dtype", None if got is None else got[2]),
               ("op", None if got is None else got[3]), ("algo", None if got is None else got[5]))
        _agree(world, "reduce_scatter", sig, err, timeout_s=self._agree_bound(got, 2))
        a, o, dt, red, c, chosen = got
        lay = self._layout("reduce_scatter", chosen, a.itemsize)
        prefix = {"ll": "ll_", "pipe": "pipe_", "ring": "ring_"}.get(chosen, "")
        name = f"fluxrt_reduce_scatter_{prefix}{dt}_{_kernel_op(red)}"
        team = self._teams["reduce_scatter"]
        isz = a.itemsize

        def args(p):
            if chosen == "ring":
                return team + (_u64(a.data.ptr), _u64(o.data.ptr), _u64(c)) + self._ring_tail(p, isz)
            return team + (_u64(a.data.ptr + p.start * isz), _u64(c), _u64(o.data.ptr + p.start * isz),
                           _u64(p.count), _u64(lay.slot_bytes)) + (self._pipe_tail(p, isz) if chosen == "pipe" else ())

        launches = tuple(self._launch(name, p.grid, args(p), block=plan.block_threads(chosen, self.tuning))
                         for p in _pieces("reduce_scatter", chosen, c, isz, n, lay, self.tuning))
        if red == "avg":
            launches += (self._divide(dt, o, c),)
        return launches, o

    # --- data movement ----------------------------------------------------------------------------
    @_nvtx("allgather")
    def allgather(self, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto",
                  compress: str | None = None, error_feedback=None):
        """out = concat(x of rank 0, x of rank 1, ...) (out=None: shape (n * x.shape[0], ...)). In place:
        x = out[r * x.size : (r + 1) * x.size] (flattened). compress: as allreduce's (not in place)."""
        if compress is not None:
            return _compressed.call(self, "allgather", x, out, compress, error_feedback, "sum", algo, stream,
                                    async_op)
        return self._call(_fast_key("allgather", x, out, algo), lambda s: self._plan_allgather(x, out, algo, s),
                          stream, async_op, out, (x, out))

    def _plan_allgather(self, x, out, algo, stream):
        world = self.world
        n = world.size

        def prepare():
            a = _as_array(x, "x", "allgather", world, stream)
            _move_dtype(a.dtype)
            shape = (n * a.shape[0], *a.shape[1:]) if a.ndim else (n,)
            o = self._output(out, "out", a.dtype, n * a.size, shape, "allgather", stream)
            _check_alias("allgather", a, o, (world.rank * a.nbytes,))
            off = _symmetric_offset(world, o)
            chosen = plan.choose_algo("allgather", n * a.nbytes, n, algo, direct_ok=off is not None,
                                      tuning=self.tuning, half_bytes=self.half_bytes)
            return a, o, chosen, off

        got, err = _local(prepare)
        sig = (("count", None if got is None else got[0].size),
               ("dtype", None if got is None else got[0].dtype.str), *_algo_signature(got))
        _agree(world, "allgather", sig, err)
        a, o, chosen, _ = got
        isz, c = a.itemsize, a.size
        lay = self._layout("allgather", chosen, isz)
        if chosen == "ring":  # in bytes; the kernel skips this rank's chunk when it is already in place
            launches = tuple(self._launch("fluxrt_allgather_ring", p.grid,
                                          self._teams["allgather"] + (_u64(a.data.ptr), _u64(o.data.ptr),
                                                                      _u64(a.nbytes)) + self._ring_tail(p, 1),
                                          block=plan.block_threads(chosen, self.tuning))
                             for p in _pieces("allgather", chosen, c, isz, n, lay, self.tuning))
            return launches, o
        mine = o.data.ptr + world.rank * a.nbytes
        peers = _peer_pointers(o, n) if chosen == "direct" else None

        def table(p, t):
            t[0, :n] = a.data.ptr + p.start * isz
            t[1, :n] = p.count * isz
            t[2, :n] = o.data.ptr + (np.arange(n, dtype=np.uint64) * c + p.start) * isz
            t[3, :n] = p.count * isz
            if peers is not None:
                t[4, :n] = peers + (world.rank * c + p.start) * isz
                if mine == a.data.ptr:  # in place: this rank's chunk is already there
                    t[1, world.rank] = 0

        return self._exchange_launches("allgather", chosen, c, isz, lay, table), o

    @_nvtx("alltoall")
    def alltoall(self, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto"):
        """x holds world.size equal chunks; chunk q goes to rank q, and out's chunk p comes from rank p.
        out=None: same shape as x; out=x is in place."""
        return self._call(_fast_key("alltoall", x, out, algo), lambda s: self._plan_alltoall(x, out, algo, s),
                          stream, async_op, out, (x, out))

    def _plan_alltoall(self, x, out, algo, stream):
        world = self.world
        n = world.size

        def prepare():
            a = _as_array(x, "x", "alltoall", world, stream)
            _move_dtype(a.dtype)
            if a.size % n:
                raise CollectiveArgumentError(f"alltoall: x has {a.size} elements, not a multiple of {n} ranks")
            o = self._output(out, "out", a.dtype, a.size, a.shape, "alltoall", stream)
            _check_alias("alltoall", a, o, (0,))
            # direct pushes (and pairwise phases) would overwrite chunks of an in-place buffer that this rank
            # has still to send
            overlaps = _overlap(a, o)
            off = _symmetric_offset(world, o) if not overlaps else None
            chosen = plan.choose_algo("alltoall", a.nbytes, n, algo, direct_ok=off is not None, tuning=self.tuning,
                                      overlaps=overlaps, half_bytes=self.half_bytes)
            return a, o, chosen, off

        got, err = _local(prepare)
        sig = (("count", None if got is None else got[0].size),
               ("dtype", None if got is None else got[0].dtype.str), *_algo_signature(got))
        _agree(world, "alltoall", sig, err)
        a, o, chosen, _ = got
        isz, c = a.itemsize, a.size // n
        lay = self._layout("alltoall", chosen, isz)
        offsets = np.arange(n, dtype=np.uint64) * c
        peers = _peer_pointers(o, n) if chosen == "direct" else None

        def table(p, t):
            t[0, :n] = a.data.ptr + (offsets + p.start) * isz
            t[1, :n] = p.count * isz
            t[2, :n] = o.data.ptr + (offsets + p.start) * isz
            t[3, :n] = p.count * isz
            if peers is not None:
                t[4, :n] = peers + (world.rank * c + p.start) * isz

        return self._exchange_launches("alltoall", chosen, c, isz, lay, table), o

    @_nvtx("alltoallv")
    def alltoallv(self, x, send_counts, recv_counts=None, out=None, *, send_displs=None, recv_displs=None,
                  max_count: int | None = None, stream=None, async_op: bool = False, algo: str = "auto"):
        """Rank r sends send_counts[q] elements (from x at send_displs[q], default: packed in rank order)
        to every rank q and receives recv_counts[p] from every p into out at recv_displs[p]. Zeros are
        allowed; not in place.

        Every rank must launch as many rounds as the largest pair needs, so by default the counts are
        exchanged over MPI (which also derives recv_counts=None and checks that each pair agrees). With
        ``max_count`` (a bound on every pair's count, the same on every rank), recv_counts given and the
        world's cross-rank checks off, no MPI call is made and repeated calls reuse their launches."""
        trusted = (max_count is not None and recv_counts is not None
                   and not self.world.options.check_collective_args)
        key = None
        if trusted:  # one host copy of each (a device array costs a synchronizing .get())
            send_counts, recv_counts, send_displs, recv_displs = (
                _as_tuple(v) for v in (send_counts, recv_counts, send_displs, recv_displs))
            key = _fast_key("alltoallv", x, out, send_counts, recv_counts, send_displs, recv_displs,
                            int(max_count), algo)
        return self._call(key, lambda s: self._plan_alltoallv(x, send_counts, recv_counts, out, send_displs,
                                                              recv_displs, max_count, trusted, algo, s),
                          stream, async_op, out, (x, out))

    def _plan_alltoallv(self, x, send_counts, recv_counts, out, send_displs, recv_displs, max_count, trusted,
                        algo, stream):
        world = self.world
        n = world.size

        def prepare():
            got = alltoallv_local_args(x, send_counts, recv_counts, send_displs, max_count, world, stream)
            plan.choose_algo("alltoallv", got[0].nbytes, n, algo, tuning=self.tuning)  # validates a forced algo
            return got

        got, err = _local(prepare)
        sig = (("dtype", None if got is None else got[0].dtype.str), ("max_count", max_count), ("algo", algo))
        if trusted:
            if err is not None:
                raise err
            a, sc, sd, rc = got
            largest = int(max_count)
        else:
            extra = ([], None) if got is None else (got[1].tolist(), None if got[3] is None else got[3].tolist())
            every = _agree(world, "alltoallv", sig, err, extra=extra)
            a, sc, sd, _ = got
            matrix = np.array([e[0] for e in every], dtype=np.int64)  # matrix[p][q]: elements p sends to q
            bad = [(p, r, int(matrix[p][r]), e[1][p]) for r, e in enumerate(every) if e[1] is not None
                   for p in range(n) if e[1][p] != matrix[p][r]]
            if bad:
                detail = "; ".join(f"rank {p} sends {s} to rank {r}, which expects {e}" for p, r, s, e in bad[:8])
                raise CollectiveMismatchError(f"alltoallv counts do not match across ranks ({detail})")
            rc = matrix[:, world.rank].copy()
            largest = int(matrix.max(initial=0)) if max_count is None else int(max_count)

        def prepare_out():
            rd = _displs(recv_displs, rc, "recv_displs")
            need = int((rd + rc).max(initial=0))
            o = self._output(out, "out", a.dtype, need, (need,), "alltoallv", stream)
            _check_alias("alltoallv", a, o, ())
            return rd, o

        got2, err2 = _local(prepare_out)
        _agree(world, "alltoallv", sig, err2)
        rd, o = got2
        isz = a.itemsize
        # chosen from agreed values only: the largest pair (or max_count) stands for the message size
        chosen = plan.choose_algo("alltoallv", largest * isz * n, n, algo, tuning=self.tuning)
        lay = self._layout("alltoallv", chosen, isz)
        sd_u, rd_u = sd.astype(np.uint64), rd.astype(np.uint64)

        def table(p, t):
            send = np.clip(sc - p.start, 0, p.count).astype(np.uint64)
            recv = np.clip(rc - p.start, 0, p.count).astype(np.uint64)
            t[0, :n] = a.data.ptr + (sd_u + np.uint64(p.start)) * np.uint64(isz)
            t[1, :n] = send * np.uint64(isz)
            t[2, :n] = o.data.ptr + (rd_u + np.uint64(p.start)) * np.uint64(isz)
            t[3, :n] = recv * np.uint64(isz)

        return self._exchange_launches("alltoallv", chosen, largest, isz, lay, table), o

    @_nvtx("broadcast")
    def broadcast(self, x, out=None, *, root: int = 0, stream=None, async_op: bool = False, algo: str = "auto"):
        """Every rank gets root's x. out=None: in place (x is overwritten on the other ranks), as
        torch.distributed.broadcast; otherwise out receives it on every rank, root included."""
        return self._call(_fast_key("broadcast", x, x if out is None else out, root, algo),
                          lambda s: self._plan_broadcast(x, out, root, algo, s), stream, async_op,
                          x if out is None else out, (x, out))

    def _plan_broadcast(self, x, out, root, algo, stream):
        world = self.world
        n = world.size

        def prepare():
            if not 0 <= int(root) < n:
                raise CollectiveArgumentError(f"broadcast: root {root} outside world of size {n}")
            a = _as_array(x, "x", "broadcast", world, stream, writable=out is None)
            _move_dtype(a.dtype)
            o = a if out is None else self._output(out, "out", a.dtype, a.size, a.shape, "broadcast", stream)
            _check_alias("broadcast", a, o, (0,))
            off = _symmetric_offset(world, o)
            chosen = plan.choose_algo("broadcast", a.nbytes, n, algo, direct_ok=off is not None, tuning=self.tuning)
            return a, o, chosen, off

        got, err = _local(prepare)
        sig = (("count", None if got is None else got[0].size),
               ("dtype", None if got is None else got[0].dtype.str), ("root", root), *_algo_signature(got))
        _agree(world, "broadcast", sig, err)
        a, o, chosen, _ = got
        isz, c, r0 = a.itemsize, a.size, int(root)
        lay = self._layout("broadcast", chosen, isz)
        peers = _peer_pointers(o, n) if chosen == "direct" else None

        def table(p, t):
            nbytes = p.count * isz
            t[0, :n] = a.data.ptr + p.start * isz
            t[1, :n] = nbytes if world.rank == r0 else 0
            t[2, r0] = o.data.ptr + p.start * isz
            t[3, r0] = nbytes
            if peers is not None:
                t[4, :n] = peers + p.start * isz
                if o.data.ptr == a.data.ptr:  # in place on the root: its own copy is already there
                    t[1, world.rank] = 0

        return self._exchange_launches("broadcast", chosen, c, isz, lay, table), o


# ------------------------------------------------------------------------------------------ plans (cached)
@functools.lru_cache(maxsize=1024)
def _allreduce_plan(count: int, itemsize: int, world_size: int, algo: str, half_bytes: int, tuning: plan.Tuning):
    lay = plan.layout("allreduce", algo, half_bytes, world_size, itemsize)
    return lay, tuple(plan.allreduce_pieces(count, itemsize, world_size, algo, lay, tuning))


@functools.lru_cache(maxsize=1024)
def _pieces(op: str, algo: str, count: int, itemsize: int, world_size: int, lay: plan.Layout, tuning: plan.Tuning):
    return tuple(plan.pieces(op, algo, count, itemsize, world_size, lay, tuning))


def _as_tuple(values):
    """Hashable form of a counts/displacements argument (None stays None)."""
    if values is None:
        return None
    return tuple(int(v) for v in (values.get() if hasattr(values, "get") else np.asarray(values)).reshape(-1))


def alltoallv_local_args(x, send_counts, recv_counts, send_displs, max_count, world: World, stream):
    """This rank's alltoallv arguments checked on their own (before the cross-rank agreement): (x as an
    array, send counts, send displacements, recv counts or None)."""
    n = world.size
    a = _as_array(x, "x", "alltoallv", world, stream)
    _move_dtype(a.dtype)
    sc = _counts(send_counts, n, "send_counts")
    sd = _displs(send_displs, sc, "send_displs")
    if (sd + sc).max(initial=0) > a.size:
        raise CollectiveArgumentError(f"alltoallv: send counts/displacements reach element "
                                      f"{int((sd + sc).max())}, x has {a.size}")
    rc = None if recv_counts is None else _counts(recv_counts, n, "recv_counts")
    if max_count is not None and max(sc.max(initial=0), 0 if rc is None else rc.max(initial=0)) > max_count:
        raise CollectiveArgumentError(f"alltoallv: a count exceeds max_count={max_count}")
    return a, sc, sd, rc


def _counts(counts, n: int, name: str) -> np.ndarray:
    c = np.asarray(counts.get() if hasattr(counts, "get") else counts, dtype=np.int64).reshape(-1)
    if c.shape != (n,):
        raise CollectiveArgumentError(f"alltoallv: {name} needs {n} entries (one per rank), got {c.size}")
    if (c < 0).any():
        raise CollectiveArgumentError(f"alltoallv: {name} has negative entries: {c.tolist()}")
    return c


def _displs(displs, counts: np.ndarray, name: str) -> np.ndarray:
    if displs is None:
        return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    d = np.asarray(displs.get() if hasattr(displs, "get") else displs, dtype=np.int64).reshape(-1)
    if d.shape != counts.shape or (d < 0).any():
        raise CollectiveArgumentError(f"alltoallv: {name} needs {counts.size} non-negative entries, got {d.tolist()}")
    return d


# ------------------------------------------------------------------------------------------ functional API
def context(world: World, stream=None) -> Collectives:
    """The world's default collectives context (in the world's registry); made (collectively) on the first
    call, or by the first ``Collectives(world, options)`` or ``prepare(world)``. A world of several nodes
    (``world.topology``) gets the hierarchical context (``collectives_plan.choose_path``). A first call on a
    stream that is capturing a CUDA graph raises GraphCaptureError instead (before anything is enqueued)."""
    ctx = world.registry.get(_KEY)
    if ctx is None:
        world.make_current()   # the stream below and the context's allocations are the world's GPU's
        path, why = plan.choose_path(getattr(world, "topology", None))
        if path == "hierarchical":   # ranks without NVLink pointers between them: fluxrt.collectives_hier
            from . import collectives_hier

            if collectives_hier.KEY not in world.registry and world.rank == 0:
                log.info("collectives: path %s (%s)", path, why)
            return collectives_hier.context(world)
        if as_cupy_stream(stream).is_capturing():
            raise GraphCaptureError(
                "collectives: the first call of a world makes its context (symmetric workspace, flags: "
                "allocations and a device synchronize), which a CUDA graph capture cannot contain; call "
                "fluxrt.prepare(world) (collective) before capturing")
        ctx = Collectives(world)   # registers itself
    return ctx


def prepare(world: World, dtypes=(), ops=("sum",), options: CollectivesOptions | None = None):
    """Make everything the world's collectives need before a CUDA graph capture: the context (collective:
    every rank calls it; `options` for a new one: on a world of several nodes, its node stage's) and the kernels
    of reductions of `dtypes` with `ops` that are not in the base module (fp64, integers, prod, avg). A first
    call inside a capture then works (on a single node: the hierarchical calls are not capturable)."""
    ctx = world.registry.get(_KEY)
    if ctx is None:
        path, _ = plan.choose_path(getattr(world, "topology", None))
        if path != "hierarchical":
            ctx = Collectives(world, options)
        else:
            from . import collectives_hier

            ctx = collectives_hier.context(world, None if options is None else
                                           collectives_hier.HierarchicalOptions(node=options))
    ctx.prepare(dtypes, ops)
    return ctx


def allreduce(world: World, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False, algo: str = "auto",
              compress: str | None = None, error_feedback=None):
    return context(world, stream).allreduce(x, out, op=op, stream=stream, async_op=async_op, algo=algo,
                                            compress=compress, error_feedback=error_feedback)


def reduce_scatter(world: World, x, out=None, *, op: str = "sum", stream=None, async_op: bool = False,
                   algo: str = "auto", compress: str | None = None, error_feedback=None):
    return context(world, stream).reduce_scatter(x, out, op=op, stream=stream, async_op=async_op, algo=algo,
                                                 compress=compress, error_feedback=error_feedback)


def allgather(world: World, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto",
              compress: str | None = None, error_feedback=None):
    return context(world, stream).allgather(x, out, stream=stream, async_op=async_op, algo=algo, compress=compress,
                                            error_feedback=error_feedback)


def alltoall(world: World, x, out=None, *, stream=None, async_op: bool = False, algo: str = "auto"):
    return context(world, stream).alltoall(x, out, stream=stream, async_op=async_op, algo=algo)


def alltoallv(world: World, x, send_counts, recv_counts=None, out=None, *, send_displs=None, recv_displs=None,
              max_count: int | None = None, stream=None, async_op: bool = False, algo: str = "auto"):
    return context(world, stream).alltoallv(x, send_counts, recv_counts, out, send_displs=send_displs,
                                    recv_displs=recv_displs, max_count=max_count, stream=stream,
                                    async_op=async_op, algo=algo)


def broadcast(world: World, x, out=None, *, root: int = 0, stream=None, async_op: bool = False, algo: str = "auto"):
    return context(world, stream).broadcast(x, out, root=root, stream=stream, async_op=async_op, algo=algo)


def barrier(world: World, stream=None) -> None:   # World.barrier carries the NVTX range
    """Stream-ordered barrier across every rank (bounded; a timeout surfaces at the next check)."""
    world.barrier(stream)


allreduce.__doc__ = Collectives.allreduce.__doc__
reduce_scatter.__doc__ = Collectives.reduce_scatter.__doc__
allgather.__doc__ = Collectives.allgather.__doc__
alltoall.__doc__ = Collectives.alltoall.__doc__
alltoallv.__doc__ = Collectives.alltoallv.__doc__
broadcast.__doc__ = Collectives.broadcast.__doc__

__all__ = ["Collectives", "CollectivesOptions", "CollectiveHandle", "context", "prepare", "wait_all", "allreduce",
           "reduce_scatter",
           "allgather", "alltoall", "alltoallv", "broadcast", "barrier"]
