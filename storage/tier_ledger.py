"""Byte accounting and exact-LRU eviction for one cache tier, in names and integers only.

The ledger knows nothing about files: it is the tier's bookkeeping (what is held, how big, how
recently used, pinned, being loaded, being filled) and its eviction policy, so both are tested
with plain numbers (the nano-vllm block-manager idea). Order is the `OrderedDict`'s, least
recently used first -- exact, never a timestamp comparison that two uses in one clock tick could
tie. `plan_eviction` is the pure check, `reserve`/`commit` the mutations that apply it.

The simulator keeps its nodes' DRAM and SSD tiers in the same ledger (`sim.sim_node`), through
`keep` (a whole copy arrived) and `fits`: one eviction policy for the platform and its model.

What is never evicted: a pinned entry, an entry with a load in progress, an entry still being
filled. If the rest cannot make room, `TierFullError` says what holds the space, and nothing is
evicted (a failed reservation must not empty the cache for nothing).

Not thread-safe on its own: the tier that owns it calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class TierFullError(RuntimeError):
    """A tier cannot make room: everything it could evict together is still too little."""


@dataclass
class LedgerEntry:
    num_bytes: int
    last_used_s: float  # wall-clock time of the last use (for reports; order is the ledger's)
    pinned: bool = False
    num_loading: int = 0  # loads in progress (acquire without release)
    filling: bool = False  # reserved, bytes still arriving: not usable, not evictable

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.num_loading == 0 and not self.filling


class TierLedger:
    """What one tier holds, within `capacity_bytes`; see the module docstring."""

    def __init__(self, tier: str, capacity_bytes: int, clock: Callable[[], float] = time.time):
        if capacity_bytes < 0:
            raise ValueError(f"{tier} capacity_bytes is {capacity_bytes}; it must be >= 0")
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()  # least recently used first
        self._used_bytes = 0  # the entries' num_bytes summed, kept as they change (a simulated node asks often)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __contains__(self, model: str) -> bool:
        return model in self._entries

    def get(self, model: str) -> LedgerEntry | None:
        return self._entries.get(model)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, LedgerEntry]]:
        """(model, entry) from least to most recently used."""
        return list(self._entries.items())

    def models(self) -> list[str]:
        """The models held, from least to most recently used."""
        return list(self._entries)

    def fits(self, num_bytes: int) -> bool:
        """Whether a copy of `num_bytes` could be kept at all (evicting what may be evicted)."""
        return 0 < num_bytes <= self.capacity_bytes

    def keep(self, model: str, num_bytes: int) -> list[str]:
        """A whole copy of `model` arrived (no fill in between: the simulator's copies): keep it as
        the most recently used, evicting least recently used entries to make room; returns them.
        Already held: it is touched. Larger than the tier, or no room past what cannot be evicted:
        not kept, nothing evicted."""
        if model in self._entries:
            self.touch(model)
            return []
        if not self.fits(num_bytes):
            return []
        try:
            victims = self.plan_eviction(num_bytes)
        except TierFullError:
            return []
        self._evict(victims)
        self._entries[model] = LedgerEntry(num_bytes=num_bytes, last_used_s=self._clock())
        self._used_bytes += num_bytes
        return victims

    def plan_eviction(self, num_bytes: int, exclude: str | None = None) -> list[str]:
        """The models to evict, least recently used first, so that `num_bytes` more fit; [] if
        they fit already. Pure. Raises `TierFullError` (naming what holds the space) if even
        evicting every evictable entry (other than `exclude`) is not enough."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes is {num_bytes}; it must be >= 0")
        missing = num_bytes - self.free_bytes
        victims: list[str] = []
        for model, entry in self._entries.items():
            if missing <= 0:
                break
            if model != exclude and entry.evictable:
                victims.append(model)
                missing -= entry.num_bytes
        if missing > 0:
            held = [f"{m} ({e.num_bytes} bytes, {self._why_kept(e)})" for m, e in self._entries.items()
                    if not e.evictable or m == exclude]
            raise TierFullError(f"{self.tier} tier cannot make room for {num_bytes} bytes: capacity "
                                f"{self.capacity_bytes}, used {self.used_bytes}, and what cannot be evicted "
                                f"holds the rest: {', '.join(held) if held else 'nothing (the request is larger than the tier)'}")
        return victims

    @staticmethod
    def _why_kept(entry: LedgerEntry) -> str:
        reasons = [r for r, on in (("pinned", entry.pinned), (f"{entry.num_loading} loading", entry.num_loading),
                                   ("filling", entry.filling)) if on]
        return ", ".join(reasons) or "being admitted"

    def _evict(self, victims: list[str]) -> list[str]:
        for model in victims:
            self._used_bytes -= self._entries.pop(model).num_bytes
        return victims

    def reserve(self, model: str, num_bytes: int) -> list[str]:
        """Admit `model` as a filling entry of `num_bytes` (most recently used); returns the models
        evicted to make room, which the caller deletes. Raises `TierFullError`, evicting nothing."""
        if model in self._entries:
            raise ValueError(f"{model!r} is already in the {self.tier} tier")
        victims = self.plan_eviction(num_bytes)
        self._entries[model] = LedgerEntry(num_bytes=num_bytes, last_used_s=self._clock(), filling=True)
        self._used_bytes += num_bytes
        return self._evict(victims)

    def commit(self, model: str, num_bytes: int) -> list[str]:
        """The fill of `model` finished with `num_bytes` actual bytes: make it usable, evicting
        (and returning) other models if it came out larger than reserved. On `TierFullError` the
        entry stays filling; the caller removes it."""
        entry = self._entries[model]
        victims = self.plan_eviction(max(0, num_bytes - entry.num_bytes), exclude=model)
        self._used_bytes += num_bytes - entry.num_bytes
        entry.num_bytes, entry.filling = num_bytes, False
        self.touch(model)
        return self._evict(victims)

    def adopt(self, model: str, num_bytes: int, last_used_s: float) -> None:
        """Take over an entry found on disk at start, as the most recently used so far (callers
        adopt in last-use order)."""
        old = self._entries.get(model)
        self._entries[model] = LedgerEntry(num_bytes=num_bytes, last_used_s=last_used_s)
        self._used_bytes += num_bytes - (old.num_bytes if old is not None else 0)

    def shrink_to_capacity(self) -> list[str]:
        """Evict least recently used entries until the tier is within capacity (after adoption)."""
        victims, excess = [], self.used_bytes - self.capacity_bytes
        for model, entry in self._entries.items():
            if excess <= 0:
                break
            if entry.evictable:
                victims.append(model)
                excess -= entry.num_bytes
        return self._evict(victims)

    def remove(self, model: str) -> LedgerEntry | None:
        entry = self._entries.pop(model, None)
        if entry is not None:
            self._used_bytes -= entry.num_bytes
        return entry

    def touch(self, model: str) -> None:
        self._entries[model].last_used_s = self._clock()
        self._entries.move_to_end(model)

    def set_pinned(self, model: str, pinned: bool) -> None:
        self._entries[model].pinned = pinned

    def begin_load(self, model: str) -> None:
        self.touch(model)
        self._entries[model].num_loading += 1

    def end_load(self, model: str) -> None:
        entry = self._entries.get(model)
        if entry is not None and entry.num_loading > 0:  # gone if invalidated meanwhile
            entry.num_loading -= 1
