"""RoPE frequencies, attention factors and cos/sin equal transformers' for every scaled type.

Each case uses a published model's RoPE parameters (Qwen2.5 with YaRN x4, Phi-3-mini-128k's
longrope, Phi-4-mini's partial rotary, a dynamic-NTK x2 Llama), read through our config parser
from the dict transformers' own config class writes, and compares against `ROPE_INIT_FUNCTIONS`
and the rotary module transformers runs, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from worker.models.model_config import ModelConfig
from worker.models.rotary_embedding import (
    apply_rope,
    attention_factor,
    inverse_frequencies,
    needs_rope_lengths,
    per_token_inverse_frequencies,
    rope_cos_sin,
    rope_lengths_of_span,
)

# Qwen2.5-7B-Instruct's YaRN recipe (its model card): head size 128, theta 1e6.
QWEN25_YARN = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                   rope_theta=1000000.0,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
# Phi-3-mini-128k: head size 96 (48 frequencies), pretrained at 4k, extended to 128k.
PHI3_SHORT = [round(1.0 + 0.002 * i * i / 48, 6) for i in range(48)]
PHI3_LONG = [round(1.0 + 0.05 * i * i, 4) for i in range(48)]
PHI3_LONGROPE = dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                     original_max_position_embeddings=4096, rope_theta=10000.0,
                     rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG})
LLAMA_DYNAMIC = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                     rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})
YARN_VARIANTS = {
    "qwen2.5-yarn-x4": {},
    # DeepSeek-style equal mscales: the derived attention factor is exactly 1.
    "mscale-equal": {"mscale": 0.707, "mscale_all_dim": 0.707, "factor": 32.0, "original_max_position_embeddings": 4096},
    "mscale-unequal": {"mscale": 1.0, "mscale_all_dim": 0.5},
    "explicit-attention-factor-no-truncate": {"attention_factor": 1.25, "truncate": False},
    "betas": {"beta_fast": 16, "beta_slow": 2},
}


def _configs(config_cls: str, fields: dict):
    """(transformers' config, ours read from the dict transformers writes)."""
    import transformers

    hf = getattr(transformers, config_cls)(vocab_size=100, intermediate_size=128, num_hidden_layers=1, **fields)
    ours = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return hf, ours


def _hf_rotary(hf_config):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(hf_config)


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_matches_transformers(variant):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = dict(QWEN25_YARN, rope_scaling={**QWEN25_YARN["rope_scaling"], **YARN_VARIANTS[variant]})
    hf_config, config = _configs("Qwen2Config", fields)
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert inv_freq.shape == (64,)
    assert torch.equal(inv_freq, want_inv_freq)
    assert attention_factor(config.rope_scaling) == want_factor
    expected = {"explicit-attention-factor-no-truncate": 1.25, "mscale-equal": 1.0}
    if variant in expected:
        assert want_factor == expected[variant]
    else:
        assert want_factor > 1.0  # the factor is exercised, not a no-op
    # cos and sin as transformers' rotary module computes them, attention factor included.
    positions = torch.tensor([0, 1, 17, 4095, 32767, 32768, 100000])
    want_cos, want_sin = _hf_rotary(hf_config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32, attention_factor(config.rope_scaling))
    assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])


def test_longrope_matches_transformers_short_and_long():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config, config = _configs("Phi3Config", PHI3_LONGROPE)
    scaling = config.rope_scaling
    assert scaling.original_max_position_embeddings == 4096 and scaling.factor == 32.0
    assert needs_rope_lengths(scaling)
    short, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=4097)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, scaling)
    assert inv_freq.shape == (2, 48)
    assert torch.equal(inv_freq[0], short) and torch.equal(inv_freq[1], long)
    assert not torch.equal(short, long)
    assert attention_factor(scaling) == want_factor == pytest.approx(1.1902380714238083, abs=0)
    # transformers picks one set per forward pass from max(position_ids) + 1: a prompt of 4096
    # tokens is short throughout, one of 4097 long throughout (its first token included).
    rotary = _hf_rotary(hf_config)
    for prompt_len in (4096, 4097):
        positions = torch.arange(prompt_len)
        want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
        lengths = torch.full((prompt_len,), prompt_len)
        per_token = per_token_inverse_frequencies(inv_freq, scaling, positions, lengths)
        cos, sin = rope_cos_sin(positions, per_token, torch.float32, attention_factor(scaling))
        assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0]), prompt_len
    # A ragged step: the set follows each token's RoPE length, position + 1 when none is given.
    positions = torch.tensor([0, 4095, 4096, 10])
    per_token = per_token_inverse_frequencies(inv_freq, scaling, positions, torch.tensor([4096, 4096, 4097, 5000]))
    assert [bool(torch.equal(row, long)) for row in per_token] == [False, False, True, True]
    per_token = per_token_inverse_frequencies(inv_freq, scaling, positions)
    assert [bool(torch.equal(row, long)) for row in per_token] == [False, False, True, False]


def test_dynamic_matches_transformers_within_max_positions():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config, config = _configs("LlamaConfig", LLAMA_DYNAMIC)
    assert config.rope_scaling.original_max_position_embeddings == 4096 and config.rope_scaling.factor == 2.0
    assert not needs_rope_lengths(config.rope_scaling)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    for seq_len in (None, 1, 4096):
        want, want_factor = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=seq_len)
        assert torch.equal(inv_freq, want) and attention_factor(config.rope_scaling) == want_factor == 1.0
    # NTK rescaling begins only past max_position_embeddings, which the engine never runs.
    beyond, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=4097)
    assert not torch.equal(inv_freq, beyond)
    positions = torch.tensor([0, 5, 4000, 4095])
    want_cos, want_sin = _hf_rotary(hf_config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])


def test_static_types_ignore_rope_lengths():
    _, config = _configs("Qwen2Config", QWEN25_YARN)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    out = per_token_inverse_frequencies(inv_freq, config.rope_scaling, torch.tensor([3, 4]), torch.tensor([9, 9]))
    assert out is inv_freq


# Phi-4-mini: head size 128, three quarters rotated (96 dimensions, 48 frequencies), longrope 4k -> 128k.
PHI4_MINI = dict(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                 original_max_position_embeddings=4096, rope_theta=10000.0, partial_rotary_factor=0.75,
                 rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG})


@pytest.mark.parametrize("rope", ["longrope", "default"])
def test_partial_rotary_matches_transformers_phi3(rope):
    """Phi-4-mini's partial RoPE: frequencies over the first 96 of 128 dimensions, cos/sin that wide,
    and q/k rotated there with the last 32 dimensions passed through, as transformers' Phi3 does."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    fields = dict(PHI4_MINI) if rope == "longrope" else {k: v for k, v in PHI4_MINI.items() if k != "rope_scaling"}
    hf_config = transformers.Phi3Config(vocab_size=100, intermediate_size=128, num_hidden_layers=1, **fields)
    config = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert config.head_dim == 128 and config.rotary_dim == 96
    assert config.rope_scaling.partial_rotary_factor == 0.75
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    rotary = Phi3RotaryEmbedding(hf_config)
    assert inv_freq.shape == ((2, 48) if rope == "longrope" else (48,))
    assert torch.equal(inv_freq[0] if rope == "longrope" else inv_freq, rotary.inv_freq)
    gen = torch.Generator().manual_seed(0)
    for prompt_len in (4096, 4097):  # longrope: the short set, then the long one
        positions = torch.arange(prompt_len)
        want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, T, 96]
        per_token = per_token_inverse_frequencies(inv_freq, config.rope_scaling, positions,
                                                  torch.full((prompt_len,), prompt_len))
        cos, sin = rope_cos_sin(positions, per_token, torch.float32, attention_factor(config.rope_scaling))
        assert cos.shape == (prompt_len, 1, 96)
        assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0]), prompt_len
        q = torch.randn(prompt_len, 24, 128, generator=gen)  # [T, H, D]
        k = torch.randn(prompt_len, 8, 128, generator=gen)
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], want_cos, want_sin)
        rotated_q, rotated_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert torch.equal(rotated_q, want_q[0].transpose(0, 1)) and torch.equal(rotated_k, want_k[0].transpose(0, 1))
        assert torch.equal(rotated_q[..., 96:], q[..., 96:])  # the last quarter passes through
        assert not torch.equal(rotated_q[1:, :, :96], q[1:, :, :96])


def test_rope_lengths_of_a_span():
    """max(prompt length, position + 1) for positions start..end-1: a chunk of the prompt, a chunk that
    crosses into generated tokens (recomputed after preemption), and decode tokens alone."""
    assert rope_lengths_of_span(5, 0, 3) == [5, 5, 5]
    assert rope_lengths_of_span(5, 3, 8) == [5, 5, 6, 7, 8]
    assert rope_lengths_of_span(5, 6, 8) == [7, 8]
    assert rope_lengths_of_span(5, 2, 2) == []
