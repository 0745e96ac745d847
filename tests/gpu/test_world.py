"""World lifecycle on GPUs: repeated init/finalize, sub-communicators, allocation churn and errors,
and the bounded-wait timeout path. Each test boots and tears down its own world."""
import os
import time

import numpy as np
import pytest

import fluxrt

pytestmark = pytest.mark.multirank
DEV = int(os.environ["FLUXRT_TEST_DEVICE"]) if os.environ.get("FLUXRT_TEST_DEVICE") else None   # see conftest


def test_repeated_init_finalize():
    from mpi4py import MPI

    for i in range(3):
        with fluxrt.init(device=DEV) as world:
            assert (world.rank, world.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
            x = world.zeros((1000 + i,), np.float32)
            world.barrier()
            world.synchronize()
        assert not world.active
        with pytest.raises(fluxrt.NvshmemInitError):
            world.empty((4,), np.float32)


def test_second_init_in_process_refused():
    with fluxrt.init(device=DEV) as world:
        with pytest.raises(fluxrt.NvshmemInitError, match="already active"):
            fluxrt.init(device=DEV)
        world.synchronize()


def test_sub_communicators_side_by_side():
    import cupy
    from mpi4py import MPI

    from fluxrt import p2p

    comm = MPI.COMM_WORLD
    half = comm.Split(color=comm.Get_rank() % 2, key=comm.Get_rank())
    with fluxrt.init(half, device=DEV) as world:
        assert world.size == half.Get_size()
        pad = world.signal_pad(1)
        dst = world.empty((4096,), np.int32)
        src = cupy.arange(4096, dtype=np.int32) + 100000 * comm.Get_rank()
        right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
        epoch = pad.next_epoch()
        world.barrier()
        p2p.put(world, dst, src, right, mode="sm", flag_ptr=pad.peer_ptr(right, 0), flag_value=epoch)
        pad.wait(0, epoch, peer=left)
        world.synchronize()
        sender_global = half.allgather(comm.Get_rank())[left]
        np.testing.assert_array_equal(cupy.asnumpy(dst), np.arange(4096, dtype=np.int32) + 100000 * sender_global)
        world.barrier()
        world.synchronize()
    half.Free()


def test_alloc_free_churn_and_errors():
    rng = np.random.default_rng(1234)  # same sequence on every rank
    with fluxrt.init(device=DEV, options=fluxrt.WorldOptions(heap_size="1G")) as world:
        base = world.heap.used
        live = []
        for _ in range(200):
            if live and rng.random() < 0.5:
                world.free(live.pop(int(rng.integers(len(live)))))
            else:
                dtype = [np.float32, np.uint8, fluxrt.bfloat16, np.int64][int(rng.integers(4))]
                live.append(world.empty((int(rng.integers(1, 1 << 18)),), dtype))
        for a in live:
            world.free(a)
        assert world.heap.used == base

        with pytest.raises(fluxrt.CollectiveMismatchError, match="differs across ranks"):
            world.empty((100 + world.rank,), np.float32)
        with pytest.raises(fluxrt.CollectiveMismatchError):
            world.empty((100,), np.float32 if world.rank == 0 else np.float16)
        with pytest.raises(fluxrt.HeapExhaustedError, match="NVSHMEM_SYMMETRIC_SIZE"):
            world.empty((2 << 30,), np.uint8)
        # the world is still usable after refused allocations
        x = world.zeros((10,), np.float32)
        world.barrier()
        world.synchronize()
        world.free(x)


def test_wait_timeout_names_op_rank_and_peer():
    with fluxrt.init(device=DEV, options=fluxrt.WorldOptions(timeout_s=0.5)) as world:
        pad = world.signal_pad(1)
        epoch = pad.next_epoch()
        if world.rank == 0:
            t0 = time.monotonic()
            pad.wait(0, epoch, peer=1, op="test_silent_peer")
            with pytest.raises(fluxrt.WaitTimeoutError) as info:
                world.synchronize()
            elapsed = time.monotonic() - t0
            err = info.value
            assert (err.op, err.rank, err.peer) == ("test_silent_peer", 0, 1)
            assert "rank 0" in str(err) and "peer 1" in str(err)
            assert 0.5 <= elapsed < 5.0, elapsed
            with pytest.raises(fluxrt.WaitTimeoutError):   # sticky: every later call raises it
                world.barrier()
            world.reset_error()
        world.comm.Barrier()  # rank 1 never signalled; everyone meets again on the host
        world.barrier()
        world.synchronize()


def test_layers_state_lives_in_the_registry_and_goes_with_finalize():
    import cupy

    from fluxrt import collectives, p2p, signals

    with fluxrt.init(device=DEV) as world:
        assert "fluxrt.signals" in world.registry          # the barrier pad, made by init
        ctx = collectives.context(world)
        assert world.registry.get("fluxrt.collectives") is ctx and collectives.context(world) is ctx
        assert p2p.state(world) is p2p.state(world)
        out = fluxrt.allreduce(world, cupy.ones(1000, dtype=np.float32))
        world.synchronize()
        assert float(out[0]) == world.size
    assert len(world.registry) == 0 and ctx._freed
    with pytest.raises(fluxrt.FluxrtError, match="finalized"):
        signals.state(world)
