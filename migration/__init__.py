"""Live migration of in-flight requests between model instances.

Two methods behind one interface (`MigrationEndpoint`), both abort-safe — a migration that fails
at any step leaves the request finishing on its source, whole, and frees what the destination
reserved — and both invisible to a client that follows the request (`follow_generation`):

- token-based (`migrate_by_tokens`, after ServerlessLLM): the destination recomputes the KV from
  the tokens in rounds while the source decodes; the stop costs one short prefill;
- KV blocks (`migrate_by_kv`, after Llumnix): the blocks are copied in stages while the source
  decodes; the stop copies the last one or two, whatever the context length.

and a third move for a request not generating yet: `hand_over_prefill` (after BlitzScale's
helper) takes a prompt half-way through its layer-by-layer prefill on an instance still receiving
its weights and finishes it on one that has them all (method ``"layer"``).

Public API:
- `migrate_request`, `migrate_requests` (many at once, concurrently), `migrate_by_tokens`,
  `migrate_by_kv`, with `TokenMigrationConfig`, `KVMigrationConfig`; they return a
  `MigrationOutcome` (`MigrationStatus`, `MigrationMethod`, costs) and never raise for a failed
  migration.
- `MigrationEndpoint`: what a protocol drives; `EngineEndpoint` (an in-process `AsyncEngine`),
  `RayEndpoint` (a `MigratableInstanceActor`).
- `start_slot_host`: a slot host (`worker.SlotHost`) whose instances are migratable.
- `MigratableInstanceActor`, `start_migratable_instance`, `start_migratable_spare`: an instance
  actor that can migrate (with a model, or a spare assigned one later);
  `follow_generation`: the client's stream across hand-offs, with an idle timeout
  (`StreamIdleTimeout`, `DEFAULT_STREAM_IDLE_TIMEOUT_S`).
- `DEFAULT_LEASE_S`: how long an instance keeps a frozen request or a paused import without word
  from the migration's driver (then it undoes it alone; ``lease_s`` in each method's config).
- `KVTransport`, `KVPayload`, `InProcessKVTransport`, `RayObjectKVTransport`: how blocks travel.
- `ParkingEndpoint`, `ParkedRequest`, `replay`, `PARKED`: a request suspended with its KV kept in
  memory (a KV migration into memory) and later replayed into its model's next instance.
- `RequestSnapshot`, `MigrationRefusedError`, `UnknownRequestError`: from `worker`, re-exported.
"""

from migration.engine_endpoint import EngineEndpoint
from migration.following_stream import follow_generation
from migration.lease_book import DEFAULT_LEASE_S
from migration.kv_migration import KVMigrationConfig, migrate_by_kv
from migration.kv_transport import InProcessKVTransport, KVPayload, KVTransport, RayObjectKVTransport
from migration.migratable_instance_actor import (
    MigratableInstanceActor, start_migratable_instance, start_migratable_spare, start_slot_host,
)
from migration.migrate import migrate_request, migrate_requests
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome, MigrationStatus
from migration.parking_endpoint import PARKED, ParkedRequest, ParkingEndpoint, replay
from migration.partial_prefill_payload import PartialPrefillPayload
from migration.prefill_handoff import hand_over_prefill
from migration.ray_endpoint import RayEndpoint
from migration.stream_idle_timeout import DEFAULT_STREAM_IDLE_TIMEOUT_S, StreamIdleTimeout
from migration.token_migration import TokenMigrationConfig, migrate_by_tokens
from worker import MigrationRefusedError, RequestSnapshot, UnknownRequestError

__all__ = [
    "DEFAULT_LEASE_S", "DEFAULT_STREAM_IDLE_TIMEOUT_S", "StreamIdleTimeout",
    "PARKED", "ParkedRequest", "ParkingEndpoint", "replay",
    "EngineEndpoint", "InProcessKVTransport", "KVMigrationConfig", "KVPayload", "KVTransport",
    "MigratableInstanceActor", "MigrationEndpoint", "MigrationMethod", "MigrationOutcome", "MigrationRefusedError",
    "MigrationStatus", "PartialPrefillPayload", "RayEndpoint", "RayObjectKVTransport", "RequestSnapshot", "TokenMigrationConfig",
    "UnknownRequestError", "follow_generation", "hand_over_prefill", "migrate_by_kv", "migrate_by_tokens", "migrate_request",
    "migrate_requests", "start_migratable_instance", "start_migratable_spare", "start_slot_host",
]
