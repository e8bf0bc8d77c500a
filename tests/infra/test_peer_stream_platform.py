"""Scale-out by streaming on a real platform: a real controller on a local Ray with three logical
nodes. The model runs on one; scaled to three, the new instances land on the other nodes, which
hold no copy of the checkpoint, so the controller streams the weights from the running instance
to a chain of the two (real worker actors, a real gloo stream; the first receiver forwards to the
second) instead of waiting for the repository. The new instances are routed while their layers
land, end with every layer in and their node's copy handed over as the fallback, and their greedy
output equals the first instance's token for token."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import ray

from controller import ControllerConfig, start_controller
from storage import RepositoryConfig
from tests.infra.platform_teardown import stop_platform
from worker import DemoModelConfig, SamplingParams, stream_generation, write_demo_model

pytestmark = pytest.mark.slow

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MODEL = "acme/streamed"
DEADLINE_S = 120.0


def poll(predicate, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.1)
    return result


def greedy_tokens(instance: dict, namespace: str, prompt: str) -> list[int]:
    handle = ray.get_actor(instance["actor_name"], namespace=namespace)

    async def run():
        return [t async for chunk in stream_generation(handle, f"req-{uuid.uuid4().hex[:6]}", prompt, GREEDY)
                for t in chunk.token_ids]

    return asyncio.run(run())


def test_new_nodes_stream_their_weights_from_the_running_instance_in_a_chain(tmp_path):
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    model_dir = write_demo_model(tmp_path / "demo", TINY_DEMO)
    config = ControllerConfig(
        state_dir=tmp_path / "state", repository=RepositoryConfig(str(tmp_path / "repo")),
        namespace=f"thaw-ps-{uuid.uuid4().hex[:8]}", calibrate=False, cpu_worker_slots_per_node=1,
        nodes_per_ray_node=3, spare_workers_per_node=0, ssd_capacity_bytes=1 << 30, dram_capacity_bytes=256 << 20,
        reconcile_interval_s=0.2, engine_defaults={"block_size": 4, "num_kv_blocks": 128}, report_timeout_s=10.0)
    controller = start_controller(config, name="thaw-controller-ps")
    try:
        ray.get(controller.ping.remote(), timeout=DEADLINE_S)
        policy = dict(min_instances=1, max_instances=3, upscale_delay_s=0.0, keep_alive_s=600.0)
        ray.get(controller.deploy.remote({"name": MODEL, "source": str(model_dir), "resources": {"num_cpus": 0.5},
                                          "autoscaling": policy}), timeout=60)

        def instances():
            return ray.get(controller.status.remote(), timeout=30)["instances"]

        [first] = poll(lambda: [i for i in instances() if i["state"] == "ready"] or None, "the first instance")
        ray.get(controller.scale.remote(MODEL, min_instances=3), timeout=30)

        def new_ready():
            ready = [i for i in instances() if i["instance_id"] != first["instance_id"] and i["state"] == "ready"]
            return ready if len(ready) == 2 else None

        new = poll(new_ready, "both new instances ready")
        assert len({first["node_id"], *(i["node_id"] for i in new)}) == 3  # one per node
        for instance in new:  # one stream from the first instance, to a chain of the two
            assert instance["load_path"]["kind"] == "stream", instance["load_path"]
            assert instance["load_path"]["source_instance_id"] == first["instance_id"]
            assert "repository is the fallback" in instance["load_path"]["reason"]
            assert "of a chain of 2" in instance["load_path"]["reason"]

        prompts = ["the cat sat on the", "a dog ran far"]
        want = [greedy_tokens(first, config.namespace, p) for p in prompts]
        for instance in new:  # possibly while layers land
            assert [greedy_tokens(instance, config.namespace, p) for p in prompts] == want
        assert all(len(t) == GREEDY.max_tokens for t in want)

        for instance in new:
            done = poll(lambda: next((i for i in instances() if i["instance_id"] == instance["instance_id"]
                                      and i["weights_resident"] and i["tier"] is not None), None),
                        "every layer in and the node's copy handed over")
            assert done["tier"] in ("dram", "ssd")
            handle = ray.get_actor(instance["actor_name"], namespace=config.namespace)
            read = ray.get(handle.stats.remote(), timeout=30).weights_read
            assert f"streamed from instance {first['instance_id']}" in read and "failed" not in read, read
        decisions = ray.get(controller.status.remote(), timeout=30)["recent_decisions"]
        streamed = {d.get("instance_id") for d in decisions if d["kind"] == "load_path"}
        assert streamed == {i["instance_id"] for i in new}
        assert not any(d["kind"] == "fallback_unavailable" for d in decisions)
    finally:
        leftovers = stop_platform(controller, config.namespace)
        if started_here:
            ray.shutdown()
    assert leftovers == []
