"""Chooses the attention backend for a device: the one place that decision is made."""

from __future__ import annotations

import os

import torch

from kernels.attention_backend import AttentionBackend
from kernels.reference import ReferenceAttentionBackend

BACKENDS = ("reference", "triton")


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_attention_backend(device: torch.device | str, prefer: str | None = None) -> AttentionBackend:
    """Returns the backend the engine should use on ``device``.

    By default: the Triton kernels on CUDA, the PyTorch reference everywhere else. ``prefer``
    forces one by name; "triton" off CUDA needs Triton's interpreter (``TRITON_INTERPRET=1``,
    set before the kernels are first imported), which is how the kernels are tested on CPU.
    """
    device = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"unknown attention backend {prefer!r}; choose one of {', '.join(BACKENDS)}")
    name = prefer or ("triton" if device.type == "cuda" else "reference")
    if name == "reference":
        return ReferenceAttentionBackend()
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(
            f"the Triton attention backend needs a CUDA device (got {device.type!r}); "
            "on CPU set TRITON_INTERPRET=1 to run it in Triton's interpreter"
        )
    from kernels.triton_attention import TritonAttentionBackend  # imports triton: only when chosen

    return TritonAttentionBackend()
