"""A node's own store settings (`storage.node_settings`): validated, carried in one environment
entry and applied over the platform's config by the node store actor."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.node_settings import NODE_SETTINGS_ENV, NodeSettings
from storage.node_store_actor import NodeStoreActor
from storage.repository_config import RepositoryConfig
from storage.store_config import GIB, NodeStoreConfig

PLATFORM = NodeStoreConfig(ssd_dir=Path("/srv/thaw/ssd-cache/n1"), ssd_capacity_bytes=64 * GIB,
                           dram_capacity_bytes=8 * GIB, node_id="n1", calibrate=False)


def test_settings_override_only_what_they_name():
    assert NodeSettings().apply(PLATFORM) is PLATFORM and NodeSettings().to_env() == {}
    mine = NodeSettings.from_gb("/nvme/thaw", 2000, 0)
    applied = mine.apply(PLATFORM)
    assert (applied.ssd_dir, applied.ssd_capacity_bytes, applied.dram_capacity_bytes) == (
        Path("/nvme/thaw/n1"), 2000 * GIB, 0)  # each logical node in its own subdirectory; DRAM 0: no DRAM tier
    assert (applied.platform_id, applied.node_id) == (PLATFORM.platform_id, "n1")
    only_dram = NodeSettings.from_gb(dram_capacity_gb=96).apply(PLATFORM)
    assert (only_dram.ssd_dir, only_dram.ssd_capacity_bytes, only_dram.dram_capacity_bytes) == (
        PLATFORM.ssd_dir, 64 * GIB, 96 * GIB)
    assert only_dram.worker_memory_bytes is None  # the platform's budget
    budget = NodeSettings.from_gb(worker_memory_gb=12).apply(PLATFORM)
    assert (budget.worker_memory_bytes, budget.ssd_capacity_bytes) == (12 * GIB, 64 * GIB)


def test_settings_travel_in_one_environment_entry():
    mine = NodeSettings.from_gb("/nvme/thaw", 2000, 0.5, 6)
    env = mine.to_env()
    assert list(env) == [NODE_SETTINGS_ENV] and NodeSettings.from_env(env) == mine
    assert NodeSettings.from_env({}) == NodeSettings()


@pytest.mark.parametrize("text, message", [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"ssd_dirr": "/x"}', "unknown field(s) ['ssd_dirr']"),
    ('{"ssd_dir": "relative"}', "ssd_dir must be an absolute path"),
    ('{"ssd_capacity_bytes": 0}', "ssd_capacity_bytes must be an integer >= 1"),
    ('{"dram_capacity_bytes": -1}', "dram_capacity_bytes must be an integer >= 0"),
    ('{"worker_memory_bytes": 0}', "worker_memory_bytes must be an integer >= 1"),
])
def test_a_malformed_environment_entry_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        NodeSettings.from_env({NODE_SETTINGS_ENV: text})


@pytest.mark.parametrize("kwargs, message", [
    ({"ssd_capacity_gb": 0}, "--ssd-capacity-gb must be a number of GB > 0, got 0"),
    ({"dram_capacity_gb": -2}, "--dram-capacity-gb must be a number of GB >= 0, got -2"),
    ({"dram_capacity_gb": float("nan")}, "--dram-capacity-gb must be a number of GB >= 0, got nan"),
    ({"worker_memory_gb": 0}, "--worker-memory-gb must be a number of GB > 0, got 0"),
])
def test_flag_values_are_checked_in_the_flags_terms(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NodeSettings.from_gb(**kwargs)


def test_the_store_actor_applies_its_node_s_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_SETTINGS_ENV, NodeSettings(ssd_dir=str(tmp_path / "nvme"), ssd_capacity_bytes=3 * GIB,
                                                       dram_capacity_bytes=0, worker_memory_bytes=5 * GIB
                                                       ).to_env()[NODE_SETTINGS_ENV])
    config = NodeStoreConfig(ssd_dir=tmp_path / "platform" / "n1", ssd_capacity_bytes=GIB, dram_capacity_bytes=GIB,
                             node_id="n1", calibrate=False)
    actor = NodeStoreActor(config, RepositoryConfig(uri=str(tmp_path / "repo")))
    try:
        report = actor.report()
        assert (report.tier("ssd").capacity_bytes, report.tier("dram").capacity_bytes) == (3 * GIB, 0)
        assert report.worker_memory_bytes == 5 * GIB  # reported for the controller to place by
        assert (tmp_path / "nvme" / "n1").is_dir() and not (tmp_path / "platform" / "n1").exists()
    finally:
        actor.close()
