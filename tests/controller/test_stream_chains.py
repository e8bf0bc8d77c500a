"""`StreamChains`: members that join before the first asks share one stream, ranked in join order;
a later joiner starts a new chain; a member that leaves is not counted; a failed open reaches all."""

from __future__ import annotations

import asyncio

import pytest

from controller.stream_chains import StreamChains
from tests.controller.fake_cluster import FakeTicket


def test_members_joined_together_share_one_stream_in_join_order():
    async def scenario():
        opened = []

        async def open_stream(source, num_receivers):
            opened.append((source, num_receivers))
            return FakeTicket(source, num_receivers)

        chains = StreamChains(open_stream)
        for member in ("a", "b", "gone", "c"):
            chains.join("src", member)
        chains.leave("gone")
        got = await asyncio.gather(*(chains.ticket(m, "src") for m in ("c", "a", "b")))
        assert opened == [("src", 3)]
        assert [(t.rank, rank, length) for t, rank, length in got] == [(3, 3, 3), (1, 1, 3), (2, 2, 3)]
        chains.join("src", "d")  # after the chain closed: a chain of its own
        ticket, rank, length = await chains.ticket("d", "src")
        assert opened[-1] == ("src", 1) and (rank, length) == (1, 1)
        with pytest.raises(RuntimeError, match="joined no stream chain"):
            await chains.ticket("d", "src")

    asyncio.run(scenario())


def test_a_failed_open_reaches_every_member():
    async def scenario():
        async def open_stream(source, num_receivers):
            raise RuntimeError("source busy")

        chains = StreamChains(open_stream)
        chains.join("src", "a")
        chains.join("src", "b")
        results = await asyncio.gather(chains.ticket("a", "src"), chains.ticket("b", "src"), return_exceptions=True)
        assert [str(r) for r in results] == ["source busy", "source busy"]

    asyncio.run(scenario())
