"""The embedded default, as a new user meets it: ``thaw serve --demo`` with its default worker
slots sharing a worker memory budget (a share of the machine's RAM), then three more small models
deployed with ``thaw deploy``, then requests alternating between all four through the official
``openai`` client. After each model has served once, an interleaved round loads nothing: the four
instances stay resident side by side (memory is the slot), no instance starts or stops, no
eviction happens, every worker keeps its process, and ``thaw status`` shows the node's worker
memory shared by the four. Stopped with SIGINT at the end. (Models taking turns on one slot, by
eviction, are `test_slot_sharing_platform`'s.)
"""

from __future__ import annotations

import pytest

from tests.infra.running_platform import DEADLINE_S, start_platform, wait_for
from tests.infra.test_platform_e2e import CHAT
from worker import DemoModelConfig, write_demo_model

pytestmark = pytest.mark.slow

DEPLOYED = ("acme/second", "acme/third", "acme/fourth")


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-default")
    model_dir = write_demo_model(root / "small", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=512, init_std=0.1, seed=9))
    # The defaults but for where it keeps its state and listens (and no bandwidth calibration).
    with start_platform(root, model_dir, "--num-cpus", "2", "--no-calibrate", "--ssd-capacity-gb", "1",
                        "--dram-capacity-gb", "0.25", prefix="dd") as running:
        yield running


def ask(client, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), model


def test_the_demo_and_three_deployed_models_stay_resident_side_by_side(platform):
    [node] = platform.status()["nodes"]
    assert node["num_slots"] == 4 and node["worker_memory"]["budget_bytes"] > 0  # the default
    for name in DEPLOYED:
        platform.thaw("deploy", "--name", name, "--source", str(platform.model_dir))
    models = ("demo/tiny", *DEPLOYED)
    client = platform.client(timeout_s=DEADLINE_S)
    for model in models:  # each model's first request starts its instance
        ask(client, model)
    # An instance's pid arrives with its worker's first stats report, a tick after it is ready.
    status = wait_for(lambda: (lambda s: s if all(i["pid"] for i in s["instances"]) else None)(platform.status()),
                      "every instance's worker pid reported")
    before = {i["instance_id"]: i["pid"] for i in status["instances"]}
    assert len(before) == 4, "\n".join(f"{d['kind']} {d.get('model_id')} {d.get('reason')}"
                                        for d in status["recent_decisions"])

    for _ in range(2):  # interleaved rounds: nothing loads
        for model in models:
            ask(client, model)
    status = platform.status()
    assert {i["instance_id"]: i["pid"] for i in status["instances"]} == before
    assert all(i["state"] == "ready" for i in status["instances"])
    assert [d for d in status["recent_decisions"] if d["kind"] in ("eviction", "preemption")] == []
    assert sum(d["kind"] == "placement" and d["node_id"] is not None for d in status["recent_decisions"]) == 4
    [node] = status["nodes"]
    memory = node["worker_memory"]
    assert sorted(i["model_id"] for i in memory["instances"]) == sorted(models)
    assert memory["used_bytes"] == sum(i["memory_bytes"] for i in memory["instances"]) <= memory["budget_bytes"]
    text = platform.thaw("status").stdout
    assert "WORKER MEMORY" in text and "(4 inst.)" in text
