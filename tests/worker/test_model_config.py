"""Reading Hugging Face configs of every supported family, in both config dialects."""

from __future__ import annotations

import json

import pytest
import torch

from worker.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from worker.rotary_embedding import inverse_frequencies

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
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
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
