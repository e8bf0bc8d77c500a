"""The architecture of a Llama-family checkpoint, read from its Hugging Face ``config.json``.

One frozen dataclass covers Llama 2/3 (incl. llama3 RoPE scaling), Mistral (sliding window),
Qwen2/2.5 (QKV bias) and Qwen3 (per-head q/k RMSNorm): they differ only in a handful of switches, so one model definition
(`llama.py`) serves all of them. The mixture-of-experts families, Mixtral and Qwen3-MoE, are the same decoder
with the sparse expert block (`moe.py`) in place of the MLP of some or all layers (the ``num_experts`` to
``moe_layers`` fields); shared experts, which other MoE families have, are refused. Mixtral's
``router_jitter_noise`` is accepted: transformers applies it only while training, so inference is
unaffected. Both config dialects are read: the older ``rope_theta`` +
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
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Config keys of shared (always-on) experts, which other MoE families have; refused if set.
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModelError(ValueError):
    """The checkpoint is valid Hugging Face, but not something this engine can run exactly."""


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE variant and its parameters as transformers reads them (the math is in
    `rotary_embedding.py`). Defaults transformers derives (a missing factor or original length)
    are resolved when the config is read (`_read_rope`), so every field is the value in effect."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # The context the model was pretrained at (llama3, yarn, longrope). For dynamic, the config's
    # max_position_embeddings: transformers' NTK rescaling starts past it.
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between extrapolated and interpolated dimensions, in rotations over the
    # original context; mscale / mscale_all_dim feed the derived attention factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: what cos and sin are multiplied by; None derives it from factor.
    attention_factor: float | None = None
    # longrope: one divisor per frequency (head_dim / 2 each), for sequences up to and beyond
    # original_max_position_embeddings.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if not _is_number(self.factor) or self.factor <= 0:
            raise ValueError(f"rope scaling factor must be a number > 0, got {self.factor!r}")
        omax = self.original_max_position_embeddings
        if not isinstance(omax, int) or isinstance(omax, bool) or omax < 1:
            raise ValueError(f"rope original_max_position_embeddings must be a positive integer, got {omax!r}")
        for name in ("beta_fast", "beta_slow"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"rope {name} must be a number > 0, got {getattr(self, name)!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise ValueError(f"rope {name} must be a number, got {value!r}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"rope attention_factor must be > 0, got {self.attention_factor}")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(self, name)
                if not factors or not all(_is_number(f) and f > 0 for f in factors):
                    raise ValueError(f"longrope needs {name}: a list of numbers > 0 (one per frequency), "
                                     f"got {list(factors)!r}")
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(f"longrope short_factor and long_factor must be equally long, got "
                                 f"{len(self.short_factor)} and {len(self.long_factor)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of its top
    # num_experts_per_tok experts' outputs (see `moe.py`). num_experts 0: every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the top-k routing probabilities to sum to 1 (Mixtral always, Qwen3-MoE per config).
    norm_topk_prob: bool = True
    # Mixtral multiplies expert outputs by float32 routing weights; Qwen3-MoE casts the weights to the
    # model dtype first. The same in float32, not in bfloat16.
    moe_weights_float32: bool = False
    # Per layer: True where the MLP is the sparse expert block, False for a dense MLP.
    moe_layers: tuple[bool, ...] = ()
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
        self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config field {name} must be a non-negative integer, got {value!r}")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_hidden_layers)
        if len(self.moe_layers) != self.num_hidden_layers:
            raise ValueError(f"moe_layers needs one entry per layer: {len(self.moe_layers)} for "
                             f"{self.num_hidden_layers} layers")
        if not self.num_experts:
            if any(self.moe_layers):
                raise ValueError("moe_layers marks sparse layers but num_experts is 0; set num_experts")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be a positive integer when num_experts > 0")

    @property
    def family(self) -> str:
        """The family name of the architecture: llama, mistral, qwen2, qwen3, mixtral or qwen3_moe."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        experts = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # + h: the router's row
        mlps = sum(experts if sparse else 3 * h * i for sparse in self.moe_layers)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + mlps + embed + h

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
        for key in _SHARED_EXPERT_KEYS:
            if raw.get(key):
                raise UnsupportedModelError(f"{key}={raw[key]!r}: shared experts are not supported "
                                            "(supported MoE families: Mixtral, Qwen3-MoE)")
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
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **_read_moe(raw, family, layers),
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
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return theta, RopeScaling(rope_type=rope_type)  # refused by name
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial!r} (RoPE over part of each head) is not "
                                    "supported; only RoPE over the whole head (1.0)")
    kwargs: dict[str, Any] = {k: scaling[k] for k in ("low_freq_factor", "high_freq_factor", "mscale",
                                                      "mscale_all_dim", "attention_factor") if k in scaling}
    factor = scaling.get("factor")
    if rope_type in ("linear", "llama3", "dynamic") and factor is None:
        raise ValueError(f"rope scaling type {rope_type!r} needs a factor (rope_parameters.factor)")
    max_positions = raw.get("max_position_embeddings", 2048)
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings
        # (where Phi-3 keeps it) wins over the rope dict's; max_position_embeddings if neither.
        original = (raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                    or max_positions)
        kwargs["original_max_position_embeddings"] = original
        if factor is None:  # yarn and longrope: the extension the config implies
            factor = max_positions / original
    elif rope_type == "dynamic":
        kwargs["original_max_position_embeddings"] = max_positions
    if factor is not None:
        kwargs["factor"] = factor
    if rope_type == "yarn":
        # transformers: `get(...) or default`, so a null or 0 also means the default.
        kwargs["beta_fast"] = scaling.get("beta_fast") or 32.0
        kwargs["beta_slow"] = scaling.get("beta_slow") or 1.0
        kwargs["truncate"] = bool(scaling.get("truncate", True))
    if rope_type == "longrope":
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        for name in ("short_factor", "long_factor"):
            factors = scaling.get(name)
            if not isinstance(factors, list) or len(factors) != head_dim // 2:
                raise ValueError(f"longrope {name} must be a list of head_dim / 2 = {head_dim // 2} numbers, got "
                                 f"{len(factors) if isinstance(factors, list) else repr(factors)}"
                                 f"{' entries' if isinstance(factors, list) else ''}")
            kwargs[name] = tuple(factors)
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
    if family == "qwen3_moe":  # transformers applies the window to every layer (no max_window_layers)
        return (window if raw.get("use_sliding_window") else None,) * num_layers
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return (None,) * num_layers
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    if family in ("mistral", "mixtral"):
        return (window,) * num_layers
    return (None,) * num_layers


def _read_moe(raw: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Mixtral or Qwen3-MoE config (defaults as transformers' own)."""
    if family == "mixtral":  # every layer sparse; experts as wide as intermediate_size; top-k renormalised
        return dict(num_experts=raw.get("num_local_experts", 8), num_experts_per_tok=raw.get("num_experts_per_tok", 2),
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True, moe_weights_float32=True,
                    moe_layers=(True,) * num_layers)
    if family != "qwen3_moe":
        return {}
    # The Hub's configs say num_experts; transformers 5 saves it as num_local_experts.
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    mlp_only = raw.get("mlp_only_layers") or []
    outside = [i for i in mlp_only if not (isinstance(i, int) and 0 <= i < num_layers)]
    if outside:
        raise ValueError(f"mlp_only_layers names layers {outside} outside 0..{num_layers - 1}")
    if not num_experts:  # transformers: no experts, every layer dense
        return dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=num_experts, num_experts_per_tok=raw.get("num_experts_per_tok", 8),
                moe_intermediate_size=raw.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_weights_float32=False,
                moe_layers=moe_layers)
