"""Which model class runs a checkpoint: the one place that maps a config's family to its definition.

Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE and Phi-3 share `llama.LlamaForCausalLM` (they differ
only in switches of `ModelConfig`); Gemma 2 and Gemma 3 differ in their norms, MLP, embedding,
soft-capping (Gemma 2) and RoPE settings (Gemma 3) and have their own definitions (`gemma.py`)
behind the same interface. `checkpoint.load_model` and the engine's layer-by-layer start build
models only through `build_model`.
"""

from __future__ import annotations

from worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.model_config import ModelConfig


def build_model(config: ModelConfig) -> LlamaForCausalLM:
    """The model for `config`, with uninitialised weights (build it under ``torch.device("meta")``
    and assign the checkpoint's)."""
    if config.family == "gemma2":
        return Gemma2ForCausalLM(config)
    if config.family == "gemma3":
        return Gemma3ForCausalLM(config)
    return LlamaForCausalLM(config)
