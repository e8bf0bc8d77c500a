"""The simulated model catalog: N models whose sizes come from real open model families.

No public trace names the models behind its requests (see ../shared/traces/README.md), so the
catalog is made, not replayed: each simulated model is a fine-tune of one real architecture,
drawn with the size mix below. Popularity is assigned by the workload (`sim.workload`),
independently of size.

Architectures (parameter counts from each model card; layers, attention width = heads x head
dim, and KV-cache bytes per token = 2 (K and V) x layers x KV heads x head dim x 2 bytes, from
each model's `config.json` on the Hugging Face Hub): Qwen2.5 0.5/1.5/3/7/14/32/72B, Llama-3.2
1/3B, Llama-3 8/70B, Mistral 7B v0.3, Gemma-2 2/9/27B, Phi-3 mini (3.8B) and medium (14B).
Weights are bf16: `weight_bytes = params x 2`.

Size mix (`SIZE_MIX`) -- an assumption, not a measurement: no public source gives the size
distribution of the models a multi-model platform hosts. It is skewed to small models because
that is the population a serverless platform exists for (fine-tunes of 0.5-9B bases that are
too idle to justify a dedicated GPU): 53% are <= 4B, 32% are 7-9B, 10% are 14-32B and 5% are
70B-class. FineServe's replay files (traces README) point the same way -- its "<10B" bucket is
by far its largest -- but carry no model ids to count. Change `SIZE_MIX` to study another mix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["SimModel", "ARCHITECTURES", "SIZE_MIX", "model_catalog"]


@dataclass(frozen=True)
class SimModel:
    """One simulated model. `weight_bytes` are its bf16 weights; `num_layers`,
    `attention_dim` (query heads x head dim) and `kv_bytes_per_token` (bf16 K and V over all
    layers) feed the cost model's attention terms; 0 means unknown, and the cost model then
    uses the Llama-3-8B per-parameter figures (see `sim.cost_model`)."""

    model_id: str
    family: str
    params_b: float
    weight_bytes: int
    num_layers: int = 0
    attention_dim: int = 0
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"SimModel.model_id must be a non-empty string, got {self.model_id!r}")
        if not (isinstance(self.params_b, (int, float)) and math.isfinite(self.params_b) and self.params_b > 0):
            raise ValueError(f"SimModel {self.model_id}: params_b must be a number > 0 (billions), got {self.params_b!r}")
        if not isinstance(self.weight_bytes, int) or self.weight_bytes <= 0:
            raise ValueError(f"SimModel {self.model_id}: weight_bytes must be an int > 0, got {self.weight_bytes!r}")
        for name in ("num_layers", "attention_dim", "kv_bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"SimModel {self.model_id}: {name} must be an int >= 0 (0 = unknown), got {value!r}")


def _kv(layers: int, kv_heads: int, head_dim: int) -> int:
    return 2 * layers * kv_heads * head_dim * 2  # K and V, bf16


# name: (family, params_b, layers, query heads x head dim, KV bytes per token)
ARCHITECTURES: dict[str, tuple[str, float, int, int, int]] = {
    "qwen2.5-0.5b": ("qwen2.5", 0.49, 24, 14 * 64, _kv(24, 2, 64)),
    "llama-3.2-1b": ("llama-3.2", 1.24, 16, 32 * 64, _kv(16, 8, 64)),
    "qwen2.5-1.5b": ("qwen2.5", 1.54, 28, 12 * 128, _kv(28, 2, 128)),
    "gemma-2-2b": ("gemma-2", 2.61, 26, 8 * 256, _kv(26, 4, 256)),
    "qwen2.5-3b": ("qwen2.5", 3.09, 36, 16 * 128, _kv(36, 2, 128)),
    "llama-3.2-3b": ("llama-3.2", 3.21, 28, 24 * 128, _kv(28, 8, 128)),
    "phi-3-mini": ("phi-3", 3.82, 32, 32 * 96, _kv(32, 32, 96)),
    "mistral-7b": ("mistral", 7.25, 32, 32 * 128, _kv(32, 8, 128)),
    "qwen2.5-7b": ("qwen2.5", 7.61, 28, 28 * 128, _kv(28, 4, 128)),
    "llama-3-8b": ("llama-3", 8.03, 32, 32 * 128, _kv(32, 8, 128)),
    "gemma-2-9b": ("gemma-2", 9.24, 42, 16 * 256, _kv(42, 8, 256)),
    "phi-3-medium": ("phi-3", 14.0, 40, 40 * 128, _kv(40, 10, 128)),
    "qwen2.5-14b": ("qwen2.5", 14.7, 48, 40 * 128, _kv(48, 8, 128)),
    "gemma-2-27b": ("gemma-2", 27.2, 46, 32 * 128, _kv(46, 16, 128)),
    "qwen2.5-32b": ("qwen2.5", 32.5, 64, 40 * 128, _kv(64, 8, 128)),
    "llama-3-70b": ("llama-3", 70.6, 80, 64 * 128, _kv(80, 8, 128)),
    "qwen2.5-72b": ("qwen2.5", 72.7, 80, 64 * 128, _kv(80, 8, 128)),
}

# Share of catalog models per architecture (an assumption: see the module docstring). Sums to 1.
SIZE_MIX: dict[str, float] = {
    "qwen2.5-0.5b": 0.10, "llama-3.2-1b": 0.08, "qwen2.5-1.5b": 0.10, "gemma-2-2b": 0.06,
    "qwen2.5-3b": 0.07, "llama-3.2-3b": 0.06, "phi-3-mini": 0.06,            # <= 4B: 53%
    "mistral-7b": 0.08, "qwen2.5-7b": 0.10, "llama-3-8b": 0.10, "gemma-2-9b": 0.04,  # 7-9B: 32%
    "phi-3-medium": 0.02, "qwen2.5-14b": 0.03, "gemma-2-27b": 0.02, "qwen2.5-32b": 0.03,  # 14-32B: 10%
    "llama-3-70b": 0.03, "qwen2.5-72b": 0.02,                                 # 70B-class: 5%
}


def architecture_model(model_id: str, architecture: str) -> SimModel:
    """A `SimModel` named `model_id` with the shape of `architecture` (a key of ARCHITECTURES)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; pick one of {sorted(ARCHITECTURES)}")
    family, params_b, layers, attention_dim, kv_bytes = ARCHITECTURES[architecture]
    return SimModel(model_id=model_id, family=family, params_b=params_b, weight_bytes=int(round(params_b * 1e9)) * 2,
                    num_layers=layers, attention_dim=attention_dim, kv_bytes_per_token=kv_bytes)


def model_catalog(num_models: int, seed: int) -> list[SimModel]:
    """`num_models` models, architecture drawn i.i.d. from SIZE_MIX with a generator seeded by
    `seed`; ids are `m<index>-<architecture>` (zero-padded index), in index order."""
    if not isinstance(num_models, int) or isinstance(num_models, bool) or num_models < 1:
        raise ValueError(f"num_models must be an int >= 1, got {num_models!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    names = list(SIZE_MIX)
    weights = np.array([SIZE_MIX[n] for n in names])
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED_CA7A]))
    picks = rng.choice(len(names), size=num_models, p=weights / weights.sum())
    width = max(5, len(str(num_models - 1)))
    return [architecture_model(f"m{i:0{width}d}-{names[k]}", names[k]) for i, k in enumerate(picks.tolist())]
