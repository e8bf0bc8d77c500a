"""Tiny Hugging Face checkpoints built in the test run (fixed seed, no network).

Weights come from `transformers`' own random initialisation so the checkpoint is exactly
what a user's would look like on disk; the tokenizer is the demo tokenizer trained locally.
``init_std`` is raised above transformers' default so logits are not near-uniform and a
greedy argmax is not decided by float noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
# Tiny mixture-of-experts defaults: 4 experts, top-2, narrow experts (Qwen3-MoE's dense layers keep 128).
ARCH_DEFAULTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # Phi3Config's pad_token_id (32000) lies outside the tiny vocabulary.
    "phi3": dict(pad_token_id=None),
    # Gemma 3: 4 layers, sliding (window 8, so prompts exceed it) and full, a head size that is not
    # hidden / heads, a score scale that is not head_dim's, and both RoPE settings (linear x8 on the
    # full layers, as in the published models).
    "gemma3": dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
                   tie_word_embeddings=True, pad_token_id=None),
    # Gemma 2: the same shape of layers (no q/k norms, one RoPE setting) with soft-capping small enough
    # to bite on random weights: attention scores capped at +-2, final logits at +-3 (the published
    # models' 50 and 30 would leave a tiny model's scores and logits untouched).
    "gemma2": dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
                   pad_token_id=None),
}


def make_hf_checkpoint(out_dir: Path, arch: str = "llama", *, seed: int = 0, init_std: float = 0.1,
                       max_shard_size: str | None = None, stacked_experts: bool = False, **overrides) -> Path:
    """Builds and saves a tiny random ``arch`` model; `stacked_experts` saves MoE experts in
    transformers 5's own stacked layout (``mlp.experts.gate_up_proj``) instead of the per-expert
    names published checkpoints use."""
    import transformers

    from worker.models.demo_model import build_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    kwargs = dict(
        vocab_size=max(len(tok), 512), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=init_std, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    kwargs.update(ARCH_DEFAULTS.get(arch, {}))
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.bos_token_id = tok.bos_token_id
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if stacked_experts:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir
