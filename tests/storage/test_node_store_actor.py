"""The node store as a real Ray actor on a local Ray: a worker process on the node loads a
DRAM-resident model without reading the disk, loads hold entries across the actor boundary, and
stopping -- or killing -- the actor leaves no shared memory behind."""

from __future__ import annotations

import json

import pytest

from storage import (LocalModelRepository, NodeStore, NodeStoreReport, RepositoryConfig, open_repository,
                     start_node_store, stop_node_store)
from storage.shm_directory import OWNER_FILE, owner_is_gone
from tests.storage.conftest import wait_until

ray = pytest.importorskip("ray")
WAIT_S = 60


@pytest.fixture(scope="module")
def local_ray():
    started_here = not ray.is_initialized()  # another module's Ray may still be up: reuse it
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    if started_here:
        ray.shutdown()


@pytest.fixture
def repository_config(tmp_path, thaw_model_dir) -> RepositoryConfig:
    repo = LocalModelRepository(tmp_path / "repo")
    repo.push(thaw_model_dir, "m0")
    return RepositoryConfig(str(tmp_path / "repo"))


def load_in_worker_process(path: str) -> dict:
    """What a model worker on the node does with a path from its store: load it, counting disk reads."""
    import os

    from loader import load_checkpoint

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))

    before = read_bytes()
    tensors, stats = load_checkpoint(path)
    return {"pid": os.getpid(), "num_tensors": len(tensors), "num_bytes": stats.num_bytes,
            "disk_read_bytes": read_bytes() - before}


def test_worker_loads_from_dram_without_disk_and_stop_frees_shared_memory(local_ray, store_config,
                                                                           repository_config):
    config = store_config()
    store = start_node_store(config, repository_config)
    try:
        path = ray.get(store.acquire.remote("m0", "dram"), timeout=WAIT_S)
        assert path.startswith(str(config.shm_dir))
        report = ray.get(store.report.remote(), timeout=WAIT_S)
        assert isinstance(report, NodeStoreReport) and report.tier("dram").get("m0").num_loading == 1
        load = ray.remote(load_in_worker_process)
        ray.get(load.remote(path), timeout=WAIT_S)  # the first load imports torch and the loader
        result = ray.get(load.remote(path), timeout=WAIT_S)
        ray.get(store.release.remote("m0", "dram"), timeout=WAIT_S)
        assert result["num_tensors"] == 21 and result["num_bytes"] > 0
        assert result["disk_read_bytes"] == 0
        report = ray.get(store.report.remote(), timeout=WAIT_S)
        assert report.tier("dram").get("m0").num_loading == 0 and report.num_fetches == 1
        assert config.shm_dir.is_dir()
    finally:
        stop_node_store(store)
    assert not config.shm_dir.exists()


def test_killed_actor_memory_is_reclaimed_by_the_next_store(local_ray, store_config, repository_config):
    config = store_config()
    store = start_node_store(config, repository_config)
    ray.get(store.ensure.remote("m0", "dram"), timeout=WAIT_S)
    owner = json.loads((config.shm_dir / OWNER_FILE).read_text())
    ray.kill(store, no_restart=True)  # SIGKILL: no close(), no atexit
    wait_until(lambda: owner_is_gone(owner), "the killed actor's process to exit")
    assert config.shm_dir.is_dir()  # left behind, as a hard kill must
    successor_config = store_config(node_id=config.node_id + "b")
    with NodeStore(successor_config, open_repository(repository_config)):
        assert not config.shm_dir.exists()
