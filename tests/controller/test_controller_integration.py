"""The controller as a real Ray actor on a local Ray: real node stores, real workers loading tiny
demo models, real streams -- the issue's "Must show", end to end.

- `test_three_models_on_two_slots_...`: three models share two worker slots; traffic to one
  scales it to its max; a request to a scaled-to-zero model that finds no free slot waits and
  then succeeds; idle models scale to zero after their keep-alive; the controller is killed with
  ``ray.kill`` and a new one on the same state serves on with the same instances and specs,
  and without a single extra worker actor.
- `test_placement_prefers_dram_then_ssd_then_repository_with_real_stores`: one Ray node split
  into three logical nodes (``nodes_per_ray_node=3``: three real node stores, each with its own
  SSD and shared-memory directory, one worker slot each), the model put in DRAM on one and on
  SSD on another: the instances go to the DRAM node, then the SSD node, then the empty one.

The gateway is played by the test: it polls the routing table and reports its queue with
``notify_demand`` while it waits, as the real one does. No sleep synchronises anything: every
wait polls with a deadline. Each test's platform has its own namespace (so its own actors and
shared-memory names); the module ends by checking that no actor, worker or shared-memory
directory of them is left.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import ray

from controller import ControllerConfig, get_controller, node_store_actor_name, start_controller, stop_controller
from storage import RepositoryConfig
from worker import DemoModelConfig, stream_generation, write_demo_model

pytestmark = pytest.mark.slow

TINY_DEMO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=256, init_std=0.1)
ENGINE_DEFAULTS = {"block_size": 4, "num_kv_blocks": 128}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
LOAD = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
DEADLINE_S = 90.0
SHM_ROOT = Path("/dev/shm")
NAMESPACES: list[str] = []
LOG_TO_DRIVER = bool(int(__import__("os").environ.get("THAW_TEST_RAY_LOGS", "0")))


def wait_until(predicate, what: str, timeout_s: float = DEADLINE_S, on_wait=None):
    """Poll until `predicate()` returns something truthy (returned); `on_wait` runs between polls
    (a gateway repeating its queue report). A deadline turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if on_wait is not None:
            on_wait()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def local_ray():
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=LOG_TO_DRIVER, logging_level="ERROR")
    yield
    leftovers = sorted((entry["namespace"], entry["name"]) for entry in ray.util.list_named_actors(True)
                       if entry["namespace"] in NAMESPACES)
    shm = sorted(p.name for p in SHM_ROOT.iterdir() if any(p.name.startswith(f"thaw-{ns}.") for ns in NAMESPACES))
    for namespace, name in leftovers:  # clean up, then fail: the next run must not inherit them
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    if started_here:
        ray.shutdown()
    assert leftovers == [], f"actors left behind: {leftovers}"
    assert shm == [], f"shared-memory directories left behind: {shm}"


@pytest.fixture(scope="module")
def demo_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo-models")
    return {name: write_demo_model(root / name, DemoModelConfig(seed=seed, **TINY_DEMO))
            for seed, name in enumerate(("m1", "m2", "m3"), start=1)}


def platform_config(tmp_path: Path, **overrides) -> ControllerConfig:
    namespace = f"thaw-it-{uuid.uuid4().hex[:8]}"
    NAMESPACES.append(namespace)
    fields = dict(state_dir=tmp_path / "state", repository=RepositoryConfig(str(tmp_path / "repo")),
                  namespace=namespace, calibrate=False, cpu_worker_slots_per_node=2, ssd_capacity_bytes=1 << 30,
                  dram_capacity_bytes=256 << 20, engine_defaults=ENGINE_DEFAULTS, reconcile_interval_s=0.2,
                  report_timeout_s=10.0, drain_timeout_s=5.0, queue_report_ttl_s=3.0)
    fields.update(overrides)
    return ControllerConfig(**fields)


def model_spec(name: str, source: Path, **autoscaling) -> dict:
    policy = dict(min_instances=0, max_instances=1, target_ongoing_requests=1, upscale_delay_s=0.0,
                  downscale_delay_s=0.5, keep_alive_s=2.0)
    policy.update(autoscaling)
    return {"name": f"acme/{name}", "source": str(source), "resources": {"num_cpus": 0.5}, "autoscaling": policy}


def routes(controller, model_id: str) -> list[dict]:
    return ray.get(controller.routing_table.remote(), timeout=30)[1].get(model_id, [])


def where(route: dict) -> dict:
    """A route without its load figure (which moves with every request)."""
    return {key: value for key, value in route.items() if key != "num_ongoing_requests"}


def worker_actor_names(namespace: str) -> list[str]:
    return sorted(entry["name"] for entry in ray.util.list_named_actors(True)
                  if entry["namespace"] == namespace and entry["name"].startswith("thaw-worker-"))


def spare_names(namespace: str, *serving: str) -> set[str]:
    """Spare workers' actor names (model-less processes kept for cold starts), less `serving`."""
    return {name for name in worker_actor_names(namespace) if name.startswith("thaw-worker-spare-")} - set(serving)


async def generate(route: dict, request_id: str, prompt: str = "The quick brown fox", params=GREEDY) -> list:
    handle = ray.get_actor(route["actor_name"], namespace=route["namespace"])
    return [chunk async for chunk in stream_generation(handle, request_id, prompt, params)]


def every(interval_s: float, action):
    """`action`, at most once per `interval_s` (a gateway repeats its queue report about once a second)."""
    last = [time.monotonic()]

    def maybe() -> None:
        if time.monotonic() - last[0] >= interval_s:
            last[0] = time.monotonic()
            action()

    return maybe


def request_through_gateway(controller, model_id: str, request_id: str) -> tuple[list, float]:
    """What the gateway does for a model with no ready instance: report the queued request
    (again while it waits), then stream from the first instance that appears. Returns the
    chunks and how long the request waited."""
    start = time.monotonic()
    ray.get(controller.notify_demand.remote(model_id, 1, "test-gateway"), timeout=30)
    [route, *_] = wait_until(lambda: routes(controller, model_id), f"an instance of {model_id}",
                             on_wait=every(1.0, lambda: controller.notify_demand.remote(model_id, 1, "test-gateway")))
    waited_s = time.monotonic() - start
    chunks = asyncio.run(generate(route, request_id))
    ray.get(controller.notify_demand.remote(model_id, 0, "test-gateway"), timeout=30)
    return chunks, waited_s


def start_and_wait(config: ControllerConfig):
    handle = start_controller(config)
    ray.get(handle.ping.remote(), timeout=DEADLINE_S)
    return handle


async def keep_busy(controller, model_id: str, num_streams: int, stop: asyncio.Event) -> int:
    """`num_streams` requests in flight on the model at all times, until `stop`; returns how many ran."""
    done = 0

    async def one_stream(stream_index: int) -> None:
        nonlocal done
        while not stop.is_set():
            _, table = await controller.routing_table.remote()
            ready = table.get(model_id, [])
            chunks = await generate(ready[done % len(ready)], f"load-{stream_index}-{done}", params=LOAD)
            assert chunks[-1].finish_reason == "length"
            done += 1

    await asyncio.gather(*(one_stream(i) for i in range(num_streams)))
    return done


def test_three_models_on_two_slots_scale_wait_restart(local_ray, demo_models, tmp_path):
    # Slot reclaims off: this is the waiting path (with them, m2 would empty one of m1's two
    # instances at once; that path is tested in tests/controller/test_slot_reclaimer.py).
    config = platform_config(tmp_path, slot_reclaim=None)
    controller = start_and_wait(config)
    try:
        for name, keep_alive_s in (("m1", 2.0), ("m2", 60.0), ("m3", 2.0)):
            max_instances = 2 if name == "m1" else 1
            ray.get(controller.deploy.remote(model_spec(name, demo_models[name], max_instances=max_instances,
                                                        keep_alive_s=keep_alive_s)), timeout=60)
        specs = ray.get(controller.list_models.remote(), timeout=30)
        assert [s["name"] for s in specs] == ["m1", "m2", "m3"]
        assert ray.get(controller.routing_table.remote(), timeout=30)[1] == {}  # min 0: nothing runs

        # A first request to m1 (cold): it waits for an instance, then succeeds.
        chunks, _ = request_through_gateway(controller, "acme/m1", "m1-first")
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 8

        # Traffic on m1: three streams in flight on a target of one per instance -> its max, two.
        # While it holds both slots, a request for m2 (at zero) arrives: it cannot be placed yet.
        async def load_m1_and_ask_for_m2() -> tuple[dict, dict, dict, int]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(keep_busy(controller, "acme/m1", 3, stop))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE_S
            while len((await controller.routing_table.remote())[1].get("acme/m1", [])) < 2:
                assert loop.time() < deadline and not load.done(), "m1 did not scale to 2 under load"
                await asyncio.sleep(0.05)
            m1, status = await controller.get_model.remote("acme/m1"), await controller.status.remote()
            await controller.notify_demand.remote("acme/m2", 1, "test-gateway")
            while (await controller.get_model.remote("acme/m2"))["last_placement"] is None:
                assert loop.time() < deadline and not load.done(), "m2's request was not considered"
                await asyncio.sleep(0.05)
            m2 = await controller.get_model.remote("acme/m2")
            stop.set()
            return m1, status, m2, await load

        m1, status, m2, num_load_requests = asyncio.run(load_m1_and_ask_for_m2())
        assert num_load_requests > 0
        assert m1["num_desired_instances"] == 2 and len(m1["instances"]) == 2
        [node] = status["nodes"]
        assert (node["num_slots"], node["num_free_slots"]) == (2, 0)  # both slots are m1's now
        scale_ups = [d["reason"] for d in status["recent_decisions"]
                     if d["kind"] == "scale" and d["model_id"] == "acme/m1" and d["num_instances"] == 2]
        assert scale_ups and scale_ups[0].startswith("scale up 1 -> 2:")
        assert m2["num_desired_instances"] == 1 and m2["instances"] == []
        assert m2["last_placement"]["reason"].startswith("no free slot: none of 1 nodes has 1 free worker slot; "
                                                         "no idle instance to evict: ")

        # The m2 request waits (its gateway repeating the report), then succeeds once m1, idle
        # again, gives up a slot.
        assert routes(controller, "acme/m2") == []
        chunks, _ = request_through_gateway(controller, "acme/m2", "m2-cold")
        assert chunks[-1].finish_reason == "length"
        assert ray.get(controller.get_model.remote("acme/m2"), timeout=30)["last_placement"]["reason"].startswith(
            "soonest ready:")
        # m1, idle, scales to zero after its keep-alive; m3 was never asked for and never ran.
        wait_until(lambda: not ray.get(controller.get_model.remote("acme/m1"), timeout=30)["instances"],
                   "m1 to scale to zero")
        m1 = ray.get(controller.get_model.remote("acme/m1"), timeout=30)
        assert m1["num_desired_instances"] == 0 and routes(controller, "acme/m1") == []
        assert ray.get(controller.get_model.remote("acme/m3"), timeout=30)["instances"] == []
        reasons = [d["reason"] for d in ray.get(controller.status.remote(), timeout=30)["recent_decisions"]
                   if d["kind"] == "scale" and d["model_id"] == "acme/m1"]
        assert reasons[-1].startswith("scale to zero 1 -> 0: idle") and reasons[-1].endswith(">= keep_alive_s 2")

        # Kill the controller mid-flight; a new one on the same state serves on.
        [m2_route] = routes(controller, "acme/m2")
        m2_worker = m2_route["actor_name"]
        # One serving worker plus the node's spare (a worker process with no model yet, which may
        # itself have been what m2 was assigned to, named thaw-worker-spare-...).
        spares_before = wait_until(lambda: spare_names(config.namespace, m2_worker), "one spare worker")
        assert len(spares_before) == 1 and m2_worker in worker_actor_names(config.namespace)
        ray.kill(controller, no_restart=True)
        wait_until(lambda: not _controller_exists(config.namespace), "the killed controller's name to be free")
        controller = start_and_wait(config)
        assert ray.get(controller.list_models.remote(), timeout=30) == specs  # specs intact
        assert [where(r) for r in routes(controller, "acme/m2")] == [where(m2_route)]  # adopted, routed at once
        # No duplicate worker: m2's worker was adopted; the old spare, which no record names, was
        # ended as an orphan and exactly one new spare took its place.
        wait_until(lambda: (lambda spares: len(spares) == 1 and not spares & spares_before)(
            spare_names(config.namespace, m2_worker)), "the old spare replaced by exactly one new one")
        assert m2_worker in worker_actor_names(config.namespace)
        chunks = asyncio.run(generate(m2_route, "m2-after-restart"))
        assert chunks[-1].finish_reason == "length"
        # ... and it still starts models: m3, at zero, waits and then serves.
        chunks, _ = request_through_gateway(controller, "acme/m3", "m3-cold")
        assert chunks[-1].finish_reason == "length"
        m3_workers = [r["actor_name"] for r in routes(controller, "acme/m3")]
        assert len(m3_workers) == 1
        assert set(worker_actor_names(config.namespace)) \
            - spare_names(config.namespace, m2_worker, *m3_workers) == {m2_worker, *m3_workers}
    finally:
        stop_controller(controller, stop_workers=True)
    assert worker_actor_names(config.namespace) == []


def _controller_exists(namespace: str) -> bool:
    try:
        get_controller(namespace=namespace)
    except ValueError:
        return False
    return True


def test_placement_prefers_dram_then_ssd_then_repository_with_real_stores(local_ray, demo_models, tmp_path):
    config = platform_config(tmp_path, nodes_per_ray_node=3, cpu_worker_slots_per_node=1)
    controller = start_and_wait(config)
    try:
        ray.get(controller.deploy.remote(model_spec("m1", demo_models["m1"], max_instances=3, keep_alive_s=60.0)),
                timeout=60)
        def all_three_reporting() -> list[str] | None:
            found = [n["node_id"] for n in ray.get(controller.status.remote(), timeout=30)["nodes"]
                     if n["store_connected"] and n["reported_at"]]
            return found if len(found) == 3 else None  # not the first to report: a busy machine is slow

        nodes = wait_until(all_three_reporting, "three node stores reporting")
        assert len(nodes) == 3
        # Put the model in DRAM on the second node and on SSD only on the third, with their real stores.
        in_dram, on_ssd, empty = nodes[1], nodes[2], nodes[0]
        ray.get(ray.get_actor(node_store_actor_name(in_dram), namespace=config.namespace)
                .ensure.remote("acme--m1", "dram"), timeout=DEADLINE_S)
        ray.get(ray.get_actor(node_store_actor_name(on_ssd), namespace=config.namespace)
                .ensure.remote("acme--m1", "ssd"), timeout=DEADLINE_S)

        def holdings() -> dict[str, set[str]]:
            status = ray.get(controller.status.remote(), timeout=30)
            return {n["node_id"]: {t["tier"] for t in n["tiers"] for e in t["entries"] if e["model"] == "acme--m1"}
                    for n in status["nodes"]}

        wait_until(lambda: holdings() == {in_dram: {"dram", "ssd"}, on_ssd: {"ssd"}, empty: set()},
                   "the controller to see the stores' holdings")

        ray.get(controller.notify_demand.remote("acme/m1", 3, "test-gateway"), timeout=30)
        wait_until(lambda: len(routes(controller, "acme/m1")) == 3, "three ready instances",
                   on_wait=every(1.0, lambda: controller.notify_demand.remote("acme/m1", 3, "test-gateway")))
        status = ray.get(controller.status.remote(), timeout=30)
        placements = [d for d in status["recent_decisions"] if d["kind"] == "placement"]
        assert [(p["node_id"], p["tier"]) for p in placements] == [
            (in_dram, "dram"), (on_ssd, "ssd"), (empty, "repository")]
        first = placements[0]["estimates"]
        assert [(e["node_id"], e["tier"]) for e in first] == [(in_dram, "dram"), (on_ssd, "ssd"), (empty, "repository")]
        assert first[0]["ready_s"] < first[1]["ready_s"] < first[2]["ready_s"]
        instances = {i["node_id"]: i for i in status["instances"]}
        assert instances[in_dram]["tier"] == "dram"  # read from shared memory
        dram_entry = next(e for n in status["nodes"] if n["node_id"] == in_dram for t in n["tiers"]
                          if t["tier"] == "dram" for e in t["entries"] if e["model"] == "acme--m1")
        assert dram_entry["pinned"]  # kept there while a worker uses it
        for route in routes(controller, "acme/m1"):
            chunks = asyncio.run(generate(route, f"placed-{route['node_id']}"))
            assert chunks[-1].finish_reason == "length"
    finally:
        stop_controller(controller, stop_workers=True)
    assert worker_actor_names(config.namespace) == []
