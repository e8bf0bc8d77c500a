"""The simulator's cost model from a measured `HardwareProfile`: `ProfileCostModel`.

It answers what `SimCluster` and `NodeViews` ask of `sim.cost_model.CostModel` -- slots per
instance, load seconds per tier, each model's prefill and decode times, a migration's pause --
from the profile's measurements instead of a roofline: a model takes one slot (a CPU worker slot
holds one instance), a load reads at the tier's measured rate, a prefill and a decode step cost
what the model's `ModelTiming` says. The accelerator kind callers pass along (`gpu`) is ignored:
the profile is the hardware. The migration pause keeps `CostModel`'s measured factors (a multiple
of a decode step, bench/migration.py).
"""

from __future__ import annotations

import math

from sim.cost_model import LOAD_TIERS, MIGRATION_METHODS, CostModel
from sim.hardware_profile import HardwareProfile, ModelTiming

__all__ = ["ProfileCostModel"]

_PAUSE_FACTORS = CostModel()


class ProfileCostModel:
    """See the module docstring. `engine_start_s` is the profile's start on a warm spare (what
    `SimConfig.cluster_spec` takes as a start's fixed cost)."""

    def __init__(self, profile: HardwareProfile) -> None:
        if not isinstance(profile, HardwareProfile):
            raise ValueError(f"ProfileCostModel needs a HardwareProfile, got {type(profile).__name__}")
        self.profile = profile
        self.engine_start_s = profile.spare_start_s
        self._rates = {"dram": profile.dram_Bps, "ssd": profile.ssd_Bps, "s3": profile.repository_Bps,
                       "gpu": profile.peer_Bps, "remote": profile.peer_Bps}

    def tier_Bps(self, tier: str) -> float:
        if tier not in self._rates:
            raise ValueError(f"unknown load tier {tier!r}; use one of {LOAD_TIERS}")
        return self._rates[tier]

    def load_s(self, weight_bytes: int, tier: str) -> float:
        """Seconds to read `weight_bytes` from `tier` into a worker (start costs not included)."""
        if isinstance(weight_bytes, bool) or not isinstance(weight_bytes, (int, float)) \
                or not math.isfinite(weight_bytes) or weight_bytes < 0:
            raise ValueError(f"weight_bytes must be a finite number >= 0, got {weight_bytes!r}")
        return weight_bytes / self.tier_Bps(tier)

    def accelerators_needed(self, model, gpu=None) -> int:
        """One slot per instance (checked: the profile must have measured the model)."""
        self.profile.timing(model.model_id)
        return 1

    def instance_costs(self, model, gpu=None, *, memoise: bool = True) -> "MeasuredCosts":
        return MeasuredCosts(self.profile.timing(model.model_id))

    def decode_step_s(self, model, gpu, batch: int, context_tokens: float) -> float:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        return self.profile.timing(model.model_id).decode_time_s(batch)

    def prefill_s(self, model, gpu, tokens: int) -> float:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        return self.profile.timing(model.model_id).prefill_time_s(tokens)

    def migration_pause_s(self, model, gpu, batch: int, context_tokens: float, method: str = "kv") -> float:
        """As `CostModel.migration_pause_s`, with this profile's decode step and prefill."""
        if method not in MIGRATION_METHODS:
            raise ValueError(f"unknown migration method {method!r}; use one of {MIGRATION_METHODS}")
        step_s = self.decode_step_s(model, gpu, max(1, batch), 0.0)
        if method == "kv":
            return (_PAUSE_FACTORS.kv_pause_factor - 1) * step_s
        if method == "tokens":
            return (_PAUSE_FACTORS.token_pause_factor - 1) * step_s
        per_sequence = max(1, round(context_tokens / max(1, batch)))
        return max(1, batch) * self.prefill_s(model, gpu, per_sequence)


class MeasuredCosts:
    """`InstanceCosts`' two calls for one measured model (the cluster's hot path)."""

    __slots__ = ("decode_step_s", "prefill_s")

    def __init__(self, timing: ModelTiming) -> None:
        step, per_sequence = timing.decode_step_s, timing.decode_s_per_sequence
        fixed, per_token = timing.prefill_s, timing.prefill_s_per_token
        self.decode_step_s = lambda batch, context_tokens: step + per_sequence * (batch - 1)
        self.prefill_s = lambda tokens: fixed + per_token * tokens
