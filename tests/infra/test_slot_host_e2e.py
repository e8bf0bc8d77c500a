"""Slot hosts on the real platform (issue 38, Build 1): ``thaw serve --demo --models-per-process 4``
(its default slots sharing a worker memory budget) and two more models deployed; each serves
through the official ``openai`` client, all three live in one warm worker process (the same pid,
`hosted`), the deployed models' greedy output is exactly what the engine gives run directly, and
``thaw status`` counts the host's instances. Stopped with SIGINT at the end."""

from __future__ import annotations

import os
import signal

import pytest

from tests.infra.running_platform import DEADLINE_S, start_platform, wait_for
from worker import DemoModelConfig, Engine, SamplingParams, write_demo_model

pytestmark = pytest.mark.slow

DEPLOYED = ("acme/left", "acme/right")
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("slot-host")
    model_dir = write_demo_model(root / "small", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=512, init_std=0.1, seed=11))
    with start_platform(root, model_dir, "--num-cpus", "2", "--no-calibrate", "--ssd-capacity-gb", "1",
                        "--dram-capacity-gb", "0.25", "--models-per-process", "4", prefix="sh") as running:
        yield running


def test_the_demo_and_two_deployed_models_share_one_warm_process_and_serve_exactly(platform):
    expected = Engine(platform.model_dir).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].text
    for name in DEPLOYED:
        platform.thaw("deploy", "--name", name, "--source", str(platform.model_dir))
    client = platform.client(timeout_s=DEADLINE_S)
    chat = client.chat.completions.create(model="demo/tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    for name in DEPLOYED:
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].finish_reason == "length"
        assert completion.choices[0].text == expected, name
    status = wait_for(lambda: (lambda s: s if len(s["instances"]) == 3 and all(i["pid"] for i in s["instances"])
                               else None)(platform.status()), "every instance's worker pid reported")
    instances = status["instances"]
    assert all(i["hosted"] and i["state"] == "ready" for i in instances), instances
    assert len({i["pid"] for i in instances}) == 1 and len({i["actor_name"] for i in instances}) == 1
    [counts] = status["spare_workers"].values()
    assert counts["hosted"] == 3
    [host] = [h for h in status["hosts"] if h["instances"]]
    assert host["actor_name"] == instances[0]["actor_name"] and host["warm"]
    assert sorted(i["model_id"] for i in host["instances"]) == sorted(["demo/tiny", *DEPLOYED])
    assert host["memory_bytes"] == sum(i["memory_bytes"] for i in instances) > 0
    text = platform.thaw("status").stdout
    assert "SLOT HOSTS" in text and host["actor_name"] in text
    assert status["worker_processes_started"]["instances"] == 0  # none needed a process of its own


def test_a_killed_host_takes_its_models_with_it_and_they_come_back(platform):
    """SIGKILL the host's process: every model it held answers again (replaced by the controller,
    in processes of their own until a new host is warm), none of them in the dead process."""
    status = platform.status()
    [old_pid] = {i["pid"] for i in status["instances"]}
    os.kill(old_pid, signal.SIGKILL)
    client = platform.client(timeout_s=DEADLINE_S)
    for name in DEPLOYED:
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].finish_reason == "length", name
    status = wait_for(lambda: (lambda s: s if {i["model_id"] for i in s["instances"]} >= set(DEPLOYED)
                               and all(i["pid"] for i in s["instances"]) else None)(platform.status()),
                      "the deployed models' new instances reported")
    assert old_pid not in {i["pid"] for i in status["instances"]}
    assert any(d["kind"] == "died" for d in status["recent_decisions"])
