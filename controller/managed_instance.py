"""One model instance as the controller tracks it between reconcile ticks.

The durable part is the state store's `WorkerRecord` (enough to find the actor again after a
restart); this adds what only a live controller knows: the actor handle, where the checkpoint
was read from, the placement estimate, and the last load report. Mutable on purpose: the
controller updates it as reports arrive, always on its one event loop.

Phases: LOADING from the moment a slot is taken (the checkpoint is being made local, the actor
started, the model read) until ``ready()`` answers, or while a sleeping instance wakes; READY
while it serves (the only phase the routing table lists); ASLEEP once its model scaled down on a
node where memory is the slot and it was put to sleep instead of stopped (its KV pool freed, its
weights kept: it holds only `ManagedInstance.held_memory_bytes` and no slot, and waking it is
fast; on a GPU its weights wait in pinned host memory, so it holds none of the GPU's memory but
keeps its place in the GPU's slot host, `sleeps_to_host`); STOPPING while it finishes its open requests and shuts down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire import InstanceState


@dataclass
class ManagedInstance:
    """Fields:
        instance_id / model_id / node_id / actor_name: as in the worker record; `node_id` is
            the logical node (the node store's id), `ray_node_id` the Ray node it runs on.
        num_worker_slots: slots it occupies on its node.
        memory_bytes: what it takes of its node's worker memory budget (weights plus KV pool;
            `engine_settings.instance_memory_bytes`), held until it is gone.
        kv_memory_bytes: the KV pool's part of `memory_bytes`, which sleeping frees.
        sleeps_to_host: it lives on a GPU, whose engine moves its weights to pinned host memory
            when it sleeps (`worker.Engine.sleep_frees_weights`): asleep it holds none of its GPU's
            memory, but keeps its place (its slot) in the GPU's slot host.
        asleep_s: when it went to sleep (controller clock), None while awake; a sleeper being
            stopped keeps it (its KV pool stays freed).
        repository_name: the model's name in the repository and the node stores.
        tier: the node-store tier its checkpoint was read from ("dram", "ssd"), None if unknown
            (adopted after a restart).
        estimate_s: placement's time-to-ready estimate, None if adopted.
        started_s / ready_s: on the controller's clock; ready_s None until ready.
        num_ongoing_requests / num_generated_tokens / num_requests_started: from the last stats
            report (the last a running total of the requests it was given).
        load_s: the worker's own load time once ready; pack_s the part of it spent pre-packing
            linear weights for oneDNN (0 when deferred past the start, or none were).
        from_spare: the worker is a spare that was assigned this model (no process start).
        hosted: it lives in a slot host (`actor_name` is the host's; `handle` a
            `wire.HostedInstance`), one of the host's models.
        reserves_cpus: its process may hold Ray CPUs for the model (a spare's, or one sharing its
            node by memory, holds none; an adopted one is assumed to).
        load_path: how it gets its weights (a peer's stream or its node's tier) and why; None if
            adopted.
        weights_resident: every layer is in (False while a peer's stream still delivers them:
            such an instance serves, but is no source for another).
        prefills_at_frontier: its requests waiting for a layer still on its way (last report).
        num_running_requests / num_waiting_requests / kv_cache_usage: its engine's batch, queue and
            fraction of KV blocks in use (last report), for the gateways' ``/metrics``.
        pid: the worker's process id on its node (last report; 0 until one).
    """

    instance_id: str
    model_id: str
    node_id: str
    ray_node_id: str
    actor_name: str
    num_worker_slots: int
    repository_name: str
    memory_bytes: int = 0
    kv_memory_bytes: int = 0
    sleeps_to_host: bool = False
    asleep_s: float | None = None
    phase: InstanceState = InstanceState.LOADING
    handle: Any = None
    tier: str | None = None
    estimate_s: float | None = None
    started_s: float = 0.0
    ready_s: float | None = None
    load_s: float | None = None
    pack_s: float | None = None
    num_ongoing_requests: int = 0
    num_generated_tokens: int = 0
    num_requests_started: int = 0
    last_error: str | None = None
    from_spare: bool = False
    hosted: bool = False
    reserves_cpus: bool = True
    load_path: Any = None  # a controller.stream_source_policy.LoadPath
    weights_resident: bool = True
    prefills_at_frontier: tuple[str, ...] = ()
    pid: int = 0
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0

    @property
    def reusable_process(self) -> bool:
        """Its worker process may serve another model once this one is let go: it reserves no Ray
        CPU, so nothing about it was sized for this model."""
        return not self.reserves_cpus

    @property
    def serving(self) -> bool:
        """Counts toward the model's instances (the autoscaler's current count): loading or ready."""
        return self.phase in (InstanceState.LOADING, InstanceState.READY)

    @property
    def kv_pool_freed(self) -> bool:
        """Asleep, or stopping from asleep (`asleep_s` stays set until it wakes): its worker freed
        the KV pool and does not allocate it again on its way out."""
        phase = self.phase
        return phase is InstanceState.ASLEEP or (phase is InstanceState.STOPPING and self.asleep_s is not None)

    @property
    def held_memory_bytes(self) -> int:
        """What it holds of its node's worker memory budget now: its weights alone while its KV
        pool is freed (`kv_pool_freed`), nothing where its weights sleep in host memory."""
        if self.kv_pool_freed:
            return 0 if self.sleeps_to_host else max(0, self.memory_bytes - self.kv_memory_bytes)
        return self.memory_bytes

    @property
    def wake_memory_bytes(self) -> int:
        """What waking it takes of its node's budget on top of what it holds asleep: its KV pool,
        and its weights too where they sleep in host memory."""
        return self.memory_bytes - self.held_memory_bytes if self.kv_pool_freed else 0

    @property
    def holds_slot(self) -> bool:
        """Whether it takes its worker slots: not while its KV pool is freed (a sleeper serves
        nobody; its node's memory budget bounds how many sleep there), except where it sleeps in
        host memory: it holds no device memory then, and its slot is its place in the GPU's slot
        host (which holds at most `models_per_process`), so the slot count bounds the sleepers."""
        return not self.kv_pool_freed or self.sleeps_to_host

    def expected_remaining_s(self, now: float, start_overhead_s: float) -> float | None:
        """How long a client should expect to wait for this loading instance: placement's read
        estimate plus a start's measured fixed cost, less the time it has loaded. None when that is
        unknown: adopted (no estimate), not loading, or past it (an estimate of 0 s would be a lie:
        the instance is late, and nothing says by how much)."""
        if self.phase is not InstanceState.LOADING or self.estimate_s is None:
            return None
        remaining = self.estimate_s + start_overhead_s - (now - self.started_s)
        return remaining if remaining > 0 else None

    def remaining_load_s(self, now: float) -> float:
        """What is left of placement's estimate for a loading instance: its node's loader wait."""
        if self.phase is not InstanceState.LOADING or self.estimate_s is None:
            return 0.0
        return max(0.0, self.estimate_s - (now - self.started_s))

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id, "model_id": self.model_id, "node_id": self.node_id,
            "ray_node_id": self.ray_node_id, "actor_name": self.actor_name, "state": self.phase.value,
            "memory_bytes": self.memory_bytes, "held_memory_bytes": self.held_memory_bytes,
            "sleeps_to_host": self.sleeps_to_host,
            "tier": self.tier, "estimate_s": self.estimate_s, "load_s": self.load_s, "pack_s": self.pack_s,
            "num_ongoing_requests": self.num_ongoing_requests, "num_generated_tokens": self.num_generated_tokens,
            "last_error": self.last_error, "from_spare": self.from_spare, "hosted": self.hosted,
            "load_path": self.load_path.to_dict() if self.load_path is not None else None,
            "weights_resident": self.weights_resident, "pid": self.pid,
        }
