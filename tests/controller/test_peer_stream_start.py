"""Starting an instance from a running peer's stream, against the fake cluster: the controller
streams when a peer on another node beats the new node's tier, serves before the node's own copy
has arrived and then hands that copy over as the fallback; a peer that refuses makes it load from
the tier, saying why; a peer still receiving its own stream is never a source."""

from __future__ import annotations

import asyncio

from controller.stream_source_policy import PeerStreamSettings
from tests.controller.fake_cluster import FakeTicket
from tests.controller.test_controller import Harness, eventually, spec


def instances(h) -> dict[str, dict]:
    return {i["instance_id"]: i for i in h.controller.status()["instances"]}


def worker_of(h, instance_id: str):
    return next(w for w in h.cluster.live_workers() if w.instance_id == instance_id)


async def second_instance(h, first: dict) -> dict:
    """Asks for a second instance of acme/m1 and returns it, started in that tick."""
    h.controller.notify_demand("acme/m1", 2)
    await h.tick()
    [second] = [i for i in instances(h).values() if i["instance_id"] != first["instance_id"]]
    return second


async def first_ready(h) -> dict:
    await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1, max_instances=3,
                                   target_ongoing_requests=1))
    await h.tick()
    [first] = h.controller.get_model("acme/m1")["instances"]
    assert first["state"] == "ready"
    assert first["load_path"] is None or first["load_path"]["kind"] == "tier"  # nothing to stream from yet
    return first


def test_a_new_node_streams_from_the_running_peer_and_gets_its_copy_as_the_fallback(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1) as h:
            first = await first_ready(h)
            h.cluster.pin_gate = asyncio.Event()  # the second node's copy is slow to arrive
            h.controller.notify_demand("acme/m1", 2)
            await h.tick()
            [second] = [i for i in instances(h).values() if i["instance_id"] != first["instance_id"]]
            assert second["node_id"] != first["node_id"]
            assert second["load_path"]["kind"] == "stream"
            assert second["load_path"]["source_instance_id"] == first["instance_id"]
            assert "repository is the fallback" in second["load_path"]["reason"]
            assert h.cluster.streams == [(first["instance_id"], 1)]
            worker = worker_of(h, second["instance_id"])
            assert worker.peer == FakeTicket(first["instance_id"], 1, 1) and worker.model_dir is None
            # Serving before its node holds the checkpoint: routed, weights still arriving.
            await eventually(lambda: second["instance_id"] in h.routes("acme/m1"), "the streamed instance routed")
            assert worker.fallback_dir is None and not instances(h)[second["instance_id"]]["weights_resident"]
            kinds = [(d["kind"], d.get("instance_id")) for d in h.controller.status()["recent_decisions"]]
            assert ("load_path", second["instance_id"]) in kinds
            h.cluster.pin_gate.set()
            await eventually(lambda: worker.fallback_dir is not None, "the node's copy handed over")
            assert worker.fallback_dir == f"/fake/{second['node_id']}/ssd/acme--m1"
            assert instances(h)[second["instance_id"]]["tier"] == "ssd"
            worker.weights_resident = True  # the last layer landed
            await h.tick()
            assert instances(h)[second["instance_id"]]["weights_resident"]

    asyncio.run(scenario())


def test_a_peer_that_refuses_to_stream_leaves_the_tier_with_the_reason(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1) as h:
            first = await first_ready(h)
            worker_of(h, first["instance_id"]).stream_error = RuntimeError("no local copy yet")
            second = await second_instance(h, first)
            assert second["load_path"]["kind"] == "tier"
            assert second["load_path"]["reason"] == (f"repository: streaming from {first['instance_id']} refused "
                                                     "(no local copy yet)")
            worker = worker_of(h, second["instance_id"])
            assert worker.peer is None and worker.model_dir == f"/fake/{second['node_id']}/ssd/acme--m1"
            assert second["state"] == "ready" and h.cluster.streams == []

    asyncio.run(scenario())


def test_an_instance_still_receiving_its_weights_is_no_source_and_peer_streaming_can_be_off(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1) as h:
            first = await first_ready(h)
            worker_of(h, first["instance_id"]).weights_resident = False  # as if itself fed by a stream still running
            await h.tick()
            second = await second_instance(h, first)
            assert second["load_path"]["kind"] == "tier"
            assert "still receiving its own weights" in second["load_path"]["reason"]

        async with Harness(tmp_path / "off", nodes_per_ray_node=2, cpu_worker_slots_per_node=1,
                           peer_stream=None) as h:
            first = await first_ready(h)
            h.controller.notify_demand("acme/m1", 2)
            await h.tick()
            assert all(i["load_path"] is None for i in instances(h).values()) and h.cluster.streams == []

    asyncio.run(scenario())


def test_instances_started_together_from_one_peer_share_one_chain(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=4, cpu_worker_slots_per_node=1) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1, max_instances=4,
                                           target_ongoing_requests=1))
            await h.tick()
            [first] = h.controller.get_model("acme/m1")["instances"]
            h.controller.notify_demand("acme/m1", 4)
            await h.tick()
            others = [i for i in instances(h).values() if i["instance_id"] != first["instance_id"]]
            assert len(others) == 3 and h.cluster.streams == [(first["instance_id"], 3)]  # one stream, not three
            tickets = sorted(w.peer.rank for w in h.cluster.live_workers() if w.peer is not None)
            assert tickets == [1, 2, 3]
            assert all("of a chain of 3" in i["load_path"]["reason"] for i in others)

    asyncio.run(scenario())


def test_a_prompt_waiting_on_the_streamed_instance_is_handed_to_the_loaded_one(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1) as h:
            first = await first_ready(h)
            second = await second_instance(h, first)
            assert second["load_path"]["kind"] == "stream"
            worker = worker_of(h, second["instance_id"])
            await eventually(lambda: second["instance_id"] in h.routes("acme/m1"), "the streamed instance routed")
            worker.request_ids, worker.prefills_at_frontier = ["r1"], ("r1",)  # waits for a layer on its way
            await h.tick()
            await eventually(lambda: any(d["kind"] == "prefill_handoff"
                                         for d in h.controller.status()["recent_decisions"]), "the hand-over")
            assert h.cluster.migrations == [(second["instance_id"], first["instance_id"], ["r1"], "layer")]
            [decision] = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "prefill_handoff"]
            assert decision["status"] == "migrated" and decision["helper"] == first["instance_id"]
            assert worker_of(h, first["instance_id"]).request_ids == ["r1"]
            # The streamed instance's stale report is not acted on twice.
            await h.tick()
            assert len(h.cluster.migrations) == 1

    asyncio.run(scenario())


def test_hand_overs_can_be_switched_off(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1,
                           peer_stream=PeerStreamSettings(hand_over_prefills=False)) as h:
            first = await first_ready(h)
            second = await second_instance(h, first)
            worker = worker_of(h, second["instance_id"])
            await eventually(lambda: second["instance_id"] in h.routes("acme/m1"), "the streamed instance routed")
            worker.request_ids, worker.prefills_at_frontier = ["r1"], ("r1",)
            await h.tick()
            await h.tick()
            assert h.cluster.migrations == []

    asyncio.run(scenario())
