"""One simulated GPU as a slot host: its memory is the slot (ARCHITECTURE.md, "Slot hosts").

With `ClusterSpec.models_per_gpu` above 1 a GPU holds up to that many instances at once, as far
as their shares fit its memory (`ClusterSpec.gpu_memory_bytes`): an instance of a model whose
tensor-parallel degree is k takes k hosts of one node, and of each its share, the weights / k
plus its KV pool / k (`CostModel.instance_memory_bytes`).

Co-resident instances with work take turns at their decode steps (the worker's `StepTurns`:
token-level time sharing, one step at a time on the device, as Aegaeon does), so each one's step
lasts its own step plus the steps of the other busy instances on its hosts
(`SimInstance.share`). A prefill takes the GPU whole: prefills on one host run one after
another (`prefill_until_s`), and each holds up its neighbours' decode for its length
(`SimInstance.hold`; the token clock loses that time at once rather than when the prefill runs,
which is the same count of tokens once it has ended). An instance's decode turn still counts for
its neighbours while its own prefill holds its decode: pessimistic for them, by at most that
prefill's share of their steps.

Accounting: a host is in use (one accelerator-second per second) while an awake instance is on
it, however many; an instance's own slots are not counted apart, so two models on one GPU cost
one GPU's time, and a GPU holding only sleepers costs none.
"""

from __future__ import annotations

__all__ = ["SimHost", "best_fit", "neighbours", "others_s", "prefill_taken", "reshare"]


class SimHost:
    """One GPU's memory and places; only the cluster's `SlotHosts` changes it. An instance asleep on
    it keeps its place and holds none of its memory (its weights wait in host memory)."""

    __slots__ = ("index", "free_bytes", "free_places", "instances", "num_awake", "occupied_since_s",
                 "prefill_until_s", "steps_s")

    def __init__(self, index: int, memory_bytes: int, places: int) -> None:
        self.index = index  # the GPU's index on its node
        self.free_bytes = memory_bytes
        self.free_places = places
        self.instances: list = []  # the SimInstances on it (asleep ones too), in arrival order
        self.num_awake = 0
        self.occupied_since_s: float | None = None  # since when an awake instance has been on it
        self.prefill_until_s = 0.0  # when the last prefill begun on it ends
        self.steps_s = 0.0  # its instances' own decode steps, summed (`reshare` keeps it)

    def fits(self, share_bytes: int) -> bool:
        return self.free_places > 0 and self.free_bytes >= share_bytes

    def fits_once_gone(self, share_bytes: int, leaving_bytes: int) -> bool:
        """Whether `share_bytes` would fit once an instance here holding `leaving_bytes` left (its
        place comes free with its memory)."""
        return self.free_bytes + leaving_bytes >= share_bytes

    def take(self, instance, share_bytes: int, now: float) -> bool:
        """Put `instance` here, awake; True when no awake instance was (the GPU is in use from now)."""
        self.free_places -= 1
        self.instances.append(instance)
        return self.rouse(share_bytes, now)

    def rouse(self, share_bytes: int, now: float) -> bool:
        """An instance here takes `share_bytes` and works (started, or woken); True as `take`."""
        self.free_bytes -= share_bytes
        self.num_awake += 1
        if self.occupied_since_s is None:
            self.occupied_since_s = now
            return True
        return False

    def doze(self, share_bytes: int, now: float) -> float | None:
        """An awake instance here gives its `share_bytes` back (it sleeps, or leaves); the seconds
        the GPU was in use when no awake instance is left, else None."""
        self.free_bytes += share_bytes
        self.num_awake -= 1
        if self.num_awake:
            return None
        used_s = now - self.occupied_since_s
        self.occupied_since_s = None
        return used_s

    def give_back(self, instance, share_bytes: int, now: float, *, awake: bool = True) -> float | None:
        """`instance` leaves, its place free (and its memory, when `awake`); as `doze`."""
        self.instances.remove(instance)
        self.free_places += 1
        return self.doze(share_bytes, now) if awake else None


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
    """The steps `instance`'s turn waits for: its co-residents' own decode steps (on one GPU, its
    host's sum less its own; across several, each co-resident once)."""
    if len(instance.hosts) == 1:
        return instance.hosts[0].steps_s - instance.own_step_s
    return sum(other.own_step_s for other in neighbours(instance.hosts, instance))


def reshare(hosts, instance, now: float) -> None:
    """`instance`'s own step changed (or it left `hosts`): each neighbour's turn waits anew."""
    for host in hosts:
        host.steps_s = sum(other.own_step_s for other in host.instances)
    for neighbour in neighbours(hosts, instance):
        neighbour.share(now, others_s(neighbour))


def prefill_taken(instance, now: float, prefill_s: float) -> None:
    """`instance` began a prefill ending at its `resume_s`: its hosts are taken until then, and its
    neighbours' decode stands still for `prefill_s`."""
    for host in instance.hosts:
        if instance.resume_s > host.prefill_until_s:
            host.prefill_until_s = instance.resume_s
    for neighbour in neighbours(instance.hosts, instance):
        neighbour.hold(now, prefill_s)
