"""Attention and KV-cache kernels behind one interface (see `attention_backend`).

Public API: `AttentionMetadata`, `AttentionBackend`, `ReferenceAttentionBackend`,
`get_attention_backend`. Nothing here imports other Thaw folders.
"""

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.reference import ReferenceAttentionBackend
from kernels.select import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "ReferenceAttentionBackend", "get_attention_backend"]
