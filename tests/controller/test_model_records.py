"""The controller's model records (`Controller.model_records`, `wire.ModelRecord`): what the gateway
reads of each model -- its queue limits, when it was deployed, how its instances were loaded --
from a real controller over the fake cluster, with a fake wall clock."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from controller import UnknownModelError
from tests.controller.fake_cluster import FakeCluster
from tests.controller.test_controller import NODE, RAY_NODE, FakeClock, Harness, spec
from wire import InstanceLoadRecord, ModelRecord

DEPLOYED_S = 1_700_000_123.5


def test_the_record_carries_the_deploy_time_and_keeps_it_through_updates(tmp_path):
    wall = FakeClock()
    wall.now = DEPLOYED_S

    async def scenario():
        async with Harness(tmp_path, wall_clock=wall) as h:
            source = h.source("m1")
            await h.controller.deploy(spec("acme/m1", source, max_queued_requests=7, queue_timeout_s=3.0))
            wall.advance(600.0)
            await h.controller.update({**spec("acme/m1", source, max_queued_requests=9, queue_timeout_s=3.0),
                                       "max_model_len": 512})
            expected = ModelRecord(model_id="acme/m1", deployed_s=DEPLOYED_S, max_model_len=512,
                                   max_queued_requests=9, queue_timeout_s=3.0)
            assert h.controller.model_records() == [expected]
            assert h.controller.model_record("acme/m1") == expected
            assert pickle.loads(pickle.dumps(expected)) == expected  # as it crosses Ray to the gateway
            with pytest.raises(UnknownModelError):
                h.controller.model_record("acme/nope")

    asyncio.run(scenario())


def test_the_record_lists_how_each_instance_was_loaded(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cluster=FakeCluster((RAY_NODE,), auto_ready=False), wall_clock=lambda: 5.0) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
            [worker] = h.cluster.live_workers()
            assert h.controller.model_record("acme/m1").instances == (
                InstanceLoadRecord(instance_id=worker.instance_id, tier="ssd", load_s=None),)  # still loading
            worker.finish_loading()
            await h.tick()
            [loaded] = h.controller.model_record("acme/m1").instances
            assert (loaded.instance_id, loaded.tier, loaded.load_s) == (worker.instance_id, "ssd", 0.5)
            assert h.controller.get_model("acme/m1")["instances"][0]["node_id"] == NODE

    asyncio.run(scenario())


def test_a_restarted_controller_reports_the_deploy_time_the_store_kept(tmp_path):
    """The deploy time is durable: a restarted controller (a minute later, on the same state)
    reports the original time, so ``/v1/models``' ``created`` does not fall to 0."""
    async def scenario():
        async with Harness(tmp_path, wall_clock=lambda: DEPLOYED_S) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            assert h.controller.model_record("acme/m1").deployed_s == DEPLOYED_S
        async with Harness(tmp_path, wall_clock=lambda: DEPLOYED_S + 60) as restarted:
            assert [r.deployed_s for r in restarted.controller.model_records()] == [DEPLOYED_S]

    asyncio.run(scenario())
