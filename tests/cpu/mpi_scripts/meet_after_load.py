"""2 ranks: meet_after_load outlasts the world's timeout for a peer that is still loading (compiling), and
still raises, naming the peer, when that peer never arrives."""
import os
import sys
import time
from types import SimpleNamespace

from mpi4py import MPI

from fluxrt import agreement
from fluxrt.errors import AgreementTimeoutError

os.environ["FLUXRT_LOAD_WAIT_S"] = "6"
comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
world = SimpleNamespace(comm=comm, rank=rank, size=comm.Get_size(),
                        options=SimpleNamespace(timeout_s=1.0, check_collective_args=True))
assert agreement.load_wait_s(world) == 6.0
# 1. rank 1 "compiles" for 3 s, three times the world's timeout: rank 0 waits for it without raising
t0 = time.monotonic()
if rank == 1:
    time.sleep(3.0)
agreement.meet_after_load(world, "first call")
if rank == 0:
    took = time.monotonic() - t0
    assert took > 2.5, took
    print(f"rank 0: waited {took:.1f} s", flush=True)
comm.Barrier()
# 2. rank 1 never arrives: rank 0 raises within the load bound, naming it
if rank == 0:
    t0 = time.monotonic()
    try:
        agreement.meet_after_load(world, "first call of the fp64 kernels")
        raise SystemExit("no timeout raised")
    except AgreementTimeoutError as e:
        took = time.monotonic() - t0
        assert e.missing == [1] and 5.5 < took < 20, (e, took)
        print(f"rank 0: {e}", flush=True)
print(f"rank {rank}: OK", flush=True)
sys.stdout.flush()
