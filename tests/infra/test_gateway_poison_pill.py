"""Issue 19: one request must not take down instance after instance, and a request that failed
alone on a healthy instance is not retried.

`RayGatewayBackend` against the fake `ServingCluster` (tests/infra/fake_serving_cluster.py), whose
instances here die (or refuse) the moment a request reaches them: what is checked is how many
instances the backend sends the request to, and what the client is told (a 500 naming no
internals when the request is at fault, a 503 when the instances are).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from infra.gateway_backend import BackendUnavailable, RequestFailed
from infra.openai_errors import error_from_backend
from infra.serving_cluster import InstanceGone, InstanceRoute
from tests.infra.fake_serving_cluster import FAST, MODEL, FakeCluster, collect, record, route, run
from worker import RequestFailedError, SamplingParams

INTERNALS = "CUDA error: device-side assert triggered"  # what an engine's exception might say


class DyingCluster(FakeCluster):
    """Every instance fails the request as soon as it gets it: its engine dies (`suspect` says
    whether the request was in the failing forward pass) or, with `fail_alone`, the request alone
    fails on an instance that serves on."""

    def __init__(self, *, suspect: bool = False, fail_alone: bool = False) -> None:
        super().__init__()
        self.suspect = suspect
        self.fail_alone = fail_alone
        self.tried: list[str] = []  # instance ids, in the order the request reached them

    async def generate(self, r: InstanceRoute, request_id: str, prompt: Any, params: SamplingParams, *,
                       sent_token_ids: tuple[int, ...] = ()) -> AsyncIterator[Any]:
        self.tried.append(r.instance_id)
        if self.fail_alone:
            raise RequestFailedError(f"sampling failed: RuntimeError: {INTERNALS}")
        raise InstanceGone(f"instance {r.instance_id} cannot serve: EngineDeadError: {INTERNALS}",
                           suspect=self.suspect)
        yield  # an async generator, like the real one


def three_instances(cluster: DyingCluster) -> DyingCluster:
    cluster.records[MODEL] = record(MODEL)
    cluster.set_routes(MODEL, [route("i1"), route("i2"), route("i3")])
    return cluster


def assert_no_internals(error: Exception) -> None:
    body = json.dumps(error_from_backend(error).body())
    assert INTERNALS not in body and "EngineDeadError" not in body and "RuntimeError" not in body


def test_a_request_whose_engine_died_in_its_forward_pass_is_tried_on_one_more_instance_only():
    cluster = three_instances(DyingCluster(suspect=True))

    async def test(cluster, backend):
        with pytest.raises(RequestFailed) as info:
            await collect(backend, "poison")
        assert len(cluster.tried) == 2 and len(set(cluster.tried)) == 2  # not a third instance
        assert str(info.value) == (f"model {MODEL!r}: this request failed on 2 instances and is not retried; "
                                   "the failure has been logged")
        error = error_from_backend(info.value)
        assert error.status_code == 500 and error.body()["error"]["code"] == "request_failed"
        assert_no_internals(info.value)

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=3))


def test_instances_that_died_with_no_evidence_against_the_request_are_all_tried():
    """A process killed, a node lost, an instance found gone: the request is not to blame, so it
    goes on to every attempt the config allows, and the failure is a 503 (retry later)."""
    cluster = three_instances(DyingCluster(suspect=False))

    async def test(cluster, backend):
        with pytest.raises(BackendUnavailable) as info:
            await collect(backend, "innocent")
        assert sorted(cluster.tried) == ["i1", "i2", "i3"]
        assert error_from_backend(info.value).status_code == 503
        assert_no_internals(info.value)

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=3))


def test_a_request_that_failed_alone_on_a_healthy_instance_is_not_retried():
    cluster = three_instances(DyingCluster(fail_alone=True))

    async def test(cluster, backend):
        with pytest.raises(RequestFailed) as info:
            await collect(backend, "unlucky")
        assert len(cluster.tried) == 1
        assert str(info.value) == f"model {MODEL!r} could not complete this request; the failure has been logged"
        assert error_from_backend(info.value).status_code == 500
        assert_no_internals(info.value)
        # The instance was not marked broken: the next request goes to the instances as usual.
        cluster.fail_alone = False
        cluster.suspect = False
        with pytest.raises(BackendUnavailable):
            await collect(backend, "next")
        assert len(cluster.tried) == 4

    run(test)(cluster, dataclasses.replace(FAST, max_attempts=3))
