"""The entry points a caller (the controller's drain, `thaw migrate`, a benchmark) uses: move one
request, or many at once, by the method it names.

Many at once run concurrently: each request's protocol is its own task, and their calls
interleave on both instances between engine steps, so a drain of N requests costs about one
migration's time, not N, and no request's stop waits for another's copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from migration.kv_migration import KVMigrationConfig, migrate_by_kv
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome
from migration.prefill_handoff import hand_over_prefill
from migration.token_migration import TokenMigrationConfig, migrate_by_tokens

__all__ = ["migrate_request", "migrate_requests"]


async def migrate_request(source: MigrationEndpoint, dest: MigrationEndpoint, request_id: str,
                          method: MigrationMethod | str = MigrationMethod.KV, *,
                          token_config: TokenMigrationConfig | None = None,
                          kv_config: KVMigrationConfig | None = None) -> MigrationOutcome:
    """Moves one request; the outcome says whether it moved (a failed migration never raises).
    Each method's config defaults to its defaults. ``"layer"`` moves a prefill still running layer
    by layer on an instance receiving its weights (`hand_over_prefill`)."""
    method = MigrationMethod(method)
    if method is MigrationMethod.LAYER:
        return await hand_over_prefill(source, dest, request_id)
    if method is MigrationMethod.TOKENS:
        return await migrate_by_tokens(source, dest, request_id, token_config or TokenMigrationConfig())
    return await migrate_by_kv(source, dest, request_id, kv_config or KVMigrationConfig())


async def migrate_requests(source: MigrationEndpoint, dest: MigrationEndpoint, request_ids: Iterable[str],
                           method: MigrationMethod | str = MigrationMethod.KV, *,
                           token_config: TokenMigrationConfig | None = None,
                           kv_config: KVMigrationConfig | None = None) -> list[MigrationOutcome]:
    """Moves several requests concurrently; one outcome per request, in order."""
    return list(await asyncio.gather(*(
        migrate_request(source, dest, request_id, method, token_config=token_config, kv_config=kv_config)
        for request_id in request_ids
    )))
