"""A slot host: one long-lived worker process that model instances come and go through.

Issue 38, Build 1 (ARCHITECTURE.md "Slot hosts"). A fresh worker process pays a process start,
the torch import, the engine's first-load costs (and on a GPU a CUDA context) before it reads a
byte of its model -- seconds, where a load into a warm process takes a fraction of one. So a host
is started with its node, warmed once (``warm``), and then holds several instances at a time:
``call(instance_id, "assign", ...)`` gives it one more, `unload` lets one go, and the process
stays. Each instance is a *body* (`InstanceWorkerActor`, or `migration.MigratableInstanceActor`
as the platform starts it) built in this process, the same object that is otherwise a Ray actor
of its own; the host forwards every call to the body it names (``call`` for a method, ``stream``
for a streaming one), so callers address a hosted instance exactly as an actor
(`wire.HostedInstance`).

The host's engines take turns at their steps (`worker.serving.step_turns`): at most `max_concurrent_steps`
run at once, in the order asked, priority giving a bounded head start.

A call naming an instance the host does not hold raises `wire.ActorGoneError`, as a call to a
dead actor does: the caller forgets that instance (it was unloaded, or the host was restarted).
The host itself imports no Ray; it is made a Ray actor where it is started
(`migration.start_slot_host`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from wire import ActorGoneError, InstanceState
from worker.loading.host_allocator import tune_host_allocator
from worker.serving.instance_worker_actor import InstanceWorkerActor, SpareWorkerError
from worker.serving.process_warmup import warm_up_process
from worker.serving.step_turns import StepTurns

logger = logging.getLogger(__name__)
_PROCESS_STARTED = time.time()

__all__ = ["SlotHost"]


class SlotHost:
    """Ray actor body: several model instances in one warm process (see the module docstring).

    `body_factory(step_turns=...)` builds one model-less instance body (`InstanceWorkerActor` by
    default); `max_instances` bounds how many the host holds at once; `max_concurrent_steps` how
    many of their engine steps run at a time (None: the CPUs this process may run on, each engine
    stepping with its own threads; on a GPU host, 1 is the device's time shared step by step)."""

    def __init__(self, body_factory: Callable[..., Any] | None = None, *, max_instances: int = 8,
                 max_concurrent_steps: int | None = None, max_step_boost: int = 4) -> None:
        if not isinstance(max_instances, int) or isinstance(max_instances, bool) or max_instances < 1:
            raise ValueError(f"SlotHost.max_instances must be an integer >= 1, got {max_instances!r}")
        tune_host_allocator()
        self._factory = body_factory or InstanceWorkerActor
        self.max_instances = max_instances
        if max_concurrent_steps is None:
            max_concurrent_steps = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                       else os.cpu_count() or 1)
        self.turns = StepTurns(max_concurrent_steps, max_step_boost)
        self._bodies: dict[str, Any] = {}
        self._warm_lock = asyncio.Lock()
        self._warm = False

    async def warm(self, weight_bytes: int = 0, kv_bytes: int = 0) -> float:
        """Pays a first load's one-time costs now (`worker.serving.process_warmup`); answers once done,
        with the process's age in seconds. The reservations a single-model spare makes
        (`weight_bytes`, `kv_bytes`) do not apply: a host's models share its memory."""
        async with self._warm_lock:
            if not self._warm:
                await asyncio.to_thread(warm_up_process)
                self._warm = True
        return time.time() - _PROCESS_STARTED

    def host_instance_ids(self) -> list[str]:
        """The instances this host holds, sorted."""
        return sorted(self._bodies)

    def health(self) -> InstanceState:
        """A host is always a spare to whoever asks it directly; its instances answer for themselves."""
        return InstanceState.SPARE

    def _body(self, instance_id: str, method: str) -> Any:
        body = self._bodies.get(instance_id)
        if body is not None:
            return body
        if method != "assign":
            raise ActorGoneError(f"instance {instance_id} is not held by this slot host (unloaded, or never "
                                 "loaded here)")
        if len(self._bodies) >= self.max_instances:
            raise SpareWorkerError(f"this slot host holds {len(self._bodies)} instances, its most "
                                   f"(max_instances {self.max_instances}); place {instance_id} elsewhere")
        body = self._bodies[instance_id] = self._factory(step_turns=self.turns)
        return body

    async def call(self, instance_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``<instance>.<method>(*args, **kwargs)``, awaited if it is a coroutine. ``assign``
        creates the instance's body first; a failed assign leaves no body behind."""
        body = self._body(instance_id, method)
        try:
            result = getattr(body, method)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        except BaseException:
            if method == "assign" and self._bodies.get(instance_id) is body:
                del self._bodies[instance_id]
            raise
        return result

    async def stream(self, instance_id: str, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """The items of ``<instance>.<method>(...)``, a streaming method (``generate``, ``resume``,
        ``recover``); cancelling this stream closes that one (which aborts its request)."""
        body = self._body(instance_id, method)
        async with contextlib.aclosing(getattr(body, method)(*args, **kwargs)) as items:
            async for item in items:
                yield item

    async def unload(self, instance_id: str, timeout_s: float = 10.0) -> bool:
        """Shuts the instance down (open requests end "suspended", as at any stop) and lets it go;
        its memory returns to this process for the next model. False if the host did not hold it."""
        body = self._bodies.get(instance_id)
        if body is None:
            return False
        try:
            await body.shutdown(timeout_s)
        finally:
            if self._bodies.get(instance_id) is body:
                del self._bodies[instance_id]
            del body
            gc.collect()  # the engine's tensors go now, not at some later collection
        logger.info("slot host: instance %s unloaded (%d left)", instance_id, len(self._bodies))
        return True

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Every instance unloaded (the host is being ended)."""
        await asyncio.gather(*(self.unload(i, timeout_s) for i in list(self._bodies)), return_exceptions=True)
