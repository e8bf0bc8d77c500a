"""The gateway's Prometheus metrics, in a registry of their own.

Each `GatewayMetrics` owns a fresh `CollectorRegistry` instead of registering on
prometheus_client's process-global one: two gateways (or two tests) in one process then never
collide with "Duplicated timeseries", and ``GET /metrics`` shows exactly this app's series.
Ray Serve's own metrics stay on Ray's exporter.

What is measured and by whom:
- the app, per request: counts by model, endpoint and HTTP status; time to first token;
  inter-token latency; end-to-end latency; prompt and generated tokens; queue time when the
  backend reports one on the first chunk;
- the platform (controller / backend), as events happen: cold starts by the tier the
  checkpoint came from and their load seconds, the number of ready instances per model, every
  ready instance's engine gauges (running and waiting requests, KV-cache use: all nodes, from the
  controller's view, so any replica's scrape shows them; also as vLLM's gauges), and
  each wait in a model's queue, by the cause the controller last gave for it (its outlook's
  status) and how the wait ended.

The ``model`` label only ever carries a resolved model id (or ``""`` when a request failed
before its model was known), never a string from the request body, so a client cannot grow
the number of series by sending made-up model names; ``cause`` and ``outcome`` take only the
values listed in `QUEUE_WAIT_CAUSES` and `QUEUE_WAIT_OUTCOMES`. Metric names follow vLLM's
where they mean the same (``time_to_first_token_seconds``, ``e2e_request_latency_seconds``), and
the per-request series are also exported under vLLM's own names and label (``vllm:...``,
``model_name``; `VLLM_ALIASES`), so dashboards and alerts built for vLLM chart Thaw unchanged.

Several replicas: a scrape reaches one replica, and each counts only the requests it served. So
the series are kept in two registries: ``registry``, the per-request series this replica
observed, and ``platform_registry``, the controller's view that every replica mirrors alike
(instances, cold starts, engine gauges, slot decisions). A replica that knows its identity
(`ReplicaIdentity`, set in a Serve replica) hands its per-request text to its peers through the
controller (`snapshot`, `set_peer_snapshots`: `wire.GatewayMetricsSnapshot`, relayed by
`controller.GatewayMetricsBoard` on each routing refresh), and renders every replica's per-request
series, its own live and its peers' as last received, each sample labelled ``replica`` and
``node``; the platform series once, unlabelled. Sum over ``replica`` for the platform's totals.

``GET /metrics`` is not public, since its labels name every tenant's models: it answers the
admin key or the metrics scrape token (`infra.gateway_access`, `infra.metrics_token`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from wire import EngineGauges, GatewayMetricsSnapshot

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
UNKNOWN_MODEL = ""
# Why a request waited: the status of the controller's last outlook for its model
# (`controller.slot_outlook.OUTLOOK_STATUSES`), "unknown" when none had arrived.
QUEUE_WAIT_CAUSES = ("ready", "loading", "waiting_for_slot", "unplaced", "unknown")
# How the wait ended: an instance took it, the deadline passed (503), the client left or it
# was aborted, or it failed otherwise (the model was deleted, the gateway shut down).
QUEUE_WAIT_OUTCOMES = ("served", "timed_out", "aborted", "failed")


# Our series -> vLLM's name for the same observation (vLLM v1's /metrics; label ``model_name``).
VLLM_ALIASES = {
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "queue_time_seconds": "vllm:request_queue_time_seconds",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
}


@dataclass(frozen=True)
class ReplicaIdentity:
    """Which gateway replica this is, and on which logical node: the labels its per-request
    series carry once several replicas' are rendered together."""

    replica_id: str
    node_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id:
            raise ValueError(f"ReplicaIdentity.replica_id must be a non-empty string, got {self.replica_id!r}")
        if not isinstance(self.node_id, str):
            raise ValueError(f"ReplicaIdentity.node_id must be a string, got {self.node_id!r}")


class GatewayMetrics:
    """Prometheus series for one gateway app; `render` is the ``/metrics`` body. `replica`: this
    replica's identity where there may be several (see the module docstring); None renders this
    app's series alone, unlabelled."""

    def __init__(self, namespace: str = "thaw", replica: ReplicaIdentity | None = None) -> None:
        self.replica = replica
        self.registry = CollectorRegistry(auto_describe=True)  # per request, this replica's
        self.platform_registry = CollectorRegistry(auto_describe=True)  # the controller's view, alike in all
        self._peers: list[GatewayMetricsSnapshot] = []
        r, ns = self.registry, namespace
        self.requests = Counter("gateway_requests", "Requests by model, endpoint and HTTP status.",
                                ["model", "endpoint", "status"], namespace=ns, registry=r)
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "From request arrival to the first generated token.",
            ["model"], namespace=ns, registry=r, buckets=_TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Gap between successive streamed tokens of one request.",
            ["model"], namespace=ns, registry=r, buckets=_ITL_BUCKETS)
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds", "From request arrival to its last token.",
            ["model"], namespace=ns, registry=r, buckets=_E2E_BUCKETS)
        self.queue_time = Histogram(
            "queue_time_seconds", "Time a request waited for a ready instance of its model.",
            ["model"], namespace=ns, registry=r, buckets=_QUEUE_BUCKETS)
        self.queue_wait = Histogram(
            "queue_wait_seconds", "Time a request spent in its model's queue (only requests that joined "
            "one), by the controller's last outlook for the model (cause) and how the wait ended (outcome).",
            ["model", "cause", "outcome"], namespace=ns, registry=r, buckets=_QUEUE_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests.",
                                     ["model"], namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated.",
                                         ["model"], namespace=ns, registry=r)
        self._vllm_ttft = Histogram(VLLM_ALIASES["time_to_first_token_seconds"], "Time to first token (vLLM's name).",
                                    ["model_name"], registry=r, buckets=_TTFT_BUCKETS)
        self._vllm_itl = Histogram(VLLM_ALIASES["inter_token_latency_seconds"], "Inter-token latency (vLLM's name).",
                                   ["model_name"], registry=r, buckets=_ITL_BUCKETS)
        self._vllm_e2e = Histogram(VLLM_ALIASES["e2e_request_latency_seconds"], "End-to-end latency (vLLM's name).",
                                   ["model_name"], registry=r, buckets=_E2E_BUCKETS)
        self._vllm_queue = Histogram(VLLM_ALIASES["queue_time_seconds"], "Time waiting for an instance (vLLM's name).",
                                     ["model_name"], registry=r, buckets=_QUEUE_BUCKETS)
        self._vllm_prompt = Counter(VLLM_ALIASES["prompt_tokens"], "Prompt tokens (vLLM's name).", ["model_name"],
                                    registry=r)
        self._vllm_generation = Counter(VLLM_ALIASES["generation_tokens"], "Generated tokens (vLLM's name).",
                                        ["model_name"], registry=r)
        r = self.platform_registry
        self.cold_starts = Counter("cold_starts", "Model instances started, by the tier the checkpoint came from.",
                                   ["model", "tier"], namespace=ns, registry=r)
        self.load_seconds = Histogram("load_seconds", "Time to load a model instance, by source tier.",
                                      ["model", "tier"], namespace=ns, registry=r, buckets=_LOAD_BUCKETS)
        self.instances = Gauge("model_instances", "Ready instances per model.",
                               ["model"], namespace=ns, registry=r)
        engine = ["model", "instance", "node"]
        self.engine_running = Gauge("engine_requests_running", "Requests in an instance's running batch.", engine,
                                    namespace=ns, registry=r)
        self.engine_waiting = Gauge("engine_requests_waiting", "Requests queued in an instance's engine.", engine,
                                    namespace=ns, registry=r)
        self.engine_kv_usage = Gauge("engine_kv_cache_usage", "Fraction of an instance's KV blocks in use (0..1).",
                                     engine, namespace=ns, registry=r)
        vllm_engine = ["model_name", "engine"]
        self._vllm_running = Gauge("vllm:num_requests_running", "Running requests (vLLM's name).", vllm_engine,
                                   registry=r)
        self._vllm_waiting = Gauge("vllm:num_requests_waiting", "Waiting requests (vLLM's name).", vllm_engine,
                                   registry=r)
        self._vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache use, 0..1 (vLLM's name).", vllm_engine,
                                    registry=r)
        # A gauge, not a counter: it mirrors the controller's own counts, which start again at 0
        # when the controller restarts (Prometheus' rate() over it still reads as a counter's).
        self.slot_decisions = Gauge(
            "slot_decisions", "Slot-sharing decisions since the controller started, by kind: evictions, "
            "preemptions (migrated or suspended), requests suspended, parked with their KV, resumed with it, "
            "instances put to sleep and woken.",
            ["kind"], namespace=ns, registry=r)

    # ---- per request (the app) -----------------------------------------------------------

    def record_request(self, model_id: str, endpoint: str, status: int) -> None:
        self.requests.labels(model=model_id, endpoint=endpoint, status=str(status)).inc()

    def record_first_token(self, model_id: str, seconds: float) -> None:
        self.time_to_first_token.labels(model=model_id).observe(seconds)
        self._vllm_ttft.labels(model_name=model_id).observe(seconds)

    def record_inter_token(self, model_id: str, seconds: float) -> None:
        self.inter_token_latency.labels(model=model_id).observe(seconds)
        self._vllm_itl.labels(model_name=model_id).observe(seconds)

    def record_queue_time(self, model_id: str, seconds: float) -> None:
        self.queue_time.labels(model=model_id).observe(seconds)
        self._vllm_queue.labels(model_name=model_id).observe(seconds)

    def record_finished(self, model_id: str, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.e2e_latency.labels(model=model_id).observe(e2e_s)
        self.prompt_tokens.labels(model=model_id).inc(num_prompt_tokens)
        self.generation_tokens.labels(model=model_id).inc(num_output_tokens)
        self._vllm_e2e.labels(model_name=model_id).observe(e2e_s)
        self._vllm_prompt.labels(model_name=model_id).inc(num_prompt_tokens)
        self._vllm_generation.labels(model_name=model_id).inc(num_output_tokens)

    # ---- platform events (controller / backend) ------------------------------------------

    def record_cold_start(self, model_id: str, tier: str, load_s: float) -> None:
        """One instance of `model_id` became ready after loading from `tier` ("gpu", "dram", "ssd", "repository")."""
        self.cold_starts.labels(model=model_id, tier=tier).inc()
        self.load_seconds.labels(model=model_id, tier=tier).observe(load_s)

    def record_queue_wait(self, model_id: str, cause: str, outcome: str, seconds: float) -> None:
        """One request left `model_id`'s queue after `seconds`; a `cause` or `outcome` outside
        `QUEUE_WAIT_CAUSES` / `QUEUE_WAIT_OUTCOMES` is a bug."""
        if cause not in QUEUE_WAIT_CAUSES:
            raise ValueError(f"queue wait cause must be one of {QUEUE_WAIT_CAUSES}, got {cause!r}")
        if outcome not in QUEUE_WAIT_OUTCOMES:
            raise ValueError(f"queue wait outcome must be one of {QUEUE_WAIT_OUTCOMES}, got {outcome!r}")
        self.queue_wait.labels(model=model_id, cause=cause, outcome=outcome).observe(seconds)

    def set_slot_decisions(self, counts: Mapping[str, int]) -> None:
        """The controller's slot-sharing counters, as it reported them last."""
        for kind, value in counts.items():
            self.slot_decisions.labels(kind=kind).set(value)

    def set_engine_gauges(self, gauges: Sequence[EngineGauges]) -> None:
        """Every ready instance's engine load as the controller reported it; instances no longer
        listed drop out (their series end rather than freeze at the last value)."""
        series = (self.engine_running, self.engine_waiting, self.engine_kv_usage,
                  self._vllm_running, self._vllm_waiting, self._vllm_kv_usage)
        for gauge in series:
            gauge.clear()
        for g in gauges:
            ours = {"model": g.model_id, "instance": g.instance_id, "node": g.node_id}
            theirs = {"model_name": g.model_id, "engine": g.instance_id}
            self.engine_running.labels(**ours).set(g.num_running_requests)
            self.engine_waiting.labels(**ours).set(g.num_waiting_requests)
            self.engine_kv_usage.labels(**ours).set(g.kv_cache_usage)
            self._vllm_running.labels(**theirs).set(g.num_running_requests)
            self._vllm_waiting.labels(**theirs).set(g.num_waiting_requests)
            self._vllm_kv_usage.labels(**theirs).set(g.kv_cache_usage)

    def set_instances(self, model_id: str, num_instances: int) -> None:
        self.instances.labels(model=model_id).set(num_instances)

    def forget_model(self, model_id: str) -> None:
        """Drops a deleted model's instance gauge (counters keep their history until restart)."""
        try:
            self.instances.remove(model_id)
        except KeyError:
            pass

    # ---- exposition -----------------------------------------------------------------------

    def snapshot(self) -> GatewayMetricsSnapshot | None:
        """This replica's per-request series for its peers; None without a `ReplicaIdentity`."""
        if self.replica is None:
            return None
        return GatewayMetricsSnapshot(replica_id=self.replica.replica_id, node_id=self.replica.node_id,
                                      text=generate_latest(self.registry).decode())

    def set_peer_snapshots(self, snapshots: Iterable[GatewayMetricsSnapshot]) -> None:
        """The other replicas' latest per-request series (this replica's own is never taken twice)."""
        own = self.replica.replica_id if self.replica is not None else None
        self._peers = [s for s in snapshots if s.replica_id != own]

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` body and its content type: the per-request series (every replica's,
        labelled, when this one has a `ReplicaIdentity`), then the platform's."""
        if self.replica is None:
            return generate_latest(self.registry) + generate_latest(self.platform_registry), CONTENT_TYPE_LATEST
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_ReplicaSeries([(self.replica, generate_latest(self.registry).decode())]
                                       + [(ReplicaIdentity(p.replica_id, p.node_id), p.text) for p in self._peers]))
        return generate_latest(merged) + generate_latest(self.platform_registry), CONTENT_TYPE_LATEST


class _ReplicaSeries:
    """A collector over several replicas' exposition texts: one family per name, every sample
    labelled with its replica and node. A peer's text that does not parse is left out (and
    logged): one bad snapshot must not take the scrape down."""

    def __init__(self, texts: Sequence[tuple[ReplicaIdentity, str]]) -> None:
        self._texts = texts

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for identity, text in self._texts:
            labels = {"replica": identity.replica_id, "node": identity.node_id}
            try:
                parsed = list(text_string_to_metric_families(text))
            except ValueError as exc:
                logger.warning("gateway replica %s sent metrics that do not parse: %s", identity.replica_id, exc)
                continue
            for family in parsed:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, **labels}, sample.value, sample.timestamp)
        return list(families.values())
