"""What a migration protocol needs from each of the two instances: the interface it drives.

Token-based (`token_migration.py`) and KV (`kv_migration.py`) migration are written once against
this interface; `EngineEndpoint` implements it over an in-process `AsyncEngine`, `RayEndpoint`
over a `MigratableInstanceActor`'s handle, so the same protocol code runs in a unit test, in a
benchmark and between two actors on different nodes.

Every method is one step of the protocol and either happens or raises; the errors a protocol
acts on are `MigrationRefusedError` (the destination will not take the request: nothing to undo
but the import), `UnknownRequestError` (the request is not on that instance any more: on the
source it simply finished) and anything else (the instance failed). Source-side methods name the
request; destination-side ones take the source's snapshot, so a destination needs no state from
the driver beyond what each call carries.

The steps that leave state waiting for the driver's next step -- a freeze on the source, an import
begun on the destination -- take a ``lease_s``: if the driver sends nothing for that long (no
step, no ``renew_lease``), the instance undoes that state alone (`migration.lease_book`).
"""

from __future__ import annotations

from typing import Protocol

from migration.kv_transport import KVPayload
from migration.lease_book import DEFAULT_LEASE_S
from migration.partial_prefill_payload import PartialPrefillPayload
from worker import RequestSnapshot

__all__ = ["MigrationEndpoint"]


class MigrationEndpoint(Protocol):
    @property
    def instance_id(self) -> str: ...

    # ---- source side -------------------------------------------------------------------------

    async def export_request(self, request_id: str) -> RequestSnapshot:
        """The request's state now; it keeps decoding."""
        ...

    async def freeze_request(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> RequestSnapshot:
        """Stops decoding the request (its KV and stream stay) for ``lease_s`` unless renewed; the
        final snapshot."""
        ...

    async def unfreeze_request(self, request_id: str) -> None:
        """The migration failed: the request carries on here."""
        ...

    async def release_request(self, request_id: str, destination_id: str) -> None:
        """Handed over: frees the request here; its stream ends with ``finish_reason="migrated"``."""
        ...

    async def send_kv(self, request_id: str, first_block: int, *, freeze: bool,
                      lease_s: float = DEFAULT_LEASE_S) -> tuple[RequestSnapshot, KVPayload]:
        """Ships the request's KV blocks from table index ``first_block``: the full ones while it
        decodes, or (``freeze``) stops it first (leased, as by ``freeze_request``) and ships the
        partial last block too."""
        ...

    # ---- destination side --------------------------------------------------------------------

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int,
                           lease_s: float = DEFAULT_LEASE_S) -> None:
        """The handshake: takes the request in, paused, with blocks reserved, until the commit or
        for ``lease_s`` unless renewed (refusable: no room, another checkpoint, ...)."""
        ...

    async def extend_import(self, snapshot: RequestSnapshot) -> None:
        """Takes the tokens generated since the last snapshot."""
        ...

    async def prefill_import(self, request_id: str) -> int:
        """Recomputes KV for every token it has but the last; returns how many tokens have KV."""
        ...

    async def receive_kv(self, snapshot: RequestSnapshot, first_block: int, payload: KVPayload) -> int:
        """Writes shipped KV blocks at table index ``first_block``; returns how many tokens have KV."""
        ...

    async def commit_import(self, snapshot: RequestSnapshot) -> None:
        """Takes the final snapshot and starts generating; the client's stream continues here."""
        ...

    async def cancel_import(self, request_id: str) -> None:
        """Drops the import wherever it got to and frees its blocks. Idempotent."""
        ...

    # ---- either side -------------------------------------------------------------------------

    async def renew_lease(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> bool:
        """The driver is alive: extends what this instance holds leased for the request (a freeze,
        an import) to ``lease_s`` from now. False if it holds nothing leased for it."""
        ...

    # ---- a prefill moving at a layer (migration.prefill_handoff) -----------------------------

    async def export_partial_prefill(self, request_id: str, lease_s: float = DEFAULT_LEASE_S
                                     ) -> PartialPrefillPayload:
        """Source, still loading: takes the request out of its layer-wise pass and freezes it
        (leased, as by ``freeze_request``)."""
        ...

    async def take_over_prefill(self, payload: PartialPrefillPayload) -> None:
        """Helper, fully loaded: finishes the prefill from its layer and starts the request
        (refusable, like ``begin_import``); the client's stream continues here."""
        ...
