"""Where a model instance is in its life: the one spelling for the worker that reports it, the
controller that tracks it (and writes it to its state store), and the simulator that models it.

Each side uses the states it can observe. A worker reports SPARE (a pre-started process with no
model yet), LOADING, READY, ASLEEP, FAILED or STOPPED about itself (`InstanceStats.state`, the
answer to ``health()``). The controller tracks each instance it started as LOADING, READY, ASLEEP
or STOPPING (`controller.ManagedInstance.phase`, and `controller.WorkerRecord.state` in the
store); STOPPING is its own: it asked the instance to stop and waits for its requests to end, the
instance itself still serving them. The simulator's instances are LOADING, READY or STOPPING.
"""

from __future__ import annotations

import enum

__all__ = ["InstanceState"]


class InstanceState(str, enum.Enum):
    """A str, so it prints, compares and serialises as its value."""

    SPARE = "spare"  # a pre-started worker process with no model yet (see worker.InstanceWorkerActor)
    LOADING = "loading"  # the actor exists, the model is still being read
    READY = "ready"  # serving
    ASLEEP = "asleep"  # loaded, its KV pool released: takes no request until woken (see worker.InstanceWorker.sleep)
    STOPPING = "stopping"  # the controller stopped it on purpose; it finishes the requests it has, takes no new ones
    FAILED = "failed"  # the load failed or the engine thread died; the actor should be replaced
    STOPPED = "stopped"  # shut down on purpose; takes no new requests
