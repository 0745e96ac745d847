"""Split-K: a plain GEMM whose K is cut into ``plan.split_k`` slices, for problems whose M x N tiles leave SMs
idle (few tiles, long K).

One launch of the GEMM kernel (FLUXRT_GEMM_SPLIT_K) computes every slice: its rows are ``splits`` bands of
M rows (padded to whole tiles), band s multiplies A[:, s*Ks:min((s+1)*Ks, K)] by the matching slice of B
and stores its fp32 partial in plane s of a workspace [splits, M, N]. Ks is a whole number of K blocks
(plan.split_slices), so K needs no divisibility: only the last slice is shorter, and only its last block
reaches past K, where TMA reads zeros. A second kernel (kernels/gemm/splitk_reduce.cu) sums the planes in
order 0, 1, ... and rounds once into C: deterministic, and graph-capturable (both are plain launches on the
caller's stream). A and B are read in place through their ordinary 2-D tensor maps at the slice's K offset,
so nothing is copied.
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import GemmArgumentError
from ..packed_launch import PackedLaunch
from ..streams import as_cupy_stream
from .kernel import OUT_IDS, _kernel, _num_sms, plain_defines
from .params import gemm_params
from .plan import GemmPlan, split_slices
from .tmaps import tensor_map

REDUCE_SOURCE = "gemm/splitk_reduce.cu"
REDUCE_NAME = "fluxrt_splitk_reduce"
REDUCE_THREADS = 256
MAX_WORKSPACE_BYTES = 1 << 30

_lock = threading.Lock()
_workspaces: dict = {}    # (device, stream) -> [current buffer, *older buffers still referenced by launches]
_reducers: dict = {}


def check_split(plan: GemmPlan, m: int, n: int, k: int) -> tuple[int, int]:
    """(K columns of a slice, slices) of a call (:func:`plan.split_slices`: at most ``plan.split_k`` slices, for
    any K); raises GemmArgumentError when the workspace would be too large."""
    k_slice, s = split_slices(k, plan.split_k, plan.block_k)
    if s * m * n * 4 > MAX_WORKSPACE_BYTES:
        raise GemmArgumentError(f"gemm: split_k={plan.split_k} at M={m}, N={n} needs {s * m * n * 4} B of fp32 "
                                f"partials, more than {MAX_WORKSPACE_BYTES}")
    return k_slice, s


def workspace(device: int, stream_ptr: int, nbytes: int, zeroed: bool = False):
    """A device buffer of at least nbytes for the split-K partials of calls on one stream (calls on one stream
    run one after another, so they can share it). Grows by doubling; a grown-out buffer is kept alive for the
    packed launches that point into it. zeroed: a separate buffer per stream, zeroed on that stream when made
    (stream-K's counters, which its launches leave at zero)."""
    import cupy

    key = (device, stream_ptr, True) if zeroed else (device, stream_ptr)
    with _lock:
        bufs = _workspaces.get(key)
        if bufs and bufs[0].nbytes >= nbytes:
            return bufs[0]
    size = max(nbytes, 2 * bufs[0].nbytes if bufs else 0)
    with cupy.cuda.Device(device):
        if zeroed:
            with as_cupy_stream(stream_ptr):
                buf = cupy.zeros((size,), dtype=cupy.uint8)
        else:
            buf = cupy.empty((size,), dtype=cupy.uint8)
    with _lock:
        _workspaces.setdefault(key, []).insert(0, buf)
    return buf


def release_workspaces(device: int, stream_ptr: int, *, zeroed_only: bool = False) -> None:
    """Drop one stream's split-K and stream-K workspaces (zeroed_only: the stream-K counters alone), after that
    stream's work: the autotuner's private stream after a tuning, or after a stream-K timeout left counts in its
    counters. Launches built earlier keep their buffers alive; the next one gets a new (zeroed) buffer."""
    with _lock:
        if not zeroed_only:
            _workspaces.pop((device, stream_ptr), None)
        _workspaces.pop((device, stream_ptr, True), None)


def _reducer(out_dtype: str, device: int):
    key = (out_dtype, device)
    with _lock:
        k = _reducers.get(key)
    if k is None:
        from ..toolchain import CompileOptions, load_module

        mod = load_module(REDUCE_SOURCE, CompileOptions(defines=(("FLUXRT_SPLITK_OUT", str(OUT_IDS[out_dtype])),)))
        k = mod.get_function(REDUCE_NAME)
        with _lock:
            _reducers[key] = k
    return k


class SplitLaunch:
    """The two launches of one split-K call, enqueued together."""

    __slots__ = ("gemm", "reduce", "workspace")

    def __init__(self, gemm: PackedLaunch, reduce: PackedLaunch, ws):
        self.gemm, self.reduce, self.workspace = gemm, reduce, ws

    def launch(self, stream_ptr: int) -> None:
        self.gemm.launch(stream_ptr)
        self.reduce.launch(stream_ptr)


def load(plan: GemmPlan, in_dt: str, out_dt: str, trans_b: bool, dev: int):
    """A split-K call's kernels, loaded (compiled on first use): (the GEMM of fp32 partials into banded C, the
    slices' reduction, the GEMM's shared memory)."""
    smem = plan.smem_bytes("float32")
    return _kernel(plain_defines(plan, in_dt, out_dt, trans_b), dev, smem), _reducer(out_dt, dev), smem


def prepare(a, b, out, plan: GemmPlan, m: int, n: int, k: int, in_dt: str, out_dt: str, trans_b: bool, dev: int,
            stream_ptr: int) -> SplitLaunch:
    """Build the split-K launches of a checked plain call (CuPy arrays, out allocated)."""
    ks, splits = check_split(plan, m, n, k)
    m_pad = -(-m // plan.block_m) * plan.block_m
    rows = splits * m_pad                                # the launch's M: one band of m_pad rows per slice
    ws = workspace(dev, stream_ptr, splits * m * n * 4)
    kern, reducer, smem = load(plan, in_dt, out_dt, trans_b, dev)
    # the plain GEMM's maps: band s reads them from K column s * ks on (GemmArgs::k_slice)
    tmap_a = tensor_map(a.data.ptr, in_dt, m, k, plan.block_k, plan.block_m)
    if trans_b:
        tmap_b = tensor_map(b.data.ptr, in_dt, n, k, plan.block_k, plan.block_n)
    else:
        tmap_b = tensor_map(b.data.ptr, in_dt, k, n, 64, plan.block_k)
    tmap_c = tensor_map(ws.data.ptr, "float32", m, n, 128 // 4, 64, bands=splits)
    mt, _ = plan.tiles(rows, n)
    params = gemm_params(tmap_a=tmap_a, tmap_b=tmap_b, tmap_c=tmap_c, m=rows, n=n, k=k, group_m=plan.group_m,
                        m_tile_offset=plan.m_tile_offset % mt, chunk_rows=m_pad, chunks_per_peer=1, k_slice=ks)
    grid = plan.grid(rows, n, _num_sms(dev))
    gemm = PackedLaunch(kern, grid, plan.threads, (params,), shared_mem=smem)
    vecs = m * n // 4
    rgrid = max(1, min(-(-vecs // REDUCE_THREADS), 8 * _num_sms(dev)))
    red = PackedLaunch(reducer, rgrid, REDUCE_THREADS,
                       (np.uint64(ws.data.ptr), np.uint64(out.data.ptr), np.int64(vecs), np.int64(vecs),
                        np.int32(splits)))
    return SplitLaunch(gemm, red, ws)


__all__ = ["SplitLaunch", "check_split", "load", "prepare", "release_workspaces", "workspace"]
