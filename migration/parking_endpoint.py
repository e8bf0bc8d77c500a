"""Suspending a request with its KV: a migration whose destination is node memory, not an engine.

When the controller preempts a model's only instance for another model, that instance's requests
cannot move anywhere live. Instead of dropping their KV (and recomputing it from the tokens
later), `ParkingEndpoint` plays the destination of an ordinary KV migration (`migrate_by_kv`):
the source ships its blocks in stages while it decodes, freezes the request, ships the rest, and
releases it to the handoff target `PARKED` -- so the client's stream ends and the follower
(`follow_generation`) reports it "suspended": the gateway queues the request for its model's
next instance. The endpoint keeps every stage (snapshot, first block, payload) as a
`ParkedRequest`, owning the payloads itself (`keep`), so they outlive the source's process.

`replay(parked, dest)` later plays the same stages into the model's new instance (begin_import,
receive_kv per stage, commit_import): the request runs there from the exact position it stopped
at, its outputs buffered until the client attaches (`recover` finds it adopted and streams it).
Any failure there cancels the import, and the client's `recover` falls back to recomputing the
KV from its tokens -- as it does for a request whose KV exceeded the parking budget: this
endpoint refuses (`MigrationRefusedError`) a stage that would take it over `max_bytes`, which
the migration undoes (the request carries on at the source until its tokens are suspended).

Shapes: each payload holds KV blocks [L, 2, n, block_size, Hkv, D] as the source's pool has them;
only an instance of the same model and engine config can take them (the controller replays a
model's parked requests into that model's instances only).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from migration.kv_transport import KVPayload
from migration.lease_book import DEFAULT_LEASE_S
from migration.migration_endpoint import MigrationEndpoint
from worker import MigrationRefusedError, RequestSnapshot

__all__ = ["PARKED", "ParkedRequest", "ParkingEndpoint", "replay"]

# The handoff target of a parked request: its stream ended because its slot was preempted.
PARKED = "parked"


@dataclass
class ParkedRequest:
    """One suspended request's KV, in stages as it was shipped, and its snapshots.

    `first` is the handshake's snapshot (what the destination reserves blocks for), `final` the
    frozen one (None until the migration committed), `stages` (snapshot, first block, payload)
    in order."""

    request_id: str
    first: RequestSnapshot
    final: RequestSnapshot | None = None
    stages: list[tuple[RequestSnapshot, int, KVPayload]] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(payload.num_bytes for _, _, payload in self.stages)

    @property
    def num_tokens(self) -> int:
        return self.final.num_tokens if self.final is not None else self.first.num_tokens


class ParkingEndpoint:
    """The destination side of `MigrationEndpoint`, into memory (see the module docstring).

    `keep(payload)` makes a payload this process's own (e.g. `RayObjectKVTransport.keep`: the
    source's object is read and put again, so the source's death does not lose it); `max_bytes`
    bounds what it holds in all (imports under way and parked). At most one import per request id."""

    def __init__(self, keep: Callable[[KVPayload], Awaitable[KVPayload]], max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self._keep = keep
        self._max_bytes = max_bytes
        self._imports: dict[str, ParkedRequest] = {}
        self.parked: dict[str, ParkedRequest] = {}  # committed: request id -> its stages

    @property
    def instance_id(self) -> str:
        return PARKED

    @property
    def num_bytes(self) -> int:
        """KV held: parked requests and imports under way."""
        return sum(p.num_bytes for p in self.parked.values()) + sum(p.num_bytes for p in self._imports.values())

    async def begin_import(self, snapshot: RequestSnapshot, num_reserved_tokens: int,
                           lease_s: float = DEFAULT_LEASE_S) -> None:
        # No lease: this endpoint lives in its driver's process, and an import dies with it.
        if snapshot.request_id in self._imports or snapshot.request_id in self.parked:
            raise MigrationRefusedError(f"request {snapshot.request_id!r} is parked already")
        self._imports[snapshot.request_id] = ParkedRequest(snapshot.request_id, snapshot)

    async def receive_kv(self, snapshot: RequestSnapshot, first_block: int, payload: KVPayload) -> int:
        parked = self._import(snapshot.request_id)
        if self.num_bytes + payload.num_bytes > self._max_bytes:
            raise MigrationRefusedError(
                f"request {snapshot.request_id!r}: {payload.num_bytes} more bytes of KV would take the parked KV "
                f"to {self.num_bytes + payload.num_bytes} bytes, over the budget of {self._max_bytes}; it is "
                f"suspended by its tokens instead")
        parked.stages.append((snapshot, first_block, await self._keep(payload)))
        block_size = payload.shape[3]
        num_blocks = first_block + payload.num_blocks
        return min(num_blocks * block_size, snapshot.num_computed_tokens)

    async def commit_import(self, snapshot: RequestSnapshot) -> None:
        parked = self._imports.pop(snapshot.request_id, None)
        if parked is None:
            raise MigrationRefusedError(f"request {snapshot.request_id!r} has no import to commit")
        parked.final = snapshot
        self.parked[snapshot.request_id] = parked

    async def cancel_import(self, request_id: str) -> None:
        self._imports.pop(request_id, None)
        self.parked.pop(request_id, None)

    async def renew_lease(self, request_id: str, lease_s: float = DEFAULT_LEASE_S) -> bool:
        return request_id in self._imports

    async def extend_import(self, snapshot: RequestSnapshot) -> None:
        raise MigrationRefusedError("parking takes KV blocks, not a token-based migration")

    async def prefill_import(self, request_id: str) -> int:
        raise MigrationRefusedError("parking takes KV blocks, not a token-based migration")

    def _import(self, request_id: str) -> ParkedRequest:
        parked = self._imports.get(request_id)
        if parked is None:
            raise MigrationRefusedError(f"request {request_id!r} has no import under way")
        return parked


async def replay(parked: ParkedRequest, dest: MigrationEndpoint) -> None:
    """Plays a parked request's stages into `dest` (begin, each stage, commit): it runs there from
    where it stopped. Raises what `dest` raised, after cancelling the import there."""
    if parked.final is None:
        raise ValueError(f"request {parked.request_id!r} was never committed to its parking")
    try:
        await dest.begin_import(parked.first, parked.final.num_tokens)
        for snapshot, first_block, payload in parked.stages:
            await dest.receive_kv(snapshot, first_block, payload)
        await dest.commit_import(parked.final)
    except BaseException:
        try:
            await dest.cancel_import(parked.request_id)
        except Exception:  # noqa: BLE001 - a dead destination has nothing to free
            pass
        raise
