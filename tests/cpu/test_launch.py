"""fluxrt-run: command lines and environment for Open MPI, MPICH and srun, without launching."""
import pytest

from fluxrt import launch


def plan(argv, env=None, euid=1000):
    args = launch.parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    base = {"PATH": "/usr/bin:/bin", "HOME": "/root", "SECRET": "x", "NCCL_DEBUG": "INFO"} | (env or {})
    return launch.build(args, base_env=base, euid=euid)


def test_openmpi_exports_safety_env_and_passes_program_args():
    p = plan(["-n", "4", "--mpirun", "/opt/mpi/bin/mpirun", "--mpi-flavor", "openmpi", "--heap", "4G",
              "--timeout", "7", "--", "python3", "app.py", "-n", "9"])
    assert p.argv[:3] == ["/opt/mpi/bin/mpirun", "-n", "4"]
    assert p.argv[-3:] == ["app.py", "-n", "9"] and p.argv[-6].endswith("python3")
    assert p.argv[-5:-3] == ["-m", "mpi4py"]   # an uncaught exception on a rank aborts the job
    exported = {p.argv[i + 1] for i, a in enumerate(p.argv) if a == "-x"}
    assert {"NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_SYMMETRIC_SIZE",
            "FLUXRT_TIMEOUT_S", "NCCL_DEBUG", "PATH"} <= exported
    assert "SECRET" not in exported and "HOME" not in exported
    assert p.env["NVSHMEM_DISABLE_NVLS"] == "1" and p.env["NCCL_NVLS_ENABLE"] == "0"
    assert p.env["NVSHMEM_SYMMETRIC_SIZE"] == "4G" and p.env["FLUXRT_TIMEOUT_S"] == "7.0"
    assert "--allow-run-as-root" not in p.argv


def test_openmpi_as_root_and_multinode():
    p = plan(["-n", "16", "-N", "2", "--mpirun", "mpirun", "--mpi-flavor", "openmpi", "--", "x"], euid=0)
    assert "--allow-run-as-root" in p.argv
    i = p.argv.index("--map-by")
    assert p.argv[i + 1] == "ppr:8:node"


@pytest.mark.parametrize("flavor, flag", [("openmpi", "--bind-to"), ("mpich", "-bind-to")])
def test_ranks_are_not_bound_to_one_core_by_default(flavor, flag):
    # Open MPI binds 1-2 ranks to a core each by default, which stalled a rank's host thread
    p = plan(["-n", "2", "--mpirun", "mpirun", "--mpi-flavor", flavor, "--", "x"])
    assert p.argv[p.argv.index(flag) + 1] == "none"
    p = plan(["-n", "2", "--mpirun", "mpirun", "--mpi-flavor", flavor, "--bind-to", "numa", "--", "x"])
    assert p.argv[p.argv.index(flag) + 1] == "numa"
    p = plan(["-n", "2", "--mpirun", "mpirun", "--mpi-flavor", flavor, "--bind-to", "launcher", "--", "x"])
    assert flag not in p.argv
    p = plan(["-n", "8", "--launcher", "srun", "--bind-to", "core", "--", "prog"], env={"SLURM_JOB_ID": "1"})
    assert "--cpu-bind=cores" in p.argv


def test_mpich_uses_genvlist():
    p = plan(["-n", "2", "--mpirun", "mpiexec", "--mpi-flavor", "mpich", "--env", "FOO=bar", "--", "x"])
    i = p.argv.index("-genvlist")
    names = p.argv[i + 1].split(",")
    assert "FOO" in names and "NVSHMEM_DISABLE_NVLS" in names and "-x" not in p.argv
    assert p.env["FOO"] == "bar"


def test_srun_inside_allocation_uses_export_list():
    p = plan(["-n", "8", "--launcher", "srun", "--srun-mpi", "pmix", "--", "prog"], env={"SLURM_JOB_ID": "1"})
    assert p.argv[:3] == ["srun", "-n", "8"]
    export = next(a for a in p.argv if a.startswith("--export="))
    assert export.startswith("--export=ALL,") and "NVSHMEM_DISABLE_NVLS=1" in export
    assert "--mpi=pmix" in p.argv


@pytest.mark.parametrize("argv, message", [
    (["-n", "2"], "nothing to run"),
    (["-n", "0", "--", "x"], "-n must be >= 1"),
    (["-n", "2", "--env", "NOVALUE", "--mpirun", "m", "--mpi-flavor", "mpich", "--", "x"], "NAME=VALUE"),
])
def test_bad_arguments_exit_with_a_reason(argv, message):
    with pytest.raises(SystemExit, match=message):
        plan(argv)


def test_dry_run_prints_command(capsys):
    assert launch.main(["-n", "2", "--mpirun", "mpiexec", "--mpi-flavor", "mpich", "--dry-run", "--", "echo", "hi"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mpiexec -n 2 -bind-to none -genvlist ") and out.rstrip().endswith("echo hi")
