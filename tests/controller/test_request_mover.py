"""Live migration through the controller (fake cluster, fake clock): ``migrate`` moves an
instance's requests and refuses bad calls by name; a drain migrates running requests off before
the instance stops. See `controller.request_mover`."""

from __future__ import annotations

import asyncio

import pytest

from controller import InvalidMigrationError, MigrationConflictError, UnknownInstanceError
from tests.controller.test_controller import Harness, eventually, spec


def test_migrate_moves_an_instances_requests_and_refuses_bad_calls_by_name(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=2, max_instances=2))
            await h.tick()
            source, other = sorted(h.cluster.live_workers(), key=lambda w: w.instance_id)
            source.request_ids[:] = ["r1", "r2"]
            nodes = {i["instance_id"]: i["node_id"] for i in h.controller.get_model("acme/m1")["instances"]}
            with pytest.raises(InvalidMigrationError, match="method"):
                await h.controller.migrate(source.instance_id, method="teleport")
            with pytest.raises(InvalidMigrationError, match="not both"):
                await h.controller.migrate(source.instance_id, to_node="x", to_instance="y")
            with pytest.raises(UnknownInstanceError):
                await h.controller.migrate("no-such-instance")
            with pytest.raises(LookupError, match="no node"):
                await h.controller.migrate(source.instance_id, to_node="no-such-node")
            [empty_node] = {n["node_id"] for n in h.controller.status()["nodes"]} - set(nodes.values())
            with pytest.raises(MigrationConflictError, match=f"no ready instance .* on node {empty_node}"):
                await h.controller.migrate(source.instance_id, to_node=empty_node)
            assert h.cluster.migrations == []

            one = await h.controller.migrate(source.instance_id, "r1", method="tokens")
            assert (one.destination_id, [o.status.value for o in one.outcomes]) == (other.instance_id, ["migrated"])
            assert (one.source_id, one.method.value, one.num_migrated) == (source.instance_id, "tokens", 1)
            rest = await h.controller.migrate(source.instance_id, to_node=nodes[other.instance_id])
            assert [(o.request_id, o.status.value) for o in rest.outcomes] == [("r2", "migrated")]
            assert h.cluster.migrations == [(source.instance_id, other.instance_id, ["r1"], "tokens"),
                                            (source.instance_id, other.instance_id, ["r2"], "kv")]
            assert (source.request_ids, other.request_ids) == ([], ["r1", "r2"])
            recorded = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "migration"]
            assert [(d["source"], d["destination"], d["num_migrated"]) for d in recorded] == [
                (source.instance_id, other.instance_id, 1)] * 2

    asyncio.run(scenario())


def test_drain_migrates_running_requests_off_before_stopping_the_instance(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1, drain_timeout_s=5.0) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=2, max_instances=2))
            await h.tick()
            source, other = sorted(h.cluster.live_workers(), key=lambda w: w.instance_id)
            source.request_ids[:] = ["r1", "r2", "r3"]
            source.num_ongoing_requests = 3
            node_id = h.controller.get_model("acme/m1")["instances"][0]["node_id"]
            assert h.controller.get_model("acme/m1")["instances"][0]["instance_id"] == source.instance_id
            result = await h.controller.drain_node(node_id)
            assert result["stopping"] == [source.instance_id] and result["migrating"] is True
            await eventually(lambda: h.cluster.stopped_workers == [source.instance_id], "the drained worker stopped",
                             timeout_s=10.0)
            assert h.cluster.migrations == [(source.instance_id, other.instance_id, ["r1", "r2", "r3"], "kv")]
            assert other.request_ids == ["r1", "r2", "r3"]  # none lost: all moved before the stop

    asyncio.run(scenario())
