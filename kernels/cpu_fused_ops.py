"""Fused element-wise steps of a decoder layer on CPU (`cpu_fused_ops.cpp`), or None where they do not apply.

Each function returns the fused result for CPU tensors in float32 or bfloat16 when Thaw's CPU
extension is built (`cpu_extension.py`), and None otherwise (another device, float16, no
compiler), so the caller keeps its PyTorch code as the one fallback and the one definition of the
arithmetic: the kernels do the same operations in the same order and precision, including
PyTorch's intermediate roundings to bfloat16 (tested against that code).

Why: at decode batch sizes RMSNorm is 8 PyTorch ops, rotary embedding 6 per tensor and
SiLU-and-multiply 2 (each widening and narrowing bfloat16 operands); profiled on the 100M Llama
in bfloat16 (32 decode rows, 2 threads) they were ~20% of a step, mostly per-op overhead.

Not used by the model yet: wired into worker/llama.py they made a bfloat16 engine fed layer by
layer (zigzag) differ from a loaded one (tests/worker/test_layer_gate.py), and the engine bench was
no faster with them (302.7 vs 338.2 tok/s bf16, single runs); both to be understood first.
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
