"""The last rank is SIGKILLed in the middle of its calls (a collective, or a fused op); the other ranks must
raise within the world's wait bound, naming it, and then end the job (``with fluxrt.init()`` aborts it).

    python -m mpi4py rank_killed.py OUT_DIR collective|fused

Each rank writes OUT_DIR/rank<r>.json: the victim the time it was killed, the others what they raised and
when, and whether the next call raised the same error again (the error is sticky)."""
import json
import os
import signal
import sys
import time

import fluxrt
from fluxrt.ops import AllGatherGemm

out_dir, what = sys.argv[1], sys.argv[2]
timeout_s = float(os.environ.get("FLUXRT_KILL_TEST_TIMEOUT_S", "3"))
calls = 50
device = os.environ.get("FLUXRT_TEST_DEVICE")   # several ranks on one GPU under CUDA MPS


def note(rank: int, **record) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


# The cross-rank argument check is off, so a call on a survivor enqueues its kernels without waiting for
# the victim on the host: what ends the wait is the device bound (with the check on, the host-side
# agreement's own bound would raise AgreementTimeoutError first, which the test accepts too).
options = fluxrt.WorldOptions(heap_size="1G", timeout_s=timeout_s, check_collective_args=False)
with fluxrt.init(device=int(device) if device else None, options=options) as world:
    import cupy

    victim = world.size - 1
    if what == "collective":
        x = cupy.ones(1 << 22, dtype=cupy.float32)   # 16 MiB: a round of many blocks

        def call():
            return fluxrt.allreduce(world, x)
    else:
        m, n, k = 256 * world.size, 512, 512             # small: the GEMM's CTAs fit beside a peer's under MPS
        op = AllGatherGemm(world, m, n, k, "fp16")
        a = cupy.full((m // world.size, k), 0.01, dtype=cupy.float16)
        b = cupy.full((k, n), 0.01, dtype=cupy.float16)

        def call():
            return op.forward(a, b)

    call()
    world.synchronize()        # every kernel compiled and loaded, every rank through one call
    world.comm.Barrier()
    if world.rank == victim:
        for _ in range(calls // 2):
            call()
        # killed at once: its last calls are still running on the GPU, and the survivors' second half can
        # never complete, however fast the first half ran
        note(world.rank, killed_at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.time()
    try:
        for _ in range(calls):
            call()
        world.synchronize()
    except (fluxrt.WaitTimeoutError, fluxrt.AgreementTimeoutError) as e:
        record = {"error": type(e).__name__, "message": str(e), "raised_at": time.time(), "started": started,
                  "peer": getattr(e, "peer", None), "missing": getattr(e, "missing", None)}
        try:
            call()
            record["sticky"] = False
        except type(e):
            record["sticky"] = True
        note(world.rank, **record)
        raise
    note(world.rank, error=None, finished_at=time.time())
