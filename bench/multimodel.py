"""Many models on few slots (issue 18): 8 models of mixed sizes on 2 CPU slots, under a seeded
bursty trace, served by Thaw's slot sharing, by Thaw with keep-alive as a hard lease, and by one
Ray Serve deployment per model.

One run writes 8 random-weight Llamas (`worker.write_demo_model`, bf16, three sizes: ~25, ~80 and
~185 MB; 0.4 to 7 MB with ``--quick``) and generates one trace (`bursty_trace`): the models' popularity
is Zipf (s = 1.1, the ranks shuffled by the seed so size and popularity are unrelated), each model
alternates between on and off bursts of exponential length, and requests arrive as a Poisson
process within its on bursts. Every request is a short prompt of random token ids with a small
``max_tokens``, decoded greedily to the end (``ignore_eos``), so the CPU goes to cold starts and
contention rather than to decoding. The same trace is replayed open loop (asyncio + aiohttp, every
request sent at its arrival time whatever the others do; 300 s of trace, 20 s with ``--quick``)
against, one after the other:

* ``thaw``: the platform `thaw serve` starts (`infra.Platform`, in this process, no auth, a local
  Ray with 2 CPUs, 2 worker slots, 1 engine thread per instance), every model deployed with
  ``min_instances: 0``, ``max_instances: 1`` and the mode's ``keep_alive_s`` and
  ``queue_timeout_s``. A model with waiting requests and no free slot evicts the idle instance
  cheapest to bring back, and past ``max_wait_before_preempt_s`` preempts a busy one;
* ``thaw-keepalive-wait``: the same with ``slot_sharing=False``: keep-alive is a hard lease and a
  waiting model gets a slot only once an idle instance's keep-alive has expired (ServerlessLLM);
* ``thaw-shared``: memory is the slot (#38): the same Ray CPUs, but a slot per model and a worker
  memory budget that holds every model's weights plus KV pool (and one more instance's), so
  nothing is evicted (``slot_sharing.evictions``; ``worker_memory`` has the budget and the most of
  it seen in use). Its node keeps a warm worker process per slot (8), all up before the trace
  starts (``processes_started_in_trace`` counts any started after), so a model's first start
  loads into a warm process (``cold_starts_from_spare``), and a model whose keep-alive ran out
  sleeps (its KV pool freed, its weights kept) and wakes without a load when asked again
  (``slot_sharing.sleeps`` / ``wakes``). The
  line carries its P99 over ``thaw``'s from the same run and the issue's target: at most a
  quarter of the 12.1 s last recorded for ``thaw`` (``TARGET_SHARED_P99_S``);
* ``thaw-hosts`` (only when asked for with ``--policies``): ``thaw-shared`` with 2 slot hosts: two
  warm worker processes hold the 8 models, 4 each (``models_per_process``), their engine steps
  taking turns two at a time (the cores). Its line also says (``host_checks``) whether no worker
  process started during the trace and the sampled memory in use stayed within the budget;
* ``thaw-hosts-tight`` (on request): the same with half that budget, so only some models fit at
  once: idle ones sleep, and sleepers are woken or evicted as demand moves (``host_checks``:
  ``slept_and_woke``);
* ``rayserve``: what a user builds instead: one Ray Serve application per model, each one
  deployment (`bench.transformers_replica`) whose replica loads the checkpoint with
  ``transformers`` and streams greedy tokens, ``min_replicas: 0``, ``max_replicas: 1``, 1 CPU per
  replica on a Ray with 2 CPUs (so at most 2 replicas, the same 2 slots), tuned in its favour
  (``upscale_delay_s: 0``, ``downscale_delay_s`` = ``downscale_to_zero_delay_s`` = the same
  keep-alive, metrics every 0.5 s looked back over 2 s). A request that gets no replica waits as
  Serve makes it wait.

The platform (or Ray) is stopped fully between policies. For every request the client records
whether it succeeded (HTTP 200, no error event, the stream ended with ``[DONE]`` and a finish
reason of ``length``/``stop``) and its time to first token: from sending it to the first ``data:``
event carrying output (SSE comment lines, Thaw's ``: waiting for a slot`` progress, are skipped).
Every policy gets the same client deadlines: a first token within ``queue_timeout_s`` + 5 s (Thaw's
own queue bound, and the grace a client gives it; ``--first-token-deadline-s`` changes it), the
whole answer within 120 s more. A failed request that never got a token counts in the TTFT
percentiles as the first-token deadline, or the time it took to fail if longer -- it is at least as
bad as a request that waited that long -- so a policy cannot improve its P99 by failing requests;
``ttft_p99_censored`` says when a P99 rests on such a stand-in (a lower bound: a peer's censored P99
makes Thaw's ratio to it an upper bound, and caps what the ratio can show at Thaw's P99 / deadline).

How right Thaw's wait estimates are (#37): the first ``: waiting ..., about N s`` comment a
waiting stream receives is compared with what was actually left until its first token;
``wait_estimates`` gives the ratio estimate / actual at P10, median and P90, and the absolute
error |ratio - 1| at the median and P90 (target: within 30% at the median).

Once a second a sampler reads which slots hold a ready instance (Thaw: the controller's
``status()``; Serve: the replicas in state RUNNING); a slot whose model has no request in flight at
the client counts as idle for that second (``idle_slot_s``). Cold starts by tier come from the
controller's recent decisions, gathered by the same sampler: every instance that became ready,
with the tier its placement chose (``repository`` when the node had to fetch the checkpoint) or
else the tier it loaded from; Serve's replicas log each finished load (``repository``: the local
checkpoint directory, the only place Serve reads a model from).

Every Thaw policy asks for each token's text (``logprobs: 0``), and once every policy has run, each
answered request's tokens are checked against the engine run directly on the same checkpoint
(`bench.greedy_reference`): ``greedy`` counts the exact outputs, the near ties (a first difference
where the reference's top two were within ``near_tie_nats``) and the outputs that differ (the
target: none).

Targets (issue 18): no failed request for Thaw's policy; its P99 TTFT at most half of
keep-alive wait's and at most a fifth of Ray Serve's. One JSON line per policy on stdout (the thaw
line carries the ratios, thaw P99 / peer P99, and ``targets_met``), printed once every policy has
run; progress, and whatever Ray and Serve print, on stderr.

    python bench/multimodel.py [--quick] [--seed N] [--duration-s S] [--policies thaw,rayserve]
                               [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (`python bench/multimodel.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.coldstart import free_port, machine, wait_for  # noqa: E402
from bench.bursty_trace import BurstyTraceConfig, TraceRequest, bursty_trace  # noqa: E402
from bench.greedy_reference import (GreedyRequest, ReferenceToken, judge, near_tie_nats, reference_outputs,  # noqa: E402
                                    summarize)
from worker import DemoModelConfig, EngineConfig, write_demo_model  # noqa: E402

POLICIES = ("thaw", "thaw-shared", "thaw-hosts", "thaw-hosts-tight", "thaw-keepalive-wait", "rayserve")
DEFAULT_POLICIES = ("thaw", "thaw-shared", "thaw-keepalive-wait", "rayserve")  # the hosts' two: on request
TARGET_P99_RATIO_TO_KEEPALIVE_WAIT = 0.5
TARGET_SHARED_P99_S = 12.1 / 4  # issue 38: a quarter of thaw's last recorded P99 on this trace
TARGET_P99_RATIO_TO_RAYSERVE = 0.2
NUM_SLOTS = 2
THREADS_PER_INSTANCE = 1
FIRST_TOKEN_GRACE_S = 5.0  # past the queue timeout, before the client gives up on a first token
STREAM_DEADLINE_S = 120.0  # after the first token, for the rest of the answer
SAMPLE_INTERVAL_S = 1.0
START_TIMEOUT_S = 300.0
TENANT = "bench"
NUM_SLOT_HOSTS = 2  # thaw-hosts: the 8 models share two warm processes
TIGHT_BUDGET_SHARE = 0.5  # thaw-hosts-tight: half the budget that holds every model


@dataclass(frozen=True)
class ThawPolicy:
    """How one of Thaw's policies configures the platform."""

    slot_sharing: bool  # evict an idle instance for a waiting model (else keep-alive is a hard lease)
    memory_is_the_slot: bool = False  # a slot per model, a worker memory budget the instances share
    slot_hosts: int = 0  # 0: a process per instance; N: N warm slot hosts hold the models
    budget_share: float = 1.0  # of the budget that holds every model at once


THAW_POLICIES = {
    "thaw": ThawPolicy(slot_sharing=True),
    "thaw-shared": ThawPolicy(slot_sharing=True, memory_is_the_slot=True),
    "thaw-hosts": ThawPolicy(slot_sharing=True, memory_is_the_slot=True, slot_hosts=NUM_SLOT_HOSTS),
    "thaw-hosts-tight": ThawPolicy(slot_sharing=True, memory_is_the_slot=True, slot_hosts=NUM_SLOT_HOSTS,
                                   budget_share=TIGHT_BUDGET_SHARE),
    "thaw-keepalive-wait": ThawPolicy(slot_sharing=False),
}


# ---- modes and models ----------------------------------------------------------------------------


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int,
           dtype: str) -> DemoModelConfig:
    return DemoModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=512,
                           dtype=dtype, init_std=0.1, seed=seed)


@dataclass(frozen=True)
class BenchMode:
    """One mode's models (by size class), trace and lifetimes; the same for every policy."""

    name: str
    sizes: dict[str, tuple[int, int, int, int, int]]  # class -> (hidden, layers, heads, kv heads, intermediate)
    trace: BurstyTraceConfig
    keep_alive_s: float
    queue_timeout_s: float
    first_token_deadline_s: float | None = None  # None: queue_timeout_s + FIRST_TOKEN_GRACE_S
    # The models' dtype. Greedy exactness is a check only in float32: a bfloat16 model's greedy
    # tokens move with the batch a row is computed in (see `bench.greedy_reference`).
    dtype: str = "bfloat16"

    @property
    def effective_first_token_deadline_s(self) -> float:
        """How long the client waits for a first token, the same for every policy."""
        if self.first_token_deadline_s is not None:
            return self.first_token_deadline_s
        return self.queue_timeout_s + FIRST_TOKEN_GRACE_S


FULL = BenchMode("full", {"tiny": (512, 4, 8, 2, 1376), "small": (768, 6, 12, 4, 2048),
                          "medium": (1024, 8, 16, 4, 2816)},
                 BurstyTraceConfig(num_models=8, duration_s=300.0, mean_rate_per_s=1.0, mean_on_s=15.0,
                                   mean_off_s=30.0, min_prompt_tokens=16, max_prompt_tokens=64, max_tokens=32),
                 keep_alive_s=30.0, queue_timeout_s=60.0)
QUICK = BenchMode("quick", {"tiny": (64, 2, 4, 2, 128), "small": (128, 2, 4, 2, 352), "medium": (256, 4, 8, 2, 688)},
                  BurstyTraceConfig(num_models=8, duration_s=20.0, mean_rate_per_s=2.0, mean_on_s=4.0,
                                    mean_off_s=8.0, min_prompt_tokens=8, max_prompt_tokens=32, max_tokens=16),
                  keep_alive_s=10.0, queue_timeout_s=30.0, dtype="float32")


@dataclass(frozen=True)
class BenchModel:
    index: int
    name: str  # "m3-small": the Thaw model name and the Serve application name
    size: str
    path: Path
    num_bytes: int

    @property
    def model_id(self) -> str:
        return f"{TENANT}/{self.name}"


def write_models(mode: BenchMode, root: Path) -> list[BenchModel]:
    """The mode's models, the size classes taken in turn (3 tiny, 3 small, 2 medium of 8)."""
    classes = list(mode.sizes)
    models = []
    for index in range(mode.trace.num_models):
        size = classes[index % len(classes)]
        name = f"m{index}-{size}"
        path = write_demo_model(root / name, _llama(*mode.sizes[size], seed=index, dtype=mode.dtype), overwrite=True)
        models.append(BenchModel(index, name, size, path, sum(p.stat().st_size for p in path.glob("*.safetensors"))))
    return models


def log(message: str) -> None:
    print(f"[multimodel] {message}", file=sys.stderr, flush=True)


# ---- the client ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the client saw of one request; times in seconds from the trace's start."""

    model_index: int
    arrival_s: float
    sent_s: float
    ttft_s: float | None  # None: no output arrived
    end_s: float
    failure: str | None  # None: it succeeded
    estimate: tuple[float, float] | None = None  # the first "about N s" it was told: (when, N), seconds from its send
    tokens: tuple[str, ...] | None = None  # each output token's text, where the stream carried logprobs


@dataclass(frozen=True)
class Sent:
    ttft_s: float | None  # None: no output arrived
    failure: str | None  # None: it succeeded
    estimate: tuple[float, float] | None = None  # the first wait estimate: (seconds after sending, N)
    tokens: tuple[str, ...] | None = None  # the output tokens' texts (completions' logprobs.tokens)


_ABOUT = re.compile(rb"about ([0-9.]+) s")


async def stream_request(session: Any, url: str, body: dict[str, Any], first_token_deadline_s: float) -> Sent:
    """POSTs one streaming request and reads it to its end: its TTFT, failure, the first wait
    estimate a ``: waiting ..., about N s`` comment gave, and (a request that asked for logprobs)
    its tokens' texts."""
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time()
    ttft_s, finish_reason, done, phase = None, None, False, "first-token"
    estimate: tuple[float, float] | None = None
    tokens: list[str] | None = [] if body.get("logprobs") is not None else None
    try:
        async with asyncio.timeout_at(start + first_token_deadline_s) as deadline:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    return Sent(None, f"http-{response.status}", estimate)
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        about = _ABOUT.search(line) if estimate is None and line.startswith(b":") else None
                        if about is not None:  # what the platform says the wait will be
                            estimate = (loop.time() - start, float(about.group(1)))
                        continue  # blank separators and ": ..." comments (progress while waiting)
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        code = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
                        return Sent(ttft_s, f"error-event:{code or 'unknown'}", estimate)
                    choices = event.get("choices") or []
                    if ttft_s is None and ("token" in event or choices):
                        ttft_s = loop.time() - start
                        phase = "stream"
                        deadline.reschedule(loop.time() + STREAM_DEADLINE_S)
                    for choice in choices:
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if tokens is not None and choice.get("logprobs"):
                            tokens.extend(choice["logprobs"].get("tokens") or ())
    except TimeoutError:
        return Sent(ttft_s, f"client-timeout-{phase}", estimate)
    except aiohttp.ClientError as exc:
        return Sent(ttft_s, f"connection-error:{type(exc).__name__}", estimate)
    if not done:
        return Sent(ttft_s, "stream-cut", estimate)
    if ttft_s is None:
        return Sent(None, "no-output", estimate)
    if finish_reason is not None and finish_reason not in ("length", "stop"):
        return Sent(ttft_s, f"finish-{finish_reason}", estimate)
    return Sent(ttft_s, None, estimate, tuple(tokens) if tokens is not None else None)


async def replay(trace: list[TraceRequest], send: Callable[[TraceRequest], Awaitable[Sent]],
                 ready_models: Callable[[], Awaitable[list[int]]]) -> tuple[list[Outcome], float, float]:
    """Sends every request at its arrival time (open loop) and samples the slots once a second
    until the last answer; returns (outcomes, idle slot-seconds, seconds from start to last answer)."""
    loop = asyncio.get_running_loop()
    in_flight: collections.Counter[int] = collections.Counter()
    finished: list[Outcome] = []
    start = loop.time()

    async def one(request: TraceRequest) -> Outcome:
        await asyncio.sleep(max(0.0, start + request.arrival_s - loop.time()))
        sent_s = loop.time() - start
        in_flight[request.model_index] += 1
        try:
            sent = await send(request)
        finally:
            in_flight[request.model_index] -= 1
        outcome = Outcome(request.model_index, request.arrival_s, sent_s, sent.ttft_s, loop.time() - start,
                          sent.failure, sent.estimate, sent.tokens)
        finished.append(outcome)
        return outcome

    async def sample(stop: asyncio.Event) -> float:
        idle_s, last = 0.0, loop.time()
        next_log = 10.0
        while not stop.is_set():
            try:
                ready = await ready_models()
            except Exception as exc:  # noqa: BLE001 - a missed sample only loses that second
                log(f"slot sample failed: {type(exc).__name__}: {exc}")
                ready = None
            now = loop.time()
            if ready is not None:
                idle_s += sum(1 for m in ready if in_flight[m] == 0) * (now - last)
            last = now
            if now - start >= next_log:
                next_log += 10.0
                log(f"  t={now - start:5.1f}s: {len(finished)}/{len(trace)} done "
                    f"({sum(o.failure is not None for o in finished)} failed), {sum(in_flight.values())} in flight, "
                    f"ready slots: {sorted(ready) if ready is not None else '?'}")
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)
            except TimeoutError:
                pass
        return idle_s

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(stop))
    outcomes = await asyncio.gather(*(one(r) for r in trace))
    duration_s = loop.time() - start
    stop.set()
    return list(outcomes), await sampler, duration_s


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


# ---- the run --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    return censored_percentile([(v, False) for v in values], q)[0]


def censored_percentile(values: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """The q-th percentile of (value, censored) pairs, and whether it rests on a censored value
    (a lower bound standing in for a request that never got its token)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low][0] + (ordered[high][0] - ordered[low][0]) * (position - low)
    return value, ordered[low][1] or (ordered[high][1] and position > low)


async def drive(side: ThawSide | ServeSide, trace: list[TraceRequest]) -> tuple[list[Outcome], float, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await replay(trace, side.send(session), side.ready_models)


def run_policy(policy: str, mode: BenchMode, models: list[BenchModel], trace: list[TraceRequest],
               work_dir: Path) -> tuple[dict[str, Any], list[Outcome]]:
    """One policy's JSON line (without the greedy check, which needs every policy's outcomes) and
    its outcomes, in the trace's order."""
    side = ServeSide(mode, models, work_dir) if policy == "rayserve" else ThawSide(policy, mode, models, work_dir)
    log(f"{policy}: starting")
    started = time.monotonic()
    try:
        side.start()
        log(f"{policy}: up in {time.monotonic() - started:.1f} s; replaying {len(trace)} requests")
        outcomes, idle_slot_s, duration_s = asyncio.run(drive(side, trace))
        extra = side.finish()
    finally:
        side.stop()
    deadline_s = mode.effective_first_token_deadline_s
    ttfts = [(o.ttft_s, False) if o.ttft_s is not None else (max(deadline_s, o.end_s - o.sent_s), True)
             for o in outcomes]
    p99_s, p99_censored = censored_percentile(ttfts, 99)
    failures = collections.Counter(o.failure for o in outcomes if o.failure is not None)
    line = {"policy": policy, "num_requests": len(outcomes), "num_failed": sum(failures.values()),
            "failures": dict(sorted(failures.items())),
            "ttft_p50_s": round(censored_percentile(ttfts, 50)[0], 4), "ttft_p99_s": round(p99_s, 4),
            "ttft_p99_censored": p99_censored, "ttft_max_s": round(max(t for t, _ in ttfts), 4), **extra,
            "idle_slot_s": round(idle_slot_s, 2), "duration_s": round(duration_s, 2),
            "max_send_lag_s": round(max(o.sent_s - o.arrival_s for o in outcomes), 3),
            "wait_estimates": wait_estimate_errors(outcomes)}
    log(f"{policy}: {line['num_failed']} failed, TTFT p50 {line['ttft_p50_s']} s p99 {line['ttft_p99_s']} s, "
        f"cold starts {line['cold_starts_by_tier']}, idle slot-s {line['idle_slot_s']}")
    return line, outcomes


def greedy_checks(mode: BenchMode, models: list[BenchModel], trace: list[TraceRequest],
                  outcomes: dict[str, list[Outcome]]) -> dict[str, dict[str, Any]]:
    """Each policy's served tokens against the engine run directly (`bench.greedy_reference`), for
    every request it answered with tokens; the reference runs once per model, after every policy."""
    served = {policy: [(i, o.tokens) for i, o in enumerate(result) if o.failure is None and o.tokens]
              for policy, result in outcomes.items()}
    wanted = sorted({i for pairs in served.values() for i, _ in pairs})
    references: dict[int, tuple[ReferenceToken, ...]] = {}
    for model in models:
        indices = [i for i in wanted if trace[i].model_index == model.index]
        log(f"greedy reference: {model.name}, {len(indices)} requests")
        requests = [GreedyRequest(tuple(trace[i].prompt_token_ids), trace[i].max_tokens) for i in indices]
        references.update(zip(indices, reference_outputs(model.path, requests)))
    tolerance = near_tie_nats(mode.dtype)
    return {policy: summarize([judge(tokens, references[i], tolerance) for i, tokens in pairs], mode.dtype)
            for policy, pairs in served.items()}


def wait_estimate_errors(outcomes: list[Outcome]) -> dict[str, Any]:
    """How right the first wait estimate each waiting request was told was: estimate / actual,
    the actual being what was left until its first token when it was told (requests that got one)."""
    ratios = sorted(est / (o.ttft_s - seen_s) for o in outcomes if o.estimate is not None and o.ttft_s is not None
                    for seen_s, est in [o.estimate] if o.ttft_s - seen_s > 0.05)
    if not ratios:
        return {"num": 0}
    errors = sorted(abs(r - 1.0) for r in ratios)
    return {"num": len(ratios), "ratio_p10": round(percentile(ratios, 10), 3),
            "ratio_median": round(percentile(ratios, 50), 3), "ratio_p90": round(percentile(ratios, 90), 3),
            "abs_error_median": round(percentile(errors, 50), 3), "abs_error_p90": round(percentile(errors, 90), 3)}


def run(mode: BenchMode, seed: int, policies: list[str], work_dir: Path) -> list[dict[str, Any]]:
    import torch

    trace = bursty_trace(mode.trace, seed)
    if not trace:
        raise ValueError("the trace has no request: choose a longer --duration-s or another --seed")
    models = write_models(mode, work_dir / "models")
    sizes = {m.size: m.num_bytes for m in models}
    per_model = collections.Counter(r.model_index for r in trace)
    log(f"{len(trace)} requests over {mode.trace.duration_s:g} s; per model "
        f"{[per_model[m.index] for m in models]}; model bytes {sizes}")
    results, outcomes = {}, {}
    for policy in policies:
        results[policy], outcomes[policy] = run_policy(policy, mode, models, trace, work_dir)
    for policy, greedy in greedy_checks(mode, models, trace, {p: outcomes[p] for p in policies if p in THAW_POLICIES}).items():
        results[policy]["greedy"] = greedy
    common = {"bench": "multimodel", "mode": mode.name, "trace": mode.trace.describe(), "seed": seed,
              "num_models": len(models), "num_slots": NUM_SLOTS, "keep_alive_s": mode.keep_alive_s,
              "queue_timeout_s": mode.queue_timeout_s, "max_tokens": mode.trace.max_tokens,
              "first_token_deadline_s": mode.effective_first_token_deadline_s,
              "model_bytes": sizes, "requests_per_model": [per_model[m.index] for m in models],
              "machine": machine(), "torch": torch.__version__}
    lines = [{**common, **results[policy]} for policy in POLICIES if policy in results]
    for line in lines:
        if line["policy"] == "thaw":
            line.update(ratios_and_targets(line, results))
        if line["policy"] in THAW_POLICIES and THAW_POLICIES[line["policy"]].memory_is_the_slot:
            line.update(shared_targets(line, results))
    return lines


def shared_targets(shared: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Memory as the slot against today's policy in the same run, and the issue's absolute target."""
    figures: dict[str, Any] = {"target_ttft_p99_s": round(TARGET_SHARED_P99_S, 4)}
    if "thaw" in results and results["thaw"]["ttft_p99_s"] > 0:
        figures["p99_ratio_to_thaw"] = round(shared["ttft_p99_s"] / results["thaw"]["ttft_p99_s"], 4)
    figures["targets_met"] = (shared["num_failed"] == 0 and shared["ttft_p99_s"] <= TARGET_SHARED_P99_S
                              and figures.get("p99_ratio_to_thaw", 0.0) < 1.0)
    # What the slot hosts must also show (issue 38): every greedy output exact (near ties allowed,
    # see `bench.greedy_reference`), no worker process started after warm-up, memory within budget;
    # the tight budget must have slept and woken instances.
    settings = THAW_POLICIES[shared["policy"]]
    if settings.slot_hosts:
        counts = shared.get("slot_sharing", {})
        greedy = shared.get("greedy", {})
        checks = {"greedy_exact": greedy.get("differs", 1) == 0 if greedy.get("exact_check") else None,
                  "no_process_started": shared["processes_started_in_trace"] == 0,
                  "within_budget": shared["worker_memory"]["max_used_bytes"] <= shared["worker_memory"]["budget_bytes"]}
        if settings.budget_share < 1.0:
            checks["slept_and_woke"] = counts.get("sleeps", 0) > 0 and counts.get("wakes", 0) > 0
        figures["host_checks"] = checks
        figures["targets_met"] = figures["targets_met"] and all(v is not False for v in checks.values())
    return figures


def ratios_and_targets(thaw: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Thaw's P99 over each peer's measured in the same run, and whether the issue's targets hold
    (only when both peers ran). A peer's censored P99 is a lower bound, so its ratio an upper one."""
    figures: dict[str, Any] = {}
    targets = {"keepalive_wait": ("thaw-keepalive-wait", TARGET_P99_RATIO_TO_KEEPALIVE_WAIT),
               "rayserve": ("rayserve", TARGET_P99_RATIO_TO_RAYSERVE)}
    for key, (peer, _) in targets.items():
        if peer in results:
            peer_p99 = results[peer]["ttft_p99_s"]
            figures[f"p99_ratio_to_{key}"] = round(thaw["ttft_p99_s"] / peer_p99, 4) if peer_p99 > 0 else None
    if all(peer in results for peer, _ in targets.values()):
        figures["targets"] = {"num_failed": 0,
                              **{f"p99_ratio_to_{key}": target for key, (_, target) in targets.items()}}
        figures["targets_met"] = thaw["num_failed"] == 0 and all(
            figures[f"p99_ratio_to_{key}"] is not None and figures[f"p99_ratio_to_{key}"] <= target
            for key, (_, target) in targets.items())
    return figures


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Points file descriptor 1 at stderr meanwhile, so stdout carries only the JSON lines: Ray
    prints messages of its own there (a retried task at shutdown), and processes it starts
    inherit the descriptor."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a 20 s trace (CI smoke run)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument("--duration-s", type=float, default=None, help="trace length (default: 300, quick: 20)")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated subset of {','.join(POLICIES)} (default: {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--first-token-deadline-s", type=float, default=None,
                        help="how long the client waits for a first token, every policy alike (default: the "
                             "queue timeout + 5 s; longer measures how late a peer serves instead of failing it)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="the models' dtype (default: bfloat16, quick: float32); greedy outputs are checked "
                             "exactly only in float32")
    parser.add_argument("--work-dir", type=Path, default=None, help="where models and state go (default: a temp dir)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.duration_s is not None:
        if not args.duration_s > 0:
            parser.error("--duration-s must be > 0")
        mode = dataclasses.replace(mode, trace=dataclasses.replace(mode.trace, duration_s=args.duration_s))
    if args.first_token_deadline_s is not None:
        if not args.first_token_deadline_s > 0:
            parser.error("--first-token-deadline-s must be > 0")
        mode = dataclasses.replace(mode, first_token_deadline_s=args.first_token_deadline_s)
    if args.dtype is not None:
        mode = dataclasses.replace(mode, dtype=args.dtype)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        parser.error(f"--policies takes a subset of {','.join(POLICIES)}, got {args.policies!r}")
    with tempfile.TemporaryDirectory(prefix="thaw-multimodel-", dir=args.work_dir) as tmp:
        with stdout_to_stderr():
            lines = run(mode, args.seed, policies, Path(tmp))
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
