"""The caller's side of a `MigratableInstanceActor`: the `MigrationEndpoint` a protocol drives when
the instances are Ray actors. Every Ray call of a migration goes through this one class, so the
protocols never see Ray and tests swap in an in-process endpoint.

The instance's own errors (`MigrationRefusedError`, `UnknownRequestError`, `EngineDeadError`,
`ValueError` for a protocol misuse) come back as themselves, Ray's wrapper as their ``__cause__``;
a dead actor is `wire.ActorGoneError` (`wire.call` translates Ray's errors, as for every Ray
caller), and the protocol treats it as a failure.
KV payloads pass through the driver as Ray object references: the blocks themselves go from the
source's object store to the destination without touching this process.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from migration.kv_transport import KVPayload
from migration.lease_book import DEFAULT_LEASE_S
from migration.partial_prefill_payload import PartialPrefillPayload
from wire import call
from worker import RequestSnapshot

__all__ = ["RayEndpoint"]

T = TypeVar("T")

class RayEndpoint:
    """`MigrationEndpoint` over a `MigratableInstanceActor` handle."""

    def __init__(self, handle: Any, instance_id: str) -> None:
        self.handle = handle
        self._instance_id = instance_id

    @property
    def instance_id(self) -> str:
        return self._instance_id

    async def export_request(self, request_id: str) -> RequestSnapshot:
        return await _unwrap(self.handle.export_request.remote(request_id))

    async def freeze_request(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> RequestSnapshot:
        return await _unwrap(self.handle.freeze_request.remote(request_id, lease_s))

    async def unfreeze_request(self, request_id: str) -> None:
        await _unwrap(self.handle.unfreeze_request.remote(request_id))

    async def release_request(self, request_id: str, destination_id: str) -> None:
        await _unwrap(self.handle.release_request.remote(request_id, destination_id))

    async def send_kv(self, request_id: str, first_block: int, *, freeze: bool,
                      lease_s: float = DEFAULT_LEASE_S) -> tuple[RequestSnapshot, KVPayload]:
        return await _unwrap(self.handle.send_kv.remote(request_id, first_block, freeze, lease_s))

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int,
                           lease_s: float = DEFAULT_LEASE_S) -> None:
        await _unwrap(self.handle.begin_import.remote(snapshot, num_reserved_tokens, lease_s))

    async def extend_import(self, snapshot: RequestSnapshot) -> None:
        await _unwrap(self.handle.extend_import.remote(snapshot))

    async def prefill_import(self, request_id: str) -> int:
        return await _unwrap(self.handle.prefill_import.remote(request_id))

    async def receive_kv(self, snapshot: RequestSnapshot, first_block: int, payload: KVPayload) -> int:
        return await _unwrap(self.handle.receive_kv.remote(snapshot, first_block, payload))

    async def commit_import(self, snapshot: RequestSnapshot) -> None:
        await _unwrap(self.handle.commit_import.remote(snapshot))

    async def cancel_import(self, request_id: str) -> None:
        await _unwrap(self.handle.cancel_import.remote(request_id))

    async def renew_lease(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> bool:
        return await _unwrap(self.handle.renew_lease.remote(request_id, lease_s))

    async def export_partial_prefill(self, request_id: str, lease_s: float = DEFAULT_LEASE_S
                                     ) -> PartialPrefillPayload:
        return await _unwrap(self.handle.export_partial_prefill.remote(request_id, lease_s))

    async def take_over_prefill(self, payload: PartialPrefillPayload) -> None:
        await _unwrap(self.handle.take_over_prefill.remote(payload))


async def _unwrap(ref: Awaitable[T]) -> T:
    """The call's result; the instance's own errors (`MigrationRefusedError`, ...) as themselves and
    a dead actor as `wire.ActorGoneError` (`wire.call`, the one place Ray's errors are translated)."""
    return await call(ref, None)
