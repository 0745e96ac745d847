"""GEMM planner, argument validation and sm_90a compile checks: no GPU needed."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fluxrt.gemm import (GemmArgumentError, GemmTypeError, compile_options, gemm, gemm_with_hooks,
                         kernel_defines, validate_gemm_args, ArrivalWait, TileDestinations, TileEpilogue)
from fluxrt.gemm.plan import (SMEM_LIMIT_BYTES, GemmPlan, grouped_order, hilbert_order, max_stages, plan_gemm,
                              tile_order)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


class FakeDeviceArray:
    """Just enough of __cuda_array_interface__ to be validated; the pointer is never dereferenced."""

    def __init__(self, shape, dtype, strides=None, ptr=1 << 32):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.__cuda_array_interface__ = {
            "shape": self.shape, "typestr": self.dtype.str if self.dtype != BF16 else "<V2",
            "data": (ptr, False), "strides": strides, "version": 3}


def arr(shape, dtype=BF16, **kw):
    return FakeDeviceArray(shape, dtype, **kw)


# --- planner ----------------------------------------------------------------------------------------

def test_plan_large_square_is_128x256():
    p = plan_gemm(8192, 8192, 8192)
    assert (p.block_m, p.block_n, p.block_k, p.consumers, p.cluster) == (128, 256, 64, 2, 1)
    assert p.stages == 3
    assert p.smem_bytes("bfloat16") <= SMEM_LIMIT_BYTES
    assert p.threads == 384


def test_plan_fp32_output_uses_narrower_tile():
    p = plan_gemm(4096, 4096, 4096, out_dtype="float32")
    assert p.block_n == 128 and p.stages >= 3
    assert p.smem_bytes("float32") <= SMEM_LIMIT_BYTES


def test_plan_small_shapes():
    assert plan_gemm(64, 1024, 1024).consumers == 1
    assert plan_gemm(64, 1024, 1024).block_m == 64
    assert plan_gemm(1024, 128, 1024).block_n == 128


@pytest.mark.parametrize("shape", [(8192, 8192, 8192), (8192, 7168, 8192), (16384, 6144, 8192),
                                   (4096, 7168, 8192), (1000, 1000, 1000), (129, 257, 72), (64, 64, 16)])
@pytest.mark.parametrize("out", ["bfloat16", "float16", "float32"])
def test_plans_fit_and_validate(shape, out):
    m, n, k = shape
    p = plan_gemm(m, n, k, out_dtype=out)
    assert p.validate(out) is p
    assert p.smem_bytes(out) <= SMEM_LIMIT_BYTES
    assert 1 <= p.grid(m, n) <= 132


def test_plan_overrides_are_validated():
    p = plan_gemm(4096, 4096, 4096)
    with pytest.raises(ValueError, match="block_m"):
        dataclasses.replace(p, block_m=256).validate()
    assert dataclasses.replace(p, block_n=96, stages=6, cluster=2).validate().fitted_n   # 16-bit: pairs too
    with pytest.raises(ValueError, match="block_n=144 .*cluster=1 with fp8"):
        dataclasses.replace(p, block_n=144, block_k=128, stages=4, cluster=2).validate()
    assert dataclasses.replace(p, block_n=96, stages=6).validate().c_staging_bytes("bfloat16") == 128 * 256
    assert dataclasses.replace(p, block_n=96, stages=6).c_staging_bytes("float32") == 128 * 384
    with pytest.raises(ValueError, match="multiple of 16"):
        dataclasses.replace(p, block_n=100, epilogue="direct").validate()
    with pytest.raises(ValueError, match="multiple of 16 from 64 to 256"):
        dataclasses.replace(p, block_n=272, epilogue="direct").validate()
    with pytest.raises(ValueError, match="block_n=176 .*no split-K"):
        dataclasses.replace(p, block_n=176, stages=4, split_k=2).validate()
    assert dataclasses.replace(p, block_n=176, stages=4, stream_k=True).validate().fitted_n   # stream-K form
    fitted = dataclasses.replace(p, block_n=112, epilogue="direct", stages=6).validate()
    assert fitted.fitted_n and not p.fitted_n
    with pytest.raises(ValueError, match="cluster"):
        dataclasses.replace(p, cluster=4).validate()
    with pytest.raises(ValueError, match="order"):
        dataclasses.replace(p, order="zigzag").validate()
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(p, stages=4).validate("bfloat16")   # 4 x 48 KiB + 64 KiB staging > 227 KiB
    assert max_stages(128, 256, "bfloat16") == 3
    assert max_stages(128, 128, "bfloat16") == 6
    assert max_stages(128, 256, "bfloat16", "direct") == 4
    with pytest.raises(ValueError, match="epilogue"):
        dataclasses.replace(p, epilogue="smem").validate()


def test_shared_c_staging_plan():
    shared = GemmPlan(stages=4, c_staging="shared")
    assert shared.validate("bfloat16") is shared
    # one consumer's 64 x 256 bf16 rows instead of both: 4 x 48 KiB + 32 KiB + 12 barriers + alignment
    assert shared.c_staging_bytes("bfloat16") == 32768 and GemmPlan().c_staging_bytes("bfloat16") == 65536
    assert shared.c_turns == 2 and GemmPlan().c_turns == 1
    assert shared.smem_bytes("bfloat16") == 4 * 49152 + 32768 + 8 * (2 * 4 + 2 * 2) + 1024 <= SMEM_LIMIT_BYTES
    assert max_stages(128, 256, "bfloat16", c_staging="shared") == 4
    assert max_stages(128, 256, "float16", c_staging="shared") == 4
    assert max_stages(128, 256, "float32", c_staging="shared") == 3     # 64 KiB staging (per-consumer: 2)
    assert max_stages(128, 256, "float32") == 2
    assert max_stages(128, 128, "bfloat16", c_staging="shared") == 6    # MAX_STAGES-bounded either way
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(shared, stages=5).validate("bfloat16")
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(shared, stages=4).validate("float32")
    GemmPlan(stages=3, c_staging="shared").validate("float32")
    # one consumer: the staging is one consumer's already, the option changes nothing
    one = GemmPlan(block_m=64, consumers=1, stages=4)
    one_shared = dataclasses.replace(one, c_staging="shared")
    assert one_shared.c_turns == 1
    assert one_shared.smem_bytes("bfloat16") == one.smem_bytes("bfloat16")
    assert kernel_defines(one_shared, "bfloat16", "bfloat16", False) == kernel_defines(one, "bfloat16", "bfloat16",
                                                                                       False)
    with pytest.raises(ValueError, match="c_staging"):
        dataclasses.replace(shared, c_staging="turns").validate()
    with pytest.raises(ValueError, match="c_staging='shared' needs epilogue='tma'"):
        dataclasses.replace(shared, epilogue="direct").validate()
    # the planner's default is unchanged until the shared staging is measured on a GPU
    assert plan_gemm(8192, 8192, 8192).c_staging == "per_consumer"


def test_kernel_defines_c_staging():
    per = dict(kernel_defines(GemmPlan(), "bfloat16", "bfloat16", False))
    shared = dict(kernel_defines(GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", True, True, True))
    assert per["FLUXRT_GEMM_C_SHARED"] == "0"
    assert shared["FLUXRT_GEMM_C_SHARED"] == "1" and shared["FLUXRT_GEMM_STAGES"] == "4"
    assert shared["FLUXRT_GEMM_HOOK_EPILOGUE"] == "1" and shared["FLUXRT_GEMM_EPI_DIRECT"] == "0"


def test_bench_describe_shows_c_staging():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "perf" / "bench_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.describe(GemmPlan()) == "128x256x64 s3 grouped/g16 epi=tma x1"      # as in earlier results
    assert mod.describe(GemmPlan(stages=4, c_staging="shared", cluster=2)) == "128x256x64 s4 grouped/g16 epi=tma/shared x2"
    assert mod.describe(GemmPlan(block_n=128, stages=5, pingpong=True)) == "128x128x64 s5 grouped/g16 epi=tma x1 pp"
    assert mod.describe(GemmPlan(stream_k=True)) == "128x256x64 s3 grouped/g16 epi=tma x1 sk"


@pytest.mark.parametrize("mt,nt", [(1, 1), (3, 5), (64, 32), (7, 1), (1, 9), (17, 13)])
def test_tile_orders_are_permutations(mt, nt):
    every = {(i, j) for i in range(mt) for j in range(nt)}
    h = hilbert_order(mt, nt)
    assert len(h) == mt * nt and set(h) == every
    for g in (1, 4, 16):
        o = grouped_order(mt, nt, g)
        assert len(o) == mt * nt and set(o) == every


def test_rank_offset_starts_at_own_shard():
    p = GemmPlan(m_tile_offset=5, group_m=2)
    order = tile_order(p, 16 * 128, 4 * 256)   # 16 x 4 tiles
    assert order[0][0] == 5
    assert {o for o in order} == {(i, j) for i in range(16) for j in range(4)}
    # the wrap-around is modulo m_tiles
    assert tile_order(dataclasses.replace(p, m_tile_offset=16 + 3), 16 * 128, 4 * 256)[0][0] == 3


def test_hilbert_neighbours_are_adjacent():
    h = hilbert_order(8, 8)
    for (a, b), (c, d) in zip(h, h[1:]):
        assert abs(a - c) + abs(b - d) == 1


# --- argument validation (must not touch CUDA) --------------------------------------------------------

def test_valid_args_return_problem_size():
    assert validate_gemm_args(arr((1000, 72)), arr((72, 1000))) == (1000, 1000, 72, "bfloat16", "bfloat16")
    assert validate_gemm_args(arr((129, 72), np.float16), arr((264, 72), np.float16), trans_b=True,
                              out_dtype="float32") == (129, 264, 72, "float16", "float32")


@pytest.mark.parametrize("trans_b", [False, True])
def test_inner_dimension_mismatch_names_shapes(trans_b):
    b = arr((256, 64)) if trans_b else arr((64, 256))
    with pytest.raises(GemmArgumentError, match=r"\(128, 72\).*K=72"):
        gemm(arr((128, 72)), b, trans_b=trans_b)


def test_dtype_errors():
    with pytest.raises(GemmTypeError, match="float32"):
        gemm(arr((64, 64), np.float32), arr((64, 64), np.float32))
    with pytest.raises(GemmTypeError, match="same 16-bit type"):
        gemm(arr((64, 64)), arr((64, 64), np.float16))
    with pytest.raises(GemmTypeError, match="out_dtype"):
        gemm(arr((64, 64)), arr((64, 64)), out_dtype="int8")
    with pytest.raises(GemmTypeError, match="host numpy array"):
        gemm(np.zeros((64, 64), np.float16), arr((64, 64), np.float16))
    with pytest.raises(GemmTypeError, match="not a CUDA array"):
        gemm([[1.0]], arr((64, 64)))


def test_layout_and_alignment_errors():
    with pytest.raises(GemmArgumentError, match="2-D"):
        gemm(arr((4, 64, 64)), arr((64, 64)))
    with pytest.raises(GemmArgumentError, match="C-contiguous"):
        gemm(arr((64, 64), strides=(2, 128)), arr((64, 64)))
    with pytest.raises(GemmArgumentError, match="multiple of 8"):
        gemm(arr((64, 60)), arr((60, 64)))                       # K*2 bytes not a multiple of 16
    with pytest.raises(GemmArgumentError, match="rows of B"):
        gemm(arr((64, 64)), arr((64, 100)))                      # B [K, N] rows: N*2 bytes
    with pytest.raises(GemmArgumentError, match="aligned"):
        gemm(arr((64, 64), ptr=(1 << 32) + 8), arr((64, 64)))
    with pytest.raises(GemmArgumentError, match="empty"):
        gemm(arr((0, 64)), arr((64, 64)))


def test_out_errors():
    with pytest.raises(GemmArgumentError, match=r"out has shape \(64, 128\), expected \(M, N\) = \(64, 64\)"):
        gemm(arr((64, 64)), arr((64, 64)), out=arr((64, 128)))
    with pytest.raises(GemmTypeError, match="out is bfloat16 but out_dtype=float32"):
        gemm(arr((64, 64)), arr((64, 64)), out=arr((64, 64)), out_dtype="float32")
    with pytest.raises(GemmArgumentError, match="aliases"):
        gemm(arr((64, 64)), arr((64, 64)), out=arr((64, 64)))   # same fake pointer as A
    with pytest.raises(GemmArgumentError, match="output rows"):
        validate_gemm_args(arr((64, 64)), arr((4, 64)), trans_b=True)   # N=4: 8-byte output rows


def test_hook_arguments_validated_before_launch():
    a, b = arr((256, 64)), arr((64, 256), ptr=1 << 33)
    plan = plan_gemm(256, 256, 64)
    with pytest.raises(GemmArgumentError, match="chunk_rows=100"):
        gemm_with_hooks(a, b, plan=plan, wait=ArrivalWait(flags=0, epoch=1, chunk_rows=100, err=0))
    with pytest.raises(GemmArgumentError, match="ErrorRecord"):
        gemm_with_hooks(a, b, plan=plan, wait=ArrivalWait(flags=0, epoch=1, chunk_rows=128, err=None))
    dests = TileDestinations([1 << 36, (1 << 36) + 256 * 512], 256, "bfloat16")
    with pytest.raises(GemmArgumentError, match="epilogue='tma'"):
        gemm_with_hooks(a, b, plan=dataclasses.replace(plan, epilogue="direct"),
                        epilogue=TileEpilogue(destinations=dests, chunk_rows=128))
    with pytest.raises(GemmArgumentError, match="non-null flags and err"):
        gemm_with_hooks(a, b, plan=plan, wait=ArrivalWait(flags=1 << 34, epoch=1, chunk_rows=128, err=0))
    with pytest.raises(GemmArgumentError, match="must be equal"):
        gemm_with_hooks(a, b, plan=plan, wait=ArrivalWait(flags=1 << 34, epoch=1, chunk_rows=128, err=1 << 35),
                        epilogue=TileEpilogue(destinations=dests, chunk_rows=256))
    with pytest.raises(GemmArgumentError, match="must be a TileDestinations"):
        gemm_with_hooks(a, b, plan=plan, epilogue=TileEpilogue(destinations=1 << 36, chunk_rows=128))
    # the destinations must hold what the call writes: a destination per chunk, N columns, the output type
    with pytest.raises(GemmArgumentError, match="M=256 in chunks of 128 rows needs 2 destinations, TileDestinations has 1"):
        gemm_with_hooks(a, b, plan=plan, epilogue=TileEpilogue(
            destinations=TileDestinations([1 << 36], 256, "bfloat16"), chunk_rows=128))
    with pytest.raises(GemmArgumentError, match="exceeds the destinations' row length ld=128"):
        gemm_with_hooks(a, b, plan=plan, epilogue=TileEpilogue(
            destinations=TileDestinations([1 << 36, 1 << 37], 128, "bfloat16"), chunk_rows=128))
    with pytest.raises(GemmArgumentError, match="writes float32, the destinations hold bfloat16"):
        gemm_with_hooks(a, b, plan=plan_gemm(256, 256, 64, out_dtype="float32"), out_dtype="float32",
                        epilogue=TileEpilogue(destinations=dests, chunk_rows=128))


def test_chunk_reduce_validated_before_launch():
    from fluxrt.gemm import ChunkReduce

    a, b = arr((512, 64)), arr((64, 256), ptr=1 << 33)
    plan = plan_gemm(512, 256, 64)
    dests = TileDestinations([1 << 36] * 4, 256, "bfloat16")
    out = arr((128, 256), ptr=1 << 37)
    good = dict(chunk=1, out=out, partials=1 << 38, source_bytes=128 * 256 * 2, ld=256, sources=4, flags=1 << 39,
                flag_stride=8, epoch=1, err=1 << 40, group_n=2)

    def launch(out_dtype=None, wait=None, **changes):
        p = plan if out_dtype is None else plan_gemm(512, 256, 64, out_dtype=out_dtype)
        d = dests if out_dtype is None else TileDestinations([1 << 36] * 4, 256, out_dtype)
        gemm_with_hooks(a, b, plan=p, out_dtype=out_dtype, wait=wait, epilogue=TileEpilogue(
            destinations=d, chunk_rows=128, reduce=ChunkReduce(**{**good, **changes})))

    for changes, match in [
        (dict(chunk=4), "chunk=4 is not one of the call's 4 chunks"),
        (dict(sources=0), "sources=0 must be 1..128"),
        (dict(sources=129), "sources=129"),
        (dict(group_n=-1), "group_n and flag_stride must be >= 0"),
        (dict(partials=(1 << 38) + 8), "partials=.* multiple of 16 bytes"),
        (dict(source_bytes=100), "source_bytes=100"),
        (dict(ld=252), r"ld \* itemsize=504"),
        (dict(ld=128), "ld=128 is shorter than N=256"),
        (dict(flags=0), "non-null partials, flags and err"),
        (dict(err=None), "non-null partials, flags and err"),
        (dict(out=arr((256, 256))), r"out must be \[128, 256\] \(chunk 1's rows\)"),
        (dict(out=arr((128, 256), strides=(1024, 2))), "C-contiguous"),
        (dict(out=arr((128, 256), ptr=(1 << 37) + 8)), "16-byte aligned"),
    ]:
        with pytest.raises(GemmArgumentError, match=match):
            launch(**changes)
    with pytest.raises(GemmTypeError, match="ChunkReduce.out is float16"):
        launch(out=arr((128, 256), np.float16))
    with pytest.raises(GemmArgumentError, match="16-bit partials"):
        launch(out_dtype="float32")
    with pytest.raises(GemmArgumentError, match="share err, timeout_ns and rank"):
        launch(wait=ArrivalWait(flags=1 << 41, epoch=1, chunk_rows=128, err=1 << 42))


def test_tail_reduce_validated_before_launch():
    from fluxrt.gemm import ChunkReduce
    from fluxrt.gemm.checks import _check_tail

    a, b = arr((512, 64)), arr((64, 256), ptr=1 << 33)
    parts = 1 << 38
    src = 128 * 256 * 2   # one source's partial of the chunk: 128 rows x 256 bf16
    # 4 tile rows; group_m=1 and m_tile_offset=0: chunk 3 (the last 128 rows) is the schedule's last run
    plan = dataclasses.replace(plan_gemm(512, 256, 64), group_m=1)
    dests = TileDestinations([1 << 36] * 3 + [parts + 3 * src], 256, "bfloat16")
    good = dict(chunk=3, out=arr((128, 256), ptr=1 << 37), partials=parts, source_bytes=src, ld=256, sources=4,
                flags=1 << 39, flag_stride=8, epoch=1, err=1 << 40, group_n=1, where="tail", counter=1 << 41)

    def epilogue(destinations=dests, **changes):
        return TileEpilogue(destinations=destinations, chunk_rows=128, reduce=ChunkReduce(**{**good, **changes}))

    _check_tail(ChunkReduce(**good), epilogue(), plan, 512, 256)   # accepted
    for p, chunk in ((dataclasses.replace(plan, m_tile_offset=1), 0),   # rotated: chunk 0's row comes last
                     (dataclasses.replace(plan, group_m=3), 3)):        # bands of 3 rows: chunk 3 is the short last
        e = epilogue(destinations=TileDestinations([parts + c * src for c in range(4)], 256, "bfloat16"), chunk=chunk)
        _check_tail(e.reduce, e, p, 512, 256)
    for changes, match in [
        (dict(where="after"), "where must be one of"),
        (dict(counter=0), "needs counter"),
        (dict(counter=(1 << 41) + 2), "4-byte aligned"),
        (dict(plan=GemmPlan(cluster=2)), "cluster-1 plan in grouped order"),
        (dict(plan=dataclasses.replace(plan, order="hilbert")), "cluster-1 plan in grouped order"),
        # bands of 4 tile rows: chunk 3's single row shares its band with chunks 0-2
        (dict(plan=dataclasses.replace(plan, group_m=4)), "not one run of the schedule"),
        # m_tile_offset=1: chunk 0's row comes last, chunk 1's starts a band of 2 it shares with chunk 2
        (dict(chunk=1, plan=dataclasses.replace(plan, group_m=2, m_tile_offset=1)), "not one run of the schedule"),
        (dict(destinations=TileDestinations([1 << 36] * 4, 256, "bfloat16")), "own source's slot of the partials"),
        (dict(destinations=TileDestinations([1 << 36] * 3 + [parts + 3 * src], 264, "bfloat16")),
         "own source's slot of the partials"),
    ]:
        p = changes.pop("plan", plan)
        with pytest.raises(GemmArgumentError, match=match):
            gemm_with_hooks(a, b, plan=p, epilogue=epilogue(**changes))
    assert ChunkReduce(**good).hook_id == 2 and ChunkReduce(**{**good, "where": "epilogue"}).hook_id == 1
    assert dict(kernel_defines(plan, "bfloat16", "bfloat16", False, False, True, 2))["FLUXRT_GEMM_HOOK_REDUCE"] == "2"


def test_shard_copy_validated_before_launch():
    from fluxrt.gemm import ShardCopy

    a, b = arr((512, 64)), arr((64, 256), ptr=1 << 33)
    wait = ArrivalWait(flags=1 << 41, epoch=1, chunk_rows=128, err=1 << 42)
    good = dict(src=arr((256, 64), ptr=1 << 37), row0=128, counters=1 << 38)

    def launch(wait=wait, **changes):
        gemm_with_hooks(a, b, arr((512, 256), ptr=1 << 39), wait=wait, copy=ShardCopy(**{**good, **changes}))

    for changes, match in [
        (dict(wait=None), "ShardCopy needs an ArrivalWait"),
        (dict(src=arr((256, 32), ptr=1 << 37)), r"src must be \[rows, K=64\]"),
        (dict(src=arr((256,), ptr=1 << 37)), r"src must be \[rows, K=64\]"),
        (dict(row0=64), r"rows \[64, 320\) must be whole chunks of 128 rows"),
        (dict(src=arr((200, 64), ptr=1 << 37)), "must be whole chunks"),
        (dict(row0=384), r"rows \[384, 640\) .* inside A's 512 rows"),
        (dict(src=arr((256, 64), strides=(256, 2), ptr=1 << 37)), "C-contiguous"),
        (dict(src=arr((256, 64), ptr=(1 << 37) + 8)), "16-byte aligned"),
        (dict(counters=0), "non-null, 8-byte aligned"),
        (dict(counters=(1 << 38) + 4), "non-null, 8-byte aligned"),
    ]:
        with pytest.raises(GemmArgumentError, match=match):
            launch(**changes)
    with pytest.raises(GemmTypeError, match="ShardCopy.src is float16, A is bfloat16"):
        launch(src=arr((256, 64), np.float16, ptr=1 << 37))
    # the copier's 16 KiB buffer must fit beside the plan's ring and staging
    full = GemmPlan(stages=4, c_staging="shared")
    with pytest.raises(GemmArgumentError, match="ShardCopy needs .* shared memory"):
        gemm_with_hooks(a, b, arr((512, 256), ptr=1 << 39), plan=full, wait=wait, copy=ShardCopy(**good))
    assert plan_gemm(8192, 8192, 8192).smem_bytes("bfloat16", shard_copy=True) <= SMEM_LIMIT_BYTES
    assert ShardCopy.pieces_per_chunk(256, 520) == 2 * 9


def test_row_bands_validated_before_launch():
    """RowBands (the fused ops' padded calls): band geometry, shapes and the hooks it combines with are
    checked before any CUDA call, naming what is wrong."""
    from fluxrt.gemm import BANDS_A, BANDS_C, RowBands, ShardCopy, band_bits

    b, plan = arr((64, 256), ptr=1 << 33), plan_gemm(768, 256, 64)
    wait = ArrivalWait(flags=1 << 41, epoch=1, chunk_rows=128, err=1 << 42, chunks_per_peer=2)
    a_banded = arr((600, 64))                     # 3 bands of 200 real rows, stride 256: GEMM M = 768
    a_full, out_banded = arr((768, 64)), arr((600, 256), ptr=1 << 39)
    cases = [
        (dict(a=a_banded, a_bands=RowBands(0, 256)), r"rows=0 must be in \[1, stride=256\]"),
        (dict(a=a_banded, a_bands=RowBands(300, 256)), r"rows=300 must be in \[1, stride=256\]"),
        (dict(a=a_banded, a_bands=RowBands(200, 256), c_bands=RowBands(200, 384), out=out_banded),
         "strides 256 and 384; the kernel has one band height"),
        (dict(a=a_full, c_bands=RowBands(200, 384), out=out_banded, wait=wait), "must equal the hooks' chunk geometry "
         r"\(256 rows"),
        (dict(a=arr((300, 64)), a_bands=RowBands(200, 256)), "A has 300 rows, not whole bands of RowBands.rows=200"),
        (dict(a=arr((700, 64)), c_bands=RowBands(200, 256), out=out_banded), "A has 700 rows, not whole bands of 256"),
        (dict(a=a_full, c_bands=RowBands(200, 256), out=arr((768, 256), ptr=1 << 39)),
         r"out has shape \(768, 256\), expected \(600, 256\) \(3 bands of 200 rows\)"),
        (dict(a=a_banded, a_bands=RowBands(200, 256), out=arr((600, 256), ptr=1 << 39)),
         r"out has shape \(600, 256\), expected \(768, 256\) \(the GEMM's M=768: 3 bands of 256 rows\)"),
        (dict(a=arr((150, 64)), a_bands=RowBands(50, 64)), "stride=64 must be a multiple of block_m=128"),
        (dict(a=a_full, c_bands=RowBands(200, 256), out=out_banded, plan=dataclasses.replace(plan, epilogue="direct")),
         "banded C is stored by the storer warp"),
        (dict(a=a_full, c_bands=RowBands(200, 256), out=out_banded, plan=plan,
              epilogue=TileEpilogue(destinations=TileDestinations([1 << 36] * 3, 256, "bfloat16"), chunk_rows=256)),
         "banded C is stored by the storer warp"),
        (dict(a=a_banded, a_bands=RowBands(200, 256), wait=wait,
              copy=ShardCopy(src=arr((256, 64), ptr=1 << 37), row0=0, counters=1 << 38)), "banded A cannot take ShardCopy"),
    ]
    for kw, match in cases:
        kw = {"plan": plan, **kw}
        a = kw.pop("a")
        with pytest.raises(GemmArgumentError, match=match):
            gemm_with_hooks(a, b, kw.pop("out", None), **kw)
    with pytest.raises(GemmTypeError, match="bands of A must be a RowBands"):
        gemm_with_hooks(a_banded, b, plan=plan, a_bands=(200, 256))
    with pytest.raises(GemmTypeError, match="out is float16 but out_dtype=bfloat16"):
        gemm_with_hooks(a_full, b, arr((600, 256), np.float16, ptr=1 << 39), plan=plan, out_dtype="bfloat16",
                        c_bands=RowBands(200, 256))
    # the kernel configurations: the macro only where bands are on (the others keep their modules)
    assert band_bits(RowBands(1, 128), None) == BANDS_A and band_bits(None, RowBands(1, 128)) == BANDS_C
    assert band_bits(RowBands(1, 128), RowBands(1, 128)) == 3 and band_bits(None, None) == 0
    assert dict(kernel_defines(plan, "bfloat16", "bfloat16", False, bands=BANDS_C))["FLUXRT_GEMM_BANDS"] == "2"
    assert "FLUXRT_GEMM_BANDS" not in dict(kernel_defines(plan, "bfloat16", "bfloat16", False))


def test_tile_destinations_validated():
    with pytest.raises(GemmArgumentError, match="at least one"):
        TileDestinations([], 256, "bfloat16")
    with pytest.raises(GemmArgumentError, match="destination 1 at 0x0 must be non-null"):
        TileDestinations([1 << 36, 0], 256, "bfloat16")
    with pytest.raises(GemmArgumentError, match="16-byte aligned"):
        TileDestinations([(1 << 36) + 8], 256, "bfloat16")
    with pytest.raises(GemmArgumentError, match="ld=0"):
        TileDestinations([1 << 36], 0, "bfloat16")
    with pytest.raises(GemmArgumentError, match="ld=4 bfloat16"):
        TileDestinations([1 << 36], 4, "bfloat16")     # 8-byte rows: TMA needs 16-byte multiples
    with pytest.raises(GemmArgumentError, match="not an output type"):
        TileDestinations([1 << 36], 256, "int32")
    d = TileDestinations([1 << 36], 256, "fp16")
    assert d.dtype == "float16" and d.ptrs == (1 << 36,) and d.ld == 256


# --- kernel compiles for sm_90a -------------------------------------------------------------------

def _nvrtc_available() -> str | None:
    try:
        from cuda.core import Program  # noqa: F401
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        return None
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"NVRTC unavailable ({type(e).__name__}: {e}); pip install 'cuda-toolkit[nvrtc]==13.*'"


COMPILE_CONFIGS = [
    # (plan, in, out, trans_b, hook_wait, hook_epilogue[, hook_reduce (True/1 epilogue, 2 tail)[, hook_copy]])
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, False, False),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", True, False, False),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", False, False, False),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", True, False, False),
    (plan_gemm(4096, 4096, 4096, out_dtype="float32"), "bfloat16", "float32", False, False, False),
    (plan_gemm(4096, 4096, 4096, out_dtype="float32"), "float16", "float32", True, False, False),
    (plan_gemm(1024, 128, 1024), "bfloat16", "bfloat16", False, False, False),
    (plan_gemm(64, 1024, 1024), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=192, stages=3), "bfloat16", "bfloat16", False, False, False),
    (GemmPlan(block_n=64, stages=6), "float16", "float32", True, False, False),
    (GemmPlan(block_m=64, consumers=1, block_n=256, stages=4), "float16", "float16", False, False, False),
    (GemmPlan(epilogue="direct", stages=4), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(epilogue="direct", block_n=128, stages=6), "float16", "float32", False, True, False),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, True, False),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", True, False, True),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, True, True),
    (GemmPlan(cluster=2), "bfloat16", "bfloat16", True, False, False),
    # shared C staging (the consumers take turns on one consumer's region): 4 stages at 128x256
    (GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", False, False, False),
    (GemmPlan(stages=4, c_staging="shared"), "float16", "float16", True, False, False),
    (GemmPlan(stages=4, c_staging="shared", cluster=2), "bfloat16", "bfloat16", False, False, False),
    (GemmPlan(stages=4, c_staging="shared", cluster=2), "bfloat16", "bfloat16", True, False, True),
    (GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", True, False, True),
    (GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", False, True, True),
    (GemmPlan(stages=3, c_staging="shared"), "bfloat16", "float32", False, False, False),
    (GemmPlan(stages=3, c_staging="shared"), "float16", "float32", True, False, True),
    (GemmPlan(block_n=128, stages=6, c_staging="shared"), "bfloat16", "bfloat16", False, False, True),
    (GemmPlan(block_m=64, consumers=1, stages=4, c_staging="shared"), "bfloat16", "bfloat16", False, False, False),
    # hook 3 (GEMM+ReduceScatter's reduce in the epilogue)
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, False, True, True),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", True, False, True, True),
    (GemmPlan(cluster=2), "bfloat16", "bfloat16", True, False, True, True),
    (GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", False, False, True, True),
    (GemmPlan(block_n=128, stages=6), "float16", "float16", False, False, True, True),
    # hook 3 in the tail (GEMM+ReduceScatter's reduce_mode='tail')
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, False, True, 2),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", True, False, True, 2),
    (GemmPlan(stages=4, c_staging="shared"), "bfloat16", "bfloat16", False, False, True, 2),
    (GemmPlan(block_n=128, stages=6), "bfloat16", "bfloat16", True, False, True, 2),
    (GemmPlan(block_m=64, consumers=1, stages=4), "float16", "float16", False, False, True, 2),
    # hook 4 (AllGather+GEMM's own shard read from its source and copied into A by the GEMM)
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, True, False, False, True),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", True, True, False, False, True),
    (GemmPlan(cluster=2), "bfloat16", "bfloat16", False, True, False, False, True),
    (GemmPlan(stages=3, c_staging="shared"), "bfloat16", "bfloat16", True, True, False, False, True),
    # row bands (padded fused-op calls): C with hook 1 (AllGather+GEMM), A with hook 2 (GEMM+ReduceScatter)
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, True, False, 0, False, 2),
    (GemmPlan(cluster=2), "float16", "float16", True, True, False, 0, False, 2),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, False, True, 2, False, 1),
    (plan_gemm(8192, 8192, 8192), "float16", "float16", True, False, True, 0, False, 1),
    (plan_gemm(4096, 4096, 4096, out_dtype="float32"), "bfloat16", "float32", False, False, True, 0, False, 1),
    (plan_gemm(8192, 8192, 8192), "bfloat16", "bfloat16", False, False, False, 0, False, 3),
    # stream-K (cut tiles finished with fp32 partials in K order)
    (GemmPlan(stream_k=True), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(stream_k=True), "float16", "float16", False, False, False),
    (GemmPlan(block_n=128, stages=4, stream_k=True), "bfloat16", "float32", False, False, False),
    (GemmPlan(block_m=64, consumers=1, stages=4, stream_k=True), "float16", "float16", True, False, False),
    (GemmPlan(stream_k=True, cluster=2), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=128, stages=6, stream_k=True, cluster=2), "float16", "float16", False, False, False),
    # B [K, N] in 64-column slabs shared over the pair: three slabs (2 + 1), one slab (the second CTA loads none)
    (GemmPlan(block_n=192, stages=4, stream_k=True, cluster=2), "bfloat16", "bfloat16", False, False, False),
    (GemmPlan(block_n=64, stages=6, stream_k=True, cluster=2), "float16", "float32", False, False, False),
    # the consumers' turns at one shared C staging region (the autotuner's deeper stream-K rings)
    (GemmPlan(stages=4, c_staging="shared", stream_k=True), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(stages=4, c_staging="shared", stream_k=True, cluster=2), "float16", "float16", False, False, False),
    # tile widths fitted to the waves (B K-major; staged: FitArgs' map for the part-filled last slab)
    (GemmPlan(block_n=112, stages=5), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=144, stages=4), "float16", "float32", True, False, False),
    (GemmPlan(block_n=176, stages=5, c_staging="shared"), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=112, stages=6, epilogue="direct"), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=240, stages=4, epilogue="direct"), "float16", "float32", True, False, False),
    (GemmPlan(block_m=64, block_n=80, consumers=1, stages=8, epilogue="direct"), "bfloat16", "float16", True, False,
     False),
    # fitted widths with B as [K, N] (whole 64-column slabs of B per stage, the last one part-read)
    (GemmPlan(block_n=176, stages=4), "bfloat16", "bfloat16", False, False, False),
    (GemmPlan(block_n=112, stages=6), "float16", "float16", False, False, False),
    (GemmPlan(block_n=144, stages=3), "bfloat16", "float32", False, False, False),
    (GemmPlan(block_n=224, stages=4, c_staging="shared", stream_k=True), "float16", "float16", False, False, False),
    # fitted widths in clusters of 2 along M (B multicast: kBN / 2 rows, or every other 64-column slab, per CTA)
    (GemmPlan(block_n=176, stages=4, cluster=2), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=144, stages=4, cluster=2), "float16", "float16", False, False, False),
    (GemmPlan(block_n=208, stages=4, c_staging="shared", cluster=2, stream_k=True), "bfloat16", "bfloat16", True,
     False, False),
    # fitted widths in stream-K form (the fitted C box store in the stream-K storer)
    (GemmPlan(block_n=224, stages=4, c_staging="shared", stream_k=True), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=176, stages=3, stream_k=True), "float16", "float32", True, False, False),
    # clusters along N (A multicast), 1 x 2 and 2 x 2
    (GemmPlan(cluster=2, cluster_n=2), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(cluster=2, cluster_n=2, block_n=192, stages=4), "float16", "float16", False, False, False),
    (GemmPlan(cluster_n=2, block_n=64, stages=8), "bfloat16", "float32", True, False, False),
    (GemmPlan(block_m=64, consumers=1, block_n=128, stages=8, cluster_n=2), "bfloat16", "bfloat16", False, False,
     False),
    (GemmPlan(cluster=2, cluster_n=2, block_n=128, stages=6, epilogue="direct"), "float16", "float16", True, False,
     False),
    # ping-pong consumers (whole tiles alternating between the consumers: two wgmma row blocks each)
    (GemmPlan(block_n=128, stages=5, pingpong=True), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=128, stages=5, pingpong=True), "float16", "float16", False, False, False),
    (GemmPlan(block_n=192, stages=4, c_staging="shared", pingpong=True), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=64, stages=8, pingpong=True, cluster=2), "float16", "float16", True, False, False),
    (GemmPlan(block_n=128, stages=3, pingpong=True), "bfloat16", "float32", False, False, False),
    (GemmPlan(block_n=128, stages=6, c_staging="shared", cluster=2, pingpong=True), "bfloat16", "bfloat16", False,
     False, False),
    # 256-row tiles (two consumers of two wgmma row blocks each): whole, in pairs, fitted, stream-K
    (GemmPlan(block_m=256, block_n=128, stages=4, c_staging="shared"), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_m=256, block_n=128, stages=3), "float16", "float16", False, False, False),
    (GemmPlan(block_m=256, block_n=192, stages=3, c_staging="shared", cluster=2), "bfloat16", "bfloat16", True, False,
     False),
    (GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared"), "float16", "float16", False, False, False),
    (GemmPlan(block_m=256, block_n=96, stages=4, c_staging="shared", cluster=2, stream_k=True), "bfloat16", "bfloat16",
     True, False, False),
    (GemmPlan(block_m=256, block_n=128, stages=2), "bfloat16", "float32", True, False, False),
    (GemmPlan(block_m=256, block_n=192, stages=4, epilogue="direct", cluster=2), "bfloat16", "bfloat16", True, False,
     False),
    (GemmPlan(block_m=256, block_n=96, stages=5, epilogue="direct"), "float16", "float32", True, False, False),
    # clusters along N (A multicast) with 256-row tiles and fitted widths
    (GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared", cluster_n=2), "bfloat16", "bfloat16", True,
     False, False),
    (GemmPlan(block_m=256, block_n=144, stages=3, c_staging="shared", cluster=2, cluster_n=2), "float16", "float16",
     True, False, False),
    (GemmPlan(block_m=256, block_n=160, stages=3, c_staging="shared", cluster_n=2), "bfloat16", "bfloat16", False,
     False, False),
    (GemmPlan(block_m=256, block_n=144, stages=4, epilogue="direct", cluster_n=2), "bfloat16", "bfloat16", True,
     False, False),
    (GemmPlan(block_n=144, stages=4, c_staging="shared", cluster_n=2), "bfloat16", "bfloat16", True, False, False),
    (GemmPlan(block_n=176, stages=4, cluster=2, cluster_n=2), "float16", "float16", False, False, False),
]


def _cubin_u32(data: bytes, name: str) -> int:
    """Initial value of a 4-byte __device__ variable of a cubin (ELF64): the kernel's exported constants
    read without a GPU."""
    import struct

    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2:   # SHT_SYMTAB
            continue
        strtab = sections[link]
        for pos in range(offset, offset + size, entsize):
            st_name, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, pos)
            start = strtab[4] + st_name
            if data[start:data.index(b"\0", start)] == name.encode():
                return struct.unpack_from("<I", data, sections[st_shndx][4] + st_value)[0]
    raise KeyError(name)


@pytest.mark.parametrize("cfg", COMPILE_CONFIGS,
                         ids=lambda c: f"{c[0].block_m}x{c[0].block_n}s{c[0].stages}{c[0].epilogue}"
                                       f"{'-sharedC' if c[0].c_staging == 'shared' else ''}-x{c[0].cluster}"
                                       f"{f'x{c[0].cluster_n}' if c[0].cluster_n > 1 else ''}-{c[1]}-{c[2]}-tb{int(c[3])}-w{int(c[4])}-e{int(c[5])}"
                                       f"{f'-r{int(c[6])}' if c[6:] and c[6] else ''}{'-c1' if c[7:] and c[7] else ''}"
                                       f"{f'-bands{c[8]}' if c[8:] else ''}{'-sk' if c[0].stream_k else ''}{'-pp' if c[0].pingpong else ''}")
def test_kernel_compiles_sm90a(cfg, tmp_path, monkeypatch):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.toolchain import WGMMA_SERIALIZED, compile_cubin, compile_log

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    plan, in_dt, out_dt, tb, hw, he, *rest = cfg
    hooks = dict(hook_reduce=int(rest[0]) if rest else 0, hook_copy=bool(rest[1:2] and rest[1]),
                 bands=rest[2] if rest[2:] else 0)
    cubin = compile_cubin("gemm/hopper_gemm.cu",
                          compile_options(kernel_defines(plan, in_dt, out_dt, tb, hw, he, **hooks), arch="sm_90a"))
    data = cubin.read_bytes()
    assert b"fluxrt_gemm" in data
    assert len(data) > 10_000
    assert WGMMA_SERIALIZED not in compile_log(cubin), compile_log(cubin)   # a wait after every wgmma
    _assert_no_spills(cubin)
    # the kernel's own layout constants agree with the planner's (launch size and dynamic smem)
    assert _cubin_u32(data, "fluxrt_gemm_smem_bytes") == plan.smem_bytes(out_dt, shard_copy=hooks["hook_copy"],
                                                                        b_kmajor=tb)
    assert _cubin_u32(data, "fluxrt_gemm_threads") == plan.threads
    assert (_cubin_u32(data, "fluxrt_gemm_block_m"), _cubin_u32(data, "fluxrt_gemm_block_n")) == \
        (plan.block_m, plan.block_n)
    # one parameter of the same layout in every configuration (fluxrt/gemm/params.py)
    from fluxrt.gemm.params import PARAMS

    assert _cubin_u32(data, "fluxrt_gemm_params_bytes") == PARAMS.itemsize
    if in_dt in ("bfloat16", "float16"):
        _assert_uniform_descriptors(cubin)


@pytest.mark.parametrize("plan", [GemmPlan(block_n=256, stages=4, c_staging="shared", cluster=2),
                                  GemmPlan(block_m=256, block_n=160, stages=4, epilogue="direct", cluster_n=2)],
                         ids=["128x256s4-sharedC-x2", "256x160s4-direct-x1x2"])
def test_trace_build_compiles_sm90a(plan, tmp_path, monkeypatch):
    """FLUXRT_GEMM_TRACE=1 (perf/gemm_trace.py) adds its macro to the configuration, and the diagnostic build
    exports the trace array and keeps the main loop's properties: no wgmma wait after every MMA, no spills,
    descriptors in uniform registers. Without the variable the macro is absent."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.gemm.kernel import kernel_defines
    from fluxrt.toolchain import WGMMA_SERIALIZED, compile_cubin, compile_log

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLUXRT_GEMM_TRACE", raising=False)
    assert ("FLUXRT_GEMM_TRACE", "1") not in kernel_defines(plan, "bfloat16", "bfloat16", True)
    monkeypatch.setenv("FLUXRT_GEMM_TRACE", "1")
    defines = kernel_defines(plan, "bfloat16", "bfloat16", True)
    assert ("FLUXRT_GEMM_TRACE", "1") in defines
    cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(defines, arch="sm_90a"))
    assert b"fluxrt_gemm_trace" in cubin.read_bytes()
    assert b"fluxrt_gemm_epi_trace" in cubin.read_bytes()
    assert WGMMA_SERIALIZED not in compile_log(cubin), compile_log(cubin)
    _assert_no_spills(cubin)
    _assert_uniform_descriptors(cubin)


def _assert_no_spills(cubin) -> None:
    """No stack and no local memory (cuobjdump -res-usage): the accumulators stay in registers (ping-pong's 128 x 192
    tile holds 192 per thread). Needs cuobjdump (the test extra); nothing checked without it."""
    import re
    import subprocess

    from test_toolchain import _cuobjdump

    tool = _cuobjdump()
    if tool is None:
        return
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"Function (\w+):\s*\n\s*REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    assert found and all(st == "0" and lo == "0" for _, st, lo in found), res


def _assert_uniform_descriptors(cubin) -> None:
    """The consumer's wgmma take their descriptors from uniform registers stepped in the uniform datapath: no R2UR
    (a per-thread value moved over) inside a K block's run of HGMMAs (from one to the next that ends its group,
    gsb0), where a descriptor rebuilt per k16 step from a per-thread warpgroup index put a chain of vector
    instructions before every wgmma. Needs cuobjdump and nvdisasm (the test extra's
    cuda-toolkit[cuobjdump,nvdisasm]); nothing checked without them."""
    import subprocess

    from test_toolchain import _cuobjdump

    tool = _cuobjdump()
    if tool is None:
        return
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = [line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines() if "/*" in line and ";" in line]
    runs, start = [], None
    for i, op in enumerate(ops):
        if "HGMMA" in op:
            start = i if start is None else start
            if "gsb0" in op:
                runs.append(ops[start:i + 1])
                start = None
    assert runs, "no HGMMA group in a 16-bit GEMM configuration"
    moved = [op for run in runs for op in run if "R2UR" in op.split()[:2]]
    assert not moved, "\n\n".join("\n".join(run) for run in runs)


def test_generated_wgmma_header_is_current():
    """kernels/gemm/wgmma_ops.cuh must match its generator."""
    import importlib.util
    from pathlib import Path

    from fluxrt.toolchain import kernel_root

    gen = kernel_root() / "gemm" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", gen)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    current = Path(kernel_root() / "gemm" / "wgmma_ops.cuh").read_text()
    expected = "".join(["// GENERATED by kernels/gemm/gen_wgmma.py -- do not edit by hand.\n"])
    assert current.startswith(expected)
    for n in mod.NS:
        assert f"m64n{n}k16.f32.bf16.bf16" in current and f"m64n{n}k16.f32.f16.f16" in current
    assert current == mod.render(), "kernels/gemm/wgmma_ops.cuh is stale: run python kernels/gemm/gen_wgmma.py"


@pytest.mark.parametrize("mt", [1, 5, 16])
@pytest.mark.parametrize("offset", [0, 3])
def test_cluster_order_covers_every_tile_once(mt, offset):
    p = dataclasses.replace(GemmPlan(), cluster=2, group_m=4, m_tile_offset=offset)
    order = tile_order(p, mt * 128, 3 * 256)
    assert sorted(order) == [(m, n) for m in range(mt) for n in range(3)]
    assert order[0] == (offset % mt, 0)


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("mt,nt", [(1, 1), (3, 5), (16, 4), (5, 7)])
@pytest.mark.parametrize("order", ["grouped", "hilbert"])
def test_cluster_along_n_order_covers_every_tile_once(cluster, mt, nt, order):
    p = GemmPlan(cluster=cluster, cluster_n=2, group_m=4, order=order, m_tile_offset=1)
    order_ = tile_order(p, mt * 128, nt * 256 - 8)
    assert sorted(order_) == [(m, n) for m in range(mt) for n in range(nt)]
    # a work item is cluster x 2 tiles: the CTAs of one item share their M tile along N, their N tile along M
    items = -(-mt // cluster) * -(-nt // 2)
    assert p.grid(mt * 128, nt * 256 - 8, 132) == 2 * cluster * min(items, 132 // (2 * cluster))


def test_cluster_along_n_plans_and_defines():
    from fluxrt.gemm import kernel_defines

    p = GemmPlan(cluster=2, cluster_n=2).validate()
    assert p.cluster_ctas == 4 and p.describe().endswith(" x2x2")
    assert dict(kernel_defines(p, "bfloat16", "bfloat16", True))["FLUXRT_GEMM_CLUSTER_N"] == "2"
    assert "FLUXRT_GEMM_CLUSTER_N" not in dict(kernel_defines(GemmPlan(cluster=2), "bfloat16", "bfloat16", True))
    assert p.grid(8192, 8192, 132, max_clusters=30) == 120
    for bad in (dict(cluster_n=3), dict(cluster_n=2, split_k=2), dict(cluster_n=2, stream_k=True)):
        with pytest.raises(ValueError, match="cluster_n"):
            GemmPlan(**bad).validate()
    # fitted widths and 256-row tiles pair along N too
    assert GemmPlan(cluster_n=2, block_n=112, stages=5).validate().cluster_ctas == 2
    assert GemmPlan(block_m=256, block_n=176, stages=3, c_staging="shared", cluster_n=2).validate().grid(
        4096, 4096, 132) == 132


def test_cluster_grid_is_a_multiple_of_the_cluster():
    p = dataclasses.replace(GemmPlan(), cluster=2)
    assert p.grid(8192, 8192, 132) == 132
    assert p.grid(8192, 8192, 132, max_clusters=60) == 120
    assert p.grid(3 * 128, 256, 132) == 4          # 2 work items (the second with a phantom tile)


def test_launch_cache_keeps_none_and_drops_the_oldest():
    """The repeated-call cache shared by gemm, fp8 gemm and grouped gemm: a cached None (nothing to launch) is
    a hit, not a miss, and the oldest entry goes once the bound is passed."""
    from fluxrt.gemm.launch_cache import MISS, LaunchCache

    c = LaunchCache(2)
    assert c.get("a") is MISS
    c.put("a", None)
    assert c.get("a") is None
    c.put("b", 1)
    c.put("c", 2)
    assert c.get("a") is MISS and c.get("b") == 1 and c.get("c") == 2 and len(c) == 2
    c.clear()
    assert c.get("b") is MISS


@pytest.mark.parametrize("split", [1, 3])
def test_load_plain_loads_what_a_plain_call_launches(monkeypatch, tmp_path, split):
    """fluxrt.gemm.launch.load_plain (the decomposed fused ops load their pieces' GEMMs before any collective)
    loads the configuration a plain gemm() call runs: with split-K the fp32-partials kernel (compiled here with
    NVRTC where available) and the slices' reduction."""
    import contextlib

    pytest.importorskip("cupy", reason="cupy not installed")
    from fluxrt.gemm import launch, split_k
    from fluxrt.gemm.kernel import kernel_defines, plain_defines

    plan = GemmPlan(block_n=128, stages=4, split_k=split)
    kernels, reducers = [], []
    monkeypatch.setattr(launch, "_kernel", lambda defines, dev, smem: kernels.append((defines, smem)))
    monkeypatch.setattr(split_k, "_kernel", lambda defines, dev, smem: kernels.append((defines, smem)))
    monkeypatch.setattr(split_k, "_reducer", lambda out_dt, dev: reducers.append(out_dt))
    monkeypatch.setattr("cupy.cuda.Device", lambda dev: contextlib.nullcontext())
    launch.load_plain(plan, "bfloat16", "bfloat16", True, 0)
    if split == 1:
        assert kernels == [(kernel_defines(plan, "bfloat16", "bfloat16", True), plan.smem_bytes("bfloat16"))]
        assert reducers == []
        return
    assert kernels == [(plain_defines(plan, "bfloat16", "bfloat16", True), plan.smem_bytes("float32"))]
    assert reducers == ["bfloat16"] and split_k.REDUCE_NAME
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from fluxrt.toolchain import compile_cubin

    monkeypatch.setenv("FLUXRT_CACHE_DIR", str(tmp_path))
    cubin = compile_cubin("gemm/hopper_gemm.cu", compile_options(kernels[0][0], arch="sm_90a"))
    assert _cubin_u32(cubin.read_bytes(), "fluxrt_gemm_smem_bytes") == plan.smem_bytes("float32")
