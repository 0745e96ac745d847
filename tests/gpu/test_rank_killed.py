"""A rank killed with SIGKILL in the middle of a collective and of a fused op: the other ranks raise within
the wait bound, naming it, and the job ends.

Each case starts an MPI job of its own (``fluxrt-run``), so this file runs in ONE process, not under mpirun:
`python -m pytest tests/gpu/test_rank_killed.py` on a node with 2+ GPUs (ranks = GPUs, at most 4), or with
FLUXRT_TEST_DEVICE=0 and the CUDA MPS daemon running (launch/mps-check.sh), 2 ranks on one GPU.

A launcher ends the whole job by itself once a rank dies from a signal (Open MPI and MPICH both do), which
would hide what the survivors do. So each rank runs under `sh`, which turns the victim's death into a
non-zero exit status, and the launcher is told to keep the job going on such an exit: the survivors' own
abort (``with fluxrt.init()`` calls MPI_Abort on the error) is then what ends the job."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GPUS, RANKS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "rank_killed.py"
TIMEOUT_S = 3.0          # the world's wait bound in the job
SLACK_S = 20.0           # start-up of the survivors' error path, the abort, ranks sharing one GPU under MPS
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
ON_ONE_GPU = os.environ.get("FLUXRT_TEST_DEVICE") is not None
NRANKS = 2 if ON_ONE_GPU else min(max(GPUS, 2), 4)

pytestmark = [
    pytest.mark.skipif(RANKS > 1, reason="starts MPI jobs of its own: run this file in one process, not under mpirun"),
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun/mpiexec on PATH"),
    pytest.mark.skipif(GPUS < 2 and not ON_ONE_GPU,
                       reason="needs 2 GPUs, or FLUXRT_TEST_DEVICE=0 with the CUDA MPS daemon (launch/mps-check.sh)"),
]


def _keep_going_args() -> list[str]:
    """mpirun arguments that keep the job running when a rank exits with a non-zero status."""
    from fluxrt.launch import _flavor

    if _flavor(MPIRUN) == "openmpi":
        return ["--mpi-args=--mca", "--mpi-args=orte_abort_on_non_zero_status", "--mpi-args=0"]
    return ["--mpi-args=-disable-auto-cleanup"]


@pytest.mark.parametrize("what", ["collective", "fused"])
def test_a_killed_rank_makes_the_others_raise_within_the_bound_and_ends_the_job(tmp_path, what):
    # os.environ is the environment this process started with (an MPI singleton's own settings are not in
    # it), and it keeps the site's launcher settings (e.g. OMPI_MCA_plm_rsh_agent on a node without ssh)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               FLUXRT_KILL_TEST_TIMEOUT_S=str(TIMEOUT_S))
    rank_cmd = ["sh", "-c", '"$0" -m mpi4py "$@"; exit $?', sys.executable, str(SCRIPT), str(tmp_path), what]
    cmd = [sys.executable, "-m", "fluxrt.launch", "-n", str(NRANKS), "--oversubscribe", *_keep_going_args(),
           "--", *rank_cmd]
    t0 = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    ended = time.time()
    log = f"rc={out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-6000:]}"
    victim = NRANKS - 1
    vpath = tmp_path / f"rank{victim}.json"
    assert vpath.is_file(), "the victim never reached its kill:\n" + log
    killed_at = json.loads(vpath.read_text())["killed_at"]
    assert out.returncode != 0, log
    assert ended - killed_at < TIMEOUT_S + SLACK_S, f"the job outlived the kill by {ended - killed_at:.1f} s\n" + log
    for r in range(victim):
        path = tmp_path / f"rank{r}.json"
        assert path.is_file(), f"rank {r} was ended before it raised:\n" + log
        rec = json.loads(path.read_text())
        assert rec["error"] in ("WaitTimeoutError", "AgreementTimeoutError"), f"rank {r}: {rec}\n" + log
        named = rec["peer"] if rec["error"] == "WaitTimeoutError" else rec["missing"]
        assert named == victim or (isinstance(named, list) and victim in named), f"rank {r}: {rec}"
        assert rec["raised_at"] - killed_at < TIMEOUT_S + SLACK_S, f"rank {r}: {rec}, killed at {killed_at}"
        if rec["error"] == "WaitTimeoutError":
            assert rec["sticky"], f"rank {r}: the next call did not raise the recorded error again: {rec}"
    print(f"{what}: ranks ended {ended - killed_at:.1f} s after the kill (bound {TIMEOUT_S} s); "
          f"job {ended - t0:.1f} s in all")
