"""How one live migration went: the record a protocol returns, and what callers plan and log with.

The migration driver returns it to whoever asked for the move -- the controller (over Ray, from
the process that drives the migration) and through it the CLI -- so it is a wire record, defined
here once (``migration.MigrationOutcome`` re-exports it). Its dict form carries the method and
the status as their string values, so it reads the same from JSON as from `to_dict`.

Only ``status`` decides what happened to the request; the figures say what it cost, so a
controller can learn its migration costs and a benchmark can report them. ``stop_s`` is the time
the request made no progress at all (from the source stopping it until the destination had it
running): the pause a client can see, bar the time it takes to follow the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from wire.wire_record import WireRecord, check_count, check_member, check_name, check_seconds

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
class MigrationOutcome(WireRecord):
    """Fields (positional in this order):
        request_id: the request moved (or not).
        method / status: how it was moved, and what happened (see the enums).
        source_id / destination_id: the instances it was to move between.
        num_rounds: token rounds, or KV stages, before the stop.
        num_tokens_at_stop: prompt + output when the source stopped the request (0: it never did).
        num_tokens_after_stop: tokens whose KV the destination computed after the stop (0: all copied).
        num_blocks_copied / num_bytes_copied: the KV that travelled.
        stop_s: source stopped -> destination running (0.0 if it never stopped).
        total_s: the whole migration, first call to outcome.
        error: why it was refused or failed, or what went wrong after the hand-off; None if nothing.
    """

    SCHEMA: ClassVar[str] = "migration_outcome/1"

    request_id: str
    method: MigrationMethod
    status: MigrationStatus
    source_id: str
    destination_id: str
    num_rounds: int
    num_tokens_at_stop: int
    num_tokens_after_stop: int
    num_blocks_copied: int
    num_bytes_copied: int
    stop_s: float
    total_s: float
    error: str | None = None

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "request_id", self.request_id)
        object.__setattr__(self, "method", check_member(name, "method", MigrationMethod, self.method))
        object.__setattr__(self, "status", check_member(name, "status", MigrationStatus, self.status))
        check_name(name, "source_id", self.source_id)
        check_name(name, "destination_id", self.destination_id)
        for field in ("num_rounds", "num_tokens_at_stop", "num_tokens_after_stop", "num_blocks_copied",
                      "num_bytes_copied"):
            object.__setattr__(self, field, check_count(name, field, getattr(self, field)))
        object.__setattr__(self, "stop_s", check_seconds(name, "stop_s", self.stop_s))
        object.__setattr__(self, "total_s", check_seconds(name, "total_s", self.total_s))
        if self.error is not None and not isinstance(self.error, str):  # may be empty: str() of a bare exception
            raise ValueError(f"{name}.error must be None or a string, got {type(self.error).__name__}")

    @property
    def migrated(self) -> bool:
        return self.status is MigrationStatus.MIGRATED
