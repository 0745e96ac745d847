"""Hopper GEMM on a GPU: correctness against a float64 reference, tails, both B layouts, plans, hooks.

Run on an H100/H200: python3 -m pytest tests/gpu/test_gemm.py -q
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.hopper   # skipped off Hopper, with the reason (conftest.py)

from fluxrt.errors import decode_error_record, op_id  # noqa: E402
from fluxrt.gemm import (ArrivalWait, ChunkReduce, GemmArgumentError, ShardCopy, TileDestinations,  # noqa: E402
                         TileEpilogue, gemm, gemm_with_hooks)
from fluxrt.gemm.plan import GemmPlan, max_stages, plan_gemm  # noqa: E402
from gemm_checks import BF16, NAN_BITS, NP_DT, TOL, poisoned, rand_matrix  # noqa: E402


def to_device(x: np.ndarray):
    return cupy.asarray(x)


def reference(a: np.ndarray, b: np.ndarray, trans_b: bool) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    flops = 2 * a.shape[0] * a.shape[1] * (b.shape[0] if trans_b else b.shape[1])
    if flops > 2e10:   # big problems: float64 cuBLAS on the GPU (same float64 reference, seconds not minutes)
        r = cupy.asarray(a64) @ (cupy.asarray(b64).T if trans_b else cupy.asarray(b64))
        return cupy.asnumpy(r)
    return a64 @ (b64.T if trans_b else b64)


def rel_err(c, ref: np.ndarray) -> float:
    c64 = cupy.asnumpy(c).astype(np.float64)
    assert not np.isnan(c64).any(), f"{np.isnan(c64).sum()} output elements never written (still NaN)"
    return float(np.linalg.norm(c64 - ref) / np.linalg.norm(ref))


def with_staging(plan: GemmPlan, c_staging: str, out_dtype: str = "bfloat16") -> GemmPlan:
    """`plan` with the given C staging; shared staging gets the deepest ring (<= 6) that its smaller
    staging buffer makes room for (4 stages at 128x256 bf16)."""
    if c_staging == "per_consumer":
        return plan
    stages = min(6, max_stages(plan.block_m, plan.block_n, out_dtype, c_staging=c_staging))
    return dataclasses.replace(plan, c_staging=c_staging, stages=stages).validate(out_dtype)


def run_case(m, n, k, *, in_dtype="bfloat16", out_dtype=None, trans_b=False, plan=None, seed=0, stream=None):
    out_dtype = out_dtype or in_dtype
    rng = np.random.default_rng(seed)
    a = rand_matrix(rng, (m, k), in_dtype)
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), in_dtype)
    da, db = to_device(a), to_device(b)
    out = poisoned((m, n), out_dtype)
    if stream is not None:
        cupy.cuda.Device().synchronize()   # inputs/poison were written on the null stream
    res = gemm(da, db, out, trans_b=trans_b, plan=plan, stream=stream)
    assert res is out
    cupy.cuda.get_current_stream().synchronize()
    if stream is not None:
        cupy.cuda.Device().synchronize()
    err = rel_err(out, reference(a, b, trans_b))
    assert err < TOL[out_dtype], f"M={m} N={n} K={k} {in_dtype}->{out_dtype} trans_b={trans_b}: rel err {err:.3e}"
    return err


# --- plain GEMM ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (129, 264, 72), (257, 72, 136), (128, 256, 64),
                                   (512, 384, 16), (512, 384, 64), (384, 512, 16384), (2048, 2048, 2048)])
def test_bf16_shapes(m, n, k, trans_b):
    run_case(m, n, k, trans_b=trans_b)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("in_dtype,out_dtype", [("float16", "float16"), ("bfloat16", "float32"),
                                                ("float16", "float32"), ("bfloat16", "float16"),
                                                ("float16", "bfloat16")])
def test_dtypes(in_dtype, out_dtype, trans_b):
    run_case(1000, 1000, 1000, in_dtype=in_dtype, out_dtype=out_dtype, trans_b=trans_b, seed=1)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
def test_large_once(trans_b):
    run_case(8192, 7168, 8192, trans_b=trans_b, seed=2)


PLANS = [
    GemmPlan(block_m=128, block_n=128, stages=6),
    GemmPlan(block_m=128, block_n=64, stages=6),
    GemmPlan(block_m=128, block_n=192, stages=3),
    GemmPlan(block_m=64, block_n=256, consumers=1, stages=4),
    GemmPlan(block_m=64, block_n=128, consumers=1, stages=6),
    GemmPlan(order="hilbert"),
    GemmPlan(order="grouped", group_m=3, m_tile_offset=5),
    GemmPlan(order="hilbert", m_tile_offset=2, max_ctas=7),
    GemmPlan(max_ctas=1),
    GemmPlan(epilogue="direct", stages=4),
    GemmPlan(epilogue="direct", block_n=128, stages=6, order="hilbert"),
    GemmPlan(cluster=2),
    GemmPlan(cluster=2, block_n=128, stages=6, order="hilbert", m_tile_offset=3),
    GemmPlan(cluster=2, block_n=192, stages=3, group_m=3, max_ctas=6),
    GemmPlan(cluster=2, block_n=64, stages=6),
    GemmPlan(cluster=2, block_m=64, block_n=256, consumers=1, stages=4),
    GemmPlan(cluster=2, epilogue="direct", stages=4),
    # shared C staging: the two consumers take turns on one consumer's staging region
    GemmPlan(stages=4, c_staging="shared"),
    GemmPlan(stages=4, c_staging="shared", order="hilbert", m_tile_offset=3, max_ctas=7),
    GemmPlan(block_n=128, stages=6, c_staging="shared", group_m=3),
    GemmPlan(cluster=2, stages=4, c_staging="shared"),
    GemmPlan(cluster=2, block_n=128, stages=6, c_staging="shared", order="hilbert", m_tile_offset=3),
    GemmPlan(block_n=192, stages=5, c_staging="shared"),              # the autotuner's deeper rings
    GemmPlan(cluster=2, block_n=192, stages=5, c_staging="shared", group_m=5),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.block_m}x{p.block_n}s{p.stages}-{p.order}"
                                                      f"g{p.group_m}o{p.m_tile_offset}c{p.max_ctas}-{p.epilogue}"
                                                      f"{'-sharedC' if p.c_staging == 'shared' else ''}-x{p.cluster}")
@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
def test_plans(plan, trans_b):
    run_case(1000, 1000, 520, trans_b=trans_b, plan=plan, seed=3)


FITTED = [GemmPlan(block_n=112, stages=6, epilogue="direct"), GemmPlan(block_n=144, stages=6, epilogue="direct"),
          GemmPlan(block_n=240, stages=4, epilogue="direct", order="hilbert"),
          GemmPlan(block_m=64, block_n=80, consumers=1, stages=8, epilogue="direct"),
          GemmPlan(block_n=112, stages=6), GemmPlan(block_n=176, stages=4, order="hilbert"),
          GemmPlan(block_n=144, stages=5, c_staging="shared"),
          GemmPlan(block_m=64, block_n=208, consumers=1, stages=5),
          # in pairs along M (B multicast: half of B's rows, or every other 64-column slab, from each CTA)
          GemmPlan(block_n=176, stages=4, cluster=2), GemmPlan(block_n=240, stages=4, c_staging="shared", cluster=2),
          GemmPlan(block_n=112, stages=6, epilogue="direct", cluster=2)]


@pytest.mark.parametrize("plan", FITTED, ids=lambda p: f"{p.block_m}x{p.block_n}s{p.stages}-{p.order}-{p.epilogue}"
                                                      f"{'-sharedC' if p.c_staging == 'shared' else ''}")
@pytest.mark.parametrize("m,n,k,out_dtype", [(1000, 1000, 520, "bfloat16"), (257, 7168, 1000, "bfloat16"),
                                             (129, 264, 40, "float32"), (300, 2000, 4104, "float16"),
                                             (200, 96, 64, "bfloat16")])
@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
def test_fitted_tile_widths(plan, m, n, k, out_dtype, trans_b):
    # tile widths between the multiples of 64: N tails inside a tile and across tiles (N % block_n of every kind;
    # N below one tile), K shorter than one block, K tails, every output type; staged, the inner tile columns'
    # part-filled last slab goes through the tiles' view of C. B as [K, N]: whole 64-column slabs of B per stage,
    # the last one read in part (the next tile's columns, or zeros past N)
    in_dtype = "float16" if out_dtype == "float16" else "bfloat16"
    fits = max_stages(plan.block_m, plan.block_n, out_dtype, plan.epilogue, plan.c_staging, b_kmajor=trans_b)
    plan = dataclasses.replace(plan, stages=min(plan.stages, fits))   # fp32 output: a larger C staging
    run_case(m, n, k, trans_b=trans_b, plan=plan, in_dtype=in_dtype, out_dtype=out_dtype, seed=21)


def test_fitted_tile_width_with_b_as_k_by_n_takes_more_shared_memory():
    # 128 x 144 with B as [K, N] stages 192 columns of B: 5 stages fit with B as [N, K], not with [K, N]
    a, b = cupy.zeros((256, 128), BF16), cupy.zeros((128, 512), BF16)
    plan = GemmPlan(block_n=144, stages=5)
    gemm(a, cupy.ascontiguousarray(b.T), trans_b=True, plan=plan)
    with pytest.raises(ValueError, match="shared memory"):
        gemm(a, b, trans_b=False, plan=plan)


CLUSTER_N = [GemmPlan(cluster=2, cluster_n=2), GemmPlan(cluster_n=2, block_n=64, stages=8),
             GemmPlan(block_m=64, consumers=1, block_n=128, stages=8, cluster_n=2),
             GemmPlan(cluster=2, cluster_n=2, block_n=192, stages=4, order="hilbert", m_tile_offset=3),
             GemmPlan(cluster=2, cluster_n=2, block_n=128, stages=6, c_staging="shared"),
             GemmPlan(cluster=2, cluster_n=2, block_m=64, consumers=1, stages=4),
             GemmPlan(cluster=2, cluster_n=2, epilogue="direct", stages=4),
             GemmPlan(cluster_n=2, group_m=3, max_ctas=6),
             # fitted widths (the last slab part-filled, the last tile column through C's own map) and 256-row tiles
             GemmPlan(block_n=144, stages=4, c_staging="shared", cluster_n=2),
             GemmPlan(block_n=176, stages=4, cluster=2, cluster_n=2),
             GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared", cluster_n=2),
             GemmPlan(block_m=256, block_n=160, stages=3, c_staging="shared", cluster=2, cluster_n=2),
             GemmPlan(block_m=256, block_n=128, stages=4, epilogue="direct", cluster=2, cluster_n=2)]


@pytest.mark.parametrize("plan", CLUSTER_N, ids=lambda p: p.describe().replace(" ", "_"))
@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 520), (257, 648, 136), (130, 72, 40), (513, 1400, 4104)])
def test_cluster_along_n(plan, m, n, k, trans_b):
    # clusters of 1 x 2 and 2 x 2 CTAs (A multicast along N, with B multicast along M): odd tile counts on
    # either axis leave phantom tiles in the last slot row or column, N below one tile, K below one block
    run_case(m, n, k, trans_b=trans_b, plan=plan, seed=31)


def test_cluster_along_n_sanitize_small():
    # compute-sanitizer's case (launch/gpu-check.sh): a 2 x 2 cluster with phantom tiles on both axes, B [N, K];
    # a 1 x 2 cluster of one-consumer tiles, B [K, N]
    run_case(257, 648, 136, trans_b=True, plan=GemmPlan(cluster=2, cluster_n=2), seed=32)
    run_case(257, 648, 136, plan=GemmPlan(block_m=64, consumers=1, block_n=128, stages=8, cluster_n=2), seed=33)
    # 256-row tiles of a fitted width in a 2 x 2 cluster: the pair along N splits A's 256 rows, along M B's 144
    run_case(300, 648, 136, trans_b=True, plan=GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared",
                                                        cluster=2, cluster_n=2), seed=34)


def test_cluster_along_n_is_for_plain_16_bit_gemms():
    a8, b8 = cupy.zeros((256, 256), cupy.uint8), cupy.zeros((256, 256), cupy.uint8)
    with pytest.raises(GemmArgumentError, match="cluster_n=2"):
        gemm(a8, b8, trans_b=True, fp8_format="e4m3", plan=GemmPlan(block_k=128, cluster_n=2),
             out_dtype="bfloat16")


@pytest.mark.parametrize("c_staging", ["per_consumer", "shared"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("m,n,k", [(1100, 1000, 520), (129, 264, 72), (130, 72, 136)])
def test_cluster_odd_tile_rows(m, n, k, trans_b, c_staging):
    # an odd number of M tiles leaves one CTA of the last cluster without a tile of its own (its storer
    # still passes the staging token from turn to turn with shared staging)
    plan = with_staging(dataclasses.replace(plan_gemm(m, n, k), cluster=2, m_tile_offset=1), c_staging)
    run_case(m, n, k, trans_b=trans_b, plan=plan, seed=13)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_direct_epilogue_tails(out_dtype):
    plan = GemmPlan(epilogue="direct", stages=4) if out_dtype == "bfloat16" else \
        GemmPlan(epilogue="direct", block_n=128, stages=6)
    run_case(129, 264, 72, out_dtype=out_dtype, plan=plan, seed=11)
    run_case(1000, 1000, 1000, out_dtype=out_dtype, trans_b=True, plan=plan, seed=12)


@pytest.mark.parametrize("cluster", [1, 2])
def test_shared_staging_fp32_out_tails(cluster):
    # 128x256 fp32: 64 KiB of shared staging leaves room for 3 stages (per-consumer staging: 2)
    plan = GemmPlan(stages=3, c_staging="shared", cluster=cluster).validate("float32")
    run_case(129, 264, 72, out_dtype="float32", plan=plan, seed=14)
    run_case(1000, 1000, 1000, out_dtype="float32", trans_b=True, plan=plan, seed=15)


def test_raw_stream_handle_and_cupy_stream():
    s = cupy.cuda.Stream(non_blocking=True)
    run_case(640, 512, 256, stream=s.ptr)
    run_case(640, 512, 256, stream=s, seed=4)
    # handle 0 (the legacy default stream), also where the call zeroes a stream-K workspace on its stream
    run_case(640, 512, 256, stream=0, seed=5)
    run_case(461, 1000, 4104, stream=0, plan=GemmPlan(block_n=128, stages=6, stream_k=True), seed=6)
    run_case(461, 1000, 4104, stream=s.ptr, plan=GemmPlan(block_n=128, stages=6, stream_k=True), seed=7)


def test_unaligned_shape_rejected_before_launch():
    # 129 x 257 x 72: N = 257 bf16 elements = 514-byte rows, not a multiple of 16 (TMA requirement)
    a = cupy.ones((129, 72), dtype=BF16)
    b = cupy.ones((72, 257), dtype=BF16)
    with pytest.raises(GemmArgumentError, match="257"):
        gemm(a, b)


def test_out_allocated_and_repeatable():
    rng = np.random.default_rng(5)
    a = to_device(rand_matrix(rng, (300, 200), "bfloat16"))
    b = to_device(rand_matrix(rng, (200, 136), "bfloat16"))
    c1 = gemm(a, b)
    c2 = gemm(a, b)
    assert c1.shape == (300, 136) and c1.dtype == BF16
    assert cupy.array_equal(c1.view(cupy.uint16), c2.view(cupy.uint16))   # deterministic


# --- hooks -----------------------------------------------------------------------------------------

_SETTER_SRC = r"""
extern "C" __global__ void late_chunks(char* dst, const char* src, unsigned long long chunk_bytes, int chunks,
                                       unsigned long long* flags, unsigned long long epoch,
                                       unsigned long long delay_ns) {
    // Publishes chunks in reverse order, each after a delay: copy -> fence.sys -> st.release.sys flag.
    for (int i = chunks - 1; i >= 0; --i) {
        if (threadIdx.x == 0) {
            unsigned long long t0, t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < delay_ns);
        }
        __syncthreads();
        const uint4* s = reinterpret_cast<const uint4*>(src + i * chunk_bytes);
        uint4* d = reinterpret_cast<uint4*>(dst + i * chunk_bytes);
        for (unsigned long long j = threadIdx.x; j < chunk_bytes / 16; j += blockDim.x) d[j] = s[j];
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(flags + i), "l"(epoch) : "memory");
        }
    }
}
"""


@pytest.fixture(scope="module")
def setter():
    return cupy.RawKernel(_SETTER_SRC, "late_chunks")


def _err_record():
    return cupy.zeros(6, dtype=cupy.uint64)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
def test_arrival_wait_sees_late_chunks(setter, trans_b):
    m, n, k, chunk_rows = 1024, 768, 512, 256
    chunks = m // chunk_rows
    rng = np.random.default_rng(6)
    a = rand_matrix(rng, (m, k), "bfloat16")
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), "bfloat16")
    staged, db = to_device(a), to_device(b)
    da = cupy.empty_like(staged)
    da.view(cupy.uint16).fill(NAN_BITS["bfloat16"])   # A arrives only through the setter
    flags = cupy.zeros(chunks, dtype=cupy.uint64)
    err = _err_record()
    plan = dataclasses.replace(plan_gemm(m, n, k), max_ctas=64)   # leave SMs for the setter kernel
    side = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.Stream(non_blocking=True)
    ref = reference(a, b, trans_b)
    # compile + load the hooked kernel first (epoch 0 is always satisfied), so that below the GEMM is
    # really running while the setter is still publishing
    gemm_with_hooks(staged, db, trans_b=trans_b, plan=plan,
                    wait=ArrivalWait(flags=flags, epoch=0, chunk_rows=chunk_rows, err=err))
    for epoch in (1, 2):                       # flags are never reset: the epoch grows
        da.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
        out = poisoned((m, n), "bfloat16")
        cupy.cuda.Device().synchronize()       # the non-blocking streams below do not order after these
        with side:
            setter((1,), (256,), (da, staged, np.uint64(chunk_rows * k * 2), np.int32(chunks), flags,
                                  np.uint64(epoch), np.uint64(20_000_000)))
        gemm_with_hooks(da, db, out, trans_b=trans_b, plan=plan, stream=main,
                        wait=ArrivalWait(flags=flags, epoch=epoch, chunk_rows=chunk_rows, err=err,
                                         timeout_ns=5_000_000_000, op_id=op_id("test_gemm.arrival"), rank=0))
        cupy.cuda.Device().synchronize()
        assert decode_error_record(cupy.asnumpy(err)) is None
        e = rel_err(out, ref)
        assert e < TOL["bfloat16"], f"epoch {epoch}: rel err {e:.3e}"


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("which", ["A", "C", "C+wait", "A+C"])
def test_row_bands_read_a_and_write_c_in_place(which, trans_b, cluster):
    """RowBands: 3 bands of 256 GEMM rows hold 200 real rows each. Banded A is read in place, its padding
    rows as zeros (the rows of C they make are exactly 0); banded C gets every real row (N and K tails)
    and nothing else: not the padding rows (A's padding there is random, so a misplaced tile shows), not
    past its end (a poisoned guard). With hook 1 the band height is chunk_rows * chunks_per_peer."""
    from fluxrt.gemm import RowBands

    bands, stride, rows, n, k = 3, 256, 200, 264, 136
    rng = np.random.default_rng(29)
    a_pad = rand_matrix(rng, (bands * stride, k), "bfloat16")
    real = np.concatenate([np.arange(i * stride, i * stride + rows) for i in range(bands)])
    banded_a = "A" in which
    if banded_a:
        a_pad[np.setdiff1d(np.arange(bands * stride), real)] = 0   # what the GEMM must read there
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), "bfloat16")
    ref = reference(a_pad, b, trans_b)
    da = to_device(np.ascontiguousarray(a_pad[real]) if banded_a else a_pad)
    bands_ = RowBands(rows, stride)
    wait = None
    if which == "C+wait":
        flags = cupy.full((bands * stride // 128,), 3, dtype=cupy.uint64)   # every chunk already in place
        wait = ArrivalWait(flags=flags, epoch=3, chunk_rows=128, err=_err_record(), chunks_per_peer=2,
                           timeout_ns=500_000_000, op_id=op_id("test_gemm.bands"), rank=0)
    banded_c = "C" in which
    guard = 64
    big = poisoned((bands * rows + guard, n) if banded_c else (bands * stride, n), "bfloat16")
    out = big[:bands * rows] if banded_c else big
    plan = dataclasses.replace(plan_gemm(bands * stride, n, k), cluster=cluster)
    for call in (1, 2):
        res = gemm_with_hooks(da, to_device(b), out, trans_b=trans_b, plan=plan, wait=wait,
                              a_bands=bands_ if banded_a else None, c_bands=bands_ if banded_c else None)
        cupy.cuda.Device().synchronize()
        assert res is out
        if banded_c:
            e = rel_err(out, ref[real])
            assert cupy.all(big[bands * rows:].view(cupy.uint16) == NAN_BITS["bfloat16"]), "wrote past banded C"
        else:
            e = rel_err(out, ref)
            pad_rows = np.setdiff1d(np.arange(bands * stride), real)
            assert not cupy.asnumpy(out[pad_rows]).astype(np.float64).any(), "padding rows of banded A not zero"
        assert e < TOL["bfloat16"], f"{which} call {call}: rel err {e:.3e}"
        if wait is not None:
            assert decode_error_record(cupy.asnumpy(wait.err)) is None


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("cluster", [1, 2])
def test_shard_copy_reads_own_rows_from_source_and_copies_them(trans_b, cluster):
    """Hook 4: the own rows come from their source (A's copy of them is poison, and their chunk flags are
    never raised: a wait on them would time out), land in A bit for bit (K tail included), and every
    piece is counted once per chunk."""
    m, n, k, chunk_rows, row0, rows = 1024, 768, 520, 256, 256, 512   # K tail: 520 = 8 * 64 + 8
    rng = np.random.default_rng(17)
    a = rand_matrix(rng, (m, k), "bfloat16")
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), "bfloat16")
    da, db = to_device(a), to_device(b)
    src = to_device(a[row0:row0 + rows])
    flags = cupy.asarray(np.array([7, 0, 0, 7], dtype=np.uint64))   # own chunks 1, 2: never raised
    counters = cupy.asarray(np.array([5, 11], dtype=np.uint64))
    err = _err_record()
    plan = dataclasses.replace(plan_gemm(m, n, k), cluster=cluster)
    ref = reference(a, b, trans_b)
    for call in (1, 2):
        da[row0:row0 + rows].view(cupy.uint16).fill(NAN_BITS["bfloat16"])
        out = poisoned((m, n), "bfloat16")
        gemm_with_hooks(da, db, out, trans_b=trans_b, plan=plan,
                        wait=ArrivalWait(flags=flags, epoch=7, chunk_rows=chunk_rows, err=err, timeout_ns=500_000_000,
                                         op_id=op_id("test_gemm.copy"), rank=0),
                        copy=ShardCopy(src=src, row0=row0, counters=counters.data.ptr))
        cupy.cuda.Device().synchronize()
        assert decode_error_record(cupy.asnumpy(err)) is None
        e = rel_err(out, ref)
        assert e < TOL["bfloat16"], f"call {call}: rel err {e:.3e}"
        assert cupy.array_equal(da[row0:row0 + rows].view(cupy.uint16), src.view(cupy.uint16))
        pieces = ShardCopy.pieces_per_chunk(chunk_rows, k)   # 2 tile rows x 9 K blocks
        assert cupy.asnumpy(counters).tolist() == [5 + call * pieces, 11 + call * pieces]


def test_arrival_wait_times_out_and_reports():
    m, n, k = 512, 256, 128
    rng = np.random.default_rng(7)
    da = to_device(rand_matrix(rng, (m, k), "bfloat16"))
    db = to_device(rand_matrix(rng, (k, n), "bfloat16"))
    flags = cupy.zeros(2, dtype=cupy.uint64)
    err = _err_record()
    gemm_with_hooks(da, db, wait=ArrivalWait(flags=flags, epoch=1, chunk_rows=256, err=err, timeout_ns=2_000_000,
                                             chunks_per_peer=1, op_id=op_id("test_gemm.timeout"), rank=3))
    cupy.cuda.Device().synchronize()   # the kernel must finish despite the missing signal
    exc = decode_error_record(cupy.asnumpy(err))
    assert exc is not None and exc.rank == 3 and exc.expected == 1 and exc.op == "test_gemm.timeout"
    assert exc.peer in (0, 1)


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("signal_add", [False, True], ids=["set", "add"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("c_staging", ["per_consumer", "shared"])
def test_tile_epilogue_routes_tiles_and_signals(trans_b, signal_add, out_dtype, cluster, c_staging):
    # with shared staging the storer copies each tile in two turns; its flag rises after the second
    m, n, k, chunk_rows = 1000, 776, 264, 256
    plan = with_staging(dataclasses.replace(plan_gemm(m, n, k, out_dtype=out_dtype), cluster=cluster), c_staging,
                        out_dtype)
    chunks = -(-m // chunk_rows)
    rng = np.random.default_rng(8)
    a = rand_matrix(rng, (m, k), "bfloat16")
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), "bfloat16")
    da, db = to_device(a), to_device(b)
    ld = n + 72                                    # padded destination rows (multiple of 8 elements)
    dsts = [poisoned((chunk_rows, ld), out_dtype) for _ in range(chunks)]   # e.g. one peer buffer per chunk
    n_tiles = -(-n // plan.block_n)
    tiles_per_chunk = (chunk_rows // plan.block_m) * n_tiles
    flag_arrays = [cupy.zeros(tiles_per_chunk, dtype=cupy.uint64) for _ in range(chunks)]
    flag_table = cupy.asarray(np.array([f.data.ptr for f in flag_arrays], dtype=np.uint64))
    local = poisoned((m, n), out_dtype)
    epi = TileEpilogue(destinations=TileDestinations([d.data.ptr for d in dsts], ld, out_dtype), chunk_rows=chunk_rows,
                       flag_table=flag_table, signal_value=7, signal_add=signal_add)
    for _ in range(2 if signal_add else 1):
        gemm_with_hooks(da, db, local, trans_b=trans_b, plan=plan, out_dtype=out_dtype, epilogue=epi)
    cupy.cuda.Device().synchronize()
    got = np.concatenate([cupy.asnumpy(d)[:, :n] for d in dsts])[:m]
    ref = reference(a, b, trans_b)
    g64 = got.astype(np.float64)
    assert not np.isnan(g64).any()
    e = float(np.linalg.norm(g64 - ref) / np.linalg.norm(ref))
    assert e < TOL[out_dtype], f"rel err {e:.3e}"
    # padding columns, the last chunk's rows past M and the local output are untouched
    for d in dsts:
        assert np.isnan(cupy.asnumpy(d)[:, n:].astype(np.float64)).all()
    assert np.isnan(cupy.asnumpy(dsts[-1])[m - (chunks - 1) * chunk_rows:].astype(np.float64)).all()
    assert np.isnan(cupy.asnumpy(local).astype(np.float64)).all()
    # one flag per tile that exists; tiles past M never signal
    m_tiles = -(-m // plan.block_m)
    expect = 14 if signal_add else 7
    for c, f in enumerate(flag_arrays):
        fv = cupy.asnumpy(f).reshape(chunk_rows // plan.block_m, n_tiles)
        for lm in range(fv.shape[0]):
            gm = c * (chunk_rows // plan.block_m) + lm
            want = expect if gm < m_tiles else 0
            assert (fv[lm] == want).all(), f"chunk {c} local m tile {lm}: flags {fv[lm]} (want {want})"


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("c_staging", ["per_consumer", "shared"])
def test_both_hooks_together(setter, cluster, c_staging):
    m, n, k, chunk_rows = 768, 512, 256, 256
    chunks = m // chunk_rows
    rng = np.random.default_rng(9)
    a = rand_matrix(rng, (m, k), "bfloat16")
    b = rand_matrix(rng, (k, n), "bfloat16")
    staged, db = to_device(a), to_device(b)
    da = cupy.empty_like(staged)
    da.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
    arrival = cupy.zeros(chunks, dtype=cupy.uint64)
    err = _err_record()
    dst = poisoned((m, n), "bfloat16")
    dests = TileDestinations([dst.data.ptr + c * chunk_rows * n * 2 for c in range(chunks)], n, "bfloat16")
    plan = with_staging(dataclasses.replace(plan_gemm(m, n, k), max_ctas=32, m_tile_offset=2, cluster=cluster),
                        c_staging)
    n_tiles = -(-n // plan.block_n)
    tile_flags = cupy.zeros(chunks * (chunk_rows // plan.block_m) * n_tiles, dtype=cupy.uint64)
    per_chunk = (chunk_rows // plan.block_m) * n_tiles
    flag_table = cupy.asarray(np.array([tile_flags.data.ptr + 8 * c * per_chunk for c in range(chunks)], np.uint64))
    side, main = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    # warm-up (compile/load; epoch 0 always satisfied): A is still NaN, so dst gets NaN and flags 1
    gemm_with_hooks(da, db, plan=plan, wait=ArrivalWait(flags=arrival, epoch=0, chunk_rows=chunk_rows, err=err),
                    epilogue=TileEpilogue(destinations=dests, chunk_rows=chunk_rows, flag_table=flag_table,
                                          signal_value=1))
    cupy.cuda.Device().synchronize()
    with side:
        setter((1,), (256,), (da, staged, np.uint64(chunk_rows * k * 2), np.int32(chunks), arrival, np.uint64(3),
                              np.uint64(3_000_000)))
    gemm_with_hooks(da, db, plan=plan, stream=main,
                    wait=ArrivalWait(flags=arrival, epoch=3, chunk_rows=chunk_rows, err=err),
                    epilogue=TileEpilogue(destinations=dests, chunk_rows=chunk_rows, flag_table=flag_table,
                                          signal_value=3))
    cupy.cuda.Device().synchronize()
    assert decode_error_record(cupy.asnumpy(err)) is None
    e = rel_err(dst, reference(a, b, False))
    assert e < TOL["bfloat16"]
    assert (cupy.asnumpy(tile_flags) == 3).all()


_LATE_FLAGS_SRC = r"""
extern "C" __global__ void late_flags(unsigned long long* flags, int count, unsigned long long value,
                                      unsigned long long delay_ns) {
    // One thread: after a delay, releases each flag in turn (st.release.sys), as a peer's pull would.
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < delay_ns);
    for (int i = 0; i < count; ++i)
        asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(flags + i), "l"(value) : "memory");
}
"""


def _reduce_case(m, n, k, chunk_rows, chunk, sources, group_n, plan, out_dtype, seed):
    """Inputs of a hook-3 call: A, B, per-source partials of chunk `chunk`'s rows (padded rows; the GEMM's
    own source poisoned: it must never be read), poisoned destinations, flags."""
    rng = np.random.default_rng(seed)
    a = rand_matrix(rng, (m, k), out_dtype)   # inputs of the output's type: bf16 -> bf16, fp16 -> fp16
    b = rand_matrix(rng, (k, n), out_dtype)
    ld = n + 8
    parts = rand_matrix(rng, (sources, chunk_rows, ld), out_dtype)
    dparts = to_device(parts)
    dparts[chunk].view(cupy.uint16).fill(NAN_BITS[out_dtype])
    n_tiles = -(-n // plan.block_n)
    stride = -(-n_tiles // group_n) if group_n else (chunk_rows // plan.block_m) * n_tiles
    flags = cupy.zeros((sources, stride), dtype=cupy.uint64)
    ref_full = reference(a, b, False)
    rows = slice(chunk * chunk_rows, (chunk + 1) * chunk_rows)
    ref_chunk = ref_full[rows] + sum(parts[s, :, :n].astype(np.float64) for s in range(sources) if s != chunk)
    return a, b, dparts, flags, ref_full, ref_chunk, ld


@pytest.mark.parametrize("group_n", [0, 2], ids=["per_tile", "per_group"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("c_staging", ["per_consumer", "shared"])
def test_chunk_reduce_adds_late_partials_in_the_epilogue(group_n, out_dtype, cluster, c_staging):
    m, n, k, chunk_rows, chunk, sources = 512, 776, 1024, 128, 2, 4   # 776: a partial last column tile
    plan = with_staging(dataclasses.replace(plan_gemm(m, n, k), cluster=cluster, max_ctas=64, m_tile_offset=3),
                        c_staging, out_dtype)
    a, b, dparts, flags, ref_full, ref_chunk, ld = _reduce_case(m, n, k, chunk_rows, chunk, sources, group_n, plan,
                                                                 out_dtype, seed=11)
    chunks = m // chunk_rows
    dsts = [poisoned((chunk_rows, n), out_dtype) for _ in range(chunks)]
    n_tiles = -(-n // plan.block_n)
    tile_flags = [cupy.zeros((chunk_rows // plan.block_m) * n_tiles, dtype=cupy.uint64) for _ in range(chunks)]
    flag_table = cupy.asarray(np.array([f.data.ptr for f in tile_flags], dtype=np.uint64))
    out = poisoned((chunk_rows, n), out_dtype)
    err = _err_record()
    late = cupy.RawKernel(_LATE_FLAGS_SRC, "late_flags")
    side, main = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    epi = TileEpilogue(destinations=TileDestinations([d.data.ptr for d in dsts], n, out_dtype), chunk_rows=chunk_rows,
                       flag_table=flag_table, signal_value=5, reduce=ChunkReduce(
                           chunk=chunk, out=out, partials=dparts.data.ptr, source_bytes=chunk_rows * ld * dparts.itemsize,
                           ld=ld, sources=sources, flags=flags.data.ptr, flag_stride=flags.shape[1], epoch=0, err=err,
                           group_n=group_n, timeout_ns=5_000_000_000, op_id=op_id("test_gemm.reduce"), rank=1))
    da, db = to_device(a), to_device(b)
    gemm_with_hooks(da, db, plan=plan, out_dtype=out_dtype, epilogue=epi)   # compile/load (epoch 0: no wait)
    cupy.cuda.Device().synchronize()
    out.view(cupy.uint16).fill(NAN_BITS[out_dtype])
    cupy.cuda.Device().synchronize()
    with side:   # the partials' flags rise 20 ms after the GEMM started
        late((1,), (1,), (flags, np.int32(flags.size), np.uint64(3), np.uint64(20_000_000)))
    gemm_with_hooks(da, db, plan=plan, out_dtype=out_dtype, stream=main,
                    epilogue=dataclasses.replace(epi, reduce=dataclasses.replace(epi.reduce, epoch=3)))
    cupy.cuda.Device().synchronize()
    assert decode_error_record(cupy.asnumpy(err)) is None
    got = cupy.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "reduced chunk: elements never written (or the GEMM's own partial was read)"
    e = float(np.abs(got - ref_chunk).max() / np.abs(ref_chunk).max())
    assert e < TOL[out_dtype], f"reduced chunk: rel err {e:.3e}"
    for c, d in enumerate(dsts):
        dv = cupy.asnumpy(d).astype(np.float64)
        if c == chunk:   # the reduced chunk skips its destination and its flags
            assert np.isnan(dv).all()
            assert (cupy.asnumpy(tile_flags[c]) == 0).all()
        else:
            assert rel_err(d, ref_full[c * chunk_rows:(c + 1) * chunk_rows]) < TOL[out_dtype]
            assert (cupy.asnumpy(tile_flags[c]) == 5).all()


@pytest.mark.parametrize("group_n", [0, 2], ids=["per_tile", "per_group"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("c_staging", ["per_consumer", "shared"])
def test_chunk_reduce_in_the_tail_sums_every_source_in_order(group_n, out_dtype, c_staging):
    # 8 tile rows in chunks of 2; m_tile_offset=4 with bands of 2 makes chunk 1 (tile rows 2, 3) the
    # schedule's 4th band; 776 columns: a partial last column tile. 48 CTAs: several tiles each.
    m, n, k, chunk_rows, chunk, sources = 1024, 776, 512, 256, 1, 4
    plan = with_staging(dataclasses.replace(plan_gemm(m, n, k), max_ctas=48, group_m=2, m_tile_offset=4),
                        c_staging, out_dtype)
    rng = np.random.default_rng(21)
    a, b = rand_matrix(rng, (m, k), out_dtype), rand_matrix(rng, (k, n), out_dtype)
    ld = n + 8
    parts = rand_matrix(rng, (sources, chunk_rows, ld), out_dtype)
    dparts = to_device(parts)
    n_tiles = -(-n // plan.block_n)
    stride = (chunk_rows // plan.block_m) * n_tiles   # per-tile flags (the GEMM's own source always)
    flags = cupy.zeros((sources, stride), dtype=cupy.uint64)
    chunks = m // chunk_rows
    dsts = [poisoned((chunk_rows, ld), out_dtype) for _ in range(chunks)]
    ptrs = [d.data.ptr for d in dsts]
    ptrs[chunk] = dparts[chunk].data.ptr   # the chunk's tiles go to its own source's slot of the partials
    tile_flags = [cupy.zeros(stride, dtype=cupy.uint64) for _ in range(chunks)]
    flag_table = cupy.asarray(np.array([f.data.ptr for f in tile_flags], dtype=np.uint64))
    out = poisoned((chunk_rows, n), out_dtype)
    counter = cupy.zeros(1, dtype=cupy.uint32)
    err = _err_record()
    late = cupy.RawKernel(_LATE_FLAGS_SRC, "late_flags")
    side, main = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    epi = TileEpilogue(destinations=TileDestinations(ptrs, ld, out_dtype), chunk_rows=chunk_rows,
                       flag_table=flag_table, signal_value=5, reduce=ChunkReduce(
                           chunk=chunk, out=out, partials=dparts.data.ptr, source_bytes=chunk_rows * ld * dparts.itemsize,
                           ld=ld, sources=sources, flags=flags.data.ptr, flag_stride=stride, epoch=0, err=err,
                           group_n=group_n, timeout_ns=5_000_000_000, op_id=op_id("test_gemm.tail"), rank=1,
                           where="tail", counter=counter.data.ptr))
    da, db = to_device(a), to_device(b)
    gemm_with_hooks(da, db, plan=plan, out_dtype=out_dtype, epilogue=epi)   # compile/load (epoch 0: no wait)
    cupy.cuda.Device().synchronize()
    ref_full = reference(a, b, False)
    rows = slice(chunk * chunk_rows, (chunk + 1) * chunk_rows)
    for epoch, delay_ns in ((3, 20_000_000), (4, 0)):   # the other sources' flags rise 20 ms late, then at once
        out.view(cupy.uint16).fill(NAN_BITS[out_dtype])
        dparts[chunk].view(cupy.uint16).fill(NAN_BITS[out_dtype])
        cupy.cuda.Device().synchronize()
        with side:
            for s in range(sources):
                if s != chunk:
                    late((1,), (1,), (flags[s], np.int32(stride), np.uint64(epoch), np.uint64(delay_ns)))
        gemm_with_hooks(da, db, plan=plan, out_dtype=out_dtype, stream=main,
                        epilogue=dataclasses.replace(epi, reduce=dataclasses.replace(epi.reduce, epoch=epoch)))
        cupy.cuda.Device().synchronize()
        assert decode_error_record(cupy.asnumpy(err)) is None
        assert int(counter.get()[0]) == 0, "the last claim resets the slab counter for the next launch"
        own = cupy.asnumpy(dparts[chunk])   # the GEMM's partial of the chunk, stored before the tail read it
        assert rel_err(dparts[chunk][:, :n], ref_full[rows]) < TOL[out_dtype]
        assert (cupy.asnumpy(flags[chunk]) == epoch).all(), "the chunk's tiles raise their own per-tile flags"
        # bitwise: sources 0, 1, ... (own partial included) summed in fp32 in that order, rounded once
        acc = np.zeros((chunk_rows, n), dtype=np.float32)
        for s in range(sources):
            acc += (own if s == chunk else parts[s])[:, :n].astype(np.float32)
        got = cupy.asnumpy(out)
        assert (got.view(np.uint16) == acc.astype(NP_DT[out_dtype]).view(np.uint16)).all(), \
            "tail sum differs from the in-order fp32 sum"
        ref_chunk = ref_full[rows] + sum(parts[s, :, :n].astype(np.float64) for s in range(sources) if s != chunk)
        e = float(np.abs(got.astype(np.float64) - ref_chunk).max() / np.abs(ref_chunk).max())
        assert e < TOL[out_dtype], f"reduced chunk: rel err {e:.3e}"
        for c, d in enumerate(dsts):
            if c != chunk:
                assert rel_err(d[:, :n], ref_full[c * chunk_rows:(c + 1) * chunk_rows]) < TOL[out_dtype]
                assert (cupy.asnumpy(tile_flags[c]) == 5).all()
        assert (cupy.asnumpy(tile_flags[chunk]) == 0).all(), "the reduced chunk raises no flag-table flag"


def test_chunk_reduce_in_the_tail_times_out_naming_the_source():
    m, n, k, chunk_rows, chunk, sources = 256, 256, 128, 128, 1, 3
    plan = dataclasses.replace(plan_gemm(m, n, k), group_m=1)
    rng = np.random.default_rng(22)
    dparts = to_device(rand_matrix(rng, (sources, chunk_rows, n), "bfloat16"))
    flags = cupy.zeros((sources, 2), dtype=cupy.uint64)
    # source 0 is in place, source 2 never comes; source 1 is the GEMM itself, whose tiles must beat the
    # timeout even under compute-sanitizer (hence 1 s)
    flags[0] = 9
    err = _err_record()
    counter = cupy.zeros(1, dtype=cupy.uint32)
    out = poisoned((chunk_rows, n), "bfloat16")
    dsts = TileDestinations([poisoned((chunk_rows, n), "bfloat16").data.ptr, dparts[chunk].data.ptr], n, "bfloat16")
    gemm_with_hooks(to_device(rand_matrix(rng, (m, k), "bfloat16")), to_device(rand_matrix(rng, (k, n), "bfloat16")),
                    plan=plan, epilogue=TileEpilogue(destinations=dsts, chunk_rows=chunk_rows, reduce=ChunkReduce(
                        chunk=chunk, out=out, partials=dparts.data.ptr, source_bytes=chunk_rows * n * 2, ld=n,
                        sources=sources, flags=flags.data.ptr, flag_stride=2, epoch=9, err=err, group_n=1,
                        timeout_ns=1_000_000_000, op_id=op_id("test_gemm.tail_timeout"), rank=5, where="tail",
                        counter=counter.data.ptr)))
    cupy.cuda.Device().synchronize()   # the kernel finishes despite the missing partial
    exc = decode_error_record(cupy.asnumpy(err))
    assert exc is not None and exc.op == "test_gemm.tail_timeout" and exc.rank == 5 and exc.peer == 2
    assert exc.expected == 9
    assert int(counter.get()[0]) == 0


def test_chunk_reduce_times_out_naming_the_source():
    m, n, k, chunk_rows, chunk, sources = 256, 256, 128, 128, 0, 3
    plan = plan_gemm(m, n, k)
    a, b, dparts, flags, _, _, ld = _reduce_case(m, n, k, chunk_rows, chunk, sources, 1, plan, "bfloat16", seed=12)
    flags[1] = 9   # source 1 is in place, source 2 never comes
    err = _err_record()
    out = poisoned((chunk_rows, n), "bfloat16")
    dsts = TileDestinations([poisoned((chunk_rows, n), "bfloat16").data.ptr for _ in range(2)], n, "bfloat16")
    gemm_with_hooks(to_device(a), to_device(b), plan=plan, epilogue=TileEpilogue(
        destinations=dsts, chunk_rows=chunk_rows, reduce=ChunkReduce(
            chunk=chunk, out=out, partials=dparts.data.ptr, source_bytes=chunk_rows * ld * 2, ld=ld, sources=sources,
            flags=flags.data.ptr, flag_stride=flags.shape[1], epoch=9, err=err, group_n=1, timeout_ns=2_000_000,
            op_id=op_id("test_gemm.reduce_timeout"), rank=5)))
    cupy.cuda.Device().synchronize()   # the kernel finishes despite the missing partial
    exc = decode_error_record(cupy.asnumpy(err))
    assert exc is not None and exc.op == "test_gemm.reduce_timeout" and exc.rank == 5 and exc.peer == 2
    assert exc.expected == 9


class _TorchLikeDtype:
    def __str__(self):
        return "torch.bfloat16"


class _CaiOperand:
    """A CAI-only producer whose dtype prints as torch.bfloat16 (what fluxrt.gemm once refused)."""

    def __init__(self, arr, readonly: bool = False):
        cai = dict(arr.__cuda_array_interface__)
        cai.update(data=(arr.data.ptr, readonly), typestr="<V2", version=3)
        self.__cuda_array_interface__, self.dtype, self.shape, self._keep = cai, _TorchLikeDtype(), arr.shape, arr


def test_foreign_bf16_producers_match_cupy_operands():
    rng = np.random.default_rng(21)
    a = cupy.asarray(rng.standard_normal((256, 192)).astype(BF16))
    b = cupy.asarray(rng.standard_normal((192, 128)).astype(BF16))
    want = gemm(a, b)
    got = gemm(_CaiOperand(a), _CaiOperand(b))
    assert isinstance(got, cupy.ndarray) and got.dtype == BF16
    assert cupy.array_equal(got.view(cupy.uint16), want.view(cupy.uint16))
    with pytest.raises(GemmArgumentError, match="written by this call"):
        gemm(a, b, _CaiOperand(cupy.empty((256, 128), dtype=BF16), readonly=True))


# --- split-K ------------------------------------------------------------------------------------------

SPLIT_CASES = [  # (M, N, K, splits, block_m, block_n): tails in M and N, slices not whole K blocks
    (256, 2560, 8192, 2, 64, 192),
    (461, 1000, 4096, 4, 128, 128),
    (100, 264, 1536, 3, 64, 64),
    (1024, 1280, 8192, 8, 128, 256),
    (77, 72, 2000, 2, 64, 128),
]


def _check_split(m, n, k, splits, bm, bn, trans_b, dtype, out_dtype, seed):
    """A split-K plan against float64, and the same bits on a second call (slices summed in a fixed order)."""
    rng = np.random.default_rng(seed)
    a = rand_matrix(rng, (m, k), dtype)
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), dtype)
    stages = min(max_stages(bm, bn, "float32"), 6)
    plan = GemmPlan(block_m=bm, block_n=bn, consumers=bm // 64, stages=stages, split_k=splits, group_m=4)
    out = poisoned((m, n), out_dtype)
    da, db = to_device(a), to_device(b)
    gemm(da, db, out, trans_b=trans_b, plan=plan)
    assert rel_err(out, reference(a, b, trans_b)) < TOL[out_dtype]
    again = poisoned((m, n), out_dtype)
    gemm(da, db, again, trans_b=trans_b, plan=plan)
    assert bool((out.view(cupy.uint8) == again.view(cupy.uint8)).all())


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                             ("bfloat16", "float32")])
@pytest.mark.parametrize("m,n,k,splits,bm,bn", SPLIT_CASES)
def test_split_k_matches_float64(m, n, k, splits, bm, bn, trans_b, dtype, out_dtype):
    _check_split(m, n, k, splits, bm, bn, trans_b, dtype, out_dtype, m * 31 + n * 7 + k + splits)


def test_split_k_in_a_cuda_graph():
    m, n, k = 256, 1024, 4096
    rng = np.random.default_rng(5)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (n, k), "bfloat16")
    da, db = to_device(a), to_device(b)
    out = poisoned((m, n), "bfloat16")
    plan = GemmPlan(block_m=64, block_n=128, consumers=1, stages=6, split_k=4, group_m=4)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        gemm(da, db, out, trans_b=True, plan=plan, stream=s)   # first call outside the capture: kernels loaded
        out.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
        s.begin_capture()
        gemm(da, db, out, trans_b=True, plan=plan, stream=s)
        graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
    assert rel_err(out, reference(a, b, True)) < TOL["bfloat16"]


SPLIT_UNEVEN_CASES = [  # (M, N, K, splits, block_m, block_n): K not a multiple of 16 * splits, 64 or the slice
    (461, 1000, 4104, 4, 128, 128),   # K % 16 == 8: slices of 1088, the last 840
    (100, 264, 1000, 3, 64, 64),      # 384 + 384 + 232
    (77, 72, 1544, 2, 64, 128),       # 832 + 712
    (300, 200, 5000, 8, 64, 192),     # 7 x 640 + 520
    (256, 512, 200, 4, 64, 128),      # 64 + 64 + 64 + 8: the last slice a part of one block
    (130, 192, 136, 4, 128, 128),     # 3 blocks for 4 slices: 3 slices, the last 8 columns
    (64, 128, 40, 2, 64, 128),        # K shorter than one block: one slice
]


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "bfloat16"), ("float16", "float32")])
@pytest.mark.parametrize("m,n,k,splits,bm,bn", SPLIT_UNEVEN_CASES)
def test_split_k_uneven_slices_match_float64(m, n, k, splits, bm, bn, trans_b, dtype, out_dtype):
    """Any K: slices of whole K blocks, the last shorter (its tail past K read as zeros); a non-last slice never
    reads the next one's columns, so every column is counted once. The same bits on a second call."""
    _check_split(m, n, k, splits, bm, bn, trans_b, dtype, out_dtype, m * 13 + n * 5 + k + splits)


def test_split_k_uneven_counts_every_column_once():
    """Ones times ones: every output element is exactly K (fp32 out), so a column read twice (a slice running
    into the next) or never (a gap) shows as an exact mismatch, not only as a relative error."""
    for m, n, k, splits in [(128, 256, 1000, 3), (64, 128, 4104, 4), (192, 320, 136, 4)]:
        a = cupy.ones((m, k), dtype=BF16)
        b = cupy.ones((n, k), dtype=BF16)
        out = cupy.full((m, n), np.nan, dtype=cupy.float32)
        gemm(a, b, out, trans_b=True, plan=GemmPlan(block_m=64, block_n=128, consumers=1, stages=6, split_k=splits))
        assert bool((out == k).all()), (m, n, k, splits)


def test_split_k_sanitize_small():
    """A small uneven split (for compute-sanitizer memcheck: 3 slices of 384, 384, 232 columns, tails in M and N)."""
    rng = np.random.default_rng(3)
    a, b = rand_matrix(rng, (100, 1000), "bfloat16"), rand_matrix(rng, (1000, 264), "bfloat16")
    out = poisoned((100, 264), "bfloat16")
    gemm(to_device(a), to_device(b), out, plan=GemmPlan(block_m=64, block_n=64, consumers=1, stages=6, split_k=3))
    assert rel_err(out, reference(a, b, False)) < TOL["bfloat16"]


def test_heuristic_and_tuned_plans_run_the_suite_shapes_correctly():
    """Whatever plan gemm() picks by itself (split-K included) gives float64-close results on suite shapes."""
    from fluxrt.gemm import plan_for

    rng = np.random.default_rng(11)
    for m, n, k, trans_b in [(256, 2560, 8192, True), (1024, 1280, 8192, False), (461, 9128, 13208, True),
                             (256, 9216, 16384, False)]:
        a = rand_matrix(rng, (m, k), "bfloat16")
        b = rand_matrix(rng, (n, k) if trans_b else (k, n), "bfloat16")
        out = poisoned((m, n), "bfloat16")
        gemm(to_device(a), to_device(b), out, trans_b=trans_b)
        plan = plan_for(m, n, k, trans_b=trans_b)
        assert rel_err(out, reference(a, b, trans_b)) < TOL["bfloat16"], plan.describe()


def test_autotune_times_graphs_keeps_a_winner_and_writes_a_correct_out(tmp_path, monkeypatch):
    """Plain, split-K and stream-K candidates: every one captures and runs on the tuning stream after the
    caller's stream's work (the inputs are written there just before), `out` holds a float64-close product,
    the winner is cached and later gemm() calls take it."""
    import sys

    from fluxrt.gemm import autotune, plan_for

    monkeypatch.setenv("FLUXRT_GEMM_TUNE_DIR", str(tmp_path))
    at = sys.modules["fluxrt.gemm.autotune"]
    monkeypatch.setattr(at, "_paths", {})
    monkeypatch.setattr(at, "_tables", {})
    m, n, k = 300, 1000, 4104
    rng = np.random.default_rng(21)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (n, k), "bfloat16")
    plans = [GemmPlan(block_n=128, stages=6), GemmPlan(block_m=64, block_n=128, consumers=1, stages=6, split_k=3),
             GemmPlan(block_n=128, stages=6, stream_k=True)]
    user = cupy.cuda.Stream(non_blocking=True)
    with user:
        da = cupy.zeros((m, k), dtype=BF16)
        db = cupy.zeros((n, k), dtype=BF16)
        da[...] = to_device(a)
        db[...] = to_device(b)
        out = poisoned((m, n), "bfloat16")
    res = autotune(da, db, out, trans_b=True, plans=plans, stream=user, force=True)
    assert rel_err(out, reference(a, b, True)) < TOL["bfloat16"]
    assert res.plan in plans and res.us > 0 and not res.cached
    assert len(res.timings) == 3 and all(us and us > 0 for _, us in res.timings)
    assert plan_for(m, n, k, trans_b=True) == res.plan
    again = poisoned((m, n), "bfloat16")
    gemm(da, db, again, trans_b=True)
    assert rel_err(again, reference(a, b, True)) < TOL["bfloat16"]
    # the kept plan ran last: `out` has its bits (split-K and stream-K sum in their own fixed orders)
    assert bool(cupy.all(again.view(cupy.uint16) == out.view(cupy.uint16)))


def test_autotune_sustained_confirms_each_finalist_alone(tmp_path, monkeypatch):
    """sustained_ms: the screen's finalists (all three here) each run alone for that long, twice; the kept plan is the
    lowest mean of those timings, `out` holds its float64-close product and the cache has it."""
    import sys

    from fluxrt.gemm import autotune, plan_for

    monkeypatch.setenv("FLUXRT_GEMM_TUNE_DIR", str(tmp_path))
    at = sys.modules["fluxrt.gemm.autotune"]
    monkeypatch.setattr(at, "_paths", {})
    monkeypatch.setattr(at, "_tables", {})
    calls = []
    alone = at._alone_us
    monkeypatch.setattr(at, "_alone_us", lambda t, ms: calls.append((t.plan, ms)) or alone(t, ms))
    m, n, k = 1000, 1000, 2000
    rng = np.random.default_rng(23)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (k, n), "bfloat16")
    plans = [GemmPlan(block_n=128, stages=6), GemmPlan(block_n=256, stages=3), GemmPlan(block_n=192, stages=4)]
    out = poisoned((m, n), "bfloat16")
    res = autotune(to_device(a), to_device(b), out, plans=plans, force=True, sustained_ms=20)
    assert rel_err(out, reference(a, b, False)) < TOL["bfloat16"]
    assert sorted((p.describe(), ms) for p, ms in calls) == sorted((p.describe(), 20.0) for p in plans for _ in (0, 1))
    assert set(res.confirmed) == {p.describe() for p in plans}
    assert res.us == dict(res.timings)[res.plan.describe()] <= min(dict(res.timings).values()) * (1 + at.HEURISTIC_TIE)
    assert plan_for(m, n, k) == res.plan
    with pytest.raises(GemmArgumentError, match="sustained_ms"):
        autotune(to_device(a), to_device(b), plans=plans, force=True, sustained_ms=-1)


def test_autotune_refines_the_band_height_of_the_winner(tmp_path, monkeypatch):
    """Default candidates (narrowed to one plan here): the winner's band variants are prepared and replayed with it;
    the kept plan is one of them, the product float64-close and the plan cached."""
    import sys

    from fluxrt.gemm import autotune, plan_for

    monkeypatch.setenv("FLUXRT_GEMM_TUNE_DIR", str(tmp_path))
    at = sys.modules["fluxrt.gemm.autotune"]
    monkeypatch.setattr(at, "_paths", {})
    monkeypatch.setattr(at, "_tables", {})
    plan = GemmPlan(block_n=128, stages=6, group_m=16)
    monkeypatch.setattr(at, "candidates", lambda *args, **kw: [plan])
    m, n, k = 2304, 2304, 256   # 18 x 18 tiles: two waves and more on an H100/H200
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    variants = at.band_variants(plan, m, n, sms)
    if not variants:
        pytest.skip(f"{m}x{n} fills fewer than two waves of {sms} SMs")
    rng = np.random.default_rng(22)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (n, k), "bfloat16")
    out = poisoned((m, n), "bfloat16")
    res = autotune(to_device(a), to_device(b), out, trans_b=True, force=True)
    assert rel_err(out, reference(a, b, True)) < TOL["bfloat16"]
    assert res.plan in [plan, *variants]
    assert {d for d, _ in res.timings} == {p.describe() for p in [plan, *variants]}
    assert all(us is not None and us > 0 for _, us in res.timings), res.timings
    assert set(res.confirmed) == {p.describe() for p in [plan, *variants]}   # one interleaved timing of all
    assert res.us == dict(res.timings)[res.plan.describe()]
    assert plan_for(m, n, k, trans_b=True) == res.plan


# --- stream-K -----------------------------------------------------------------------------------------

STREAM_K_CASES = [  # (M, N, K, plan): tails in M, N and K; few tiles cut into many pieces; whole waves first
    (300, 520, 3000, GemmPlan(stream_k=True)),                                   # 9 tiles, 4 pieces each
    (461, 1000, 4104, GemmPlan(block_n=128, stages=6, stream_k=True)),           # K % 64 == 8
    (128, 256, 8192, GemmPlan(stream_k=True)),                                   # 1 tile, 8 pieces
    (1000, 1000, 1000, GemmPlan(block_n=128, stages=6, stream_k=True, max_ctas=7)),   # 56 or 63 whole tiles first
    (257, 72, 2000, GemmPlan(block_n=128, stages=6, stream_k=True, max_ctas=6)),  # 32 K blocks: 16 + 16
    (200, 264, 40, GemmPlan(stream_k=True)),                                     # K shorter than one block: no cut
    (100, 384, 1544, GemmPlan(block_m=64, consumers=1, stages=4, stream_k=True, max_ctas=9)),
    # clusters of 2 along M (B multicast to the pair; items are pairs of M tiles)
    (300, 520, 3000, GemmPlan(stream_k=True, cluster=2)),                        # 3 M tiles: a phantom in each item
    (461, 1000, 4104, GemmPlan(block_n=128, stages=6, stream_k=True, cluster=2)),   # 16 items, K % 64 == 8
    (128, 256, 8192, GemmPlan(stream_k=True, cluster=2)),                        # 1 item, its second tile a phantom
    (1000, 1000, 1000, GemmPlan(block_n=128, stages=6, stream_k=True, cluster=2, max_ctas=10)),  # 32 items, 5 pairs
    (700, 1000, 3000, GemmPlan(block_n=192, stages=4, stream_k=True, cluster=2, max_ctas=12)),  # 3 B slabs: 2 + 1
    (300, 200, 2600, GemmPlan(block_n=64, stages=6, stream_k=True, cluster=2, max_ctas=8)),     # 1 slab: 1 + 0
    # the consumers' turns at one shared C staging region (the autotuner's deeper rings), partials and finishers
    (700, 1000, 3000, GemmPlan(stages=4, c_staging="shared", stream_k=True, max_ctas=12)),      # 24 tiles, 12 CTAs
    (461, 1000, 4104, GemmPlan(stages=4, c_staging="shared", stream_k=True, cluster=2, max_ctas=10)),
]


def _check_float64_and_reruns(m, n, k, plan, trans_b, dtype, out_dtype, seed):
    """A plan against float64, and the same bits on a second and third call (stream-K: the partials are added in K
    order and the counters reset themselves; ping-pong: the ring positions and barrier parities start over)."""
    rng = np.random.default_rng(seed)
    a = rand_matrix(rng, (m, k), dtype)
    b = rand_matrix(rng, (n, k) if trans_b else (k, n), dtype)
    out = poisoned((m, n), out_dtype)
    da, db = to_device(a), to_device(b)
    gemm(da, db, out, trans_b=trans_b, plan=plan)
    assert rel_err(out, reference(a, b, trans_b)) < TOL[out_dtype], plan.describe()
    for _ in range(2):
        again = poisoned((m, n), out_dtype)
        gemm(da, db, again, trans_b=trans_b, plan=plan)
        assert bool((out.view(cupy.uint8) == again.view(cupy.uint8)).all()), plan.describe()


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "bfloat16"), ("float16", "float16")])
@pytest.mark.parametrize("case", range(len(STREAM_K_CASES)))
def test_stream_k_matches_float64_and_reruns_bitwise(case, trans_b, dtype, out_dtype):
    m, n, k, plan = STREAM_K_CASES[case]
    _check_float64_and_reruns(m, n, k, plan, trans_b, dtype, out_dtype, m * 17 + n * 3 + k)


# Fitted widths in stream-K form, both layouts of B: the stream-K storer's fitted C box store (an inner tile column's
# part-filled last slab through the tiles' map, the last column clipped by C's map), partials of block_n columns.
FITTED_STREAM_K_CASES = [  # (M, N, K, plan)
    (461, 1000, 4104, GemmPlan(block_n=176, stages=4, stream_k=True)),          # 4 x 6 tiles (the last 120 wide), K % 64 == 8
    (700, 664, 3000, GemmPlan(block_n=224, stages=4, c_staging="shared", stream_k=True, max_ctas=12)),  # 6 x 3 on 12
    (300, 520, 3000, GemmPlan(block_n=144, stages=5, stream_k=True, max_ctas=5)),   # 3 x 4 tiles on 5 CTAs
    (300, 1000, 3000, GemmPlan(block_n=208, stages=4, c_staging="shared", stream_k=True, cluster=2, max_ctas=10)),
]


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(FITTED_STREAM_K_CASES)))
def test_fitted_stream_k_matches_float64_and_reruns_bitwise(case, dtype, trans_b):
    m, n, k, plan = FITTED_STREAM_K_CASES[case]
    fits = max_stages(plan.block_m, plan.block_n, dtype, c_staging=plan.c_staging, b_kmajor=trans_b)
    plan = dataclasses.replace(plan, stages=min(plan.stages, fits))
    _check_float64_and_reruns(m, n, k, plan, trans_b, dtype, dtype, m * 13 + n * 5 + k)
    if case == 0:   # fp32 out: fewer stages beside the wider staging
        fits = max_stages(plan.block_m, plan.block_n, "float32", c_staging=plan.c_staging, b_kmajor=trans_b)
        _check_float64_and_reruns(m, n, k, dataclasses.replace(plan, stages=fits), trans_b, dtype, "float32",
                                  m + n + k)


def test_stream_k_fp32_out_counts_every_k_block_once():
    """Ones times ones into fp32: every element is exactly K, so a K block summed twice or never shows exactly."""
    for m, n, k, plan in [(128, 256, 8192, GemmPlan(block_n=128, stages=4, stream_k=True)),
                          (1000, 1000, 1000, GemmPlan(block_n=128, stages=4, stream_k=True, max_ctas=8)),
                          (461, 9128, 13208 - 8, GemmPlan(block_n=128, stages=4, stream_k=True)),
                          (1000, 1000, 1000, GemmPlan(block_n=128, stages=4, stream_k=True, cluster=2, max_ctas=10)),
                          (461, 9128, 13208 - 8, GemmPlan(block_n=128, stages=4, stream_k=True, cluster=2))]:
        a = cupy.ones((m, k), dtype=BF16)
        b = cupy.ones((n, k), dtype=BF16)
        out = cupy.full((m, n), np.nan, dtype=cupy.float32)
        gemm(a, b, out, trans_b=True, plan=plan)
        assert bool((out == k).all()), (m, n, k, plan.describe())


def _check_graph_replays(m, n, k, plan, seed, replays=3):
    """Captured once (B [N, K], bf16), replayed with new inputs in between: every replay matches float64 and an
    eager call bit for bit."""
    rng = np.random.default_rng(seed)
    a = to_device(rand_matrix(rng, (m, k), "bfloat16"))
    b = to_device(rand_matrix(rng, (n, k), "bfloat16"))
    out = poisoned((m, n), "bfloat16")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        gemm(a, b, out, trans_b=True, plan=plan, stream=s)   # outside the capture: kernel loaded, workspace made
        s.begin_capture()
        gemm(a, b, out, trans_b=True, plan=plan, stream=s)
        graph = s.end_capture()
        for i in range(replays):
            a_host = rand_matrix(rng, (m, k), "bfloat16")
            a.set(a_host, stream=s)
            out.view(cupy.uint16).fill(NAN_BITS["bfloat16"])
            graph.launch(s)
            eager = poisoned((m, n), "bfloat16")
            gemm(a, b, eager, trans_b=True, plan=plan, stream=s)
            s.synchronize()
            assert rel_err(out, reference(a_host, cupy.asnumpy(b), True)) < TOL["bfloat16"], i
            assert bool((out.view(cupy.uint16) == eager.view(cupy.uint16)).all()), i


@pytest.mark.parametrize("cluster", [1, 2], ids=["x1", "x2"])
def test_stream_k_in_a_cuda_graph_replays(cluster):
    """The counters the finishing CTAs reset make every replay complete and equal to an eager call."""
    _check_graph_replays(256, 2048, 6144, GemmPlan(stream_k=True, cluster=cluster), seed=9)


def test_stream_k_calls_of_several_shapes_share_a_stream():
    """Calls of different shapes (and tile shapes) on one stream share its workspace: each leaves the counters at
    zero for the next."""
    rng = np.random.default_rng(4)
    cases = [(300, 520, 3000, GemmPlan(stream_k=True)), (461, 1000, 4104, GemmPlan(block_n=128, stages=6,
                                                                                    stream_k=True)),
             (128, 256, 8192, GemmPlan(stream_k=True)), (700, 1000, 3000, GemmPlan(block_n=192, stages=4,
                                                                                   stream_k=True, cluster=2))]
    ops = []
    for m, n, k, plan in cases:
        a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (k, n), "bfloat16")
        ops.append((to_device(a), to_device(b), reference(a, b, False), plan))
    for _ in range(2):
        outs = []
        for da, db, _, plan in ops:
            out = poisoned((da.shape[0], db.shape[1]), "bfloat16")
            gemm(da, db, out, plan=plan)
            outs.append(out)
        for out, (_, _, ref, plan) in zip(outs, ops):
            assert rel_err(out, ref) < TOL["bfloat16"], plan.describe()


def test_stream_k_refuses_hooks():
    a = cupy.zeros((256, 512), dtype=BF16)
    b = cupy.zeros((512, 256), dtype=BF16)
    flags = cupy.zeros((2,), dtype=cupy.uint64)
    with pytest.raises(GemmArgumentError, match="stream_k"):
        gemm_with_hooks(a, b, cupy.empty((256, 256), dtype=BF16), plan=GemmPlan(stream_k=True),
                        wait=ArrivalWait(flags=flags, epoch=1, chunk_rows=128, err=0))


@pytest.mark.parametrize("staging", ["per_consumer", "shared"])
@pytest.mark.parametrize("cluster", [1, 2], ids=["x1", "x2"])
def test_stream_k_sanitize_small(cluster, staging):
    """A small cut (for compute-sanitizer memcheck / racecheck: 6 tiles cut in 2 on 12 CTAs, tails in M, N and K;
    with a cluster of 2, 3 items (pairs of M tiles) cut over 6 pairs), with each C staging."""
    rng = np.random.default_rng(8)
    a, b = rand_matrix(rng, (200, 1000), "bfloat16"), rand_matrix(rng, (1000, 264), "bfloat16")
    out = poisoned((200, 264), "bfloat16")
    gemm(to_device(a), to_device(b), out, plan=GemmPlan(block_n=128, stages=6, stream_k=True, max_ctas=12,
                                                        cluster=cluster, c_staging=staging))
    assert rel_err(out, reference(a, b, False)) < TOL["bfloat16"]


@pytest.mark.parametrize("cluster", [1, 2], ids=["x1", "x2"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("stream_k", [False, True], ids=["whole", "stream_k"])
def test_fitted_sanitize_small(stream_k, trans_b, cluster):
    """A fitted width, small (for compute-sanitizer memcheck / racecheck: 2 x 2 tiles of 128 x 176, the last column
    88 wide, tails in M, N and K; whole tiles on 2 CTAs or pairs, or cut over 12). B as [K, N]: the second tile
    column's last two 64-column slabs lie past N (zero-filled by TMA) and the first column's last slab is half the
    next tile's."""
    rng = np.random.default_rng(10)
    a = rand_matrix(rng, (200, 1000), "bfloat16")
    b = rand_matrix(rng, (264, 1000) if trans_b else (1000, 264), "bfloat16")
    out = poisoned((200, 264), "bfloat16")
    gemm(to_device(a), to_device(b), out, trans_b=trans_b,
         plan=GemmPlan(block_n=176, stages=4, stream_k=stream_k, cluster=cluster,
                       max_ctas=12 if stream_k else 2 * cluster))
    assert rel_err(out, reference(a, b, trans_b)) < TOL["bfloat16"]


# --- ping-pong consumers (GemmPlan.pingpong: whole tiles alternating between the two consumers) ---------------------
PINGPONG_CASES = [  # (M, N, K, plan): tails in M, N and K; K shorter than one stage; ring positions that wrap mid-tile.
    # Every case gives a CTA at least 3 tiles (max_ctas), so both consumers, the order barriers and both staging turns run.
    (1000, 1000, 1000, GemmPlan(block_n=128, stages=5, pingpong=True, max_ctas=8)),    # 64 tiles: 8 per CTA
    (1000, 1000, 1000, GemmPlan(block_n=192, stages=4, c_staging="shared", pingpong=True, max_ctas=7)),  # 48: 7 or 6
    (777, 1032, 200, GemmPlan(block_n=128, stages=5, pingpong=True, max_ctas=2)),   # 4 K blocks, 63 tiles: 32 and 31
    (777, 1032, 200, GemmPlan(block_n=64, stages=6, c_staging="shared", pingpong=True, max_ctas=3)),   # 119: 40, 40, 39
    (257, 136, 48, GemmPlan(block_n=128, stages=5, pingpong=True, max_ctas=2)),     # K < one K block; 6 tiles: 3 each
    (1400, 1160, 328, GemmPlan(block_n=128, stages=3, pingpong=True, max_ctas=4)),  # K % 64 == 8; 110 tiles: 28, 28, 27, 27
    # clusters of 2 along M (B multicast): both CTAs' consumers release each stage; 3 M tiles leave a phantom
    (300, 520, 3000, GemmPlan(block_n=128, stages=5, cluster=2, pingpong=True, max_ctas=4)),   # 10 items: 5 per pair
    (1000, 1000, 456, GemmPlan(block_n=128, stages=6, c_staging="shared", cluster=2, pingpong=True, max_ctas=6)),
]


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(PINGPONG_CASES)))
def test_pingpong_matches_float64_and_reruns_bitwise(case, dtype, trans_b):
    m, n, k, plan = PINGPONG_CASES[case]
    _check_float64_and_reruns(m, n, k, plan, trans_b, dtype, dtype, m * 13 + n * 7 + k + case)


def _check_fp32_out_equals(plan, other, seed):
    """plan's fp32 output of a 1000 x 900 x 1000 GEMM against float64, and every element equal to other's (the same
    MMAs in the same K order per element)."""
    m, n, k = 1000, 900, 1000
    rng = np.random.default_rng(seed)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (n, k), "bfloat16")
    da, db = to_device(a), to_device(b)
    out = poisoned((m, n), "float32")
    gemm(da, db, out, trans_b=True, plan=plan)
    assert rel_err(out, reference(a, b, True)) < TOL["float32"], plan.describe()
    same = poisoned((m, n), "float32")
    gemm(da, db, same, trans_b=True, plan=other)
    assert bool((out == same).all())


def test_pingpong_fp32_out_and_cooperative_agree():
    """fp32 output (64 KiB of staging per consumer at 128x128: 3 stages), 8 tiles per CTA; equal to the cooperative
    plan's."""
    pp = GemmPlan(block_n=128, stages=max_stages(128, 128, "float32", pingpong=True), pingpong=True, max_ctas=8)
    _check_fp32_out_equals(pp, GemmPlan(block_n=128, stages=4), seed=21)


def test_pingpong_in_a_cuda_graph_replays():
    plan = GemmPlan(block_n=128, stages=5, pingpong=True, max_ctas=8)   # 8 tiles per CTA
    _check_graph_replays(1000, 1000, 600, plan, seed=22, replays=2)


def test_pingpong_refuses_hooks():
    a = cupy.zeros((256, 512), dtype=BF16)
    b = cupy.zeros((512, 256), dtype=BF16)
    flags = cupy.zeros((2,), dtype=cupy.uint64)
    with pytest.raises(GemmArgumentError, match="pingpong"):
        gemm_with_hooks(a, b, cupy.empty((256, 256), dtype=BF16), plan=GemmPlan(block_n=128, stages=5, pingpong=True),
                        wait=ArrivalWait(flags=flags, epoch=1, chunk_rows=128, err=0))


@pytest.mark.parametrize("staging", ["per_consumer", "shared"])
@pytest.mark.parametrize("cluster", [1, 2], ids=["x1", "x2"])
def test_pingpong_sanitize_small(cluster, staging):
    """A small case for compute-sanitizer memcheck / racecheck: 3 x 3 tiles on 2 CTAs (or one pair), K of 3 blocks
    on a 2-stage ring (positions wrap inside a tile), tails in M, N and K; a phantom tile with the cluster."""
    m, n, k = 300, 264, 168
    plan = GemmPlan(block_n=128, stages=2, c_staging=staging, cluster=cluster, pingpong=True, max_ctas=2)
    rng = np.random.default_rng(23)
    a, b = rand_matrix(rng, (m, k), "bfloat16"), rand_matrix(rng, (n, k), "bfloat16")
    out = poisoned((m, n), "bfloat16")
    gemm(to_device(a), to_device(b), out, trans_b=True, plan=plan)
    assert rel_err(out, reference(a, b, True)) < TOL["bfloat16"], plan.describe()


# --- 256-row tiles (GemmPlan.block_m=256: two consumers of two wgmma row blocks, 128 rows each) ---------------------
TALL_CASES = [  # (M, N, K, plan): tails in M (inside a consumer's second row block, inside its first, in the other
    # consumer's rows), N and K; K shorter than one K block; fitted widths; pairs along M with a phantom tile.
    (1000, 1000, 1000, GemmPlan(block_m=256, block_n=128, stages=3)),              # M tail in consumer 1's 2nd block
    (300, 1000, 520, GemmPlan(block_m=256, block_n=128, stages=4, c_staging="shared")),   # 44 rows of the 2nd tile
    (461, 1000, 4104, GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared")),  # K % 64 == 8, fitted width
    (200, 264, 40, GemmPlan(block_m=256, block_n=192, stages=3, c_staging="shared")),     # one tile row, K < 64
    (700, 1000, 1000, GemmPlan(block_m=256, block_n=96, stages=4, c_staging="shared", cluster=2)),  # 3 rows: a phantom
    (1000, 1000, 456, GemmPlan(block_m=256, block_n=192, stages=3, c_staging="shared", cluster=2, max_ctas=4)),
    # the direct epilogue (registers to C, each consumer's two row blocks; a 4th stage at 192 wide)
    (1000, 1000, 456, GemmPlan(block_m=256, block_n=192, stages=4, epilogue="direct")),
    (700, 1000, 1000, GemmPlan(block_m=256, block_n=96, stages=4, epilogue="direct", cluster=2)),
    # 2 x 2 clusters, direct: a fitted width, 7 tile columns (a phantom column), 44 rows of the 2nd tile row
    (300, 1000, 4104, GemmPlan(block_m=256, block_n=160, stages=4, epilogue="direct", cluster=2, cluster_n=2)),
    # stream-K forms: cut tiles' partials of 256 x block_n, pairs
    (461, 1000, 4104, GemmPlan(block_m=256, block_n=128, stages=4, c_staging="shared", stream_k=True)),
    (700, 1000, 3000, GemmPlan(block_m=256, block_n=176, stages=3, c_staging="shared", stream_k=True, max_ctas=10)),
    (700, 1000, 3000, GemmPlan(block_m=256, block_n=96, stages=4, c_staging="shared", stream_k=True, cluster=2,
                               max_ctas=8)),
]


@pytest.mark.parametrize("trans_b", [False, True], ids=["B_KxN", "B_NxK"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(TALL_CASES)))
def test_tall_tiles_match_float64_and_rerun_bitwise(case, dtype, trans_b):
    m, n, k, plan = TALL_CASES[case]
    plan.validate(dtype, b_kmajor=trans_b)
    _check_float64_and_reruns(m, n, k, plan, trans_b, dtype, dtype, m * 11 + n * 5 + k + case)


def test_tall_tiles_fp32_out_and_128_row_tiles_agree():
    """fp32 output (2 stages beside 128 rows of fp32 staging per consumer); equal to a 128-row tile's."""
    tall = GemmPlan(block_m=256, block_n=128, stages=max_stages(256, 128, "float32"))
    _check_fp32_out_equals(tall, GemmPlan(block_n=128, stages=4), seed=41)


def test_tall_tiles_in_a_cuda_graph_replays():
    _check_graph_replays(1000, 1000, 600, GemmPlan(block_m=256, block_n=128, stages=4, c_staging="shared"), seed=42,
                         replays=2)


def test_tall_tiles_are_for_plain_16_bit_gemms():
    a = cupy.zeros((256, 512), dtype=BF16)
    b = cupy.zeros((512, 256), dtype=BF16)
    flags = cupy.zeros((2,), dtype=cupy.uint64)
    with pytest.raises(GemmArgumentError, match="256-row"):
        gemm_with_hooks(a, b, cupy.empty((256, 256), dtype=BF16), plan=GemmPlan(block_m=256, block_n=128, stages=3),
                        wait=ArrivalWait(flags=flags, epoch=1, chunk_rows=256, err=0))


_TALL_SMALL = GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared")


@pytest.mark.parametrize("plan", [
    dataclasses.replace(_TALL_SMALL, max_ctas=2), dataclasses.replace(_TALL_SMALL, cluster=2, max_ctas=4),
    dataclasses.replace(_TALL_SMALL, stream_k=True, max_ctas=8),
    dataclasses.replace(_TALL_SMALL, stream_k=True, cluster=2, max_ctas=8),
    GemmPlan(block_m=256, block_n=144, stages=4, epilogue="direct", cluster=2, cluster_n=2, max_ctas=4),
], ids=["whole-x1", "whole-x2", "stream_k-x1", "stream_k-x2", "x2x2_direct"])
def test_tall_sanitize_small(plan):
    """256-row tiles, small (for compute-sanitizer memcheck / racecheck: 2 x 2 tiles of 256 x 144, M and N tails inside
    the second tile row and column, K % 64 == 40; whole tiles on 2 CTAs, a pair or a 2 x 2 cluster with the direct
    epilogue (A and B multicast), or cut over 8)."""
    rng = np.random.default_rng(43)
    a, b = rand_matrix(rng, (300, 1000), "bfloat16"), rand_matrix(rng, (264, 1000), "bfloat16")
    out = poisoned((300, 264), "bfloat16")
    gemm(to_device(a), to_device(b), out, trans_b=True, plan=plan)
    assert rel_err(out, reference(a, b, True)) < TOL["bfloat16"], plan.describe()
