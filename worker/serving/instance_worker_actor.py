"""The model instance as a Ray actor, the helpers that start and stop it, and the caller's side
of its token stream.

`InstanceWorkerActor` forwards to an `InstanceWorker` built inside the actor's process, so the
model is loaded there (``ready()`` says when, and how; a failed load is an `InstanceLoadError`
from ``ready()`` while the actor stays up to report it). It is an async actor: every method runs
on one event loop, concurrent ``generate`` streams interleave on it, and the engine thread does
the tensor work beside it. Nothing else in `worker/` knows about Ray; Ray is imported only
inside the helpers, so the rest of the folder works without it.

A caller streams through Ray's streaming generators::

    stream = handle.generate.options(num_returns="streaming").remote(request_id, prompt, params)
    async for ref in stream:
        chunk = await ref          # a GenerationChunk; the last one has finish_reason and usage
    ...
    ray.cancel(stream)             # client went away: aborts the request, frees its KV blocks

Dropping ``stream`` does not stop it — Ray runs a streaming generator to its end whether or not
anyone reads it — so a caller that stops early must call ``ray.cancel(stream)``; that cancels the
actor's asyncio task, which aborts the request in the engine. `stream_generation` does all of
this through `wire.stream`, which also translates Ray's errors as for every Ray caller (the
worker's own errors raised as themselves, a dead actor as `wire.ActorGoneError`), and is what the
gateway should use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from loader import StreamConfig
from wire import InstanceLoad, InstanceState, InstanceStats, stream
from worker.engine.engine import Prompt
from worker.engine.engine_config import EngineConfig
from worker.loading.host_allocator import tune_host_allocator
from worker.serving.instance_worker import GenerationChunk, InstanceWorker, as_engine_config
from worker.loading.peer_weights import PeerWeights
from worker.serving.process_warmup import warm_up_process
from worker.loading.reserved_memory import ReservedMemory
from wire.sampling_params import SamplingParams
from worker.serving.step_turns import StepTurns

_PROCESS_STARTED = time.time()  # when this module was imported: about when the worker process started


class SpareWorkerError(RuntimeError):
    """A model call reached a spare worker that has no model yet, or a spare was assigned twice."""


class InstanceWorkerActor:
    """Ray actor body over `InstanceWorker` (see the module docstring).

    Constructed with a model, it loads it at once. Constructed without one it is a *spare*: a
    worker process started ahead of demand, with torch and the engine imported and the host
    allocator tuned, waiting for ``assign``. A cold start then costs the model's load, not a
    process start and a torch import (~2-3 s, the bulk of a naive cold start). ``warm`` also pays
    the first load's other one-time costs (`worker.serving.process_warmup`, ~2 s measured) and faults
    the memory the model will be loaded into (`worker.loading.reserved_memory`).
    """

    def __init__(self, instance_id: str | None = None, model_id: str | None = None, model_dir: str | None = None,
                 engine_config: EngineConfig | None = None, *, peer: PeerWeights | None = None,
                 num_threads: int | None = None, step_turns: StepTurns | None = None) -> None:
        """`step_turns`: where this body is one of a slot host's (`worker.serving.slot_host`), the turns at
        stepping its engine shares with the host's other models."""
        tune_host_allocator()  # this process exists for its engines (see host_allocator.py)
        self._step_turns = step_turns
        if num_threads is not None:  # an actor reserving no Ray CPU (see `start_instance_worker`)
            import torch

            torch.set_num_threads(max(1, int(num_threads)))
        self._worker: InstanceWorker | None = None
        self._reserved: ReservedMemory | None = None
        self._warm_lock = asyncio.Lock()
        if instance_id is not None:
            self._worker = InstanceWorker(instance_id, model_id, model_dir, engine_config, peer=peer)

    async def warm(self, weight_bytes: int = 0, kv_bytes: int = 0) -> float:
        """Makes the spare ready to take a model fast: warms the process up and reserves
        `weight_bytes` for the weights and `kv_bytes` for the KV pool (both faulted now; see
        `ReservedMemory`). Answers once done (at once when called again); returns the process's
        age in seconds, for the record."""
        async with self._warm_lock:
            if self._worker is None and self._reserved is None:
                def prepare() -> ReservedMemory:
                    warm_up_process()
                    return ReservedMemory(weight_bytes, kv_bytes)

                self._reserved = await asyncio.to_thread(prepare)
        return time.time() - _PROCESS_STARTED

    async def assign(self, instance_id: str, model_id: str, model_dir: str | None, engine_config: EngineConfig,
                     num_threads: int = 1, peer: PeerWeights | None = None, step_priority: int = 0) -> None:
        """Make this spare the instance of a model: loading starts now (await ``ready()``).

        ``num_threads`` stands in for what Ray sets from an actor's ``num_cpus`` at start
        (``OMP_NUM_THREADS``), which a spare, started before anyone knew the model's resources,
        could not get. ``peer``: take the weights from a running instance's stream (see
        `InstanceWorker`; ``model_dir`` may then be None until ``supply_fallback``).
        ``step_priority``: the model's priority in its slot host's turns at stepping."""
        if self._worker is not None:
            raise SpareWorkerError(f"this worker already serves {self._worker.model_id!r} "
                                   f"(instance {self._worker.instance_id}); a worker takes one model")
        import torch

        torch.set_num_threads(max(1, int(num_threads)))
        reserved, self._reserved = self._reserved, None
        self._worker = InstanceWorker(instance_id, model_id, model_dir, as_engine_config(engine_config),
                                      reserved=reserved, peer=peer, step_turns=self._step_turns,
                                      step_priority=step_priority)

    def _model_worker(self) -> InstanceWorker:
        if self._worker is None:
            raise SpareWorkerError("this is a spare worker with no model assigned yet")
        return self._worker

    async def ready(self) -> InstanceLoad:
        return await self._model_worker().ready()

    async def generate(self, request_id: str, prompt: Prompt,
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None
                       ) -> AsyncIterator[GenerationChunk]:
        async for chunk in self._model_worker().generate(request_id, prompt, sampling_params):
            yield chunk

    def abort(self, request_id: str) -> bool:
        return self._worker.abort(request_id) if self._worker is not None else False

    def suspend_requests(self) -> list[str]:
        """Ends every stream "suspended" (`InstanceWorker.suspend`); returns their request ids."""
        return self._worker.suspend() if self._worker is not None else []

    async def stream_weights(self, num_receivers: int = 1, config: StreamConfig | None = None) -> PeerWeights:
        """Stream this instance's model to new instances (see `InstanceWorker.stream_weights`). A
        config that leaves the rendezvous on loopback is given this node's address, so receivers on
        other nodes can reach it."""
        config = config or StreamConfig()
        if config.host == StreamConfig.host:
            config = dataclasses.replace(config, host=_node_address())
        return await self._model_worker().stream_weights(num_receivers, config)

    def supply_fallback(self, checkpoint_dir: str) -> None:
        self._model_worker().supply_fallback(checkpoint_dir)

    async def sleep(self) -> int:
        """Frees the idle model's KV pool, and on a GPU moves its weights to host memory
        (`InstanceWorker.sleep`); returns the device bytes freed."""
        return await self._model_worker().sleep()

    async def wake(self) -> None:
        await self._model_worker().wake()

    def stats(self) -> InstanceStats:
        return self._model_worker().stats()

    def health(self) -> InstanceState:
        return self._worker.health() if self._worker is not None else InstanceState.SPARE

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._worker is not None:
            await self._worker.shutdown(timeout_s)

    async def release_model(self, timeout_s: float = 10.0) -> None:
        """Shuts the model's engine down (open requests end as in ``shutdown``) and lets it go: the
        process is a spare again, torch imported and its first-load costs paid, ready for
        ``assign``. So a slot given to another model (an eviction) can reuse the process instead
        of paying a new one's start (~2-3 s); its freed memory stays in this process's heap for
        the next model. Only a process that reserves no Ray CPU (a spare, or an instance sharing its node
        by memory) should be reused."""
        worker, self._worker = self._worker, None
        if worker is not None:
            await worker.shutdown(timeout_s)
        del worker
        gc.collect()  # the engine's tensors (weights, KV pool) go now, not at some later collection


def _node_address() -> str:
    """This node's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray, or no address: loopback still serves this node
        pass
    return StreamConfig.host


def worker_actor_options(name: str | None, namespace: str | None, node_id: str | None, num_cpus: float,
                         num_gpus: float, detached: bool, options: Mapping[str, Any]) -> dict[str, Any]:
    """Ray options for a worker actor (hard node affinity, no restarts: a restarted worker would
    have lost its requests and its model anyway); subclasses' starters use it too."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
    if name is not None:
        actor_options["name"] = name
    if namespace is not None:
        actor_options["namespace"] = namespace
    if node_id is not None:
        actor_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    if detached:
        actor_options["lifetime"] = "detached"
    actor_options.update(options)
    return actor_options


def start_instance_worker(instance_id: str, model_id: str, model_dir: str | None,
                          engine_config: EngineConfig | Mapping[str, Any] | None = None, *,
                          name: str | None = None, namespace: str | None = None, node_id: str | None = None,
                          num_cpus: float = 1.0, num_gpus: float = 0.0, detached: bool = False,
                          peer: PeerWeights | None = None, num_threads: int | None = None, **options):
    """Starts an `InstanceWorkerActor` and returns its handle at once (the model loads in the actor;
    await ``handle.ready.remote()``).

    ``node_id`` pins the actor to that Ray node (hard node affinity: placement already chose the
    node for its checkpoint's locality, so running anywhere else would defeat it). ``detached``
    lets the actor outlive its creator, so a restarted controller can adopt it by ``name`` and
    ``namespace``. The engine config is validated here, so a bad one fails in the caller rather
    than in a dead actor. ``num_threads`` sets the engine's torch threads where Ray's ``num_cpus``
    does not (an instance sharing its node's cores by memory reserves none; see
    `ControllerConfig.worker_memory_bytes`). Other ``options`` go to ``.options()`` (e.g. ``resources``).
    """
    import ray

    config = as_engine_config(engine_config)
    actor_options = worker_actor_options(name, namespace, node_id, num_cpus, num_gpus, detached, options)
    return ray.remote(InstanceWorkerActor).options(**actor_options).remote(
        instance_id, model_id, None if model_dir is None else str(model_dir), config, peer=peer,
        num_threads=num_threads)


def start_spare_worker(*, name: str | None = None, namespace: str | None = None, node_id: str | None = None,
                       detached: bool = False, **options):
    """Starts a spare `InstanceWorkerActor` (no model; ``warm()`` answers once it can take one,
    ``assign(...)`` gives it one) and returns its handle at once.

    A spare reserves no Ray CPU (``num_cpus=0``): it idles until assigned, and the controller's
    worker slots, not Ray's CPU count, bound how many instances a node runs. It has no GPU
    either, so it serves CPU instances; a GPU instance starts a fresh actor.
    """
    import ray

    actor_options = worker_actor_options(name, namespace, node_id, 0, 0, detached, options)
    return ray.remote(InstanceWorkerActor).options(**actor_options).remote()


def stop_instance_worker(handle, timeout_s: float = 30.0) -> None:
    """Shuts the instance down cleanly (open streams end "suspended", the engine thread stops),
    then ends the actor. An actor that is already gone counts as stopped."""
    import ray

    try:
        ray.get(handle.shutdown.remote(timeout_s), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass
    finally:
        ray.kill(handle, no_restart=True)


async def stream_generation(handle, request_id: str, prompt: Prompt,
                            sampling_params: Mapping[str, Any] | SamplingParams | None = None
                            ) -> AsyncIterator[GenerationChunk]:
    """The caller's side of ``generate``: yields the chunks; leaving early cancels the request.

    The worker's own errors (`InvalidFieldError` and the other `InvalidRequestError`s,
    `InstanceLoadError`, `EngineDeadError`, `RequestFailedError`, `SpareWorkerError`) are raised
    as themselves, with Ray's wrapper as their ``__cause__``; a dead actor is
    `wire.ActorGoneError` (see `wire.ray_calls`).
    """
    generator = handle.generate.options(num_returns="streaming").remote(request_id, prompt, sampling_params)
    # aclosing: leaving this generator early closes `stream`'s now, which cancels the request.
    async with contextlib.aclosing(stream(generator, is_last=lambda chunk: chunk.finished)) as chunks:
        async for chunk in chunks:
            yield chunk
