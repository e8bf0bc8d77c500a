"""The controller's engine gauges: what every gateway replica exports for all nodes on ``/metrics``."""

from __future__ import annotations

import asyncio

from tests.controller.test_controller import NODE, Harness, spec


def test_engine_gauges_list_every_ready_instance_as_its_worker_last_reported(tmp_path):
    from wire import EngineGauges

    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            assert h.controller.engine_gauges() == []
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            [worker] = h.cluster.live_workers()
            worker.num_running_requests, worker.num_waiting_requests, worker.kv_cache_usage = 3, 2, 0.5
            await h.tick()
            assert h.controller.engine_gauges() == [EngineGauges(worker.instance_id, "acme/m1", NODE, 3, 2, 0.5)]

    asyncio.run(scenario())
