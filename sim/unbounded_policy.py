"""The lower bound: unlimited accelerators, weights always in GPU memory, no control delay.

What it assumes, exactly: the instant a request of a model finds no instance with room (none,
or all at `max_batch`), a new instance of the model exists, ready, on an accelerator of its own
(no slot limit, no load, no start overhead, no controller tick); the instant an instance has no
request left, it is gone (no keep-alive). So every request's TTFT is its prefill alone (behind
the prefills admitted before it on its instance) and accelerator-seconds count only the time an
instance is serving. Both are bounds no real policy reaches -- and not jointly: a real one
would trade one for the other through keep-alive. Requests are batched as elsewhere.
"""

from __future__ import annotations

from sim.policies import SimPolicy

__all__ = ["UnboundedPolicy"]


class UnboundedPolicy(SimPolicy):
    name = "unbounded"
    keeps_node_copies = False

    def on_queued(self, state) -> None:
        while state.queue:
            self.cluster.start_instance(state.index, None, "gpu")  # ready at once: takes the queue

    def on_ready(self, instance) -> None:
        pass

    def on_idle(self, instance) -> None:
        self.cluster.stop_instance(instance)

    def on_released(self, instance) -> None:
        pass

    def tick(self, now: float) -> None:
        self.take_dirty(now)
