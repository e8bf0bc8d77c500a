"""A measured node for the simulator: `HardwareProfile` (one node kind's slots, tiers and start
costs) with a `ModelTiming` per model (its engine's prefill and decode costs there).

The GPU cost model (`sim.cost_model`) derives times from datasheets and a roofline; a profile
instead carries numbers measured on the hardware a real run used, so the simulator can replay
that run and be compared with it (bench/sim_fidelity.py measures one on the 2-slot CPU node of
bench/multimodel.py). Every field is a plain number; `sim.profile_cost_model.ProfileCostModel`
turns the profile into what `SimCluster` asks of a cost model, `cluster_spec()` into its node
shape, `sim_models()` into its catalog.

Start costs follow the platform's spare-worker pool (`controller.spare_pool`): a start on a warm
spare costs `spare_start_s` beyond reading the weights, one that must start a worker process
costs `process_start_s` more, and a spare taken is replaced once the node has settled (no
instance loading or ready for less than `settle_s`), warm `spare_warm_s` later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.cluster_spec import ClusterSpec
from sim.sim_models import SimModel

__all__ = ["HardwareProfile", "ModelTiming"]


def _seconds(owner: str, name: str, value: object, *, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{owner}.{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


def _int(owner: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ModelTiming:
    """One model's engine costs on the profile's node, as measured (one instance's threads).

    Fields:
        model_id: the model's id in the simulated catalog.
        weight_bytes: its checkpoint's size (what a load reads).
        prefill_s / prefill_s_per_token: a prompt of n tokens takes prefill_s + n x per token
            to its first token.
        decode_step_s / decode_s_per_sequence: one decode step of a batch of b sequences takes
            decode_step_s + (b - 1) x per sequence.
    """

    model_id: str
    weight_bytes: int
    prefill_s: float
    prefill_s_per_token: float
    decode_step_s: float
    decode_s_per_sequence: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"ModelTiming.model_id must be a non-empty string, got {self.model_id!r}")
        owner = f"ModelTiming {self.model_id}"
        _int(owner, "weight_bytes", self.weight_bytes, 1)
        for name in ("prefill_s", "prefill_s_per_token", "decode_s_per_sequence"):
            object.__setattr__(self, name, _seconds(owner, name, getattr(self, name)))
        object.__setattr__(self, "decode_step_s", _seconds(owner, "decode_step_s", self.decode_step_s,
                                                           allow_zero=False))
        if self.prefill_s + self.prefill_s_per_token <= 0:
            raise ValueError(f"{owner}: a one-token prefill would take no time (prefill_s and "
                             f"prefill_s_per_token are both 0); give at least one a measured value")

    def prefill_time_s(self, tokens: int) -> float:
        return self.prefill_s + self.prefill_s_per_token * tokens

    def decode_time_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_s_per_sequence * (batch - 1)


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One node kind, measured; see the module docstring.

    Fields:
        name: what it is (shown in results).
        num_slots: instances one node runs at once (worker slots; a CPU node's are its own).
        dram_bytes / ssd_bytes: the node store's tier capacities (0: no such tier).
        dram_Bps / ssd_Bps / repository_Bps: read rates into a worker from each tier, bytes/s
            (repository: fetched to the SSD tier, then read).
        peer_Bps: the rate a peer stream is assumed to run at (placement compares it with the
            tiers; never exercised where every model has at most one instance).
        spare_start_s: a start on a warm spare worker, beyond the weight read.
        process_start_s: what a start without a warm spare costs on top (a worker process).
        spare_workers: spare workers kept per node (0: every start pays `process_start_s`).
        spare_warm_s: from a spare's start until it is offered.
        settle_s: background work on a node (a spare's start, a DRAM promotion) waits until no
            instance there is loading or has been ready for less than this.
        request_overhead_s: latency every first token carries beyond the engine (client,
            gateway and back), added to each TTFT.
        stop_s / recycle_s: from stopping an idle instance for another model to its slot being
            free for that model: its worker ended, or handed back to the spare pool.
        max_batch: requests one instance serves at once (the engine's max_num_seqs).
        models: one `ModelTiming` per model, ids unique.
        source: where the numbers come from (a command, a run).
    """

    name: str
    num_slots: int
    dram_bytes: int
    ssd_bytes: int
    dram_Bps: float
    ssd_Bps: float
    repository_Bps: float
    peer_Bps: float
    spare_start_s: float
    process_start_s: float
    spare_workers: int = 1
    spare_warm_s: float = 0.0
    settle_s: float = 0.0
    request_overhead_s: float = 0.0
    stop_s: float = 0.0
    recycle_s: float = 0.0
    max_batch: int = 64
    models: tuple[ModelTiming, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareProfile.name must be a non-empty string, got {self.name!r}")
        owner = f"HardwareProfile {self.name}"
        _int(owner, "num_slots", self.num_slots, 1)
        _int(owner, "dram_bytes", self.dram_bytes, 0)
        _int(owner, "ssd_bytes", self.ssd_bytes, 0)
        _int(owner, "spare_workers", self.spare_workers, 0)
        _int(owner, "max_batch", self.max_batch, 1)
        for name in ("dram_Bps", "ssd_Bps", "repository_Bps", "peer_Bps"):
            object.__setattr__(self, name, _seconds(owner, name, getattr(self, name), allow_zero=False))
        for name in ("spare_start_s", "process_start_s", "spare_warm_s", "settle_s", "request_overhead_s", "stop_s",
                     "recycle_s"):
            object.__setattr__(self, name, _seconds(owner, name, getattr(self, name)))
        models = tuple(self.models)
        if not models or not all(isinstance(m, ModelTiming) for m in models):
            raise ValueError(f"{owner}: models must be a non-empty sequence of ModelTiming, got {self.models!r}")
        if len({m.model_id for m in models}) != len(models):
            raise ValueError(f"{owner}: model ids must be unique, got {[m.model_id for m in models]}")
        object.__setattr__(self, "models", models)

    def timing(self, model_id: str) -> ModelTiming:
        for timing in self.models:
            if timing.model_id == model_id:
                return timing
        raise ValueError(f"HardwareProfile {self.name} has no timing for model {model_id!r}; "
                         f"it has {[m.model_id for m in self.models]}")

    def sim_models(self) -> list[SimModel]:
        """The catalog: one `SimModel` per timing, in order (params from bf16 bytes; the shape
        fields stay unknown: the profile's timings replace the formulas that use them)."""
        return [SimModel(model_id=m.model_id, family="measured", params_b=m.weight_bytes / 2e9,
                         weight_bytes=m.weight_bytes) for m in self.models]

    def cluster_spec(self, num_nodes: int = 1):
        """`SimCluster`'s hardware: `num_nodes` of this node."""
        return ClusterSpec(num_nodes=num_nodes, gpus_per_node=self.num_slots, dram_bytes_per_node=self.dram_bytes,
                           ssd_bytes_per_node=self.ssd_bytes, max_batch=self.max_batch,
                           start_overhead_s=self.spare_start_s, spare_workers_per_node=self.spare_workers,
                           process_start_s=self.process_start_s, spare_warm_s=self.spare_warm_s,
                           settle_s=self.settle_s, promote_on_settle=True,
                           request_overhead_s=self.request_overhead_s, stop_s=self.stop_s,
                           recycle_s=self.recycle_s)
