"""Tuning defaults come from the per-machine tables, and the default workspace is the tuned one."""
import dataclasses

import pytest

from fluxrt import collectives_plan as plan
from fluxrt import tuning_tables


@pytest.mark.parametrize("kind", sorted(tuning_tables.TABLES))
def test_every_table_sets_every_field_to_a_valid_tuning(kind):
    fields = {f.name for f in dataclasses.fields(plan.Tuning)}
    assert set(tuning_tables.TABLES[kind]) == fields
    t = plan.Tuning.for_machine(kind)  # __post_init__ validates the values
    assert dataclasses.asdict(t) == tuning_tables.TABLES[kind]


def test_defaults_are_the_default_kind_table():
    assert plan.DEFAULT_TUNING == plan.Tuning.for_machine(tuning_tables.DEFAULT_KIND)
    assert plan.Tuning.for_machine("hopper-nvlink", pdl=0).pdl == 0


def test_library_workspace_is_the_tuned_one():
    from fluxrt.collectives import CollectivesOptions

    assert CollectivesOptions().workspace_bytes == tuning_tables.TUNED_WORKSPACE_BYTES == 256 << 20


@pytest.mark.parametrize("name, nvlink, kind", [
    ("NVIDIA H200", True, "hopper-nvlink"), ("NVIDIA H100 80GB HBM3", True, "hopper-nvlink"),
    ("NVIDIA H100 PCIe", False, tuning_tables.FALLBACK_KIND), ("NVIDIA A100-SXM4-80GB", True, tuning_tables.FALLBACK_KIND),
])
def test_machine_kind(name, nvlink, kind):
    assert tuning_tables.machine_kind(name, nvlink) == kind
    assert kind in tuning_tables.TABLES


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(KeyError, match="hopper-nvlink"):
        tuning_tables.table("no-such-machine")
