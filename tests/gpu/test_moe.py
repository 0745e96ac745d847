"""GPU tests of MoE dispatch and combine (fluxrt.moe.Dispatcher) under mpirun on 2 or 4 ranks (or on one GPU
under CUDA MPS: launch/mps-check.sh with MPS_FILES=moe).

Every rank routes its own random tokens; the reference gathers every rank's tokens and routing over MPI and
builds, in numpy, what each owner must receive (rows grouped by local expert, then source rank, then token and
slot: compared bit for bit, since dispatch only copies) and what combine must return (float64 weighted sums
of a known per-expert function of the tokens, compared with a relative error bound). Receive buffers and
outputs are poisoned with NaN first.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multirank

HIDDEN = 264          # 16-byte rows, not a multiple of 128
TOL = 1.5e-2          # max |err| / max |ref| for bf16 outputs (rounding of y and of the sum)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _scale(num_experts):
    """The test's experts: expert e multiplies its tokens by c[e] (so a row delivered to the wrong expert shows)."""
    return (1.0 + 0.125 * np.arange(num_experts)).astype(np.float32)


def _routing(rng, tokens, k, num_experts, masked=0.0):
    """k distinct experts per token (-1 for a masked slot with probability `masked`), and positive weights."""
    if tokens == 0:
        return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
    idx = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(tokens)]).reshape(tokens, k)
    if masked:
        idx = np.where(rng.random((tokens, k)) < masked, -1, idx)
    w = rng.random((tokens, k)).astype(np.float32) + 0.1
    return idx.astype(np.int32), w


def _expected_recv(world, xs, idxs, num_experts):
    """Rows owner `world.rank` must receive, and its per-local-expert counts."""
    el = num_experts // world.size
    rows, counts = [], []
    for le in range(el):
        e = world.rank * el + le
        n = 0
        for s in range(world.size):
            for i, ex in enumerate(idxs[s].reshape(-1)):
                if ex == e:
                    rows.append(xs[s][i // idxs[s].shape[1]])
                    n += 1
        counts.append(n)
    h = xs[0].shape[1]
    return (np.stack(rows) if rows else np.zeros((0, h), xs[0].dtype)), np.array(counts, np.int32)


def _expected_rows_sent(world, idx, num_experts, dedupe):
    """Rows this rank pushes to each rank: one per (token, slot), with dedupe one per (token, destination)."""
    el = num_experts // world.size
    owners = np.where(idx >= 0, idx // el, -1)
    if dedupe:
        return np.array([int((owners == r).any(axis=1).sum()) for r in range(world.size)], np.int64)
    return np.array([int((owners == r).sum()) for r in range(world.size)], np.int64)


def _expected_out(x, idx, w, num_experts):
    """float64 reference of combine after the test's experts: sum_j w[t, j] * bf16(c[e] * x[t])."""
    c = _scale(num_experts)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            if e >= 0:
                y = (x[t].astype(np.float32) * c[e]).astype(_bf16())
                out[t] += float(w[t, j]) * y.astype(np.float64)
    return out


_SCALE_ROWS = r"""
extern "C" __global__ void scale_rows(unsigned short* recv, const int* offsets, int el, const float* c, int hidden) {
    const int r = blockIdx.x;
    if (r >= offsets[el]) return;
    int i = 0;
    while (i + 1 < el && offsets[i + 1] <= r) ++i;   // the local expert of row r
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        const float f = __uint_as_float((unsigned)recv[(long long)r * hidden + j] << 16) * c[i];
        unsigned b = __float_as_uint(f);
        b += 0x7FFFu + ((b >> 16) & 1u);              // round to nearest even, as ml_dtypes
        recv[(long long)r * hidden + j] = (unsigned short)(b >> 16);
    }
}
"""


_KERNELS: dict = {}


def _local_scales(num_experts, world):
    import cupy

    el = num_experts // world.size
    return cupy.asarray(_scale(num_experts)[world.rank * el:(world.rank + 1) * el])


def _experts(recv, offsets, c, stream=None):
    """The test's experts on the GPU, in place on the received rows: rows of local expert i times c[i]; no host
    read of the layout, so it can be captured."""
    import cupy

    kernel = _KERNELS.get("scale_rows")
    if kernel is None:   # made once: a capture must not load a module
        kernel = _KERNELS["scale_rows"] = cupy.RawKernel(_SCALE_ROWS, "scale_rows")
    kernel((recv.shape[0],), (128,), (recv, offsets, np.int32(offsets.size - 1), c, np.int32(recv.shape[1])),
           stream=stream)


def _poison(a):
    a.view(np.uint16).fill(0x7FC0)


def _rel_err(got, ref):
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return np.inf
    return np.abs(got - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-30)


def _rank_rng(rng, world):
    """A generator of this rank's own data, drawn from the test's generator (which every rank advances alike)."""
    return np.random.default_rng([int(rng.integers(1 << 31)), world.rank])


class _Problems(list):
    def assert_none(self):
        assert not self, "; ".join(self[:5]) + (f" (+{len(self) - 5} more)" if len(self) > 5 else "")


def _round(world, d, rng, tokens, k, *, masked=0.0, route=None, idx_dtype=np.int32, problems, what=""):
    """One dispatch -> experts -> combine, checked against the reference; problems collected (not asserted),
    so that no rank leaves the others waiting in the next collective step."""
    import cupy

    e = d.cfg.num_experts
    rng = _rank_rng(rng, world)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32).astype(_bf16())
    idx, w = route(rng, tokens) if route else _routing(rng, tokens, k, e, masked)
    idx = idx.astype(idx_dtype)
    xs, idxs = world.comm.allgather(x), world.comm.allgather(idx)
    _poison(d.recv)
    recv, h = d.dispatch(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w))
    exp_rows, exp_counts = _expected_recv(world, xs, idxs, e)
    n = h.num_recv()
    got_counts = h.counts_host()
    offsets = h.offsets.get()
    if n != exp_rows.shape[0] or not np.array_equal(got_counts, exp_counts):
        problems.append(f"{what} rank {world.rank}: received {n} rows counts {got_counts.tolist()}, expected "
                        f"{exp_rows.shape[0]} counts {exp_counts.tolist()}")
    elif not np.array_equal(offsets, np.concatenate(([0], np.cumsum(exp_counts))).astype(np.int32)):
        problems.append(f"{what} rank {world.rank}: offsets {offsets.tolist()}")
    elif not np.array_equal(recv[:n].get().view(np.uint16), exp_rows.view(np.uint16)):
        bad = np.nonzero((recv[:n].get().view(np.uint16) != exp_rows.view(np.uint16)).any(axis=1))[0]
        problems.append(f"{what} rank {world.rank}: {bad.size} received rows differ (first {bad[:8].tolist()})")
    sent = h.rows_sent()
    if not np.array_equal(sent, _expected_rows_sent(world, idx, e, d.cfg.dedupe)):
        problems.append(f"{what} rank {world.rank}: rows sent {sent.tolist()}, expected "
                        f"{_expected_rows_sent(world, idx, e, d.cfg.dedupe).tolist()}")
    if d.cfg.arrivals:   # every (local expert, source) word is up at this round, empty experts included
        flags, round_ = d.arrive.get(), int(d.epoch[1].get())
        if not (flags == round_).all():
            problems.append(f"{what} rank {world.rank}: arrival flags {flags.tolist()}, round {round_}")
    _experts(recv, h.offsets, _local_scales(e, world))
    out = cupy.empty((tokens, HIDDEN), dtype=_bf16())
    _poison(out)
    got = d.combine(recv, h, out=out)
    ref = _expected_out(x, idx, w, e)
    err = _rel_err(got.get().astype(np.float64), ref)
    if not err < TOL:
        problems.append(f"{what} rank {world.rank}: combine relative error {err:.3g}")
    world.check_errors()
    return x, idx, w, got


@pytest.fixture(scope="module", params=["throughput", "low_latency", "arrivals", "throughput_dedupe",
                                        "low_latency_dedupe", "arrivals_dedupe"])
def disp(world, request):
    import fluxrt.moe as moe

    name = request.param.removesuffix("_dedupe")
    mode, arrivals = ("throughput", True) if name == "arrivals" else (name, False)
    d = moe.Dispatcher(world, num_experts=4 * world.size, hidden=HIDDEN, max_tokens_per_rank=160, dtype="bf16",
                       options=moe.DispatcherOptions(top_k=4, blocks=8, threads=256, mode=mode, arrivals=arrivals,
                                                     dedupe=request.param.endswith("_dedupe")))
    yield d
    d.free()


def test_dispatch_combine_random_routing(world, disp, rng):
    problems = _Problems()
    for tokens in (37 + 13 * world.rank, 1, 97):   # T differs per rank; not a multiple of anything
        _round(world, disp, rng, tokens, 4, problems=problems, what=f"T={tokens}")
    problems.assert_none()


def test_int64_routing_and_masked_slots(world, disp, rng):
    problems = _Problems()
    _round(world, disp, rng, 53, 3, masked=0.3, idx_dtype=np.int64, problems=problems)
    problems.assert_none()


def test_rank_without_tokens(world, disp, rng):
    problems = _Problems()
    _round(world, disp, rng, 0 if world.rank == 0 else 29, 2, problems=problems)
    problems.assert_none()


def test_experts_without_tokens_and_all_to_one_expert(world, disp, rng):
    e = disp.cfg.num_experts
    problems = _Problems()

    def even_only(rng, t):   # odd experts (and, with 2 ranks, whole halves of the ranks' experts) get nothing
        idx = np.stack([rng.choice(np.arange(0, e, 2), size=2, replace=False) for _ in range(t)]).reshape(t, 2)
        return idx.astype(np.int32), rng.random((t, 2)).astype(np.float32) + 0.1

    def one_expert(rng, t):  # every token of every rank to expert 1 (slot 1 masked)
        idx = np.stack([np.full(t, 1), np.full(t, -1)], axis=1)
        return idx.astype(np.int32), rng.random((t, 2)).astype(np.float32) + 0.1

    _round(world, disp, rng, 41, 2, route=even_only, problems=problems, what="even experts")
    _round(world, disp, rng, 160, 2, route=one_expert, problems=problems, what="one expert")
    problems.assert_none()


def test_two_slots_to_the_same_rank(world, disp, rng):
    el = disp.local_experts
    problems = _Problems()

    def same_rank(rng, t):   # slots 0 and 1 on two experts of one rank, slot 2 elsewhere
        owner = rng.integers(0, world.size, size=t)
        a = owner * el + rng.integers(0, el // 2, size=t)
        b = owner * el + el // 2 + rng.integers(0, el - el // 2, size=t)
        c = (owner + 1) % world.size * el
        return np.stack([a, b, c], axis=1).astype(np.int32), rng.random((t, 3)).astype(np.float32) + 0.1

    _round(world, disp, rng, 64, 3, route=same_rank, problems=problems)
    problems.assert_none()


def test_several_slots_on_one_rank(world, disp, rng):
    """2, 3 and all 4 of a token's slots on one rank (dedupe sends such a token there once; the owner copies it
    into each expert's group), mixed with tokens spread out and masked slots; T not a multiple of anything."""
    el, e = disp.local_experts, disp.cfg.num_experts
    problems = _Problems()

    def clustered(rng, t):
        owner = rng.integers(0, world.size, size=t)
        on_owner = rng.integers(1, 5, size=t)      # how many of the 4 slots go to `owner`
        idx = np.full((t, 4), -1, np.int64)
        for i in range(t):
            mine = owner[i] * el + rng.choice(el, size=on_owner[i], replace=False)
            others = [x for x in range(e) if x // el != owner[i]]
            rest = rng.choice(others, size=4 - on_owner[i], replace=False) if others else []
            row = np.concatenate([mine, rest])[:4]
            idx[i, :row.size] = rng.permutation(row)   # the owner's slots anywhere among the 4
        idx = np.where(rng.random((t, 4)) < 0.05, -1, idx)
        return idx.astype(np.int32), rng.random((t, 4)).astype(np.float32) + 0.1

    def all_on_one(rng, t):   # every slot of every token on rank (token mod world), in reversed expert order
        owner = np.arange(t) % world.size
        idx = owner[:, None] * el + np.arange(el)[::-1][None, :4]
        return idx.astype(np.int32), rng.random((t, 4)).astype(np.float32) + 0.1

    for t in (61 + 17 * world.rank, 1, 160):
        _round(world, disp, rng, t, 4, route=clustered, problems=problems, what=f"clustered T={t}")
    _round(world, disp, rng, 93, 4, route=all_on_one, problems=problems, what="all on one rank")
    problems.assert_none()


def test_back_to_back_changing_routing_and_bitwise_repeat(world, disp, rng):
    import cupy

    problems = _Problems()
    first = None
    for it in range(30):
        tokens = int(rng.integers(1, 161))
        _round(world, disp, rng, tokens, int(rng.integers(1, 5)), masked=0.1, problems=problems, what=f"iter {it}")
    # the same inputs twice: the same bits
    x = cupy.asarray(rng.standard_normal((77, HIDDEN)).astype(np.float32).astype(_bf16()))
    idx, w = (cupy.asarray(a) for a in _routing(rng, 77, 4, disp.cfg.num_experts))
    for _ in range(2):
        recv, h = disp.dispatch(x, idx, w)
        out = disp.combine(recv, h)
        if first is None:
            first = out.get()
        elif not np.array_equal(out.get().view(np.uint16), first.view(np.uint16)):
            problems.append(f"rank {world.rank}: a repeated combine gave other bits")
    problems.assert_none()


def _replay_with_new_routing(world, graph, s, buffers, experts, rng, reference, tol, problems) -> None:
    """Three replays of a captured graph, each after new tokens, routing and weights were written into its
    input buffers and its output was poisoned; the output against reference(x, topk_idx, topk_weights)."""
    import cupy

    x, idx, w, out = buffers
    t, k = idx.shape
    for rep in range(3):
        xh = rng.standard_normal((t, HIDDEN)).astype(np.float32).astype(_bf16())
        ih, wh = _routing(rng, t, k, experts, masked=0.1)
        x.set(xh)
        idx.set(ih)
        w.set(wh)
        _poison(out)
        cupy.cuda.Device().synchronize()
        world.comm.Barrier()
        graph.launch(s)
        s.synchronize()
        world.check_errors()
        err = _rel_err(out.get().astype(np.float64), reference(xh, ih, wh))
        if not err < tol:
            problems.append(f"replay {rep} rank {world.rank}: relative error {err:.3g}")


def test_graph_capture(world, disp, rng):
    import cupy

    e, t, k = disp.cfg.num_experts, 90, 4
    x = cupy.zeros((t, HIDDEN), dtype=_bf16())
    idx = cupy.zeros((t, k), dtype=np.int32)
    w = cupy.zeros((t, k), dtype=np.float32)
    out = cupy.empty((t, HIDDEN), dtype=_bf16())
    c = _local_scales(e, world)
    s = cupy.cuda.Stream(non_blocking=True)

    def body():
        recv, h = disp.dispatch(x, idx, w, stream=s)
        _experts(recv, h.offsets, c, stream=s)   # on the device: no host read
        disp.combine(recv, h, out=out, stream=s)

    body()   # compile and warm up outside the capture
    s.synchronize()
    with s:
        s.begin_capture()
        body()
        graph = s.end_capture()
    problems = _Problems()
    _replay_with_new_routing(world, graph, s, (x, idx, w, out), e, _rank_rng(rng, world),
                             lambda xh, ih, wh: _expected_out(xh, ih, wh, e), TOL, problems)
    problems.assert_none()


def test_bad_arguments_raise_on_every_rank(world, disp):
    import cupy

    import fluxrt.moe as moe

    x = cupy.zeros((4, HIDDEN), dtype=np.float16)   # the Dispatcher is bf16
    idx = cupy.zeros((4, 2), dtype=np.int32)
    w = cupy.zeros((4, 2), dtype=np.float32)
    with pytest.raises(moe.MoEArgumentError, match="bf16|other ranks"):
        disp.dispatch(x if world.rank == 0 else x.astype(_bf16()), idx, w)
    xb = cupy.zeros((4, HIDDEN), dtype=_bf16())
    recv, h = disp.dispatch(xb, idx, w)
    disp.combine(recv, h)
    with pytest.raises(moe.MoEArgumentError, match="combined already"):
        disp.combine(recv, h)
    recv2, h2 = disp.dispatch(xb, idx, w)
    with pytest.raises(moe.MoEArgumentError, match="earlier dispatch"):
        disp.combine(recv2, h)
    if disp.cfg.mode == "low_latency":
        with pytest.raises(moe.MoEArgumentError, match="combined first"):
            disp.dispatch(xb, idx, w)
    disp.combine(recv2, h2)
    world.synchronize()


@pytest.mark.parametrize("mode", ["throughput", "low_latency"])
def test_dedupe_gives_the_same_bits_as_one_row_per_slot(world, rng, mode):
    """The same routing through a plain and a dedupe Dispatcher: the same received rows, offsets and combined
    output, bit for bit (combine is unchanged: it pulls every slot's expert output in slot order)."""
    import cupy

    import fluxrt.moe as moe

    e, k, t = 4 * world.size, 4, 77 + 5 * world.rank
    local = _rank_rng(rng, world)
    x = cupy.asarray(local.standard_normal((t, HIDDEN)).astype(np.float32).astype(_bf16()))
    idx, w = (cupy.asarray(a) for a in _routing(local, t, k, e, masked=0.1))
    got = []
    for dedupe in (False, True):
        d = moe.Dispatcher(world, num_experts=e, hidden=HIDDEN, max_tokens_per_rank=128,
                           dtype="bf16", options=moe.DispatcherOptions(top_k=k, blocks=6, threads=128, mode=mode,
                                                                       dedupe=dedupe))
        try:
            _poison(d.recv)
            recv, h = d.dispatch(x, idx, w)
            n = h.num_recv()
            rows, offsets = recv[:n].get().view(np.uint16), h.offsets.get()
            _experts(recv, h.offsets, _local_scales(e, world))
            out = d.combine(recv, h).get().view(np.uint16)
            got.append((rows, offsets, out, h.rows_sent()))
            world.synchronize()
        finally:
            d.free()
    (r0, o0, y0, s0), (r1, o1, y1, s1) = got
    problems = _Problems()
    if not (np.array_equal(o0, o1) and np.array_equal(r0, r1)):
        problems.append(f"rank {world.rank}: received rows or offsets differ with dedupe")
    if not np.array_equal(y0, y1):
        problems.append(f"rank {world.rank}: combined output differs with dedupe")
    if not (s1 <= s0).all():
        problems.append(f"rank {world.rank}: dedupe sent more rows {s1.tolist()} than plain {s0.tolist()}")
    problems.assert_none()


def test_heap_exhausted_is_named(world):
    import fluxrt
    import fluxrt.moe as moe

    with pytest.raises(fluxrt.HeapExhaustedError, match="heap_size"):
        moe.Dispatcher(world, num_experts=world.size, hidden=7168, max_tokens_per_rank=1 << 16, dtype="bf16")


def _quantize_ref(x, block):
    """numpy e4m3 quantization of bf16 rows: scale = amax / 448 per token or per 1x128 block (fp32); an all-zero
    group has scale 0 and zero codes."""
    import ml_dtypes

    f = x.astype(np.float32)
    g = f.reshape(f.shape[0], -1, 128) if block else f.reshape(f.shape[0], 1, -1)
    scale = (np.abs(g).max(axis=2, keepdims=True) / np.float32(448.0)).astype(np.float32)
    v = np.divide(g, scale, out=np.zeros_like(g), where=scale > 0)
    q = v.astype(ml_dtypes.float8_e4m3fn).reshape(f.shape)
    return q.view(np.uint8), scale.reshape(f.shape[0], -1)


@pytest.mark.parametrize("dedupe", [False, True], ids=["plain", "dedupe"])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_fp8_dispatch(world, rng, mode, dedupe):
    import cupy

    import fluxrt.moe as moe

    h, e, k = 256, 2 * world.size, 2   # 2 experts per rank: many tokens have both slots on one rank
    d = moe.Dispatcher(world, num_experts=e, hidden=h, max_tokens_per_rank=64, dtype="bf16",
                       options=moe.DispatcherOptions(top_k=k, blocks=4, threads=128, fp8=mode, dedupe=dedupe))
    try:
        local = _rank_rng(rng, world)
        t = 29 + 7 * world.rank
        x = (local.standard_normal((t, h)) * np.exp(local.standard_normal((t, 1)))).astype(np.float32).astype(_bf16())
        x[3] = 0   # an all-zero token: scale 0, zero codes
        idx, w = _routing(local, t, k, e, masked=0.2)
        xs, idxs = world.comm.allgather(x), world.comm.allgather(idx)
        (q, sc), hd = d.dispatch(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w))
        n = hd.num_recv()
        qs = [_quantize_ref(xx, mode == "block") for xx in xs]
        exp_q, exp_counts = _expected_recv(world, [a for a, _ in qs], idxs, e)
        exp_s, _ = _expected_recv(world, [b for _, b in qs], idxs, e)
        problems = _Problems()
        if n != exp_q.shape[0] or not np.array_equal(hd.counts_host(), exp_counts):
            problems.append(f"rank {world.rank}: {n} rows, expected {exp_q.shape[0]}")
        else:
            got_q = q[:n].view(np.uint8).get()
            bad = int((got_q != exp_q).sum())
            if bad:
                problems.append(f"rank {world.rank}: {bad} of {got_q.size} e4m3 values differ")
            if not np.array_equal(sc[:n].get(), exp_s):
                problems.append(f"rank {world.rank}: scales differ")
        sent, want = hd.rows_sent(), _expected_rows_sent(world, idx, e, dedupe)
        if not np.array_equal(sent, want):
            problems.append(f"rank {world.rank}: rows sent {sent.tolist()}, expected {want.tolist()}")
        wire = h + 4 * (1 if mode == "token" else h // 128)
        if hd.bytes_sent() != (int(want.sum()) - int(want[world.rank])) * wire:
            problems.append(f"rank {world.rank}: bytes sent {hd.bytes_sent()}")
        d.combine(d.recv, hd)   # combine stays 16-bit; ends the round
        world.synchronize()
        problems.assert_none()
    finally:
        d.free()


# --- MoELayer: dispatch -> grouped GEMM gate/up -> SiLU * up -> grouped GEMM down -> combine -------------------
FFN = 200             # 2 F = 400: neither a multiple of a tile nor of 128
LAYER_TOL = 3e-2      # max |err| / max |ref|: bf16 roundings of h, act, y and out over the float64 reference
_POISON = 0x7FC0      # a bf16 NaN


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _layer_reference(x, idx, w, wgu, wd):
    """float64 of the whole layer for this rank's tokens: out[t] = sum_j w[t, j] * FFN_e(x[t]), e = idx[t, j],
    FFN_e(v) = Wd[e] (silu(Wg[e] v) * (Wu[e] v)) with Wg, Wu the first and last F rows of wgu[e]."""
    x64 = x.astype(np.float64)
    out = np.zeros(x.shape, np.float64)
    f = wd.shape[2]
    for e in np.unique(idx[idx >= 0]):
        t, j = np.nonzero(idx == e)
        h = x64[t] @ wgu[e].T
        y = (_silu(h[:, :f]) * h[:, f:]) @ wd[e].T
        np.add.at(out, t, w[t, j].astype(np.float64)[:, None] * y)
    return out


class _Layer:
    """A MoELayer with known weights: every rank draws every expert's weights from one seed and loads its own."""

    def __init__(self, world, mode):
        import cupy

        import fluxrt.moe as moe

        e = 4 * world.size
        dedupe = mode.endswith("_dedupe")
        mode = mode.removesuffix("_dedupe")
        overlap = mode == "overlap"   # throughput dispatch with arrival flags, gate/up GEMM beside the push
        self.layer = moe.MoELayer(world, num_experts=e, hidden=HIDDEN, ffn_hidden=FFN, max_tokens_per_rank=160,
                                  dtype="bf16", options=moe.MoELayerOptions(
                                      dispatch=moe.DispatcherOptions(top_k=4, blocks=8, threads=256,
                                                                     mode="throughput" if overlap else mode,
                                                                     dedupe=dedupe),
                                      overlap=overlap))
        self.mode = mode
        g = np.random.default_rng(2025)
        self.wgu = (g.standard_normal((e, 2 * FFN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32).astype(_bf16())
        self.wd = (g.standard_normal((e, HIDDEN, FFN)) / np.sqrt(FFN)).astype(np.float32).astype(_bf16())
        el, r = self.layer.local_experts, world.rank
        mine = slice(r * el, (r + 1) * el)
        # gate and up given separately: the layer stores them as one [E_local, 2 F, H] array
        self.layer.set_weights(w_gate=cupy.asarray(self.wgu[mine, :FFN]), w_up=cupy.asarray(self.wgu[mine, FFN:]),
                               w_down=cupy.asarray(self.wd[mine]))
        self.stored_ok = np.array_equal(self.layer.w_gate_up.get().view(np.uint16), self.wgu[mine].view(np.uint16))
        self.wgu64, self.wd64 = self.wgu.astype(np.float64), self.wd.astype(np.float64)
        self.num_experts = e

    def reference(self, x, idx, w):
        return _layer_reference(x, idx, w, self.wgu64, self.wd64)


@pytest.fixture(scope="module", params=["throughput", "low_latency", "overlap", "overlap_dedupe"])
def moe_layer(world, request):
    lay = _Layer(world, request.param)
    yield lay
    lay.layer.free()


def _layer_round(world, lay, rng, tokens, k, *, masked=0.0, route=None, problems, what="", check_untouched=False):
    """One forward against the float64 reference; problems collected (no rank leaves the others waiting)."""
    import cupy

    layer = lay.layer
    rng = _rank_rng(rng, world)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32).astype(_bf16())
    idx, w = route(rng, tokens) if route else _routing(rng, tokens, k, lay.num_experts, masked)
    out = cupy.empty((tokens, HIDDEN), dtype=_bf16())
    world.comm.Barrier()   # every rank's previous combine (which read this rank's receive buffer) has ended
    for a in (out, layer.h, layer.act, layer.dispatcher.recv):
        _poison(a)
    got = layer.forward(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w), out=out)
    cupy.cuda.get_current_stream().synchronize()
    world.check_errors()
    err = _rel_err(got.get().astype(np.float64), lay.reference(x, idx, w))
    if not err < LAYER_TOL:
        problems.append(f"{what} rank {world.rank}: layer relative error {err:.3g}")
    if check_untouched:   # rows past the received ones: the GEMMs and the activation never touch them
        n = int(layer.dispatcher.offsets[-1].get())
        for name, a in (("h", layer.h), ("act", layer.act), ("receive buffer", layer.dispatcher.recv)):
            if not (a[n:].view(np.uint16) == _POISON).all():
                problems.append(f"{what} rank {world.rank}: {name} rows past the {n} received were written")
    return x, idx, w, got


def test_layer_matches_the_float64_reference(world, moe_layer, rng):
    problems = _Problems()
    if not moe_layer.stored_ok:
        problems.append(f"rank {world.rank}: separate gate/up weights were not stored as [gate; up]")
    for tokens in (37 + 13 * world.rank, 1, 97, 160):   # T differs per rank; not a multiple of anything
        _layer_round(world, moe_layer, rng, tokens, 4, masked=0.1, problems=problems, what=f"T={tokens}",
                     check_untouched=True)
    problems.assert_none()


def test_layer_experts_without_tokens(world, moe_layer, rng):
    e = moe_layer.num_experts
    problems = _Problems()

    def even_only(rng, t):   # odd experts receive nothing
        idx = np.array([rng.choice(np.arange(0, e, 2), size=2, replace=False) for _ in range(t)], np.int32)
        return idx.reshape(t, 2), rng.random((t, 2)).astype(np.float32) + 0.1

    def one_expert(rng, t):  # every token of every rank to expert e - 1: every other expert is empty
        idx = np.stack([np.full(t, e - 1), np.full(t, -1)], axis=1)
        return idx.astype(np.int32), rng.random((t, 2)).astype(np.float32) + 0.1

    _layer_round(world, moe_layer, rng, 41, 2, route=even_only, problems=problems, what="even experts",
                 check_untouched=True)
    _layer_round(world, moe_layer, rng, 160, 2, route=one_expert, problems=problems, what="one expert")
    _layer_round(world, moe_layer, rng, 0 if world.rank == 0 else 29, 3, problems=problems, what="rank 0 empty")
    problems.assert_none()


def test_layer_two_slots_on_one_rank(world, moe_layer, rng):
    """Two (or three) of a token's top-k experts on one rank: the rows land in each expert's group."""
    el, e = moe_layer.layer.local_experts, moe_layer.num_experts
    problems = _Problems()

    def same_rank(rng, t):   # slots 0 and 1 on two experts of one rank, slot 2 elsewhere, slot 3 on slot 0's rank
        owner = rng.integers(0, world.size, size=t)
        a = owner * el + rng.integers(0, el // 2, size=t)
        b = owner * el + el // 2 + rng.integers(0, el - el // 2, size=t)
        c = (owner + 1) % world.size * el + 1
        d = np.where(a % el == 0, a + 1, a - 1) if el > 2 else np.full(t, -1)
        d = np.where((d == b) | (d == c), -1, d)
        idx = np.stack([a, b, c, d], axis=1) % e
        return idx.astype(np.int32), rng.random((t, 4)).astype(np.float32) + 0.1

    for t in (64, 1, 133):
        _layer_round(world, moe_layer, rng, t, 4, route=same_rank, problems=problems, what=f"same rank T={t}",
                     check_untouched=True)
    problems.assert_none()


def test_overlapped_layer_gives_the_sequential_layers_bits(world, moe_layer, rng):
    """The overlapped layer (the down GEMM's epilogue pushes each finished tile's rows to their home ranks, the
    combine sums them as they land) against the same layer stage after stage on the same inputs: bit for bit,
    and both against the float64 reference, over the edge cases: masked slots and odd T, experts without
    tokens, every token to one expert, no tokens on rank 0, two or three of a token's slots on one rank."""
    if moe_layer.mode != "overlap":
        pytest.skip("the overlapped layer against its own sequential run (this layer has no overlap)")
    import cupy

    layer, e, el = moe_layer.layer, moe_layer.num_experts, moe_layer.layer.local_experts

    def even_only(rng, t):
        idx = np.array([rng.choice(np.arange(0, e, 2), size=2, replace=False) for _ in range(t)], np.int32)
        return idx.reshape(t, 2), rng.random((t, 2)).astype(np.float32) + 0.1

    def one_expert(rng, t):
        idx = np.stack([np.full(t, e - 1), np.full(t, -1)], axis=1)
        return idx.astype(np.int32), rng.random((t, 2)).astype(np.float32) + 0.1

    def same_rank(rng, t):   # slots 0, 1 (and 3) on one rank: one row per slot, or with dedupe a local copy
        owner = rng.integers(0, world.size, size=t)
        a = owner * el + rng.integers(0, el // 2, size=t)
        b = owner * el + el // 2 + rng.integers(0, el - el // 2, size=t)
        c = (owner + 1) % world.size * el + 1
        d = np.where(a % el == 0, a + 1, a - 1)
        d = np.where((d == b) | (d == c), -1, d)
        return np.stack([a, b, c, d], axis=1).astype(np.int32) % e, rng.random((t, 4)).astype(np.float32) + 0.1

    cases = [(37 + 13 * world.rank, 4, 0.1, None, "odd T, masked"), (1, 3, 0.0, None, "T=1"),
             (160, 4, 0.0, None, "T=max"), (41, 2, 0.0, even_only, "even experts"),
             (160, 2, 0.0, one_expert, "one expert"), (0 if world.rank == 0 else 29, 3, 0.0, None, "rank 0 empty"),
             (133, 4, 0.0, same_rank, "same rank")]
    problems = _Problems()
    for t, k, masked, route, what in cases:
        x, idx, w, got = _layer_round(world, moe_layer, rng, t, k, masked=masked, route=route, problems=problems,
                                      what=what)
        fused = got.get()
        seq = cupy.empty((t, HIDDEN), dtype=_bf16())
        _poison(seq)
        world.comm.Barrier()
        layer.forward(cupy.asarray(x), cupy.asarray(idx), cupy.asarray(w), out=seq, overlap=False)
        cupy.cuda.get_current_stream().synchronize()
        world.check_errors()
        if not np.array_equal(fused.view(np.uint16), seq.get().view(np.uint16)):
            bad = np.nonzero((fused.view(np.uint16) != seq.get().view(np.uint16)).any(axis=1))[0]
            problems.append(f"{what} rank {world.rank}: {bad.size} overlapped rows differ from the sequential "
                            f"layer's (first {bad[:8].tolist()})")
    problems.assert_none()


def test_returned_combine_that_runs_out_names_op_rank_and_owner(world, moe_layer, rng):
    """A combine whose rows never come back (the experts skipped): its bounded waits give up, the error names
    op 'moe_combine', this rank and the owner it waited for, the tokens come out NaN, and the next overlapped
    forward is right (the counters re-base on what landed, not on what was expected)."""
    if moe_layer.mode != "overlap":
        pytest.skip("the returned combine belongs to the overlapped layer")
    import cupy

    from fluxrt.errors import WaitTimeoutError

    layer, el, t = moe_layer.layer, moe_layer.layer.local_experts, 17
    owner = (world.rank + 1) % world.size
    local = _rank_rng(rng, world)
    x = cupy.asarray(local.standard_normal((t, HIDDEN)).astype(np.float32).astype(_bf16()))
    idx = np.full((t, 2), -1, np.int32)
    idx[:, 0] = owner * el + local.integers(0, el, size=t)   # every token to one owner's experts
    w = cupy.asarray(local.random((t, 2)).astype(np.float32) + 0.1)
    out = cupy.empty((t, HIDDEN), dtype=_bf16())
    out.view(np.uint16).fill(0)
    world.comm.Barrier()
    handle = layer.dispatch(x, cupy.asarray(idx), w)
    layer.dispatcher.combine_returned(handle, out=out)   # no experts: no row comes back
    cupy.cuda.Device().synchronize()
    with pytest.raises(WaitTimeoutError) as info:
        world.check_errors()
    world.reset_error()
    err = info.value
    problems = _Problems()
    if (err.op, err.rank, err.peer) != ("moe_combine", world.rank, owner):
        problems.append(f"rank {world.rank}: {err}")
    if not cupy.isnan(out.astype(np.float32)).all():
        problems.append(f"rank {world.rank}: tokens whose rows never came are not NaN")
    world.comm.Barrier()
    _layer_round(world, moe_layer, rng, 50, 4, masked=0.1, problems=problems, what="after the timeout")
    problems.assert_none()


def test_layer_back_to_back_changing_routing(world, moe_layer, rng):
    problems = _Problems()
    for it in range(20):
        tokens = int(rng.integers(1, 161))
        _layer_round(world, moe_layer, rng, tokens, int(rng.integers(1, 5)), masked=0.1, problems=problems,
                     what=f"iter {it}")
    problems.assert_none()


def test_overlapped_layer_1000_back_to_back_layers(world, moe_layer, rng):
    """1000 overlapped forwards in a row without a host sync between them, each with new tokens, new routing
    (T in [0, 64], k in [1, 4], masked slots, now and then all tokens to one expert) and its own output, then
    every output against the float64 reference: the arrival flags of one round never let a GEMM of the next
    start early, and no round reads another's rows."""
    if moe_layer.mode != "overlap":
        pytest.skip("1000 rounds run on the overlapped layer (the sequential ones: the 20-round test)")
    import cupy

    layer, e, rounds, tmax = moe_layer.layer, moe_layer.num_experts, 1000, 64
    local = _rank_rng(rng, world)
    xs = local.standard_normal((rounds, tmax, HIDDEN)).astype(np.float32).astype(_bf16())
    cases = []
    for r in range(rounds):
        t, k = int(local.integers(0, tmax + 1)), int(local.integers(1, 5))
        if r % 97 == 13:   # every token of every rank to one expert
            idx = np.full((t, k), -1, np.int32)
            idx[:, 0] = (r // 97) % e
            w = local.random((t, k)).astype(np.float32) + 0.1
        else:
            idx, w = _routing(local, t, k, e, masked=0.1)
        cases.append((t, idx, w))
    x_dev = cupy.asarray(xs)
    outs = cupy.empty((rounds, tmax, HIDDEN), dtype=_bf16())
    _poison(outs)
    dev = [(cupy.asarray(idx), cupy.asarray(w)) for _, idx, w in cases]
    world.comm.Barrier()
    s = cupy.cuda.Stream(non_blocking=True)
    for r, (t, _, _) in enumerate(cases):
        layer.forward(x_dev[r, :t], dev[r][0], dev[r][1], out=outs[r, :t], stream=s)
    s.synchronize()
    world.check_errors()
    got = outs.get()
    problems = _Problems()
    for r, (t, idx, w) in enumerate(cases):
        err = _rel_err(got[r, :t].astype(np.float64), moe_layer.reference(xs[r, :t], idx, w)) if t else 0.0
        if not err < LAYER_TOL:
            problems.append(f"round {r} (T={t}, k={idx.shape[1]}) rank {world.rank}: relative error {err:.3g}")
    problems.assert_none()


def test_arrival_wait_that_runs_out_names_op_rank_and_source(world):
    """A grouped GEMM whose arrival flags never come up: its bounded wait gives up, the error names the op,
    this rank and the source it waited for, and the kernel ends (the tile is computed on what is there)."""
    import cupy

    from fluxrt.errors import WaitTimeoutError, op_id
    from fluxrt.gemm import GroupArrival, grouped_gemm

    g, m, k, n = 2, 256, 64, 128
    a = cupy.zeros((m, k), dtype=_bf16())
    b = cupy.zeros((g, n, k), dtype=_bf16())
    offsets = cupy.asarray(np.array([0, 100, m], np.int32))
    # group 0: every source arrived at round 7; group 1: source 1 is a round behind
    flags = cupy.asarray(np.array([7, 7, 7, 7, 6, 7], np.uint64))
    epoch = cupy.asarray(np.array([7], np.uint64))
    arrival = GroupArrival(flags=flags.data.ptr, epoch_at=epoch.data.ptr, sources=3, err=int(world.error_record),
                           timeout_ns=50_000_000, op_id=op_id("moe_arrival_test"), rank=world.rank)
    grouped_gemm(a, b, offsets, trans_b=True, arrival=arrival)
    cupy.cuda.Device().synchronize()
    with pytest.raises(WaitTimeoutError) as info:
        world.check_errors()
    world.reset_error()
    err = info.value
    assert (err.op, err.rank, err.peer) == ("moe_arrival_test", world.rank, 1), str(err)
    flags[4] = 7             # the late source arrives: the same call waits for nobody
    out = grouped_gemm(a, b, offsets, trans_b=True, arrival=arrival)
    cupy.cuda.Device().synchronize()
    world.check_errors()
    assert not cupy.isnan(out[:m].astype(np.float32)).any()
    world.comm.Barrier()


class _Allocations:
    """Counts CuPy allocations (pool and device) while active."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = "fluxrt-test-allocations"

            def __init__(self):
                self.n = 0

            def alloc_preprocess(self, **kw):
                self.n += 1

            def malloc_preprocess(self, **kw):
                self.n += 1

        self.hook = Hook()


def test_layer_graph_capture_and_replay_with_changed_routing(world, moe_layer, rng):
    import cupy

    layer, t, k = moe_layer.layer, 90, 4
    x = cupy.zeros((t, HIDDEN), dtype=_bf16())
    idx = cupy.asarray(np.tile(np.arange(k, dtype=np.int32), (t, 1)))   # distinct experts (low latency's rule)
    w = cupy.zeros((t, k), dtype=np.float32)
    out = cupy.empty((t, HIDDEN), dtype=_bf16())
    s = cupy.cuda.Stream(non_blocking=True)
    layer.forward(x, idx, w, out=out, stream=s)   # compile and warm up outside the capture
    s.synchronize()
    allocs = _Allocations()
    with allocs.hook:   # the steady state allocates nothing (a graph keeps pointing at live buffers)
        layer.forward(x, idx, w, out=out, stream=s)
        s.synchronize()
    problems = _Problems()
    if allocs.hook.n:
        problems.append(f"rank {world.rank}: a steady-state forward made {allocs.hook.n} allocations")
    with s:
        s.begin_capture()
        layer.forward(x, idx, w, out=out, stream=s)
        graph = s.end_capture()
    _replay_with_new_routing(world, graph, s, (x, idx, w, out), moe_layer.num_experts, _rank_rng(rng, world),
                             moe_layer.reference, LAYER_TOL, problems)
    problems.assert_none()


def test_layer_bad_arguments_raise_on_every_rank(world, moe_layer, rng):
    import cupy

    import fluxrt.moe as moe

    layer = moe_layer.layer
    x = cupy.zeros((8, HIDDEN), dtype=_bf16())
    idx = cupy.asarray(np.tile(np.arange(2, dtype=np.int32), (8, 1)))
    w = cupy.ones((8, 2), dtype=np.float32)
    bad_out = cupy.empty((7 if world.rank == 0 else 8, HIDDEN), dtype=_bf16())
    with pytest.raises(moe.MoEArgumentError, match=r"out must be bf16 \[8, 264\]|other ranks"):
        layer.forward(x, idx, w, out=bad_out)
    with pytest.raises(moe.MoEArgumentError, match="set_weights: w_down must be bf16"):
        layer.set_weights(w_down=cupy.zeros((layer.local_experts, FFN, HIDDEN), dtype=_bf16()))
    with pytest.raises(moe.MoEArgumentError, match="w_gate and w_up go together"):
        layer.set_weights(w_gate=cupy.zeros((layer.local_experts, FFN, HIDDEN), dtype=_bf16()))
    # nothing was left half done: the next call runs and is right
    problems = _Problems()
    _layer_round(world, moe_layer, rng, 33, 2, problems=problems, what="after the errors")
    problems.assert_none()
