"""One simulated node: its slots, its checkpoint tiers, its read path and the fetches in flight on it.

A record the cluster (`sim.sim_cluster`) writes and the policies read (`sim.node_views`); it
decides nothing.
"""

from __future__ import annotations

from sim.node_loader import LoaderJob
from sim.sim_host import SimHost
from sim.sim_instance import SimInstance
from storage.tier_ledger import TierLedger

__all__ = ["SimNode"]


def _no_clock() -> float:
    return 0.0


class SimNode:
    """One node. `free_slots`: its free GPUs; on slot hosts (`hosts` not None) its GPUs with a
    free place, whatever their memory (`SimCluster.room` says what fits one model)."""

    __slots__ = ("index", "node_id", "num_slots", "free_slots", "dram", "ssd", "loader", "hosts", "sleepers",
                 "fetches")

    def __init__(self, index: int, num_slots: int, dram_bytes: int, ssd_bytes: int, loader,
                 hosts: list[SimHost] | None = None) -> None:
        self.index = index
        self.node_id = f"node-{index:05d}"
        self.num_slots = num_slots
        self.free_slots = num_slots
        # The node store's own bookkeeping and LRU eviction (`storage.tier_ledger`), keyed by model
        # index; the clock only stamps last uses for reports, which a simulation never reads.
        self.dram = TierLedger("dram", dram_bytes, clock=_no_clock)
        self.ssd = TierLedger("ssd", ssd_bytes, clock=_no_clock)
        self.loader = loader  # its SSD and repository reads (`sim.node_loader`)
        self.hosts = hosts
        self.sleepers: dict[int, SimInstance] = {}  # on its slot hosts, by index, longest asleep first
        self.fetches: dict[int, LoaderJob] = {}  # model index -> its last repository fetch here (in flight until end_s)

    def loader_wait_s(self, now: float) -> float:
        """What the node's loads from SSD and repository have left: a long new one's wait, as the
        controller estimates it (`QueuedLoader.backlog_s`, `SharedLoader.backlog_s`)."""
        return self.loader.backlog_s(now)
