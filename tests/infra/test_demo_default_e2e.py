"""The embedded default, as a new user meets it: ``thaw serve --demo`` with its default single worker
slot, then a second model deployed with ``thaw deploy``, then requests alternating between the
two models through the official ``openai`` client. Every request succeeds (the models take
turns on the slot: each idle instance is evicted for the other's waiting request), and
``thaw status`` shows the evictions. Stopped with SIGINT at the end.
"""

from __future__ import annotations

import pytest

from tests.infra.running_platform import DEADLINE_S, start_platform
from tests.infra.test_platform_e2e import CHAT
from worker import DemoModelConfig, write_demo_model

pytestmark = pytest.mark.slow

SECOND = "acme/second"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-default")
    model_dir = write_demo_model(root / "second", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=512, init_std=0.1, seed=9))
    # The defaults but for where it keeps its state and listens (and no bandwidth calibration).
    with start_platform(root, model_dir, "--num-cpus", "2", "--no-calibrate", "--ssd-capacity-gb", "1",
                        "--dram-capacity-gb", "0.25", prefix="dd") as running:
        yield running


def test_a_second_model_on_the_default_single_slot_takes_turns_with_the_demo_model(platform):
    [node] = platform.status()["nodes"]
    assert node["num_slots"] == 1  # the default
    platform.thaw("deploy", "--name", SECOND, "--source", str(platform.model_dir))
    client = platform.client(timeout_s=DEADLINE_S)
    for turn in range(3):
        for model in ("demo/tiny", SECOND):
            chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), (turn, model)
    status = platform.status()
    evictions = [d for d in status["recent_decisions"] if d["kind"] == "eviction"]
    assert len(evictions) >= 5  # every turn after the first took the slot from the other model's idle instance
    assert status["slot_sharing"]["counts"]["evictions"] == len(evictions)
    text = platform.thaw("status").stdout
    assert "SLOTS" in text and "SLOT DECISIONS" in text and "eviction" in text
