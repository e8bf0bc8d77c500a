"""`FinishReason`: how a request's stream ended, one spelling for every process it crosses.

The engine sets it on a finished sequence, the worker ends a stream with it, the migration's
following stream and the gateway read it off the last `GenerationChunk` (whose ``finish_reason``
carries the value, a plain string on the wire). ``migrated`` and ``suspended`` are not the end of
the request: the first continues on another instance (the migration follows it), the second on
the model's next instance (the gateway re-queues it with the tokens its client already has).
"""

from __future__ import annotations

import enum

__all__ = ["FinishReason"]


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller, or the client went away
    MIGRATED = "migrated"  # handed over to another instance; the stream continues there
    SUSPENDED = "suspended"  # its slot was preempted or its instance stopped: continued on the next one
    ERROR = "error"  # this request alone failed (sampling, stop handling, detokenizing); the engine goes on
