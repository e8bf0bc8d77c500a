"""Spare workers: worker processes started ahead of demand, so a cold start skips the process.

Starting a worker actor costs a new Python process and an import of torch and the engine --
about 2-3 s, longer than reading a 1 GB checkpoint from a node's DRAM or SSD. A cold start that
pays it cannot be fast, so each Ray node keeps `ControllerConfig.spare_workers_per_node` spare
workers (`worker.start_spare_worker`): running, imports done, no model. Starting an instance
takes a warm spare on its node when there is one and assigns the model to it; the pool starts a
replacement once that instance has been ready for `ControllerConfig.spare_refill_delay_s`, off
the request's path (see `SparePool.replenish`). A worker that was itself a spare and whose model
is evicted for another comes back to the pool (`adopt`): slots changing hands reuse processes.
Where memory is the slot, so does any worker reserving no Ray CPU whose model scales down, and a
node may keep up to `adopt_per_node` such warm processes. And there (`replenish`'s `hosts`) a node
keeps one warm worker process per slot: spares fill the slots its instances' processes do not
(ARCHITECTURE.md "Slot hosts": processes started with the node and kept, models coming and going
through them), so a model's first start skips the process start too, not only its later ones.

With `host_models` > 1 (`ControllerConfig.models_per_process`) the pool's processes are slot
hosts (`worker.SlotHost`): a host is never taken out of the pool; `host_for` loads one more
instance into the node's warm host holding the fewest (up to `host_models`), `unhost` lets it go,
and the host stays warm for the next. A node then keeps enough hosts for its slots. On a GPU node
(`replenish`'s `gpu_ray_node_ids`: memory is the slot there, `ControllerConfig.gpu_memory_bytes`)
each host owns one GPU (started with ``num_gpus=1``; its warm-up makes the CUDA context) and has
that GPU's memory to itself: `can_host` / `host_for` (a check/commit pair) fit an instance into a
host whose instances leave room for it, the fullest such (best fit: packing leaves the largest
holes for large models). There is no fresh-process fallback on such a node (its hosts hold every
GPU), so a model waits for a warm host with room.

``warm()`` makes a spare pay the rest of a first load's one-time costs (the engine's lazy imports,
the attention kernel, oneDNN's first primitives) and fault the memory its model will be loaded
into: `ControllerConfig.spare_weight_bytes` for the weights, the engine's KV cache size for the
KV pool. A spare is offered only once it has answered ``warm()`` (a spare still importing torch
would make the start slower, not faster), and only to CPU instances (a spare holds no GPU; see
`start_spare_worker`), except a GPU node's slot hosts. Spares are named ``thaw-worker-spare-...`` in the platform's namespace, so
a restarted controller that finds one without a worker record ends it like any orphan worker
and starts fresh ones.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.cluster_client import ActorGoneError, ClusterClient, worker_actor_name

logger = logging.getLogger(__name__)
SPARE_NAME_PREFIX = "spare-"


def spare_actor_name() -> str:
    """A fresh spare's actor name (a worker name, so adoption and orphan clean-up cover it)."""
    return worker_actor_name(f"{SPARE_NAME_PREFIX}{uuid.uuid4().hex[:12]}")


@dataclass
class Spare:
    """One spare worker; `warm` once it answered ``warm()``."""

    actor_name: str
    ray_node_id: str
    handle: Any
    warm: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)
    hosted: set[str] = field(default_factory=set)  # a slot host's instances
    num_gpus: int = 0  # 1: a GPU node's slot host, owning its GPU


class SparePool:
    """The spares of every Ray node (see the module docstring). Runs on the controller's loop."""

    def __init__(self, cluster: ClusterClient, per_node: int, warm_timeout_s: float, *, weight_bytes: int = 0,
                 kv_bytes: int = 0, adopt_per_node: int | None = None, host_models: int = 1) -> None:
        self._cluster = cluster
        self.per_node = per_node
        self.host_models = host_models  # > 1: the pool's processes are slot hosts holding this many
        # How many spares a node may hold counting workers taken back (`adopt`); the pool only ever
        # starts `per_node`. More where memory is the slot: a stopped model's process is kept
        # warm for the next model rather than ended and, later, paid for again.
        self.adopt_per_node = max(per_node, adopt_per_node or 0)
        self._warm_timeout_s = warm_timeout_s
        self._weight_bytes = weight_bytes  # what each spare faults ahead for its model's weights
        self._kv_bytes = kv_bytes  # ... and for its KV pool
        self._spares: dict[str, Spare] = {}  # actor name -> spare
        self.num_started = 0  # spare processes started so far (for ``thaw status`` and benchmarks)
        self._hosts: dict[str, int] = {}  # Ray node -> warm processes it keeps in all (`replenish`)

    @property
    def hosting(self) -> bool:
        return self.host_models > 1

    def take(self, ray_node_id: str) -> Spare | None:
        """A warm spare on that Ray node, now the caller's (the pool forgets it); None if none (and
        always where the pool's processes are slot hosts: see `host_for`)."""
        if self.hosting:
            return None
        for name, spare in sorted(self._spares.items()):
            if spare.ray_node_id == ray_node_id and spare.warm:
                del self._spares[name]
                return spare
        return None

    def can_host(self, ray_node_id: str, memory_bytes: int = 0, *, capacity_bytes: int | None = None,
                 held_bytes: Mapping[str, int] | None = None) -> Spare | None:
        """The warm slot host on that Ray node that would take one more instance (`host_for`
        without taking it); None if none has room.

        Room is a place (fewer than `host_models` instances) and, where each host has memory of
        its own (`capacity_bytes`: a GPU's), `memory_bytes` left once its instances' `held_bytes`
        (instance id -> bytes held now; a sleeper on a GPU holds none) are counted. Among those:
        the fullest that fits (best fit), then the fewest instances, then the smallest name;
        without `capacity_bytes`, the fewest instances, then the smallest name."""
        if not self.hosting:
            return None
        held = held_bytes or {}

        def free_bytes(host: Spare) -> int:
            return (capacity_bytes or 0) - sum(held.get(instance_id, 0) for instance_id in host.hosted)

        hosts = [s for s in self._spares.values()
                 if s.ray_node_id == ray_node_id and s.warm and len(s.hosted) < self.host_models
                 and (capacity_bytes is None or free_bytes(s) >= memory_bytes)]
        if not hosts:
            return None
        if capacity_bytes is None:
            return min(hosts, key=lambda s: (len(s.hosted), s.actor_name))
        return min(hosts, key=lambda s: (free_bytes(s) - memory_bytes, len(s.hosted), s.actor_name))

    def host_for(self, ray_node_id: str, instance_id: str, memory_bytes: int = 0, *,
                 capacity_bytes: int | None = None, held_bytes: Mapping[str, int] | None = None) -> Spare | None:
        """The slot host `can_host` chooses, now holding `instance_id` too; None if none."""
        host = self.can_host(ray_node_id, memory_bytes, capacity_bytes=capacity_bytes, held_bytes=held_bytes)
        if host is not None:
            host.hosted.add(instance_id)
        return host

    def unhost(self, actor_name: str, instance_id: str) -> None:
        """`instance_id` is no longer in the slot host `actor_name` (unloaded, or it failed)."""
        host = self._spares.get(actor_name)
        if host is not None:
            host.hosted.discard(instance_id)

    def adopt_host(self, actor_name: str, ray_node_id: str, handle: Any, instance_id: str) -> None:
        """A slot host found holding `instance_id` after a controller restart: the pool's again
        (warm), so its room is used and it is ended with the pool, not left behind."""
        if not self.hosting:
            return
        host = self._spares.get(actor_name)
        if host is None:
            host = self._spares[actor_name] = Spare(actor_name, ray_node_id, handle, warm=True)
        host.hosted.add(instance_id)

    def hosts(self) -> list[Spare]:
        """The slot hosts (none unless the pool's processes are hosts), by name."""
        return sorted(self._spares.values(), key=lambda s: s.actor_name) if self.hosting else []

    def drop_host(self, actor_name: str) -> None:
        """A slot host whose actor died: out of the pool (ended, to be sure), replaced by `replenish`."""
        host = self._spares.pop(actor_name, None)
        if host is not None:
            logger.warning("slot host %s is gone (its instances with it); a new one will start", actor_name)
            self._end(host)

    def adopt(self, actor_name: str, ray_node_id: str, handle: Any) -> bool:
        """Takes a worker whose model was let go (``release_model``: an evicted instance, or one
        scaled down whose process reserves no Ray CPU) back as a warm spare, if its node has room
        in the pool (`adopt_per_node`); False: the caller stops it."""
        if not self.has_room(ray_node_id) or actor_name in self._spares:
            return False
        self._spares[actor_name] = Spare(actor_name, ray_node_id, handle, warm=True)
        logger.info("worker %s is a spare again on Ray node %s (its model was let go)", actor_name, ray_node_id[:12])
        return True

    def has_room(self, ray_node_id: str) -> bool:
        """Whether the node's pool may take a worker back (`adopt_per_node`, or the node's slots where
        it keeps a process per slot; warm or starting)."""
        cap = max(self.adopt_per_node, self._hosts.get(ray_node_id, 0))
        return sum(1 for spare in self._spares.values() if spare.ray_node_id == ray_node_id) < cap

    def counts(self) -> dict[str, dict[str, int]]:
        """Ray node id -> {"warm": n, "starting": n}, for ``thaw status`` (and "hosted": the
        instances its slot hosts hold, where they are hosts)."""
        counts: dict[str, dict[str, int]] = {}
        for spare in self._spares.values():
            entry = counts.setdefault(spare.ray_node_id, {"warm": 0, "starting": 0}
                                      | ({"hosted": 0} if self.hosting else {}))
            entry["warm" if spare.warm else "starting"] += 1
            if self.hosting:
                entry["hosted"] += len(spare.hosted)
        return counts

    def replenish(self, ray_node_ids: list[str], busy_ray_node_ids: Collection[str] = (),
                  hosts: Mapping[str, int] | None = None, in_use: Mapping[str, int] | None = None,
                  gpu_ray_node_ids: Collection[str] = ()) -> list[str]:
        """Start spares where a node has fewer than `per_node` (warm or starting), except on
        `busy_ray_node_ids`; end those of nodes that left. A node in `hosts` keeps that many warm
        processes in all (its slots, or hosts enough for them): spares fill what its instances'
        poolable processes (`in_use`) do not, and none is started beyond that, so once warm the
        node's processes are the ones it keeps (none either when `per_node` is 0: spares are off).
        On `gpu_ray_node_ids` (GPU nodes in `hosts`) each process is a slot host owning one GPU.
        Returns errors, one per failed start (the next tick retries).

        A busy node is one whose newest instance is still loading or only just ready: starting a
        spare costs seconds of CPU (a process, the torch import, the warm-up, faulting its
        memory), which on a small node would slow the very cold start it replaces and that
        instance's first requests (measured on 2 cores: a warm first token 2.5x slower)."""
        errors = []
        live = set(ray_node_ids)
        self._hosts = {node: num for node, num in (hosts or {}).items() if node in live}
        for name, spare in list(self._spares.items()):
            if spare.ray_node_id not in live:
                del self._spares[name]
                self._end(spare)
        for ray_node_id in sorted(live - set(busy_ray_node_ids)):
            have = sum(1 for spare in self._spares.values() if spare.ray_node_id == ray_node_id)
            want = self.per_node
            if want and ray_node_id in self._hosts:  # per_node 0: spares are off, slot hosts too
                slots = max(0, self._hosts[ray_node_id] - (in_use or {}).get(ray_node_id, 0))
                want = -(-slots // self.host_models)  # processes enough for its slots, no more
            num_gpus = int(self.hosting and ray_node_id in self._hosts and ray_node_id in gpu_ray_node_ids)
            for _ in range(want - have):
                name = spare_actor_name()
                try:
                    handle = self._cluster.start_spare_worker(actor_name=name, ray_node_id=ray_node_id,
                                                              host_models=self.host_models, num_gpus=num_gpus)
                except Exception as exc:  # noqa: BLE001 - no spare is a slower start, not a failure
                    errors.append(f"spare worker on Ray node {ray_node_id[:12]}: {type(exc).__name__}: {exc}")
                    break
                self.num_started += 1
                spare = Spare(name, ray_node_id, handle, num_gpus=num_gpus)
                self._spares[name] = spare
                spare.task = asyncio.get_running_loop().create_task(self._await_warm(spare))
        return errors

    async def _await_warm(self, spare: Spare) -> None:
        try:
            age_s = await self._cluster.spare_warm(spare.handle, self._warm_timeout_s,
                                                   weight_bytes=self._weight_bytes, kv_bytes=self._kv_bytes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a spare that cannot start is dropped and replaced
            logger.warning("spare worker %s did not start: %s: %s", spare.actor_name, type(exc).__name__, exc)
            if self._spares.get(spare.actor_name) is spare:
                del self._spares[spare.actor_name]
            await self._stop(spare)
            return
        spare.warm = True
        logger.info("spare worker %s warm on Ray node %s (%.1f s after its process started)", spare.actor_name,
                    spare.ray_node_id[:12], age_s)

    def _end(self, spare: Spare) -> None:
        if spare.task is not None:
            spare.task.cancel()
        asyncio.get_running_loop().create_task(self._stop(spare))

    async def _stop(self, spare: Spare) -> None:
        try:
            await self._cluster.stop_worker(spare.handle, 5.0)
        except (ActorGoneError, TimeoutError):
            pass
        except Exception:  # noqa: BLE001
            logger.exception("stopping spare worker %s failed", spare.actor_name)

    async def close(self, keep_hosting: bool = False) -> None:
        """End every spare (the controller is shutting down); with `keep_hosting`, not a slot host
        still holding instances (a successor adopts them there)."""
        spares = [s for s in self._spares.values() if not (keep_hosting and s.hosted)]
        self._spares = {}
        for spare in spares:
            if spare.task is not None:
                spare.task.cancel()
        await asyncio.gather(*(self._stop(spare) for spare in spares), return_exceptions=True)
