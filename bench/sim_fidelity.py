"""Simulator fidelity (issue 24): the small scenario of bench/multimodel.py run on the real platform
and replayed in the simulator, measured in one run; P50/P99 TTFT and cold starts side by side.

One run:

1. **Real**: bench/multimodel.py's scenario for Thaw's policy (8 random Llamas of 3 sizes, bf16, on
   2 CPU worker slots of a local Ray with 2 CPUs, 1 engine thread per instance, slot sharing on; its
   seeded bursty trace replayed open loop by one aiohttp SSE client), through multimodel.py's own
   `ThawSide`, `replay` and percentile functions. Besides the client's figures it keeps what the
   controller saw: every decision it recorded (placements, readies, evictions, recycled workers;
   sampled once a second), the spare pool once a second, the node store's measured tier rates, the
   gateway's per-model histograms (``/metrics``: inter-token gaps), and the running controller's
   own config and the deployed autoscaling spec. Once the trace is done (the figures taken), a few
   one-token requests go to instances still ready (a fallback measure of the request path).
2. **Calibration** (the platform stopped): each size class's model in the real `worker.Engine`
   at 1 thread, as a worker runs it: prefill at several prompt lengths, decode steps at batch 1 and
   4, each the median of a few runs, fitted linearly.
3. **Profile**: a `sim.HardwareProfile` for this CPU node from those measurements alone: the tier
   rates the node store measured; a start's fixed cost on a spare worker and without one (each start's
   time to ready less its read at those rates, median); how long an evicted instance's slot takes
   to be free for the waiting model, its worker recycled into the spare pool or ended (eviction to
   the next placement, median); a new spare's time to warm (the pool's samples); the settling
   delay, spare count, DRAM/SSD capacities and batch limit of the controller's config; the request
   path's latency (the mean client TTFT less the gateway's wait for an instance, less the
   prefill: what a request spends outside both the queue and the engine; the probes' where the
   gateway's counts do not match the client's); and a `ModelTiming` per model: its size class's calibration times
   the class's contention factor (the gateway's mean inter-token gap in the trace over the
   engine's own decode step: the engines ran beside each other and the platform on 2 cores), at
   its real byte size.
4. **Simulated**: `sim.run_simulation` of Thaw's policy (the controller's policy functions) with
   that profile, the controller's slot-sharing settings and reconcile interval, the deployed
   autoscaling spec (its ``queue_timeout_s`` failing a request no instance took in time, as the
   gateway does), the controller loop's timing (`real_controller_timing`: ticks a reconcile
   interval after the last, requests seen at the next tick), and the exact request list of the
   trace (arrival, model, prompt tokens, ``max_tokens``; `sim.explicit_workload`).

With ``--policies thaw,thaw-keepalive-wait`` (issue 39's contended run) the same trace is also
served by multimodel.py's ``thaw-keepalive-wait`` (the platform with ``--no-slot-sharing``:
keep-alive a hard lease, no eviction or preemption, as ServerlessLLM) and replayed by the
simulator's Thaw policy with slot sharing off, under the profile measured from Thaw's run (the
hardware is the same; only the policy differs). The line then also says, per figure, whether the
simulator ranks the two policies as the real platform does (``ranking``; values within 20% of
each other are a tie on either side) and how close each policy's figures are (``peers``).

Both sides' TTFT percentiles are computed alike (multimodel.py's: linear interpolation; a request
without a first token within the client's deadline counts as the deadline, and a simulated TTFT
past it is capped there, since the real client would have given up). Cold starts are instances that
became ready, by the tier they loaded from (``repository``: the node fetched the checkpoint first).
SLO attainment is the share of requests whose first token came within the models' TTFT SLO (the
spec's ``ttft_slo_s``). For each figure: the ratio sim / real and whether it is within 20%.

One JSON line on stdout; progress, and whatever Ray prints, on stderr.

    python bench/sim_fidelity.py [--quick] [--seed N] [--policies thaw[,thaw-keepalive-wait]]
                                 [--work-dir DIR] [--details-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (`python bench/sim_fidelity.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bursty_trace import TraceRequest, bursty_trace  # noqa: E402
from bench.coldstart import machine  # noqa: E402
from bench.engine_calibration import calibrate_engine, line_fit  # noqa: E402
from bench.fidelity_figures import compare, figures_of, ranking, sim_ttfts  # noqa: E402
from bench.multimodel import stdout_to_stderr  # noqa: E402
from bench.multimodel_setup import FULL, NUM_SLOTS, QUICK, BenchMode, BenchModel, write_models  # noqa: E402
from bench.multimodel_sides import ThawSide  # noqa: E402
from bench.trace_client import replay  # noqa: E402

PROBES_PER_MODEL = 5
NUM_PROBED_MODELS = 2
GATEWAY_HISTOGRAMS = {"thaw_inter_token_latency_seconds": "itl", "thaw_time_to_first_token_seconds": "ttft",
                      "thaw_queue_time_seconds": "queue"}
MIN_TOKEN_GAPS = 50  # a size class with fewer measured gaps takes the run's overall contention factor
POLICIES = ("thaw", "thaw-keepalive-wait")  # multimodel.py's: slot sharing on, and keep-alive as a hard lease


def log(message: str) -> None:
    print(f"[sim_fidelity] {message}", file=sys.stderr, flush=True)


# ---- the real run -----------------------------------------------------------------------------------


@dataclass
class RealRun:
    """What the real platform did with the trace, and what the profile is measured from."""

    figures: dict[str, Any]  # multimodel.py's figures: failures, TTFT percentiles, cold starts
    ttfts: list[tuple[float, bool]]  # per request, in trace order: (TTFT or stand-in, censored)
    starts: list[dict[str, Any]]  # per instance that became ready
    tier_Bps: dict[str, float]  # the node store's measured rates, as placement uses them
    spare_samples: list[tuple[float, int, int]]  # (s from the trace's start, warm, starting)
    probes: list[tuple[int, int, float]]  # (model index, prompt tokens, TTFT) after the trace
    config: Any  # the running controller's ControllerConfig
    autoscaling: Any  # the deployed spec's AutoscalingPolicy (the same for every model)
    model_bytes: dict[int, int]  # model index -> the controller's size of its checkpoint
    decisions: list[dict[str, Any]]  # the controller's recorded decisions, `at_s` from the trace's start
    gateway_series: dict[str, dict[str, float]]  # model id -> the gateway's histogram sums and counts
    nodes: list[dict[str, Any]]  # the controller's last view of the nodes (tiers' holdings, rates)


@dataclass
class _Replayed:
    outcomes: list[Any]  # multimodel.Outcome, in trace order
    idle_slot_s: float
    duration_s: float
    extra: dict[str, Any]  # ThawSide.finish()
    spare_samples: list[tuple[float, int, int]]
    probes: list[tuple[int, int, float]]
    start_wall_s: float  # time.time() at the trace's start (the controller stamps decisions so)
    gateway_series: dict[str, dict[str, float]]  # model id -> the gateway's histogram sums and counts


async def _replay_and_probe(side: ThawSide, trace: list[TraceRequest], mode: BenchMode, seed: int) -> _Replayed:
    """multimodel.py's replay, with the spare pool sampled beside its slot samples; then the
    figures taken (`ThawSide.finish`), then the probes."""
    import aiohttp

    loop = asyncio.get_running_loop()
    spare_samples: list[tuple[float, int, int]] = []
    start, start_wall_s = loop.time(), time.time()

    async def ready_models() -> list[int]:
        ready = await side.ready_models()
        status = await side.controller.status.remote()
        pools = list(status.get("spare_workers", {}).values())
        spare_samples.append((loop.time() - start, sum(p.get("warm", 0) for p in pools),
                              sum(p.get("starting", 0) for p in pools)))
        return ready

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        outcomes, idle_slot_s, duration_s = await replay(trace, side.send(session), ready_models)
        extra = side.finish()
        series = await _gateway_series(session, side.config.url)
        probes = await _probe(side, session, mode, seed)
    return _Replayed(outcomes, idle_slot_s, duration_s, extra, spare_samples, probes, start_wall_s, series)


async def _gateway_series(session: Any, url: str) -> dict[str, dict[str, float]]:
    """The gateway's per-model histogram sums and counts (``/metrics``): its inter-token gaps are
    the engines' decode steps as they ran in the trace, beside everything else on the node."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(f"{url}/metrics") as response:
            response.raise_for_status()
            text = await response.text()
    except Exception as exc:  # noqa: BLE001 - the profile then says it has no contention factor
        log(f"reading the gateway's /metrics failed: {type(exc).__name__}: {exc}")
        return {}
    series: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in GATEWAY_HISTOGRAMS:
            continue
        for sample in family.samples:
            model = sample.labels.get("model")
            if model and sample.name.endswith(("_sum", "_count")):
                key = f"{GATEWAY_HISTOGRAMS[family.name]}_{sample.name.rpartition('_')[2]}"
                series.setdefault(model, {})[key] = sample.value
    return series


async def _probe(side: ThawSide, session: Any, mode: BenchMode, seed: int) -> list[tuple[int, int, float]]:
    """A few one-token requests, one at a time, to the models whose instance is ready and idle."""
    status = await side.controller.status.remote()
    ready = sorted({side.index_of[i["model_id"]] for i in status["instances"]
                    if i["state"] == "ready" and not i["num_ongoing_requests"]})[:NUM_PROBED_MODELS]
    tokens = (mode.trace.min_prompt_tokens + mode.trace.max_prompt_tokens) // 2
    rng = random.Random(f"{seed}/probes")
    send = side.send(session)
    probes = []
    for model_index in ready:
        for _ in range(PROBES_PER_MODEL):
            prompt = tuple(rng.randrange(3, mode.trace.max_token_id) for _ in range(tokens))
            sent = await send(TraceRequest(0.0, model_index, prompt, 1))
            if sent.failure is None and sent.ttft_s is not None:
                probes.append((model_index, tokens, sent.ttft_s))
    log(f"probes: {len(probes)} one-token requests to models {ready}")
    return probes


def _starts(side: ThawSide, start_wall_s: float) -> list[dict[str, Any]]:
    """Every instance that became ready: model, tier (as multimodel.py counts it), spare or not,
    and the controller's time from its placement to its ready."""
    placed = {d["instance_id"]: d for d in side.decisions.values()
              if d.get("kind") == "placement" and d.get("instance_id")}
    starts = []
    for decision in sorted(side.decisions.values(), key=lambda d: d.get("at_s") or 0.0):
        if decision.get("kind") != "ready" or decision.get("instance_id") not in placed:
            continue
        placement = placed[decision["instance_id"]]
        seen = side.instances.get(decision["instance_id"], {})
        tier = placement.get("tier")
        if tier != "repository":
            tier = seen.get("tier") or tier or "unknown"
        starts.append({"model_index": side.index_of[decision["model_id"]], "tier": tier,
                       "placed_at_s": placement["at_s"] - start_wall_s,
                       "from_spare": bool(seen.get("from_spare")), "start_to_ready_s": decision["at_s"] - placement["at_s"],
                       "worker_load_s": seen.get("load_s"), "estimate_s": placement.get("estimate_s")})
    return starts


def run_real(policy: str, mode: BenchMode, models: list[BenchModel], trace: list[TraceRequest], work_dir: Path,
             seed: int) -> RealRun:
    import ray

    from controller import AutoscalingPolicy

    side = ThawSide(policy, mode, models, work_dir)
    log(f"real ({policy}): starting the platform")
    started = time.monotonic()
    try:
        side.start()
        config = ray.get(side.controller.config.remote(), timeout=60)
        specs = {m.index: ray.get(side.controller.get_model.remote(m.model_id), timeout=60) for m in models}
        log(f"real ({policy}): up in {time.monotonic() - started:.1f} s; replaying {len(trace)} requests")
        replayed = asyncio.run(_replay_and_probe(side, trace, mode, seed))
        status = ray.get(side.controller.status.remote(), timeout=60)
    finally:
        side.stop()
    autoscaling = {json.dumps(s["spec"]["autoscaling"], sort_keys=True) for s in specs.values()}
    if len(autoscaling) != 1:
        raise RuntimeError(f"the models were deployed with different autoscaling specs: {sorted(autoscaling)}")
    rates = status["nodes"][0]["placement_bytes_per_s"]
    deadline_s = mode.effective_first_token_deadline_s
    outcomes = replayed.outcomes
    ttfts = [(o.ttft_s, False) if o.ttft_s is not None else (max(deadline_s, o.end_s - o.sent_s), True)
             for o in outcomes]
    failures = collections.Counter(o.failure for o in outcomes if o.failure is not None)
    figures = {"num_requests": len(outcomes), "num_failed": sum(failures.values()),
               "failures": dict(sorted(failures.items())), **replayed.extra,
               "idle_slot_s": round(replayed.idle_slot_s, 2), "duration_s": round(replayed.duration_s, 2)}
    return RealRun(
        figures=figures, ttfts=ttfts, starts=_starts(side, replayed.start_wall_s),
        tier_Bps={"repository": rates["repository_bytes_per_s"], "ssd": rates["ssd_bytes_per_s"],
                  "dram": rates["dram_bytes_per_s"] or rates["ssd_bytes_per_s"]},
        spare_samples=replayed.spare_samples, probes=replayed.probes, config=config,
        autoscaling=AutoscalingPolicy(**next(iter(specs.values()))["spec"]["autoscaling"]),
        model_bytes={i: s["num_bytes"] or models[i].num_bytes for i, s in specs.items()},
        decisions=[{k: v for k, v in d.items() if k in ("kind", "model_id", "instance_id", "victim_model_id", "tier",
                                                          "action", "reason")}
                   | {"at_s": d["at_s"] - replayed.start_wall_s}
                   for d in sorted(side.decisions.values(), key=lambda d: d.get("at_s") or 0.0)],
        gateway_series=replayed.gateway_series, nodes=status["nodes"])


# ---- the profile ------------------------------------------------------------------------------------


def build_profile(real: RealRun, calibration: dict[str, dict[str, Any]], models: list[BenchModel],
                  trace: list[TraceRequest], mode: BenchMode) -> tuple[Any, dict[str, Any]]:
    """The CPU node's `HardwareProfile` from this run's measurements, and how each number was got."""
    from sim import HardwareProfile, ModelTiming

    config = real.config
    factors = contention_factors(real.gateway_series, calibration, models)
    timings = []
    for model in models:
        measured, factor = calibration[model.size], factors[model.size]
        prefill_s, per_token_s = line_fit(measured["prefill_s"])
        decode = measured["decode_step_s"]
        batches = sorted(decode)
        per_sequence_s = max(0.0, (decode[batches[-1]] - decode[batches[0]]) / (batches[-1] - batches[0]))
        timings.append(ModelTiming(model_id=model.model_id, weight_bytes=real.model_bytes[model.index],
                                   prefill_s=prefill_s * factor, prefill_s_per_token=per_token_s * factor,
                                   decode_step_s=decode[batches[0]] * factor,
                                   decode_s_per_sequence=per_sequence_s * factor))
    residuals: dict[bool, list[float]] = {True: [], False: []}
    for start in real.starts:
        rate = real.tier_Bps.get(start["tier"])
        if rate:
            read_s = real.model_bytes[start["model_index"]] / rate
            residuals[start["from_spare"]].append(start["start_to_ready_s"] - read_s)
    spare_start_s = statistics.median(residuals[True]) if residuals[True] else None
    fresh_start_s = statistics.median(residuals[False]) if residuals[False] else None
    if spare_start_s is None and fresh_start_s is None:
        raise RuntimeError("no instance became ready in the real run: nothing to measure start costs from")
    spare_start_s = max(0.0, spare_start_s if spare_start_s is not None else fresh_start_s)
    process_start_s = max(0.0, fresh_start_s - spare_start_s) if fresh_start_s is not None else 0.0
    warm_s = _spare_warm_times(real.spare_samples)
    freed_s = _slot_freed_times(real.decisions)
    by_model = {m.index: m for m in models}
    timing_of = {t.model_id: t for t in timings}
    overheads = [ttft - timing_of[by_model[i].model_id].prefill_time_s(tokens) / factors[by_model[i].size]
                 for i, tokens, ttft in real.probes]  # the probes run alone: the engine's own prefill
    probed_s = max(0.0, statistics.median(overheads)) if overheads else 0.0
    in_trace_s = _path_in_trace_s(real, trace, [timing_of[m.model_id] for m in models])
    request_overhead_s = in_trace_s if in_trace_s is not None else probed_s
    peer = config.peer_stream
    profile = HardwareProfile(
        name=f"cpu-node-{NUM_SLOTS}-slots", num_slots=config.cpu_worker_slots_per_node,
        dram_bytes=config.dram_capacity_bytes, ssd_bytes=config.ssd_capacity_bytes,
        dram_Bps=real.tier_Bps["dram"], ssd_Bps=real.tier_Bps["ssd"], repository_Bps=real.tier_Bps["repository"],
        peer_Bps=peer.link_bytes_per_s if peer is not None else real.tier_Bps["dram"],
        spare_start_s=spare_start_s, process_start_s=process_start_s,
        spare_workers=config.spare_workers_per_node,
        spare_warm_s=statistics.median(warm_s) if warm_s else spare_start_s + process_start_s,
        settle_s=config.spare_refill_delay_s, request_overhead_s=request_overhead_s,
        stop_s=statistics.median(freed_s[False]) if freed_s[False] else 0.0,
        recycle_s=statistics.median(freed_s[True]) if freed_s[True] else 0.0,
        max_batch=config.engine_config().max_num_seqs, models=tuple(timings),
        source=f"measured by bench/sim_fidelity.py ({mode.name}) in the same run as the real figures")
    how = {"contention_factor": {size: round(f, 4) for size, f in factors.items()},
           "engine_calibration": {size: {k: {str(n): round(v, 6) for n, v in c.items()} for k, c in cal.items()}
                                  for size, cal in calibration.items()},
           "num_starts": {"from_spare": len(residuals[True]), "new_process": len(residuals[False])},
           "num_spare_warmups_seen": len(warm_s), "num_probes": len(real.probes),
           "num_slots_freed": {"recycled": len(freed_s[True]), "stopped": len(freed_s[False])},
           "spare_warm_s_from": "pool samples" if warm_s else "no refill seen: a start without a spare",
           "request_overhead_s_from": "the trace (client TTFT less gateway queue, less prefill)"
           if in_trace_s is not None else "the probes after the trace",
           "request_overhead_s_probed": round(probed_s, 6)}
    return profile, how


def _path_in_trace_s(real: RealRun, trace: list[TraceRequest], timings: list[Any]) -> float | None:
    """The mean latency of a request's path beyond its prefill in the trace itself: the client's
    TTFT less the gateway's wait for an instance (``/metrics``), less the profile's prefill of its
    prompt; None when the gateway's counts do not match the client's served requests."""
    served = [(trace[i], ttft) for i, (ttft, censored) in enumerate(real.ttfts) if not censored]
    num_first = sum(s.get("ttft_count", 0.0) for s in real.gateway_series.values())
    num_queued = sum(s.get("queue_count", 0.0) for s in real.gateway_series.values())
    if not served or num_first != len(served) or num_queued != len(served):
        return None
    queue_s = sum(s.get("queue_sum", 0.0) for s in real.gateway_series.values())
    prefill_s = sum(timings[r.model_index].prefill_time_s(len(r.prompt_token_ids)) for r, _ in served)
    return max(0.0, (sum(ttft for _, ttft in served) - queue_s - prefill_s) / len(served))


def contention_factors(series: dict[str, dict[str, float]], calibration: dict[str, dict[str, Any]],
                       models: list[BenchModel]) -> dict[str, float]:
    """Per size class: the gateway's mean inter-token gap in the trace over the engine's own
    batch-1 decode step (how much slower the engines ran beside each other, the gateway, the
    controller and the client on the node's cores); the run's overall factor for a class with
    fewer than `MIN_TOKEN_GAPS` gaps; 1 where the gateway measured none."""
    gaps: dict[str, list[float]] = {}
    for model in models:
        got = series.get(model.model_id, {})
        count = got.get("itl_count", 0.0)
        if count:
            own = calibration[model.size]["decode_step_s"][min(calibration[model.size]["decode_step_s"])]
            gaps.setdefault(model.size, [0.0, 0.0, 0.0])
            gaps[model.size][0] += got["itl_sum"]
            gaps[model.size][1] += count
            gaps[model.size][2] += count * own  # the engine's own time for as many steps
    total = [sum(g[i] for g in gaps.values()) for i in range(3)]
    overall = total[0] / total[2] if total[2] else 1.0
    return {size: (gaps[size][0] / gaps[size][2] if size in gaps and gaps[size][1] >= MIN_TOKEN_GAPS else overall)
            for size in calibration}


def _slot_freed_times(decisions: list[dict[str, Any]]) -> dict[bool, list[float]]:
    """For every instance stopped for another model (evicted or preempted): the time from that
    decision to the other model's placement (the held slot free), by whether the victim's worker
    went back to the spare pool."""
    recycled = {d["instance_id"] for d in decisions if d["kind"] == "recycled"}
    freed: dict[bool, list[float]] = {True: [], False: []}
    for i, decision in enumerate(decisions):
        if decision["kind"] not in ("eviction", "preemption"):
            continue
        placed = next((d for d in decisions[i + 1:] if d["kind"] == "placement" and d.get("instance_id")
                       and d["model_id"] == decision["model_id"]), None)
        if placed is not None:
            freed[decision["instance_id"] in recycled].append(placed["at_s"] - decision["at_s"])
    return freed


def _spare_warm_times(samples: list[tuple[float, int, int]]) -> list[float]:
    """From the pool's samples: each spare's time from first seen starting to no longer starting."""
    times, began = [], None
    previous = 0
    for at_s, _, starting in samples:
        if starting > previous and began is None:
            began = at_s
        elif starting == 0 and began is not None:
            times.append(at_s - began)
            began = None
        previous = starting
    return times


def profile_summary(profile: Any) -> dict[str, Any]:
    def r(x: float) -> float:
        return round(x, 6)

    return {"name": profile.name, "num_slots": profile.num_slots,
            "tier_bytes_per_s": {"dram": r(profile.dram_Bps), "ssd": r(profile.ssd_Bps),
                                 "repository": r(profile.repository_Bps)},
            "spare_start_s": r(profile.spare_start_s), "process_start_s": r(profile.process_start_s),
            "spare_warm_s": r(profile.spare_warm_s), "settle_s": profile.settle_s,
            "request_overhead_s": r(profile.request_overhead_s), "stop_s": r(profile.stop_s),
            "recycle_s": r(profile.recycle_s), "max_batch": profile.max_batch,
            "models": {t.model_id: {"weight_bytes": t.weight_bytes, "prefill_s": r(t.prefill_s),
                                    "prefill_s_per_token": r(t.prefill_s_per_token),
                                    "decode_step_s": r(t.decode_step_s),
                                    "decode_s_per_sequence": r(t.decode_s_per_sequence)}
                       for t in profile.models}}


# ---- the simulated run ------------------------------------------------------------------------------


def simulate(profile: Any, real: RealRun, models: list[BenchModel], trace: list[TraceRequest], mode: BenchMode,
             seed: int) -> Any:
    from sim import SimConfig, SimRequest, explicit_workload, run_simulation

    config = real.config
    requests = explicit_workload([SimRequest(r.arrival_s, models[r.model_index].model_id, len(r.prompt_token_ids),
                                             r.max_tokens) for r in trace], [m.model_id for m in models])
    sim_config = SimConfig(num_models=len(models), num_nodes=1, hours=mode.trace.duration_s / 3600.0, seed=seed,
                           policy="thaw", tick_s=config.reconcile_interval_s,
                           slo_ttft_s=mode.effective_first_token_deadline_s,
                           max_instances=real.autoscaling.max_instances, keep_alive_s=real.autoscaling.keep_alive_s,
                           drain_limit_s=600.0, sample_s=1.0, thaw_sharing=config.slot_sharing,
                           thaw_slot_sharing=config.slot_sharing is not None,
                           queue_timeout_s=real.autoscaling.queue_timeout_s, thaw_autoscaling=real.autoscaling,
                           real_controller_timing=True, hardware=profile)
    return run_simulation(sim_config, requests=requests)


# ---- the comparison ---------------------------------------------------------------------------------


def valid_policies(policies: tuple[str, ...]) -> bool:
    """Thaw's first (its run gives the profile), then each of `POLICIES` at most once."""
    return bool(policies) and policies[0] == "thaw" and len(set(policies)) == len(policies) \
        and all(p in POLICIES for p in policies)


def compare_policy(policy: str, real: RealRun, profile: Any, models: list[BenchModel], trace: list[TraceRequest],
                   mode: BenchMode, seed: int) -> tuple[dict[str, Any], Any]:
    """One policy's real run against its replay in the simulator under the same profile."""
    result = simulate(profile, real, models, trace, mode, seed)
    deadline_s, slo_s = mode.effective_first_token_deadline_s, real.autoscaling.ttft_slo_s
    real_figures = figures_of(real.ttfts, real.figures["cold_starts_by_tier"], slo_s)
    sim_tiers = {"dram": result.cold_starts_by_tier["dram"], "ssd": result.cold_starts_by_tier["ssd"],
                 "repository": result.cold_starts_by_tier["s3"]}
    simulated = figures_of(sim_ttfts(result, deadline_s), sim_tiers, slo_s)
    ratios, within = compare(real_figures, simulated)
    sharing = real.figures.get("slot_sharing", {})
    real_extra = {"num_requests": real.figures["num_requests"], "num_failed": real.figures["num_failed"],
                  "cold_starts_from_spare": real.figures["cold_starts_from_spare"],
                  "evictions": sharing.get("evictions", 0),
                  "preemptions": sharing.get("preemptions_migrated", 0) + sharing.get("preemptions_suspended", 0),
                  "duration_s": real.figures["duration_s"]}
    sim_extra = {"num_requests": result.num_requests, "num_served": result.num_served,
                 "num_failed": result.counts.get("requests_timed_out", 0),
                 "cold_starts_from_spare": result.counts.get("starts_from_spare", 0),
                 "evictions": result.evictions, "preemptions": result.preemptions,
                 "sim_end_s": round(result.sim_end_s, 2), "wall_s": round(result.wall_s, 3)}
    side = {"policy": policy, "slo_ttft_s": slo_s, "real": {**real_figures, **real_extra},
            "sim": {**simulated, **sim_extra}, "ratio_sim_to_real": ratios, "within_20pct": within,
            "all_within_20pct": all(within.values())}
    return side, result


def run(mode: BenchMode, seed: int, work_dir: Path, details_out: Path | None,
        policies: tuple[str, ...] = ("thaw",)) -> dict[str, Any]:
    """The real runs of `policies` (Thaw's first), one hardware profile measured from Thaw's, and
    each policy replayed in the simulator under that profile."""
    import torch

    if not valid_policies(policies):
        raise ValueError(f"policies must start with 'thaw' and name each of {', '.join(POLICIES)} at most once, "
                         f"got {', '.join(policies) or 'none'}")
    trace = bursty_trace(mode.trace, seed)
    if not trace:
        raise ValueError("the trace has no request: choose another --seed")
    models = write_models(mode, work_dir / "models")
    log(f"{len(trace)} requests over {mode.trace.duration_s:g} s, {len(models)} models")
    reals = {}
    for policy in policies:
        reals[policy] = run_real(policy, mode, models, trace, work_dir, seed)
        log(f"real ({policy}): {reals[policy].figures['num_failed']} failed, "
            f"cold starts {reals[policy].figures['cold_starts_by_tier']}")
    lengths = sorted({mode.trace.min_prompt_tokens, (mode.trace.min_prompt_tokens + mode.trace.max_prompt_tokens) // 2,
                      mode.trace.max_prompt_tokens})
    calibration = {}
    for model in models:
        if model.size not in calibration:
            calibration[model.size] = calibrate_engine(model.path, lengths, seed)
            log(f"calibrated {model.size}: {calibration[model.size]}")
    profile, how = build_profile(reals["thaw"], calibration, models, trace, mode)
    sides, results = {}, {}
    for policy in policies:
        sides[policy], results[policy] = compare_policy(policy, reals[policy], profile, models, trace, mode, seed)
    thaw = sides["thaw"]
    line = {"bench": "sim_fidelity", "mode": mode.name, "seed": seed, "trace": mode.trace.describe(),
            "num_models": len(models), "num_slots": NUM_SLOTS, "first_token_deadline_s": mode.effective_first_token_deadline_s,
            "slo_ttft_s": thaw["slo_ttft_s"], "policies": list(policies),
            "real": thaw["real"], "sim": thaw["sim"], "ratio_sim_to_real": thaw["ratio_sim_to_real"],
            "within_20pct": thaw["within_20pct"], "all_within_20pct": thaw["all_within_20pct"]}
    if len(policies) > 1:
        line["peers"] = {p: sides[p] for p in policies[1:]}
        line["ranking"] = ranking(sides)
    line.update({"profile": profile_summary(profile), "profile_measured_from": how,
                 "machine": machine(), "torch": torch.__version__})
    if details_out is not None:
        real, result = reals["thaw"], results["thaw"]
        details = {"starts": real.starts, "decisions": real.decisions, "probes": real.probes, "spare_samples": real.spare_samples,
                   "calibration": {size: {k: {str(n): v for n, v in c.items()} for k, c in cal.items()}
                                   for size, cal in calibration.items()},
                   "real_ttft_s": [t for t, _ in real.ttfts], "sim_ttft_s": result.ttft_s.tolist(),
                   "arrival_s": [r.arrival_s for r in trace], "model_index": [r.model_index for r in trace],
                   "real_figures": real.figures, "sim_counts": result.counts, "gateway_series": real.gateway_series,
                   "nodes": real.nodes,
                   "peers": {p: {"real_ttft_s": [t for t, _ in reals[p].ttfts], "sim_ttft_s": results[p].ttft_s.tolist(),
                                 "real_figures": reals[p].figures, "sim_counts": results[p].counts}
                             for p in policies[1:]}}
        details_out.write_text(json.dumps(details, indent=1, default=str))
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="multimodel.py's quick scenario (tiny models, 20 s)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument("--policies", default="thaw",
                        help=f"comma-separated, thaw first: thaw alone, or {','.join(POLICIES)} for the contended "
                             "comparison (each run for real, each replayed under the profile of Thaw's run, and "
                             "whether the simulator ranks them as the real platform does)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where models and state go (default: a temp dir)")
    parser.add_argument("--details-out", type=Path, default=None,
                        help="also write per-request TTFTs, per-start times and the calibration there (JSON)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not valid_policies(policies):
        parser.error(f"--policies takes thaw, then optionally {','.join(POLICIES[1:])}, got {args.policies!r}")
    with tempfile.TemporaryDirectory(prefix="thaw-sim-fidelity-", dir=args.work_dir) as tmp:
        with stdout_to_stderr():
            line = run(mode, args.seed, Path(tmp), args.details_out, policies)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
