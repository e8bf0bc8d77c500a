"""The architecture of a Llama-family checkpoint, read from its Hugging Face ``config.json``.

One frozen dataclass covers Llama 2/3 (incl. llama3 RoPE scaling), Mistral (sliding window),
Qwen2/2.5 (QKV bias) and Qwen3 (per-head q/k RMSNorm): they differ only in a handful of switches, so one model definition
(`llama.py`) serves all of them. Both config dialects are read: the older ``rope_theta`` +
``rope_scaling`` keys that published checkpoints carry, and transformers 5's
``rope_parameters``. Anything we cannot run exactly is refused by name, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModelError(ValueError):
    """The checkpoint is valid Hugging Face, but not something this engine can run exactly."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    # Qwen3: an RMSNorm over each head's query and key (weights [head_dim]) before RoPE.
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Per layer: the sliding window width, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_hidden_layers)
        if len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows needs one entry per layer")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        """Builds the config from a parsed ``config.json``; ``dtype`` overrides the file's."""
        architectures = raw.get("architectures") or []
        if not architectures:
            raise UnsupportedModelError("config.json names no architecture (the 'architectures' key is missing)")
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {architecture!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        family = SUPPORTED_ARCHITECTURES[architecture]
        quantization = raw.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise UnsupportedModelError(
                f"quantization_config: quantized checkpoints ({method or 'this method'}) are not supported; "
                "deploy the model's bfloat16/float16/float32 weights"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _read_rope(raw)
        layers = raw["num_hidden_layers"]
        file_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_windows=_read_sliding_windows(raw, family, layers),
            dtype=dtype or file_dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str | None = None) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_hf_dict(raw, dtype=dtype)
        except KeyError as exc:
            raise ValueError(f"{path} lacks the required key {exc.args[0]!r}") from exc


def _read_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    kwargs = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in scaling}
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def _read_sliding_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return (None,) * num_layers
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    if family == "mistral":
        return (window,) * num_layers
    return (None,) * num_layers
