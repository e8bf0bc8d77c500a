"""A model instance as a Ray actor that can hand its requests over and take others in.

`MigratableInstanceActor` is `InstanceWorkerActor` plus the migration endpoint's methods (each
forwards to an `EngineEndpoint` over the instance's engine; `RayEndpoint` is the caller's side)
and the two methods a client needs to follow a request that moved:

* ``handoff_target(request_id)`` on the old instance: where the request went, once its stream
  ended with ``finish_reason="migrated"``;
* ``resume(request_id)`` on the new instance: a streaming generator of `GenerationChunk`s from the
  first token after the hand-off, read like ``generate``'s (cancel it and the request is aborted).

and one for a request whose instance died: ``recover(request_id, prompt, params, sent_token_ids)``
continues it here from the tokens its client already received (the gateway's failure recovery),
and one for a client whose stream went quiet: ``request_progress(request_id)`` (loading, queued,
running, frozen; `follow_generation`'s idle check).

Checkpoints. A live migration moves a request only between instances of the same checkpoint
(`worker.loading.checkpoint_identity`; the destination refuses any other, and the request finishes on its
source). A recovery is different: its source is dead, so refusing it fails the client's stream.
It is therefore *not* refused when this instance serves another checkpoint of the model than the
dead one did (the model was deployed again meanwhile): the new weights continue from the tokens
the client already has -- the output is the old version's beginning and the new version's rest,
exactly what the client would get by sending its partial answer to the new version as a prompt.
What cannot be continued is still refused: token ids outside this checkpoint's vocabulary
(`MigrationRefusedError`), and KV parked by another checkpoint (its replay is refused, so the
recovery recomputes the KV from the tokens instead of mixing another checkpoint's KV in).

KV blocks travel through Ray's object store by default (`RayObjectKVTransport`): the source puts
them there once, the destination reads them, the driver only passes the reference.

Being a subclass keeps `worker/` free of migration; started with `start_migratable_instance`
(same arguments as `start_instance_worker`, which is hard-wired to its own class), or as a spare
with `start_migratable_spare` (no model until ``assign``, as `start_spare_worker`'s): the
platform starts every worker through these, so any request it serves can be moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from migration.engine_endpoint import EngineEndpoint
from migration.kv_transport import KVPayload, KVTransport, RayObjectKVTransport
from migration.lease_book import DEFAULT_LEASE_S
from migration.partial_prefill_payload import PartialPrefillPayload
from wire import InstanceState, InstanceStats
from worker import (
    EngineConfig, GenerationChunk, InstanceWorkerActor, InvalidRequestError, PeerWeights,
    RequestProgress, RequestSnapshot, RequestState, SamplingParams, worker_actor_options,
)

Prompt = str | list  # text, token ids, or chat messages: what ``generate`` takes

__all__ = ["MigratableInstanceActor", "start_migratable_instance", "start_migratable_spare", "start_slot_host"]


class MigratableInstanceActor(InstanceWorkerActor):
    """`InstanceWorkerActor` plus migration (module docstring). Like its base, constructed without
    a model it is a spare; its instance id is then the one ``assign`` gives it, and every
    migration method raises `SpareWorkerError` until then."""

    def __init__(self, instance_id: str | None = None, model_id: str | None = None, model_dir: str | None = None,
                 engine_config: EngineConfig | None = None, transport: KVTransport | None = None, *,
                 peer: PeerWeights | None = None, num_threads: int | None = None, step_turns: Any = None) -> None:
        super().__init__(instance_id, model_id, model_dir, engine_config, peer=peer, num_threads=num_threads,
                         step_turns=step_turns)
        self._transport = transport if transport is not None else RayObjectKVTransport()
        self._endpoint: EngineEndpoint | None = None
        self._resumed: set[str] = set()  # imported requests whose client is attached

    async def _migration(self) -> EngineEndpoint:
        if self._endpoint is None:
            worker = self._model_worker()  # a spare has nothing to migrate: SpareWorkerError
            # The instance's running engine (waits for the load; raises like ``generate``).
            async_engine = await worker.serving_engine()
            if self._endpoint is None:  # another call may have built it while this one waited
                # The checkpoint's identity is the engine's, read at its load: the model dir
                # itself may be gone by now (a restarted node store empties its DRAM tier).
                self._endpoint = EngineEndpoint(async_engine, self._transport, worker.instance_id)
        return self._endpoint

    # ---- the endpoint (see MigrationEndpoint) --------------------------------------------------

    async def export_request(self, request_id: str) -> RequestSnapshot:
        return await (await self._migration()).export_request(request_id)

    async def freeze_request(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> RequestSnapshot:
        return await (await self._migration()).freeze_request(request_id, lease_s)

    async def unfreeze_request(self, request_id: str) -> None:
        await (await self._migration()).unfreeze_request(request_id)

    async def release_request(self, request_id: str, destination_id: str) -> None:
        await (await self._migration()).release_request(request_id, destination_id)

    async def send_kv(self, request_id: str, first_block: int, freeze: bool,
                      lease_s: float = DEFAULT_LEASE_S) -> tuple[RequestSnapshot, KVPayload]:
        return await (await self._migration()).send_kv(request_id, first_block, freeze=freeze, lease_s=lease_s)

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int,
                           lease_s: float = DEFAULT_LEASE_S) -> None:
        await (await self._migration()).begin_import(snapshot, num_reserved_tokens, lease_s)

    async def extend_import(self, snapshot: RequestSnapshot) -> None:
        await (await self._migration()).extend_import(snapshot)

    async def prefill_import(self, request_id: str) -> int:
        return await (await self._migration()).prefill_import(request_id)

    async def receive_kv(self, snapshot: RequestSnapshot, first_block: int, payload: KVPayload) -> int:
        return await (await self._migration()).receive_kv(snapshot, first_block, payload)

    async def commit_import(self, snapshot: RequestSnapshot) -> None:
        await (await self._migration()).commit_import(snapshot)

    async def cancel_import(self, request_id: str) -> None:
        await (await self._migration()).cancel_import(request_id)

    async def renew_lease(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> bool:
        return await (await self._migration()).renew_lease(request_id, lease_s)

    async def export_partial_prefill(self, request_id: str, lease_s: float = DEFAULT_LEASE_S
                                     ) -> PartialPrefillPayload:
        return await (await self._migration()).export_partial_prefill(request_id, lease_s)

    async def take_over_prefill(self, payload: PartialPrefillPayload) -> None:
        await (await self._migration()).take_over_prefill(payload)

    # ---- following a request -------------------------------------------------------------------

    def handoff_target(self, request_id: str) -> str | None:
        return None if self._endpoint is None else self._endpoint.handoff_target(request_id)

    async def request_progress(self, request_id: str) -> RequestProgress:
        """Where the request stands here (`worker.RequestProgress`): ``loading`` while the model
        is, else as the engine sees it. What a client whose stream went quiet asks
        (`follow_generation`); never waits for the load."""
        if self.health() is InstanceState.LOADING:
            return RequestProgress(request_id, RequestState.LOADING)
        if self.health() is not InstanceState.READY:  # a spare, failed or stopped: nothing runs here
            return RequestProgress(request_id, RequestState.UNKNOWN)
        return await (await self._migration()).request_progress(request_id)

    async def resume(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        async for chunk in self._adopted_chunks(request_id):
            yield chunk

    async def recover(self, request_id: str, prompt: Prompt,
                      sampling_params: Mapping[str, Any] | SamplingParams | None,
                      sent_token_ids: Sequence[int]) -> AsyncIterator[GenerationChunk]:
        """Continues a request whose instance died, from what its client already received: the
        prompt (as ``generate`` took it) and ``sent_token_ids``, the output tokens delivered.

        The request is imported from that transcript the way a token-based migration imports
        one (a `RequestSnapshot` with no KV and no sampler state): the prompt and the sent tokens
        are recomputed in one prefill, the detokenizer replays the sent tokens without emitting
        them, so the text deltas continue mid-character and mid-stop-string, and the usage
        counts go on from the prompt's length and the tokens sent. (A request suspended with its KV
        parked, and replayed here by the controller before the client came back, is already
        running: its buffered stream is what this yields.) Greedy decoding continues
        exactly as the dead instance would have; seeded sampling continues from a generator
        seeded afresh (the dead one's state died with it). Streams like ``resume``; raises
        `InvalidRequestError` for a bad request and `MigrationRefusedError` if this instance
        cannot take it (KV blocks, no token left to generate).
        """
        endpoint = await self._migration()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if endpoint.holds_adopted(request_id):  # suspended with its KV, replayed here: nothing to recompute
            async for chunk in self._adopted_chunks(request_id):
                yield chunk
            return
        if not sent_token_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in sent_token_ids):
            raise InvalidRequestError("sent_token_ids must be a non-empty list of token ids (nothing sent: "
                                      "call generate instead)")
        try:
            params = sampling_params if isinstance(sampling_params, SamplingParams) \
                else SamplingParams(**dict(sampling_params or {}))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from exc
        engine = endpoint.async_engine.engine
        prompt_ids = await asyncio.to_thread(lambda: engine.prepare_request(prompt, params).prompt_token_ids)
        snapshot = RequestSnapshot(request_id=request_id, prompt_token_ids=tuple(prompt_ids),
                                   output_token_ids=tuple(sent_token_ids), params=params, num_computed_tokens=0)
        await endpoint.begin_import(snapshot, snapshot.num_tokens)
        try:
            await endpoint.commit_import(snapshot)  # opens the stream, then starts the request
        except BaseException:
            await endpoint.cancel_import(request_id)
            raise
        async for chunk in self._adopted_chunks(request_id):
            yield chunk

    async def _adopted_chunks(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        """An imported request's outputs as `GenerationChunk`s; closing early aborts it."""
        outputs = (await self._migration()).adopted_stream(request_id)
        # Held here: `release_model` lets the worker go while this stream still ends "suspended".
        worker = self._model_worker()
        self._resumed.add(request_id)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield GenerationChunk(
                        request_id=request_id,
                        text=out.new_text,
                        token_ids=out.new_token_ids,
                        finish_reason=worker.finish_reason(request_id, out.finish_reason),
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_completion_tokens=out.num_output_tokens,
                        logprobs=out.logprobs,  # of the tokens generated here; those streamed before are the client's
                    )
        finally:
            self._resumed.discard(request_id)

    # ---- what the controller sees ---------------------------------------------------------------

    def _imported_request_ids(self) -> set[str]:
        """Requests taken in by migration or recovery that are still here (streamed through
        ``resume``/``recover``, or committed and waiting for their client to attach)."""
        if self._endpoint is None:
            return set(self._resumed)
        return self._resumed | set(self._endpoint.adopted_request_ids())

    def request_ids(self) -> list[str]:
        """Every request open here, started here or taken in: what a drain must move."""
        started = set(self._worker.open_request_ids()) if self._worker is not None else set()
        return sorted(started | self._imported_request_ids())

    def stats(self) -> InstanceStats:
        """The base's stats, with imported requests counted as ongoing (the base knows only the
        ones it started): a drain that waits for zero must wait for them too."""
        stats = super().stats()
        return dataclasses.replace(stats, num_ongoing_requests=stats.num_ongoing_requests
                                   + len(self._imported_request_ids()))

    async def release_model(self, timeout_s: float = 10.0) -> None:
        """The base's, with the migration endpoint of the model let go too (the process becomes a
        spare; a later ``assign`` builds a new endpoint over the new engine). Imported requests
        end "suspended" as in ``shutdown``."""
        if self._endpoint is not None:
            self.suspend_requests()
            self._endpoint.close()
        self._endpoint = None
        self._resumed.clear()
        await super().release_model(timeout_s)

    def suspend_requests(self) -> list[str]:
        """The base's, for the imported requests too: every stream here ends "suspended"."""
        if self._worker is None:
            return []
        return self._worker.suspend(self._imported_request_ids())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ends the imported requests' streams "suspended" too (the base does it for the ones it
        started), so they continue on the model's next instance instead of waiting on a stopped
        engine, then shuts down."""
        if self._endpoint is not None:
            self.suspend_requests()
            self._endpoint.close()
        await super().shutdown(timeout_s)

    def abort(self, request_id: str) -> bool:
        if super().abort(request_id):
            return True
        if self._endpoint is None:
            return False
        if request_id in self._resumed or self._endpoint.holds_adopted(request_id):
            self._endpoint.async_engine.abort(request_id)
            return True
        return False


def start_migratable_instance(instance_id: str, model_id: str, model_dir: str | None,
                              engine_config: EngineConfig | Mapping[str, Any] | None = None, *,
                              transport: KVTransport | None = None, name: str | None = None,
                              namespace: str | None = None, node_id: str | None = None, num_cpus: float = 1.0,
                              num_gpus: float = 0.0, detached: bool = False, peer: PeerWeights | None = None,
                              num_threads: int | None = None, **options):
    """Starts a `MigratableInstanceActor` and returns its handle at once; the arguments and their
    meaning are `start_instance_worker`'s (``transport`` picks how its KV blocks travel)."""
    import ray

    # A bad config fails here, not in a dead actor.
    config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**dict(engine_config or {}))
    actor_options = worker_actor_options(name, namespace, node_id, num_cpus, num_gpus, detached, options)
    return ray.remote(MigratableInstanceActor).options(**actor_options).remote(
        instance_id, model_id, None if model_dir is None else str(model_dir), config, transport, peer=peer,
        num_threads=num_threads)


def start_migratable_spare(*, transport: KVTransport | None = None, name: str | None = None,
                           namespace: str | None = None, node_id: str | None = None, detached: bool = False,
                           **options):
    """Starts a spare `MigratableInstanceActor` (no model until ``assign``) and returns its handle
    at once; the arguments and their meaning are `start_spare_worker`'s: no Ray CPU or GPU."""
    import ray

    actor_options = worker_actor_options(name, namespace, node_id, 0, 0, detached, options)
    return ray.remote(MigratableInstanceActor).options(**actor_options).remote(transport=transport)



def start_slot_host(*, max_instances: int, max_concurrent_steps: int | None = None, name: str | None = None,
                    namespace: str | None = None, node_id: str | None = None, detached: bool = False,
                    num_gpus: int = 0, **options):
    """Starts a slot host (`worker.SlotHost`) whose instances are `MigratableInstanceActor`s, so
    every request it serves can be moved; returns its handle at once. Like a spare, it reserves no
    Ray CPU (its node's worker memory budget and slots bound what it holds); a GPU node's host
    reserves its GPU (``num_gpus=1``: Ray makes it the visible one, and every model the host holds
    runs on it)."""
    import ray

    from worker.serving.slot_host import SlotHost

    actor_options = worker_actor_options(name, namespace, node_id, 0, num_gpus, detached, options)
    return ray.remote(SlotHost).options(**actor_options).remote(
        MigratableInstanceActor, max_instances=max_instances, max_concurrent_steps=max_concurrent_steps)
