"""One simulation run: `SimConfig` in, `SimResult` out (`run_simulation`).

It wires the parts together: the model catalog (`sim.sim_models`), the workload
(`sim.workload`, fed to the event loop one arrival at a time, so a day of millions of requests
never sits in memory), the cost model (`sim.cost_model`), the cluster (`sim.sim_cluster`), one
policy (`sim.policies`) and the tick scheduler. The run goes on past the last arrival until every
request has finished and every instance is gone or asleep (or `drain_limit_s` more), so each policy pays
for its own tail (a keep-alive, a downscale delay) in accelerator-seconds.

Measured besides the simulated figures: the wall time of each controller tick (the policy's
`tick`, which is where the real policy functions run), so the decision time per tick is known at
the scale simulated.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controller.read_path import check_short_fetch_ratio

from sim.event_loop import EventLoop
from sim.hardware_profile import HardwareProfile
from sim.policies import POLICY_NAMES, PolicySettings, ThawAutoscaling
from sim.policy_factory import make_policy
from sim.profile_cost_model import ProfileCostModel
from sim.cluster_spec import ClusterSpec
from sim.sim_cluster import COLD_START_TIERS, SimCluster
from sim.tick_scheduler import TickScheduler
from sim.ttft_floor import first_load_floor_s, percentile_floor_s

__all__ = ["SimConfig", "SimResult", "run_simulation"]

GIB = 1 << 30
GPU_KINDS = ("H100", "H200", "A100")


def _int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"SimConfig.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"SimConfig.{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One run.

    Fields:
        num_models / num_nodes / gpus_per_node / hours / seed: the scenario.
        policy: one of `POLICY_NAMES`.
        trace_dir: folder of raw traces to fit the workload from (None: the bundled fit).
        source: the workload source (`sim.workload.SOURCES`).
        requests_per_model_per_hour: the mean load (None: the source's default).
        tick_s: the controller's reconcile interval.
        slo_ttft_s: the TTFT bound SLO attainment counts against.
        gpu: the accelerator kind ("H100", "H200", "A100").
        target_ongoing_requests / max_instances / keep_alive_s: `PolicySettings`, alike for all.
        max_batch / dram_gib_per_node / ssd_gib_per_node: `ClusterSpec`.
        drain_limit_s: how long past the last arrival the run may go on.
        sample_s: how often accelerators in use are sampled for the plot.
        thaw_sharing: the controller config's `SlotSharingSettings` for Thaw's policy (None: its
            defaults: evict an instance idle 0.5 s, preempt a busy one ready 2 s).
        thaw_max_wait_before_preempt_s: the model spec's bounded wait before Thaw preempts (None:
            its default, 5 s).
        thaw_spec: the spec settings Thaw's policy is deployed with on a GPU cluster
            (`ThawAutoscaling`: keep-alive per restart, scale delays; its defaults);
            `ThawAutoscaling.controller_defaults()` for the controller's own. Not used with
            `thaw_autoscaling`, whose own settings apply.
        thaw_slot_reclaim: Thaw's policy frees a slot for a cold model when no node has room by
            migrating a busy instance's requests to a sibling of its model (the controller's default
            `ControllerConfig.slot_reclaim`); False: never, as ``slot_reclaim=None``.
        thaw_slot_sharing: False: Thaw's policy without slot sharing, as the controller with
            ``slot_sharing=None`` (keep-alive a hard lease, no eviction or preemption; then
            `thaw_sharing` must be None). True: with `thaw_sharing` (or its defaults).
        thaw_autoscaling: every model's whole `AutoscalingPolicy` for Thaw's policy (its delays,
            keep-alive, bounded wait), as a real deployment's spec gives it (None: built from
            `target_ongoing_requests` / `max_instances` / `keep_alive_s` and the defaults).
        real_controller_timing: the controller's timing as its loop has it: a periodic tick
            `tick_s` after the last one rather than on a fixed grid, and (Thaw's policy) a model's
            requests known at the next tick, when it reads the workers' stats. False: ticks on the
            grid and requests known at once, as the cluster-scale figures in BENCHMARKS.md were taken.
        queue_timeout_s: a request no instance took within this long fails, as the gateway fails
            it after the spec's ``queue_timeout_s`` (`ClusterSpec.queue_timeout_s`; every policy
            alike). None: requests wait as long as it takes.
        staged_tier: "ssd" or "dram": every node's SSD holds every model's checkpoint when the run
            starts, and with "dram" its DRAM too, each as far as it fits, as on a cluster that has
            served the catalog before, so no request waits for a first fetch from the repository
            (the density figure's set-up); None: the repository alone holds them. A tier too small
            for all holds the most requested models first, by the generator's expected rates (what
            a day of history gives; the counts of `requests` when they are given or replayed), as
            its LRU would after serving them. Policies that keep no node copies (Ray-Serve-like,
            unbounded) read the repository all the same.
        thaw_models_per_gpu: Thaw's GPUs as slot hosts (`ClusterSpec.models_per_gpu`): each holds up
            to this many models at once as far as their weights and KV pools fit its memory
            (`gpu_memory_utilization` of it), their decode steps taking turns, as the controller's
            ``models_per_process`` with ``gpu_memory_bytes``; 1: a GPU per model. The other policies
            always have a GPU per model (neither ServerlessLLM nor Ray Serve shares a GPU's memory
            between models).
        thaw_sleep: on slot hosts, an idle instance Thaw's policy scales down sleeps (its GPUs'
            memory freed, its weights in pinned host memory, woken over the link) rather than
            stopping, as the controller's ``sleep_idle_instances`` (its default); False: it stops.
        concurrent_loads: a node's loads from SSD and the repository in flight at once, sharing its
            read path (`ClusterSpec.concurrent_loads`); 1: one at a time, as the node store fetches.
        short_fetch_ratio: one at a time, a load this many times shorter than another goes first
            (`ClusterSpec.short_fetch_ratio`; 8, the default, as the node store; 0: arrival order).
        hardware: a measured `HardwareProfile` (`sim.hardware_profile`): the nodes, the catalog
            and the costs all come from it, replacing `gpu`, `gpus_per_node`, `dram_gib_per_node`,
            `ssd_gib_per_node` and `max_batch` (then `num_models` must be its model count).
    """

    num_models: int
    num_nodes: int
    gpus_per_node: int = 8
    hours: float = 1.0
    seed: int = 0
    policy: str = "thaw"
    trace_dir: Path | None = None
    source: str = "azure_functions"
    requests_per_model_per_hour: float | None = None
    tick_s: float = 1.0
    slo_ttft_s: float = 5.0
    gpu: str = "H100"
    target_ongoing_requests: float = 16.0
    max_instances: int = 8
    keep_alive_s: float = 60.0
    max_batch: int = 64
    dram_gib_per_node: int = 512
    ssd_gib_per_node: int = 4096
    drain_limit_s: float = 7200.0
    sample_s: float = 60.0
    thaw_sharing: object = None
    thaw_max_wait_before_preempt_s: float | None = None
    thaw_spec: ThawAutoscaling = field(default_factory=ThawAutoscaling)
    thaw_slot_reclaim: bool = True
    thaw_slot_sharing: bool = True
    thaw_autoscaling: object = None
    real_controller_timing: bool = False
    staged_tier: str | None = None
    queue_timeout_s: float | None = None
    thaw_models_per_gpu: int = 1
    thaw_sleep: bool = True
    concurrent_loads: int = 1
    short_fetch_ratio: float = 8.0
    hardware: object = None

    def __post_init__(self) -> None:
        _int("num_models", self.num_models, 1)
        _int("num_nodes", self.num_nodes, 1)
        _int("gpus_per_node", self.gpus_per_node, 1)
        _int("seed", self.seed, 0)
        _int("max_instances", self.max_instances, 1)
        _int("max_batch", self.max_batch, 1)
        _int("dram_gib_per_node", self.dram_gib_per_node, 0)
        _int("ssd_gib_per_node", self.ssd_gib_per_node, 0)
        object.__setattr__(self, "hours", _seconds("hours", self.hours))
        for name in ("tick_s", "slo_ttft_s", "target_ongoing_requests", "sample_s"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        for name in ("keep_alive_s", "drain_limit_s"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name), allow_zero=True))
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"SimConfig.policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.gpu not in GPU_KINDS:
            raise ValueError(f"SimConfig.gpu must be one of {', '.join(GPU_KINDS)}, got {self.gpu!r}")
        if self.trace_dir is not None:
            object.__setattr__(self, "trace_dir", Path(self.trace_dir))
        if self.thaw_sharing is not None:
            from controller import SlotSharingSettings
            if not isinstance(self.thaw_sharing, SlotSharingSettings):
                raise ValueError(f"SimConfig.thaw_sharing must be a controller SlotSharingSettings or None, "
                                 f"got {type(self.thaw_sharing).__name__}")
        if self.thaw_max_wait_before_preempt_s is not None:
            object.__setattr__(self, "thaw_max_wait_before_preempt_s",
                               _seconds("thaw_max_wait_before_preempt_s", self.thaw_max_wait_before_preempt_s,
                                        allow_zero=True))
        if not isinstance(self.thaw_spec, ThawAutoscaling):
            raise ValueError(f"SimConfig.thaw_spec must be a sim.policies.ThawAutoscaling, "
                             f"got {type(self.thaw_spec).__name__}")
        if self.thaw_autoscaling is not None:
            from controller import AutoscalingPolicy
            if not isinstance(self.thaw_autoscaling, AutoscalingPolicy):
                raise ValueError(f"SimConfig.thaw_autoscaling must be a controller AutoscalingPolicy or None, "
                                 f"got {type(self.thaw_autoscaling).__name__}")
            if self.thaw_max_wait_before_preempt_s is not None:
                raise ValueError("SimConfig: give thaw_max_wait_before_preempt_s or thaw_autoscaling (whose "
                                 "max_wait_before_preempt_s it is), not both")
        if not isinstance(self.thaw_slot_reclaim, bool):
            raise ValueError(f"SimConfig.thaw_slot_reclaim must be True or False, got {self.thaw_slot_reclaim!r}")
        if not isinstance(self.thaw_slot_sharing, bool):
            raise ValueError(f"SimConfig.thaw_slot_sharing must be True or False, got {self.thaw_slot_sharing!r}")
        if not self.thaw_slot_sharing and self.thaw_sharing is not None:
            raise ValueError("SimConfig: thaw_sharing settings were given with thaw_slot_sharing=False; give one")
        if self.queue_timeout_s is not None:
            object.__setattr__(self, "queue_timeout_s", _seconds("queue_timeout_s", self.queue_timeout_s))
        if self.staged_tier not in (None, "ssd", "dram"):
            raise ValueError(f"SimConfig.staged_tier must be 'ssd', 'dram' or None, got {self.staged_tier!r}")
        if not isinstance(self.real_controller_timing, bool):
            raise ValueError(f"SimConfig.real_controller_timing must be True or False, "
                             f"got {self.real_controller_timing!r}")
        _int("thaw_models_per_gpu", self.thaw_models_per_gpu, 1)
        _int("concurrent_loads", self.concurrent_loads, 1)
        check_short_fetch_ratio(self.short_fetch_ratio, "SimConfig.short_fetch_ratio")
        if not isinstance(self.thaw_sleep, bool):
            raise ValueError(f"SimConfig.thaw_sleep must be True or False, got {self.thaw_sleep!r}")
        if self.hardware is not None and self.thaw_models_per_gpu > 1:
            raise ValueError("SimConfig.thaw_models_per_gpu shares a GPU's memory: it needs a GPU kind, "
                             "not a measured hardware profile")
        if self.hardware is not None:
            if not isinstance(self.hardware, HardwareProfile):
                raise ValueError(f"SimConfig.hardware must be a HardwareProfile or None, "
                                 f"got {type(self.hardware).__name__}")
            if self.num_models != len(self.hardware.models):
                raise ValueError(f"SimConfig.num_models ({self.num_models}) must be the hardware profile's model "
                                 f"count ({len(self.hardware.models)})")

    def cluster_spec(self, start_overhead_s: float, gpu_memory_bytes: int | None = None) -> ClusterSpec:
        """The run's cluster; `gpu_memory_bytes`: what a slot host's instances may take of a GPU
        (used when Thaw's GPUs are slot hosts, `thaw_models_per_gpu`)."""
        if self.hardware is not None:
            return dataclasses.replace(self.hardware.cluster_spec(self.num_nodes), queue_timeout_s=self.queue_timeout_s,
                                       concurrent_loads=self.concurrent_loads, short_fetch_ratio=self.short_fetch_ratio)
        hosts = self.policy == "thaw" and self.thaw_models_per_gpu > 1
        return ClusterSpec(num_nodes=self.num_nodes, gpus_per_node=self.gpus_per_node,
                           dram_bytes_per_node=self.dram_gib_per_node * GIB,
                           ssd_bytes_per_node=self.ssd_gib_per_node * GIB, max_batch=self.max_batch,
                           start_overhead_s=start_overhead_s, queue_timeout_s=self.queue_timeout_s,
                           models_per_gpu=self.thaw_models_per_gpu if hosts else 1,
                           concurrent_loads=self.concurrent_loads, short_fetch_ratio=self.short_fetch_ratio,
                           gpu_memory_bytes=gpu_memory_bytes if hosts else None)

    def policy_settings(self) -> PolicySettings:
        return PolicySettings(target_ongoing_requests=self.target_ongoing_requests,
                              max_instances=self.max_instances, keep_alive_s=self.keep_alive_s)


@dataclass(frozen=True)
class SimResult:
    """What one run measured. `ttft_s` has one entry per request in arrival order (NaN: never
    served within the drain limit; it counts as a miss and as +inf in the percentiles)."""

    policy: str
    num_requests: int
    num_served: int
    ttft_p50_s: float
    ttft_p99_s: float
    slo_ttft_s: float
    slo_attainment: float
    accelerator_s: float
    cold_starts: int
    cold_starts_by_tier: dict[str, int]
    migrations: int
    evictions: int
    preemptions: int
    decision_ms_p50: float | None
    decision_ms_p99: float | None
    num_ticks: int
    sim_end_s: float
    wall_s: float
    num_events: int
    ttft_s: np.ndarray = field(repr=False)
    accelerators_in_use: tuple[tuple[float, int], ...] = field(repr=False, default=())
    counts: dict[str, int] = field(default_factory=dict)
    settings: dict[str, object] = field(default_factory=dict)
    cpu_s: float | None = None  # this process's CPU seconds for the run (wall_s counts waits for a busy core too)
    # The P99 no policy that loads on demand can beat: first loads at the bandwidth of where the
    # run starts each checkpoint (`sim.ttft_floor`); None for the unbounded reference.
    ttft_p99_floor_s: float | None = None

    def summary(self) -> dict[str, object]:
        """The figures as a JSON-ready dict (infinite percentiles as None)."""
        def finite(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, 6)

        return {"policy": self.policy, "num_requests": self.num_requests, "num_served": self.num_served,
                "ttft_p50_s": finite(self.ttft_p50_s), "ttft_p99_s": finite(self.ttft_p99_s),
                "slo_ttft_s": self.slo_ttft_s, "slo_attainment": round(self.slo_attainment, 6),
                "accelerator_s": round(self.accelerator_s, 3), "cold_starts": self.cold_starts,
                "cold_starts_by_tier": dict(self.cold_starts_by_tier), "migrations": self.migrations,
                "evictions": self.evictions, "preemptions": self.preemptions,
                "decision_ms_p50": finite(self.decision_ms_p50), "decision_ms_p99": finite(self.decision_ms_p99),
                "num_ticks": self.num_ticks, "sim_end_s": round(self.sim_end_s, 3), "wall_s": round(self.wall_s, 3),
                "cpu_s": None if self.cpu_s is None else round(self.cpu_s, 3),
                "ttft_p99_floor_s": finite(self.ttft_p99_floor_s),
                "num_events": self.num_events, "counts": dict(self.counts), "settings": dict(self.settings)}


def _gpu(name: str):
    from sim.cost_model import A100, H100, H200

    return {"H100": H100, "H200": H200, "A100": A100}[name]


class _Feeder:
    """Hands the workload's requests to the event loop's feed one at a time, in arrival order."""

    def __init__(self, cluster: SimCluster, requests: Iterable) -> None:
        self.cluster = cluster
        self.requests = iter(requests)
        self.num_requests = 0
        self.done = False
        self.last_arrival_s = 0.0
        self.arrival_s = array("d")  # [R] each request's arrival, for the TTFT floor
        self.model_index = array("l")  # [R] its model

    def pull(self) -> tuple | None:
        """The next arrival as the loop's feed item, None after the last."""
        request = next(self.requests, None)
        if request is None:
            self.done = True
            return None
        model_index = self.cluster.model_index.get(request.model_id)
        if model_index is None:
            raise ValueError(f"the workload names model {request.model_id!r}, which is not in the catalog")
        index = self.num_requests
        self.num_requests += 1
        self.arrival_s.append(request.arrival_s)
        self.model_index.append(model_index)
        self.last_arrival_s = max(self.last_arrival_s, request.arrival_s)
        return (request.arrival_s, self.cluster.arrive,
                (index, model_index, request.input_tokens, request.output_tokens))


def _first_load_s(cluster: SimCluster) -> np.ndarray:
    """[M] each model's earliest first load at the run's start (`sim.ttft_floor`): its checkpoint
    from the fastest tier any node holds it in (the repository where none does) and the engine
    start every policy pays at least."""
    dram, ssd = set(), set()
    for node in cluster.nodes:  # what was staged; a node's tiers are empty without staging
        dram.update(node.dram.models())
        ssd.update(node.ssd.models())
    out = np.empty(len(cluster.models))
    for index, state in enumerate(cluster.models):
        tier = "dram" if index in dram else "ssd" if index in ssd else "s3"
        out[index] = cluster.cost.load_s(state.model.weight_bytes, tier) + cluster.spec.start_overhead_s
    return out


def run_simulation(config: SimConfig, progress: Callable[[float, float], None] | None = None, *,
                   models: list | None = None, requests: Iterable | None = None, cost=None,
                   memoise_costs: bool = True) -> SimResult:
    """Run `config`; `progress(sim_s, horizon_s)` is called every `sample_s` of simulated time.
    `models`, `requests` and `cost` replace the catalog, workload and cost model (tests);
    `memoise_costs=False` runs the cost model's checked methods instead of its fast path (the same
    figures, slower: the reference the tests compare with)."""
    started = time.perf_counter()
    started_cpu = time.process_time()
    if cost is None:
        from sim.cost_model import default_cost_model
        cost = default_cost_model() if config.hardware is None else ProfileCostModel(config.hardware)
    if models is None:
        from sim.sim_models import model_catalog
        models = model_catalog(config.num_models, config.seed) if config.hardware is None \
            else config.hardware.sim_models()
    workload = None  # the generator's config, when the workload is generated here
    if requests is None:
        from sim.workload import WorkloadConfig, generate_workload
        workload = WorkloadConfig(num_models=config.num_models, hours=config.hours, seed=config.seed,
                                  trace_dir=config.trace_dir, source=config.source,
                                  requests_per_model_per_hour=config.requests_per_model_per_hour)
        requests = generate_workload(workload, models)
    gpu = _gpu(config.gpu) if config.hardware is None else None  # a profile is its own hardware
    loop = EventLoop()
    gpu_memory = int(gpu.hbm_bytes * cost.gpu_memory_utilization) if gpu is not None else None
    cluster = SimCluster(config.cluster_spec(cost.engine_start_s, gpu_memory), models, cost, gpu, loop,
                         memoise_costs=memoise_costs)
    policy = make_policy(config.policy, config.policy_settings(), thaw_sharing=config.thaw_sharing,
                         thaw_max_wait_before_preempt_s=config.thaw_max_wait_before_preempt_s,
                         thaw_autoscaling=config.thaw_autoscaling,
                         thaw_activity_at_ticks=config.real_controller_timing,
                         thaw_spec=config.thaw_spec if config.thaw_autoscaling is None else None,
                         thaw_slot_sharing=config.thaw_slot_sharing,
                         thaw_slot_reclaim=config.thaw_slot_reclaim, thaw_sleep=config.thaw_sleep)
    decision_s: list[float] = []

    def on_tick(now: float) -> None:
        t0 = time.perf_counter()
        policy.tick(now)
        decision_s.append(time.perf_counter() - t0)

    ticks = TickScheduler(loop, config.tick_s, on_tick, from_last_tick=config.real_controller_timing)
    cluster.attach(policy)
    policy.attach(cluster, ticks)
    if config.staged_tier is not None and cluster.keep_copies:
        rates = None
        if workload is not None and workload.source != "azure_llm":
            from sim.workload import expected_requests_per_hour
            rates = expected_requests_per_hour(workload, models)
        if rates is None:
            requests = list(requests)
            rates = collections.Counter(request.model_id for request in requests)
        order = sorted(range(len(cluster.models)), key=lambda i: (-rates.get(cluster.models[i].model_id, 0.0), i))
        for node_index in range(len(cluster.nodes)):
            for tier in ("ssd", "dram") if config.staged_tier == "dram" else ("ssd",):
                cluster.stage(node_index, order, tier)
    floor_load_s = None if config.policy == "unbounded" else _first_load_s(cluster)
    feeder = _Feeder(cluster, requests)
    loop.feed(feeder.pull)
    horizon_s = config.hours * 3600.0
    samples: list[tuple[float, int]] = []

    def sample() -> None:
        now = loop.now
        samples.append((now, cluster.num_used_slots))
        if progress is not None:
            progress(min(now, horizon_s), horizon_s)
        if not feeder.done or cluster.num_awake_instances or cluster.num_done < feeder.num_requests:
            loop.schedule(now + config.sample_s, sample, priority=3)

    loop.schedule(0.0, sample, priority=3)
    loop.run(until_s=max(horizon_s, feeder.last_arrival_s) + config.drain_limit_s)
    while not feeder.done:  # past the drain limit: count the rest as never served
        feeder.pull()
    end_s = loop.now
    cluster.close(end_s)
    if progress is not None:
        progress(horizon_s, horizon_s)

    num_requests = feeder.num_requests
    ttft = np.frombuffer(cluster.ttft_s, dtype=np.float64)[:num_requests].copy()
    if len(ttft) < num_requests:
        ttft = np.concatenate([ttft, np.full(num_requests - len(ttft), np.nan)])
    served = ~np.isnan(ttft)
    ranked = np.where(served, ttft, np.inf)
    p50, p99 = (float(np.percentile(ranked, q, method="higher")) for q in (50, 99)) if num_requests else (math.nan,) * 2
    attained = float(np.count_nonzero(ttft[served] <= config.slo_ttft_s)) / num_requests if num_requests else 1.0
    decisions = np.array(decision_s) * 1e3
    p99_floor = None
    if floor_load_s is not None and num_requests:
        floors = first_load_floor_s(np.frombuffer(feeder.arrival_s, dtype=np.float64),
                                    np.frombuffer(feeder.model_index, dtype=np.int64), floor_load_s)
        p99_floor = percentile_floor_s(floors, 99)
    cold = {tier: cluster.cold_starts[tier] for tier in COLD_START_TIERS}
    counts = {**cluster.counts, **(cluster.upkeep.counts if cluster.upkeep.enabled else {}), **policy.counts()}
    return SimResult(
        policy=config.policy, num_requests=num_requests, num_served=int(served.sum()), ttft_p50_s=p50,
        ttft_p99_s=p99, slo_ttft_s=config.slo_ttft_s, slo_attainment=attained, accelerator_s=cluster.accelerator_s,
        cold_starts=sum(cold.values()), cold_starts_by_tier=cold, migrations=cluster.counts["migrations"],
        evictions=cluster.counts["evictions"], preemptions=cluster.counts["preemptions"],
        decision_ms_p50=float(np.median(decisions)) if len(decisions) else None,
        decision_ms_p99=float(np.percentile(decisions, 99)) if len(decisions) else None,
        num_ticks=ticks.num_ticks, sim_end_s=end_s, wall_s=time.perf_counter() - started,
        num_events=loop.num_events_run, ttft_s=ttft, accelerators_in_use=tuple(samples), counts=counts,
        settings=policy.describe(), cpu_s=time.process_time() - started_cpu, ttft_p99_floor_s=p99_floor)
