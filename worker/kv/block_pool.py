"""Who holds each KV block: reference counts, the free queue, and the full blocks kept for reuse.

With prefix caching several sequences read the same full block (a shared system prompt), so a
block is free only when no sequence references it. A freed block whose KV is named by a hash
(`worker.kv.prefix_hasher`) is not forgotten: it waits in an LRU of cached blocks, where a later
sequence with the same prefix takes it back, and it is evicted -- its hash dropped -- only when a
fresh block is needed and no never-cached block is left. So blocks are handed out in this order:

1. a block holding nothing worth keeping (first in, first out: predictable ids in tests);
2. the least recently freed cached block.

A sequence's table is released tail first into the LRU (vLLM's order): a cached block is only
useful after all the blocks before it in its chain, so the end of a prefix should go before its
beginning. Both kinds of free block count in `num_free` -- a cached one is reclaimable at once.

Integers only, like the block manager that uses it; nothing here knows tokens or sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

__all__ = ["BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # unreferenced, nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced and cached: oldest first
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks no sequence references: never cached, or cached and reclaimable."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks named by a hash, referenced or not."""
        return len(self._hash_by_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def evictable_block_ids(self) -> list[int]:
        """Cached blocks no sequence references, in eviction order (the next evicted first)."""
        return list(self._evictable)

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the KV named `block_hash`, or None."""
        return self._block_by_hash.get(block_hash)

    def num_reclaimable(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` nobody references: taking them back costs free blocks."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def take(self, num: int) -> list[int]:
        """`num` fresh blocks, each referenced once, evicting the oldest cached blocks when no
        never-cached block is left. Raises `RuntimeError` (taking none) if fewer are free."""
        if num > self.num_free:
            raise RuntimeError(f"cannot take {num} KV blocks: only {self.num_free} are free")
        taken = []
        for _ in range(num):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._block_by_hash[self._hash_by_block.pop(block_id)]
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def share(self, block_ids: Iterable[int]) -> None:
        """One more reference to each of these cached blocks (a prefix hit); a block nobody held
        leaves the LRU. Raises `RuntimeError` for a block that is not cached (a stale hit)."""
        block_ids = list(block_ids)
        stale = [b for b in block_ids if b not in self._hash_by_block]
        if stale:
            raise RuntimeError(f"blocks {stale} are no longer cached: look the prefix up again")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def share_held(self, block_ids: Iterable[int]) -> None:
        """One more reference to each of these blocks, which another sequence holds and computes in
        the step about to run (a sequence riding along with the one computing its prefix, see
        `BlockManager.ride_in_flight`). Raises `RuntimeError` for a block nobody holds."""
        block_ids = list(block_ids)
        free = [b for b in block_ids if self._ref_counts[b] < 1]
        if free:
            raise RuntimeError(f"blocks {free} are held by no sequence: nothing is computing them")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's KV is named (reusable by a later prefix)."""
        return block_id in self._hash_by_block

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference to each block of a sequence's table (in token order). Blocks nobody
        holds any more become free: never-cached ones join the free queue in table order, cached
        ones join the LRU tail first (see the module docstring)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise RuntimeError(f"block {block_id} released more often than it was taken")
        cached = []
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_by_block:
                    cached.append(block_id)
                else:
                    self._free_block_ids.append(block_id)
        for block_id in reversed(cached):
            self._evictable[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Names a referenced block's (full, computed) KV by `block_hash`, so later prefixes can hit
        it. False, changing nothing, if the block already has a name or another block has this one
        (the same prefix computed twice: the first copy stays the cached one)."""
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free: only a block a sequence holds can be cached")
        if block_id in self._hash_by_block or block_hash in self._block_by_hash:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        return True

    def forget_cached(self) -> int:
        """Forgets every cached block's KV (the pool that held it is being freed: an engine going
        to sleep); they join the free queue. Only when no sequence holds a block. Returns how many
        were forgotten."""
        held = sum(1 for count in self._ref_counts if count)
        if held:
            raise RuntimeError(f"{held} block(s) are held by sequences; their KV cannot be forgotten")
        forgotten = list(self._evictable)
        self._free_block_ids.extend(forgotten)
        self._evictable.clear()
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        return len(forgotten)
