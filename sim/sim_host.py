"""One simulated GPU as a slot host: its memory is the slot (ARCHITECTURE.md, "Slot hosts").

With `ClusterSpec.models_per_gpu` above 1 a GPU holds up to that many instances at once, as far
as their shares fit its memory (`ClusterSpec.gpu_memory_bytes`): an instance of a model whose
tensor-parallel degree is k takes k hosts of one node, and of each its share, the weights / k
plus its KV pool / k (`CostModel.instance_memory_bytes`).

Co-resident instances with work take turns at their decode steps (the worker's `StepTurns`:
token-level time sharing, one step at a time on the device, as Aegaeon does), so each one's step
lasts its own step plus the steps of the other busy instances on its hosts
(`SimInstance.share`). A stated simplification: a prefill holds up only its own instance's
decode, not its neighbours' (optimistic for them by the share of GPU time prefills take).

Accounting: a host is in use (one accelerator-second per second) while any instance is on it,
however many; an instance's own slots are not counted apart, so two models on one GPU cost one
GPU's time.
"""

from __future__ import annotations

__all__ = ["SimHost", "best_fit", "neighbours", "others_s", "reshare"]


class SimHost:
    """One GPU's memory and places; the cluster alone changes it (`SimCluster`)."""

    __slots__ = ("index", "free_bytes", "free_places", "instances", "occupied_since_s")

    def __init__(self, index: int, memory_bytes: int, places: int) -> None:
        self.index = index  # the GPU's index on its node
        self.free_bytes = memory_bytes
        self.free_places = places
        self.instances: list = []  # the SimInstances on it, in arrival order
        self.occupied_since_s: float | None = None  # since when an instance has been on it

    def fits(self, share_bytes: int) -> bool:
        return self.free_places > 0 and self.free_bytes >= share_bytes

    def fits_once_gone(self, share_bytes: int, leaving_bytes: int) -> bool:
        """Whether `share_bytes` would fit once an instance here holding `leaving_bytes` left (its
        place comes free with its memory)."""
        return self.free_bytes + leaving_bytes >= share_bytes

    def take(self, instance, share_bytes: int, now: float) -> bool:
        """Put `instance` here; True when the host was empty (it is in use from now)."""
        self.free_bytes -= share_bytes
        self.free_places -= 1
        self.instances.append(instance)
        if self.occupied_since_s is None:
            self.occupied_since_s = now
            return True
        return False

    def give_back(self, instance, share_bytes: int, now: float) -> float | None:
        """`instance` leaves; the seconds the host was in use when it is now empty, else None."""
        self.instances.remove(instance)
        self.free_bytes += share_bytes
        self.free_places += 1
        if self.instances:
            return None
        used_s = now - self.occupied_since_s
        self.occupied_since_s = None
        return used_s


def best_fit(hosts, share_bytes: int, count: int) -> tuple[SimHost, ...]:
    """The `count` hosts that fit `share_bytes` leaving the least memory free (then the lower
    index), as the controller's `SparePool.host_for`: a large free block stays whole."""
    fitting = sorted((h for h in hosts if h.fits(share_bytes)), key=lambda h: (h.free_bytes, h.index))
    return tuple(fitting[:count])


def neighbours(hosts, instance) -> list:
    """The other instances on `hosts`, each once, in the order they came."""
    found: dict[int, object] = {}
    for host in hosts:
        for other in host.instances:
            if other is not instance:
                found.setdefault(other.index, other)
    return list(found.values())


def others_s(instance) -> float:
    """The steps `instance`'s turn waits for: its co-residents' own decode steps."""
    return sum(other.own_step_s for other in neighbours(instance.hosts, instance))


def reshare(hosts, instance, now: float) -> None:
    """`instance`'s own step changed (or it left `hosts`): each neighbour's turn waits anew."""
    for neighbour in neighbours(hosts, instance):
        neighbour.share(now, others_s(neighbour))
