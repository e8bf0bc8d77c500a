"""Where one request stands on an instance, for a client whose stream has gone quiet.

A stream can be silent for good reasons (the instance is still loading its model, the request
waits in the scheduler for KV blocks, a long prompt is being prefilled in chunks) and for bad ones
(its instance hangs, it sits frozen by a migration whose driver is gone, the request is not there
any more). A client's follower (`migration.follow_generation`) tells them apart by asking the
instance for this record and comparing two answers: a request queued or loading is waiting its
turn; one whose tokens or computed KV moved between two answers is progressing; anything else,
for long enough, is idle.

The record carries counts only (no token ids, no text), so it prints and logs without the prompt.
The engine fills it between two steps (`worker.transfer.engine_migration.request_progress`); the instance
actor answers ``loading`` itself while there is no engine yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["RequestProgress", "RequestState"]


class RequestState(str, enum.Enum):
    """A request's state as a client's follower sees it; a str so it prints as its value."""

    LOADING = "loading"  # the instance is still loading its model; the request waits for it
    QUEUED = "queued"  # admitted, waiting in the scheduler for its turn (or for KV blocks)
    RUNNING = "running"  # being prefilled or decoded
    FROZEN = "frozen"  # held by a live migration (a source's stop, or an import not started yet)
    UNKNOWN = "unknown"  # not on this instance (finished, aborted, moved, or never here)


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    state: RequestState
    num_tokens: int = 0  # prompt + output tokens the request holds now
    num_computed_tokens: int = 0  # positions whose KV exists: grows during a chunked prefill

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", RequestState(self.state))
        for name in ("num_tokens", "num_computed_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RequestProgress.{name} must be an integer >= 0, got {value!r}")
