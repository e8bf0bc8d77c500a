"""Which GPU sleepers give way when host memory for sleepers runs short: `room_for_sleeper`.

On a GPU node a sleeping instance's weights wait in pinned host memory (`worker.HostWeights`):
it holds none of its GPU's memory, so the GPU's budget never makes it go, but page-locked host
memory is finite (and what the node's DRAM tier and its processes need too). So a GPU node's
sleepers may hold at most `ControllerConfig.gpu_sleep_memory_bytes` per GPU of host memory in all
(ARCHITECTURE.md "Slot hosts": "drops the asleep when host memory runs short").

When one more instance would go to sleep there and its weights do not fit beside the sleepers'
already there, the longest asleep go first (the least likely wanted: a sleeper's model had no
demand since it fell asleep, so the longest asleep is the longest unwanted; ties: the smaller
id), until it fits. A newcomer larger than the whole bound never sleeps: it is stopped as
before sleep existed, and no sleeper is dropped for it. A pure function of plain values: tested
with numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostSleeper", "SleeperRoom", "room_for_sleeper"]


@dataclass(frozen=True)
class HostSleeper:
    """One instance asleep in a node's host memory: `weight_bytes` held since `asleep_s`."""

    instance_id: str
    weight_bytes: int
    asleep_s: float


@dataclass(frozen=True)
class SleeperRoom:
    """Whether the newcomer may sleep (`fits`), the sleepers to stop first (`dropped`, in order),
    and why, for the decision log."""

    fits: bool
    dropped: tuple[str, ...]
    reason: str


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def room_for_sleeper(instance_id: str, weight_bytes: int, sleepers: Sequence[HostSleeper],
                     capacity_bytes: int) -> SleeperRoom:
    """See the module docstring. `sleepers`: those asleep on the newcomer's node now."""
    if weight_bytes > capacity_bytes:
        return SleeperRoom(False, (), f"its weights ({_gib(weight_bytes)}) exceed the {_gib(capacity_bytes)} of host "
                                      f"memory this node's sleepers may hold (gpu_sleep_memory_bytes)")
    held = sum(s.weight_bytes for s in sleepers)
    dropped: list[HostSleeper] = []
    for sleeper in sorted(sleepers, key=lambda s: (s.asleep_s, s.instance_id)):
        if held + weight_bytes <= capacity_bytes:
            break
        dropped.append(sleeper)
        held -= sleeper.weight_bytes
    if not dropped:
        return SleeperRoom(True, (), f"{_gib(held + weight_bytes)} of the sleepers' {_gib(capacity_bytes)} of host "
                                     f"memory held with {instance_id}")
    return SleeperRoom(True, tuple(s.instance_id for s in dropped), (
        f"the longest asleep ({', '.join(s.instance_id for s in dropped)}) stopped for {instance_id}: the node's "
        f"sleepers may hold {_gib(capacity_bytes)} of host memory, {_gib(held + weight_bytes)} with it"))
