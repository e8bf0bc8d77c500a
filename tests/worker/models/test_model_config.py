"""Reading Hugging Face configs of every supported family, in both config dialects."""

from __future__ import annotations

import json

import pytest
import torch

from worker.models.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from worker.models.rotary_embedding import inverse_frequencies

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_llama3_rope_in_old_and_new_dialects_agree():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_type": "llama3"}
    old = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_theta": 500000.0,
                                    "rope_scaling": scaling})
    new = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE,
                                    "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling.rope_type == "llama3"
    assert old.head_dim == 16 and not old.attention_bias


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(**BASE, rope_parameters=params)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(16, 500000.0, RopeScaling(**{k: v for k, v in params.items() if k != "rope_theta"}))
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=0, atol=0)


def test_qwen2_has_qkv_bias_and_mistral_a_window():
    qwen = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE, "use_sliding_window": False,
                                     "sliding_window": 32, "tie_word_embeddings": True})
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.sliding_windows == (None, None)
    mistral = ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **BASE, "sliding_window": 32})
    assert mistral.sliding_windows == (32, 32) and not mistral.attention_bias
    typed = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE, "sliding_window": 8,
                                      "layer_types": ["full_attention", "sliding_attention"]})
    assert typed.sliding_windows == (None, 8)


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "GPT2LMHeadModel"),
        ({"architectures": []}, UnsupportedModelError, "names no architecture"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, UnsupportedModelError, "proportional"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, UnsupportedModelError,
         r"quantization_config: quantized checkpoints \(fp8\) are not supported"),
        ({"num_key_value_heads": 3}, ValueError, "multiple of"),
    ],
)
def test_unsupported_or_invalid_configs_are_refused_by_name(patch, error, message):
    raw = {"architectures": ["LlamaForCausalLM"], **BASE, **patch}
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict(raw)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)
    raw = {"architectures": ["LlamaForCausalLM"], **BASE}
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_model_dir(tmp_path)


def test_qwen3_normalises_queries_and_keys_and_qwen2_does_not():
    qwen3 = ModelConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], **BASE, "head_dim": 128})
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 128)
    qwen2 = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], **BASE})
    assert (qwen2.qk_norm, qwen2.attention_bias) == (False, True)


def test_mixtral_is_sparse_everywhere_with_renormalised_float32_weights():
    mixtral = ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], **BASE, "num_local_experts": 8,
                                        "num_experts_per_tok": 2, "sliding_window": 16, "router_jitter_noise": 0.1})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert (mixtral.norm_topk_prob, mixtral.moe_weights_float32, mixtral.qk_norm) == (True, True, False)
    assert mixtral.moe_layers == (True, True) and mixtral.sliding_windows == (16, 16)
    # attention 2 * (64*(64+2*32) + 64*64 + 2*64); experts 2 * 8 * (3*64*128 + 64); embed + head + norm
    assert mixtral.num_params == 2 * (8192 + 4096 + 128) + 2 * 8 * (24576 + 64) + 2 * 100 * 64 + 64


def test_qwen3_moe_layers_follow_sparse_step_and_mlp_only_layers():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_hidden_layers": 6, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}
    config = ModelConfig.from_hf_dict(raw)
    assert config.moe_layers == (False, True, False, False, False, True)
    assert (config.norm_topk_prob, config.moe_weights_float32, config.qk_norm) == (False, False, True)
    assert (config.intermediate_size, config.moe_intermediate_size) == (128, 32)
    assert config.sliding_windows == (8,) * 6  # transformers' Qwen3-MoE ignores max_window_layers
    # transformers 5 saves num_experts as num_local_experts
    saved = ModelConfig.from_hf_dict({**{k: v for k, v in raw.items() if k != "num_experts"},
                                      "num_local_experts": 4, "norm_topk_prob": True})
    assert saved.num_experts == 4 and saved.norm_topk_prob
    dense = ModelConfig.from_hf_dict({**raw, "num_experts": 0})
    assert dense.moe_layers == (False,) * 6 and dense.num_experts == 0


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"shared_expert_intermediate_size": 256}, UnsupportedModelError,
         r"shared_expert_intermediate_size=256: shared experts are not supported"),
        ({"n_shared_experts": 1}, UnsupportedModelError, "n_shared_experts=1: shared experts"),
        ({"num_experts_per_tok": 5}, ValueError, r"num_experts_per_tok must be between 1 and num_experts \(4\), got 5"),
        ({"num_experts_per_tok": 0}, ValueError, "num_experts_per_tok must be between 1"),
        ({"moe_intermediate_size": 0}, ValueError, "moe_intermediate_size must be a positive integer"),
        ({"decoder_sparse_step": 0}, ValueError, "decoder_sparse_step must be a positive integer, got 0"),
        ({"mlp_only_layers": [2]}, ValueError, r"mlp_only_layers names layers \[2\] outside 0..1"),
        ({"num_experts": -1}, ValueError, "num_experts must be a non-negative integer, got -1"),
    ],
)
def test_invalid_moe_configs_are_refused_by_name(patch, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({**QWEN3_MOE, **patch})


def test_moe_layers_must_match_the_layer_count_and_experts():
    fields = dict(architecture="Qwen3MoeForCausalLM", head_dim=16, **BASE)
    with pytest.raises(ValueError, match="moe_layers needs one entry per layer: 1 for 2 layers"):
        ModelConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, moe_layers=(True,))
    with pytest.raises(ValueError, match="moe_layers marks sparse layers but num_experts is 0"):
        ModelConfig(**fields, moe_layers=(True, False))
    assert ModelConfig(**fields).moe_layers == (False, False)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [float(i + 1) for i in range(8)]}


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
         "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.5, "truncate": False},
        {**LONGROPE, "original_max_position_embeddings": 128, "attention_factor": 1.1},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=["yarn", "longrope", "dynamic"],
)
def test_scaled_rope_in_old_and_new_dialects_agree(scaling):
    old_scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    old = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_theta": 500000.0,
                                    "rope_scaling": old_scaling})
    new = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE,
                                    "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new and old.rope_theta == 500000.0
    rope = old.rope_scaling
    assert rope.rope_type == scaling["rope_type"] and rope.factor == scaling.get("factor", 512 / 128)
    if rope.rope_type == "yarn":
        assert (rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow, rope.mscale,
                rope.mscale_all_dim, rope.attention_factor, rope.truncate) == (128, 16.0, 1.0, 0.707, 1.0, 1.5, False)
    if rope.rope_type == "longrope":
        assert rope.short_factor == (1.0,) * 8 and rope.long_factor == tuple(float(i + 1) for i in range(8))
        assert rope.factor == 4.0 and rope.attention_factor == 1.1  # factor: 512 / 128, as transformers derives it
    if rope.rope_type == "dynamic":  # NTK rescales past the config's max_position_embeddings
        assert rope.original_max_position_embeddings == 512


def test_rope_original_length_as_transformers_resolves_it():
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}
    raw = {"architectures": ["LlamaForCausalLM"], **BASE, "rope_parameters": yarn}
    assert ModelConfig.from_hf_dict(raw).rope_scaling.factor == 8.0  # 512 / 64
    # A top-level original_max_position_embeddings (Phi-3's place for it) wins over the rope dict's.
    top = ModelConfig.from_hf_dict({**raw, "original_max_position_embeddings": 128}).rope_scaling
    assert top.original_max_position_embeddings == 128 and top.factor == 4.0
    # Neither: max_position_embeddings, for llama3 too.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling = ModelConfig.from_hf_dict({**raw, "rope_parameters": llama3}).rope_scaling
    assert scaling.original_max_position_embeddings == 512
    nulls = {"rope_type": "yarn", "factor": 4.0, "beta_fast": None, "beta_slow": 0, "truncate": None}
    scaling = ModelConfig.from_hf_dict({**raw, "rope_parameters": nulls}).rope_scaling
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, False)


@pytest.mark.parametrize(
    "scaling,error,message",
    [
        ({**LONGROPE, "short_factor": [1.0] * 7}, ValueError,
         r"longrope short_factor must be a list of rotary_dim / 2 = 8 numbers, got 7 entries"),
        ({**LONGROPE, "long_factor": None}, ValueError, "longrope long_factor must be a list"),
        ({**LONGROPE, "long_factor": [0.0] * 8}, ValueError, "long_factor: a list of numbers > 0"),
        ({"rope_type": "dynamic"}, ValueError, "rope scaling type 'dynamic' needs a factor"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, ValueError, "attention_factor must be > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -2}, ValueError, "beta_fast must be a number > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, UnsupportedModelError,
         r"partial_rotary_factor 0.5 \(RoPE over part of each head\) is not supported"),
        ({"rope_type": "mrope", "mrope_section": [2, 3, 3]}, UnsupportedModelError,
         "RoPE scaling type 'mrope' is not supported"),
    ],
)
def test_invalid_rope_parameters_are_refused_by_name(scaling, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_parameters": scaling})


def test_top_level_partial_rotary_factor_is_refused():
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **BASE, "partial_rotary_factor": 0.75})


# Phi-4-mini's config.json as published (shrunk): partial rotary and longrope's factor lists at the top level
# dialect, tied embeddings, the original context outside the rope dict.
PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], **BASE, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
             "original_max_position_embeddings": 64, "sliding_window": 262144, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}


def test_phi4_mini_config_reads_partial_rotary_longrope_and_a_window_on_every_layer():
    config = ModelConfig.from_hf_dict(PHI4_MINI)
    assert config.family == "phi3" and config.tie_word_embeddings and not config.attention_bias
    assert config.head_dim == 16 and config.rotary_dim == 12
    scaling = config.rope_scaling
    assert scaling.rope_type == "longrope" and scaling.partial_rotary_factor == 0.75
    assert scaling.original_max_position_embeddings == 64 and scaling.factor == 8.0
    assert scaling.short_factor == (1.0,) * 6 and scaling.long_factor == (2.0,) * 6
    assert config.sliding_windows == (262144, 262144)
    assert inverse_frequencies(config.head_dim, config.rope_theta, scaling).shape == (2, 6)
    # The transformers 5 dialect says the same; "su" is Phi-3's old name for longrope.
    params = {**PHI4_MINI["rope_scaling"], "rope_type": "longrope", "rope_theta": 10000.0,
              "partial_rotary_factor": 0.75}
    new = {k: v for k, v in PHI4_MINI.items() if k not in ("rope_scaling", "partial_rotary_factor")}
    assert ModelConfig.from_hf_dict({**new, "rope_parameters": params}) == config
    su = {**PHI4_MINI["rope_scaling"], "type": "su"}
    assert ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": su}) == config


def test_phi3_mini_defaults_and_ignored_switches():
    """Phi-3-mini-4k: default RoPE over the whole head, rms_norm_eps 1e-5 when left out; attention_bias and
    layer_types mean nothing to transformers' Phi3, so they do not here either."""
    config = ModelConfig.from_hf_dict({"architectures": ["Phi3ForCausalLM"], **BASE, "sliding_window": 8,
                                       "attention_bias": True, "layer_types": ["full_attention"] * 2})
    assert config.rope_scaling == RopeScaling() and config.rotary_dim == 16
    assert config.rms_norm_eps == 1e-5 and not config.attention_bias and config.sliding_windows == (8, 8)


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, UnsupportedModelError,
         r"RoPE type 'linear' is not supported for Phi3ForCausalLM \(supported: default, longrope\)"),
        ({"rope_scaling": {**PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 8}}, ValueError,
         r"longrope short_factor must be a list of rotary_dim / 2 = 6 numbers, got 8 entries"),
        ({"partial_rotary_factor": 1.5}, ValueError, r"partial_rotary_factor must be a number in \(0, 1\], got 1.5"),
        ({"partial_rotary_factor": "half"}, ValueError, "partial_rotary_factor must be a number"),
        # int(16 * 0.7) = 11 dimensions: RoPE rotates pairs.
        ({"partial_rotary_factor": 0.7, "rope_scaling": None}, ValueError,
         r"partial_rotary_factor 0.7 rotates 11 of head_dim 16 dimensions; RoPE needs an even number >= 2"),
    ],
)
def test_invalid_phi3_configs_are_refused_by_name(patch, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({**PHI4_MINI, **patch})


# A published Gemma 3 text config (the 4B's shape, 8 layers), in the older dialect the Hub's files use.
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 512, "hidden_activation": "gelu_pytorch_tanh",
          "query_pre_attn_scalar": 24, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 16, "sliding_window_pattern": 6,
          "attn_logit_softcapping": None, "final_logit_softcapping": None, "rms_norm_eps": 1e-6}


def test_gemma3_config_reads_as_transformers_does_in_both_dialects():
    from transformers import Gemma3TextConfig

    old = ModelConfig.from_hf_dict(GEMMA3)
    assert old.family == "gemma3" and old.qk_norm and old.tie_word_embeddings  # transformers' default: tied
    assert old.query_pre_attn_scalar == 24 and old.local_rope_theta == 10000.0 and old.rope_theta == 1e6
    assert old.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert old.sliding_windows == (16, 16, 16, 16, 16, None, 16, 16)  # every sixth layer is global
    hf = Gemma3TextConfig(**{k: v for k, v in GEMMA3.items() if k not in ("architectures", "model_type")})
    assert old.sliding_windows == tuple(16 if t == "sliding_attention" else None for t in hf.layer_types)
    assert hf.rope_parameters["full_attention"]["rope_theta"] == old.rope_theta
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == old.local_rope_theta
    # transformers 5 writes per-layer-type rope_parameters and layer_types: the same model.
    new_raw = {k: v for k, v in GEMMA3.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                                                            "sliding_window_pattern")}
    new = ModelConfig.from_hf_dict({**new_raw, "layer_types": hf.layer_types, "rope_parameters": hf.rope_parameters})
    assert new == old
    # transformers' defaults: query_pre_attn_scalar 256, a 4096 window, theta 1e6 global and 1e4 local.
    bare = ModelConfig.from_hf_dict({k: v for k, v in new_raw.items() if k not in ("query_pre_attn_scalar",
                                                                                   "sliding_window")})
    assert (bare.query_pre_attn_scalar, bare.rope_theta, bare.local_rope_theta) == (256, 1e6, 1e4)
    assert bare.rope_scaling.rope_type == "default" and bare.sliding_windows[0] == 4096
    assert bare.num_params == old.num_params == (
        8 * (64 * (128 + 2 * 64) + 128 * 64 + 4 * 64 + 2 * 32 + 3 * 64 * 128) + 100 * 64 + 64)
    assert ModelConfig.from_hf_dict({**GEMMA3, "head_dim": None}).head_dim == 256  # transformers' default


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"final_logit_softcapping": 30.0}, UnsupportedModelError,
         "final_logit_softcapping=30.0 is not supported for Gemma3ForCausalLM"),
        ({"attn_logit_softcapping": 50.0}, UnsupportedModelError,
         "attn_logit_softcapping=50.0 is not supported for Gemma3ForCausalLM"),
        ({"hidden_activation": "gelu"}, UnsupportedModelError,
         "hidden_activation 'gelu' is not supported for Gemma3ForCausalLM \\(only 'gelu_pytorch_tanh'\\)"),
        ({"use_bidirectional_attention": True}, UnsupportedModelError, "use_bidirectional_attention=true"),
        ({"sliding_window": None}, ValueError, "Gemma 3 sliding_window must be a positive integer, got None"),
        ({"query_pre_attn_scalar": 0}, ValueError, "Gemma 3 needs query_pre_attn_scalar as a number > 0, got 0"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ValueError,
         "Gemma 3 rope_parameters must map 'full_attention' and 'sliding_attention'"),
        ({"rope_scaling": None, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         UnsupportedModelError, "rope_parameters.sliding_attention.rope_type 'linear' is not supported for Gemma 3"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                           "original_max_position_embeddings": 64}},
         UnsupportedModelError, "rope_parameters.full_attention.rope_type 'longrope' is not supported for Gemma 3"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, UnsupportedModelError,
         "architecture 'Gemma3ForConditionalGeneration' is not supported: the multimodal Gemma 3"),
    ],
)
def test_invalid_gemma3_configs_are_refused_by_name(patch, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({**GEMMA3, **patch})


# A published Gemma 2 config (the 2B's shape, 6 layers), in the older dialect the Hub's files use.
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 100, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 512, "hidden_act": "gelu_pytorch_tanh",
          "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24, "rope_theta": 10000.0,
          "sliding_window": 16, "cache_implementation": "hybrid", "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0, "attention_bias": False, "rms_norm_eps": 1e-6}


def test_gemma2_config_reads_as_transformers_does_in_both_dialects():
    from transformers import Gemma2Config

    old = ModelConfig.from_hf_dict(GEMMA2)
    assert old.family == "gemma2" and old.is_gemma and not old.qk_norm and old.tie_word_embeddings
    assert (old.attn_logit_softcapping, old.final_logit_softcapping) == (50.0, 30.0)
    assert old.query_pre_attn_scalar == 24 and old.local_rope_theta is None and old.rope_theta == 1e4
    assert old.rope_scaling == RopeScaling()
    assert old.sliding_windows == (16, None, 16, None, 16, None)  # every other layer, from the first
    hf = Gemma2Config(**{k: v for k, v in GEMMA2.items() if k not in ("architectures", "model_type")})
    assert old.sliding_windows == tuple(16 if t == "sliding_attention" else None for t in hf.layer_types)
    assert hf.rope_parameters["rope_theta"] == old.rope_theta
    # transformers 5 writes layer_types and rope_parameters: the same model.
    new_raw = {k: v for k, v in GEMMA2.items() if k not in ("rope_theta", "cache_implementation", "hidden_act")}
    new = ModelConfig.from_hf_dict({**new_raw, "layer_types": hf.layer_types, "rope_parameters": hf.rope_parameters})
    assert new == old
    # Omitted soft-capping keys mean transformers' defaults (on); null means off.
    bare = ModelConfig.from_hf_dict({k: v for k, v in new_raw.items() if "softcapping" not in k})
    assert (bare.attn_logit_softcapping, bare.final_logit_softcapping) == (
        Gemma2Config().attn_logit_softcapping, Gemma2Config().final_logit_softcapping) == (50.0, 30.0)
    off = ModelConfig.from_hf_dict({**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (None, None)
    # No q/k norms: two norms fewer per layer than Gemma 3's count.
    assert old.num_params == 6 * (64 * (128 + 2 * 64) + 128 * 64 + 4 * 64 + 3 * 64 * 128) + 100 * 64 + 64
    assert ModelConfig.from_hf_dict({**GEMMA2, "head_dim": None}).head_dim == 256  # transformers' default


@pytest.mark.parametrize(
    "patch,error,message",
    [
        ({"attention_bias": True}, UnsupportedModelError, "attention_bias=true is not supported for Gemma2ForCausalLM"),
        ({"use_bidirectional_attention": True}, UnsupportedModelError,
         "use_bidirectional_attention=true .* only causal Gemma 2 models"),
        ({"hidden_activation": "gelu"}, UnsupportedModelError,
         "hidden_activation 'gelu' is not supported for Gemma2ForCausalLM \\(only 'gelu_pytorch_tanh'\\)"),
        ({"sliding_window": None}, ValueError, "Gemma 2 sliding_window must be a positive integer, got None"),
        ({"query_pre_attn_scalar": 0}, ValueError, "Gemma 2 needs query_pre_attn_scalar as a number > 0, got 0"),
        ({"attn_logit_softcapping": 0.0}, ValueError,
         "Gemma 2 attn_logit_softcapping must be a number > 0 or null \\(no capping\\), got 0.0"),
        ({"final_logit_softcapping": "30"}, ValueError,
         "Gemma 2 final_logit_softcapping must be a number > 0 or null \\(no capping\\), got '30'"),
        ({"layer_types": ["sliding_attention"] * 5}, ValueError, "layer_types has 5 entries for 6 layers"),
    ],
)
def test_invalid_gemma2_configs_are_refused_by_name(patch, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf_dict({**GEMMA2, **patch})


def test_soft_capping_is_a_gemma2_setting_only():
    with pytest.raises(ValueError, match="attn_logit_softcapping is a Gemma 2 setting; leave it None for "
                                         "LlamaForCausalLM"):
        ModelConfig(architecture="LlamaForCausalLM", head_dim=16, attn_logit_softcapping=50.0, **BASE)
