"""Handing a half-computed prefill from an instance still receiving its weights to one that has them.

BlitzScale's helper, between two instances: the new instance (``source``) is running a queued
prompt layer by layer while its weights stream in; an instance holding every layer (``helper``)
takes the prompt at the layer it reached, with the hidden state entering that layer and the KV
of the layers before it, computes the remaining layers, and from then on serves the request --
the first token comes from the helper instead of after the rest of the weights have landed.

The steps reuse the migration protocol's bookkeeping (`MigrationAttempt`), so abort safety is
the same as for a live migration:

1. The source takes the request out of its pass and freezes it (`export_partial_prefill`); the
   KV of the layers done travels through the instance's `KVTransport`, the hidden state with the
   call (one ``[T, H]`` tensor, small next to the KV).
2. The helper admits it through the migration import (refusable: KV blocks, request id, another
   model, its own weights not all in), writes the KV, runs layers k..N-1 for the prompt, opens
   the request's stream and starts it (`take_over_prefill`).
3. The source releases the request: its stream ends with ``finish_reason="migrated"`` and the
   client follows it to the helper (`handoff_target` / ``resume``), as after any migration.

A failure before 3 undoes it: the helper drops the import (its blocks freed) and the source
queues the request again, where a new pass prefills it from the start -- slower, never wrong.
"""

from __future__ import annotations

from migration.migration_attempt import MigrationAttempt
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome

__all__ = ["hand_over_prefill"]


async def hand_over_prefill(source: MigrationEndpoint, helper: MigrationEndpoint,
                            request_id: str) -> MigrationOutcome:
    """Moves `request_id`'s prefill from `source` (still loading) to `helper` (fully loaded); see
    the module docstring. Never raises for a failed hand-over: the outcome says what happened
    (``REFUSED`` when the source cannot export it, e.g. its prompt spans several passes, or the
    helper cannot take it)."""
    attempt = MigrationAttempt(source, helper, request_id, MigrationMethod.LAYER)

    async def steps() -> None:
        payload = await attempt.stop_source(source.export_partial_prefill(request_id))
        attempt.copied(payload.kv)
        await attempt.on_dest(helper.take_over_prefill(payload))
        # The helper has KV for every prompt token but the last, which its first step computes.
        attempt.running_on_dest(payload.snapshot, payload.snapshot.num_tokens - 1)

    return await attempt.drive(steps)
