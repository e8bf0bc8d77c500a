"""Which idle instance gives up its slot to a waiting model: keep-alive as a soft lease.

Keep-alive keeps an idle instance warm so its model's next request skips a cold start. That is a
bet, and when another model's requests wait with no slot free it is the wrong one to hold on to:
the waiting requests pay a cold start for sure, the idle model only perhaps. So an idle instance
(no ongoing request, no queued request for its model) of a model above its `min_instances` may
be stopped at once for a waiting model. Which one is a caching decision, after FaaSCache
(Fuerst & Sharma, ASPLOS '21: keep-alive is caching, and Greedy-Dual-Size-Frequency chooses
well):

    score = frequency x reload_s / num_worker_slots

- frequency: the model's recent requests, decayed exponentially with their age (a model asked
  once an hour ago counts ~0, one asked ten times a minute ago ~10; `UsageMeter` keeps it). It
  never goes below `min_frequency`, so the reload cost still ranks models never used since the
  controller started.
- reload_s: what bringing the model back would cost: a start's fixed overhead (a worker taking
  the model, building its engine: measured on this platform's recent starts, seconds even for a
  tiny model, where the read itself may take milliseconds) plus its size over the rate of the
  tier its checkpoint would come back from on that node (DRAM when the node's DRAM tier holds or
  will take it, else SSD, else the repository). Without the overhead a small popular model would
  look free to reload and be evicted again and again.
- num_worker_slots: the slots the eviction frees (GDSF's size).

Where memory is the slot (a node with a worker memory budget, ARCHITECTURE.md "Slot hosts"), one
victim may not free enough of it: victims are then taken in their rank order below, each node
collecting its own, until the first node whose collected victims (with what is free there
already) make room for the newcomer; those are evicted together. One victim that makes room on
its own is therefore chosen exactly as without a budget.

An asleep instance (its model scaled down; ARCHITECTURE.md "Slot hosts": it holds its weights'
memory and no slot) is idle by definition and wanted by nobody now: among equal priorities every
sleeper goes before any awake instance, and the `min_instances` floor does not keep it (it is
not one of its model's instances). It frees memory, never a slot -- except on a GPU, where a
sleeper's weights wait in host memory: it frees no device memory there, but its place in the GPU's
slot host (`holds_slot`).

The lowest score goes first: cheap, rarely used, longest idle (decay makes idleness lower the
score). GDSF ages entries with an inflation clock instead; the decay does the same job from one
number per model, which a restarted controller rebuilds within a few minutes of traffic rather
than carrying a clock that only means something relative to entries it has forgotten.

Priority comes first (an idle instance of a lower-priority model goes before any of a higher
one), then, among equals, the cheapest in total: the victim's score (the reload seconds its model
is expected to pay) plus the waiting model's own load time on the victim's node (its checkpoint
may sit in DRAM on one node and nowhere on another). Ties: longest idle, then the smaller id.

Never evicted: an instance still loading, stopping, serving, or on a draining node; one idle for
less than `min_idle_s` (it may have just become ready for the very requests now being routed to
it); one whose model would drop below `min_instances` (a hard limit); one whose model has queued
requests; one too small to free the slots the waiting model needs; one whose model is expected to
get `max_displaced_requests` (1) or more requests while the waiting model loads into its slot (its
rate, from the decayed count, times that load): evicting it would only move the wait, and with
slow storage (a 40-190 s load from S3 in `thaw simulate`) it made popular models evict each other
in turn.

With a deadline (the waiting model's `ttft_slo_s`, issue 39), an awake instance is also kept when
the eviction could not save a single queued request: when even the waiting model's newest request
(the one with the most time left) would get its first token after its deadline, loading on the
victim's node, and its oldest has waited less than `lost_wait_s`. A request that can no longer
meet its deadline then does not displace a model whose next requests still can: in `thaw
simulate`'s contended scenario such evictions were mostly of popular models, for a model whose
requests waited out a one-minute load from the repository anyway, and the popular model's next
burst then missed in turn. Past `lost_wait_s` the lost requests evict as any others do, so they
wait that long at most for an idle instance.

A pure function of plain values: tested with numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EvictionCandidate", "EvictionDecision", "EvictionSettings", "choose_eviction", "eviction_score"]


def _number(owner: str, name: str, value: object, *, minimum: float = 0.0, exclusive: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value < minimum or (exclusive and value == minimum):
        raise ValueError(f"{owner}.{name} must be a finite number {'>' if exclusive else '>='} {minimum:g}, "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EvictionSettings:
    """How willing the controller is to stop idle instances for waiting models.

    Fields:
        min_idle_s: an instance idle for less than this is kept (the gateway may be routing the
            requests it was started for).
        min_frequency: the floor of a model's decayed request count in the score.
        usage_half_life_s: the age at which a request counts half in the frequency.
        start_overhead_s: a start's fixed cost in reload_s until the platform has measured its own
            (the median of recent starts' load time beyond their read estimate).
        max_displaced_requests: an idle instance is kept when its model is expected to get at least
            this many requests while the waiting model loads into its slot (its request rate, from
            the decayed count, times that load time): evicting it would only move the wait.
        lost_wait_s: with a deadline, a waiting model none of whose queued requests can meet it
            after the load on a node evicts an awake instance there only once its oldest request
            has waited this long (see the module docstring).
    """

    min_idle_s: float = 0.5
    min_frequency: float = 0.1
    usage_half_life_s: float = 300.0
    start_overhead_s: float = 1.0
    max_displaced_requests: float = 1.0
    lost_wait_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_idle_s", _number("EvictionSettings", "min_idle_s", self.min_idle_s))
        object.__setattr__(self, "min_frequency",
                           _number("EvictionSettings", "min_frequency", self.min_frequency, exclusive=True))
        object.__setattr__(self, "usage_half_life_s",
                           _number("EvictionSettings", "usage_half_life_s", self.usage_half_life_s, exclusive=True))
        object.__setattr__(self, "start_overhead_s",
                           _number("EvictionSettings", "start_overhead_s", self.start_overhead_s))
        object.__setattr__(self, "max_displaced_requests",
                           _number("EvictionSettings", "max_displaced_requests", self.max_displaced_requests,
                                   exclusive=True))
        object.__setattr__(self, "lost_wait_s", _number("EvictionSettings", "lost_wait_s", self.lost_wait_s))

    def request_rate(self, frequency: float) -> float:
        """Requests per second behind a decayed count: a steady stream of rate r keeps the count at
        r x half_life / ln 2."""
        return frequency * math.log(2) / self.usage_half_life_s


@dataclass(frozen=True, kw_only=True)
class EvictionCandidate:
    """One instance that might give up its slot, as the controller saw it this tick.

    Fields:
        instance_id / model_id / node_id: which instance, of which model, where.
        num_worker_slots: the slots it occupies.
        memory_bytes: what it takes of its node's worker memory budget (weights plus KV pool).
        ready: READY (not loading, asleep or stopping).
        asleep: ASLEEP: `memory_bytes` is then what it holds asleep (its weights; 0 on a GPU, whose
            sleepers' weights are in host memory), and it frees no slot unless `holds_slot`.
        holds_slot: an asleep instance that keeps its slot (its place in a GPU's slot host) and so
            frees it when evicted; an awake one always does (None: derived from `asleep`).
        num_ongoing_requests: its requests at the last report.
        num_queued_requests: requests waiting for its model at the gateways.
        idle_s: seconds since its model last had a request (or since it became ready, if later).
        num_model_instances: its model's live (not stopping) instances.
        min_instances: its model's floor.
        priority: its model's priority.
        frequency: its model's decayed recent request count.
        reload_s: seconds to bring its model back on this node, from `reload_tier`.
        reload_tier: "dram", "ssd" or "repository".
        draining: its node is draining.
    """

    instance_id: str
    model_id: str
    node_id: str
    num_worker_slots: int = 1
    memory_bytes: int = 0
    ready: bool = True
    asleep: bool = False
    holds_slot: bool | None = None  # None: as its phase says (an awake one holds it, a sleeper not)
    num_ongoing_requests: int = 0
    num_queued_requests: int = 0
    idle_s: float
    num_model_instances: int = 1
    min_instances: int = 0
    priority: int = 0
    frequency: float = 0.0
    reload_s: float
    reload_tier: str = "ssd"
    draining: bool = False

    def __post_init__(self) -> None:
        where = f"EvictionCandidate {self.instance_id}"
        if not isinstance(self.num_worker_slots, int) or isinstance(self.num_worker_slots, bool) \
                or self.num_worker_slots < 1:
            raise ValueError(f"{where}: num_worker_slots must be an integer >= 1, got {self.num_worker_slots!r}")
        if not isinstance(self.memory_bytes, int) or isinstance(self.memory_bytes, bool) or self.memory_bytes < 0:
            raise ValueError(f"{where}: memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")
        for name in ("idle_s", "frequency", "reload_s"):
            object.__setattr__(self, name, _number(where, name, getattr(self, name)))
        if self.holds_slot is None:
            object.__setattr__(self, "holds_slot", not self.asleep)
        elif not isinstance(self.holds_slot, bool) or (not self.holds_slot and not self.asleep):
            raise ValueError(f"{where}: holds_slot must be True or False (False only asleep), got {self.holds_slot!r}")


@dataclass(frozen=True)
class EvictionDecision:
    """The instance to stop (None: keep them all), with the reason and every eligible candidate's
    `(instance_id, score, total cost)`, best victim first, for ``thaw status`` and the log.
    `victims`: every instance to stop, `victim` first (more than one only where one instance frees
    too little of a node's memory budget); `score` is theirs summed."""

    victim: EvictionCandidate | None
    score: float | None
    reason: str
    ranked: tuple[tuple[str, float, float], ...] = ()
    victims: tuple[EvictionCandidate, ...] = ()


def eviction_score(candidate: EvictionCandidate, settings: EvictionSettings) -> float:
    """GDSF's value of keeping the instance: frequency x reload cost / slots (see the module docstring)."""
    return max(candidate.frequency, settings.min_frequency) * candidate.reload_s / candidate.num_worker_slots


def _why_kept(candidate: EvictionCandidate, settings: EvictionSettings, num_slots: int,
              free_slots_by_node: dict[str, int]) -> str | None:
    if candidate.draining:
        return "its node drains"
    if candidate.asleep:
        if not candidate.holds_slot and free_slots_by_node.get(candidate.node_id, 0) < num_slots:
            return f"asleep, it holds no slot and the node has fewer than the {num_slots} slots needed free"
        if candidate.holds_slot and free_slots_by_node.get(candidate.node_id, 0) + candidate.num_worker_slots < num_slots:
            return f"asleep, it frees {candidate.num_worker_slots} of the {num_slots} slots needed"
        return None
    if not candidate.ready:
        return "not ready"
    if candidate.num_ongoing_requests or candidate.num_queued_requests:
        return "busy"
    if candidate.num_model_instances <= candidate.min_instances:
        return f"its model is at min_instances {candidate.min_instances}"
    if candidate.idle_s < settings.min_idle_s:
        return f"idle only {candidate.idle_s:.3g}s < min_idle_s {settings.min_idle_s:g}"
    if free_slots_by_node.get(candidate.node_id, 0) + candidate.num_worker_slots < num_slots:
        return f"frees {candidate.num_worker_slots} of the {num_slots} slots needed"
    return None


def _why_lost(waiting_model_id: str, load_s: float, oldest_wait_s: float, newest_wait_s: float | None,
              ttft_slo_s: float | None, settings: EvictionSettings) -> str | None:
    """Why the eviction would save none of the waiting model's queued requests (None: it would,
    or there is no deadline, or they have waited `lost_wait_s`)."""
    if ttft_slo_s is None or newest_wait_s is None or oldest_wait_s >= settings.lost_wait_s:
        return None
    if newest_wait_s + load_s <= ttft_slo_s:
        return None
    return (f"{waiting_model_id}'s newest request, {newest_wait_s:.3g}s waited, would miss its {ttft_slo_s:g}s "
            f"deadline after the {load_s:.3g}s load here, and its oldest has waited {oldest_wait_s:.3g}s < "
            f"lost_wait_s {settings.lost_wait_s:g}")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def choose_eviction(waiting_model_id: str, candidates: Sequence[EvictionCandidate], *,
                    load_s_by_node: dict[str, float], settings: EvictionSettings, num_slots: int = 1,
                    free_slots_by_node: dict[str, int] | None = None, memory_bytes: int = 0,
                    free_memory_by_node: dict[str, int] | None = None, oldest_wait_s: float = 0.0,
                    newest_wait_s: float | None = None, ttft_slo_s: float | None = None) -> EvictionDecision:
    """The idle instance(s) to stop so that `waiting_model_id` gets a slot, or None with the reason.

    `load_s_by_node` is the waiting model's estimated time to ready on each node (placement's
    estimates; a node missing from it is not one the model can go to); `free_slots_by_node` the
    slots already free there (a model needing two slots may use one free slot plus a victim's).
    `free_memory_by_node`: what each node's worker memory budget has free (a node missing from it
    has no budget); the newcomer takes `memory_bytes` of it, and victims are collected until it
    fits (see the module docstring). `ttft_slo_s` (None: no deadline check), `newest_wait_s` and
    `oldest_wait_s`: the waiting model's first-token deadline and how long its newest and oldest
    queued requests have waited (the gateways' reports; newest None: not reported, no check)."""
    for name, value in (("oldest_wait_s", oldest_wait_s), ("newest_wait_s", newest_wait_s), ("ttft_slo_s", ttft_slo_s)):
        if value is not None:
            _number("choose_eviction", name, value)
    free = dict(free_slots_by_node or {})
    free_memory = dict(free_memory_by_node or {})
    eligible: list[tuple[tuple[int, float, float, str], EvictionCandidate, float, float]] = []
    kept: list[str] = []
    for candidate in candidates:
        if candidate.model_id == waiting_model_id:
            continue
        why = _why_kept(candidate, settings, num_slots, free)
        if why is None and candidate.node_id not in load_s_by_node:
            why = "the waiting model cannot be placed on its node"
        if why is None and not candidate.asleep:
            displaced = settings.request_rate(candidate.frequency) * load_s_by_node[candidate.node_id]
            if displaced >= settings.max_displaced_requests:
                why = (f"~{displaced:.3g} of its requests would arrive during the {load_s_by_node[candidate.node_id]:.3g}s "
                       f"load (max_displaced_requests {settings.max_displaced_requests:g})")
        if why is None and not candidate.asleep:
            why = _why_lost(waiting_model_id, load_s_by_node[candidate.node_id], oldest_wait_s, newest_wait_s,
                            ttft_slo_s, settings)
        if why is not None:
            kept.append(f"{candidate.instance_id} ({candidate.model_id}): {why}")
            continue
        score = eviction_score(candidate, settings)
        total = score + load_s_by_node[candidate.node_id]
        eligible.append(((candidate.priority, not candidate.asleep, total, -candidate.idle_s, candidate.instance_id),
                         candidate, score, total))
    if not eligible:
        held = "; ".join(kept) if kept else "no other model holds a slot"
        return EvictionDecision(None, None, f"no idle instance to evict: {held}")
    eligible.sort(key=lambda e: e[0])
    ranked = tuple((c.instance_id, score, total) for _, c, score, total in eligible)
    collected: dict[str, list[tuple[EvictionCandidate, float]]] = {}
    chosen: list[tuple[EvictionCandidate, float]] | None = None
    for _, candidate, score, _ in eligible:  # rank order; each node collects its own until one fits
        on_node = collected.setdefault(candidate.node_id, [])
        on_node.append((candidate, score))
        budget = free_memory.get(candidate.node_id)
        if budget is None or budget + sum(c.memory_bytes for c, _ in on_node) >= memory_bytes:
            chosen = on_node
            break
    if chosen is None:
        node_id, most = max(collected.items(), key=lambda item: (sum(c.memory_bytes for c, _ in item[1]), item[0]))
        return EvictionDecision(None, None, (
            f"no idle instances to evict make room: {waiting_model_id} needs {_gib(memory_bytes)} of worker memory "
            f"and evicting every idle instance on {node_id} ({len(most)}) would leave "
            f"{_gib(free_memory[node_id] + sum(c.memory_bytes for c, _ in most))} free"), ranked)
    victim, score = chosen[0]
    runner_up = ""
    if len(eligible) > 1 and len(chosen) == 1:
        _, other, other_score, _ = eligible[1]
        runner_up = f"; next {other.instance_id} ({other.model_id}) score {other_score:.3g}"
    more = ""
    if len(chosen) > 1:
        freed = sum(c.memory_bytes for c, _ in chosen)
        more = (f"; with {', '.join(f'{c.instance_id} ({c.model_id}, score {s:.3g})' for c, s in chosen[1:])} "
                f"until it fits: {_gib(freed)} freed + {_gib(free_memory[victim.node_id])} free >= "
                f"{_gib(memory_bytes)} needed")
    reason = (f"evict {'asleep' if victim.asleep else 'idle'} {victim.instance_id} ({victim.model_id}, priority {victim.priority}, idle "
              f"{victim.idle_s:.1f}s) on {victim.node_id} for {waiting_model_id}: score {score:.3g} = frequency "
              f"{max(victim.frequency, settings.min_frequency):.3g} x reload {victim.reload_s:.3g}s from "
              f"{victim.reload_tier} / {victim.num_worker_slots} slot(s), + {load_s_by_node[victim.node_id]:.3g}s "
              f"to load {waiting_model_id} there{more}{runner_up}")
    return EvictionDecision(victim, sum(s for _, s in chosen), reason, ranked, tuple(c for c, _ in chosen))
