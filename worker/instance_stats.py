"""What a model-instance worker reports about itself: its lifecycle state, how its model was
loaded, and its load right now.

These are the messages the controller's reconcile loop and the gateway's routing table are
built from, so they are plain frozen dataclasses (they cross Ray as pickles and print without
any prompt text). `InstanceLoad` is fixed once the model is in memory; `InstanceStats` is a
snapshot taken on request — the controller never keeps one longer than its next report.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class InstanceState(str, enum.Enum):
    """Where an instance is in its life; a str so it prints and serialises as its value."""

    SPARE = "spare"  # a pre-started worker process with no model yet (see InstanceWorkerActor)
    LOADING = "loading"  # the actor exists, the model is still being read
    READY = "ready"  # serving
    FAILED = "failed"  # the load failed or the engine thread died; the actor should be replaced
    STOPPED = "stopped"  # shut down on purpose; takes no new requests


@dataclass(frozen=True)
class InstanceLoad:
    """How the model got into this instance (answer of ``ready()``; feeds cold-start metrics).

    ``load_s`` is the whole time from the start of loading to ready (config, tokenizer, weights,
    KV pool); ``weights_load_s`` the part spent reading weights, which ``weights_read`` describes
    (format, bytes, bandwidth) in one line. An instance fed by a peer's stream is ready before its
    weights are all in: ``weights_load_s`` is then None (``InstanceStats`` tells when they are).
    """

    instance_id: str
    model_id: str
    model_dir: str
    load_s: float
    weights_load_s: float | None
    weights_read: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class InstanceStats:
    """One snapshot of an instance's load, for autoscaling (ongoing requests) and routing.

    ``num_ongoing_requests`` counts open streams in the worker — what the autoscaler's
    ``target_ongoing_requests`` is measured against; ``num_waiting_requests`` and
    ``num_running_requests`` split the engine's share of them (queued for KV blocks or a batch
    slot vs. in the running batch). ``started_at`` is wall-clock epoch seconds so it compares
    across processes; load figures are 0 and ``weights_read`` empty until the model is loaded.
    """

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

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool in use (0 while loading)."""
        if self.num_kv_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks
