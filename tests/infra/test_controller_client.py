"""`ControllerClient` and `RayServingCluster` over a fake controller handle: what a queue report
sends and what its answer comes back as. The real actor is exercised by test_platform_e2e.py."""

from __future__ import annotations

import asyncio
from typing import Any

from controller import TenantQuota
from controller.slot_outlook import SlotOutlook
from infra.controller_client import ControllerClient
from infra.serving_cluster import RayServingCluster

OUTLOOK = SlotOutlook(model_id="acme/b", status="waiting_for_slot", position=2, estimate_s=1.4)


class FakeMethod:
    """``handle.method.remote(*args, **kwargs)``: records the call, answers with `answer`."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def remote(self, *args: Any, **kwargs: Any):
        self.calls.append((args, kwargs))

        async def reply() -> Any:
            return self.answer

        return reply()


class FakeHandle:
    def __init__(self, answer: Any) -> None:
        self.notify_demand = FakeMethod(answer)


def test_a_queue_report_carries_the_oldest_and_newest_waits_and_returns_the_outlook():
    handle = FakeHandle(OUTLOOK)
    client = ControllerClient(handle, reporter="gateway-1")
    assert asyncio.run(client.notify_demand("acme/b", 3, oldest_wait_s=2.5, newest_wait_s=0.5)) == OUTLOOK
    assert asyncio.run(RayServingCluster(client).notify_demand("acme/b", 1, 0.5, 0.5)) == OUTLOOK
    assert handle.notify_demand.calls == [(("acme/b", 3, "gateway-1"), {"oldest_wait_s": 2.5, "newest_wait_s": 0.5}),
                                          (("acme/b", 1, "gateway-1"), {"oldest_wait_s": 0.5, "newest_wait_s": 0.5})]


def test_a_controller_without_an_outlook_answers_none():
    handle = FakeHandle(None)
    assert asyncio.run(ControllerClient(handle).notify_demand("acme/b", 0)) is None
    assert handle.notify_demand.calls == [(("acme/b", 0, "gateway"), {"oldest_wait_s": 0.0, "newest_wait_s": 0.0})]


def test_tenant_quotas_arrive_as_typed_records_and_a_quota_change_is_sent_as_given():
    handle = FakeHandle(None)
    handle.tenant_quotas = FakeMethod({"acme": {"max_instances": 2, "max_queued_requests": None}})
    handle.set_tenant_quota = FakeMethod({"max_instances": 2, "max_queued_requests": 50})
    client = ControllerClient(handle)
    assert asyncio.run(RayServingCluster(client).tenant_quotas()) == {"acme": TenantQuota(max_instances=2)}
    assert asyncio.run(client.set_tenant_quota("acme", {"max_queued_requests": 50})) == {
        "max_instances": 2, "max_queued_requests": 50}
    assert handle.set_tenant_quota.calls == [(("acme", {"max_queued_requests": 50}), {})]


class DeadMethod:
    """A method of an actor that is gone: every call fails as Ray's dead-actor error translates."""

    def remote(self, *args: Any, **kwargs: Any):
        async def reply() -> Any:
            from wire import ActorGoneError

            raise ActorGoneError("the actor died")

        return reply()


def test_a_client_follows_a_controller_started_anew_under_the_same_name():
    import pytest

    from infra.controller_client import ControllerUnavailable

    dead, successor = FakeHandle(None), FakeHandle(OUTLOOK)
    dead.notify_demand = DeadMethod()
    lookups: list[int] = []

    async def resolve():
        lookups.append(1)
        return successor

    client = ControllerClient(dead, resolve=resolve)

    async def main():
        with pytest.raises(ControllerUnavailable, match="did not answer notify_demand: ActorGoneError"):
            await client.notify_demand("acme/b", 1)  # the failed call is not retried: it may have run
        assert await client.notify_demand("acme/b", 2) == OUTLOOK  # the next one goes to the successor

    asyncio.run(main())
    assert lookups == [1] and successor.notify_demand.calls == [(("acme/b", 2, "gateway"), {"oldest_wait_s": 0.0, "newest_wait_s": 0.0})]


def test_without_a_successor_the_client_keeps_its_handle_and_looks_again_next_time():
    import pytest

    from infra.controller_client import ControllerUnavailable

    dead = FakeHandle(None)
    dead.notify_demand = DeadMethod()
    lookups: list[int] = []

    async def resolve():
        lookups.append(1)
        raise RuntimeError("no controller actor 'thaw-controller' yet")

    client = ControllerClient(dead, resolve=resolve)

    async def main():
        for _ in range(2):
            with pytest.raises(ControllerUnavailable):
                await client.notify_demand("acme/b", 1)

    asyncio.run(main())
    assert lookups == [1, 1]
