"""One node's DRAM or SSD checkpoint cache in the simulator: a byte budget with LRU contents.

A node store keeps checkpoints in its DRAM and SSD tiers until room is needed; the simulator
models each tier as an ordered map of model index -> bytes, least recently used first. `touch`
marks a use (a load read from it), `insert` adds a copy and evicts from the cold end until it
fits. A checkpoint larger than the whole tier is not kept (it could never fit). Integers only,
so it is tested without the rest of the simulator.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["TierCache"]


class TierCache:
    """LRU contents of one tier (`capacity_bytes` >= 0; 0 means the node has no such tier)."""

    __slots__ = ("capacity_bytes", "used_bytes", "_entries")

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an integer >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, int] = OrderedDict()

    def __contains__(self, model_index: int) -> bool:
        return model_index in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def model_indices(self) -> list[int]:
        """Held models, least recently used first."""
        return list(self._entries)

    def touch(self, model_index: int) -> None:
        """A load read the model from this tier: it becomes the most recently used."""
        if model_index in self._entries:
            self._entries.move_to_end(model_index)

    def fits(self, num_bytes: int) -> bool:
        """Whether a copy of `num_bytes` could be kept at all (evicting others)."""
        return 0 < num_bytes <= self.capacity_bytes

    def insert(self, model_index: int, num_bytes: int) -> list[int]:
        """Keep a copy (most recently used); returns the models evicted to make room."""
        if model_index in self._entries:
            self._entries.move_to_end(model_index)
            return []
        if not self.fits(num_bytes):
            return []
        evicted = []
        while self.used_bytes + num_bytes > self.capacity_bytes:
            old, old_bytes = self._entries.popitem(last=False)
            self.used_bytes -= old_bytes
            evicted.append(old)
        self._entries[model_index] = num_bytes
        self.used_bytes += num_bytes
        return evicted
