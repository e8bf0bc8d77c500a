"""What a node store holds and how fast it can deliver it: the snapshot placement works from.

Frozen dataclasses, cheap to pickle across Ray and safe to keep: a report never changes after
it is taken. Placement is a pure function of reports (STYLE.md): `BandwidthReport.load_s` turns
a model's bytes into estimated seconds from a tier at this node's measured bandwidths, and
`NodeStoreReport.best_tier` says where on the node a model currently sits.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_NAMES = ("dram", "ssd")  # fastest first
SOURCE_NAMES = (*TIER_NAMES, "repository")


@dataclass(frozen=True)
class TierEntryReport:
    """One model in one tier. `last_used_s` is Unix time; `filling`: still arriving, not usable yet."""

    model: str
    num_bytes: int
    last_used_s: float
    pinned: bool
    num_loading: int
    filling: bool = False

    @property
    def loading(self) -> bool:
        return self.num_loading > 0


@dataclass(frozen=True)
class TierReport:
    """One tier: where, how big, how full, and its entries from least to most recently used."""

    tier: str
    path: str
    capacity_bytes: int
    used_bytes: int
    entries: tuple[TierEntryReport, ...]

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def models(self) -> tuple[str, ...]:
        """Usable models, least recently used first."""
        return tuple(e.model for e in self.entries if not e.filling)

    def get(self, model: str) -> TierEntryReport | None:
        return next((e for e in self.entries if e.model == model), None)


@dataclass(frozen=True)
class BandwidthReport:
    """Bytes per second measured on this node; None where not measured (calibration off or failed).

    `ssd_bytes_per_s`: cold reads from the SSD cache's filesystem (page cache dropped) into a
    process's memory; `dram_bytes_per_s`: reads from the shared-memory tier; `repository_bytes_per_s`:
    downloads from the repository (a probe at start, then the rate of the last large fetch)."""

    ssd_bytes_per_s: float | None
    dram_bytes_per_s: float | None
    repository_bytes_per_s: float | None
    measured_at: float  # Unix time

    def rate(self, source: str) -> float | None:
        """End-to-end bytes/s from `source` (see SOURCE_NAMES) into a worker's memory, None if
        unknown. From the repository a model is downloaded to the SSD and then read from it, so
        that rate combines both (1 / (1/download + 1/ssd)); conversion time is not included."""
        if source not in SOURCE_NAMES:
            raise ValueError(f"source {source!r} is not one of {SOURCE_NAMES}")
        rates = {"dram": (self.dram_bytes_per_s,), "ssd": (self.ssd_bytes_per_s,),
                 "repository": (self.repository_bytes_per_s, self.ssd_bytes_per_s)}[source]
        if any(r is None or r <= 0 for r in rates):
            return None
        return 1.0 / sum(1.0 / r for r in rates)

    def load_s(self, source: str, num_bytes: int) -> float | None:
        """Estimated seconds to load `num_bytes` from `source` into a worker (None if unknown)."""
        rate = self.rate(source)
        return None if rate is None else num_bytes / rate


@dataclass(frozen=True)
class NodeStoreReport:
    """Everything a node store holds, with its bandwidths and counters, at `reported_at` (Unix time)."""

    platform_id: str
    node_id: str
    tiers: tuple[TierReport, ...]  # dram, ssd
    bandwidth: BandwidthReport
    num_fetches: int  # repository downloads since start
    num_conversions: int  # of which Hugging Face dirs converted to the thaw format
    reported_at: float
    worker_memory_bytes: int | None = None  # the node's own worker memory budget; None: the platform's
    num_fetches_waiting: int = 0  # repository fetches queued behind those in flight (`storage.fetch_queue`)
    short_fetch_ratio: float = 0.0  # a fetch this many times smaller passes a longer one (0: arrival order)

    def tier(self, name: str) -> TierReport:
        for tier in self.tiers:
            if tier.tier == name:
                return tier
        raise KeyError(f"no tier {name!r}; tiers: {[t.tier for t in self.tiers]}")

    def best_tier(self, model: str) -> str | None:
        """The fastest tier holding a usable copy of `model`, None if only the repository has it."""
        for name in TIER_NAMES:
            if model in self.tier(name).models:
                return name
        return None

    def estimate_load_s(self, model: str, num_bytes: int) -> float | None:
        """Seconds to load `model` (`num_bytes`) from its best source on this node."""
        return self.bandwidth.load_s(self.best_tier(model) or "repository", num_bytes)
