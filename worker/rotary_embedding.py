"""Rotary position embeddings (RoPE) as the Llama family defines them, incl. llama3 scaling.

Frequencies are computed the way Hugging Face computes them (float32 inverse frequencies,
``cat(freqs, freqs)`` and rotate-half), so our activations match `transformers` bit for bit
where the arithmetic allows. cos/sin are computed per step for the step's positions instead
of caching a [max_positions, head_dim] table: a 128k-context model would otherwise spend
hundreds of MB on a table that a step reads a few rows of.
"""

from __future__ import annotations

import math

import torch

from worker.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:  # [head_dim // 2]
    # An explicit device: models are built under torch.device("meta"), this must stay real.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [D / 2] float32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, 1, D]
    freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
