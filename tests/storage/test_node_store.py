"""The node store on the real filesystem and the real /dev/shm: misses fetched once, exact LRU
in both tiers, pins and loads that survive pressure, corruption detected and re-fetched,
interrupted downloads that leave nothing behind, restarts that adopt what is complete, and tier
files only their owner can read."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

import pytest
import torch

from loader import ChecksumMismatchError, load_checkpoint
from loader.verification_record import RECORD_FILE
from storage import (InvalidModelNameError, LocalModelRepository, ModelNotFoundError, NodeStore, RepositoryError,
                     TierFullError)
from storage.checkpoint_copy import checkpoint_bytes
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint
from tests.storage.conftest import SESSION_PLATFORM_ID, SHM_ROOT, wait_until

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it; never reached when correct
MODELS = ("m0", "m1", "m2", "m3", "m4")


def flip_byte(path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def read_bytes_from_storage() -> int:
    """Bytes this process made the kernel fetch from a block device (all threads)."""
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


@pytest.fixture
def repository(tmp_path, thaw_model_dir, hf_model_dir):
    """A local repository with five identical thaw-format models m0..m4 and one Hugging Face model
    in the form repositories held before conversion at push ("hf": node stores convert it)."""
    repo = LocalModelRepository(tmp_path / "repo", part_bytes=16384, max_concurrency=4)
    for model in MODELS:
        repo.push(thaw_model_dir, model)
    repo.push(hf_model_dir, "hf", convert=False)
    return repo


@pytest.fixture
def model_bytes(thaw_model_dir) -> int:
    return checkpoint_bytes(thaw_model_dir)


@pytest.fixture
def expected_tensors():
    return llama_tensors(2, torch.bfloat16, seed=3)


def assert_tensors(loaded, expected) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_starting_store_reclaims_the_dram_tier_a_dead_store_of_any_platform_left(store_config, repository):
    """Issue 44: a platform whose nodes never come back (every multinode test run's, one torn down
    with ``ray stop``) left its DRAM tier in /dev/shm until reboot; the next store to start on the
    node, of any platform, reclaims it -- never a directory whose owner may be alive."""
    import json

    from storage.shm_directory import OWNER_FILE, owner_record

    dead = SHM_ROOT / f"thaw-{SESSION_PLATFORM_ID}gone.node1"
    alive = SHM_ROOT / f"thaw-{SESSION_PLATFORM_ID}live.node1"
    for path, owner in ((dead, owner_record() | {"pid": 2**22 + 7}), (alive, owner_record())):
        path.mkdir(mode=0o700)
        (path / OWNER_FILE).write_text(json.dumps(owner))
        (path / "weights.bin").write_bytes(b"x" * 4096)
    try:
        with NodeStore(store_config(), repository):
            assert not dead.exists() and alive.is_dir()
    finally:
        for path in (dead, alive):
            shutil.rmtree(path, ignore_errors=True)


def test_ssd_miss_downloads_and_converts_once(store_config, repository, expected_tensors):
    with NodeStore(store_config(), repository) as store:
        path = store.ensure("hf", "ssd")
        assert path == store.config.ssd_dir / "hf" and (path / "thaw_index.json").is_file()
        assert store.ensure("hf", "ssd") == path
        report = store.report()
        assert (report.num_fetches, report.num_conversions) == (1, 1)
        assert report.tier("ssd").get("hf").num_bytes == checkpoint_bytes(path)
        assert sorted(p.name for p in store.config.ssd_dir.iterdir()) == [".staging", ".trash", "hf"]
        assert list((store.config.ssd_dir / ".staging").iterdir()) == []  # the download was removed
        tensors, _ = load_checkpoint(path)
        assert_tensors(tensors, expected_tensors)


def test_a_model_converted_at_push_is_only_copied_by_every_node_store(store_config, repository, hf_model_dir,
                                                                     expected_tensors, monkeypatch):
    import storage.node_store

    conversions = []
    real_convert = storage.node_store.convert_checkpoint
    monkeypatch.setattr(storage.node_store, "convert_checkpoint",
                        lambda *args, **kwargs: conversions.append(args) or real_convert(*args, **kwargs))
    published = repository.push(hf_model_dir, "published")
    assert published.kind == "thaw" and published.source  # converted once, here, and stored so
    for _ in range(2):  # two nodes
        with NodeStore(store_config(), repository) as store:
            path = store.ensure("published", "ssd")
            assert (store.report().num_fetches, store.report().num_conversions) == (1, 0)
            assert store.report().tier("ssd").get("published").num_bytes == published.checkpoint_bytes
            assert sorted(p.name for p in store.config.ssd_dir.iterdir()) == [".staging", ".trash", "published"]
            assert list((store.config.ssd_dir / ".staging").iterdir()) == []
            tensors, _ = load_checkpoint(path)
            assert_tensors(tensors, expected_tensors)
            store.load_checkpoint("published", "dram")
    assert conversions == []


def test_a_model_held_in_hugging_face_form_is_converted_on_fetch_and_said_once(store_config, repository, caplog):
    with NodeStore(store_config(), repository) as store:
        store.ensure("hf", "ssd")
        assert store.evict("hf", "ssd")
        store.ensure("hf", "ssd")  # fetched and converted again
        assert (store.report().num_fetches, store.report().num_conversions) == (2, 2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "storage.node_store"]
    assert warnings == [f"model 'hf' is in Hugging Face form only in the repository {repository.uri}; this node "
                        f"store converts it after each download -- push it again to store the thaw format once"]


@pytest.mark.parametrize("tier", ["ssd", "dram"])
def test_lru_eviction_order_is_exact(store_config, repository, model_bytes, tier):
    capacity = 3 * model_bytes + model_bytes // 2
    config = store_config(**{f"{tier}_capacity_bytes": capacity})
    with NodeStore(config, repository) as store:
        for model in ("m0", "m1", "m2", "m0"):
            store.ensure(model, tier)
        assert store.report().tier(tier).models == ("m1", "m2", "m0")
        store.ensure("m3", tier)
        assert store.report().tier(tier).models == ("m2", "m0", "m3")
        store.ensure("m4", tier)
        store.ensure("m3", tier)
        report = store.report().tier(tier)
        assert report.models == ("m0", "m4", "m3")
        assert report.used_bytes == 3 * model_bytes and report.capacity_bytes == capacity
        root = store.ssd.root if tier == "ssd" else store.dram.root
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["m0", "m3", "m4"]
        assert list((root / ".trash").iterdir()) == []
        assert store.report().num_fetches == 5  # one per model: a hit never fetches


def test_pinned_and_loading_entries_survive_pressure(store_config, repository, model_bytes):
    config = store_config(dram_capacity_bytes=2 * model_bytes + model_bytes // 2)
    with NodeStore(config, repository) as store:
        store.pin("m0", "dram")
        for model in ("m1", "m2", "m3"):
            store.ensure(model, "dram")
            assert "m0" in store.report().tier("dram").models
        assert store.report().tier("dram").models == ("m0", "m3")
        with store.loading("m3", "dram") as path:
            assert store.report().tier("dram").get("m3").loading
            with pytest.raises(TierFullError, match=r"m0 \(\d+ bytes, pinned\), m3 \(\d+ bytes, 1 loading\)"):
                store.ensure("m4", "dram")
            assert store.report().tier("dram").models == ("m0", "m3")  # the refusal evicted nothing
            assert (path / "thaw_index.json").is_file()
        assert store.unpin("m0", "dram") and not store.unpin("absent", "dram")
        store.ensure("m4", "dram")
        assert store.report().tier("dram").models == ("m3", "m4")
        entry = store.report().tier("dram").get("m3")
        assert (entry.pinned, entry.num_loading) == (False, 0)


class GatedRepository(LocalModelRepository):
    """Counts fetches; each one waits for `release` after announcing itself on `fetch_started`."""

    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.fetch_started = threading.Event()
        self.release = threading.Event()
        self.num_fetch_calls = 0

    def fetch(self, model, dest_dir, **kwargs):
        self.num_fetch_calls += 1
        self.fetch_started.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the fetch")
        return super().fetch(model, dest_dir, **kwargs)


@pytest.mark.parametrize("tier", ["ssd", "dram"])
def test_concurrent_requests_share_one_fetch(store_config, repository, tier):
    gated = GatedRepository(repository.root, part_bytes=16384)
    with NodeStore(store_config(), gated) as store:
        results, errors = [], []

        def ask() -> None:
            try:
                results.append(store.ensure("m0", tier))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        threads[0].start()
        assert gated.fetch_started.wait(WAIT_S)
        for thread in threads[1:]:
            thread.start()
        waiting_tier = store.ssd if tier == "ssd" else store.dram
        wait_until(lambda: waiting_tier.num_waiting("m0") == 5, "five callers waiting on the one fetch")
        gated.release.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert errors == [] and len(results) == 6 and len(set(results)) == 1
        assert gated.num_fetch_calls == 1 and store.report().num_fetches == 1


def test_concurrent_requests_share_the_error_too(store_config, repository):
    gated = GatedRepository(repository.root)
    with NodeStore(store_config(), gated) as store:
        errors = []

        def ask() -> None:
            try:
                store.ensure("absent", "ssd")
            except ModelNotFoundError as exc:
                errors.append(exc)

        gated.release.set()
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert len(errors) == 4 and all("absent" in str(e) for e in errors)
        assert store.report().tier("ssd").entries == () and gated.num_fetch_calls == 0


def test_corrupted_ssd_partition_is_detected_and_refetched(store_config, repository, expected_tensors):
    with NodeStore(store_config(), repository) as store:
        path = store.ensure("m0", "ssd")
        flip_byte(path / "partition_000.bin")
        with pytest.raises(ChecksumMismatchError):  # what a worker's load meets
            load_checkpoint(path)
        tensors, stats = store.load_checkpoint("m0", "ssd")  # drops the bad copy, fetches, loads again
        assert_tensors(tensors, expected_tensors)
        assert stats.verified and store.report().num_fetches == 2
        assert store.report().tier("ssd").get("m0").num_loading == 0


def test_corrupted_ssd_copy_is_refetched_when_promoting_to_dram(store_config, repository, expected_tensors):
    with NodeStore(store_config(), repository) as store:
        flip_byte(store.ensure("m0", "ssd") / "partition_000.bin")
        dram_path = store.ensure("m0", "dram")
        assert store.report().num_fetches == 2
        tensors, _ = load_checkpoint(dram_path)
        assert_tensors(tensors, expected_tensors)


def test_corrupted_dram_copy_is_dropped_by_the_loading_context(store_config, repository, expected_tensors):
    with NodeStore(store_config(), repository) as store:
        flip_byte(store.ensure("m0", "dram") / "partition_000.bin", offset=9000)
        with pytest.raises(ChecksumMismatchError):
            with store.loading("m0", "dram") as path:
                load_checkpoint(path)
        assert "m0" not in store.report().tier("dram").models
        tensors, _ = store.load_checkpoint("m0", "dram")  # promoted again from the (good) SSD copy
        assert_tensors(tensors, expected_tensors)
        assert store.report().num_fetches == 1


def test_interrupted_download_leaves_no_entry_that_looks_complete(store_config, repository, monkeypatch):
    calls = []
    real = repository._download_range

    def dropping(key, start, length, fd):
        calls.append(key)
        if len(calls) == 3:
            raise RepositoryError("connection reset mid-download")
        real(key, start, length, fd)

    monkeypatch.setattr(repository, "_download_range", dropping)
    config = store_config()
    with NodeStore(config, repository) as store:
        with pytest.raises(RepositoryError, match="connection reset"):
            store.ensure("m0", "dram")
        report = store.report()
        assert report.tier("ssd").entries == () and report.tier("dram").entries == ()
        assert report.tier("ssd").used_bytes == 0
        assert sorted(p.name for p in config.ssd_dir.iterdir()) == [".staging", ".trash"]
        assert list((config.ssd_dir / ".staging").iterdir()) == []
    with NodeStore(config, repository) as restarted:  # nothing to adopt after a restart either
        assert restarted.report().tier("ssd").entries == ()
        monkeypatch.undo()
        assert (restarted.ensure("m0", "ssd") / "thaw_index.json").is_file()


def test_restart_adopts_complete_entries_in_lru_order_and_clears_crash_leftovers(store_config, repository):
    config = store_config()
    with NodeStore(config, repository) as store:
        for model in ("m0", "m1", "m2", "m0"):
            store.ensure(model, "ssd")
    # What a hard crash can leave: a half-written staging dir, plus foreign junk.
    crashed = config.ssd_dir / ".staging" / "m3.abc" / "checkpoint"
    crashed.mkdir(parents=True)
    (crashed / "partition_000.bin").write_bytes(b"x" * 100)
    (config.ssd_dir / "m4").mkdir()
    (config.ssd_dir / "m4" / "partition_000.bin").write_bytes(b"partial")  # no index: not a checkpoint
    (config.ssd_dir / "not a model").write_text("?")
    with NodeStore(config, repository) as store:
        report = store.report()
        assert report.tier("ssd").models == ("m1", "m2", "m0") and report.num_fetches == 0
        assert sorted(p.name for p in config.ssd_dir.iterdir()) == [".staging", ".trash", "m0", "m1", "m2"]
        assert list((config.ssd_dir / ".staging").iterdir()) == []
    small = store_config(ssd_dir=config.ssd_dir, ssd_capacity_bytes=2 * checkpoint_bytes(config.ssd_dir / "m0"))
    with NodeStore(small, repository) as store:  # a smaller capacity than last time: the LRU goes
        assert store.report().tier("ssd").models == ("m2", "m0")


def test_dram_load_reads_no_disk(store_config, repository, expected_tensors):
    with NodeStore(store_config(), repository) as store:
        store.load_checkpoint("m0", "ssd")  # warm every code path first
        store.ensure("m0", "dram")
        before = read_bytes_from_storage()
        tensors, stats = store.load_checkpoint("m0", "dram")
        assert read_bytes_from_storage() - before == 0
        assert stats.num_bytes == stats.total_bytes
        assert_tensors(tensors, expected_tensors)


def test_close_removes_shared_memory_and_ends_use(store_config, repository):
    config = store_config()
    store = NodeStore(config, repository)
    store.ensure("m0", "dram")
    assert (config.shm_dir / "checkpoints" / "m0" / "thaw_index.json").is_file()
    store.close()
    assert not config.shm_dir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        store.ensure("m0", "ssd")
    store.close()  # idempotent
    assert (config.ssd_dir / "m0").is_dir()  # the SSD cache outlives the store


def test_two_stores_with_one_shm_name_are_refused(store_config, repository):
    config = store_config()
    with NodeStore(config, repository):
        with pytest.raises(FileExistsError, match="different platform_id or node_id"):
            NodeStore(store_config(node_id=config.node_id), repository)
        with NodeStore(store_config(), repository) as other:  # another node id: its own directory
            assert other.config.shm_dir != config.shm_dir and other.config.shm_dir.is_dir()


def test_store_without_dram_tier(store_config, repository):
    config = store_config(dram_capacity_bytes=0)
    with NodeStore(config, repository) as store:
        assert not config.shm_dir.exists()
        with pytest.raises(ValueError, match="no DRAM tier"):
            store.ensure("m0", "dram")
        assert store.report().tier("dram").capacity_bytes == 0


def test_bad_requests_are_refused_clearly(store_config, repository, model_bytes):
    with NodeStore(store_config(ssd_capacity_bytes=model_bytes - 1), repository) as store:
        with pytest.raises(TierFullError, match="larger than the tier"):
            store.ensure("m0", "ssd")
        with pytest.raises(ModelNotFoundError, match="'absent' not found"):
            store.ensure("absent", "ssd")
        with pytest.raises(InvalidModelNameError):
            store.ensure("../m0", "ssd")
        with pytest.raises(ValueError, match="tier 'gpu' is not one of"):
            store.ensure("m0", "gpu")
        assert store.report().tier("ssd").entries == ()


def test_report_and_calibration(store_config, repository, model_bytes):
    config = store_config(calibrate=True)
    with NodeStore(config, repository) as store:
        store.pin("m0", "ssd")
        store.ensure("m1", "dram")
        before = time.time()
        with store.loading("m1", "dram"):
            report = store.report()
        assert report.platform_id == config.platform_id and report.node_id == config.node_id
        assert report.reported_at >= before
        dram, ssd = report.tier("dram"), report.tier("ssd")
        assert (dram.capacity_bytes, ssd.capacity_bytes) == (config.dram_capacity_bytes, config.ssd_capacity_bytes)
        assert [(e.model, e.num_bytes, e.pinned, e.num_loading) for e in ssd.entries] == \
            [("m0", model_bytes, True, 0), ("m1", model_bytes, False, 0)]
        assert [(e.model, e.pinned, e.loading) for e in dram.entries] == [("m1", False, True)]
        assert ssd.used_bytes == 2 * model_bytes and dram.free_bytes == config.dram_capacity_bytes - model_bytes
        assert all(e.last_used_s <= report.reported_at for e in ssd.entries)
        bandwidth = report.bandwidth
        assert bandwidth.ssd_bytes_per_s > 0 and bandwidth.dram_bytes_per_s > 0 and bandwidth.repository_bytes_per_s > 0
        assert report.best_tier("m1") == "dram" and report.best_tier("m0") == "ssd" and report.best_tier("m2") is None
        assert report.estimate_load_s("m1", 10**9) == pytest.approx(10**9 / bandwidth.dram_bytes_per_s)
        assert list(config.ssd_dir.glob(".bandwidth-probe*")) == [] and repository._list_objects("_probes") == []


def _tree_modes(root) -> tuple[set[int], set[int]]:
    """(modes of the directories, modes of the files) in `root`, `root` itself included."""
    dirs = {stat.S_IMODE(root.stat().st_mode)}
    files = set()
    for path in root.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(path.stat().st_mode))
    return dirs, files


def test_tier_files_are_the_owners_only(store_config, repository, tmp_path):
    config = store_config(ssd_dir=tmp_path / "fresh" / "ssd")
    with NodeStore(config, repository) as store:
        store.load_checkpoint("hf", "ssd")  # downloaded and converted
        store.load_checkpoint("hf", "dram")  # copied into shared memory
        ssd, shm = config.ssd_dir, config.shm_dir
        assert sorted(p.name for p in (ssd / "hf").iterdir() if p.name != RECORD_FILE) == [
            "config.json", "partition_000.bin", "thaw_index.json", "tokenizer.json"]
        assert _tree_modes(ssd) == ({0o700}, {0o600})
        assert _tree_modes(shm) == ({0o700}, {0o600})  # the DRAM tier, and the owner record beside it
        assert (shm / "checkpoints" / "hf" / "partition_000.bin").is_file()


def test_a_restart_makes_adopted_entries_the_owners_only(store_config, repository):
    config = store_config()
    with NodeStore(config, repository) as store:
        store.ensure("m0", "ssd")
    os.chmod(config.ssd_dir, 0o755)  # as an older version left them
    os.chmod(config.ssd_dir / "m0", 0o755)
    for path in (config.ssd_dir / "m0").iterdir():
        os.chmod(path, 0o644)
    with NodeStore(config, repository) as store:
        assert store.report().tier("ssd").models == ("m0",)
        assert _tree_modes(config.ssd_dir) == ({0o700}, {0o600})


class PerModelGatedRepository(LocalModelRepository):
    """Each model's fetch announces itself and waits for its own release."""

    def __init__(self, root, models, **kwargs):
        super().__init__(root, **kwargs)
        self.started = {m: threading.Event() for m in models}
        self.release = {m: threading.Event() for m in models}
        self.order: list[str] = []  # the models in the order their fetches began

    def fetch(self, model, dest_dir, **kwargs):
        self.order.append(model)
        self.started[model].set()
        if not self.release[model].wait(WAIT_S):
            raise TimeoutError("the test never released the fetch")
        return super().fetch(model, dest_dir, **kwargs)


@pytest.mark.parametrize("max_concurrent_fetches", [1, 2])
def test_fetches_of_different_models_take_turns_in_arrival_order(store_config, repository, max_concurrent_fetches,
                                                                  caplog):
    gated = PerModelGatedRepository(repository.root, ("m0", "m1", "m2"), part_bytes=16384)
    with NodeStore(store_config(max_concurrent_fetches=max_concurrent_fetches), gated) as store:
        threads = []
        for model in ("m0", "m1", "m2"):
            threads.append(threading.Thread(target=store.ensure, args=(model, "ssd")))
            threads[-1].start()
            if model == "m0" or max_concurrent_fetches == 2 and model == "m1":
                assert gated.started[model].wait(WAIT_S)
            else:
                waiting = len(threads) - max_concurrent_fetches
                wait_until(lambda: store.report().num_fetches_waiting == waiting, f"{model} queued")
        assert not gated.started["m2"].is_set()  # queued behind the fetches in flight
        assert gated.started["m1"].is_set() == (max_concurrent_fetches == 2)
        with caplog.at_level("INFO", logger="storage.node_store"):
            for model in ("m0", "m1", "m2"):
                gated.release[model].set()
            for thread in threads:
                thread.join(WAIT_S)
        assert store.report().num_fetches == 3 and gated.order == ["m0", "m1", "m2"]
        assert sorted(entry.model for entry in store.report().tier("ssd").entries) == ["m0", "m1", "m2"]
        assert any("fetching 'm2' from the repository after" in r.getMessage() for r in caplog.records)


class PartLoggingRepository(LocalModelRepository):
    """Logs each ranged read's start and end per model (one part at a time: max_concurrency 1);
    the first part of each model in `hold` waits for that model's release, and `asking` is set
    while a fetch of that model waits in `before_part`."""

    def __init__(self, root, hold, **kwargs):
        super().__init__(root, **kwargs)
        self.log: list[tuple[str, str]] = []
        self.release = {m: threading.Event() for m in hold}
        self.asking = {m: threading.Event() for m in hold}

    def fetch(self, model, dest_dir, *, before_part=None, **kwargs):
        asking = self.asking.get(model) or threading.Event()

        def ask(bytes_left: int) -> None:
            asking.set()
            before_part(bytes_left)
            asking.clear()

        return super().fetch(model, dest_dir, before_part=ask if before_part else None, **kwargs)

    def _download_range(self, key, start, length, fd):
        model = key.split("/")[0]
        self.log.append((model, "begin"))
        if start == 0 and model in self.release and not self.release[model].wait(WAIT_S):
            raise TimeoutError("the test never released the fetch")
        super()._download_range(key, start, length, fd)
        self.log.append((model, "end"))


def test_a_small_models_fetch_pauses_a_large_ones_between_parts(store_config, repository, tmp_path):
    """Issue 39: a first start of a small model does not wait for a large model's whole download;
    the large one stops between parts while the small one is fetched, then goes on, and both
    arrive whole (verified against the manifest)."""
    large = write_hf_checkpoint(tmp_path / "large-hf", llama_tensors(40, torch.bfloat16, seed=4))
    repository.push(large, "large")
    assert repository.describe("large").checkpoint_bytes >= 8 * repository.describe("m0").checkpoint_bytes
    logged = PartLoggingRepository(repository.root, ("large", "m0"), part_bytes=16384, max_concurrency=1)
    with NodeStore(store_config(), logged) as store:
        assert store.config.short_fetch_ratio == 8
        fetch_large = threading.Thread(target=store.ensure, args=("large", "ssd"))
        fetch_large.start()
        wait_until(lambda: ("large", "begin") in logged.log, "the large model's first part on the wire")
        fetch_small = threading.Thread(target=store.ensure, args=("m0", "ssd"))
        fetch_small.start()
        wait_until(lambda: ("m0", "begin") in logged.log, "the small model's fetch begun")
        assert store.report().num_fetches_waiting == 1  # the large one, paused
        logged.release["large"].set()  # its part on the wire ends; its next part waits
        assert logged.asking["large"].wait(WAIT_S)
        wait_until(lambda: logged.log.count(("large", "end")) == 1, "the large model's first part ended")
        assert logged.log.count(("large", "begin")) == 1
        logged.release["m0"].set()
        fetch_small.join(WAIT_S)
        fetch_large.join(WAIT_S)
        assert not fetch_small.is_alive() and not fetch_large.is_alive()
        small_done = max(i for i, entry in enumerate(logged.log) if entry == ("m0", "end"))
        assert logged.log.index(("large", "begin"), 1) > small_done  # the large one went on after
        assert logged.log.count(("large", "begin")) > 8
        assert sorted(entry.model for entry in store.report().tier("ssd").entries) == ["large", "m0"]
        assert store.report().num_fetches == 2 and store.report().num_fetches_waiting == 0
