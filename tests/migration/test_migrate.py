"""Many requests migrated at once, each by its own concurrent protocol: every one of them arrives
and finishes exactly as it would have unmoved, and both instances end with every block free."""

from __future__ import annotations

import asyncio

import pytest

from migration import MigrationMethod, MigrationStatus, migrate_requests
from tests.migration.migration_client import GREEDY, PROMPTS, SEEDED, stream_following

NUM_REQUESTS = 6
# GREEDY and SEEDED run 200 tokens, so every request still decodes when its migration reaches it
# (with 100 a loaded CI machine once finished the last one first); six fill 156 of the 160 blocks.


@pytest.mark.parametrize("method", [MigrationMethod.KV, MigrationMethod.TOKENS])
def test_many_concurrent_requests_migrated_at_once(endpoints, unmoved, method):
    source, dest = endpoints
    params = [GREEDY if i % 2 else SEEDED for i in range(NUM_REQUESTS)]
    request_ids = [f"r{i}" for i in range(NUM_REQUESTS)]

    async def main():
        first_tokens = [asyncio.Event() for _ in request_ids]
        clients = [
            asyncio.create_task(stream_following(source, {"dst": dest}, request_ids[i], PROMPTS[i], params[i],
                                                 first_token=first_tokens[i]))
            for i in range(NUM_REQUESTS)
        ]
        for event in first_tokens:  # every request is decoding
            await event.wait()
        outcomes = await migrate_requests(source, dest, request_ids, method)
        return await asyncio.gather(*clients), outcomes

    together, outcomes = asyncio.run(main())
    alone = [unmoved(PROMPTS[i], params[i]) for i in range(NUM_REQUESTS)]
    assert [o.status for o in outcomes] == [MigrationStatus.MIGRATED] * NUM_REQUESTS, [o.error for o in outcomes]
    assert [o.request_id for o in outcomes] == request_ids
    for solo, moved in zip(alone, together, strict=True):
        assert moved.num_handoffs == 1 and moved.whole == solo.whole
