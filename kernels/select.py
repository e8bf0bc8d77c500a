"""Chooses the attention backend for a device: the one place that decision is made."""

from __future__ import annotations

import logging

import torch

from kernels.attention_backend import AttentionBackend
from kernels.reference import ReferenceAttentionBackend
from kernels.triton_interpreter import triton_interpreter_enabled

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "cpu", "triton")


def get_attention_backend(device: torch.device | str, prefer: str | None = None) -> AttentionBackend:
    """Returns the backend the engine should use on ``device``.

    By default: the Triton kernels on CUDA; on CPU the "cpu" backend (C++ decode kernel,
    reference prefill) when its kernel builds here, else the PyTorch reference. ``prefer``
    forces one by name; "triton" off CUDA needs Triton's interpreter (``TRITON_INTERPRET=1``,
    set before the kernels are first imported), which is how the kernels are tested on CPU.
    """
    device = torch.device(device)
    if prefer is not None and prefer not in BACKENDS:
        raise ValueError(f"unknown attention backend {prefer!r}; choose one of {', '.join(BACKENDS)}")
    name = prefer or ("triton" if device.type == "cuda" else "cpu")
    if name == "reference":
        return ReferenceAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the 'cpu' attention backend runs on CPU tensors, not {device.type!r}")
        from kernels.cpu_attention import CpuAttentionBackend
        from kernels.cpu_extension import try_build_cpu_extension

        extension, why_not = try_build_cpu_extension()
        if extension is None:
            if prefer == "cpu":
                raise RuntimeError(f"the CPU attention kernel could not be built: {why_not}")
            logger.warning("CPU attention kernel unavailable (%s); using the PyTorch reference", why_not)
            return ReferenceAttentionBackend()
        return CpuAttentionBackend(extension)
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(
            f"the Triton attention backend needs a CUDA device (got {device.type!r}); "
            "on CPU set TRITON_INTERPRET=1 to run it in Triton's interpreter"
        )
    from kernels.triton_attention import TritonAttentionBackend  # imports triton: only when chosen

    return TritonAttentionBackend()


def prepare_cpu_kernels() -> str | None:
    """Builds the CPU kernel now (setup does this so the first request does not wait ~40 s).
    Returns None on success, else why it is unavailable."""
    from kernels.cpu_extension import try_build_cpu_extension

    return try_build_cpu_extension()[1]
