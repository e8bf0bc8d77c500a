"""One instance's side of live migration, over its running `AsyncEngine`.

Each protocol step is one `AsyncEngine.call`: it runs on the engine thread between two steps, so
it never races the batch, and the other requests only wait for it as they would for one more
sequence in the batch. Long work is cut into several calls (a token-based catch-up prefills one
token budget per call), so decoding goes on in between.

The endpoint also keeps what the client's side needs to follow a request:

* on the source, where each handed-over request went (`handoff_target`), for a client whose
  stream just ended with ``finish_reason="migrated"``;
* on the destination, the stream of each imported request (`adopted_stream`), opened *before*
  the request is started, so nothing it generates before the client attaches is lost.

Runs in the instance's process (in a `MigratableInstanceActor`, or beside the engine in a test);
`RayEndpoint` is its remote face.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from functools import partial

import torch

from migration.kv_transport import InProcessKVTransport, KVPayload, KVTransport
from migration.prefill_handoff import PartialPrefillPayload
from worker import AsyncEngine, Engine, RequestOutput, RequestSnapshot, UnknownRequestError
from worker import engine_migration as hooks
from worker import layer_handoff

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_KV_BYTES_PER_STEP", "EngineEndpoint"]

# KV bytes the source copies out per engine call (at least one block): ~1 ms of copying on one
# core here, so a stage never adds more than that to the gap between two tokens.
DEFAULT_MAX_KV_BYTES_PER_STEP = 4 << 20


class EngineEndpoint:
    """`MigrationEndpoint` over an in-process `AsyncEngine` (see the module docstring)."""

    def __init__(self, async_engine: AsyncEngine, transport: KVTransport | None = None,
                 instance_id: str = "local", max_handoffs: int = 4096,
                 max_kv_bytes_per_step: int = DEFAULT_MAX_KV_BYTES_PER_STEP) -> None:
        if max_handoffs < 1:
            raise ValueError(f"max_handoffs must be >= 1, got {max_handoffs}")
        if max_kv_bytes_per_step < 1:
            raise ValueError(f"max_kv_bytes_per_step must be >= 1, got {max_kv_bytes_per_step}")
        self.max_kv_bytes_per_step = max_kv_bytes_per_step
        self.async_engine = async_engine
        self.transport = transport if transport is not None else InProcessKVTransport()
        self._instance_id = instance_id
        self._max_handoffs = max_handoffs
        self._handoffs: OrderedDict[str, str] = OrderedDict()  # request id -> destination instance id
        self._adopted: dict[str, AsyncIterator[RequestOutput]] = {}  # imported, not yet attached

    @property
    def instance_id(self) -> str:
        return self._instance_id

    # ---- source side -------------------------------------------------------------------------

    async def export_request(self, request_id: str) -> RequestSnapshot:
        return await self.async_engine.call(partial(hooks.export_request, request_id=request_id))

    async def freeze_request(self, request_id: str) -> RequestSnapshot:
        return await self.async_engine.call(partial(hooks.freeze_request, request_id=request_id))

    async def unfreeze_request(self, request_id: str) -> None:
        await self.async_engine.call(partial(hooks.unfreeze_request, request_id=request_id))

    async def release_request(self, request_id: str, destination_id: str) -> None:
        def release(engine: Engine) -> None:
            # Delivered from the engine thread, so it reaches the stream after every token before it.
            self.async_engine.deliver([hooks.release_request(engine, request_id)])

        # Recorded first: the client may ask where the request went as soon as its stream ends.
        self._handoffs[request_id] = destination_id
        while len(self._handoffs) > self._max_handoffs:
            self._handoffs.popitem(last=False)
        try:
            await self.async_engine.call(release)
        except BaseException:
            self._handoffs.pop(request_id, None)
            raise

    async def send_kv(self, request_id: str, first_block: int, *, freeze: bool
                      ) -> tuple[RequestSnapshot, KVPayload]:
        # The full blocks go in slices of at most max_kv_bytes_per_step, one engine call each, so
        # a long context's first stage costs every step a bounded copy instead of stalling one
        # step for all of it (the pause would grow with the context). Only then, if asked, the
        # request is frozen and the rest (the blocks filled meanwhile, the partial one) read at once.
        parts: list[torch.Tensor] = []  # each [L, 2, n_i, block_size, Hkv, D]
        next_block = first_block
        while True:
            snapshot, kv = await self.async_engine.call(partial(
                hooks.export_kv, request_id=request_id, first_block=next_block, include_partial=False,
                max_bytes=self.max_kv_bytes_per_step))
            parts.append(kv)
            next_block += kv.shape[2]
            if next_block >= snapshot.num_computed_tokens // kv.shape[3]:
                break
        if freeze:
            def read_frozen(engine: Engine):
                hooks.freeze_request(engine, request_id)
                return hooks.export_kv(engine, request_id, next_block, include_partial=True)

            snapshot, kv = await self.async_engine.call(read_frozen)
            parts.append(kv)
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [L, 2, n, block_size, Hkv, D]
        return snapshot, self.transport.send(kv)  # off the engine thread: decoding goes on

    def handoff_target(self, request_id: str) -> str | None:
        """Where a request released from here went (the last ``max_handoffs`` are remembered)."""
        return self._handoffs.get(request_id)

    # ---- destination side --------------------------------------------------------------------

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int) -> None:
        await self.async_engine.call(partial(hooks.begin_import, snapshot=snapshot,
                                             num_reserved_tokens=num_reserved_tokens))

    async def extend_import(self, snapshot: RequestSnapshot) -> None:
        await self.async_engine.call(partial(hooks.extend_import, snapshot=snapshot))

    async def prefill_import(self, request_id: str) -> int:
        budget = self.async_engine.engine.config.max_num_batched_tokens
        previous = -1
        while True:  # one token budget per call, so the other requests decode in between
            computed = await self.async_engine.call(
                partial(hooks.prefill_import, request_id=request_id, max_num_tokens=budget))
            if computed == previous:
                return computed
            previous = computed

    async def receive_kv(self, snapshot: RequestSnapshot, first_block: int, payload: KVPayload) -> int:
        kv = await self.transport.receive(payload)  # [L, 2, n, block_size, Hkv, D]
        # Written in slices as they were read, so this instance's own requests see bounded steps.
        per_call = hooks.kv_blocks_per_call(self.async_engine.engine, self.max_kv_bytes_per_step)
        start = 0
        while True:
            part = kv[:, :, start:start + per_call]  # [L, 2, <= per_call, block_size, Hkv, D]
            num_tokens_with_kv = await self.async_engine.call(partial(
                hooks.import_kv, snapshot=snapshot, first_block=first_block + start, kv=part))
            start += per_call
            if start >= kv.shape[2]:
                return num_tokens_with_kv

    async def commit_import(self, snapshot: RequestSnapshot) -> None:
        request_id = snapshot.request_id
        await self.async_engine.call(partial(hooks.commit_import, snapshot=snapshot))
        # The stream exists before the request runs: nothing it generates can miss it.
        self._adopted[request_id] = self.async_engine.open_stream(request_id)
        await self.async_engine.call(partial(hooks.unfreeze_request, request_id=request_id))

    async def cancel_import(self, request_id: str) -> None:
        def cancel(engine: Engine) -> None:
            out = hooks.cancel_import(engine, request_id)
            if out is not None:  # ends the adopted stream, if the import got that far
                self.async_engine.deliver([out])

        self._adopted.pop(request_id, None)
        await self.async_engine.call(cancel)

    # ---- a prefill moving at a layer (migration.prefill_handoff) -----------------------------

    async def export_partial_prefill(self, request_id: str) -> PartialPrefillPayload:
        prefill = await self.async_engine.call(partial(layer_handoff.export_partial_prefill, request_id=request_id))
        return PartialPrefillPayload(prefill.snapshot, prefill.next_layer, prefill.hidden,
                                     self.transport.send(prefill.kv))  # off the engine thread

    async def take_over_prefill(self, payload: PartialPrefillPayload) -> None:
        kv = await self.transport.receive(payload.kv)  # [k, 2, n, block_size, Hkv, D]
        prefill = layer_handoff.PartialPrefill(payload.snapshot, payload.next_layer, payload.hidden, kv)
        request_id = payload.snapshot.request_id
        await self.async_engine.call(partial(layer_handoff.take_over_prefill, partial=prefill, schedule=False))
        # As in commit_import: the stream exists before the request runs.
        self._adopted[request_id] = self.async_engine.open_stream(request_id)
        await self.async_engine.call(partial(hooks.unfreeze_request, request_id=request_id))

    def adopted_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of a request imported here, from its first token after the hand-off; taken
        once (by the client that follows it). Leaving it early aborts the request."""
        stream = self._adopted.pop(request_id, None)
        if stream is None:
            raise UnknownRequestError(f"request {request_id!r} was not migrated to instance {self._instance_id}")
        return stream

    def holds_adopted(self, request_id: str) -> bool:
        return request_id in self._adopted

    def adopted_request_ids(self) -> list[str]:
        """Requests imported here whose client has not attached yet."""
        return list(self._adopted)
