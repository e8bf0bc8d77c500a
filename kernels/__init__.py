"""Attention and KV-cache kernels behind one interface (see `attention_backend`), and the
pre-packed linear layers of float32 CPU serving (`cpu_linear`).

Three attention implementations: `ReferenceAttentionBackend` (PyTorch, any device: the ground
truth in tests), the CPU serving backend in `cpu_attention` (a C++ decode kernel built on first
use, the reference for prefill), and the Triton kernels in `triton_attention` (chosen on CUDA;
on CPU only under ``TRITON_INTERPRET=1``). `get_attention_backend` picks one and is the only
code that imports `cpu_attention` or `triton_attention` (outside their own tests), so `triton`
is imported only when it is chosen. `prepack_linear_layers` swaps a loaded model's
``nn.Linear`` layers for `PrepackedLinear` (oneDNN's blocked weight layout) where
`cpu_prepack_unavailable_reason` says the dtype and device allow it. `fused_rms_norm`,
`fused_add_rms_norm`, `fused_silu_and_mul` and `fused_rope` (`cpu_fused_ops`) do a decoder layer's
element-wise steps in one C++ pass on CPU, or return None where they do not apply (the caller's
PyTorch code is the fallback).

Public API: `AttentionMetadata`, `AttentionBackend`, `ReferenceAttentionBackend`,
`get_attention_backend`, `prepare_cpu_kernels`, `triton_interpreter_enabled`, `PrepackedLinear`,
`prepack_linear_layers`, `cpu_prepack_unavailable_reason`, `fused_rms_norm`, `fused_add_rms_norm`,
`fused_silu_and_mul`, `fused_rope`. Nothing here imports other Thaw
folders.
"""

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_fused_ops import fused_add_rms_norm, fused_rms_norm, fused_rope, fused_silu_and_mul
from kernels.cpu_linear import PrepackedLinear, cpu_prepack_unavailable_reason, prepack_linear_layers
from kernels.reference import ReferenceAttentionBackend
from kernels.select import get_attention_backend, prepare_cpu_kernels
from kernels.triton_interpreter import triton_interpreter_enabled

__all__ = [
    "AttentionBackend", "AttentionMetadata", "PrepackedLinear", "ReferenceAttentionBackend",
    "cpu_prepack_unavailable_reason", "fused_add_rms_norm", "fused_rms_norm", "fused_rope", "fused_silu_and_mul",
    "get_attention_backend", "prepack_linear_layers", "prepare_cpu_kernels", "triton_interpreter_enabled",
]
