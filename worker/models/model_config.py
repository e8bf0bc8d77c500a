"""The architecture of a Llama-family checkpoint, read from its Hugging Face ``config.json``.

One frozen dataclass covers Llama 2/3 (incl. llama3 RoPE scaling), Mistral (sliding window),
Qwen2/2.5 (QKV bias) and Qwen3 (per-head q/k RMSNorm): they differ only in a handful of switches, so one model definition
(`llama.py`) serves all of them. The mixture-of-experts families, Mixtral and Qwen3-MoE, are the same decoder
with the sparse expert block (`moe.py`) in place of the MLP of some or all layers (the ``num_experts`` to
``moe_layers`` fields); shared experts, which other MoE families have, are refused. Mixtral's
``router_jitter_noise`` is accepted: transformers applies it only while training, so inference is
unaffected. Gemma 2 and Gemma 3 text differ in more than switches (their norms, MLP and embedding:
`gemma.py`); their fields here are ``query_pre_attn_scalar``, Gemma 3's ``local_rope_theta`` (its
second RoPE setting) and Gemma 2's soft-capping of attention scores and final logits
(``attn_logit_softcapping``, ``final_logit_softcapping``, transformers' defaults 50 and 30 when the
file omits them); Gemma 3 configs that set the soft-capping switches are refused (published ones
do not). Phi-3/Phi-4-mini is the same decoder too: its
checkpoints store q/k/v and gate/up already fused (as our engine does), and Phi-4-mini rotates only
part of each head (``partial_rotary_factor``).
Both config dialects are read: the older ``rope_theta`` +
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
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# The families `gemma.py` runs: (1 + w) norms, four per layer, GELU-tanh, scaled embeddings.
GEMMA_FAMILIES = ("gemma2", "gemma3")
# transformers' Gemma2Config defaults, in effect when config.json omits the key (null turns it off).
_GEMMA2_SOFTCAP_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# Near misses, with why (the engine lacks something they need).
_REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": ": the multimodal Gemma 3 is not supported; a text-only Gemma3ForCausalLM "
                                      "checkpoint (e.g. gemma-3-1b) is",
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
    # Phi-3/Phi-4-mini: RoPE rotates only the first int(head_dim * partial_rotary_factor) dimensions
    # of each head (`rotary_dim`); the frequencies are computed over those, the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of each head are rotated (transformers' ``int(head_dim * factor)``)."""
        return int(head_dim * self.partial_rotary_factor)

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
        if not _is_number(self.partial_rotary_factor) or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {self.partial_rotary_factor!r}")
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
    # Gemma 2 and 3 (`gemma.py`): scores scaled by query_pre_attn_scalar ** -0.5. Gemma 3: the RoPE
    # base of the sliding-window layers, which rotate without scaling (full layers use rope_theta and
    # rope_scaling).
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # Gemma 2: attention scores and final logits x become cap * tanh(x / cap); None: not capped.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
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
        rotary_dim = self.rotary_dim
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.rope_scaling.partial_rotary_factor} rotates {rotary_dim} of "
                             f"head_dim {self.head_dim} dimensions; RoPE needs an even number >= 2 of them")
        self._check_moe()
        if self.is_gemma:
            label, needed = (("Gemma 3", ("query_pre_attn_scalar", "local_rope_theta")) if self.family == "gemma3"
                             else ("Gemma 2", ("query_pre_attn_scalar",)))
            for name in needed:
                if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                    raise ValueError(f"{label} needs {name} as a number > 0, got {getattr(self, name)!r}")
        for name in _GEMMA2_SOFTCAP_DEFAULTS:
            value = getattr(self, name)
            if value is None:
                continue
            if self.family != "gemma2":
                raise ValueError(f"{name} is a Gemma 2 setting; leave it None for {self.architecture}")
            if not _is_number(value) or value <= 0:
                raise ValueError(f"Gemma 2 {name} must be a number > 0 or null (no capping), got {value!r}")

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
        """The family name of the architecture: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, phi3, gemma2 or
        gemma3."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 or 3: the decoder of `gemma.py`, with its pre/post-feedforward norms."""
        return self.family in GEMMA_FAMILIES

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all of them but for partial RoPE)."""
        return self.rope_scaling.rotary_dim(self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        if self.is_gemma:  # the pre/post-feedforward norms
            per_layer += 2 * h
        if self.family == "gemma3":  # the q/k norms
            per_layer += 2 * self.head_dim
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
            why = _REFUSED_ARCHITECTURES.get(architecture, "")
            raise UnsupportedModelError(
                f"architecture {architecture!r} is not supported{why} "
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
        gemma_family = family in GEMMA_FAMILIES
        act_key, act = ("hidden_activation", "gelu_pytorch_tanh") if gemma_family else ("hidden_act", "silu")
        if raw.get(act_key, act) != act:
            raise UnsupportedModelError(f"{act_key} {raw[act_key]!r} is not supported for {architecture} (only {act!r})")
        if gemma_family:
            _check_gemma(raw, family)
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        for key in _SHARED_EXPERT_KEYS:
            if raw.get(key):
                raise UnsupportedModelError(f"{key}={raw[key]!r}: shared experts are not supported "
                                            "(supported MoE families: Mixtral, Qwen3-MoE)")
        num_heads = raw["num_attention_heads"]
        # Gemma: transformers' defaults (head_dim 256, tied embeddings) are what the Hub's files omit.
        head_dim = raw.get("head_dim") or (256 if gemma_family else raw["hidden_size"] // num_heads)
        if family == "gemma3":
            rope_theta, rope_scaling, gemma = _read_gemma3_rope(raw)
        else:
            rope_theta, rope_scaling = _read_rope(raw, family)
            gemma = {}
        if gemma_family:
            gemma["query_pre_attn_scalar"] = raw.get("query_pre_attn_scalar", 256)
        if family == "gemma2":
            gemma |= {key: raw.get(key, default) for key, default in _GEMMA2_SOFTCAP_DEFAULTS.items()}
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
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5 if family == "phi3" else 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Phi-3 has no attention biases whatever the config says.
            attention_bias=True if family == "qwen2" else family != "phi3" and bool(raw.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            **_read_moe(raw, family, layers),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma_family)),
            sliding_windows=_read_sliding_windows(raw, family, layers),
            **gemma,
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


def _read_rope(raw: dict[str, Any], family: str = "llama") -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if family == "phi3":
        if rope_type in ("su", "yarn"):  # transformers' Phi3Config reads both names as longrope
            rope_type = "longrope"
        if rope_type not in ("default", "longrope"):  # transformers' Phi3Config refuses the others
            raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported for Phi3ForCausalLM "
                                        "(supported: default, longrope)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return theta, RopeScaling(rope_type=rope_type)  # refused by name
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else partial
    if not _is_number(partial) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    if partial != 1.0 and family != "phi3":  # transformers' other families rotate the whole head
        raise UnsupportedModelError(f"partial_rotary_factor {partial!r} (RoPE over part of each head) is not "
                                    f"supported for {family}; only RoPE over the whole head (1.0)")
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
        half = int(head_dim * partial) // 2  # one factor per rotated pair of dimensions
        for name in ("short_factor", "long_factor"):
            factors = scaling.get(name)
            if not isinstance(factors, list) or len(factors) != half:
                raise ValueError(f"longrope {name} must be a list of rotary_dim / 2 = {half} numbers, got "
                                 f"{len(factors) if isinstance(factors, list) else repr(factors)}"
                                 f"{' entries' if isinstance(factors, list) else ''}")
            kwargs[name] = tuple(factors)
    return theta, RopeScaling(rope_type=rope_type, partial_rotary_factor=partial, **kwargs)


def _check_gemma(raw: dict[str, Any], family: str) -> None:
    """Refuses the Gemma 2 / Gemma 3 switches the engine does not run (transformers' defaults are all off)."""
    label = "Gemma 2" if family == "gemma2" else "Gemma 3"
    if family == "gemma3":
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise UnsupportedModelError(f"{key}={raw[key]!r} is not supported for Gemma3ForCausalLM "
                                            "(published Gemma 3 models set it to null)")
    elif raw.get("attention_bias"):  # Gemma 2 would bias o_proj too, which the engine's layout does not hold
        raise UnsupportedModelError("attention_bias=true is not supported for Gemma2ForCausalLM "
                                    "(published Gemma 2 models set it to false)")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true (an encoder) is not supported; "
                                    f"only causal {label} models")
    window = raw.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{label} sliding_window must be a positive integer, got {window!r}")


def _read_gemma3_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling, dict[str, Any]]:
    """Gemma 3's two RoPE settings, as transformers' Gemma3TextConfig resolves them: full-attention
    layers from ``rope_parameters["full_attention"]`` (or the older ``rope_theta``, default 1e6, and
    ``rope_scaling``), sliding layers from ``rope_parameters["sliding_attention"]`` (or
    ``rope_local_base_freq``, default 1e4), which must be unscaled. Returns the global theta and
    scaling and ``{"local_rope_theta": ...}``."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= {"full_attention", "sliding_attention"}:
        raise ValueError("Gemma 3 rope_parameters must map 'full_attention' and 'sliding_attention' to "
                         f"their RoPE settings, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    theta, scaling = _read_rope({**raw, "rope_parameters": full}, "gemma3")
    local_theta, local_scaling = _read_rope({**raw, "rope_parameters": local}, "gemma3")
    if local_scaling.rope_type != "default":
        raise UnsupportedModelError(f"rope_parameters.sliding_attention.rope_type {local_scaling.rope_type!r} is "
                                    "not supported for Gemma 3 (only 'default': sliding layers are unscaled)")
    if scaling.rope_type == "longrope":
        raise UnsupportedModelError("rope_parameters.full_attention.rope_type 'longrope' is not supported for Gemma 3 "
                                    "(supported: default, linear, llama3, yarn, dynamic)")
    return theta, scaling, {"local_rope_theta": local_theta}


def _read_sliding_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if family in GEMMA_FAMILIES:  # transformers' defaults: a 4096 window on every other layer from the first
        window = raw.get("sliding_window", 4096)  # (Gemma 2), on five layers of every six (Gemma 3)
        if not raw.get("layer_types"):
            pattern = raw.get("sliding_window_pattern", 6) if family == "gemma3" else 2
            return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    if family == "phi3":  # transformers' Phi3 windows every layer alike and has no layer_types
        return (window,) * num_layers
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
