"""2 ranks: rank 1 skips an agreement exchange; rank 0 must raise AgreementTimeoutError naming rank 1."""
import sys
import time
from types import SimpleNamespace

from mpi4py import MPI

from fluxrt import agreement
from fluxrt.errors import AgreementTimeoutError, CollectiveMismatchError, FluxrtError

comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
world = SimpleNamespace(comm=comm, rank=rank, size=comm.Get_size(),
                        options=SimpleNamespace(timeout_s=1.5, check_collective_args=True))
# 1. an agreed call on both ranks
out = agreement.agree(world, "allreduce", (("count", 8),), None, extra=rank)
assert out == [0, 1], out
# 2. different arguments: both ranks raise the mismatch
try:
    agreement.agree(world, "allreduce", (("count", 8 + rank),), None)
    raise SystemExit("no mismatch raised")
except CollectiveMismatchError as e:
    assert "ranks [0]" in str(e) and "ranks [1]" in str(e), e
comm.Barrier()
# 3. rank 1 skips the call
if rank == 0:
    t0 = time.monotonic()
    try:
        agreement.agree(world, "allgather", (("count", 4),), None)
        raise SystemExit("no timeout raised")
    except AgreementTimeoutError as e:
        took = time.monotonic() - t0
        assert e.missing == [1] and e.op == "allgather" and 1.4 < took < 10, (e, took)
        print(f"rank 0: {e}", flush=True)
    try:   # the world is out of step: later exchanges fail at once
        agreement.agree(world, "allreduce", (("count", 4),), None)
        raise SystemExit("no error after the timeout")
    except FluxrtError as e:
        assert "out of step" in str(e), e
print(f"rank {rank}: OK", flush=True)
sys.stdout.flush()
