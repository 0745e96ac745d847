"""Default collective tunings, one table per machine kind (pure data; ``collectives_plan.Tuning`` reads it).

A table maps every ``Tuning`` field to its value. Where each number comes from (the tuning job, its
results file and what it measured) is in docs/tuning.md; the field meanings are in ``Tuning``.
Every table was measured with a collectives workspace of ``TUNED_WORKSPACE_BYTES`` per rank, which is
therefore the library's default workspace (``CollectivesOptions.workspace_bytes``).
"""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20

TUNED_WORKSPACE_BYTES = 256 * MiB

# Hopper GPUs (H100, H200) whose pairs are all NVLink-connected: tuned on 4x and 2x H200 (NV18), bf16.
HOPPER_NVLINK = {
    "ll_max_bytes": 256 * KiB,
    "oneshot_max_bytes": 1 * MiB,
    "oneshot_bytes_per_block": 8 * KiB,
    "oneshot_max_grid": 64,
    "bulk_bytes_per_block": 16 * KiB,
    "bulk_max_grid": 64,
    "twoshot_max_grid": 128,
    "ll_max_grid": 32,
    "direct_min_bytes": 1 * MiB,
    "pipe_min_bytes": 64 * MiB,
    "pipe_bytes_per_block": 64 * KiB,
    "pipe_max_grid": 64,
    "pipe_depth": 2,
    "pipe_max_step": 64 * KiB,
    "allreduce_pipe_max_step": 0,
    "ll12_min_bytes": 512,
    "ll12_threads": 128,
    "ll12_max_grid": 128,
    "ll12_twoshot_min_bytes": 256 * KiB,
    "ll12_twoshot_max_bytes": 4 * MiB,
    "ll12_twoshot_threads": 512,
    "ll12_twoshot_max_grid": 128,
    "ring_min_bytes": 32 * MiB,
    "two_rank_ring_min_bytes": 32 * MiB,
    "reduce_scatter_ring_min_bytes": 64 * MiB,
    "allgather_ring_min_bytes": 32 * MiB,
    "two_rank_allgather_ring_min_bytes": 16 * MiB,
    "direct_allgather_ring_min_bytes": 128 * MiB,
    "ring_max_grid": 128,
    "ring_threads": 512,
    "ring_step": 256 * KiB,
    "ring_depth": 4,
    "ring_substeps": 2,
    "ring_one_step_max_grid": 96,
    "pairwise_min_bytes": 32 * MiB,
    "pairwise_max_step": 256 * KiB,
    "pairwise_min_step": 128 * KiB,
    "pairwise_depth": 3,
    "pdl": 1,
}

TABLES = {"hopper-nvlink": HOPPER_NVLINK}

# No other machine has been measured: elsewhere the Hopper NVLink table is the starting point, and
# `fluxrt-perf <op> --tune key=value` finds better values for that machine.
FALLBACK_KIND = "hopper-nvlink"
DEFAULT_KIND = "hopper-nvlink"

_HOPPER_NAMES = ("H100", "H200", "H800", "H20")  # substrings of the CUDA device names (GH200 too)


def machine_kind(gpu_name: str, all_pairs_nvlink: bool = True) -> str:
    """The table key for a GPU model name (e.g. cupy's ``getDeviceProperties(d)['name']``) and whether
    every pair of the job's GPUs is NVLink-connected; unknown machines get ``FALLBACK_KIND``."""
    name = gpu_name.upper()
    if all_pairs_nvlink and any(h in name for h in _HOPPER_NAMES):
        return "hopper-nvlink"
    return FALLBACK_KIND


def table(kind: str = DEFAULT_KIND) -> dict[str, int]:
    """A copy of the table for `kind` (an unknown kind raises: use ``machine_kind`` to map a machine)."""
    if kind not in TABLES:
        raise KeyError(f"no tuning table {kind!r}: known {', '.join(sorted(TABLES))}")
    return dict(TABLES[kind])
