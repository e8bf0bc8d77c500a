"""One cache tier: a directory of complete thaw checkpoints within a byte capacity.

The SSD cache and the DRAM cache (a directory in tmpfs) are the same thing at different speeds,
so both are a `CheckpointTier`; only what fills them differs, and the node store passes that in.

- A miss is filled once: the first caller runs the fill while every concurrent caller for the same
  model waits for that one flight and shares its result or its error (single flight).
- A fill writes into a hidden staging directory inside the tier (same filesystem) and is renamed
  into place only when complete, so ``<root>/<model>`` always is a whole checkpoint; the space
  is reserved in the ledger first, evicting least recently used entries (never pinned, loading or
  filling ones).
- Evicted and invalidated entries are renamed into a hidden trash directory under the lock, then
  deleted outside it: a reader that already opened its files keeps reading them, a new fill of the
  same model never meets a half-deleted directory.
- At start, a persistent tier (the SSD) adopts the checkpoints it finds, in their last-use order
  (each use touches the directory's mtime), and deletes everything else (staging leftovers of a
  crash, foreign files).
- The tier's directory and everything in it are the owner's only (0700 directories, 0600 files:
  tenants' weights), including entries adopted from before that rule.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loader import PRIVATE_DIR_MODE, is_thaw_checkpoint, make_private_dirs, make_private_tree
from storage.checkpoint_copy import checkpoint_bytes
from storage.model_name import InvalidModelNameError, validate_model_name
from storage.store_report import TierEntryReport, TierReport
from storage.tier_ledger import TierFullError, TierLedger

STAGING_DIR = ".staging"
TRASH_DIR = ".trash"

FillFn = Callable[[Path], None]  # writes a complete thaw checkpoint at the given (absent) path
EstimateFn = Callable[[], int]  # bytes to reserve for the fill (its peak use of this tier)


class EntryMissingError(LookupError):
    """The model is not (or no longer) held by this tier."""


@dataclass
class _Flight:
    """One fill in progress; callers that find it wait on `done` and share `error`."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    num_waiters: int = 0


class CheckpointTier:
    """A directory of thaw checkpoints with a byte capacity; see the module docstring. Thread-safe."""

    def __init__(self, tier: str, root: Path, capacity_bytes: int, *, persistent: bool,
                 clock: Callable[[], float] = time.time):
        self.tier = tier
        self.root = root
        self.persistent = persistent
        self.ledger = TierLedger(tier, capacity_bytes, clock)
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._trash_serial = 0
        self._last_touch_ns = 0
        make_private_dirs(root)
        os.chmod(root, PRIVATE_DIR_MODE)  # the tier owns its directory (it deletes whatever else it finds there)
        for hidden in (STAGING_DIR, TRASH_DIR):
            shutil.rmtree(root / hidden, ignore_errors=True)
            (root / hidden).mkdir(mode=PRIVATE_DIR_MODE)
        self._adopt_existing()

    def _adopt_existing(self) -> None:
        found = []
        for path in self.root.iterdir():
            if path.name in (STAGING_DIR, TRASH_DIR):
                continue
            try:
                validate_model_name(path.name)
                valid = self.persistent and path.is_dir() and not path.is_symlink() and is_thaw_checkpoint(path)
            except InvalidModelNameError:
                valid = False
            if valid:
                make_private_tree(path)  # chmod leaves mtime (the last use) alone
                found.append((path.stat().st_mtime_ns, path.name, checkpoint_bytes(path)))
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for mtime_ns, model, num_bytes in sorted(found):
            self.ledger.adopt(model, num_bytes, mtime_ns / 1e9)
            self._last_touch_ns = max(self._last_touch_ns, mtime_ns)
        self._discard(self.ledger.shrink_to_capacity())

    def path(self, model: str) -> Path:
        return self.root / model

    # -- eviction ---------------------------------------------------------------------------------

    def _to_trash(self, model: str) -> None:
        """Under the lock: move an entry's directory out of the way (deleted later by `_empty_trash`)."""
        self._trash_serial += 1
        try:
            os.rename(self.path(model), self.root / TRASH_DIR / f"{model}.{self._trash_serial}")
        except FileNotFoundError:
            pass

    def _empty_trash(self) -> None:
        for path in list((self.root / TRASH_DIR).iterdir()):
            shutil.rmtree(path, ignore_errors=True)

    def _discard(self, victims: list[str]) -> None:
        for model in victims:
            self._to_trash(model)
        self._empty_trash()

    def evict(self, model: str) -> bool:
        """Evict `model` if it is held and evictable (not pinned, loading or filling); True if it was."""
        with self._lock:
            entry = self.ledger.get(model)
            if entry is None or not entry.evictable:
                return False
            self.ledger.remove(model)
            self._to_trash(model)
        self._empty_trash()
        return True

    def invalidate(self, model: str) -> bool:
        """Drop a corrupt entry now, even while loads are in progress (they fail on their own). A
        fill in flight is left alone. True if an entry was dropped."""
        with self._lock:
            entry = self.ledger.get(model)
            if entry is None or entry.filling:
                return False
            self.ledger.remove(model)
            self._to_trash(model)
        self._empty_trash()
        return True

    # -- use --------------------------------------------------------------------------------------

    def ensure(self, model: str, fill: FillFn, estimate: EstimateFn) -> Path:
        """The path of `model`'s complete checkpoint in this tier, filling it on a miss (once,
        whoever else asks meanwhile). The entry may be evicted after this returns: callers that
        read it use `acquire`."""
        while True:
            with self._lock:
                entry = self.ledger.get(model)
                if entry is not None and not entry.filling:
                    self.ledger.touch(model)
                    self._touch_dir(model)
                    return self.path(model)
                flight = self._flights.get(model)
                leader = flight is None
                if leader:
                    flight = self._flights[model] = _Flight()
                else:
                    flight.num_waiters += 1
            if leader:
                try:
                    self._fill(model, fill, estimate)
                except BaseException as exc:
                    flight.error = exc
                    raise
                finally:
                    with self._lock:
                        del self._flights[model]
                    flight.done.set()
            else:
                flight.done.wait()
                if flight.error is not None:
                    raise flight.error
            # Loop: a hit now, unless it was evicted in between (then fill again).

    def acquire(self, model: str, fill: FillFn, estimate: EstimateFn) -> Path:
        """Like `ensure`, and mark a load in progress (never evicted) until `release`."""
        while True:
            path = self.ensure(model, fill, estimate)
            with self._lock:
                entry = self.ledger.get(model)
                if entry is not None and not entry.filling:
                    self.ledger.begin_load(model)
                    return path

    def release(self, model: str) -> None:
        with self._lock:
            self.ledger.end_load(model)

    def set_pinned(self, model: str, pinned: bool) -> None:
        with self._lock:
            if model not in self.ledger:
                raise EntryMissingError(f"{model!r} is not in the {self.tier} tier")
            self.ledger.set_pinned(model, pinned)

    def entry_bytes(self, model: str) -> int | None:
        with self._lock:
            entry = self.ledger.get(model)
            return None if entry is None or entry.filling else entry.num_bytes

    def num_waiting(self, model: str) -> int:
        """Callers waiting on the fill of `model` in flight (0 if none): lets tests and logs see sharing."""
        with self._lock:
            flight = self._flights.get(model)
            return flight.num_waiters if flight else 0

    def _touch_dir(self, model: str) -> None:
        """Under the lock: stamp the entry's mtime, strictly increasing, so the LRU order survives a
        restart (a plain utime() takes the kernel's coarse clock: two uses would often tie)."""
        if not self.persistent:
            return
        self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1000)
        try:
            os.utime(self.path(model), ns=(self._last_touch_ns, self._last_touch_ns))
        except FileNotFoundError:
            pass

    def _fill(self, model: str, fill: FillFn, estimate: EstimateFn) -> None:
        num_bytes = estimate()
        with self._lock:
            victims = self.ledger.reserve(model, num_bytes)
            for victim in victims:
                self._to_trash(victim)
        self._empty_trash()
        staging = Path(tempfile.mkdtemp(prefix=f"{model}.", dir=self.root / STAGING_DIR))
        try:
            fill(staging / "checkpoint")
            if not is_thaw_checkpoint(staging / "checkpoint"):
                raise RuntimeError(f"filling {model!r} into the {self.tier} tier produced no thaw checkpoint")
            actual = checkpoint_bytes(staging / "checkpoint")
            with self._lock:
                victims = self.ledger.commit(model, actual)
                for victim in victims:
                    self._to_trash(victim)
                os.rename(staging / "checkpoint", self.path(model))
                self._touch_dir(model)
        except BaseException:
            with self._lock:
                self.ledger.remove(model)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            self._empty_trash()

    # -- reporting and teardown -------------------------------------------------------------------

    def report(self) -> TierReport:
        with self._lock:
            entries = tuple(TierEntryReport(model=m, num_bytes=e.num_bytes, last_used_s=e.last_used_s,
                                            pinned=e.pinned, num_loading=e.num_loading, filling=e.filling)
                            for m, e in self.ledger.items())
            return TierReport(tier=self.tier, path=str(self.root), capacity_bytes=self.ledger.capacity_bytes,
                              used_bytes=self.ledger.used_bytes, entries=entries)


__all__ = ["CheckpointTier", "EntryMissingError", "TierFullError"]
