"""New instances that stream from the same peer at the same time share one chain: `StreamChains`.

When the autoscaler adds several instances of a model at once and each would stream its weights
from the same running instance, one stream to a chain of k receivers (`loader.LayerStreamSource`
with ``num_receivers=k``: the source sends once, each receiver forwards to the next as chunks
land) costs the source one transfer instead of k, and the link out of it carries the model once.

The controller starts instances synchronously within a reconcile tick and their start tasks run
after it, so "at the same time" is simply "joined before the first of them asks for its ticket":
`join` (in the synchronous start) adds an instance to its source's open chain; the first member
to call `ticket` closes the chain, opens the stream for every member, and each member gets the
ticket of its own rank (its place in the chain: the order they joined). An instance that joins
after that starts a new chain. If opening the stream fails, every member gets the error (each
then loads from its node's tier). A member that is stopped before its worker connects breaks the
chain after it: the members downstream see the stream fail and read the rest from their node's
copy, as for a dead source.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class _Chain:
    source_instance_id: str
    members: list[str] = field(default_factory=list)  # instance ids, in chain order
    opened: asyncio.Future | None = None  # the rank-1 ticket once the stream is open


class StreamChains:
    """See the module docstring. `open_stream(source_handle, num_receivers)` asks the source to
    stream and returns the rank-1 ticket (a `worker.PeerWeights`: ``for_rank`` gives the others)."""

    def __init__(self, open_stream: Callable[[Any, int], Awaitable[Any]]) -> None:
        self._open_stream = open_stream
        self._gathering: dict[str, _Chain] = {}  # source instance id -> the chain still taking members
        self._chain_of: dict[str, _Chain] = {}  # member instance id -> its chain, until it has its ticket

    def join(self, source_instance_id: str, instance_id: str) -> None:
        chain = self._gathering.get(source_instance_id)
        if chain is None:
            chain = self._gathering[source_instance_id] = _Chain(source_instance_id)
        chain.members.append(instance_id)
        self._chain_of[instance_id] = chain

    def leave(self, instance_id: str) -> None:
        """Forget an instance that will never ask for its ticket (stopped before its start ran)."""
        chain = self._chain_of.pop(instance_id, None)
        if chain is not None and chain.opened is None:
            chain.members.remove(instance_id)
            if not chain.members and self._gathering.get(chain.source_instance_id) is chain:
                del self._gathering[chain.source_instance_id]

    async def ticket(self, instance_id: str, source_handle: Any) -> tuple[Any, int, int]:
        """(this member's ticket, its rank, the chain's length); raises what opening the stream raised."""
        chain = self._chain_of.get(instance_id)
        if chain is None:
            raise RuntimeError(f"instance {instance_id} joined no stream chain")
        if chain.opened is None:
            if self._gathering.get(chain.source_instance_id) is chain:
                del self._gathering[chain.source_instance_id]  # closed: later joiners start a new chain
            chain.opened = asyncio.get_running_loop().create_future()
            try:
                chain.opened.set_result(await self._open_stream(source_handle, len(chain.members)))
            except Exception as exc:  # noqa: BLE001 - every member gets it
                chain.opened.set_exception(exc)
        try:
            first = await asyncio.shield(chain.opened)
        finally:
            self._chain_of.pop(instance_id, None)
        rank = chain.members.index(instance_id) + 1
        return (first if rank == 1 else first.for_rank(rank)), rank, len(chain.members)
