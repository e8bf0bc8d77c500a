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

What a migration leaves here between two of its driver's steps is leased (`migration.lease_book`):
a request frozen on this source (``freeze_request``, ``send_kv(freeze=True)``,
``export_partial_prefill``) and an import begun on this destination (``begin_import``, until
``commit_import``) each hold a lease of the ``lease_s`` the driver asked for, which its
``renew_lease`` calls extend. One asyncio task per endpoint sleeps until the earliest deadline; a
lease that runs out undoes its state alone -- the frozen request is unfrozen and finishes here,
its client's stream going on as if no migration had been tried; the import is cancelled and its
blocks freed. A driver that comes back late finds its release refused and undoes the rest.

Every snapshot this source hands out names its checkpoint (`worker.loading.checkpoint_identity`,
the engine's, read when it loaded), and this destination refuses one taken on
another checkpoint: a model deployed again under the same name never mixes weights in one output.

``request_progress`` says where a request stands (queued, running, frozen) for a client whose
stream went quiet (`migration.following_stream`).

Runs in the instance's process (in a `MigratableInstanceActor`, or beside the engine in a test);
`RayEndpoint` is its remote face.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial

import torch

from migration.kv_transport import InProcessKVTransport, KVPayload, KVTransport
from migration.lease_book import DEFAULT_LEASE_S, LeaseBook
from migration.partial_prefill_payload import PartialPrefillPayload
from worker import AsyncEngine, Engine, RequestOutput, RequestProgress, RequestSnapshot, UnknownRequestError
from worker.transfer import engine_migration as hooks
from worker.transfer import layer_handoff

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_KV_BYTES_PER_STEP", "EngineEndpoint"]

# KV bytes the source copies out per engine call (at least one block): ~1 ms of copying on one
# core here, so a stage never adds more than that to the gap between two tokens.
DEFAULT_MAX_KV_BYTES_PER_STEP = 4 << 20


class EngineEndpoint:
    """`MigrationEndpoint` over an in-process `AsyncEngine` (see the module docstring).

    ``checkpoint_id``: the checkpoint identity requests are stamped and checked with; by default
    the engine's own (`Engine.checkpoint_id`, read when it loaded: the model dir may be gone by
    now). ``clock``: monotonic seconds, for the leases."""

    def __init__(self, async_engine: AsyncEngine, transport: KVTransport | None = None,
                 instance_id: str = "local", max_handoffs: int = 4096,
                 max_kv_bytes_per_step: int = DEFAULT_MAX_KV_BYTES_PER_STEP, *,
                 checkpoint_id: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if max_handoffs < 1:
            raise ValueError(f"max_handoffs must be >= 1, got {max_handoffs}")
        if max_kv_bytes_per_step < 1:
            raise ValueError(f"max_kv_bytes_per_step must be >= 1, got {max_kv_bytes_per_step}")
        if checkpoint_id is not None and (not isinstance(checkpoint_id, str) or not checkpoint_id):
            raise ValueError(f"checkpoint_id must be None or a non-empty string, got {checkpoint_id!r}")
        self.max_kv_bytes_per_step = max_kv_bytes_per_step
        self.async_engine = async_engine
        self.transport = transport if transport is not None else InProcessKVTransport()
        self._instance_id = instance_id
        self._max_handoffs = max_handoffs
        self._handoffs: OrderedDict[str, str] = OrderedDict()  # request id -> destination instance id
        self._adopted: dict[str, AsyncIterator[RequestOutput]] = {}  # imported, not yet attached
        self.checkpoint_id = checkpoint_id or async_engine.engine.checkpoint_id
        self._clock = clock
        self._frozen = LeaseBook()  # source: requests frozen for a migration, not released yet
        self._importing = LeaseBook()  # destination: imports begun, not committed yet
        self._lease_timer: asyncio.Task | None = None
        self._leases_changed: asyncio.Event | None = None  # the timer's own (an Event binds to one loop)

    @property
    def instance_id(self) -> str:
        return self._instance_id

    def _stamped(self, snapshot: RequestSnapshot) -> RequestSnapshot:
        return dataclasses.replace(snapshot, checkpoint_id=self.checkpoint_id)

    # ---- source side -------------------------------------------------------------------------

    async def export_request(self, request_id: str) -> RequestSnapshot:
        return self._stamped(
            await self.async_engine.call(partial(hooks.export_request, request_id=request_id)))

    async def freeze_request(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> RequestSnapshot:
        with self._freezing(request_id, lease_s):
            snapshot = await self.async_engine.call(partial(hooks.freeze_request, request_id=request_id))
        return self._stamped(snapshot)

    async def unfreeze_request(self, request_id: str) -> None:
        self._frozen.end(request_id)
        await self.async_engine.call(partial(hooks.unfreeze_request, request_id=request_id))

    async def release_request(self, request_id: str, destination_id: str) -> None:
        def release(engine: Engine) -> None:
            # Delivered from the engine thread, so it reaches the stream after every token before it.
            self.async_engine.deliver([hooks.release_request(engine, request_id)])

        # Recorded first: the client may ask where the request went as soon as its stream ends.
        self._handoffs[request_id] = destination_id
        while len(self._handoffs) > self._max_handoffs:
            self._handoffs.popitem(last=False)
        # The driver is here: no lease runs out from now. If one ran out already, the request runs
        # again (its unfreeze is ahead of this call on the engine thread) and the release is refused.
        self._frozen.end(request_id)
        try:
            await self.async_engine.call(release)
        except BaseException:
            self._handoffs.pop(request_id, None)
            raise

    async def send_kv(self, request_id: str, first_block: int, *, freeze: bool,
                      lease_s: float = DEFAULT_LEASE_S) -> tuple[RequestSnapshot, KVPayload]:
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

            with self._freezing(request_id, lease_s):
                snapshot, kv = await self.async_engine.call(read_frozen)
            parts.append(kv)
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [L, 2, n, block_size, Hkv, D]
        return self._stamped(snapshot), self.transport.send(kv)  # off the engine thread: decoding goes on

    def handoff_target(self, request_id: str) -> str | None:
        """Where a request released from here went (the last ``max_handoffs`` are remembered)."""
        return self._handoffs.get(request_id)

    # ---- destination side --------------------------------------------------------------------

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int,
                           lease_s: float = DEFAULT_LEASE_S) -> None:
        self._grant(self._importing, snapshot.request_id, lease_s)
        try:
            await self.async_engine.call(partial(hooks.begin_import, snapshot=snapshot,
                                                 num_reserved_tokens=num_reserved_tokens,
                                                 checkpoint_id=self.checkpoint_id))
        except BaseException:
            self._importing.end(snapshot.request_id)  # refused (nothing was taken in) or broken
            raise

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
        # The driver is here: the import's lease ends before the commit, so it cannot run out (and
        # cancel the import) half-way through; a refused commit takes the lease back.
        lease_s = self._importing.end(request_id)
        try:
            await self.async_engine.call(partial(hooks.commit_import, snapshot=snapshot))
        except BaseException:
            if lease_s is not None:
                self._grant(self._importing, request_id, lease_s)
            raise
        # The stream exists before the request runs: nothing it generates can miss it.
        self._adopted[request_id] = self.async_engine.open_stream(request_id)
        await self.async_engine.call(partial(hooks.unfreeze_request, request_id=request_id))

    async def cancel_import(self, request_id: str) -> None:
        self._importing.end(request_id)
        await self._cancel_import(request_id)

    async def _cancel_import(self, request_id: str) -> None:
        def cancel(engine: Engine) -> None:
            out = hooks.cancel_import(engine, request_id)
            if out is not None:  # ends the adopted stream, if the import got that far
                self.async_engine.deliver([out])

        self._adopted.pop(request_id, None)
        await self.async_engine.call(cancel)

    # ---- leases (migration.lease_book) -------------------------------------------------------

    async def renew_lease(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> bool:
        """Extends the leases this instance holds for the request (a freeze here as a source, an
        import here as a destination) to ``lease_s`` from now; False if it holds none (resolved
        already, run out, or never granted)."""
        now = self._clock()
        renewed = self._frozen.renew(request_id, lease_s, now)
        return self._importing.renew(request_id, lease_s, now) or renewed

    def holds_lease(self, request_id: str) -> bool:
        """Whether a freeze or an import of the request is leased here (its driver has a step to come)."""
        return request_id in self._frozen or request_id in self._importing

    def close(self) -> None:
        """Stops the lease timer (the instance is shutting down or letting its model go)."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None

    @contextlib.contextmanager
    def _freezing(self, request_id: str, lease_s: float) -> Iterator[None]:
        """Leases a freeze about to be made: granted before the engine call (an abandoned call
        still runs on the engine thread, and its freeze must still run out), taken back if it fails."""
        self._grant(self._frozen, request_id, lease_s)
        try:
            yield
        except BaseException:
            self._frozen.end(request_id)
            raise

    def _grant(self, book: LeaseBook, request_id: str, lease_s: float) -> None:
        book.grant(request_id, lease_s, self._clock())
        if self._lease_timer is None or self._lease_timer.done():
            self._leases_changed = asyncio.Event()
            self._lease_timer = asyncio.get_running_loop().create_task(self._run_out_leases(self._leases_changed))
        else:
            self._leases_changed.set()  # the new deadline may be the earliest: the timer looks again

    async def _run_out_leases(self, leases_changed: asyncio.Event) -> None:
        """The one timer: sleeps until the earliest deadline, undoes what ran out, until no lease is held."""
        while True:
            now = self._clock()
            for request_id, lease_s in self._frozen.pop_expired(now):
                logger.warning("request %s was frozen for a migration whose driver sent nothing for %.1f s; "
                               "it carries on here", request_id, lease_s)
                await self._quietly(partial(hooks.unfreeze_request, request_id=request_id))
            for request_id, lease_s in self._importing.pop_expired(now):
                logger.warning("import of request %s: its migration's driver sent nothing for %.1f s; "
                               "dropping it", request_id, lease_s)
                try:
                    await self._cancel_import(request_id)
                except Exception as exc:  # noqa: BLE001 - a dead engine has nothing left to free
                    logger.info("import of request %s: cancelling it: %r", request_id, exc)
            deadlines = [d for d in (self._frozen.next_deadline(), self._importing.next_deadline()) if d is not None]
            if not deadlines:
                return
            leases_changed.clear()
            try:
                await asyncio.wait_for(leases_changed.wait(), max(0.0, min(deadlines) - self._clock()))
            except TimeoutError:
                pass

    async def _quietly(self, fn: Callable[[Engine], None]) -> None:
        try:
            await self.async_engine.call(fn)
        except UnknownRequestError:
            pass  # finished or aborted meanwhile: nothing to undo
        except Exception as exc:  # noqa: BLE001 - a dead engine has nothing left to undo
            logger.info("undoing a lapsed migration step: %r", exc)

    # ---- a client's view -----------------------------------------------------------------------

    async def request_progress(self, request_id: str) -> RequestProgress:
        """Where the request stands on this instance (`worker.RequestProgress`)."""
        return await self.async_engine.call(partial(hooks.request_progress, request_id=request_id))

    # ---- a prefill moving at a layer (migration.prefill_handoff) -----------------------------

    async def export_partial_prefill(self, request_id: str, lease_s: float = DEFAULT_LEASE_S
                                     ) -> PartialPrefillPayload:
        with self._freezing(request_id, lease_s):  # the request is frozen here until the hand-over
            prefill = await self.async_engine.call(
                partial(layer_handoff.export_partial_prefill, request_id=request_id))
        return PartialPrefillPayload(self._stamped(prefill.snapshot), prefill.next_layer, prefill.hidden,
                                     self.transport.send(prefill.kv))  # off the engine thread

    async def take_over_prefill(self, payload: PartialPrefillPayload) -> None:
        hooks.check_checkpoint(payload.snapshot, self.checkpoint_id)
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
