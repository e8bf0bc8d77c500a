"""The one interface the engine calls for attention over the paged KV cache.

Two operations cover a transformer layer's use of the cache: write this step's new K/V into
their slots, then attend every query row of the ragged batch to its sequence's context
(optionally with Gemma 2's score soft-capping). A
backend is chosen once per device (`select.get_attention_backend`) and the engine never
looks at which one it got, so the Triton kernels (CUDA) and the PyTorch reference (everywhere)
are interchangeable and tested against each other.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata


def check_gqa_heads(num_heads: int, num_kv_heads: int) -> None:
    """Every backend's one shape rule: query heads come in equal groups per KV head."""
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")


def check_softcap(softcap: float | None) -> None:
    """Every backend's rule for soft-capping: none, or a cap > 0 (tanh(scores / cap) needs one)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention softcap must be a number > 0 or None, got {softcap!r}")


class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Stores token t's key/value at flat slot ``slot_mapping[t]`` of the caches (in place)."""
        ...

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        key: torch.Tensor | None = None,  # [T, Hkv, D]: this step's keys, as just written to the cache
        value: torch.Tensor | None = None,  # [T, Hkv, D]
    ) -> torch.Tensor:  # [T, Hq, D]
        """Causal attention of each query row over its sequence's cached context.

        ``key``/``value``, when given, are the step's own rows that `write_kv_cache` just stored:
        a backend may read a sequence's keys from them instead of the cache where the sequence's
        whole context is in this step (a prompt prefilled at once), which saves gathering what
        was just written. The result is the same either way.

        Query row i of a sequence with q_len new tokens and seq_len context tokens sits at
        position ``seq_len - q_len + i`` and attends to key positions ``j <= that`` (and
        ``j > position - sliding_window`` when a window is set). Hq must be a multiple of Hkv
        (grouped-query attention: query head h reads KV head ``h // (Hq // Hkv)``). With a
        ``softcap`` (Gemma 2's ``attn_logit_softcapping``) each score ``s = scale * q.k`` becomes
        ``softcap * tanh(s / softcap)`` before the mask and the softmax, as transformers' eager
        attention computes it.
        """
        ...
