"""Names for full KV blocks, chained from the start of a sequence: what prefix caching looks blocks up by.

A KV block's contents depend on more than its own tokens: every token attends to all the tokens
before it, so block i of a sequence is reusable by another sequence only if the other's tokens
agree on blocks 0..i. vLLM's answer, used here: a hash chain. Block i's hash is
``xxh3_128(hash of block i-1 || token ids of block i)``, so equal hashes mean equal prefixes (up to
a 128-bit collision), and a block equal to another but after a different parent gets another name.

The chain starts from a root that names what else the KV depends on:

- the model: its checkpoint identity and dtype (``namespace``), so the blocks of two models, or
  of one model in two precisions, never share a name -- not even once hashes leave the engine
  (a router that matches prompts to cached prefixes);
- for longrope models (Phi-3, Phi-4-mini), whether the sequence's prompt is longer than the
  original context (``long_prompt_tokens``): the engine rotates *every* token of such a prompt
  with the long frequency set and every token of a shorter one with the short set up to that
  length (`worker.models.rotary_embedding.rope_lengths_of_span`), so the same tokens at the same
  positions have different keys in a long and in a short prompt. Past that length all tokens are
  rotated the same way whatever the prompt, and position is already implied by the chain.

Token ids are hashed as little-endian int64s (one layout on every machine), never with Python's
``hash()``, which is salted per process. Hashing a 16-token block costs about a microsecond.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from worker.models.model_config import ModelConfig
from worker.models.rotary_embedding import needs_rope_lengths

__all__ = ["PrefixHasher"]


class PrefixHasher:
    def __init__(self, namespace: str, block_size: int, *, long_prompt_tokens: int | None = None) -> None:
        """`namespace`: what identifies the model's KV (checkpoint identity and dtype); `long_prompt_tokens`:
        for longrope, the original context length past which a prompt is rotated with the long set."""
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string naming the model, got {namespace!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if long_prompt_tokens is not None and long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be >= 1 or None, got {long_prompt_tokens}")
        self.block_size = block_size
        self.long_prompt_tokens = long_prompt_tokens
        self._short_root = xxhash.xxh3_128_digest(f"thaw-kv\0{namespace}\0{block_size}\0short".encode())
        self._long_root = xxhash.xxh3_128_digest(f"thaw-kv\0{namespace}\0{block_size}\0long".encode())
        self._pack = struct.Struct(f"<{block_size}q").pack

    @classmethod
    def for_model(cls, checkpoint_id: str, config: ModelConfig, block_size: int) -> PrefixHasher:
        """Names an engine's KV blocks for prefix caching: by the checkpoint (its
        `worker.loading.checkpoint_identity`) and the KV dtype, and for longrope by whether a prompt is
        past the original context."""
        scaling = config.rope_scaling
        return cls(f"{checkpoint_id}/{config.torch_dtype}", block_size,
                   long_prompt_tokens=scaling.original_max_position_embeddings if needs_rope_lengths(scaling) else None)

    def root(self, num_prompt_tokens: int) -> bytes:
        """The chain's start for a sequence with a prompt of `num_prompt_tokens` tokens."""
        long = self.long_prompt_tokens is not None and num_prompt_tokens > self.long_prompt_tokens
        return self._long_root if long else self._short_root

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], num_prompt_tokens: int, num_blocks: int) -> None:
        """Appends to `hashes` (a sequence's chain so far, its first ``len(hashes)`` blocks) the
        hashes of its blocks up to `num_blocks`; every one of them must be full in `token_ids`."""
        size = self.block_size
        if num_blocks * size > len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens hold {len(token_ids) // size} full blocks, not {num_blocks}")
        parent = hashes[-1] if hashes else self.root(num_prompt_tokens)
        for i in range(len(hashes), num_blocks):
            parent = xxhash.xxh3_128_digest(parent + self._pack(*token_ids[i * size:(i + 1) * size]))
            hashes.append(parent)
