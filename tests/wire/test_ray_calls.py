"""Tests for wire/ray_calls.py without a Ray session: which of Ray's errors become which of ours
(`translated`), what counts as ours (`is_ours`), and `call` over a plain awaitable. The same
helpers against a real actor are in test_ray_roundtrip.py."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from controller import UnknownModelError
from wire import ActorGoneError, ActorUnreachableError, call, is_ours, ray_errors_translated, translated


class ThirdPartyError(Exception):
    """Stands for a library's exception (its module is not one of thaw's packages)."""


def task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("Echo.fail", "Traceback (most recent call last): ...", cause)


def test_a_task_error_with_one_of_our_causes_becomes_the_cause():
    ours = UnknownModelError("acme/m")
    assert translated(task_error(ours)) is ours
    builtin = LookupError("no node 'n9'")  # the controller raises built-in errors on purpose too
    assert translated(task_error(builtin)) is builtin


def test_a_task_error_with_a_foreign_cause_stays_as_ray_raised_it():
    wrapped = task_error(ThirdPartyError("boom"))
    assert translated(wrapped) is wrapped
    assert isinstance(wrapped.as_instanceof_cause(), ThirdPartyError)  # still caught by its class
    nested = task_error(ray.exceptions.ActorDiedError())  # a call the callee made itself failed
    assert translated(nested) is nested


def test_a_dead_actor_is_actor_gone_and_an_unreachable_one_a_timeout():
    gone = translated(ray.exceptions.ActorDiedError())
    assert type(gone) is ActorGoneError and "actor died" in str(gone)
    unreachable = translated(ray.exceptions.ActorUnavailableError("node cut off", None))
    assert type(unreachable) is ActorUnreachableError and isinstance(unreachable, TimeoutError)
    assert "node cut off" in str(unreachable)
    other = ray.exceptions.TaskCancelledError()  # no meaning of ours: left as Ray raised it
    plain = KeyError("k")
    assert translated(other) is other and translated(plain) is plain


def test_what_counts_as_ours():
    assert [is_ours(e) for e in (UnknownModelError("a/b"), ValueError("x"), ActorGoneError("x"))] == [True] * 3
    assert [is_ours(e) for e in (ThirdPartyError(), ray.exceptions.ActorDiedError(), KeyboardInterrupt(),
                                 asyncio.CancelledError())] == [False] * 4


def test_call_raises_the_translation_chained_to_rays_error():
    async def failing():
        raise task_error(UnknownModelError("acme/m"))

    async def slow():
        await asyncio.sleep(10)

    async def main():
        assert await call(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(UnknownModelError) as caught:
            await call(failing(), 1.0)
        assert isinstance(caught.value.__cause__, ray.exceptions.RayTaskError)
        with pytest.raises(TimeoutError):
            await call(slow(), 0.01)

    asyncio.run(main())


def test_the_context_manager_passes_our_exceptions_and_cancellation_through_unchanged():
    mine = ValueError("bad")
    with pytest.raises(ValueError) as caught:
        with ray_errors_translated():
            raise mine
    assert caught.value is mine and caught.value.__cause__ is None
    with pytest.raises(ActorGoneError):
        with ray_errors_translated():
            raise ray.exceptions.RayActorError()
