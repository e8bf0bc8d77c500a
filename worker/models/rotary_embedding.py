"""Rotary position embeddings (RoPE) as the Llama family defines them, with the scaled variants
published checkpoints use: linear, llama3, yarn, longrope and dynamic (NTK).

Frequencies are computed the way Hugging Face transformers (5.x, `modeling_rope_utils.py`)
computes them -- float32 inverse frequencies, the same operations in the same order,
``cat(freqs, freqs)`` and rotate-half -- so our activations match `transformers` bit for bit
where the arithmetic allows. cos/sin are computed per step for the step's positions instead
of caching a [max_positions, head_dim] table: a 128k-context model would otherwise spend
hundreds of MB on a table that a step reads a few rows of.

What each type needs beyond the inverse frequencies:

* yarn and longrope scale cos and sin by an attention factor (`attention_factor`), in float32
  before the cast to the model's dtype, as transformers does.
* longrope has two sets of frequencies (``short_factor`` and ``long_factor``). transformers picks
  one per forward pass: the long set when ``max(position_ids) + 1`` exceeds
  ``original_max_position_embeddings``. For one sequence run by ``generate`` that means a prompt
  token is rotated for the prompt's length and a generated token at position p for ``p + 1``
  (keys already cached keep the rotation they were computed with). Our steps mix many sequences,
  so the choice is made per token from its *RoPE length*, ``max(num_prompt_tokens, position + 1)``
  (`rope_lengths`), which reproduces that per sequence whatever the chunking, batching or
  preemption. Without explicit lengths a token's RoPE length is ``position + 1``: exact for decode
  tokens (the CUDA-graph path), not for a prompt longer than the original maximum.
  Not reproduced: transformers' Phi3 ``generate`` drops the KV cache of a sequence whose length
  first passes ``original_max_position_embeddings`` and recomputes it all with the long set; here
  keys computed before the switch keep the short set (as transformers' Llama does).
* partial RoPE (``partial_rotary_factor``, Phi-4-mini): only the first ``rotary_dim`` dimensions
  of each head are rotated, with frequencies computed over those as if the head were that wide;
  cos and sin are ``[T, 1, rotary_dim]`` and the remaining dimensions pass through unchanged.
* dynamic (NTK) rescales its base only once a forward pass reaches beyond the config's
  ``max_position_embeddings``; the engine never runs a sequence that long (``max_model_len`` is
  capped there), so its frequencies are transformers' initial ones, a function of the config alone.
"""

from __future__ import annotations

import math

import torch

from kernels.cpu_fused_ops import fused_rope
from worker.models.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[rotary_dim // 2] float32; for longrope [2, rotary_dim // 2]: row 0 the short factors' set,
    row 1 the long factors' (see `per_token_inverse_frequencies`). rotary_dim is head_dim but for
    partial RoPE, where transformers computes every type's frequencies over the rotated dimensions
    alone, as if the head were that wide."""
    dim = scaling.rotary_dim(head_dim)  # the rotated dimensions; every type's frequencies are over these
    # An explicit device: models are built under torch.device("meta"), this must stay real.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [D/2]
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(dim, theta, scaling)
    if scaling.rope_type == "longrope":
        sets = [1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)
                for factors in (scaling.short_factor, scaling.long_factor)]
        return torch.stack(sets)  # [2, D/2]
    if scaling.rope_type == "dynamic":
        # transformers' NTK base at seq_len = max_position_embeddings (Python floats, as there);
        # ~theta, kept in this form so the float rounding is the same.
        original = scaling.original_max_position_embeddings
        factor = scaling.factor
        theta = theta * ((factor * original / original) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
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


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:  # [D/2]
    # YaRN (arxiv 2309.00071): dimensions that turn fewer than beta_slow times over the original
    # context are interpolated (divided by factor), those turning more than beta_fast times are
    # kept, with a linear ramp between.
    def correction_dim(num_rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(dtype=torch.float) / head_dim)  # [D/2]
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [D/2]: 1 where a dimension is extrapolated (kept), 0 where interpolated
    return interpolated * (1 - keep) + extrapolated * keep


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by (transformers' ``attention_scaling``); 1.0 but for yarn
    and longrope, where a config's explicit ``attention_factor`` wins over the derived value."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
    return mscale(factor)


def needs_rope_lengths(scaling: RopeScaling) -> bool:
    """Whether a token's rotation depends on its sequence's length, not only its position
    (longrope): then a ragged step must pass `rope_lengths`."""
    return scaling.rope_type == "longrope"


def rope_lengths_of_span(num_prompt_tokens: int, start: int, end: int) -> list[int]:
    """The RoPE lengths of a sequence's tokens at positions start..end-1: ``max(num_prompt_tokens,
    position + 1)`` each (see the module docstring), what every caller of `embed` passes for longrope."""
    return [num_prompt_tokens] * max(0, min(end, num_prompt_tokens) - start) + list(
        range(max(start, num_prompt_tokens) + 1, end + 1))


def per_token_inverse_frequencies(
    inv_freq: torch.Tensor,  # [D/2], or [2, D/2] for longrope
    scaling: RopeScaling,
    positions: torch.Tensor,  # [T] int
    rope_lengths: torch.Tensor | None = None,  # [T] int: max(num_prompt_tokens, position + 1); None: position + 1
) -> torch.Tensor:  # [D/2] shared by every token, or [T, D/2]
    if not needs_rope_lengths(scaling):
        return inv_freq
    lengths = positions + 1 if rope_lengths is None else rope_lengths  # [T]
    is_long = (lengths > scaling.original_max_position_embeddings).long()  # [T]: 0 short set, 1 long set
    return inv_freq.index_select(0, is_long)  # [T, D/2]


def rope_cos_sin(
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [R/2] float32, or [T, R/2]: one row per token (R = rotary_dim)
    dtype: torch.dtype,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, 1, R]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, R], R = rotary_dim <= D
    """Rotate-half RoPE. On CPU in float32/bfloat16 one fused op (`kernels.cpu_fused_ops`, the
    same roundings as the PyTorch code below, which defines it and is the fallback)."""
    fused = fused_rope(x, cos, sin)  # [T, H, D]
    if fused is not None:
        return fused
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial RoPE: rotate the first R dimensions, pass the rest through
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
