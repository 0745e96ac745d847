"""The compiled GEMM kernel: which -D macros instantiate kernels/gemm/hopper_gemm.cu for a plan, the
loaded module per configuration and device, and the device facts a launch needs (SMs, cluster
occupancy)."""
from __future__ import annotations

import logging
import threading

from ..env import env_flag
from ..errors import GemmArgumentError
from .plan import GemmPlan

log = logging.getLogger("fluxrt.gemm")

KERNEL_SOURCE = "gemm/hopper_gemm.cu"
KERNEL_NAME = "fluxrt_gemm"
IN_IDS = {"bfloat16": 0, "float16": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}
SCALE_IDS = {"none": 0, "tensor": 1, "block": 2}
OUT_IDS = {"bfloat16": 0, "float16": 1, "float32": 2}

_lock = threading.Lock()
_modules: dict = {}


def kernel_defines(plan: GemmPlan, in_dtype: str, out_dtype: str, trans_b: bool, hook_wait: bool = False,
                   hook_epilogue: bool = False, hook_reduce: int = 0,
                   hook_copy: bool = False, bands: int = 0, b_dtype: str | None = None,
                   scale: str = "none", grouped: bool = False) -> tuple[tuple[str, str], ...]:
    """-D macros that instantiate hopper_gemm.cu for one configuration. hook_reduce: 0 none, 1 (or True)
    hook 3 in the epilogue, 2 hook 3 in the tail (:attr:`ChunkReduce.hook_id`). bands: which operands are
    :class:`RowBands` (:func:`band_bits`). fp8 (in_dtype float8_*): b_dtype is B's fp8 type (default A's),
    scale the dequantisation mode (fluxrt.gemm.plan.SCALE_MODES). grouped: the grouped GEMM
    (:func:`fluxrt.gemm.grouped_gemm`)."""
    fp8 = (("FLUXRT_GEMM_IN_B", str(IN_IDS[b_dtype or in_dtype])), ("FLUXRT_GEMM_SCALE", str(SCALE_IDS[scale]))) \
        if IN_IDS[in_dtype] >= 2 else ()
    # hook 4, bands, grouped, split-K, stream-K and ping-pong only when on: every configuration without them keeps its earlier macros (and
    # cache key)
    return (("FLUXRT_GEMM_GROUPED", "1"),) * grouped + (("FLUXRT_GEMM_SPLIT_K", "1"),) * (plan.split_k > 1) + (("FLUXRT_GEMM_STREAM_K", "1"),) * plan.stream_k + (("FLUXRT_GEMM_PINGPONG", "1"),) * plan.pingpong + (("FLUXRT_GEMM_BANDS", str(bands)),) * (bands > 0) + (("FLUXRT_GEMM_HOOK_COPY", "1"),) * hook_copy + (("FLUXRT_GEMM_BN", str(plan.block_n)), ("FLUXRT_GEMM_CONSUMERS", str(plan.consumers)),
            ("FLUXRT_GEMM_STAGES", str(plan.stages)), ("FLUXRT_GEMM_IN", str(IN_IDS[in_dtype])),
            ("FLUXRT_GEMM_OUT", str(OUT_IDS[out_dtype])), ("FLUXRT_GEMM_B_KMAJOR", "1" if trans_b else "0"),
            ("FLUXRT_GEMM_HOOK_WAIT", "1" if hook_wait else "0"),
            ("FLUXRT_GEMM_HOOK_EPILOGUE", "1" if hook_epilogue else "0"),
            ("FLUXRT_GEMM_HOOK_REDUCE", str(int(hook_reduce))),
            ("FLUXRT_GEMM_EPI_DIRECT", "1" if plan.epilogue == "direct" else "0"),
            ("FLUXRT_GEMM_CLUSTER", str(plan.cluster)),
            # 1 only where it changes the kernel (2 consumers): one consumer's plans share one module
            ("FLUXRT_GEMM_C_SHARED", "1" if plan.c_staging == "shared" and plan.consumers > 1 else "0")) + fp8 \
        + (("FLUXRT_GEMM_CLUSTER_N", str(plan.cluster_n)),) * (plan.cluster_n > 1) \
        + (("FLUXRT_GEMM_ROW_BLOCKS", str(plan.row_blocks)),) * (plan.row_blocks > 1) \
        + (("FLUXRT_GEMM_TRACE", "1"),) * trace_build()


def trace_build() -> bool:
    """FLUXRT_GEMM_TRACE=1: kernels loaded from now on are the diagnostic build that records CTA 0's pipeline
    waits per K block (kernels/gemm/config.cuh, read by perf/gemm_trace.py); a different module per
    configuration, slower, for measurement only."""
    return env_flag("FLUXRT_GEMM_TRACE")


def plain_defines(plan: GemmPlan, in_dtype: str, out_dtype: str, trans_b: bool) -> tuple[tuple[str, str], ...]:
    """The macros of a plain 16-bit :func:`fluxrt.gemm.gemm` call (no hooks or bands) under ``plan``: split-K
    plans run the kernel with fp32 partials into banded C (:mod:`fluxrt.gemm.split_k`)."""
    if plan.split_k > 1:
        from .hooks import BANDS_C

        return kernel_defines(plan, in_dtype, "float32", trans_b, bands=BANDS_C)
    return kernel_defines(plan, in_dtype, out_dtype, trans_b)


def compile_options(defines, arch: str | None = None):
    from ..toolchain import CompileOptions

    return CompileOptions(arch=arch, defines=tuple(defines))



def _kernel(defines, device_id: int, smem_bytes: int):
    """The loaded kernel for one configuration, with its dynamic shared memory limit raised once."""
    key = (defines, device_id)
    with _lock:
        k = _modules.get(key)
    if k is None:
        from ..toolchain import load_module

        mod = load_module(KERNEL_SOURCE, compile_options(defines))
        k = mod.get_function(KERNEL_NAME)
        k.max_dynamic_shared_size_bytes = smem_bytes   # > 48 KiB needs the opt-in attribute
        with _lock:
            _modules[key] = k
    return k



_sms: dict = {}


def context_sms(device_id: int) -> int:
    """SMs that kernels of this thread's current context on `device_id` may occupy at once: the device's,
    or fewer where the context is limited to part of the GPU (CUDA MPS with an active thread percentage,
    a context made with an SM-count execution affinity, a green context). Persistent grids are sized by
    this: a fused GEMM's CTAs wait for flags that other CTAs of its grid (or its comm kernels) release, so
    they must all be resident at once, which a grid sized for the whole device is not in a context that
    gets part of it. Cached per (device, context): a context's limit is fixed when it is made."""
    import cupy

    with cupy.cuda.Device(device_id):
        ctx = _current_context()
        n = _sms.get((device_id, ctx))
        if n is None:
            n = _sms[(device_id, ctx)] = _query_sms(device_id, ctx)
    return n


_num_sms = context_sms   # the name the launch paths import


def _current_context() -> int:
    try:
        from cuda.bindings import driver as drv
    except ImportError:   # no driver bindings: only the device attribute can be read
        return 0
    err, ctx = drv.cuCtxGetCurrent()
    return int(ctx) if err == drv.CUresult.CUDA_SUCCESS else 0


def _query_sms(device_id: int, ctx: int) -> int:
    """The device attribute, and what the driver says of this context's share (:func:`sm_share`)."""
    from cupy.cuda import runtime

    total = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id))
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return total
    ok = drv.CUresult.CUDA_SUCCESS
    affinity = resource = None
    try:   # a driver older than the bindings lacks the entry points: nothing reported
        err, aff = drv.cuCtxGetExecAffinity(drv.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT)
        affinity = int(aff.param.smCount.val) if err == ok else None
        if ctx:
            err, res = drv.cuCtxGetDevResource(drv.CUcontext(ctx), drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
            resource = int(res.sm.smCount) if err == ok else None
    except RuntimeError as e:
        log.debug("device %d: SM share not queried (%s)", device_id, e)
    n, why = sm_share(total, affinity, resource)
    if n < total:
        log.info("device %d: this context may use %d of %d SMs (%s); persistent grids are sized for %d",
                 device_id, n, total, why, n)
    return n


def sm_share(total: int, exec_affinity: int | None = None, sm_resource: int | None = None) -> tuple[int, str]:
    """(SMs a context may use, where that number came from) given the device attribute `total` and the
    context's SM-count execution affinity and SM resource as the driver reports them (None or 0: not
    reported). An MPS client with an active thread percentage sees its share in all three (docs/design.md,
    "Testing"); a green context in its SM resource."""
    limits = {"device": total}
    for name, v in (("exec affinity", exec_affinity), ("SM resource", sm_resource)):
        if v and 0 < v < total:
            limits[name] = int(v)
    return min(limits.values()), ", ".join(f"{k} {v}" for k, v in limits.items())


_cluster_caps: dict = {}


def _max_clusters(kern, plan: GemmPlan, smem_bytes: int, device_id: int) -> int | None:
    """How many clusters of plan.cluster_ctas CTAs can be resident at once (GPCs may leave SMs unpaired);
    None for one-CTA clusters or when the driver cannot say."""
    if plan.cluster_ctas == 1:
        return None
    func = kern.kernel.ptr   # cupy.RawKernel -> its loaded CUfunction
    key = (func, device_id)
    if key not in _cluster_caps:
        from cuda.bindings import driver as drv

        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = plan.cluster_ctas * _num_sms(device_id), 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = plan.threads, 1, 1
        cfg.sharedMemBytes = smem_bytes
        err, n = drv.cuOccupancyMaxActiveClusters(drv.CUfunction(func), cfg)
        ok = err == drv.CUresult.CUDA_SUCCESS and n > 0
        if not ok and plan.stream_k:
            # stream-K's finishers wait for pieces of other clusters: every cluster of the grid must be resident
            raise GemmArgumentError(f"gemm: plan {plan.describe()} needs the number of resident clusters, and "
                                    f"cuOccupancyMaxActiveClusters failed ({err}) on device {device_id}; use a "
                                    f"stream-K plan without a cluster")
        if not ok:
            log.warning("cuOccupancyMaxActiveClusters failed (%s); assuming every SM pairs up", err)
        _cluster_caps[key] = int(n) if ok else None
    return _cluster_caps[key]

