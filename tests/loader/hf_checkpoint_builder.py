"""Tiny Llama-style Hugging Face safetensors checkpoints for the loader tests.

Built with plain torch + `safetensors.torch.save_file` (no transformers): the loader only cares
about names, dtypes, shapes and bytes. Shapes are small and mostly not multiples of 4096 bytes,
so alignment padding is exercised. `lm_head.weight` sits in the *first* shard of the sharded
variant, so the tests see the converter move it to the end (layer order, not file order).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 48
INTERMEDIATE = 80
VOCAB = 100
LAYER_TENSORS = {  # suffix -> shape
    "input_layernorm.weight": (HIDDEN,),
    "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
    "post_attention_layernorm.weight": (HIDDEN,),
    "self_attn.k_proj.weight": (HIDDEN // 2, HIDDEN),
    "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "self_attn.v_proj.weight": (HIDDEN // 2, HIDDEN),
}
CONFIG_TEXT = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 48}\n'
TOKENIZER_TEXT = '{"model": {"type": "BPE", "vocab": {"a": 0}}}\n'


def llama_tensors(num_layers: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """name -> tensor, in the order a Llama state dict lists them."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN)}
    for i in range(num_layers):
        for suffix, shape in LAYER_TENSORS.items():
            tensors[f"model.layers.{i}.{suffix}"] = rand(*shape)
    tensors["model.norm.weight"] = rand(HIDDEN)
    tensors["lm_head.weight"] = rand(VOCAB, HIDDEN)
    return tensors


def write_hf_checkpoint(model_dir: Path, tensors: dict[str, torch.Tensor], *, num_shards: int = 1) -> Path:
    """Write `tensors` as model.safetensors (num_shards=1) or as shards plus an index, with a
    config.json and tokenizer.json next to them."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(CONFIG_TEXT)
    (model_dir / "tokenizer.json").write_text(TOKENIZER_TEXT)
    if num_shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return model_dir
    names = list(tensors)
    # lm_head first: a file order that differs from layer order.
    names = ["lm_head.weight", *[n for n in names if n != "lm_head.weight"]]
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n] for n in names[k * per_shard: (k + 1) * per_shard]}
        save_file(shard, str(model_dir / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in shard}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir
