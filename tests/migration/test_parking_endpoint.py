"""Parking a request's KV in memory (a KV migration into `ParkingEndpoint`) and replaying it into
another engine: the client's output is exactly the unmoved one (greedy and seeded: the sampler's
state travels in the final snapshot), a request over the budget stays whole on its source, and a
replay the destination refuses leaves nothing behind there."""

from __future__ import annotations

import asyncio

import pytest

from migration import (PARKED, InProcessKVTransport, MigrationRefusedError, MigrationStatus, ParkingEndpoint,
                       migrate_by_kv, replay)
from tests.migration.migration_client import GREEDY, PROMPTS, SEEDED, FaultyEndpoint, Received


async def park_mid_stream(source, parking, request_id: str, prompt: str, params, park_after: int) -> tuple:
    """Streams from `source`; after `park_after` tokens parks the request. Returns (what the client
    got from the source, the outcome, the handoff target)."""
    received = Received()
    task = None
    async for out in source.async_engine.generate(prompt, params, request_id):
        received.token_ids.extend(out.new_token_ids)
        received.text += out.new_text
        received.finish_reason = out.finish_reason
        if task is None and len(received.token_ids) >= park_after:
            task = asyncio.create_task(migrate_by_kv(source, parking, request_id))
    outcome = await task
    return received, outcome, source.handoff_target(request_id)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_parked_request_replayed_elsewhere_gives_exactly_the_unmoved_output(endpoints, unmoved, params):
    source, dest = endpoints
    expected = unmoved(PROMPTS[1], params)

    async def main():
        parking = ParkingEndpoint(InProcessKVTransport().keep, max_bytes=1 << 30)
        before, outcome, target = await park_mid_stream(source, parking, "parked", PROMPTS[1], params, 30)
        assert outcome.status is MigrationStatus.MIGRATED, outcome.error
        assert (before.finish_reason, target) == ("migrated", PARKED)
        parked = parking.parked["parked"]
        assert parked.final.num_tokens == len(parked.final.prompt_token_ids) + len(before.token_ids)
        assert parked.num_bytes == outcome.num_bytes_copied == parking.num_bytes
        await replay(parked, dest)
        after = Received()
        async for out in dest.adopted_stream("parked"):
            after.token_ids.extend(out.new_token_ids)
            after.text += out.new_text
            after.finish_reason = out.finish_reason
        return before, after

    before, after = asyncio.run(main())
    assert before.token_ids + after.token_ids == expected.token_ids
    assert before.text + after.text == expected.text and after.finish_reason == expected.finish_reason


def test_a_request_over_the_budget_is_refused_and_finishes_whole_on_its_source(endpoints, unmoved):
    source, _ = endpoints
    expected = unmoved(PROMPTS[0], GREEDY)

    async def main():
        parking = ParkingEndpoint(InProcessKVTransport().keep, max_bytes=1)
        return await park_mid_stream(source, parking, "too-big", PROMPTS[0], GREEDY, 10), parking

    (received, outcome, target), parking = asyncio.run(main())
    assert outcome.status is MigrationStatus.REFUSED and "over the budget of 1" in outcome.error
    assert target is None and received.whole == expected.whole
    assert parking.parked == {} and parking.num_bytes == 0


def test_a_refused_replay_leaves_nothing_on_the_destination(endpoints):
    source, dest = endpoints

    async def main():
        parking = ParkingEndpoint(InProcessKVTransport().keep, max_bytes=1 << 30)
        _, outcome, _ = await park_mid_stream(source, parking, "refused", PROMPTS[2], GREEDY, 20)
        assert outcome.status is MigrationStatus.MIGRATED
        faulty = FaultyEndpoint(dest, "commit_import", MigrationRefusedError("no room"))
        with pytest.raises(MigrationRefusedError, match="no room"):
            await replay(parking.parked["refused"], faulty)

    asyncio.run(main())  # the autouse fixture checks both engines are idle, every block free


def test_parking_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 0"):
        ParkingEndpoint(InProcessKVTransport().keep, max_bytes=-1)
