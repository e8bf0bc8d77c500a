"""How one live migration went: the record a protocol returns, and what callers plan and log with.

Only ``status`` decides what happened to the request; the figures say what it cost, so a
controller can learn its migration costs and a benchmark can report them. ``stop_s`` is the time
the request made no progress at all (from the source stopping it until the destination had it
running): the pause a client can see, bar the time it takes to follow the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["MigrationMethod", "MigrationOutcome", "MigrationStatus"]


class MigrationMethod(str, enum.Enum):
    TOKENS = "tokens"  # the destination recomputes the KV from the tokens (ServerlessLLM)
    KV = "kv"  # the KV blocks are copied in stages while the source decodes (Llumnix)
    LAYER = "layer"  # a prefill taken over at layer k by a fully loaded helper (BlitzScale)


class MigrationStatus(str, enum.Enum):
    MIGRATED = "migrated"  # generating on the destination; the source's stream ended with "migrated"
    REFUSED = "refused"  # the destination said no (KV blocks, request id, model); the source carries on
    FAILED = "failed"  # a step failed (an instance died, a call broke); the source carries on, whole
    FINISHED = "finished"  # the request ended on the source first (done, or aborted): nothing to move


@dataclass(frozen=True)
class MigrationOutcome:
    request_id: str
    method: MigrationMethod
    status: MigrationStatus
    source_id: str
    destination_id: str
    num_rounds: int  # token rounds, or KV stages, before the stop
    num_tokens_at_stop: int  # prompt + output when the source stopped the request (0: it never did)
    num_tokens_after_stop: int  # tokens whose KV the destination computed after the stop (0: all copied)
    num_blocks_copied: int
    num_bytes_copied: int
    stop_s: float  # source stopped -> destination running (0.0 if it never stopped)
    total_s: float
    error: str | None = None  # why it was refused or failed, or what went wrong after the hand-off

    @property
    def migrated(self) -> bool:
        return self.status is MigrationStatus.MIGRATED
