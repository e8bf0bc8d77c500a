"""Chooses the attention backend for a device: the one place that decision is made."""

from __future__ import annotations

import torch

from kernels.attention_backend import AttentionBackend
from kernels.reference import ReferenceAttentionBackend


def get_attention_backend(device: torch.device | str, prefer: str | None = None) -> AttentionBackend:
    """Returns the backend the engine should use on ``device``.

    ``prefer`` forces one by name ("reference"); unknown names are refused. The Triton
    kernels (CUDA) register here when they land; until then every device gets the reference.
    """
    available = {"reference": ReferenceAttentionBackend}
    if prefer is not None:
        if prefer not in available:
            raise ValueError(f"unknown attention backend {prefer!r}; choose one of {sorted(available)}")
        return available[prefer]()
    return ReferenceAttentionBackend()
