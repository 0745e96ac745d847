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


# --- the collectives' default Tuning comes from the machine (fakes stand in for the GPUs and MPI) ---------

@pytest.mark.parametrize("names, links, kind", [
    (["NVIDIA H200"] * 4, [True] * 4, "hopper-nvlink"),
    (["NVIDIA H100 80GB HBM3"] * 2, [True] * 2, "hopper-nvlink"),
    (["NVIDIA H100 80GB HBM3"], [True], "hopper-nvlink"),
    (["NVIDIA H100 PCIe"] * 2, [False, False], tuning_tables.machine_kind("NVIDIA H100 PCIe", False)),
    (["NVIDIA A100-SXM4-80GB"] * 2, [True] * 2, tuning_tables.machine_kind("NVIDIA A100-SXM4-80GB", True)),
    (["NVIDIA H200", "NVIDIA H100 80GB HBM3"], [True] * 2, tuning_tables.DEFAULT_KIND),
    (["NVIDIA H200"] * 2, [True, None], tuning_tables.DEFAULT_KIND),
    ([], [None], tuning_tables.DEFAULT_KIND),
])
def test_machine_tuning_kind(names, links, kind):
    from fluxrt.collectives import machine_tuning_kind

    got, why = machine_tuning_kind(names, links)
    assert got == kind and got in tuning_tables.TABLES and why


class _FakeComm:
    """allgather over `size` ranks that all contribute what this rank does, or scripted per-call results."""

    def __init__(self, size, script=None):
        self.size, self.script, self.calls = size, list(script or []), []

    def allgather(self, value):
        self.calls.append(value)
        return self.script.pop(0) if self.script else [value] * self.size


def _fake_world(size=2, rank=0, script=None):
    from types import SimpleNamespace

    return SimpleNamespace(comm=_FakeComm(size, script), rank=rank, size=size, device_id=rank)


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_hopper_nvlink_machines_keep_the_default_table(monkeypatch, caplog, gpu):
    """H100/H200 with all pairs NVLink: the same Tuning as before automatic selection (DEFAULT_TUNING)."""
    from fluxrt import collectives as coll

    monkeypatch.setattr(coll, "_local_machine_facts", lambda dev: (gpu, f"0000:{dev:02x}:00.0"))
    monkeypatch.setattr(coll, "_nvlink_peers", lambda dev, buses: True)
    with caplog.at_level("INFO", logger="fluxrt.collectives"):
        t = coll._machine_tuning(_fake_world(4))
    assert t == plan.DEFAULT_TUNING == plan.Tuning.for_machine("hopper-nvlink")
    assert any("tuning table 'hopper-nvlink'" in r.getMessage() and gpu in r.getMessage() for r in caplog.records)


def test_machine_selection_uses_every_ranks_facts(monkeypatch):
    from fluxrt import collectives as coll

    seen = {}
    monkeypatch.setattr(coll, "_local_machine_facts", lambda dev: ("NVIDIA H200", "0000:01:00.0"))
    monkeypatch.setattr(coll, "_nvlink_peers", lambda dev, buses: seen.setdefault("buses", buses) and False)
    facts = [("NVIDIA H200", "0000:01:00.0"), ("NVIDIA H200", "0000:02:00.0")]
    world = _fake_world(2, script=[facts, [False, False]])
    monkeypatch.setattr(coll.tuning_tables, "machine_kind",
                        lambda name, nvlink: seen.setdefault("kind_args", (name, nvlink)) and "hopper-nvlink")
    coll._machine_tuning(world)
    assert seen["buses"] == ["0000:01:00.0", "0000:02:00.0"]
    assert seen["kind_args"] == ("NVIDIA H200", False)
    assert len(world.comm.calls) == 2  # two collective calls on every rank, whatever the local outcome


def test_a_rank_without_device_properties_falls_back_to_the_default(monkeypatch, caplog):
    from fluxrt import collectives as coll

    def broken(dev):
        raise RuntimeError("no device")

    monkeypatch.setattr(coll, "_local_machine_facts", broken)
    monkeypatch.setattr(coll, "_nvlink_peers", lambda dev, buses: pytest.fail("not asked without every rank's facts"))
    world = _fake_world(2)
    with caplog.at_level("INFO", logger="fluxrt.collectives"):
        t = coll._machine_tuning(world)
    assert t == plan.Tuning.for_machine(tuning_tables.DEFAULT_KIND)
    assert len(world.comm.calls) == 2
    assert any("default table" in r.getMessage() for r in caplog.records)


def test_options_default_to_the_machine_and_an_explicit_tuning_wins():
    from fluxrt.collectives import CollectivesOptions

    assert CollectivesOptions().tuning is None
    t = plan.Tuning(pdl=0)
    assert CollectivesOptions(tuning=t).tuning is t
