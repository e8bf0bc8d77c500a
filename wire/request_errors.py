"""The errors a request's stream ends with that cross from a worker to its caller.

A worker raises them in its process; Ray carries them to the gateway or a migration driver,
where `call` / `stream` hand them over as themselves (`is_ours`: they are defined in a thaw
package) and the caller decides by their class: refuse the request (400), report it failed
(500, no retry), or try the request on another instance. So they are defined here, once, and the
caller imports them without importing the worker's engine (and torch) for three classes; the
worker raises these same classes (`worker.InvalidRequestError is wire.InvalidRequestError`).

- `InvalidRequestError`: the request is refused before it touches shared state (a `ValueError`).
- `RequestFailedError`: one admitted request failed inside the engine; the engine serves on.
- `EngineDeadError`: the engine stopped; every open request fails with it, ``suspect`` marking
  those that may have caused it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineDeadError", "InvalidRequestError", "RequestFailedError"]


class InvalidRequestError(ValueError):
    """A request the engine (or its instance) refuses; the message says what to change."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine after it was admitted (its sampling, its stop handling,
    its detokenizing; see `worker.engine.engine`); the engine is fine and serves the others. The message
    is for logs: it may carry internals."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error (or was shut down); every open request fails with it.

    `suspect` is True for the requests that were in the forward pass that killed the engine (the
    only ones that can have caused it): a caller that retries requests elsewhere retries a suspect
    once at most (a poison pill must not take down instance after instance); False for the others
    and for a clean shutdown. The message is for logs: it may carry internal exception text."""

    def __init__(self, message: str, suspect: bool = False) -> None:
        super().__init__(message)
        self.suspect = suspect

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # keep `suspect` across Ray's pickling
        return (type(self), (str(self), self.suspect))
