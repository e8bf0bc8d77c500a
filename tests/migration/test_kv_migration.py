"""KV-block migration between two running engines: the client sees exactly the unmoved output
(greedy and seeded) wherever the migration starts, the destination computes nothing but the next
token after the stop, and a destination that refuses or fails at any stage leaves the request
finishing on the source, whole, with every block it reserved freed."""

from __future__ import annotations

import asyncio
import random

import pytest

from migration import KVMigrationConfig, MigrationRefusedError, MigrationStatus, migrate_by_kv
from tests.migration.conftest import ENGINE_CONFIG
from tests.migration.migration_client import GREEDY, PROMPTS, SEEDED, FaultyEndpoint, stream_following


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_output_with_a_migration_at_a_random_point_equals_the_output_without(
        endpoints, unmoved, params, seed):
    source, dest = endpoints
    prompt = PROMPTS[seed + 2]
    expected = unmoved(prompt, params)
    migrate_after = random.Random(seed + 10).randint(0, 40)
    received = run(stream_following(
        source, {"dst": dest}, "moving", prompt, params, migrate_after=migrate_after,
        migrate=lambda: migrate_by_kv(source, dest, "moving")))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert received.num_handoffs == 1 and received.whole == expected.whole
    # Every position but the last had its KV copied: nothing was recomputed after the stop.
    assert outcome.num_tokens_after_stop == 0
    block_size = ENGINE_CONFIG.block_size
    assert outcome.num_blocks_copied == -(-(outcome.num_tokens_at_stop - 1) // block_size)
    per_block = 2 * 2 * block_size * 2 * 16 * 4  # [L=2, 2, block, Hkv=2, D=16] float32
    assert outcome.num_bytes_copied == outcome.num_blocks_copied * per_block


def test_a_long_context_is_copied_in_bounded_slices_one_engine_call_each(endpoints, unmoved, monkeypatch):
    """The pause must not grow with the context: no engine call copies more than the endpoint's
    per-step budget (here: one block), on either side, and the output is still exact."""
    from worker.transfer import engine_migration

    source, dest = endpoints
    expected = unmoved(PROMPTS[4], SEEDED)
    for endpoint in endpoints:
        monkeypatch.setattr(endpoint, "max_kv_bytes_per_step", 1)
    sizes = {"read": [], "written": []}
    read, write = engine_migration.read_kv_blocks, engine_migration.write_kv_blocks

    def recording_read(engine, block_ids):
        sizes["read"].append(len(block_ids))
        return read(engine, block_ids)

    def recording_write(engine, block_ids, kv):
        sizes["written"].append(len(block_ids))
        return write(engine, block_ids, kv)

    monkeypatch.setattr(engine_migration, "read_kv_blocks", recording_read)
    monkeypatch.setattr(engine_migration, "write_kv_blocks", recording_write)
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[4], SEEDED, migrate_after=40,
        migrate=lambda: migrate_by_kv(source, dest, "moving")))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.MIGRATED, outcome.error
    assert received.whole == expected.whole and outcome.num_tokens_after_stop == 0
    # The first stage alone held 5 full blocks or more; each went in its own call (the frozen read at the
    # stop is the one exception: it takes the rest at once, as few blocks as a stage left).
    assert max(sizes["read"][:-1]) == 1 and sum(sizes["read"]) == outcome.num_blocks_copied >= 5
    assert max(sizes["written"]) == 1 and sum(sizes["written"]) == outcome.num_blocks_copied


def test_stages_shrink_to_a_short_stop(endpoints):
    source, dest = endpoints
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[1], GREEDY, migrate_after=60,
        migrate=lambda: migrate_by_kv(source, dest, "moving", KVMigrationConfig(max_final_blocks=1))))
    outcome = received.outcome
    assert outcome.status is MigrationStatus.MIGRATED
    # The first stage ships the 8+ full blocks; the stop ships at most the stage's one and a partial one.
    assert outcome.num_rounds >= 1 and outcome.num_tokens_at_stop > 60


def test_a_refusing_destination_leaves_the_request_on_the_source(endpoints, unmoved):
    source, dest = endpoints
    expected = unmoved(PROMPTS[0], SEEDED)
    # Refuses when asked to grow its reservation at the second stage, after the first was copied.
    refusing = FaultyEndpoint(dest, "receive_kv", MigrationRefusedError("needs 2 more KV blocks"), fail_at=2)
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[0], SEEDED, migrate_after=30,
        migrate=lambda: migrate_by_kv(source, refusing, "moving", KVMigrationConfig(max_final_blocks=0))))
    assert received.outcome.status is MigrationStatus.REFUSED, received.outcome
    assert received.num_handoffs == 0 and received.whole == expected.whole


@pytest.mark.parametrize("method,fail_at,after_forwarding", [
    ("receive_kv", 1, True),  # dies after the first stage landed: blocks reserved and written
    ("receive_kv", 2, False),  # dies at the stop's copy: the source had stopped
    ("commit_import", 1, True),  # dies right after taking the request over
])
def test_a_destination_failing_mid_migration_leaves_the_request_whole_on_the_source(
        endpoints, unmoved, method, fail_at, after_forwarding):
    source, dest = endpoints
    expected = unmoved(PROMPTS[5], GREEDY)
    failing = FaultyEndpoint(dest, method, ConnectionError("instance died"), fail_at=fail_at,
                             after_forwarding=after_forwarding)
    config = KVMigrationConfig(max_final_blocks=100)  # one stage, then the stop
    received = run(stream_following(
        source, {"dst": dest}, "moving", PROMPTS[5], GREEDY, migrate_after=20,
        migrate=lambda: migrate_by_kv(source, failing, "moving", config)))
    assert received.outcome.status is MigrationStatus.FAILED and "instance died" in received.outcome.error
    assert received.num_handoffs == 0 and received.whole == expected.whole
    # (the autouse check then finds every block free on both instances)


class ClientLeavesWhenStopped:
    """The source; its client disconnects right after the source stopped the request for the hand-off."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def send_kv(self, request_id, first_block, *, freeze, **kwargs):
        result = await self.inner.send_kv(request_id, first_block, freeze=freeze, **kwargs)
        if freeze:
            self.inner.async_engine.abort(request_id)
        return result


@pytest.mark.parametrize("leave_when", ["before", "stopped"])
def test_a_client_leaving_during_the_migration_frees_both_instances(endpoints, leave_when):
    source, dest = endpoints

    async def main():
        outputs = source.async_engine.generate(PROMPTS[0], GREEDY, "leaver")
        await anext(outputs)
        if leave_when == "before":
            await outputs.aclose()  # the abort is posted before the migration's first step
            return await migrate_by_kv(source, dest, "leaver"), []
        outcome = await migrate_by_kv(ClientLeavesWhenStopped(source), dest, "leaver")
        return outcome, [out async for out in outputs]

    outcome, rest = run(main())
    # The request ended on the source; the copy the destination had taken over is dropped.
    assert outcome.status is MigrationStatus.FINISHED
    if leave_when == "stopped":  # it got as far as the destination running it, then dropped it
        assert "during the hand-off" in outcome.error and rest[-1].finish_reason == "abort"
    # (the autouse check then finds nothing running and every block free on both instances)


def test_a_per_step_copy_budget_below_one_byte_is_refused(endpoints):
    from migration import EngineEndpoint

    with pytest.raises(ValueError, match="max_kv_bytes_per_step must be >= 1, got 0"):
        EngineEndpoint(endpoints[0].async_engine, max_kv_bytes_per_step=0)


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_stages must be an integer >= 1"):
        KVMigrationConfig(max_stages=0)
    with pytest.raises(ValueError, match="max_final_blocks"):
        KVMigrationConfig(max_final_blocks=-1)
