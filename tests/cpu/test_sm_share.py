"""CPU tests of grid sizing for a context that gets only part of the GPU (CUDA MPS with an active thread
percentage, green contexts, SM-count execution affinity, or SMs left to other kernels through the fused ops'
``sm_count``): the share the driver's answers give (fluxrt.gemm.kernel.sm_share), its per-context cache, the
ops' option and its checks, that the fused GEMMs' persistent grids fit the share with the SMs they leave to
their comm kernels, and the timeout message of a wait inside a persistent grid."""
from __future__ import annotations

import contextlib

import pytest

from fluxrt.errors import WaitTimeoutError, op_id
from fluxrt.gemm import kernel as K
from fluxrt.ops import plan as P

H100 = 132


@pytest.mark.parametrize("affinity, resource, want", [
    (None, None, 132),       # a whole-GPU context
    (132, 132, 132),         # the driver reports the whole device
    (33, None, 33),          # a context made with an SM-count execution affinity
    (None, 66, 66),          # green context: its SM resource
    (40, 34, 34),            # both: the smaller
    (0, 0, 132),             # zero: not reported
    (200, None, 132),        # never more than the device
])
def test_sm_share(affinity, resource, want):
    n, why = K.sm_share(H100, affinity, resource)
    assert n == want
    assert why.startswith("device 132")
    assert (n < H100) == ("," in why)
    # an MPS client with an active thread percentage: the device attribute already is its share
    assert K.sm_share(32, 32, 32) == (32, "device 32")


def test_context_sms_is_queried_once_per_device_and_context(monkeypatch):
    import cupy

    calls = []
    ctx = {"now": 11}
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(K, "_current_context", lambda: ctx["now"])
    monkeypatch.setattr(K, "_query_sms", lambda dev, c: calls.append((dev, c)) or 33 + c)
    monkeypatch.setattr(K, "_sms", {})
    assert K.context_sms(0) == 44 and K.context_sms(0) == 44
    ctx["now"] = 12   # another context (a green context made current): its own share
    assert K.context_sms(0) == 45
    assert K.context_sms(1) == 45
    assert calls == [(0, 11), (0, 12), (1, 12)]
    assert K._num_sms is K.context_sms


def test_sm_count_option_checks():
    assert P.GemmRsPlan(sm_count=33).validate().sm_count == 33
    assert P.GemmRsPlan(comm_mode="sm", reduce_mode="tail", sm_count=1).validate().sm_count == 1
    assert P.AgGemmPlan(sm_count=2).validate().sm_count == 2
    assert "sm_count=33" in repr(P.AgGemmPlan(sm_count=33))
    for bad in (0, -4, 1.5, True, "33"):
        with pytest.raises(P.OpsArgumentError, match="sm_count must be None or an int"):
            P.GemmRsPlan(sm_count=bad).validate()
    with pytest.raises(P.OpsArgumentError, match="above the 1 SM"):   # 'ce' leaves one SM to its waits
        P.GemmRsPlan(comm_mode="ce", sm_count=1).validate()
    with pytest.raises(P.OpsArgumentError, match="above the 8 SM"):   # 'concurrent' its reduce_blocks
        P.GemmRsPlan(comm_mode="sm", reduce_mode="concurrent", reduce_blocks=8, sm_count=8).validate()
    with pytest.raises(P.OpsArgumentError, match="above the 8 SM"):   # push mode its push kernels
        P.AgGemmPlan(comm_mode="push", push_blocks=8, sm_count=8).validate()


def test_op_sms():
    assert P.op_sms(P.GemmRsPlan(), 33, "GemmReduceScatter") == 33
    assert P.op_sms(P.GemmRsPlan(sm_count=20), 33, "GemmReduceScatter") == 20
    with pytest.raises(P.OpsArgumentError, match=r"AllGatherGemm: plan.sm_count=40 exceeds the 33 SMs"):
        P.op_sms(P.AgGemmPlan(sm_count=40), 33, "AllGatherGemm")


class _FakeWorld:
    size, rank, device_id = 4, 0, 0

    class options:
        check_collective_args = False


@pytest.mark.parametrize("cls, plan", [("AllGatherGemm", P.AgGemmPlan(sm_count=40)),
                                       ("GemmReduceScatter", P.GemmRsPlan(sm_count=40))])
def test_ops_refuse_an_sm_count_above_the_context_share_before_allocating(monkeypatch, cls, plan):
    import fluxrt.ops as ops
    from fluxrt.ops import common

    monkeypatch.setattr(common, "num_sms", lambda world: 33)   # an MPS client with a quarter of an H100
    with pytest.raises(P.OpsArgumentError, match=f"{cls}: plan.sm_count=40 exceeds the 33 SMs"):
        getattr(ops, cls)(_FakeWorld(), 1024, 1024, 1024, plan=plan)


SHAPES = [(4096, 4096, 1024), (8192, 7168, 2048), (1024, 320, 192), (16384, 3072, 512)]


@pytest.mark.parametrize("sms", [33, 66, 132, 20])
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fused_grids_fit_the_share_with_their_comm_sms(sms, m, n, k, world):
    """Every per-call GEMM plan of both ops, sized for `sms`, launches at most sms - reserved CTAs: the grid and
    the comm kernels it waits for are all resident in the share (one CTA per SM is always possible)."""
    plans = [P.GemmRsPlan(comm_mode=c, reduce_mode=r) for c, r in
             (("ce", "tail"), ("ce", "epilogue"), ("ce", "after"), ("sm", "tail"), ("sm", "concurrent"))]
    for rs in plans:
        for rank in range(world):
            g = P.rs_gemm_plan(rs, m, n, k, rank, world, "bfloat16", num_sms=sms)
            assert g.grid(m, n, sms) + rs.reserved_sms <= sms
            assert P.rs_reduce_grid(rs, m // world, n, g.block_n, sms) <= max(rs.reduce_blocks, 4 * sms)
    for ag in (P.AgGemmPlan(), P.AgGemmPlan(chunks_per_rank=2), P.AgGemmPlan(comm_mode="push", push_blocks=4)):
        for rank in range(world):
            g = P.ag_gemm_plan(ag, m, n, k, rank, world, "bfloat16", num_sms=sms)
            assert g.grid(m, n, sms) + ag.reserved_sms <= sms


def test_a_grid_sized_for_the_device_does_not_fit_a_quarter():
    """Why the share matters: sized for all 132 SMs, GEMM+RS's grid for a large problem has more CTAs than a
    context with a quarter of the SMs may hold at once, so CTAs spinning on flags would hold the SMs the rest
    need."""
    g = P.rs_gemm_plan(P.GemmRsPlan(), 8192, 7168, 2048, 0, 4, "bfloat16", num_sms=H100)
    assert g.grid(8192, 7168, H100) > 33
    g = P.rs_gemm_plan(P.GemmRsPlan(), 8192, 7168, 2048, 0, 4, "bfloat16", num_sms=33)
    assert g.grid(8192, 7168, 33) == 32


def test_timeout_inside_a_persistent_grid_names_residency():
    op_id("test.sm_share.persistent", persistent_grid=True)
    op_id("test.sm_share.plain")
    e = WaitTimeoutError("test.sm_share.persistent", 1, 2, 5, 4)
    assert "rank 1 timed out waiting for peer 2" in str(e) and "sm_count" in str(e) and "beside its persistent grid" in str(e)
    assert "sm_count" not in str(WaitTimeoutError("test.sm_share.plain", 1, 2, 5, 4))
    import pickle

    assert str(pickle.loads(pickle.dumps(e))) == str(e)
