"""Tests for controller/instance_manager.py's start path against the fake cluster: the tier the
checkpoint is pinned in is the one placement decided, chosen once per start (the lifecycle itself
-- start, stop, adopt -- is covered through the controller in test_controller.py)."""

from __future__ import annotations

import asyncio

from tests.controller.test_controller import MODEL_BYTES, NODE, Harness, spec


def test_the_pin_takes_the_tier_placement_chose_even_where_the_node_report_suggests_another(tmp_path):
    # A node whose SSD measures faster than its DRAM: placement estimates the start from the SSD
    # although DRAM holds a copy too. The pin must follow placement, not look at DRAM again.
    async def scenario():
        async with Harness(tmp_path, fallback_ssd_bytes_per_s=16e9, fallback_dram_bytes_per_s=8e9) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            store = h.cluster.stores[NODE]
            store.hold("acme--m1", "dram")  # and on SSD (a DRAM copy came from there)
            await h.tick()
            [placement] = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "placement"]
            assert (placement["node_id"], placement["tier"]) == (NODE, "ssd")
            assert placement["estimate_s"] == MODEL_BYTES / 16e9
            [instance] = h.controller.get_model("acme/m1")["instances"]
            assert (instance["state"], instance["tier"]) == ("ready", "ssd")
            assert [w.model_dir for w in h.cluster.live_workers()] == [f"/fake/{NODE}/ssd/acme--m1"]
            assert store.tiers == {"dram": {"acme--m1": False}, "ssd": {"acme--m1": True}}  # pinned where read

    asyncio.run(scenario())


def test_a_dram_decision_is_pinned_in_dram_and_a_repository_one_on_ssd(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), max_instances=2, target_ongoing_requests=1))
            warm, cold = sorted(h.cluster.stores)
            h.cluster.stores[warm].hold("acme--m1", "dram")
            h.controller.notify_demand("acme/m1", 2)
            await h.tick()
            placements = {d["node_id"]: d["tier"] for d in h.controller.status()["recent_decisions"]
                          if d["kind"] == "placement"}
            assert placements == {warm: "dram", cold: "repository"}
            tiers = {i["node_id"]: i["tier"] for i in h.controller.get_model("acme/m1")["instances"]}
            assert tiers == {warm: "dram", cold: "ssd"}
            assert h.cluster.stores[warm].tiers["dram"] == {"acme--m1": True}
            assert h.cluster.stores[cold].tiers == {"dram": {}, "ssd": {"acme--m1": True}}

    asyncio.run(scenario())
