"""A request's place in a model's queue at the gateway, and the request's whereabouts.

`QueueTicket` is what `RayGatewayBackend` hands a request that must wait for an instance: the
future a free instance is handed through, when it joined (the backend's clock, for the oldest
wait it reports) and its deadline (the loop's clock, which asyncio's timeouts use). Waiting is
done in steps (`wait_a_while`), so the backend can send progress news in between without
moving the deadline. `RequestPlace` is where a request is now (its ticket, or the instance
serving it), which is what `abort` needs.
"""

from __future__ import annotations

import asyncio
from collections import deque

from infra.serving_cluster import InstanceRoute

__all__ = ["QueueTicket", "RequestPlace", "prune_settled"]


class QueueTicket:
    """The future a free instance is handed through (None when the request was aborted meanwhile),
    when the request joined (`enqueued_s`) and when it must leave (`deadline`, loop time)."""

    __slots__ = ("future", "enqueued_s", "deadline")

    def __init__(self, future: asyncio.Future[InstanceRoute | None], enqueued_s: float, deadline: float) -> None:
        self.future = future
        self.enqueued_s = enqueued_s
        self.deadline = deadline

    async def wait_a_while(self, interval_s: float) -> bool:
        """Waits until the ticket is settled or its deadline passed (True), or for at most
        `interval_s` (False: time for news). The deadline is the ticket's own, so waiting in steps
        does not move it."""
        loop = asyncio.get_running_loop()
        left_s = self.deadline - loop.time()
        if left_s > 0 and not self.future.done():
            # asyncio.wait, unlike wait_for, leaves the future alone when it returns or is cancelled.
            await asyncio.wait((self.future,), timeout=min(interval_s, left_s))
        return self.future.done() or loop.time() >= self.deadline


class RequestPlace:
    """One request's whereabouts, for `abort`: its queue ticket or the instance serving it."""

    __slots__ = ("model_id", "ticket", "route", "aborted")

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.ticket: QueueTicket | None = None
        self.route: InstanceRoute | None = None
        self.aborted = False


def prune_settled(queue: deque[QueueTicket]) -> None:
    """Drops settled tickets (served, aborted, failed) from the head of a queue."""
    while queue and queue[0].future.done():
        queue.popleft()
