"""The node store: one per node, bringing models from the repository into the node's SSD and DRAM.

``ensure(model, tier)`` returns the local path of a complete thaw checkpoint in that tier:

- SSD miss: fetch the model's thaw checkpoint from the repository (parallel ranged reads, every
  file verified against the manifest's checksums) into the tier's staging area, then rename it
  into place -- concurrent callers share the one fetch (`CheckpointTier` single flight), and
  fetches of different models take turns, one at a time by default, a much smaller one passing a
  much larger one (`storage.fetch_queue`). A
  Hugging Face push was converted once, at push (`ModelRepository.push`), so the store only
  copies; a repository that holds a model in Hugging Face form only (pushed before that, or
  unreadable by the converter then) still works: the store converts it after the download,
  saying so once per model in its log;
- DRAM miss: ensure the SSD copy, then copy it into the shared-memory tier verifying every
  chunk's checksum; a bad SSD copy is invalidated, re-fetched and the copy retried once.

A worker on the node loads the returned directory with the loader it uses for any checkpoint;
from the DRAM tier that reads tmpfs pages, never the disk. While it loads, the entry must not be
evicted: `loading(model, tier)` (or `acquire`/`release` across a Ray call) marks it, and if the
load meets a checksum or truncation error the entry is invalidated so the next `ensure`
re-fetches. `load_checkpoint` wraps all of it, retrying once. `pin` keeps an entry through any
pressure. `report()` is the snapshot placement uses: holdings per tier and measured bandwidths.

Everything in shared memory is removed by `close()`, on garbage collection, at interpreter exit,
and -- after a hard kill -- by the next store to start on the node, of any Thaw platform
(`ShmDirectory`'s sweep of every ``thaw-`` directory whose owner is certainly dead): a platform
whose nodes never come back (torn down with ``ray stop``, or a test's throwaway cluster) would
otherwise keep its DRAM tier in RAM until reboot (issue 44).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from loader import (CheckpointFormatError, ChecksumMismatchError, HostMemoryPool, LoaderConfig, LoadStats,
                    TruncatedCheckpointError, convert_checkpoint, load_checkpoint)
from storage.bandwidth_calibration import calibrate_bandwidth
from storage.checkpoint_copy import copy_checkpoint
from storage.checkpoint_tier import CheckpointTier, EntryMissingError
from storage.fetch_queue import FetchQueue
from storage.model_name import validate_model_name
from storage.model_repository import ModelRepository
from storage.shm_directory import ShmDirectory
from storage.store_config import SHM_DIR_PREFIX, NodeStoreConfig
from storage.store_report import TIER_NAMES, BandwidthReport, NodeStoreReport, TierReport

# What a damaged cached checkpoint raises when read: the entry is dropped and fetched again.
CORRUPTION_ERRORS = (ChecksumMismatchError, TruncatedCheckpointError, CheckpointFormatError)
logger = logging.getLogger(__name__)
DRAM_CHECKPOINTS_DIR = "checkpoints"  # inside the store's shared-memory dir (which also holds its owner record)


def _warn_if_filesystem_is_smaller(tier: CheckpointTier) -> None:
    """A capacity the filesystem cannot hold makes fills fail with ENOSPC later: say so at start."""
    stat = os.statvfs(tier.root)
    available = stat.f_bavail * stat.f_frsize + tier.ledger.used_bytes
    if tier.ledger.capacity_bytes > available:
        logger.warning("%s tier capacity %d bytes exceeds what %s can hold (%d bytes free plus %d held): "
                       "fills may fail with 'no space left on device'", tier.tier, tier.ledger.capacity_bytes,
                       tier.root, available - tier.ledger.used_bytes, tier.ledger.used_bytes)


class NodeStore:
    """One node's SSD and DRAM tiers over a repository; see the module docstring. Thread-safe."""

    def __init__(self, config: NodeStoreConfig, repository: ModelRepository):
        self.config = config
        self.repository = repository
        self._lock = threading.Lock()
        self._fetch_queue = FetchQueue(config.max_concurrent_fetches, config.short_fetch_ratio)  # one at a time by default: see its module
        self._num_fetches = 0
        self._num_conversions = 0
        self._converted_here: set[str] = set()  # models converted after a download (logged once each)
        self._closed = False
        self._shm: ShmDirectory | None = None
        self.dram: CheckpointTier | None = None
        if config.dram_capacity_bytes > 0:
            self._shm = ShmDirectory(config.shm_root, config.shm_dir.name, sweep_prefix=SHM_DIR_PREFIX)
        try:
            self.ssd = CheckpointTier("ssd", config.ssd_dir, config.ssd_capacity_bytes, persistent=True)
            if self._shm is not None:
                self.dram = CheckpointTier("dram", self._shm.path / DRAM_CHECKPOINTS_DIR, config.dram_capacity_bytes,
                                           persistent=False)
            for tier in (self.ssd, self.dram):
                if tier is not None:
                    _warn_if_filesystem_is_smaller(tier)
            if config.calibrate:
                self._bandwidth = calibrate_bandwidth(
                    ssd_dir=config.ssd_dir, shm_dir=self._shm.path if self._shm else None,
                    num_bytes=config.calibration_bytes, repository=repository,
                    repository_bytes=config.repository_calibration_bytes,
                    probe_id=f"{config.platform_id}-{config.node_id}")
            else:
                self._bandwidth = BandwidthReport(None, None, None, measured_at=time.time())
        except BaseException:
            if self._shm is not None:
                self._shm.close()
            raise

    # -- tiers and fills --------------------------------------------------------------------------

    def _tier(self, tier: str, *, allow_closed: bool = False) -> CheckpointTier:
        if self._closed and not allow_closed:
            raise RuntimeError("the node store is closed")
        if tier == "ssd":
            return self.ssd
        if tier == "dram":
            if self.dram is None:
                raise ValueError("this node store has no DRAM tier (NodeStoreConfig.dram_capacity_bytes is 0)")
            return self.dram
        raise ValueError(f"tier {tier!r} is not one of {TIER_NAMES}")

    def _fillers(self, model: str, tier: str):
        """(fill, estimate) for a miss of `model` in `tier`."""
        if tier == "ssd":
            def estimate() -> int:
                manifest = self.repository.describe(model)
                if manifest.kind == "hf" and not manifest.converted:
                    # Downloaded and converted next to it here: both are on the SSD at the end.
                    return manifest.total_bytes * 2
                return manifest.checkpoint_bytes
            return (lambda dest: self._fill_ssd(model, dest)), estimate
        return (lambda dest: self._fill_dram(model, dest)), (lambda: self._ssd_bytes(model))

    def _fill_ssd(self, model: str, dest: Path) -> None:
        download = dest.parent / "download"
        asked_s = time.monotonic()
        num_bytes = self.repository.describe(model).checkpoint_bytes  # what the fetch reads (prefer_thaw)
        with self._fetch_queue.turn(num_bytes) as turn:
            if turn.ahead:
                logger.info("fetching %r from the repository after %.1f s behind %d fetch(es) ahead of it",
                            model, time.monotonic() - asked_s, turn.ahead)
            with self._lock:
                self._num_fetches += 1
            result = self.repository.fetch(model, download, verify=self.config.verify_fetches, prefer_thaw=True,
                                           before_part=turn.before_part)
        if result.kind == "thaw":
            os.rename(download, dest)
        else:  # Hugging Face form only: convert here (see the module docstring)
            with self._lock:
                first = model not in self._converted_here
                self._converted_here.add(model)
            if first:
                logger.warning("model %r is in Hugging Face form only in the repository %s; this node store "
                               "converts it after each download -- push it again to store the thaw format once",
                               model, self.repository.uri)
            kwargs = {"chunk_bytes": self.config.convert_chunk_bytes} if self.config.convert_chunk_bytes else {}
            convert_checkpoint(download, dest, dtype=self.config.convert_dtype, progress=False, **kwargs)
            shutil.rmtree(download)
            with self._lock:
                self._num_conversions += 1
        if result.num_bytes >= max(1, self.config.repository_calibration_bytes):
            with self._lock:  # a real fetch is a better measure than the start-up probe
                self._bandwidth = replace(self._bandwidth, repository_bytes_per_s=result.bytes_per_s)

    def _ssd_bytes(self, model: str) -> int:
        while True:
            self.ensure(model, "ssd")
            num_bytes = self.ssd.entry_bytes(model)
            if num_bytes is not None:  # else evicted in between: ensure again
                return num_bytes

    def _fill_dram(self, model: str, dest: Path) -> None:
        for attempt in range(2):
            try:
                with self.loading(model, "ssd") as src:  # invalidates a corrupt SSD copy
                    copy_checkpoint(src, dest, verify=True, num_threads=self.config.copy_threads)
                return
            except CORRUPTION_ERRORS:
                shutil.rmtree(dest, ignore_errors=True)
                if attempt == 1:
                    raise

    # -- the API ----------------------------------------------------------------------------------

    def ensure(self, model: str, tier: str = "ssd") -> Path:
        """Path of `model`'s checkpoint in `tier` ("ssd" or "dram"), fetching/promoting on a miss.

        The entry may be evicted later; to read it, use `loading` / `acquire`."""
        validate_model_name(model)
        return self._tier(tier).ensure(model, *self._fillers(model, tier))

    def acquire(self, model: str, tier: str = "ssd") -> Path:
        """`ensure`, and mark a load in progress so the entry is never evicted until `release`."""
        validate_model_name(model)
        return self._tier(tier).acquire(model, *self._fillers(model, tier))

    def release(self, model: str, tier: str = "ssd", *, corrupt: bool = False) -> None:
        """End a load begun by `acquire`. `corrupt`: the load found the checkpoint damaged; it is
        dropped so the next `ensure` fetches it again."""
        target = self._tier(tier, allow_closed=True)  # a load may end after close()
        target.release(model)
        if corrupt:
            target.invalidate(model)

    @contextmanager
    def loading(self, model: str, tier: str = "ssd") -> Iterator[Path]:
        """``with store.loading(model, "dram") as path:`` load from `path`; the entry is held for the
        block. A checksum, truncation or format error from the block invalidates it (and propagates)."""
        path = self.acquire(model, tier)
        corrupt = False
        try:
            yield path
        except CORRUPTION_ERRORS:
            corrupt = True
            raise
        finally:
            self.release(model, tier, corrupt=corrupt)

    def load_checkpoint(self, model: str, tier: str = "dram", *, loader_config: LoaderConfig | None = None,
                        pool: HostMemoryPool | None = None) -> tuple[dict, LoadStats]:
        """Load `model` from `tier` with the thaw loader: (name -> tensor, stats). A corrupt cached
        copy is dropped, fetched again and the load retried once."""
        for attempt in range(2):
            try:
                with self.loading(model, tier) as path:
                    return load_checkpoint(path, loader_config, pool)
            except CORRUPTION_ERRORS:
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def pin(self, model: str, tier: str = "ssd") -> Path:
        """Ensure `model` in `tier` and keep it there through any pressure until `unpin`."""
        path = self.acquire(model, tier)
        try:
            self._tier(tier).set_pinned(model, True)
        finally:
            self.release(model, tier)
        return path

    def unpin(self, model: str, tier: str = "ssd") -> bool:
        """Make `model` evictable again; False if it was not in `tier`."""
        try:
            self._tier(tier).set_pinned(model, False)
        except EntryMissingError:
            return False
        return True

    def evict(self, model: str, tier: str = "ssd") -> bool:
        """Evict now if not pinned, loading or filling; True if it was evicted."""
        return self._tier(tier).evict(model)

    def invalidate(self, model: str, tier: str = "ssd") -> bool:
        """Drop a copy known to be corrupt, whatever holds it; True if one was dropped."""
        return self._tier(tier).invalidate(model)

    def report(self) -> NodeStoreReport:
        """Holdings of every tier (LRU order), bandwidths and counters, as one frozen snapshot."""
        dram = (self.dram.report() if self.dram is not None and not self._closed
                else TierReport(tier="dram", path="", capacity_bytes=0, used_bytes=0, entries=()))
        with self._lock:
            return NodeStoreReport(platform_id=self.config.platform_id, node_id=self.config.node_id,
                                   tiers=(dram, self.ssd.report()), bandwidth=self._bandwidth,
                                   num_fetches=self._num_fetches, num_conversions=self._num_conversions,
                                   reported_at=time.time(), worker_memory_bytes=self.config.worker_memory_bytes,
                                   num_fetches_waiting=self._fetch_queue.num_waiting,
                                   short_fetch_ratio=self._fetch_queue.short_ratio)

    def close(self) -> None:
        """Release the DRAM tier (its shared memory is removed); the SSD cache stays for the next start."""
        self._closed = True
        if self._shm is not None:
            self._shm.close()

    def __enter__(self) -> NodeStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
