"""What both fused ops share: argument checks, the cross-rank argument check, the kernels of
kernels/ops/tp_ops.cu, stream joins and padded-row copies. Operands come in through fluxrt.arrays, flags
go through fluxrt.signals."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from .. import agreement, signals
from ..arrays import as_array
from ..dtypes import normalize_dtype, short_name
from ..topology import require_one_domain
from .plan import MAX_WORLD, Fp8Options, OpsArgumentError, capacity_rows, check_rows, op_sms, padded_shard

if TYPE_CHECKING:
    from ..world import World

log = logging.getLogger("fluxrt.ops")

KERNEL_SOURCE = "ops/tp_ops.cu"
INPUT_DTYPES = ("bfloat16", "float16")
_KEY = "fluxrt.ops"


def input_dtype(dtype, op: str) -> str:
    name = normalize_dtype(dtype).name
    if name not in INPUT_DTYPES:
        raise OpsArgumentError(f"{op}: dtype {dtype!r} not supported; use bf16 or fp16")
    return name


def as_device_array(x, name: str, op: str, stream, *, writable: bool = False):
    """A cupy view of any CUDA array (fluxrt.arrays), ordered after its producer on `stream`."""
    return as_array(x, name=name, op=op, writable=writable, stream=stream, error=OpsArgumentError,
                    type_error=OpsArgumentError)


def check_matrix(x, name: str, op: str, shape: tuple, dtype: str, world: World) -> None:
    """Shape, dtype, row-major layout and device of one operand, before any launch."""
    if tuple(x.shape) != tuple(shape):
        raise OpsArgumentError(f"{op}: {name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.dtype.name != dtype:
        raise OpsArgumentError(f"{op}: {name} is {short_name(x.dtype)}, expected {short_name(dtype)}")
    if not x.flags.c_contiguous:
        raise OpsArgumentError(f"{op}: {name} {tuple(x.shape)} must be C-contiguous (strides {x.strides}); "
                               "use cupy.ascontiguousarray")
    if x.data.ptr % 16:
        raise OpsArgumentError(f"{op}: {name} starts at 0x{x.data.ptr:x}, not 16-byte aligned")
    if x.device.id != world.device_id:
        raise OpsArgumentError(f"{op}: {name} is on device {x.device.id}, the world uses device {world.device_id}")


def check_problem(world: World, op: str, max_m: int, n: int, k: int) -> tuple[int, int, int]:
    """Constructor checks both fused ops share: world size, positive sizes, 16-byte rows for TMA."""
    if world.size > MAX_WORLD:
        raise OpsArgumentError(f"{op}: at most {MAX_WORLD} ranks, got {world.size}")
    if n <= 0 or k <= 0 or max_m <= 0:
        raise OpsArgumentError(f"{op}: max_m, n, k must be positive, got {max_m}, {n}, {k}")
    if max_m < world.size:
        raise OpsArgumentError(f"{op}: max_m={max_m} is below world = {world.size}: no M fits (M is a multiple "
                               "of world)")
    if k % 8 or n % 8:
        raise OpsArgumentError(f"{op}: K={k} and N={n} must be multiples of 8 (16-byte rows for TMA)")
    return int(max_m), int(n), int(k)


def construct(obj, world: World, op: str, max_m: int, n: int, k: int, dtype, trans_b: bool, plan, planner,
              fp8: Fp8Options | None = None) -> None:
    """Both fused ops' constructor checks, agreed across ranks (a mismatch or a local error raises on every
    rank): sets obj.world, dtype, max_m, n, k, trans_b, plan (``plan`` or ``planner(max_m, n, k, world
    size)``, validated), capacity_m (the rows its buffers hold, shards padded to whole tiles), fp8 (the
    validated Fp8Options or None), in_dtype (A's and B's element type: dtype, or uint8 with fp8) and _sms (the
    SMs its grids are sized for, :func:`fluxrt.ops.plan.op_sms`)."""
    require_one_domain(world, f"{op}()", OpsArgumentError)
    obj.world = world

    def local_checks():
        obj.dtype = input_dtype(dtype, op)
        obj.max_m, obj.n, obj.k = check_problem(world, op, max_m, n, k)
        obj.trans_b = bool(trans_b)
        obj.plan = (plan or planner(obj.max_m, obj.n, obj.k, world.size)).validate()
        obj.capacity_m = capacity_rows(obj.max_m, world.size, obj.plan.row_multiple)
        obj.fp8 = check_fp8_options(op, fp8, obj)
        obj.in_dtype = "uint8" if obj.fp8 is not None else obj.dtype
        obj._sms = op_sms(obj.plan, num_sms(world), op)   # the first device query: after the argument checks
        return None, {"max_m": obj.max_m, "n": obj.n, "k": obj.k, "dtype": obj.dtype, "trans_b": obj.trans_b,
                      "plan": repr(obj.plan), "fp8": repr(obj.fp8)}

    checked_on_every_rank(world, f"{op}()", local_checks)
    if log.isEnabledFor(logging.INFO):
        log.info("%s(max_m=%d, n=%d, k=%d, %s, trans_b=%s) on %d ranks: %r", op, obj.max_m, obj.n, obj.k, obj.dtype,
                 obj.trans_b, world.size, obj.plan)


def forward_operands(op, name: str, a_in, b_in, out_in, stream, *, sharded_a: bool, scales=(None, None)):
    """Both fused ops' forward checks, agreed across ranks: A is ``a_shard [M/world, K]`` (sharded_a; out
    is [M, N]) or ``a [M, K_local]`` (out is [M/world, N]); B is [K, N] or, with trans_b, [N, K]; out is
    optional. Returns (a, b, out or None, shard rows, M) as cupy views, ordered on the CuPy `stream`; for
    an fp8 op (A, B uint8) also the checked ``scales`` (scale_a, scale_b): (a, b, out, shard, M, sa, sb)."""
    world, w = op.world, op.world.size
    world.check_errors()   # a sticky device error: no new call on a world whose ranks are out of step
    a_name, a_form = ("a_shard", "[M/world, K]") if sharded_a else ("a", "[M, K_local]")

    def local_checks():
        a = as_device_array(a_in, a_name, name, stream)
        b = as_device_array(b_in, "b", name, stream)
        if a.ndim != 2:
            raise OpsArgumentError(f"{name}: {a_name} must be 2-D {a_form}, got shape {tuple(a.shape)}")
        m = int(a.shape[0]) * (w if sharded_a else 1)
        shard = check_rows(name, m, w, op.max_m)
        check_matrix(a, a_name, name, (shard if sharded_a else m, op.k), op.in_dtype, world)
        check_matrix(b, "b", name, (op.n, op.k) if op.trans_b else (op.k, op.n), op.in_dtype, world)
        out = None
        if out_in is not None:
            out = as_device_array(out_in, "out", name, stream, writable=True)
            check_matrix(out, "out", name, (m if sharded_a else shard, op.n), op.dtype, world)
        sig = {"m": m, "b": tuple(b.shape), "dtype": op.dtype}
        if op.fp8 is None:
            if any(x is not None for x in scales):
                raise OpsArgumentError(f"{name}: scale_a / scale_b are for fp8 inputs: construct the op with "
                                       "fp8=Fp8Options(...)")
            return (a, b, out, shard, m), sig
        sa, sb = fp8_scales(op, name, scales, shard if sharded_a else m, stream, world)
        sig["scales"] = (op.fp8.scale, int(sa.size), int(sb.size))   # () and (1,) alike
        return (a, b, out, shard, m, sa, sb), sig

    return checked_on_every_rank(world, f"{name}.forward", local_checks)


def setup_paths(op, world: World, buffer_cols: int, buffer_dtype: str | None = None,
                scale_shape: tuple | None = None) -> None:
    """Both ops' state of the path choice (fluxrt.ops.cost): the choices made so far, and the decomposed
    path's buffer of [max_m, buffer_cols] (buffer_dtype, default op.dtype; with scale_shape also an fp32
    buffer of gathered fp8 scales) and the collectives context, made now unless the plan asks for the fused
    path only (a capture must not allocate or make a context)."""
    from .cost import DEFAULT_RATES, OPS_RATES

    op._rates = OPS_RATES[DEFAULT_RATES]
    op._paths = {}
    op._decomposed = None
    op._decomposed_cols = buffer_cols
    op._decomposed_dtype = buffer_dtype or op.dtype
    op._decomposed_scales = scale_shape
    if op.plan.path != "fused":
        decomposed_state(op)


def decomposed_state(op):
    """The op's DecomposedState (AllGather+GEMM: gathered A [max_m, K]; GEMM+ReduceScatter: partials
    [max_m, N]), made on first use."""
    if op._decomposed is None:
        from .decomposed import DecomposedState

        op._decomposed = DecomposedState(op.world, op.max_m, op._decomposed_cols, op._decomposed_dtype,
                                         op._rates.comm_sms, scale_shape=op._decomposed_scales, num_sms=op._sms)
    return op._decomposed


def check_fp8_options(op: str, fp8, obj) -> Fp8Options | None:
    """The fp8 option of a constructor (None: 16-bit inputs), validated against the op's layout and plan."""
    if fp8 is None:
        return None
    if not isinstance(fp8, Fp8Options):
        raise OpsArgumentError(f"{op}: fp8 must be a fluxrt.ops.Fp8Options or None, got {type(fp8).__name__}")
    fp8 = fp8.validate()
    if not obj.trans_b:
        raise OpsArgumentError(f"{op}: fp8 inputs need B as [N, K] with trans_b=True (the tensor cores read fp8 "
                               "operands K-major only)")
    if obj.k % 16:
        raise OpsArgumentError(f"{op}: fp8 inputs need K={obj.k} to be a multiple of 16 (16-byte rows of fp8 "
                               "bytes for TMA)")
    if obj.plan.path == "fused":
        raise OpsArgumentError(f"{op}: plan.path='fused' with fp8 inputs: the fused kernels have no fp8 hooks "
                               "yet; use path='auto' or 'decomposed'")
    return fp8


def fp8_scales(op, name: str, scales, rows: int, stream, world: World):
    """scale_a and scale_b of an fp8 call (fp32, C-contiguous, on the world's device): per tensor one
    element each; block scales scale_a [rows of A, ceil(K/128)], scale_b [ceil(N/128), ceil(K/128)]."""
    from ..gemm.plan import FP8_SCALE_BLOCK

    if any(x is None for x in scales):
        raise OpsArgumentError(f"{name}: fp8 inputs need scale_a and scale_b (fp32 device arrays; "
                               f"scale={op.fp8.scale!r})")
    kbs = -(-op.k // FP8_SCALE_BLOCK)
    if op.fp8.scale == "tensor":
        shapes = (((), (1,)), ((), (1,)))
        what = "one element, shape () or (1,)"
    else:
        shapes = (((rows, kbs),), ((-(-op.n // FP8_SCALE_BLOCK), kbs),))
        what = f"block scales: scale_a [{rows}, ceil(K/{FP8_SCALE_BLOCK})], scale_b [ceil(N/{FP8_SCALE_BLOCK}), " \
               f"ceil(K/{FP8_SCALE_BLOCK})]"
    out = []
    for x_in, nm, ok in zip(scales, ("scale_a", "scale_b"), shapes):
        x = as_device_array(x_in, nm, name, stream)
        if tuple(x.shape) not in ok:
            raise OpsArgumentError(f"{name}: {nm} has shape {tuple(x.shape)}, expected {ok[-1]} "
                                   f"(scale={op.fp8.scale!r}: {what})")
        if x.dtype.name != "float32":
            raise OpsArgumentError(f"{name}: {nm} is {short_name(x.dtype)}, expected fp32")
        if not x.flags.c_contiguous:
            raise OpsArgumentError(f"{name}: {nm} {tuple(x.shape)} must be C-contiguous (strides {x.strides})")
        if x.data.ptr % 4:
            raise OpsArgumentError(f"{name}: {nm} starts at 0x{x.data.ptr:x}, not 4-byte aligned")
        if x.device.id != world.device_id:
            raise OpsArgumentError(f"{name}: {nm} is on device {x.device.id}, the world uses device "
                                   f"{world.device_id}")
        out.append(x)
    return out


def choose_call_path(op, name: str, cost_op: str, m: int, stream, path: str | None):
    """The PathChoice of an M-row call on `stream` (fluxrt.ops.cost.choose_path with the op's plan, `path`
    overriding plan.path), made once per (M, capture, path) and agreed across ranks: every rank takes rank
    0's (the GEMM autotune cache the model reads is per host). Logged at INFO."""
    import dataclasses

    from ..gemm.autotune import tuned_us
    from .cost import PathChoice, choose_path

    capturing = bool(stream.is_capturing())
    key = (m, capturing, path)
    got = op._paths.get(key)
    if got is not None:
        return got
    plan = op.plan if path is None else dataclasses.replace(op.plan, path=path).validate()
    world, dt, tb = op.world, op.dtype, op.trans_b
    in_key = dt if op.fp8 is None else fp8_problem(op, 0, op.n, op.k).key_dtype   # the autotune cache's input key
    mine = choose_path(cost_op, m, op.n, op.k, world.size, plan, dt, capturing=capturing, num_sms=op._sms,
                       rates=op._rates,
                       tuned_us=lambda mm, nn, kk: tuned_us(mm, nn, kk, in_key, dt, tb, world.device_id),
                       fp8=op.fp8 is not None, trans_b=bool(tb))
    first = agreement.exchange(world, f"{name}.path", (mine.path, mine.chunks))[0]
    got = mine if first == (mine.path, mine.chunks) else PathChoice(
        first[0], first[1], f"rank 0's choice (this rank: {mine})", mine.fused_us, mine.decomposed_us, mine.candidates)
    if got.path == "decomposed" and op._decomposed is None:
        if capturing:
            raise OpsArgumentError(f"{name}: the decomposed path's buffers are made outside a capture: construct "
                                   "the op with plan.path 'auto' or 'decomposed', or call it once with "
                                   "path='decomposed' before capturing")
        decomposed_state(op)
    op._paths[key] = got
    if log.isEnabledFor(logging.INFO):
        log.info("%s: rank %d, M=%d%s: path %s", name, world.rank, m, " (capturing)" if capturing else "", got)
    return got


def fp8_problem(op, m: int, n: int, k: int):
    """The fluxrt.gemm Fp8Problem of an m x n x k GEMM of an fp8 op (plan choice and autotune key)."""
    from ..gemm.checks import Fp8Problem, fp8_formats

    fa, fb = fp8_formats(op.fp8.format)
    return Fp8Problem(m, n, k, fa, fb, op.dtype, op.fp8.scale)


def checked_on_every_rank(world: World, op: str, local_checks):
    """Run this rank's argument checks, ``local_checks() -> (result, signature dict)``, and agree on the
    call across ranks (fluxrt.agreement): a rank whose own checks failed makes every rank raise, and
    different signatures raise CollectiveMismatchError on every rank. Returns the local result."""
    got, error = agreement.local(local_checks)
    result, what = got if got is not None else (None, {})
    agreement.agree(world, op, tuple(sorted(what.items())), error, rejected=OpsArgumentError, by_rank=True)
    return result


class OpsKernels:
    """The tp_ops.cu kernels of one world's device (the reduce kernel per partial/output type)."""

    def __init__(self, world: World):
        from ..toolchain import load_module

        self.device_id = world.device_id
        with world.device:
            self.module = load_module(KERNEL_SOURCE)
            self.delay = self.module.get_function("fluxrt_ops_delay")
            signals.state(world).lists()   # the flag lists the ops signal and wait on
        self._reduce: dict = {}

    def reduce(self, partial_dtype: str, out_dtype: str):
        from ..toolchain import CompileOptions, load_module

        key = (partial_dtype, out_dtype)
        fn = self._reduce.get(key)
        if fn is None:
            defines = (("FLUXRT_RS_PARTIAL", str({"bfloat16": 0, "float16": 1, "float32": 2}[partial_dtype])),
                       ("FLUXRT_RS_OUT", str({"bfloat16": 0, "float16": 1}[out_dtype])))
            fn = load_module(KERNEL_SOURCE, CompileOptions(defines=defines)).get_function("fluxrt_rs_reduce")
            self._reduce[key] = fn
        return fn


def kernels(world: World) -> OpsKernels:
    """The world's fused-op kernels (in its registry), loaded on first use."""
    return world.registry.get_or_create(_KEY, lambda: OpsKernels(world))


def delay(world: World, seconds: float, stream) -> None:
    """Stream-ordered: hold `stream` back for `seconds` on the GPU (one spinning thread)."""
    kernels(world).delay((1,), (1,), (np.uint64(int(seconds * 1e9)),), stream=stream)


def join(waiter, signaller) -> None:
    """`waiter` stream waits for everything enqueued so far on `signaller` (an event, no host sync)."""
    waiter.wait_event(signaller.record())


def num_sms(world: World) -> int:
    """SMs this process's context may use on the world's device (fluxrt.gemm.context_sms)."""
    from ..gemm.kernel import context_sms

    return context_sms(world.device_id)


def alloc_on(shape, dtype: str, world: World, stream):
    """An output array from CuPy's pool for `stream` (the stream that writes and first reads it)."""
    import cupy

    with world.device, stream:
        return cupy.empty(shape, dtype=normalize_dtype(dtype))


def prepare_gemm(world: World, plan, in_dtype: str, out_dtype: str, trans_b: bool, hook_wait: bool, hook_epilogue: bool,
                 hook_reduce: int = 0, hook_copy: bool = False, bands: int = 0):
    """Compile/load the GEMM instantiation a call will launch before anything of the call is enqueued:
    a compile error then leaves no half-launched op behind for peers to wait on."""
    from ..gemm.kernel import _kernel, kernel_defines

    defines = kernel_defines(plan, in_dtype, out_dtype, trans_b, hook_wait, hook_epilogue, hook_reduce, hook_copy,
                             bands)
    with world.device:
        _kernel(defines, world.device_id, plan.smem_bytes(out_dtype, shard_copy=hook_copy))


def padded_rows(op, shard: int) -> tuple[int, int]:
    """(rows of a shard inside the op, rows of the whole padded problem) for `shard` rows per rank."""
    pad = padded_shard(shard, op.plan.row_multiple)
    return pad, pad * op.world.size


def copy_bands(dst, src, bands: int, dst_rows: int, src_rows: int, stream) -> None:
    """Stream-ordered: band i of `dst` (dst_rows rows at i * dst_rows) gets the first min(dst_rows,
    src_rows) rows of band i of `src` (src_rows rows at i * src_rows); rows of a longer dst band past
    those are zeroed. Both C-contiguous with rows of equal bytes: one copy (and memset) per band."""
    import cupy

    rt = cupy.cuda.runtime
    row = dst.strides[0]
    rows = min(dst_rows, src_rows)
    for i in range(bands):
        d = dst.data.ptr + i * dst_rows * row
        rt.memcpyAsync(d, src.data.ptr + i * src_rows * row, rows * row, rt.memcpyDeviceToDevice, stream.ptr)
        if dst_rows > rows:
            rt.memsetAsync(d + rows * row, 0, (dst_rows - rows) * row, stream.ptr)


def call_plan(op, m: int, out_dtype, *, wait_hook: bool, epilogue_hook: bool, reduce_hook: int = 0,
              copy_hooks=lambda plan: (False,), bands: int = 0):
    """op._gemm_plan(m) for a padded problem of m rows, made and its kernel(s) loaded once per (m, bands)
    (cached in op._gplans): before anything of a call is enqueued, a compile error leaves no half-launched
    op behind for peers to wait on. copy_hooks(plan): the hook-4 settings whose kernels a call with that
    plan may launch. bands: the call's banded operands (fluxrt.gemm.band_bits; a padded call's)."""
    g = op._gplans.get((m, bands))
    if g is None:
        g = op._gemm_plan(m)
        for copy in copy_hooks(g):
            prepare_gemm(op.world, g, op.dtype, out_dtype, op.trans_b, wait_hook, epilogue_hook, reduce_hook, copy,
                         bands)
        # every rank reaches this call's first use of (m, bands) together: none launches a kernel that waits
        # on a peer still compiling its GEMM
        agreement.meet_after_load(op.world, f"{type(op).__name__}: first call with {m} padded rows")
        op._gplans[(m, bands)] = g
        if log.isEnabledFor(logging.INFO):
            log.info("%s: rank %d, %d padded rows (bands %d): GEMM plan %r", type(op).__name__, op.world.rank, m,
                     bands, g)
    return g
