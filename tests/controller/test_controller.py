"""Unit tests of the Controller against a fake cluster (tests/controller/fake_cluster.py), a real
SQLite state store, a real local repository and a fake clock: autoscaling with exact
timing, placement over node stores' holdings, the start/stop lifecycle, adoption after a
restart, and a reconcile loop that survives a failing step. The registry's tests are in
test_model_registry.py, slot sharing's in test_slot_sharer.py; both use the helpers here.

Each test runs its scenario with ``asyncio.run``; `settle` lets the controller's background
tasks (starts, stops) run to their next wait -- the fakes never block unless told to.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from pathlib import Path

import pytest

from controller import Controller, ControllerConfig, InvalidSpecError, RoutingTable, UnknownModelError, open_state_store
from controller.engine_settings import engine_config_for
from controller.model_spec import ModelSpec
from controller.routing_table import Route
from storage import RepositoryConfig
from tests.controller.fake_cluster import FakeCluster
from wire import InstanceState

MODEL_BYTES = 1_000_000
RAY_NODE = "a" * 56
NODE = "a" * 16  # the logical node of an unsplit Ray node
SPLIT = ["a" * 12 + f"-{i}" for i in range(3)]  # ... of a Ray node split in three
# Placement estimates for MODEL_BYTES at the config's fallback rates (DRAM 8 GB/s, SSD 1 GB/s,
# download 0.2 GB/s then SSD: 1 / (1/0.2 + 1/1) GB/s).
DRAM_S, SSD_S, REPOSITORY_S = 1e6 / 8e9, 1e6 / 1e9, 1e6 * (1 / 2e8 + 1 / 1e9)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def eventually(predicate, what: str, timeout_s: float = 5.0) -> None:
    """Poll `predicate` on the event loop until true; a deadline turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.001)


def write_source(root: Path, name: str, seed: int = 0, num_bytes: int = MODEL_BYTES) -> Path:
    """A model dir the repository takes as a Hugging Face one (a safetensors file of `num_bytes`)."""
    src = root / "sources" / name
    src.mkdir(parents=True, exist_ok=True)
    (src / "model.safetensors").write_bytes(bytes([seed % 256]) * num_bytes)
    return src


def make_config(tmp_path: Path, **overrides) -> ControllerConfig:
    fields = dict(state_dir=tmp_path / "state", repository=RepositoryConfig(str(tmp_path / "repo")),
                  namespace="unit", calibrate=False, cpu_worker_slots_per_node=2, dram_capacity_bytes=64 << 20,
                  ssd_capacity_bytes=1 << 30, start_retry_delay_s=1.0, drain_timeout_s=1.0)
    fields.update(overrides)
    return ControllerConfig(**fields)


def spec(model_id: str, source: Path, **autoscaling) -> dict:
    policy = dict(min_instances=0, max_instances=1, target_ongoing_requests=2, upscale_delay_s=0.0,
                  downscale_delay_s=0.0, keep_alive_s=10.0)
    policy.update(autoscaling)
    return {"name": model_id, "source": str(source), "autoscaling": policy}


SERVABLE_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 256}


class Harness:
    """A controller over a fake cluster, a fake clock and the test's state directory."""

    def __init__(self, tmp_path: Path, cluster: FakeCluster | None = None, wall_clock=time.time, **config) -> None:
        self.tmp_path = tmp_path
        self.config = make_config(tmp_path, **config)
        self.cluster = cluster or FakeCluster((RAY_NODE,))
        self.cluster.model_bytes.setdefault("acme--m1", MODEL_BYTES)
        self.clock = FakeClock()
        self.controller = Controller(self.config, self.cluster, clock=self.clock, wall_clock=wall_clock)

    async def __aenter__(self) -> Harness:
        await self.controller.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.controller.shutdown(stop_workers=False)

    async def tick(self, advance_s: float = 0.0) -> dict:
        self.clock.advance(advance_s)
        result = await self.controller.reconcile_once()
        await settle()
        return result

    def source(self, name: str, seed: int = 0) -> Path:
        return write_source(self.tmp_path, name, seed)

    def routes(self, model_id: str) -> list[str]:
        return [route["instance_id"] for route in self.controller._routing.snapshot()[1].get(model_id, [])]

    def records(self) -> dict[str, InstanceState]:
        with open_state_store(self.config.state_location) as store:
            return {record.instance_id: record.state for record in store.list_workers()}


# --- pure pieces --------------------------------------------------------------------------------


def test_routing_table_version_moves_only_on_change():
    table = RoutingTable()
    route = Route("i1", "thaw-worker-i1", "ns", "n0", 0)
    assert table.snapshot() == (0, {})
    assert table.set_routes("acme/m1", [route]) is True and table.version == 1
    assert table.set_routes("acme/m1", [route]) is False and table.version == 1
    assert table.set_routes("acme/m1", [Route("i1", "thaw-worker-i1", "ns", "n0", 3)]) is True  # load moved
    assert table.snapshot() == (2, {"acme/m1": [{"schema": "instance_route/1", "instance_id": "i1",
                                                  "actor_name": "thaw-worker-i1", "namespace": "ns", "node_id": "n0",
                                                  "num_ongoing_requests": 3, "hosted": False}]})
    assert table.remove_model("acme/m1") is True and table.snapshot() == (3, {})
    assert table.remove_model("acme/m1") is False and table.version == 3


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="state_dir must be an absolute path"):
        make_config(tmp_path, state_dir="relative/dir")
    with pytest.raises(ValueError, match="excluded_ray_node_ids must be a list of Ray node ids"):
        make_config(tmp_path, excluded_ray_node_ids="abc")
    with pytest.raises(ValueError, match="cpu_worker_slots_per_node must be an integer >= 1"):
        make_config(tmp_path, cpu_worker_slots_per_node=0)
    with pytest.raises(ValueError, match="worker_memory_bytes must be an integer >= 1"):
        make_config(tmp_path, worker_memory_bytes=0)
    with pytest.raises(ValueError, match="engine_defaults: .*kv_cache_bits"):
        make_config(tmp_path, engine_defaults={"kv_cache_bits": 1})
    with pytest.raises(ValueError, match="namespace 'a b' must be"):
        make_config(tmp_path, namespace="a b")
    config = make_config(tmp_path)
    assert config.effective_platform_id == "unit" and config.state_location == f"{tmp_path}/state/"
    assert pickle.loads(pickle.dumps(config)) == config


# --- autoscaling and the instance lifecycle ------------------------------------------------------


def test_cold_start_on_demand_then_ready_enters_the_routing_table(tmp_path):
    async def scenario():
        async with Harness(tmp_path, cluster=FakeCluster((RAY_NODE,), auto_ready=False)) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            await h.tick()
            assert h.cluster.num_started_workers == 0  # min 0, no demand: nothing runs
            assert h.controller.get_model("acme/m1")["last_scale"]["reason"] == "scaled to zero, no requests"

            h.controller.notify_demand("acme/m1", 1)
            version = h.controller._routing.version
            await h.tick()
            model = h.controller.get_model("acme/m1")
            assert model["num_desired_instances"] == 1
            assert model["last_scale"]["reason"] == "cold start 0 -> 1: 1 requests and no instance (ceil(1/2))"
            [instance] = model["instances"]
            assert (instance["state"], instance["node_id"], instance["tier"]) == ("loading", NODE, "ssd")
            assert model["last_placement"]["node_id"] == NODE
            assert model["last_placement"]["estimates"][0]["tier"] == "repository"
            assert h.records() == {instance["instance_id"]: InstanceState.LOADING}
            assert h.routes("acme/m1") == []  # loading instances are not routed
            [worker] = h.cluster.live_workers()
            assert worker.model_dir == f"/fake/{NODE}/ssd/acme--m1" and worker.ray_node_id == RAY_NODE
            assert h.cluster.stores[NODE].tiers["ssd"] == {"acme--m1": True}  # pinned while in use
            assert h.cluster.stores[NODE].tiers["dram"] == {}  # no copy into DRAM on the cold start's path

            waiter = asyncio.ensure_future(h.controller.routing_table(version, timeout_s=5.0))
            await settle()
            assert not waiter.done()  # a long poll waits for the change...
            worker.finish_loading()
            new_version, table = await waiter  # ... and returns with it
            assert new_version > version
            assert table["acme/m1"] == [{"schema": "instance_route/1", "instance_id": worker.instance_id,
                                         "actor_name": worker.actor_name, "namespace": "fake-ns", "node_id": NODE,
                                         "num_ongoing_requests": 0, "hosted": False}]
            assert h.records() == {worker.instance_id: "ready"}

    asyncio.run(scenario())


def test_load_scales_up_after_the_upscale_delay_and_idle_scales_to_zero(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), max_instances=2, upscale_delay_s=2.0,
                                           downscale_delay_s=3.0, keep_alive_s=10.0))
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            h.controller.notify_demand("acme/m1", 0)  # the request reached the instance
            [worker] = h.cluster.live_workers()
            worker.num_ongoing_requests = 5

            reasons = []
            for step in (0.0, 1.0, 1.0):
                await h.tick(step)
                reasons.append(h.controller.get_model("acme/m1")["last_scale"]["reason"])
            assert reasons == [
                "holding 1: want 2 (5 requests / target 2) for 0s of upscale_delay_s 2",
                "holding 1: want 2 (5 requests / target 2) for 1s of upscale_delay_s 2",
                "scale up 1 -> 2: 5 requests / target 2 for 2s >= upscale_delay_s 2",
            ]
            assert len(h.cluster.live_workers()) == 2 and len(h.routes("acme/m1")) == 2  # its max
            [second] = [w for w in h.cluster.live_workers() if w is not worker]

            worker.num_ongoing_requests = 0  # idle from t = 2
            for step in (1.0, 2.5, 0.5):
                await h.tick(step)
                reasons.append(h.controller.get_model("acme/m1")["last_scale"]["reason"])
            assert reasons[3:] == [
                "holding 2: want 1 (0 requests / target 2) for 0s of downscale_delay_s 3",
                "holding 2: want 1 (0 requests / target 2) for 2.5s of downscale_delay_s 3",
                "scale down 2 -> 1: 0 requests / target 2 for 3s >= downscale_delay_s 3",
            ]
            assert h.cluster.live_workers() == [worker]  # the newest one went
            assert h.cluster.stopped_workers == [second.instance_id]

            await h.tick(5.5)  # 9.5 s since the last request
            assert len(h.cluster.live_workers()) == 1
            await h.tick(0.5)
            assert h.controller.get_model("acme/m1")["last_scale"]["reason"] == (
                "scale to zero 1 -> 0: idle 10s >= keep_alive_s 10")
            assert h.cluster.live_workers() == [] and h.routes("acme/m1") == [] and h.records() == {}
            assert h.cluster.stores[NODE].tiers["ssd"] == {"acme--m1": True}
            await h.tick()
            assert h.cluster.stores[NODE].tiers["ssd"] == {"acme--m1": False}  # unpinned once unused
            # Once the instances had settled, the model was copied into DRAM (unpinned) for fast restarts.
            assert h.cluster.stores[NODE].prefetches == [("acme--m1", "dram")]
            assert h.cluster.stores[NODE].tiers["dram"] == {"acme--m1": False}
            with open_state_store(h.config.state_location) as store:
                assert store.get_desired_instances("acme/m1") == 0

    asyncio.run(scenario())


def test_scale_down_stops_the_idle_instance_first(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), max_instances=2))
            h.controller.notify_demand("acme/m1", 4)
            await h.tick()
            h.controller.notify_demand("acme/m1", 0)
            busy, idle = h.cluster.live_workers()
            busy.num_ongoing_requests = 1
            await h.tick()  # 1 request wants 1 instance; downscale_delay_s 0
            assert h.cluster.stopped_workers == [idle.instance_id]
            assert h.routes("acme/m1") == [busy.instance_id]

    asyncio.run(scenario())


def test_placement_prefers_dram_over_ssd_over_the_repository(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), max_instances=3, target_ongoing_requests=1))
            h.cluster.stores[SPLIT[1]].hold("acme--m1", "dram")
            h.cluster.stores[SPLIT[2]].hold("acme--m1", "ssd")
            h.controller.notify_demand("acme/m1", 3)
            await h.tick()
            placements = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "placement"]
            assert [(p["node_id"], p["tier"]) for p in placements] == [
                (SPLIT[1], "dram"), (SPLIT[2], "ssd"), (SPLIT[0], "repository")]
            assert placements[0]["estimate_s"] == pytest.approx(DRAM_S)
            assert [(e["node_id"], e["tier"], e["has_room"]) for e in placements[0]["estimates"]] == [
                (SPLIT[1], "dram", True), (SPLIT[2], "ssd", True), (SPLIT[0], "repository", True)]
            assert [e["ready_s"] for e in placements[0]["estimates"]] == pytest.approx([DRAM_S, SSD_S, REPOSITORY_S])
            assert placements[1]["estimate_s"] == pytest.approx(SSD_S)
            assert placements[2]["estimate_s"] == pytest.approx(REPOSITORY_S)
            assert placements[1]["estimates"][-1]["node_id"] == SPLIT[1]  # full by then: listed last
            assert not placements[1]["estimates"][-1]["has_room"]
            assert sorted(w.model_dir for w in h.cluster.live_workers()) == sorted(
                [f"/fake/{SPLIT[1]}/dram/acme--m1", f"/fake/{SPLIT[2]}/ssd/acme--m1",
                 f"/fake/{SPLIT[0]}/ssd/acme--m1"])  # DRAM where it was; SSD elsewhere (fetched there first)

    asyncio.run(scenario())


def test_a_busy_loader_counts_as_wait_on_its_node(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_NODE,), auto_ready=False)
        async with Harness(tmp_path, cluster=cluster, nodes_per_ray_node=2, cpu_worker_slots_per_node=2) as h:
            h.cluster.model_bytes["acme--m2"] = MODEL_BYTES
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            await h.controller.deploy(spec("acme/m2", h.source("m2", seed=2)))
            h.cluster.stores["a" * 12 + "-0"].hold("acme--m1", "ssd")
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()  # m1 loads on node -0 (SSD); its estimate is that node's loader wait
            h.cluster.stores["a" * 12 + "-0"].hold("acme--m2", "ssd")
            h.cluster.stores["a" * 12 + "-1"].hold("acme--m2", "ssd")
            h.clock.advance(SSD_S / 4)
            h.controller.notify_demand("acme/m2", 1)
            await h.tick()
            placement = h.controller.get_model("acme/m2")["last_placement"]
            assert placement["node_id"] == "a" * 12 + "-1"  # same tier, no loader to wait for
            busy = placement["estimates"][1]
            assert (busy["node_id"], busy["wait_s"]) == ("a" * 12 + "-0", pytest.approx(SSD_S * 3 / 4))

    asyncio.run(scenario())


def test_the_keep_alive_counts_from_when_the_queue_went_to_an_instance(tmp_path):
    """A gateway's report that its queue got shorter is a request seen: the requests went to an
    instance whose next load report has not shown them yet. Counting the keep-alive from the
    last report of a non-empty queue instead scaled a model to zero under the requests it had
    just been started for (a truncated stream in a CI run, keep-alive 1 s)."""
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), keep_alive_s=1.0, downscale_delay_s=0.0))
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()  # t = 0: waiting, so seen; the instance starts
            [worker] = h.cluster.live_workers()
            h.clock.advance(0.9)
            h.controller.notify_demand("acme/m1", 0)  # t = 0.9: handed to the instance, between two ticks
            await h.tick(0.6)  # t = 1.5: the instance's report does not show it yet (0 ongoing)
            assert h.cluster.live_workers() == [worker], h.controller.get_model("acme/m1")["last_scale"]
            await h.tick(0.5)  # t = 2.0: 1.1 s after the hand-over, with nothing ongoing
            assert h.cluster.live_workers() == []
            assert h.controller.get_model("acme/m1")["last_scale"]["reason"] == (
                "scale to zero 1 -> 0: idle 1.1s >= keep_alive_s 1")

    asyncio.run(scenario())


def test_a_keep_alive_per_restart_follows_the_restart_estimate_of_the_node_it_started_on(tmp_path):
    """The controller records the model's restart estimate (its bytes over the chosen node's
    fastest tier) when it places it, and the autoscaler's keep-alive is that many restarts."""
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), keep_alive_per_restart=1e6,
                                           min_keep_alive_s=0.0, max_keep_alive_s=1000.0))
            assert h.controller.get_model("acme/m1")["restart_s"] is None
            h.controller.notify_demand("acme/m1", 1)
            await h.tick()
            h.controller.notify_demand("acme/m1", 0)
            restart_s = h.controller.get_model("acme/m1")["restart_s"]
            [node] = h.controller.status()["nodes"]
            rate = node["placement_bytes_per_s"]["dram_bytes_per_s"] or node["placement_bytes_per_s"]["ssd_bytes_per_s"]
            assert restart_s == pytest.approx(MODEL_BYTES / rate)
            keep_alive_s = 1e6 * restart_s
            assert 1.0 < keep_alive_s < 1000.0  # neither bound binds: the keep-alive is the multiple
            await h.tick(keep_alive_s * 0.99)
            assert len(h.cluster.live_workers()) == 1
            await h.tick(keep_alive_s * 0.02)
            assert h.cluster.live_workers() == []
            assert h.controller.get_model("acme/m1")["last_scale"]["reason"].endswith(
                f"(1e+06 x restart {restart_s:.3g}s)")

    asyncio.run(scenario())


def test_without_slot_sharing_no_free_slot_waits_until_another_model_scales_to_zero(tmp_path):
    """Keep-alive as a hard lease (`slot_sharing=None`); with sharing see test_slot_sharer.py."""
    async def scenario():
        async with Harness(tmp_path, cpu_worker_slots_per_node=2, slot_sharing=None) as h:
            for name, seed in (("m1", 1), ("m2", 2), ("m3", 3)):
                h.cluster.model_bytes[f"acme--{name}"] = MODEL_BYTES
                await h.controller.deploy(spec(f"acme/{name}", h.source(name, seed), keep_alive_s=5.0))
                h.controller.notify_demand(f"acme/{name}", 1)
            await h.tick()
            assert [h.routes(f"acme/{name}") != [] for name in ("m1", "m2", "m3")] == [True, True, False]
            m3 = h.controller.get_model("acme/m3")
            assert m3["num_desired_instances"] == 1 and m3["instances"] == []
            assert m3["last_placement"]["reason"].startswith("no free slot: none of 1 nodes has 1 free worker slot")
            for name in ("m1", "m2"):
                h.controller.notify_demand(f"acme/{name}", 0)
            for _ in range(4):  # m3's request keeps waiting; its gateway repeats the report
                h.controller.notify_demand("acme/m3", 1)
                await h.tick(1.0)
                assert h.routes("acme/m3") == []
            h.controller.notify_demand("acme/m3", 1)
            await h.tick(1.0)  # m1 and m2 idle 5 s: scaled to zero; their slots free once they stopped
            assert h.controller.status()["models"][2]["num_desired_instances"] == 1
            await h.tick()  # (the freed slots woke the loop: this is that tick)
            assert h.routes("acme/m1") == [] and h.routes("acme/m2") == []
            assert len(h.routes("acme/m3")) == 1

    asyncio.run(scenario())


def test_dead_worker_leaves_the_routing_table_and_is_replaced(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
            [worker] = h.cluster.live_workers()
            assert h.routes("acme/m1") == [worker.instance_id]
            worker.alive = False  # the actor's process died
            await h.tick()
            [replacement] = h.cluster.live_workers()
            assert replacement.instance_id != worker.instance_id
            assert h.records() == {replacement.instance_id: "ready"}
            assert h.routes("acme/m1") == [replacement.instance_id]
            assert [d["kind"] for d in h.controller.status()["recent_decisions"]][-3:] == [
                "died", "placement", "ready"]

    asyncio.run(scenario())


def test_failed_start_is_discarded_and_retried_after_a_backoff(tmp_path):
    async def scenario():
        cluster = FakeCluster((RAY_NODE,), auto_ready=False)
        async with Harness(tmp_path, cluster=cluster, start_retry_delay_s=2.0) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
            [worker] = h.cluster.live_workers()
            worker.finish_loading(RuntimeError("weights are corrupt"))
            await settle()
            assert h.cluster.live_workers() == [] and h.records() == {}
            [event] = [d for d in h.controller.status()["recent_decisions"] if d["kind"] == "start_failed"]
            assert event["reason"] == "start failed: RuntimeError: weights are corrupt; next start in 2s"
            await h.tick(1.5)
            assert h.cluster.num_started_workers == 1  # still backing off
            await h.tick(0.5)
            assert h.cluster.num_started_workers == 2
            h.cluster.live_workers()[0].finish_loading()
            await settle()
            assert len(h.routes("acme/m1")) == 1

    asyncio.run(scenario())


def test_drain_node_moves_instances_to_another_node(tmp_path):
    async def scenario():
        async with Harness(tmp_path, nodes_per_ray_node=2, cpu_worker_slots_per_node=1) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
            [first] = h.controller.get_model("acme/m1")["instances"]
            result = await h.controller.drain_node(first["node_id"])
            assert result == {"node_id": first["node_id"], "stopping": [first["instance_id"]], "migrating": True}
            await h.tick()
            [second] = h.controller.get_model("acme/m1")["instances"]
            assert second["node_id"] != first["node_id"] and second["state"] == "ready"
            assert h.cluster.stopped_workers == [first["instance_id"]]
            with pytest.raises(LookupError):
                await h.controller.drain_node("no-such-node")

    asyncio.run(scenario())


def test_delete_stops_the_models_workers(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
            [worker] = h.cluster.live_workers()
            await h.controller.delete("acme/m1")
            assert h.cluster.stopped_workers == [worker.instance_id]
            assert h.routes("acme/m1") == [] and h.records() == {} and h.controller.list_models() == []
            with pytest.raises(UnknownModelError):
                await h.controller.delete("acme/m1")
            with pytest.raises(UnknownModelError):
                h.controller.notify_demand("acme/m1", 1)

    asyncio.run(scenario())


# --- restart -------------------------------------------------------------------------------------


def test_restart_adopts_live_workers_and_starts_no_duplicates(tmp_path, store_location):
    """On both state-store backends (`store_location`: SQLite, and a real redis-server)."""

    async def scenario():
        cluster = FakeCluster((RAY_NODE,), auto_ready=False)
        cluster.model_bytes["acme--m2"] = MODEL_BYTES
        first = Harness(tmp_path, cluster=cluster, cpu_worker_slots_per_node=4, state_store=store_location)
        await first.controller.start()
        await first.controller.deploy(spec("acme/m1", first.source("m1"), min_instances=2, max_instances=2))
        await first.controller.deploy(spec("acme/m2", first.source("m2", seed=2), min_instances=1))
        await first.tick()
        ready, dead = [w for w in cluster.live_workers() if w.model_id == "acme/m1"]
        [loading] = [w for w in cluster.live_workers() if w.model_id == "acme/m2"]
        ready.finish_loading()
        await settle()
        dead.alive = False  # dies while no controller watches
        orphan = cluster.add_orphan("thaw-worker-stray", "acme/m1")
        # The first controller is killed: no shutdown, its tasks simply end.
        for task in list(first.controller._instances._tasks):
            task.cancel()
        await settle()

        second = Harness(tmp_path, cluster=cluster, cpu_worker_slots_per_node=4, state_store=store_location)
        second.clock.now = first.clock.now
        async with second:
            assert [m["name"] for m in second.controller.list_models()] == ["m1", "m2"]  # specs intact
            assert second.routes("acme/m1") == [ready.instance_id]  # adopted, serving at once
            assert cluster.killed_workers == [orphan.actor_name]
            assert second.records() == {ready.instance_id: InstanceState.READY,
                                        loading.instance_id: InstanceState.LOADING}
            started = cluster.num_started_workers
            loading.finish_loading()
            await settle()
            assert second.routes("acme/m2") == [loading.instance_id]  # adopted while loading, now ready
            await second.tick()  # m1 wants 2: one replacement for the dead one, nothing else
            assert cluster.num_started_workers == started + 1
            assert len([w for w in cluster.live_workers() if w.model_id == "acme/m1"]) == 2
            assert len([w for w in cluster.live_workers() if w.model_id == "acme/m2"]) == 1

    asyncio.run(scenario())


# --- the loop ------------------------------------------------------------------------------------


def test_a_failing_step_is_reported_and_the_rest_of_the_tick_runs(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            h.cluster.list_nodes_failures = 1
            result = await h.tick()
            assert result["errors"] == ["nodes: ConnectionError: GCS unreachable (injected)"]
            assert len(h.routes("acme/m1")) == 1  # autoscale still ran on the nodes it knew
            assert (await h.tick())["errors"] == []

    asyncio.run(scenario())


def test_the_loop_keeps_ticking_through_failures_and_wakes_on_demand(tmp_path):
    async def scenario():
        async with Harness(tmp_path, reconcile_interval_s=60.0) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1")))
            h.cluster.list_nodes_failures = 3
            loop = asyncio.ensure_future(h.controller.run())
            try:
                await eventually(lambda: h.controller.status()["num_ticks"] >= 1, "the first tick")
                while h.controller.status()["num_ticks"] < 4:  # each wake runs one tick, failing or not
                    ticks = h.controller.status()["num_ticks"]
                    h.controller.notify_demand("acme/m1", 1)
                    await eventually(lambda: h.controller.status()["num_ticks"] > ticks, "a tick after a wake")
                assert h.cluster.list_nodes_failures == 0
                await eventually(lambda: len(h.routes("acme/m1")) == 1,
                                 "an instance, although the interval is a minute")
            finally:
                await h.controller.shutdown(stop_workers=True)
                await asyncio.wait_for(loop, 5.0)

    asyncio.run(scenario())


def test_shutdown_stops_workers_and_stores_or_leaves_them(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            await h.controller.deploy(spec("acme/m1", h.source("m1"), min_instances=1))
            await h.tick()
        assert len(h.cluster.live_workers()) == 1 and not h.cluster.stores[NODE].closed  # left for a successor
        h2 = Harness(tmp_path, cluster=h.cluster)
        await h2.controller.start()
        await h2.controller.shutdown(stop_workers=True)
        assert h.cluster.live_workers() == [] and h.cluster.stores[NODE].closed and h2.records() == {}
        with pytest.raises(RuntimeError, match="shut down"):
            h2.controller.notify_demand("acme/m1", 1)

    asyncio.run(scenario())


def test_deploy_refuses_a_context_the_kv_pool_cannot_hold_and_a_spec_pool_makes_it_fit(tmp_path):
    async def scenario():
        # 2 layers x 2 KV heads x head size 16 x 2 (K and V) x 4 bytes (float32): 512 bytes per token.
        async with Harness(tmp_path) as h:
            source = h.source("m1")
            (source / "config.json").write_text(json.dumps({**SERVABLE_CONFIG, "max_position_embeddings": 1 << 22}))
            with pytest.raises(InvalidSpecError) as refused:
                await h.controller.deploy(spec("acme/m1", source))
            assert refused.value.field == "max_model_len"
            assert refused.value.reason == (
                "the model's max_position_embeddings 4194304 needs 2.0 GiB of KV cache (512 bytes per token in "
                "float32), but an instance's KV pool holds 1048576 tokens (512.0 MiB): set kv_cache_bytes to at "
                "least 2147483648, or max_model_len to at most 1048576")
            assert h.controller.list_models() == [] and not (tmp_path / "repo").exists()
            stored = await h.controller.deploy({**spec("acme/m1", source), "kv_cache_bytes": 2 << 30, "max_num_seqs": 8})
            assert (stored["kv_cache_bytes"], stored["max_num_seqs"]) == (2 << 30, 8)
            config = engine_config_for(ModelSpec.from_dict(stored), h.config)
            assert (config.kv_cache_bytes, config.max_num_seqs, config.num_kv_blocks) == (2 << 30, 8, None)

    asyncio.run(scenario())
