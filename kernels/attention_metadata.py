"""What an attention kernel needs to know about one engine step's batch.

The engine flattens every scheduled sequence's new tokens into one ragged batch (vLLM's
"varlen" layout): sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``
and its context (cached tokens plus the new ones) is ``seq_lens[b]`` tokens long, stored in
the physical KV blocks listed in ``block_tables[b]``. A decode row has one query token; a
prefill or prefill chunk has many, causal among themselves and attending to the whole cached
context before them. The metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Ragged-batch description shared by all layers of one forward pass.

    Host-side tuples mirror the device tensors so a kernel launcher can size its grid
    without a device-to-host sync.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per new token
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [B + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    query_lens_host: tuple[int, ...]  # B ints
    seq_lens_host: tuple[int, ...]  # B ints

    def __post_init__(self) -> None:
        num_seqs = len(self.seq_lens_host)
        if len(self.query_lens_host) != num_seqs:
            raise ValueError(
                f"query_lens_host has {len(self.query_lens_host)} entries but seq_lens_host has {num_seqs}"
            )
        for q_len, s_len in zip(self.query_lens_host, self.seq_lens_host):
            if q_len < 1 or s_len < q_len:
                raise ValueError(f"each sequence needs 1 <= query_len <= seq_len, got {q_len} and {s_len}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @classmethod
    def build(
        cls,
        *,
        block_tables: list[list[int]],
        query_lens: list[int],
        seq_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Builds the tensors from per-sequence host lists (the engine's view of a step)."""
        if not (len(block_tables) == len(query_lens) == len(seq_lens)):
            raise ValueError("block_tables, query_lens and seq_lens must have one entry per sequence")
        slots: list[int] = []
        for table, q_len, s_len in zip(block_tables, query_lens, seq_lens):
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
