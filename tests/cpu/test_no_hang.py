"""No hang on error paths (CPU): bounded argument agreement under mpiexec, abort-instead-of-finalize when
`with fluxrt.init()` exits with an exception, fluxrt-run's abort on an uncaught exception and its
signal forwarding, one-line CLI errors."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fluxrt import fatal, launch, world as world_mod
from fluxrt.errors import AgreementTimeoutError, DeviceError, FluxrtError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
MPIEXEC = shutil.which("mpiexec") or shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FLUXRT_DEBUG", None)
    return env


def _two_ranks(script: str) -> str:
    """Run mpi_scripts/`script` on 2 ranks; its stdout, once it exited 0."""
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(SCRIPTS / script)], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# --- (a) bounded agreement -------------------------------------------------------------------------
@needs_mpi
def test_agreement_times_out_naming_the_rank_that_skipped():
    stdout = _two_ranks("agree_skip.py")
    assert "rank 0: allgather: rank 0 waited 1.5 s for rank(s) [1]" in stdout
    assert "rank 0: OK" in stdout and "rank 1: OK" in stdout


@needs_mpi
def test_meet_after_load_waits_for_a_loading_peer_and_stays_bounded():
    stdout = _two_ranks("meet_after_load.py")
    assert "rank 0: waited" in stdout
    assert "rank 0: first call of the fp64 kernels: rank 0 waited 6 s for rank(s) [1]" in stdout
    assert "rank 0: OK" in stdout and "rank 1: OK" in stdout


def test_agreement_single_rank_needs_no_mpi_exchange():
    from fluxrt import agreement

    w = SimpleNamespace(comm=None, rank=0, size=1, options=SimpleNamespace(timeout_s=1, check_collective_args=True))
    assert agreement.agree(w, "allreduce", (("count", 1),), None, extra=7) == [7]


def test_agreement_timeout_error_text():
    e = AgreementTimeoutError("allreduce", 0, [2, 3], 30)
    assert isinstance(e, FluxrtError) and isinstance(e, TimeoutError)
    assert "rank(s) [2, 3]" in str(e) and "allreduce" in str(e) and e.missing == [2, 3]


# --- (b) an exception inside `with fluxrt.init()` ----------------------------------------------------
class _FakeComm:
    def __init__(self):
        self.aborted = None

    def Abort(self, code):
        self.aborted = code


def _fake_world(size=2, abort_on_error=True):
    w = SimpleNamespace(rank=1, size=size, comm=_FakeComm(), finalized=0,
                        options=world_mod.WorldOptions(abort_on_error=abort_on_error))
    w.finalize = lambda: setattr(w, "finalized", w.finalized + 1)
    return w


def _exit(w, exc):
    try:
        raise exc
    except BaseException as e:
        world_mod.World.__exit__(w, type(e), e, e.__traceback__)


def test_exit_without_error_finalizes():
    w = _fake_world()
    world_mod.World.__exit__(w, None, None, None)
    assert w.finalized == 1 and w.comm.aborted is None


def test_exit_with_error_aborts_instead_of_finalizing(capsys, caplog):
    w = _fake_world()
    _exit(w, ValueError("boom"))
    assert w.comm.aborted == 1 and w.finalized == 0
    err = capsys.readouterr().err + caplog.text   # logged once: to logging when configured, else stderr
    assert err.count("ValueError: boom") == 1 and "MPI_Abort" in err and "rank 1/2" in err


def test_exit_decisions():
    w = _fake_world()
    assert world_mod.exit_action(w, None, None) == "finalize"
    assert world_mod.exit_action(w, SystemExit, SystemExit(0)) == "finalize"
    assert world_mod.exit_action(w, SystemExit, SystemExit(3)) == "abort"
    assert world_mod.exit_action(w, KeyboardInterrupt, KeyboardInterrupt()) == "abort"
    assert world_mod.exit_action(_fake_world(size=1), ValueError, ValueError()) == "finalize"
    assert world_mod.exit_action(_fake_world(abort_on_error=False), ValueError, ValueError()) == "finalize"
    w = _fake_world()
    _exit(w, SystemExit(3))
    assert w.comm.aborted == 3


def test_abort_on_error_from_env(monkeypatch):
    monkeypatch.setenv("FLUXRT_ABORT_ON_ERROR", "0")
    assert world_mod.WorldOptions().abort_on_error is False
    monkeypatch.delenv("FLUXRT_ABORT_ON_ERROR")
    assert world_mod.WorldOptions().abort_on_error is True


# --- (c) fluxrt-run -----------------------------------------------------------------------------------
def _run_cmd(*prog):
    return [sys.executable, "-m", "fluxrt.launch", "-n", "2", "--mpirun", MPIEXEC, "--mpi-flavor", "mpich",
            "--", sys.executable, *prog]


@needs_mpi
def test_fluxrt_run_ends_the_job_when_a_rank_raises(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run(_run_cmd(str(SCRIPTS / "rank1_raises.py"), str(tmp_path), "raise"), env=_env(),
                         capture_output=True, text=True, timeout=90)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "rank 1 fails on purpose" in out.stderr
    assert "barrier passed" not in out.stdout
    assert time.monotonic() - t0 < 60


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


@needs_mpi
def test_fluxrt_run_forwards_sigint_and_leaves_no_orphans(tmp_path):
    proc = subprocess.Popen(_run_cmd(str(SCRIPTS / "rank1_raises.py"), str(tmp_path), "sleep"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "ranks outlived fluxrt-run"


def test_run_returns_the_launchers_status():
    assert launch.run([sys.executable, "-c", "raise SystemExit(7)"], dict(os.environ)) == 7
    assert launch.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                      dict(os.environ)) == 128 + signal.SIGTERM


def test_python_commands_run_under_the_mpi4py_runner():
    w = launch.with_mpi4py_runner
    assert w(["python", "a.py", "x"]) == ["python", "-m", "mpi4py", "a.py", "x"]
    assert w(["/v/bin/python3", "-u", "-m", "pkg", "-n"]) == ["/v/bin/python3", "-u", "-m", "mpi4py", "-m", "pkg", "-n"]
    assert w(["python3.12", "-X", "dev", "-c", "pass"]) == ["python3.12", "-X", "dev", "-m", "mpi4py", "-c", "pass"]
    assert w(["fluxrt-perf", "p2p"]) == ["fluxrt-perf", "p2p"]
    assert w(["python", "-m", "mpi4py", "a.py"]) == ["python", "-m", "mpi4py", "a.py"]
    assert w(["python", "-V"]) == ["python", "-V"]
    args = launch.parser().parse_args(["-n", "2", "--mpirun", "/x/mpiexec", "--mpi-flavor", "mpich",
                                       "--no-abort-on-exception", "--", "python", "a.py"])
    p = launch.build(args, base_env={"PATH": "/usr/bin"})
    assert "mpi4py" not in p.argv and "FLUXRT_ABORT_ON_EXCEPTION" not in p.env
    args = launch.parser().parse_args(["-n", "2", "--mpirun", "/x/mpiexec", "--mpi-flavor", "mpich", "--", "app"])
    assert launch.build(args, base_env={"PATH": "/usr/bin"}).env["FLUXRT_ABORT_ON_EXCEPTION"] == "1"


def test_excepthook_installed_from_env_aborts_multi_rank_jobs(monkeypatch):
    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: calls.append("previous"))
    assert fatal.install_abort_excepthook({"FLUXRT_ABORT_ON_EXCEPTION": "0"}) is False
    assert fatal.install_abort_excepthook({"FLUXRT_ABORT_ON_EXCEPTION": "1"}) is True
    comm = SimpleNamespace(Get_size=lambda: 2, Get_rank=lambda: 1, Abort=lambda code: calls.append(("abort", code)))
    monkeypatch.setattr(fatal, "_mpi_world", lambda: comm)
    sys.excepthook(ValueError, ValueError("x"), None)
    assert calls == ["previous", ("abort", 1)]


# --- (d) one-line CLI errors ----------------------------------------------------------------------------
def test_describe_maps_errors_to_remedies():
    assert "pip install 'fluxrt[mpich]'" in fatal.describe(RuntimeError("cannot load MPI library"))
    gpu = fatal.describe(RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
                                      "runtime version"))
    assert gpu.startswith("no CUDA GPU/driver found")
    assert fatal.describe(DeviceError("rank 0: no GPU")) == "DeviceError: rank 0: no GPU"
    assert fatal.describe(ValueError("a bug")) is None


def test_one_line_errors_wrapper(capsys):
    @fatal.one_line_errors("prog")
    def main(exc):
        raise exc

    assert main(FluxrtError("bad\nsecond line")) == 1
    err = capsys.readouterr().err
    assert err == "prog: error: FluxrtError: bad [1 more line(s): FLUXRT_DEBUG=DEBUG shows them]\n"
    assert main(KeyboardInterrupt()) == 130
    with pytest.raises(ZeroDivisionError):
        main(ZeroDivisionError())


@pytest.mark.parametrize("argv", [["-m", "fluxrt.toolchain", "--arch", "sm_10"], ["-m", "fluxrt.gemm", "cache", "path"]])
def test_clis_report_errors_in_one_line(argv):
    """A compile error, and (on a CPU-only machine) the missing GPU, end with one line, not a traceback."""
    out = subprocess.run([sys.executable, *argv], env=_env(), capture_output=True, text=True, timeout=300)
    if out.returncode == 0:
        pytest.skip("this machine has what the command needs")
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and ": error: " in out.stderr, out.stderr


def test_fluxrt_perf_missing_mpi_is_one_line(tmp_path):
    # a stand-in mpi4py whose MPI module cannot load its library, as on a machine with no MPI
    pkg = tmp_path / "mpi4py"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "MPI.py").write_text("raise RuntimeError('cannot load MPI library')\n")
    env = _env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    out = subprocess.run([sys.executable, "-m", "fluxrt.perf.cli", "p2p"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "fluxrt-perf: error: no MPI library could be loaded: install an MPI: pip install 'fluxrt[mpich]'" in out.stderr


def test_launcher_escalates_when_the_job_outlives_the_grace_period():
    """A job that ignores the forwarded SIGINT gets SIGTERM once grace_s has passed, not when it ends."""
    import os
    import signal
    import sys
    import threading
    import time

    from fluxrt import launch

    child = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(20)"]
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    rc = launch.run(child, dict(os.environ), grace_s=1.0)
    assert time.monotonic() - t0 < 10
    assert rc == 128 + signal.SIGTERM
