"""What `bench/multimodel.py` replays its trace against: Thaw's platform under one of its policies
(`ThawSide`), or one Ray Serve application per model (`ServeSide`); each starts, reports which
models have a ready slot, sends a request, sums up what it saw, and stops.
"""

from __future__ import annotations

import asyncio
import collections
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.bursty_trace import TraceRequest
from bench.coldstart import free_port, wait_for
from bench.multimodel_setup import (NUM_SLOTS, START_TIMEOUT_S, TENANT, THAW_POLICIES, THREADS_PER_INSTANCE, BenchMode,
                                    BenchModel)
from bench.trace_client import Sent, percentile, stream_request
from worker import EngineConfig


# ---- Thaw ---------------------------------------------------------------------------------------


class ThawSide:
    """The platform under test, started in this process, and what the sampler gathers from it."""

    def __init__(self, policy: str, mode: BenchMode, models: list[BenchModel], work_dir: Path) -> None:
        from infra.platform import Platform
        from infra.platform_config import GIB, PlatformConfig

        self.mode, self.models = mode, models
        self.index_of = {m.model_id: m.index for m in models}
        self.port = free_port()
        largest = max(m.num_bytes for m in models)
        self.policy = settings = THAW_POLICIES[policy]
        self.shared = shared = settings.memory_is_the_slot
        # Slot hosts share the models out evenly: 8 models on 2 hosts hold 4 each.
        per_process = -(-len(models) // settings.slot_hosts) if settings.slot_hosts else 1
        # Every model's weights and KV pool, plus one more of the largest: a model that comes back
        # while its last instance still drains holds two for a moment. The tight variant gets a
        # share of that, so only some fit: sleep, wake and eviction decide which.
        kv_bytes = EngineConfig().kv_cache_bytes
        budget = int((sum(m.num_bytes for m in models) + (len(models) + 1) * kv_bytes + largest)
                     * settings.budget_share)
        self.config = PlatformConfig.create(
            state_dir=work_dir / policy / "state", port=self.port, namespace=f"multimodel{uuid.uuid4().hex[:8]}",
            auth=False, num_cpus=NUM_SLOTS, cpu_worker_slots_per_node=len(models) if shared else NUM_SLOTS,
            worker_memory_bytes=budget if shared else None, ssd_capacity_bytes=16 * GIB,
            dram_capacity_bytes=4 * GIB, spare_weight_bytes=-(-largest // (1 << 20)) << 20,
            slot_sharing=settings.slot_sharing, models_per_process=per_process)
        self.platform = Platform(self.config)
        self.decisions: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.instances: dict[str, dict[str, Any]] = {}  # instance id -> its last view with a tier
        self.max_memory_used = 0  # the most of a node's worker memory budget seen in use (sampled)

    def start(self) -> None:
        import ray

        self.platform.start()
        self.controller = ray.get_actor(self.config.controller_name, namespace=self.config.namespace)
        for model in self.models:
            ray.get(self.controller.deploy.remote({
                "tenant": TENANT, "name": model.name, "source": str(model.path),
                "resources": {"num_cpus": THREADS_PER_INSTANCE},
                "autoscaling": {"min_instances": 0, "max_instances": 1, "keep_alive_s": self.mode.keep_alive_s,
                                "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
                                "queue_timeout_s": self.mode.queue_timeout_s},
            }), timeout=START_TIMEOUT_S)
        wait_for(lambda: any(n["store_connected"] for n in self._status()["nodes"]), "the node store",
                 START_TIMEOUT_S, 0.2)
        # Where memory is the slot the node keeps a warm process per slot: the trace starts once all
        # are up, so every worker process it uses was started before it (`processes_started_in_trace`).
        controller = self.config.controller
        warm = -(-controller.cpu_worker_slots_per_node // controller.models_per_process) if self.shared else 1
        wait_for(lambda: any(c.get("warm", 0) >= warm for c in self._status()["spare_workers"].values()),
                 f"{warm} warm spare worker(s)", START_TIMEOUT_S, 0.2)
        self.processes_at_start = self._processes_started(self._status())

    @staticmethod
    def _processes_started(status: dict[str, Any]) -> int:
        started = status.get("worker_processes_started", {})
        return started.get("spares", 0) + started.get("instances", 0)

    def _status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.status.remote(), timeout=60)

    def _take(self, status: dict[str, Any]) -> list[int]:
        for decision in status["recent_decisions"]:
            key = (decision.get("kind"), decision.get("model_id"), decision.get("instance_id"), decision.get("at_s"))
            self.decisions[key] = decision
        for node in status["nodes"]:
            if node.get("worker_memory"):
                self.max_memory_used = max(self.max_memory_used, node["worker_memory"]["used_bytes"])
        for instance in status["instances"]:
            if instance["tier"] is not None or instance["instance_id"] not in self.instances:
                self.instances[instance["instance_id"]] = instance
        return [self.index_of[i["model_id"]] for i in status["instances"] if i["state"] == "ready"]

    async def ready_models(self) -> list[int]:
        return self._take(await self.controller.status.remote())

    def send(self, session: Any) -> Callable[[TraceRequest], Awaitable[Sent]]:
        url = f"{self.config.url}/v1/completions"
        deadline_s = self.mode.effective_first_token_deadline_s

        def one(request: TraceRequest) -> Awaitable[Sent]:
            # logprobs 0: each token's text comes back, to check the greedy outputs (`bench.greedy_reference`).
            body = {"model": self.models[request.model_index].model_id, "prompt": list(request.prompt_token_ids),
                    "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "logprobs": 0}
            return stream_request(session, url, body, deadline_s)

        return one

    def finish(self) -> dict[str, Any]:
        """Cold starts by tier and the slot-sharing counters, from a last look at the status."""
        status = self._status()
        self._take(status)
        placed = {d["instance_id"]: d.get("tier") for d in self.decisions.values()
                  if d.get("kind") == "placement" and d.get("instance_id")}
        by_tier: collections.Counter[str] = collections.Counter()
        load_s, num_from_spare = [], 0
        for decision in self.decisions.values():
            if decision.get("kind") != "ready":
                continue
            instance_id = decision["instance_id"]
            seen = self.instances.get(instance_id, {})
            tier = placed.get(instance_id)
            if tier != "repository":
                tier = seen.get("tier") or tier or "unknown"
            by_tier[tier] += 1
            num_from_spare += bool(seen.get("from_spare"))
            if seen.get("load_s") is not None:
                load_s.append(seen["load_s"])
        kinds = collections.Counter(d.get("kind") for d in self.decisions.values())
        return {"cold_starts_by_tier": dict(sorted(by_tier.items())), "cold_starts_from_spare": num_from_spare,
                "cold_start_load_s_median": round(percentile(load_s, 50), 3) if load_s else None,
                "slot_sharing": status.get("slot_sharing", {}).get("counts", {}),
                "num_start_failures": kinds.get("start_failed", 0),
                "processes_started_in_trace": self._processes_started(status) - self.processes_at_start,
                "decision_kinds": dict(sorted((str(k), v) for k, v in kinds.items())),
                "last_tick_errors": status.get("last_tick_errors", []),
                "worker_memory": {"budget_bytes": self.config.controller.worker_memory_bytes,
                                  "max_used_bytes": self.max_memory_used}}

    def stop(self) -> None:
        self.platform.stop()


# ---- Ray Serve -----------------------------------------------------------------------------------


class ServeSide:
    """One Ray Serve application per model on a local Ray with the same 2 CPUs."""

    def __init__(self, mode: BenchMode, models: list[BenchModel], work_dir: Path) -> None:
        self.mode, self.models = mode, models
        self.port = free_port()
        self.start_log = work_dir / "rayserve" / "replica-starts.jsonl"
        self.start_log.parent.mkdir(parents=True, exist_ok=True)
        self.start_log.unlink(missing_ok=True)

    def start(self) -> None:
        import logging

        import ray
        from ray import serve

        from bench.transformers_replica import transformers_replica_app

        ray.init(num_cpus=NUM_SLOTS, namespace=f"multimodel{uuid.uuid4().hex[:8]}", include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        keep_alive_s = self.mode.keep_alive_s
        autoscaling = {"min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0,
                       "downscale_delay_s": keep_alive_s, "downscale_to_zero_delay_s": keep_alive_s,
                       "metrics_interval_s": 0.5, "look_back_period_s": 2.0}
        for model in self.models:
            serve.run(transformers_replica_app(str(model.path), name=model.name, autoscaling=autoscaling,
                                               num_cpus=THREADS_PER_INSTANCE, start_log=str(self.start_log)),
                      name=model.name, route_prefix=f"/{model.name}")

    async def ready_models(self) -> list[int]:
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        ready = []
        for model in self.models:
            app = status.applications.get(model.name)
            if app is not None and model.name in app.deployments:
                ready += [model.index] * app.deployments[model.name].replica_states.get("RUNNING", 0)
        return ready

    def send(self, session: Any) -> Callable[[TraceRequest], Awaitable[Sent]]:
        deadline_s = self.mode.effective_first_token_deadline_s

        def one(request: TraceRequest) -> Awaitable[Sent]:
            url = f"http://127.0.0.1:{self.port}/{self.models[request.model_index].name}"
            return stream_request(session, url, {"prompt": list(request.prompt_token_ids),
                                                 "max_tokens": request.max_tokens}, deadline_s)

        return one

    def finish(self) -> dict[str, Any]:
        lines = self.start_log.read_text().splitlines() if self.start_log.exists() else []
        loads = [json.loads(line) for line in lines if line.strip()]
        return {"cold_starts_by_tier": {"repository": len(loads)} if loads else {},
                "cold_start_load_s_median": round(percentile([r["load_s"] for r in loads], 50), 3) if loads
                else None}

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
