"""Where a new instance of a model goes: a pure function of the model's size and node views.

For every node, the estimated time until the model is ready there is

    model bytes / bandwidth of the fastest tier holding it there (+ the node loader's wait, for a
    read from SSD or the repository: the loads there it would not pass, `controller.read_path`)

where the tiers are a peer's GPU memory on the node, the node's DRAM cache, its SSD cache, and
the model repository (always available, at the node's measured download rate). Among the
nodes with room the minimum wins: locality first. Room is enough free worker slots and, where
the node has a worker memory budget (``NodeView.free_memory_bytes``: memory is the slot; see
ARCHITECTURE.md, "Slot hosts"), enough of it free for the instance's weights and KV pool. Ties go
to the best fit (the node the instance leaves the least memory free on, so a large free block
stays whole for a large model; a node without a budget counts as the worst fit), then to the
node with more free slots (keeps room for the next model), then to the smaller node id, so the
result never depends on the order of the input.

This is ServerlessLLM's scheduler estimate, extended with the repository and peer-GPU tiers
(ServerlessLLM skips nodes without the model on disk) and a loader wait on the node's disk and
network path: a node whose loader is busy fetching another model may lose to a node that must
read from SSD. A read from the node's DRAM copy or a peer's GPU does not wait for that path (it
runs over memory and the accelerator's own link, issue 39): charging it the wait of another
model's 3-minute repository fetch had a 1 s DRAM restart look like a minute, so the eviction and
deadline checks kept a popular model out of a slot it could have had at once. The bandwidths are the node's calibrated end-to-end rates from that tier into a worker's
memory, so a repository rate includes landing on the SSD on the way.

The decision's tier is also where the node store pins the checkpoint for the start
(`pin_tier`): the start reads what placement estimated, never a tier chosen again later.

`place_locality_blind` is the baseline that ignores all of this (most free slots wins); it
exists so tests and the simulator can show what locality buys. Both return the estimates of
every node, best first, for ``thaw status`` and logs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from controller.read_path import check_short_fetch_ratio, read_path_wait_s

# Source tiers, fastest first by nature; equal estimates prefer the earlier tier.
MODEL_TIERS = ("gpu", "dram", "ssd")
REPOSITORY = "repository"
TIERS = (*MODEL_TIERS, REPOSITORY)
LOADER_TIERS = frozenset({"ssd", REPOSITORY})  # reads that share the node's disk and network loader


def pin_tier(tier: str) -> str:
    """The node-store tier a start that placement estimated from `tier` pins its checkpoint in:
    the DRAM copy when placement chose DRAM, else the SSD (a repository fetch lands there before
    a worker reads it, and it is the node's copy behind a peer's GPU)."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    return "dram" if tier == "dram" else "ssd"


def _check_rate(name: str, value: object, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0{'' if required else ' or None'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TierBandwidths:
    """A node's calibrated rates, bytes/s, from each tier into a worker's memory.

    None means the node has no such tier (or it was never calibrated): a model sitting
    there cannot be used as a source. The repository rate is required: it is the fallback.
    """

    repository_bytes_per_s: float
    ssd_bytes_per_s: float | None = None
    dram_bytes_per_s: float | None = None
    gpu_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _check_rate("repository_bytes_per_s", self.repository_bytes_per_s, required=True)
        for tier in MODEL_TIERS:
            _check_rate(f"{tier}_bytes_per_s", getattr(self, f"{tier}_bytes_per_s"), required=False)

    def rate(self, tier: str) -> float | None:
        return getattr(self, f"{tier}_bytes_per_s")

    def restart_s(self, model_bytes: int) -> float:
        """Seconds to read `model_bytes` again on this node from its fastest checkpoint tier (DRAM,
        else SSD, else the repository): a model that ran here left its copy there, so this is
        what a restart after a scale to zero costs (the autoscaler's `keep_alive_per_restart`)."""
        for tier in ("dram", "ssd"):
            rate = self.rate(tier)
            if rate is not None:
                return model_bytes / rate
        return model_bytes / self.repository_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """One node as placement sees it.

    Fields:
        node_id: the Ray node id (or any stable name).
        num_free_slots: worker slots not taken by an instance.
        free_memory_bytes: what the node's worker memory budget has left for instances (their
            weights plus KV pools); None: the node has no budget, slots alone bound it.
        model_tiers: tiers on this node that hold the model being placed, from "gpu" (a
            running peer instance), "dram" and "ssd"; empty means repository only.
        bandwidths: the node's calibrated rates.
        loader_loads_s: what each of the node's loads from SSD or the repository has left (what
            it is loading now plus loads queued), in the order they go, the one in flight first.
            Only a read from SSD or the repository waits for them: a long one for all of them
            (`loader_wait_s`), while with `short_fetch_ratio` r > 0 a load r times shorter than
            one of them passes it (`controller.read_path`, as the node store orders its fetches).
        short_fetch_ratio: the node store's (`NodeStoreConfig.short_fetch_ratio`, in its
            report); 0: strict arrival order.
    """

    node_id: str
    num_free_slots: int
    bandwidths: TierBandwidths
    model_tiers: frozenset[str] = frozenset()
    loader_loads_s: tuple[float, ...] = ()
    free_memory_bytes: int | None = None
    short_fetch_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"node_id must be a non-empty string, got {self.node_id!r}")
        where = f"node {self.node_id}"
        free = self.num_free_slots
        if not isinstance(free, int) or isinstance(free, bool) or free < 0:
            raise ValueError(f"{where}: num_free_slots must be an integer >= 0, got {free!r}")
        memory = self.free_memory_bytes
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 0):
            raise ValueError(f"{where}: free_memory_bytes must be an integer >= 0 or None, got {memory!r}")
        if not isinstance(self.bandwidths, TierBandwidths):
            raise ValueError(f"{where}: bandwidths must be TierBandwidths, got {type(self.bandwidths).__name__}")
        tiers = frozenset(self.model_tiers) if isinstance(self.model_tiers, Iterable) else None
        if tiers is None or isinstance(self.model_tiers, str) or not tiers <= set(MODEL_TIERS):
            raise ValueError(f"{where}: model_tiers must be a set drawn from {MODEL_TIERS}, got {self.model_tiers!r}")
        for tier in tiers:
            if self.bandwidths.rate(tier) is None:
                raise ValueError(f"node {self.node_id}: holds the model in '{tier}' but has no {tier}_bytes_per_s")
        object.__setattr__(self, "model_tiers", tiers)
        loads = self.loader_loads_s
        if isinstance(loads, (str, bytes)) or not isinstance(loads, Iterable) or not all(map(_seconds, loads)):
            raise ValueError(f"node {self.node_id}: loader_loads_s must be finite seconds >= 0, got {loads!r}")
        object.__setattr__(self, "loader_loads_s", tuple(float(left) for left in loads))
        object.__setattr__(self, "short_fetch_ratio",
                           check_short_fetch_ratio(self.short_fetch_ratio, f"node {self.node_id}: short_fetch_ratio"))

    @property
    def loader_wait_s(self) -> float:
        """What a long read from SSD or the repository waits: every load on the path."""
        return sum(self.loader_loads_s)

    def read_path_wait_s(self, load_s: float) -> float:
        """How long a read of `load_s` from SSD or the repository waits for the loads ahead."""
        return read_path_wait_s(load_s, self.loader_loads_s, self.short_fetch_ratio)


def _seconds(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class NodeEstimate:
    """How soon the model could be ready on one node, and from which tier."""

    node_id: str
    tier: str
    load_s: float
    wait_s: float
    num_free_slots: int
    has_room: bool  # enough free slots (and memory, where the node has a budget) for one instance
    free_memory_bytes: int | None = None  # the node's budget left before this instance; None: no budget
    memory_bytes: int = 0  # what the instance takes of it

    @property
    def ready_s(self) -> float:
        return self.wait_s + self.load_s

    @property
    def memory_left_bytes(self) -> float:
        """The budget this instance would leave free (best fit: least); infinite without a budget."""
        return math.inf if self.free_memory_bytes is None else self.free_memory_bytes - self.memory_bytes

    def describe(self) -> str:
        wait = f" + wait {self.wait_s:.3g}s" if self.wait_s else ""
        room = "" if self.has_room else " (full)"
        fit = "" if self.free_memory_bytes is None else f", {gib_text(self.free_memory_bytes)} free"
        return f"{self.node_id}: {self.tier} {self.load_s:.3g}s{wait} = {self.ready_s:.3g}s{fit}{room}"


def gib_text(num_bytes: float) -> str:
    """``"1.5 GiB"``: a memory amount in a reason."""
    return f"{num_bytes / 2**30:.3g} GiB"


@dataclass(frozen=True)
class PlacementDecision:
    """The chosen node (None when no node has room), and what every node was estimated at.

    `estimates` lists every node: those with room first, best first, then the full ones,
    best first (a full node that would be fastest is where a migration could free a slot).
    """

    node_id: str | None
    tier: str | None
    estimate_s: float | None
    estimates: tuple[NodeEstimate, ...]
    reason: str

    @property
    def placed(self) -> bool:
        return self.node_id is not None


def estimate_node(model_bytes: int, node: NodeView, num_slots: int = 1, memory_bytes: int = 0) -> NodeEstimate:
    """The node's time-to-ready for a model of `model_bytes`, from its fastest tier holding it, and
    whether an instance taking `num_slots` slots and `memory_bytes` of a budget fits there."""
    best_tier, best_load_s = REPOSITORY, model_bytes / node.bandwidths.repository_bytes_per_s
    for tier in MODEL_TIERS:  # fastest tier by nature first, so equal times keep it
        if tier in node.model_tiers:
            load_s = model_bytes / node.bandwidths.rate(tier)
            if load_s < best_load_s or (load_s == best_load_s and TIERS.index(tier) < TIERS.index(best_tier)):
                best_tier, best_load_s = tier, load_s
    return NodeEstimate(
        node_id=node.node_id,
        tier=best_tier,
        load_s=best_load_s,
        wait_s=node.read_path_wait_s(best_load_s) if best_tier in LOADER_TIERS else 0.0,
        num_free_slots=node.num_free_slots,
        has_room=node.num_free_slots >= num_slots and (
            node.free_memory_bytes is None or node.free_memory_bytes >= memory_bytes),
        free_memory_bytes=node.free_memory_bytes,
        memory_bytes=memory_bytes,
    )


def _check_inputs(model_bytes: int, nodes: Sequence[NodeView], num_slots: int, memory_bytes: int = 0) -> None:
    if not isinstance(model_bytes, int) or isinstance(model_bytes, bool) or model_bytes < 1:
        raise ValueError(f"model_bytes must be an integer >= 1, got {model_bytes!r}")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
        raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
    if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool) or memory_bytes < 0:
        raise ValueError(f"memory_bytes must be an integer >= 0, got {memory_bytes!r}")
    node_ids = [node.node_id for node in nodes]
    if len(set(node_ids)) != len(node_ids):
        raise ValueError(f"node ids must be unique, got {sorted(node_ids)}")


def _by_ready(estimate: NodeEstimate) -> tuple[float, float, int, str]:
    return (estimate.ready_s, estimate.memory_left_bytes, -estimate.num_free_slots, estimate.node_id)


def _no_room(estimates: list[NodeEstimate], num_slots: int) -> str:
    """Why no node has room: slots, or (where slots are free) the memory budget."""
    slots = f"{num_slots} free worker slot{'s' * (num_slots > 1)}"
    short = [e for e in estimates if e.num_free_slots >= num_slots]  # slots free, memory short
    if not short:
        return f"no free slot: none of {len(estimates)} nodes has {slots}"
    most = max(short, key=lambda e: (e.free_memory_bytes or 0, e.node_id))
    return (f"no room: none of {len(estimates)} nodes has {slots} and {gib_text(most.memory_bytes)} of worker "
            f"memory free for the instance's weights and KV pool (most free: {most.node_id}, "
            f"{gib_text(most.free_memory_bytes or 0)})")


def _decide(
    estimates: list[NodeEstimate], order: Callable[[NodeEstimate], tuple], policy: str, num_slots: int
) -> PlacementDecision:
    with_room = sorted((e for e in estimates if e.has_room), key=order)
    full = sorted((e for e in estimates if not e.has_room), key=_by_ready)
    ranked = tuple(with_room + full)
    if not with_room:
        return PlacementDecision(None, None, None, ranked, _no_room(estimates, num_slots))
    best = with_room[0]
    runner_up = f"; next {with_room[1].describe()}" if len(with_room) > 1 else ""
    return PlacementDecision(
        best.node_id, best.tier, best.ready_s, ranked,
        f"{policy}: {best.describe()} (of {len(with_room)} nodes with room{runner_up})",
    )


def place(model_bytes: int, nodes: Sequence[NodeView], num_slots: int = 1, memory_bytes: int = 0
          ) -> PlacementDecision:
    """Locality-aware placement: the node with room where the model is ready soonest, then the
    best fit for an instance taking `memory_bytes` of a node's worker memory budget."""
    _check_inputs(model_bytes, nodes, num_slots, memory_bytes)
    estimates = [estimate_node(model_bytes, node, num_slots, memory_bytes) for node in nodes]
    return _decide(estimates, _by_ready, "soonest ready", num_slots)


def place_locality_blind(model_bytes: int, nodes: Sequence[NodeView], num_slots: int = 1, memory_bytes: int = 0
                         ) -> PlacementDecision:
    """Baseline: the node with the most free slots (ties: smaller node id), ignoring where the
    model is. Its estimate is still reported, so the cost of ignoring locality shows."""
    _check_inputs(model_bytes, nodes, num_slots, memory_bytes)
    estimates = [estimate_node(model_bytes, node, num_slots, memory_bytes) for node in nodes]
    return _decide(estimates, lambda e: (-e.num_free_slots, e.node_id), "most free slots", num_slots)
