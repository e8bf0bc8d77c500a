"""Paged KV-cache block accounting, in integers only (nano-vLLM's habit: testable without a device).

The KV cache is a pool of ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A
sequence owns a block table: the list of block ids holding its tokens in order. Allocation
comes as a check/commit pair — `can_allocate` says whether a sequence can grow to hold N
tokens, `allocate` does it — so the scheduler can decide to preempt before touching state.
Free blocks are handed out first-in first-out, which makes block ids predictable in tests.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._block_tables.get(seq_id, [])

    def num_missing_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``seq_id`` still needs so that it can hold ``num_tokens`` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(self._block_tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq_id, num_tokens) <= len(self._free_block_ids)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grows ``seq_id``'s table to hold ``num_tokens`` tokens; returns the new block ids."""
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(
                f"cannot allocate {missing} blocks for {seq_id}: only {len(self._free_block_ids)} free "
                "(call can_allocate first)"
            )
        new_ids = [self._free_block_ids.popleft() for _ in range(missing)]
        self._block_tables.setdefault(seq_id, []).extend(new_ids)
        return new_ids

    def free(self, seq_id: str) -> int:
        """Returns all of ``seq_id``'s blocks to the pool; returns how many were freed."""
        table = self._block_tables.pop(seq_id, [])
        self._free_block_ids.extend(table)
        return len(table)
