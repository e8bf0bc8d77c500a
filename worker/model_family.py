"""Which model class runs a checkpoint: the one place that maps a config's family to its definition.

Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE and Phi-3 share `llama.LlamaForCausalLM` (they differ
only in switches of `ModelConfig`); Gemma 3 differs in its norms, MLP, embedding and RoPE and has
its own definition (`gemma.py`) behind the same interface. `checkpoint.load_model` and the engine's
layer-by-layer start build models only through `build_model`.
"""

from __future__ import annotations

from worker.gemma import Gemma3ForCausalLM
from worker.llama import LlamaForCausalLM
from worker.model_config import ModelConfig


def build_model(config: ModelConfig) -> LlamaForCausalLM:
    """The model for `config`, with uninitialised weights (build it under ``torch.device("meta")``
    and assign the checkpoint's)."""
    if config.family == "gemma3":
        return Gemma3ForCausalLM(config)
    return LlamaForCausalLM(config)
