"""Observability on CPU: FLUXRT_DEBUG logging (levels, per-rank files, what the planners log), NVTX ranges
(off: the functions themselves; on: push/pop around the call), python -m fluxrt.info."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fluxrt import collectives_plan as plan
from fluxrt import log as flog
from fluxrt import nvtx

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLUXRT_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture
def restore_logger():
    logger = logging.getLogger("fluxrt")
    saved = (list(logger.handlers), logger.level, logger.propagate, dict(flog._state), flog._handler)
    yield
    for h in logger.handlers:
        if h not in saved[0]:
            logger.removeHandler(h)
            h.close()
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    flog._state.update(saved[3])
    flog._handler = saved[4]


def test_levels_and_rank_from_the_launcher():
    assert flog.level_from_env({}) is None
    assert flog.level_from_env({"FLUXRT_DEBUG": "warn"}) == logging.WARNING
    assert flog.level_from_env({"FLUXRT_DEBUG": "INFO"}) == logging.INFO
    assert flog.level_from_env({"FLUXRT_DEBUG": "TRACE"}) == flog.TRACE < logging.DEBUG
    assert logging.getLevelName(flog.TRACE) == "TRACE"
    assert flog.env_rank({"PMI_RANK": "3"}) == 3
    assert flog.env_rank({"OMPI_COMM_WORLD_RANK": "5", "PMI_RANK": "3"}) == 5
    assert flog.env_rank({}) is None
    assert flog.file_name("/tmp/fluxrt.%r.log", 2) == "/tmp/fluxrt.2.log"
    assert flog.file_name("a%%r-%r", None) == "a%r-?"
    assert str(os.getpid()) in flog.file_name("x.%p", 0)


def test_debug_file_per_rank_and_rank_update(tmp_path, restore_logger):
    pattern = str(tmp_path / "dbg.%r.log")
    env = {"FLUXRT_DEBUG": "INFO", "FLUXRT_DEBUG_FILE": pattern, "PMI_RANK": "1"}
    flog._state["rank"] = None
    assert flog.configure(env) is not None
    logging.getLogger("fluxrt.collectives").info("hello %d", 1)
    logging.getLogger("fluxrt.collectives").debug("not at INFO")
    text = (tmp_path / "dbg.1.log").read_text()
    assert "hello 1" in text and "rank 1" in text and "not at INFO" not in text
    flog.configure(env, rank=4)           # fluxrt.init: the communicator's rank names the file
    logging.getLogger("fluxrt").warning("from rank 4")
    assert "from rank 4" in (tmp_path / "dbg.4.log").read_text()


def test_choose_algo_logs_its_choice_at_info(restore_logger, caplog):
    logging.getLogger("fluxrt").propagate = True
    with caplog.at_level(logging.INFO, logger="fluxrt"):
        algo = plan.choose_algo("allreduce", 1 << 20, 4)
    assert f"allreduce: {1 << 20} bytes on 4 ranks" in caplog.text and f"-> algo {algo} (auto" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fluxrt"):
        plan.choose_algo("allreduce", 1 << 20, 4)
    assert caplog.text == ""


def test_fluxrt_debug_at_import_logs_to_stderr():
    code = ("import fluxrt, logging; from fluxrt import collectives_plan as p; p.choose_algo('allgather', 4096, 8);"
            "from fluxrt import log; log.trace(logging.getLogger('fluxrt.x'), 'traced')")
    out = subprocess.run([sys.executable, "-c", code], env=_env(FLUXRT_DEBUG="TRACE", PMI_RANK="2"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 2] INFO fluxrt.collectives: allgather: 4096 bytes on 8 ranks" in out.stderr
    assert "TRACE fluxrt.x: traced" in out.stderr
    quiet = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert quiet.stderr == ""


# --- NVTX ---------------------------------------------------------------------------------------------
def test_nvtx_off_returns_the_function_itself():
    def f(x):
        return x + 1

    assert nvtx.annotate("f", enabled=False)(f) is f
    if not nvtx.ENABLED:
        import fluxrt
        from fluxrt import p2p
        from fluxrt.gemm import launch

        assert not hasattr(fluxrt.Collectives.allreduce, "__wrapped_nvtx__")
        assert not hasattr(launch.gemm, "__wrapped_nvtx__") and not hasattr(p2p.put, "__wrapped_nvtx__")


def test_nvtx_on_pushes_and_pops_around_the_call(monkeypatch):
    events = []
    monkeypatch.setattr(nvtx, "_backend", (lambda name: events.append(("push", name)), lambda: events.append("pop")))

    @nvtx.annotate("op", enabled=True)
    def f(x):
        events.append("body")
        if x:
            raise ValueError
        return 3

    assert f(0) == 3 and f.__name__ == "f"
    with pytest.raises(ValueError):
        f(1)
    assert events == [("push", "fluxrt.op"), "body", "pop", ("push", "fluxrt.op"), "body", "pop"]
    with nvtx.range("step", enabled=True):
        pass
    assert events[-2:] == [("push", "step"), "pop"]


def test_nvtx_on_wraps_public_entry_points_without_importing_cuda():
    code = ("import sys, fluxrt; from fluxrt import p2p; from fluxrt.gemm import launch; from fluxrt.ops import AllGatherGemm as AgGemm, GemmReduceScatter as GemmRS;"
            "names = [f.__wrapped_nvtx__ for f in (fluxrt.Collectives.allreduce, fluxrt.Collectives.alltoallv,"
            " fluxrt.Collectives.broadcast, launch.gemm, p2p.put, p2p.get, AgGemm.forward, GemmRS.forward,"
            " fluxrt.World.barrier)];"
            "print(' '.join(names)); print(sorted(m for m in sys.modules if m.startswith(('cupy', 'cuda', 'nvshmem'))))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(FLUXRT_NVTX="1"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    names, mods = out.stdout.splitlines()
    assert names.split() == ["fluxrt.allreduce", "fluxrt.alltoallv", "fluxrt.broadcast", "fluxrt.gemm", "fluxrt.put",
                             "fluxrt.get", "fluxrt.ag_gemm.forward", "fluxrt.gemm_rs.forward", "fluxrt.world.barrier"]
    assert mods == "[]"


# --- python -m fluxrt.info ------------------------------------------------------------------------------
def test_info_prints_what_it_can_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "fluxrt.info"], env=_env(NVSHMEM_SYMMETRIC_SIZE="2G"),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    text = out.stdout
    for needle in ("fluxrt", "python", "numpy", "mpi4py", "MPI library", "CUDA runtime", "GPUs",
                   "nvidia-smi", "NVSHMEM_SYMMETRIC_SIZE  2G", "kernel cache", "GEMM autotune dir"):
        assert needle in text, needle
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if not has_gpu:
        assert "no CUDA device" in text


@pytest.mark.parametrize("value,default,expected", [(None, False, False), (None, True, True), ("", True, True),
                                                    ("1", False, True), ("yes", False, True), ("0", True, False),
                                                    ("Off", True, False), ("false", True, False)])
def test_env_flag_reads_every_switch_one_way(value, default, expected):
    from fluxrt.env import env_flag

    env = {} if value is None else {"FLUXRT_X": value}
    assert env_flag("FLUXRT_X", default, env) is expected
