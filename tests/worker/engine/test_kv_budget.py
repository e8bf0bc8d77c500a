"""The KV pool's size in tokens and the deploy-time fit check, with exact numbers."""

from __future__ import annotations

from worker.engine.engine_config import EngineConfig
from worker.engine.kv_budget import kv_bytes_per_token, kv_pool_tokens, max_model_len_problem
from worker.models.model_config import ModelConfig

# Llama-3-8B's attention shape: 32 layers, 8 KV heads of 128, bf16: 128 KiB per token.
LLAMA3_8B = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=131072, dtype="bfloat16")


def test_a_default_pool_holds_four_thousand_tokens_of_an_8b_model():
    assert kv_bytes_per_token(LLAMA3_8B) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_pool_tokens(LLAMA3_8B, EngineConfig()) == 4096  # 512 MiB / 128 KiB
    assert kv_pool_tokens(LLAMA3_8B, EngineConfig(num_kv_blocks=10, block_size=16)) == 160


def test_a_context_the_pool_cannot_hold_is_explained_with_the_numbers():
    problem = max_model_len_problem(LLAMA3_8B, EngineConfig(), None)
    assert problem == ("the model's max_position_embeddings 131072 needs 16.0 GiB of KV cache (131072 bytes per "
                       "token in bfloat16), but an instance's KV pool holds 4096 tokens (512.0 MiB): set "
                       "kv_cache_bytes to at least 17179869184, or max_model_len to at most 4096")
    assert max_model_len_problem(LLAMA3_8B, EngineConfig(), 5000).startswith("max_model_len 5000 needs 626.0 MiB")  # 313 whole blocks
    assert max_model_len_problem(LLAMA3_8B, EngineConfig(), 4096) is None
    assert max_model_len_problem(LLAMA3_8B, EngineConfig(kv_cache_bytes=16 << 30), None) is None


def test_a_context_longer_than_the_model_s_is_refused_whatever_the_pool():
    """The engine refuses it at load, so a deploy must say so instead of succeeding first."""
    problem = max_model_len_problem(LLAMA3_8B, EngineConfig(kv_cache_bytes=64 << 30), 200_000)
    assert problem == ("max_model_len 200000 exceeds the model's context (max_position_embeddings 131072): set it "
                       "to at most 131072, or leave it out")
    assert max_model_len_problem(LLAMA3_8B, EngineConfig(kv_cache_bytes=64 << 30), 131072) is None
