"""What a model-instance worker reports about itself: its lifecycle state, how its model was
loaded, and its load right now (worker -> controller).

The controller's reconcile loop and its routing table are built from these reports, so they are
wire records, defined here once and read by both sides: `InstanceLoad` is the worker's answer to
``ready()``, fixed once the model is in memory; `InstanceStats` is a snapshot taken on request
(``stats()``) -- the controller never keeps one longer than its next report; its state (a
`wire.InstanceState` among `REPORTED_STATES`) is also the answer to ``health()``. None of them holds prompt text.

`InstanceLoad` is the worker's full account of a load; `wire.InstanceLoadRecord` is the
controller's summary of it for the gateway (tier and load time only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wire.instance_state import InstanceState
from wire.wire_record import WireRecord, check_count, check_name, check_optional_seconds, check_seconds

__all__ = ["InstanceLoad", "InstanceStats", "REPORTED_STATES"]

# What a worker says about itself; STOPPING is the controller's own view (see wire.instance_state).
REPORTED_STATES = tuple(s for s in InstanceState if s is not InstanceState.STOPPING)


@dataclass(frozen=True)
class InstanceLoad(WireRecord):
    """How the model got into this instance (answer of ``ready()``; feeds cold-start metrics).

    ``load_s`` is the whole time from the start of loading to ready (config, tokenizer, weights,
    KV pool); ``weights_load_s`` the part spent reading weights, which ``weights_read`` describes
    (format, bytes, bandwidth) in one line; ``weights_pack_s`` the part spent pre-packing linear
    weights for oneDNN on CPU (0 when none were, or when packing was deferred past the start:
    `worker.models.weight_packing`). An instance fed by a peer's stream is ready before its
    weights are all in: ``weights_load_s`` is then None (``InstanceStats`` tells when they are).
    """

    SCHEMA: ClassVar[str] = "instance_ready/1"

    instance_id: str
    model_id: str
    model_dir: str
    load_s: float
    weights_load_s: float | None
    weights_read: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    weights_pack_s: float = 0.0

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "instance_id", self.instance_id)
        check_name(name, "model_id", self.model_id)
        check_name(name, "model_dir", self.model_dir)
        object.__setattr__(self, "load_s", check_seconds(name, "load_s", self.load_s))
        object.__setattr__(self, "weights_pack_s", check_seconds(name, "weights_pack_s", self.weights_pack_s))
        object.__setattr__(self, "weights_load_s", check_optional_seconds(name, "weights_load_s", self.weights_load_s))
        _check_text(name, "weights_read", self.weights_read)
        for field in ("num_kv_blocks", "block_size", "max_model_len"):  # an engine has at least one of each
            object.__setattr__(self, field, check_count(name, field, getattr(self, field), minimum=1))


@dataclass(frozen=True)
class InstanceStats(WireRecord):
    """One snapshot of an instance's load, for autoscaling (ongoing requests) and routing.

    ``num_ongoing_requests`` counts open streams in the worker — what the autoscaler's
    ``target_ongoing_requests`` is measured against; ``num_waiting_requests`` and
    ``num_running_requests`` split the engine's share of them (queued for KV blocks or a batch
    slot vs. in the running batch). ``started_at`` is wall-clock epoch seconds so it compares
    across processes; load figures are 0 and ``weights_read`` empty until the model is loaded.
    ``state`` may be given as its value (``"ready"``, as the dict form carries it).
    """

    SCHEMA: ClassVar[str] = "instance_stats/1"

    instance_id: str
    model_id: str
    state: InstanceState
    num_ongoing_requests: int
    num_waiting_requests: int
    num_running_requests: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_generated_tokens: int
    started_at: float
    load_s: float
    weights_read: str
    weights_resident: bool = True  # False while a peer's stream still delivers layers
    num_weight_streams: int = 0  # streams this instance is sending to new instances now
    # Prefills waiting for a layer still on its way (ids): a fully loaded helper could finish them.
    prefills_at_frontier: tuple[str, ...] = ()
    num_requests_started: int = 0  # requests given to it since it started (a running total)
    pid: int = 0  # the worker's process id on its node (for an operator, and for chaos tests)
    # Prefix caching, running totals in tokens: looked up at admission, and found cached (vLLM's
    # queries and hits; their ratio is the hit rate).
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "instance_id", self.instance_id)
        check_name(name, "model_id", self.model_id)
        object.__setattr__(self, "state", _check_state(name, "state", self.state))
        for field in ("num_ongoing_requests", "num_waiting_requests", "num_running_requests", "num_free_kv_blocks",
                      "num_kv_blocks", "num_generated_tokens", "num_weight_streams", "num_requests_started", "pid",
                      "num_prefix_cache_queried_tokens", "num_prefix_cache_hit_tokens"):
            object.__setattr__(self, field, check_count(name, field, getattr(self, field)))
        object.__setattr__(self, "started_at", check_seconds(name, "started_at", self.started_at))
        object.__setattr__(self, "load_s", check_seconds(name, "load_s", self.load_s))
        _check_text(name, "weights_read", self.weights_read)
        if not isinstance(self.weights_resident, bool):
            raise ValueError(f"{name}.weights_resident must be true or false, got {self.weights_resident!r}")
        ids = self.prefills_at_frontier
        if not isinstance(ids, (tuple, list)):
            raise ValueError(f"{name}.prefills_at_frontier must be a list of request ids, got {type(ids).__name__}")
        for i, request_id in enumerate(ids):
            check_name(name, f"prefills_at_frontier[{i}]", request_id)
        object.__setattr__(self, "prefills_at_frontier", tuple(ids))

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool in use (0 while loading)."""
        if self.num_kv_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks


def _check_text(record: str, field: str, value: object) -> None:
    """A string, empty allowed (a description not written yet)."""
    if not isinstance(value, str):
        raise ValueError(f"{record}.{field} must be a string, got {value!r}")


def _check_state(record: str, field: str, value: object) -> InstanceState:
    """One of the states a worker reports (`REPORTED_STATES`), or its value as the dict form
    carries it."""
    try:
        state = InstanceState(value)
    except ValueError:
        state = None
    if state not in REPORTED_STATES:
        raise ValueError(f"{record}.{field} must be one of {', '.join(repr(s.value) for s in REPORTED_STATES)}, "
                         f"got {value.value if isinstance(value, InstanceState) else value!r}")
    return state
