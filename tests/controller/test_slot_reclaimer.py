"""Controller-initiated migration to free a slot (fake cluster, fake clock): the plan, the moves,
the held slot, the placement on the freed node, and giving up. See `controller.slot_reclaimer`."""

from __future__ import annotations

import asyncio

import pytest

from controller.slot_reclaim_policy import SlotReclaimCosts
from tests.controller.test_controller import DRAM_S, MODEL_BYTES, Harness, eventually, settle, spec

CHEAP = SlotReclaimCosts(migrate_s_per_request=0.001, stop_s=0.001, min_gain_s=0.0)


async def two_full_nodes(h: Harness):
    """acme/m1 on both 1-slot nodes, requests r1, r2 on one of them (the node holding acme/m2 in
    DRAM); acme/m2 deployed and cold. Returns (busy m1 worker, other m1 worker, busy node id)."""
    h.cluster.model_bytes["acme--m2"] = MODEL_BYTES
    await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=2, max_instances=2))
    await h.controller.deploy(spec("acme/m2", h.source("m2", seed=2)))
    await h.tick()
    busy, other = sorted(h.cluster.live_workers(), key=lambda w: w.instance_id)
    busy.request_ids[:] = ["r1", "r2"]
    busy.num_ongoing_requests = 2
    await h.tick()  # the controller learns of the two requests
    node = next(i["node_id"] for i in h.controller.get_model("acme/m1")["instances"]
                if i["instance_id"] == busy.instance_id)
    h.cluster.stores[node].hold("acme--m2", "dram")
    return busy, other, node


def test_a_cold_model_gets_the_full_node_holding_it_in_dram_by_migrating_its_requests_off(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1, slot_reclaim=CHEAP,
                           drain_timeout_s=5.0) as h:
            busy, other, node = await two_full_nodes(h)
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            [plan] = h.controller.status()["slot_reclaims"]
            assert (plan["model_id"], plan["node_id"], plan["tier"]) == ("acme/m2", node, "dram")
            assert (plan["victim_instance_id"], plan["destination_instance_id"], plan["num_requests"]) == (
                busy.instance_id, other.instance_id, 2)
            assert plan["cost_s"] == pytest.approx(0.003) and plan["ready_s"] == pytest.approx(DRAM_S + 0.003)
            assert plan["alternative_s"] is None  # no node had room at all
            recorded = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "slot_reclaim"]
            assert [d["victim_instance_id"] for d in recorded] == [busy.instance_id]
            assert h.routes("acme/m1") == [other.instance_id]  # the victim left routing at once

            await eventually(lambda: h.cluster.stopped_workers == [busy.instance_id], "the emptied worker stopped")
            assert h.cluster.migrations == [(busy.instance_id, other.instance_id, ["r1", "r2"], "kv")]
            assert other.request_ids == ["r1", "r2"]  # none lost
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            m2 = h.controller.get_model("acme/m2")
            assert [(i["node_id"], i["tier"]) for i in m2["instances"]] == [(node, "dram")]
            assert h.controller.status()["slot_reclaims"] == []
            # acme/m1 wants its second instance back, but the only slot went to acme/m2
            assert [i["instance_id"] for i in h.controller.get_model("acme/m1")["instances"]] == [other.instance_id]

    asyncio.run(scenario())


def test_a_reclaim_whose_slot_never_frees_is_given_up_after_its_deadline(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1, slot_reclaim=CHEAP,
                           drain_timeout_s=30.0) as h:
            busy, other, node = await two_full_nodes(h)
            h.controller.notify_demand("acme/m2", 1)
            await h.controller.reconcile_once()  # plans; the moves have not run yet
            assert h.controller.status()["slot_reclaims"][0]["victim_instance_id"] == busy.instance_id
            other.alive = False  # the destination dies: the requests cannot move, the victim keeps draining
            await settle()
            assert busy.request_ids == ["r1", "r2"]  # whole, on their source
            h.controller.notify_demand("acme/m2", 1)
            await h.tick(advance_s=1.0)  # the slot is not free, the deadline (30 s + cost) not reached: wait
            assert h.controller.get_model("acme/m2")["instances"] == [] and h.cluster.stopped_workers == []
            assert len(h.controller.status()["slot_reclaims"]) == 1
            h.clock.advance(60.0)
            h.controller.notify_demand("acme/m2", 1)  # its request still waits (the gateway repeats the report)
            await h.tick()
            abandoned = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "slot_reclaim_abandoned"]
            assert [d["node_id"] for d in abandoned] == [node] and "was not free" in abandoned[0]["reason"]
            assert h.controller.status()["slot_reclaims"] == []

    asyncio.run(scenario())


def test_a_model_that_scales_back_down_releases_the_held_slot(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1, slot_reclaim=CHEAP,
                           drain_timeout_s=30.0) as h:
            busy, other, node = await two_full_nodes(h)
            h.controller.notify_demand("acme/m2", 1)
            await h.controller.reconcile_once()
            assert len(h.controller.status()["slot_reclaims"]) == 1
            other.alive = False  # (so the victim keeps draining and the slot stays held)
            await h.tick(advance_s=60.0)  # no more demand: acme/m2 idles past keep-alive, back to zero
            assert h.controller.get_model("acme/m2")["num_desired_instances"] == 0
            assert h.controller.status()["slot_reclaims"] == []
            abandoned = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "slot_reclaim_abandoned"]
            assert ["no longer needed" in d["reason"] for d in abandoned] == [True]

    asyncio.run(scenario())


@pytest.mark.parametrize("costs, reclaims", [(CHEAP, True), (SlotReclaimCosts(min_gain_s=1.0), False), (None, False)])
def test_a_node_with_room_wins_unless_the_reclaim_saves_more_than_the_margin(tmp_path, costs, reclaims):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1, slot_reclaim=costs) as h:
            busy, _, node = await two_full_nodes(h)  # the third node is empty: repository only for acme/m2
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            planned = h.controller.status()["slot_reclaims"]
            m2 = h.controller.get_model("acme/m2")
            if reclaims:
                assert [p["victim_instance_id"] for p in planned] == [busy.instance_id]
                assert planned[0]["gain_s"] > 0 and m2["instances"] == []
            else:
                assert planned == [] and h.routes("acme/m1") != [] and busy.alive
                [where] = [i["node_id"] for i in m2["instances"]]
                assert where != node and m2["last_placement"]["tier"] == "repository"

    asyncio.run(scenario())


def test_the_reason_a_model_cannot_be_placed_says_why_no_slot_was_reclaimed(tmp_path):
    async def scenario():
        from controller import SlotSharingSettings

        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1, slot_reclaim=CHEAP,
                           slot_sharing=SlotSharingSettings(deadline_preemption=False)) as h:
            h.cluster.model_bytes["acme--m2"] = MODEL_BYTES
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.controller.deploy(spec("acme/m3", h.source("m3", seed=3), min_instances=1))
            await h.controller.deploy(spec("acme/m2", h.source("m2", seed=2)))
            await h.tick()
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            reason = h.controller.get_model("acme/m2")["last_placement"]["reason"]
            # each way of freeing a slot says why it did not: eviction, reclaim, preemption
            assert reason.startswith("no free slot: none of 2 nodes has 1 free worker slot; no idle instance to "
                                     "evict: ")
            assert "at min_instances 1" in reason and "; no slot to reclaim: " in reason
            assert reason.endswith("acme/m2 has waited 0s of its max_wait_before_preempt_s 5")
            assert "no instance whose requests another instance of its model can take" in reason

    asyncio.run(scenario())
