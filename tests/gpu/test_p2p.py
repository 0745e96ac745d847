"""Peer put + signal + wait across ranks, every put mode, against numpy; bf16 end to end; NVSHMEM device API."""
import numpy as np
import pytest

import fluxrt
from fluxrt import p2p

pytestmark = pytest.mark.multirank

POISON = 0xA5
SIZES = [4, 7, 1000, 4099, 65536 + 13, 1 << 20, 12_345_679, 256 << 20]


def _payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@pytest.fixture(scope="module")
def bufs(world):
    import cupy

    dst = world.empty((max(SIZES) + 64,), np.uint8)
    pad = world.signal_pad(4)
    src = cupy.empty(max(SIZES), np.uint8)
    return dst, pad, src


@pytest.fixture(scope="module")
def get_bufs(world):
    import cupy

    src = world.empty((max(SIZES),), np.uint8)  # pulled from: must be symmetric
    pad = world.signal_pad(1)
    dst = cupy.empty(max(SIZES) + 64, np.uint8)
    return dst, pad, src


@pytest.mark.parametrize("mode", p2p.PUT_MODES)
@pytest.mark.parametrize("nbytes", SIZES)
def test_put_signal_wait_ring(world, bufs, mode, nbytes):
    import cupy

    dst, pad, src = bufs
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    seed = 1000 * nbytes + world.rank
    src[:nbytes].set(_payload(seed, nbytes))
    dst.fill(POISON)
    stream = cupy.cuda.Stream(non_blocking=True)
    epoch = pad.next_epoch()
    world.synchronize()
    world.barrier(stream)  # every rank's poison is in place before anyone writes into it
    flag = pad.local_ptr(0) if mode == "nvshmem" else pad.peer_ptr(right, 0)
    try:
        p2p.put(world, dst[:nbytes], src[:nbytes], right, mode=mode, stream=stream, flag_ptr=flag,
                flag_value=epoch)
        pad.wait(0, epoch, peer=left, op=f"test_put[{mode}]", stream=stream)
        world.synchronize(stream)
        expected = _payload(1000 * nbytes + left, nbytes)
        sm_wrong = int((dst[:nbytes] != cupy.asarray(expected)).sum())  # read by SMs, before the CE copy
        got = cupy.asnumpy(dst[: nbytes + 64])
    finally:
        world.comm.Barrier()  # nobody re-poisons before everyone has read, even after a failure here
    bad = np.flatnonzero(got[:nbytes] != expected)
    if bad.size:  # tell late data (ordering) from lost data (overwritten by the poison)
        import time

        time.sleep(0.2)
        later = int(np.count_nonzero(cupy.asnumpy(dst[:nbytes]) != expected))
    assert bad.size == 0, (f"{bad.size} wrong bytes from rank {left}, first at {bad[:5]}, "
                           f"{int(np.count_nonzero(got[bad] == POISON))} of them still poison; flag "
                           f"{int(pad.flags.get()[0])}, epoch {epoch}; SM read {sm_wrong} wrong; 0.2 s later {later} wrong")
    assert np.all(got[nbytes:] == POISON), "put wrote past its end"


@pytest.mark.parametrize("mode", p2p.GET_MODES)
@pytest.mark.parametrize("nbytes", SIZES)
def test_ready_signal_then_get_ring(world, get_bufs, mode, nbytes):
    """Owner writes its buffer and signals 'ready' to the rank that pulls from it; that rank waits,
    then pulls (copy engine or NVSHMEM get) into poisoned local memory."""
    import cupy

    dst, pad, src = get_bufs
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    stream = cupy.cuda.Stream(non_blocking=True)
    epoch = pad.next_epoch()
    try:
        src[:nbytes].set(_payload(7 * nbytes + world.rank, nbytes), stream=stream)
        dst.fill(POISON)
        world.synchronize()
        pad.signal(left, 0, epoch, stream=stream)      # my buffer is ready for the rank on my left
        pad.wait(0, epoch, peer=right, op=f"test_get[{mode}]", stream=stream)
        p2p.get(world, dst[:nbytes], src[:nbytes], right, mode=mode, stream=stream)
        world.synchronize(stream)
        got = cupy.asnumpy(dst[: nbytes + 64])
    finally:
        world.comm.Barrier()  # nobody rewrites its buffer before every pull is done
    bad = np.flatnonzero(got[:nbytes] != _payload(7 * nbytes + right, nbytes))
    assert bad.size == 0, f"{bad.size} wrong bytes pulled from rank {right}, first at {bad[:5]}"
    assert np.all(got[nbytes:] == POISON), "get wrote past its end"


def test_copy_engine_put_is_refused(world, bufs):
    dst, _pad, src = bufs
    with pytest.raises(ValueError, match="pulls"):
        p2p.put(world, dst[:16], src[:16], (world.rank + 1) % world.size, mode="copy_engine")


def test_signal_add_accumulates(world):
    import cupy

    pad = world.signal_pad(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    base = pad.next_epoch(world.size)  # every rank adds 1 to every other rank's slot
    world.barrier(stream)
    for r in range(world.size):
        pad.signal(r, 0, 1, add=True, stream=stream)
    pad.wait(0, base, op="test_signal_add", stream=stream)
    world.synchronize(stream)
    assert int(pad.flags.get()[0]) == world.size
    world.barrier(stream)
    world.synchronize(stream)
    pad.free()


def test_bf16_end_to_end(world, rng):
    import cupy

    n = 4097
    x = world.empty((n,), "bf16")
    assert x.dtype == fluxrt.bfloat16
    host = rng.standard_normal(n).astype(fluxrt.bfloat16)
    x[...] = cupy.asarray(host)
    # arithmetic in bf16 on the device matches numpy on the same bf16 values
    y = cupy.asnumpy(x * 2).astype(np.float64)
    np.testing.assert_array_equal(y, host.astype(np.float64) * 2)
    # DLPack round trip keeps the dtype and the memory
    z = cupy.from_dlpack(x)
    assert z.dtype == fluxrt.bfloat16 and z.data.ptr == x.data.ptr
    # peer view of a bf16 symmetric array reads the right rank's values
    world.synchronize()
    world.comm.Barrier()
    right = (world.rank + 1) % world.size
    theirs = cupy.asnumpy(x.peer(right))
    expect = world.comm.sendrecv(host, dest=(world.rank - 1) % world.size, source=right)
    np.testing.assert_array_equal(theirs.view(np.uint16), expect.view(np.uint16))
    world.comm.Barrier()
    world.free(x)


def test_views_stay_symmetric_and_results_do_not(world):
    x = world.zeros((64, 8), np.float32)
    sub = x[3:9, 2:]
    right = (world.rank + 1) % world.size
    assert sub.peer_ptr(right) - x.peer_ptr(right) == sub.data.ptr - x.data.ptr
    with pytest.raises(fluxrt.NotSymmetricError):
        (x + 1).peer(right)
    world.free(x)


def test_nvshmem_device_api_put_signal(world, rng):
    import cupy

    from fluxrt.errors import op_id
    from fluxrt.toolchain import load_nvshmem_module

    mod = load_nvshmem_module("comm/nvshmem_p2p.cu")
    put_signal = mod.get_function("fluxrt_nvshmem_put_signal")
    wait = mod.get_function("fluxrt_nvshmem_wait")
    n = 3 * 1024 * 1024 + 5
    dst = world.empty((n,), np.uint8)
    sig = world.signal_pad(1)
    src = cupy.asarray(_payload(77 + world.rank, n))
    dst.fill(POISON)
    world.synchronize()
    world.comm.Barrier()
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    epoch = sig.next_epoch()
    u64 = np.uint64
    put_signal((1,), (256,), (u64(dst.data.ptr), u64(src.data.ptr), u64(n), u64(sig.local_ptr(0)), u64(epoch),
                              np.int32(right)))
    wait((1,), (32,), (u64(sig.local_ptr(0)), u64(epoch), u64(world.timeout_ns), u64(world.error_record),
                       np.uint32(op_id("test_nvshmem_put_signal")), np.uint32(world.rank), u64(left)))
    world.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dst), _payload(77 + left, n))
    world.comm.Barrier()
    sig.free()
    world.free(dst)
