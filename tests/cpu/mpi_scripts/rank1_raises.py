"""Rank 1 raises while rank 0 waits in a blocking collective that rank 1 never reaches."""
import os
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
pid_dir = sys.argv[1] if len(sys.argv) > 1 else None
if pid_dir:
    with open(os.path.join(pid_dir, f"rank{comm.Get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
mode = sys.argv[2] if len(sys.argv) > 2 else "raise"
if mode == "raise" and comm.Get_rank() == 1:
    time.sleep(0.2)
    raise RuntimeError("rank 1 fails on purpose")
if mode == "sleep":
    print(f"rank {comm.Get_rank()} ready", flush=True)
    while True:
        time.sleep(0.1)
comm.Barrier()
print("barrier passed", flush=True)
