"""Tests for wire/request_errors.py: the errors a worker's request stream ends with survive
pickling (how Ray carries them) with their message and, for `EngineDeadError`, ``suspect``; the
worker raises the very same classes; and `wire`'s Ray helpers hand them over as themselves."""

from __future__ import annotations

import pickle

import pytest
import ray.exceptions

import wire
import worker
from wire import EngineDeadError, InvalidRequestError, RequestFailedError, is_ours, translated
from worker.serving.async_engine import EngineDeadError as AsyncEngineDeadError
from worker.engine.engine import InvalidRequestError as EngineInvalidRequestError


def roundtrip(exc: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(exc))


def test_the_worker_exports_the_same_classes():
    assert worker.InvalidRequestError is wire.InvalidRequestError is EngineInvalidRequestError
    assert worker.RequestFailedError is wire.RequestFailedError
    assert worker.EngineDeadError is wire.EngineDeadError is AsyncEngineDeadError
    assert {"EngineDeadError", "InvalidRequestError", "RequestFailedError"} <= set(wire.__all__) & set(worker.__all__)


def test_their_bases_are_what_callers_catch_them_as():
    assert issubclass(InvalidRequestError, ValueError)
    assert issubclass(RequestFailedError, RuntimeError)
    assert issubclass(EngineDeadError, RuntimeError)
    assert issubclass(worker.InvalidFieldError, InvalidRequestError)  # the worker's refusal naming a field


@pytest.mark.parametrize("exc", [InvalidRequestError("max_tokens must be >= 1, got 0"),
                                 RequestFailedError("sampling failed: boom")])
def test_request_errors_pickle_round_trip(exc):
    back = roundtrip(exc)
    assert type(back) is type(exc)
    assert back.args == exc.args


@pytest.mark.parametrize("suspect", [True, False])
def test_engine_dead_error_keeps_suspect_across_pickling(suspect):
    back = roundtrip(EngineDeadError("engine stopped: RuntimeError('CUDA error')", suspect=suspect))
    assert type(back) is EngineDeadError
    assert str(back) == "engine stopped: RuntimeError('CUDA error')"
    assert back.suspect is suspect
    assert EngineDeadError("engine is shut down").suspect is False  # the default: a clean shutdown


def test_they_count_as_ours_and_come_out_of_a_ray_task_error_as_themselves():
    errors = [InvalidRequestError("bad"), RequestFailedError("failed"), EngineDeadError("dead", suspect=True)]
    assert [is_ours(exc) for exc in errors] == [True, True, True]
    for exc in errors:
        wrapped = ray.exceptions.RayTaskError("InstanceWorkerActor.generate", "Traceback ...", exc)
        assert translated(wrapped) is exc
