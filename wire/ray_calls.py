"""Calls to Ray actors, with Ray's errors turned into ours once: `call`, `stream`, `ray_errors_translated`.

Every caller of an actor -- the controller calling workers and node stores, the gateway calling
the controller and streaming from instances, the worker's own stream helper -- awaits it through
these, so each meets the same errors, decided here and nowhere else:

- the callee raised one of *our* exceptions (`is_ours`: a class defined in one of thaw's
  packages, or one of Python's built-in exceptions, which the controller and workers raise on
  purpose: `ValueError` for a bad argument, `LookupError` for an unknown name): it is raised as
  itself, with Ray's wrapper (which holds the remote traceback) as its ``__cause__``;
- the actor is dead, or was never there (`ray.exceptions.RayActorError`): `ActorGoneError`;
- the actor is unreachable for now (`ray.exceptions.ActorUnavailableError`: its node is cut off,
  or it is restarting): `ActorUnreachableError`, a `TimeoutError`, as is a call that outlives
  its deadline;
- anything else -- a third-party library's error inside the callee, a Ray error the callee got
  from a call of its own -- is left as Ray raised it. A `RayTaskError` is then still an instance
  of its cause's class (Ray's dual type), so an ``except`` naming that class still catches it.

Ray is imported inside the functions only, so `wire` stays importable where Ray is not needed
(the gateway's HTTP app, code that only builds records).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

__all__ = ["OUR_PACKAGES", "ActorGoneError", "ActorUnreachableError", "call", "is_ours", "ray_errors_translated",
           "stream", "translated"]

T = TypeVar("T")

# Top-level packages whose exception classes are "ours" (the repository's folders).
OUR_PACKAGES = frozenset({"controller", "infra", "kernels", "loader", "migration", "storage", "wire", "worker"})


class ActorGoneError(RuntimeError):
    """The actor is dead (or was never there): its work is lost, its slot is free."""


class ActorUnreachableError(TimeoutError):
    """The actor cannot be reached now but may come back (its node is cut off, or it restarts);
    a `TimeoutError`, so code that retries after a timeout retries after this too."""


def is_ours(exc: BaseException) -> bool:
    """True for an exception the callee raised itself: a class from one of `OUR_PACKAGES`, or one
    of Python's built-in exceptions (not a bare `BaseException` such as a cancellation)."""
    if not isinstance(exc, Exception):
        return False
    module = type(exc).__module__ or ""
    return module == "builtins" or module.partition(".")[0] in OUR_PACKAGES


def translated(exc: BaseException) -> BaseException:
    """The exception to raise in place of `exc` (see the module docstring): ours for Ray's
    errors that have a meaning here, `exc` itself for everything else."""
    if "ray" not in sys.modules:  # no Ray in this process: `exc` cannot be one of its errors
        return exc
    from ray import exceptions as ray_errors

    if isinstance(exc, ray_errors.RayTaskError):
        cause = exc.cause
        return cause if isinstance(cause, BaseException) and is_ours(cause) else exc
    if isinstance(exc, ray_errors.ActorUnavailableError):  # before RayActorError: it is one
        return ActorUnreachableError(f"the actor is unreachable for now: {exc}")
    if isinstance(exc, ray_errors.RayActorError):
        return ActorGoneError(str(exc))
    return exc


@contextlib.contextmanager
def ray_errors_translated() -> Iterator[None]:
    """Raises what `translated` makes of an exception from the block, chained to Ray's original.
    For code that awaits refs it does not create itself (a stream another module opens)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised, translated or as itself
        ours = translated(exc)
        if ours is exc:
            raise
        raise ours from exc


async def call(ref: Awaitable[T], timeout_s: float | None) -> T:
    """Awaits one actor call (``handle.method.remote(...)``) for at most `timeout_s` seconds (None:
    no deadline); Ray's errors translated. Past the deadline: `TimeoutError` (the call itself is
    not cancelled on the actor)."""
    async def wait() -> T:
        return await ref

    with ray_errors_translated():
        return await asyncio.wait_for(wait(), timeout_s)


async def stream(generator: Any, *, is_last: Callable[[Any], bool] | None = None) -> AsyncIterator[Any]:
    """The items of a streaming actor call (``handle.method.options(num_returns="streaming")
    .remote(...)``), each awaited with Ray's errors translated.

    Leaving early -- closing this iterator, or an error -- cancels the call on the actor
    (``ray.cancel``): Ray runs a streaming generator to its end whether or not anyone reads it,
    and cancelling its task is what stops the work there. The stream counts as complete once an
    item for which `is_last` is true was yielded (e.g. a chunk with its finish reason), or when the
    actor's generator ends."""
    import ray

    complete = False
    refs = generator.__aiter__()
    try:
        while True:
            with ray_errors_translated():
                try:
                    ref = await refs.__anext__()
                except StopAsyncIteration:
                    complete = True
                    return
                item = await ref
            if is_last is not None and is_last(item):
                complete = True
            yield item
    finally:
        if not complete:
            ray.cancel(generator)
