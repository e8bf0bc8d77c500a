"""Attention and KV-cache kernels behind one interface (see `attention_backend`).

Three implementations: `ReferenceAttentionBackend` (PyTorch, any device: the ground truth in
tests), the CPU serving backend in `cpu_attention` (a C++ decode kernel built on first use,
the reference for prefill), and the Triton kernels in `triton_attention` (chosen on CUDA; on
CPU only under ``TRITON_INTERPRET=1``). `get_attention_backend` picks one; callers never
import an implementation directly, so `triton` is imported only when it is used.

Public API: `AttentionMetadata`, `AttentionBackend`, `ReferenceAttentionBackend`,
`get_attention_backend`, `prepare_cpu_kernels`, `triton_interpreter_enabled`. Nothing here imports other Thaw folders.
"""

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.reference import ReferenceAttentionBackend
from kernels.select import get_attention_backend, prepare_cpu_kernels, triton_interpreter_enabled

__all__ = [
    "AttentionBackend", "AttentionMetadata", "ReferenceAttentionBackend", "get_attention_backend",
    "prepare_cpu_kernels", "triton_interpreter_enabled",
]
