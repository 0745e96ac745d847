"""``fluxrt-run``: start a fluxrt program on N ranks through mpirun (Open MPI or MPICH) or srun.

    fluxrt-run -n 4 -- python app.py --its-own-flags
    fluxrt-run -n 8 --launcher srun --heap 8G -- fluxrt-perf allreduce -b 8 -e 1G

It exports what every rank needs: NVLink multicast off (NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1: multicast objects can take a shared host's GPUs out of service),
unbuffered Python output, the symmetric heap size and wait bound when given, and passes through the
caller's PYTHONPATH and FLUXRT_* / NVSHMEM_* / NCCL_* / CUDA_* / CUPY_* / XLA_* settings (XLA's: the flags
and memory settings of JAX programs, docs/embedding.md). Ranks map to GPUs by local rank
inside ``fluxrt.init`` (one GPU per rank), so the launcher places ranks only.

CPU binding: none by default (``--bind-to none``). A rank is several busy threads (Python enqueueing
work, CUDA's and MPI's helpers); Open MPI binds each of 1 or 2 ranks to a single core by default, and on
a 2-rank run that stalled a rank's host thread for milliseconds (fused-op timings on 2 GPUs read 2-4x
too slow, and the peer waited). ``--bind-to core|socket|numa`` asks the launcher for that binding;
``--bind-to launcher`` leaves the launcher's own default.

Errors end the job: a Python command runs as ``python -m mpi4py ...`` (an uncaught exception on one rank
calls MPI_Abort instead of leaving its peers waiting), and FLUXRT_ABORT_ON_EXCEPTION=1 makes any program
that imports fluxrt do the same (``--no-abort-on-exception``: neither). SIGINT/SIGTERM/SIGHUP sent to
fluxrt-run are forwarded to the launcher, which ends the ranks; fluxrt-run returns its exit status.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from .fatal import one_line_errors

SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "PYTHONUNBUFFERED": "1"}
PASS_PREFIXES = ("FLUXRT_", "NVSHMEM_", "NCCL_", "CUDA_", "CUPY_", "XLA_")
PASS_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
BIND_CHOICES = ("none", "core", "socket", "numa", "launcher")
_SRUN_BIND = {"none": "none", "core": "cores", "socket": "sockets", "numa": "ldoms"}


FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
# interpreter options before the script / -m / -c: those that take a value, and those that do not
_PY_VALUE_OPTS = {"-W", "-X", "--check-hash-based-pycs"}
_PY_FLAG = re.compile(r"^-[bBdEhiIOPqsSuvVx]+$")


def _is_python(program: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)*)?", os.path.basename(program)) is not None


def with_mpi4py_runner(command: list[str]) -> list[str]:
    """``python [opts] script|-m mod|-c cmd ...`` as ``python [opts] -m mpi4py script|-m mod|-c cmd ...``
    (mpi4py's runner aborts the MPI job on an uncaught exception). Other commands come back unchanged."""
    if not command or not _is_python(command[0]):
        return list(command)
    i = 1
    while i < len(command):
        a = command[i]
        if a in _PY_VALUE_OPTS:
            i += 2
        elif a.startswith(("-W", "-X")) and len(a) > 2 or _PY_FLAG.match(a) and a not in ("-h", "-V", "-i"):
            i += 1
        else:
            break
    if i >= len(command) or command[i] in ("-h", "--help", "-V", "--version", "-i"):
        return list(command)
    if command[i:i + 2] == ["-m", "mpi4py"]:
        return list(command)
    return command[:i] + ["-m", "mpi4py"] + command[i:]


@dataclass
class Plan:
    argv: list[str]
    env: dict[str, str]


def _flavor(mpirun: str) -> str:
    """'openmpi' or 'mpich' from `mpirun --version` (hydra/MPICH and Intel MPI share the -genv syntax)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return "openmpi"
    return "openmpi" if "open mpi" in text or "open-mpi" in text or "openrte" in text else "mpich"


def exported_env(args, base_env) -> dict[str, str]:
    env = {k: v for k, v in base_env.items() if k.startswith(PASS_PREFIXES) or k in PASS_NAMES}
    for k, v in SAFE_ENV.items():
        env[k] = v
    if args.heap:
        env["NVSHMEM_SYMMETRIC_SIZE"] = args.heap
    if args.timeout is not None:
        env["FLUXRT_TIMEOUT_S"] = str(args.timeout)
    if getattr(args, "abort_on_exception", True):
        env.setdefault("FLUXRT_ABORT_ON_EXCEPTION", "1")
    for item in args.env:
        if "=" not in item:
            raise SystemExit(f"fluxrt-run: --env needs NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        env[k] = v
    return env


def build(args, base_env=None, euid=None) -> Plan:
    """The command line and environment for `args` (separated from running it, for tests and --dry-run)."""
    base_env = dict(os.environ if base_env is None else base_env)
    if not args.command:
        raise SystemExit("fluxrt-run: nothing to run; usage: fluxrt-run -n 4 -- python app.py")
    if args.nprocs < 1:
        raise SystemExit(f"fluxrt-run: -n must be >= 1, got {args.nprocs}")
    env = exported_env(args, base_env)
    launcher = args.launcher
    if launcher == "auto":
        launcher = "srun" if "SLURM_JOB_ID" in base_env and shutil.which("srun") else "mpirun"
    if launcher == "srun":
        argv = ["srun", "-n", str(args.nprocs), "--export=ALL," + ",".join(f"{k}={v}" for k, v in sorted(env.items())
                                                                          if k not in PASS_NAMES)]
        if args.nodes:
            argv += ["-N", str(args.nodes)]
        argv += ["--mpi=" + args.srun_mpi] if args.srun_mpi else []
        if args.bind_to != "launcher":
            argv.append("--cpu-bind=" + _SRUN_BIND[args.bind_to])
    else:
        mpirun = args.mpirun or shutil.which("mpirun") or shutil.which("mpiexec")
        if not mpirun:
            raise SystemExit("fluxrt-run: no mpirun/mpiexec on PATH (install Open MPI or MPICH, or pass --mpirun)")
        flavor = args.mpi_flavor or _flavor(mpirun)
        argv = [mpirun, "-n", str(args.nprocs)]
        if flavor == "openmpi":
            if (os.geteuid() if euid is None else euid) == 0:
                argv.append("--allow-run-as-root")
            if args.oversubscribe:
                argv.append("--oversubscribe")
            if args.nodes:
                argv += ["--map-by", f"ppr:{-(-args.nprocs // args.nodes)}:node"]
            if args.bind_to != "launcher":
                argv += ["--bind-to", args.bind_to]
            for k in sorted(env):
                argv += ["-x", k]
        else:
            if args.nodes:
                argv += ["-ppn", str(-(-args.nprocs // args.nodes))]
            if args.bind_to != "launcher":
                argv += ["-bind-to", args.bind_to]
            argv += ["-genvlist", ",".join(sorted(env))]
        argv += args.mpi_args
    # Resolve the program here: remote daemons search their own PATH, which may pick another python3.
    program = shutil.which(args.command[0], path=base_env.get("PATH")) or args.command[0]
    command = [program, *args.command[1:]]
    if getattr(args, "abort_on_exception", True):
        command = with_mpi4py_runner(command)
    return Plan(argv=argv + command, env={**base_env, **env})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fluxrt-run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks (one GPU each)")
    ap.add_argument("-N", "--nodes", type=int, default=None, help="spread ranks evenly over this many nodes")
    ap.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                    help="auto: srun inside a Slurm allocation, else mpirun")
    ap.add_argument("--mpirun", default=None, help="path of mpirun/mpiexec (default: from PATH)")
    ap.add_argument("--mpi-flavor", choices=("openmpi", "mpich"), default=None,
                    help="how to pass environment to ranks (default: detected from mpirun --version)")
    ap.add_argument("--srun-mpi", default=None, help="srun --mpi plugin (e.g. pmix)")
    ap.add_argument("--heap", default=None, help="symmetric heap per rank, e.g. 4G (NVSHMEM_SYMMETRIC_SIZE)")
    ap.add_argument("--timeout", type=float, default=None, help="bound of device waits in seconds (FLUXRT_TIMEOUT_S)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra variable for every rank")
    ap.add_argument("--oversubscribe", action="store_true", help="Open MPI: allow more ranks than slots")
    ap.add_argument("--bind-to", choices=BIND_CHOICES, default="none",
                    help="CPU binding of ranks (default none: a rank's host threads must not share one core; "
                         "'launcher' keeps the launcher's default)")
    ap.add_argument("--mpi-args", action="append", default=[], metavar="ARG", help="extra argument for mpirun")
    ap.add_argument("--no-abort-on-exception", dest="abort_on_exception", action="store_false",
                    help="do not run Python commands under `python -m mpi4py` nor set FLUXRT_ABORT_ON_EXCEPTION=1 "
                         "(an uncaught exception on one rank then leaves the others running)")
    ap.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    return ap


def run(argv: list[str], env: dict[str, str], grace_s: float = 30.0) -> int:
    """Run the launcher, forwarding SIGINT/SIGTERM/SIGHUP to it (never SIGKILL: it must end its ranks),
    and return its exit status (128 + signal when a signal ended it). A second signal is forwarded too;
    only when the launcher outlives `grace_s` after the first one does it get SIGTERM again."""
    proc = subprocess.Popen(argv, env=env)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {}
    for name in FORWARDED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                previous[sig] = signal.signal(sig, forward)
            except ValueError:   # not the main thread: no forwarding
                pass
    try:
        since = None          # when the first signal was forwarded
        escalated = False
        while True:
            # a bounded wait: a signal handler runs between two, so the grace period is measured here
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and since is None:
                since = time.monotonic()
            if since is not None and not escalated and time.monotonic() - since > grace_s:
                print(f"fluxrt-run: {argv[0]} still running {grace_s:g} s after a signal; sending SIGTERM",
                      file=sys.stderr)
                proc.terminate()
                escalated = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:
        return 128 - code
    if code == 0 and received:
        return 128 + received[0]
    return code


@one_line_errors("fluxrt-run")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    plan = build(args)
    if args.dry_run:
        import shlex

        print(shlex.join(plan.argv))
        return 0
    if not shutil.which(plan.argv[0], path=plan.env.get("PATH")):
        raise SystemExit(f"fluxrt-run: {plan.argv[0]}: not found (install Open MPI or MPICH, e.g. "
                         "pip install 'fluxrt[mpich]', or pass --mpirun)")
    return run(plan.argv, plan.env)


if __name__ == "__main__":
    sys.exit(main())
