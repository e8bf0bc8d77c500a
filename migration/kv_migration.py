"""KV-cache live migration (the idea of Llumnix, written afresh): the KV blocks are copied in stages
while the source keeps decoding, so the stop only copies what the last stage could not.

Step by step, for one request:

1. Handshake. The source exports a snapshot; the destination takes the request in *paused* with
   blocks reserved for all its tokens so far, or refuses (not enough free blocks, request id in
   use, another model).
2. Stages. The source ships the request's *full* KV blocks not shipped yet — a full block is
   never written again — through the `KVTransport`, together with the snapshot taken at the same
   instant; the destination writes them into its reserved blocks (growing the reservation as the
   request grew, refusable) and takes the new tokens. The source decodes throughout, so each
   stage ships what the previous stage's decoding filled: few blocks. The stages stop once one
   ships at most ``max_final_blocks`` (or after ``max_stages``). The endpoint reads a stage in
   slices of bounded size, one engine call each, so even the first stage of a long context adds
   only a bounded copy to any one step (`EngineEndpoint.max_kv_bytes_per_step`).
3. Stop. In one step between two engine steps, the source freezes the request and ships the
   remaining blocks including the partly written last one, with the final snapshot (the last
   tokens and the sampler's generator state).
4. Commit. The destination writes them, takes the generator, opens the request's stream and
   starts it: its KV covers every token but the last, so its first step is an ordinary decode
   step, from the exact position the source stopped at.
5. Hand-off. The source releases the request (its stream ends with ``finish_reason="migrated"``).

The stop costs about one stage of ``max_final_blocks`` blocks, whatever the context length. The
destination counts which positions it holds KV for; if a stage came up short (the source was
preempted and recomputed meanwhile), the gap is recomputed after the commit instead of being
wrong. Any failure before 5 undoes the migration (`MigrationAttempt.undo`): the destination
frees every block it reserved and the source unfreezes the request, which finishes there whole.
If the driver itself dies, both instances do the same alone once ``lease_s`` passes without word
from it (`migration.lease_book`).
"""

from __future__ import annotations

from dataclasses import dataclass

from migration.lease_book import DEFAULT_LEASE_S, validate_lease_s
from migration.migration_attempt import MigrationAttempt
from migration.migration_endpoint import MigrationEndpoint
from wire.migration_outcome import MigrationMethod, MigrationOutcome

__all__ = ["KVMigrationConfig", "migrate_by_kv"]


@dataclass(frozen=True)
class KVMigrationConfig:
    # Stop once a stage ships this few blocks: the stop then ships about as many.
    max_final_blocks: int = 1
    # A source filling blocks faster than they ship never gets there; stop anyway.
    max_stages: int = 8
    # How long either instance keeps what this migration left there (a frozen source request, a
    # paused import) without hearing from the driver (migration.lease_book); renewed every third.
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if not isinstance(self.max_final_blocks, int) or isinstance(self.max_final_blocks, bool) \
                or self.max_final_blocks < 0:
            raise ValueError(f"max_final_blocks must be an integer >= 0, got {self.max_final_blocks!r}")
        if not isinstance(self.max_stages, int) or isinstance(self.max_stages, bool) or self.max_stages < 1:
            raise ValueError(f"max_stages must be an integer >= 1, got {self.max_stages!r}")
        validate_lease_s(self.lease_s, "KVMigrationConfig.lease_s")


async def migrate_by_kv(source: MigrationEndpoint, dest: MigrationEndpoint, request_id: str,
                        config: KVMigrationConfig = KVMigrationConfig()) -> MigrationOutcome:
    """Moves one generating request from ``source`` to ``dest`` (see the module docstring).
    Never raises for a failed migration: the outcome says what happened."""
    attempt = MigrationAttempt(source, dest, request_id, MigrationMethod.KV, config.lease_s)

    async def steps() -> None:
        snapshot = await attempt.on_source(source.export_request(request_id))
        await attempt.on_dest(dest.begin_import(snapshot, snapshot.num_tokens, config.lease_s))
        num_blocks_shipped = 0
        for _ in range(config.max_stages):
            attempt.num_rounds += 1
            stage, payload = await attempt.on_source(source.send_kv(request_id, num_blocks_shipped, freeze=False))
            await attempt.on_dest(dest.receive_kv(stage, num_blocks_shipped, payload))
            attempt.copied(payload)
            num_blocks_shipped += payload.num_blocks
            if payload.num_blocks <= config.max_final_blocks:
                break
        final, payload = await attempt.stop_source(source.send_kv(request_id, num_blocks_shipped, freeze=True,
                                                                      lease_s=config.lease_s))
        num_tokens_with_kv = await attempt.on_dest(dest.receive_kv(final, num_blocks_shipped, payload))
        attempt.copied(payload)
        await attempt.on_dest(dest.commit_import(final))
        attempt.running_on_dest(final, num_tokens_with_kv)

    return await attempt.drive(steps)
