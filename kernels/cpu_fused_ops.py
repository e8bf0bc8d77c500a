"""Fused element-wise steps of a decoder layer on CPU (`cpu_fused_ops.cpp`), or None where they do not apply.

Each function returns the fused result for CPU tensors in float32 or bfloat16 when Thaw's CPU
extension is built (`cpu_extension.py`), and None otherwise (another device, float16, no
compiler), so the caller keeps its PyTorch code as the one fallback and the one definition of the
arithmetic: the kernels do the same operations in the same order and precision, including
PyTorch's intermediate roundings to bfloat16 (tested against that code).

Why: at decode batch sizes RMSNorm is 8 PyTorch ops, rotary embedding 6 per tensor and
SiLU-and-multiply 2 (each widening and narrowing bfloat16 operands), the residual add one more;
timed on the 100M Llama in bfloat16 (30 decode rows, 2 threads) they and the Python around them were
~2.2 ms of a 17.9 ms step, mostly per-op overhead. Fused (AVX-512 where built, 16 lanes with
PyTorch's roundings), the five calls of a layer take ~0.05 ms at that size (BENCHMARKS.md, #23).

Used by `worker/models/llama.py` (its RMSNorm, residual add + norm, MLP) and
`worker/rotary_embedding.apply_rope`. A row's result depends only on its values, never on its
address or batch (fixed-order sums): an engine fed layer by layer computes what a loaded one does
for the same rows. (Where two engines chunk a prompt differently their attention paths differ and
bfloat16 rounds differently anyway: tests hold those to transformers up to bfloat16 rounding.)
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import try_build_cpu_extension

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _extension_for(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or x.requires_grad:
        return None
    return try_build_cpu_extension()[0]


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' Llama RMSNorm of ``x`` [T, H] with ``weight`` [H] (same dtype), or None."""
    ext = _extension_for(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype:
        return None
    return ext.rms_norm(x, weight.contiguous(), float(eps))  # [T, H]


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x + delta, RMSNorm(x + delta))`` for ``x``, ``delta`` [T, H] and ``weight`` [H] of one
    dtype (a decoder layer's residual add and the norm after it), or None."""
    ext = _extension_for(x)
    if (ext is None or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype or delta.dtype != x.dtype
            or delta.shape != x.shape or delta.stride(-1) != 1 or delta.device != x.device):
        return None
    return ext.add_rms_norm(x, delta, weight.contiguous(), float(eps))  # [T, H] each


def fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` for ``gate_up`` = [T, 2I] (gate first), or None."""
    ext = _extension_for(gate_up)
    if ext is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return None
    return ext.silu_and_mul(gate_up)  # [T, I]


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half rotary embedding of ``x`` [T, H, D] with ``cos``/``sin`` [T, 1, R] (R <= D), or None."""
    ext = _extension_for(x)
    if (ext is None or x.dim() != 3 or x.stride(-1) != 1 or cos.dtype != x.dtype or sin.dtype != x.dtype
            or cos.dim() != 3 or cos.shape[1] != 1):
        return None
    return ext.rope(x, cos[:, 0].contiguous(), sin[:, 0].contiguous())  # [T, H, D]
