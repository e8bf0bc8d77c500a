"""Token-based live migration (the idea of ServerlessLLM's live migration, written afresh): the
destination rebuilds the KV cache itself from the tokens, while the source keeps decoding.

Step by step, for one request:

1. Handshake. The source exports a snapshot (tokens so far, sampling params); the destination
   takes the request in *paused* with blocks reserved for those tokens, or refuses.
2. Rounds. The destination prefills every token it has but the last (in token-budget chunks,
   between its own decode steps); meanwhile the source generates more. Then the driver takes a
   fresh snapshot and gives the destination the new tokens. Each round's prefill is only the
   previous round's delta, so rounds shrink geometrically; they stop once the destination is
   within ``max_delta_tokens`` of the source (or after ``max_rounds``).
3. Stop. The source freezes the request (no more steps; KV and stream kept) and returns the
   final snapshot: the last tokens and its sampler's generator state.
4. Commit. The destination takes the last tokens and the generator, opens the request's stream
   and starts it; its first step computes the remaining delta and samples the next token from
   the same random stream the source would have used.
5. Hand-off. The source releases the request: its blocks are freed and its stream ends with
   ``finish_reason="migrated"``; the client continues with the destination's stream.

The stop (3-4) costs one prefill of at most ``max_delta_tokens`` tokens, whatever the length
already generated. Any failure before 5 undoes the migration (`MigrationAttempt.undo`): the
destination drops the import and frees its blocks, and the source unfreezes the request, which
then finishes there exactly as it would have. If the driver itself dies, both instances do the
same alone once ``lease_s`` passes without word from it (`migration.lease_book`).
"""

from __future__ import annotations

from dataclasses import dataclass

from migration.lease_book import DEFAULT_LEASE_S, validate_lease_s
from migration.migration_attempt import MigrationAttempt
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome

__all__ = ["TokenMigrationConfig", "migrate_by_tokens"]


@dataclass(frozen=True)
class TokenMigrationConfig:
    # Hand over once the destination is this close behind: the recompute the stop must wait for.
    max_delta_tokens: int = 4
    # A source decoding faster than the destination prefills never gets within the delta; stop anyway.
    max_rounds: int = 8
    # How long either instance keeps what this migration left there (a frozen source request, a
    # paused import) without hearing from the driver (migration.lease_book); renewed every third.
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        for name, minimum in (("max_delta_tokens", 0), ("max_rounds", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        validate_lease_s(self.lease_s, "TokenMigrationConfig.lease_s")


async def migrate_by_tokens(source: MigrationEndpoint, dest: MigrationEndpoint, request_id: str,
                            config: TokenMigrationConfig = TokenMigrationConfig()) -> MigrationOutcome:
    """Moves one generating request from ``source`` to ``dest`` (see the module docstring).
    Never raises for a failed migration: the outcome says what happened."""
    attempt = MigrationAttempt(source, dest, request_id, MigrationMethod.TOKENS, config.lease_s)

    async def steps() -> None:
        snapshot = await attempt.on_source(source.export_request(request_id))
        await attempt.on_dest(dest.begin_import(snapshot, snapshot.num_tokens, config.lease_s))
        num_tokens_with_kv = 0
        for _ in range(config.max_rounds):
            attempt.num_rounds += 1
            num_tokens_with_kv = await attempt.on_dest(dest.prefill_import(request_id))
            snapshot = await attempt.on_source(source.export_request(request_id))
            await attempt.on_dest(dest.extend_import(snapshot))
            if snapshot.num_tokens - 1 - num_tokens_with_kv <= config.max_delta_tokens:
                break
        final = await attempt.stop_source(source.freeze_request(request_id, config.lease_s))
        await attempt.on_dest(dest.commit_import(final))
        attempt.running_on_dest(final, num_tokens_with_kv)

    return await attempt.drive(steps)
