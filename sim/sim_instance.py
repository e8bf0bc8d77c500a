"""One simulated model instance: its phase (a `wire.InstanceState`: LOADING, READY or STOPPING),
and its continuous batch advanced in aggregate.

Requests are never simulated token by token. An instance keeps a *token clock*: the number of
decode steps its batch has taken (`tokens_done`), advancing at one step per `step_s`, where
`step_s = costs.decode_step_s(batch, mean context)` (`CostModel.instance_costs`) is recomputed only when the batch
changes (a request joins or leaves). A request admitted when the clock reads c with n tokens
still to generate after its first finishes when the clock reads c + n; so the next event of an
instance is its earliest finish, computed analytically, and an instance with a steady batch
costs one event per finishing request, whatever the token counts.

Prefill (vLLM's scheduler runs a new prompt before the next decode step): a request admitted at
t starts its prefill when the instance's earlier prefills are done, takes `costs.prefill_s(prompt
tokens)`, and its first token comes at the end of it. While prefills run the decode
clock stands still (the batch waits for them), a stated simplification of chunked prefill,
which would interleave them. A request resumed after a suspension or a token-based migration
prefills its prompt plus the tokens it had generated (its KV is recomputed).

On a slot host (`sim.sim_host`) the instance's step is its own plus its co-residents' own steps
(`others_s`: their turns come between its steps); when its own step changes it tells the cluster
(`on_step`), which gives each neighbour its new share (`share`: the clock advanced at the old rate
first). One model per GPU, `others_s` stays 0 and the figures are the same floats as without it.

A request's TTFT is recorded once, at its first token ever; a request suspended before its first
token came out has none yet and gets it where it resumes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from wire import InstanceState

__all__ = ["Flight", "SimInstance"]


class Flight:
    """One request in flight (mutable; only requests not yet finished have one)."""

    __slots__ = ("index", "model_index", "arrival_s", "input_tokens", "output_tokens", "remaining_tokens",
                 "first_token_s", "queued_s", "start_tokens", "remaining_after", "prefill_end_s", "needs_prefill",
                 "requeued")

    def __init__(self, index: int, model_index: int, arrival_s: float, input_tokens: int, output_tokens: int) -> None:
        self.index = index
        self.model_index = model_index
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = max(1, output_tokens)
        self.remaining_tokens = self.output_tokens  # tokens still to generate, first included
        self.first_token_s: float | None = None
        self.queued_s = arrival_s  # when it joined its model's queue (again)
        self.requeued = False  # put back at the head of its queue (suspended, or no seat after a move)
        self.start_tokens = 0.0  # the instance's token clock when it was admitted
        self.remaining_after = 0  # tokens left after its admission's first token
        self.prefill_end_s = 0.0
        self.needs_prefill = True  # False after a KV migration: its KV came with it

    @property
    def generated_tokens(self) -> int:
        return self.output_tokens - self.remaining_tokens


class SimInstance:
    """See the module docstring. `costs` is the model's `InstanceCosts` on its GPU kind
    (`CostModel.instance_costs`); `on_finish(instance, flight, now)` is called when a request's
    last token is out."""

    __slots__ = ("instance_id", "index", "model_index", "node_index", "num_slots", "tier", "phase", "started_s",
                 "ready_s", "stream_source", "max_batch", "_loop", "_costs", "_on_finish",
                 "_heap", "num_ongoing", "_sequence", "tokens_done", "_clock_s", "resume_s", "step_s", "_context_sum",
                 "_next_event", "load_event", "busy_since_s", "idle_since_s", "resident_s", "from_spare", "recycle",
                 "own_step_s", "others_s", "on_step", "on_prefill", "hosts", "asleep_s")

    def __init__(self, *, instance_id: str, index: int, model_index: int, node_index: int, num_slots: int,
                 tier: str, started_s: float, max_batch: int, loop, costs,
                 on_finish: Callable[["SimInstance", Flight, float], None]) -> None:
        self.instance_id = instance_id
        self.index = index
        self.model_index = model_index
        self.node_index = node_index
        self.num_slots = num_slots
        self.tier = tier
        self.phase = InstanceState.LOADING
        self.started_s = started_s
        self.ready_s: float | None = None
        self.stream_source: str | None = None
        self.max_batch = max_batch
        self._loop = loop
        self._costs = costs
        self._on_finish = on_finish
        self._heap: list[tuple[float, int, Flight]] = []
        self.num_ongoing = 0  # len(self._heap), kept as a plain attribute: routing reads it per request
        self._sequence = 0
        self.tokens_done = 0.0
        self._clock_s = started_s
        self.resume_s = started_s
        self.step_s = 0.0
        self._context_sum = 0.0
        self._next_event = None
        self.load_event = None
        self.busy_since_s: float | None = None
        self.idle_since_s: float | None = None
        self.resident_s = started_s  # when every layer is in (a streamed instance serves before)
        self.from_spare = False  # it started on a spare worker (`sim.node_upkeep`)
        self.recycle = False  # stopped to give its slot away: a spare's process goes back to the pool
        # On a slot host (`sim.sim_host`): its own step, its co-residents' (whose turns its step
        # waits for), the cluster's callback when its own step changes, and the hosts it is on.
        self.own_step_s = 0.0
        self.others_s = 0.0
        self.on_step: Callable[["SimInstance", float], None] | None = None
        self.on_prefill: Callable[["SimInstance", float, float], None] | None = None
        self.hosts: tuple = ()
        self.asleep_s: float | None = None  # since when it sleeps (ASLEEP, or stopping from it)

    # --- queries -----------------------------------------------------------------------------

    @property
    def has_room(self) -> bool:
        return self.phase == InstanceState.READY and self.num_ongoing < self.max_batch

    def flights(self) -> list[Flight]:
        return [f for _, _, f in self._heap]

    # --- the token clock ---------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        start = self._clock_s if self._clock_s > self.resume_s else self.resume_s
        if now > start and self._heap:
            self.tokens_done += (now - start) / self.step_s
        self._clock_s = now

    def _reschedule(self, now: float) -> None:
        if self._next_event is not None:
            self._next_event.cancel()
            self._next_event = None
        if not self._heap:
            self.step_s = 0.0
            if self.own_step_s:
                self._own_step(0.0, now)
            return
        n = len(self._heap)
        own = self._costs.decode_step_s(n, self._context_sum / n)
        self.step_s = own + self.others_s if self.others_s else own
        if own != self.own_step_s:
            self._own_step(own, now)
        left = self._heap[0][0] - self.tokens_done
        start = now if now > self.resume_s else self.resume_s
        at = start + (left * self.step_s if left > 0 else 0.0)
        self._next_event = self._loop.schedule(at, self._finish_due, priority=1)

    def _own_step(self, own_s: float, now: float) -> None:
        self.own_step_s = own_s
        if self.on_step is not None:
            self.on_step(self, now)  # its co-residents' steps now wait for a different turn

    def share(self, now: float, others_s: float) -> None:
        """Its co-residents' steps now take `others_s` per turn of its own (`sim.sim_host`): the
        clock so far at the old rate, from now at the new one."""
        if others_s == self.others_s:
            return
        self._advance(now)
        self.others_s = others_s
        self._reschedule(now)

    def hold(self, now: float, seconds: float) -> None:
        """A co-resident's prefill takes the GPU for `seconds`: this instance's decode stands still
        that long (its own prefills ended before that one began: they take the GPU in turn)."""
        if not self._heap:
            return
        self._advance(now)
        self.resume_s = (self.resume_s if self.resume_s > now else now) + seconds
        self._reschedule(now)

    def _finish_due(self) -> None:
        now = self._loop.now
        self._next_event = None
        self._advance(now)
        done = []
        heap = self._heap
        limit = self.tokens_done + 1e-6
        while heap and heap[0][0] <= limit and self.resume_s <= now + 1e-12:
            _, _, flight = heapq.heappop(heap)
            self.num_ongoing -= 1
            self._context_sum -= flight.input_tokens + flight.output_tokens / 2
            done.append(flight)
        self._reschedule(now)
        for flight in done:
            flight.remaining_tokens = 0
            self._on_finish(self, flight, now)

    # --- requests ----------------------------------------------------------------------------

    def admit(self, flight: Flight, now: float) -> None:
        """Start serving `flight` now: its prefill after the ones before it, then decode."""
        self._advance(now)
        if flight.needs_prefill:
            prompt = flight.input_tokens + flight.generated_tokens
            start = now if now > self.resume_s else self.resume_s
            for host in self.hosts:  # on a slot host a prefill takes the GPU after the ones before it
                if host.prefill_until_s > start:
                    start = host.prefill_until_s
            prefill_s = self._costs.prefill_s(prompt)
            self.resume_s = start + prefill_s
            if self.on_prefill is not None:
                self.on_prefill(self, now, prefill_s)
            flight.prefill_end_s = self.resume_s
            if flight.first_token_s is None:
                flight.first_token_s = self.resume_s
            flight.remaining_after = flight.remaining_tokens - 1
        else:  # its KV came with it: it joins the next decode step
            flight.prefill_end_s = now
            flight.remaining_after = flight.remaining_tokens
        flight.needs_prefill = True
        flight.start_tokens = self.tokens_done
        self._sequence += 1
        heapq.heappush(self._heap, (self.tokens_done + flight.remaining_after, self._sequence, flight))
        self.num_ongoing += 1
        self._context_sum += flight.input_tokens + flight.output_tokens / 2
        self.busy_since_s = now if self.busy_since_s is None else self.busy_since_s
        self.idle_since_s = None
        self._reschedule(now)

    def take_all(self, now: float) -> list[Flight]:
        """Remove every request (a suspension or a migration), each with the tokens it has left;
        one still in its prefill has produced nothing here."""
        self._advance(now)
        taken = []
        for _, _, flight in sorted(self._heap, key=lambda e: e[1]):
            if now < flight.prefill_end_s:
                if flight.first_token_s == flight.prefill_end_s:
                    flight.first_token_s = None  # its first token never came out
            else:
                done = int(self.tokens_done - flight.start_tokens + 1e-9)
                flight.remaining_tokens = max(1, flight.remaining_after - done)
            taken.append(flight)
        self._heap.clear()
        self.num_ongoing = 0
        self._context_sum = 0.0
        self.resume_s = now if now > self.resume_s else self.resume_s
        self._reschedule(now)
        return taken

    def stop(self) -> None:
        """The instance is gone: no more events of its own."""
        if self._next_event is not None:
            self._next_event.cancel()
            self._next_event = None
        if self.load_event is not None:
            self.load_event.cancel()
            self.load_event = None
