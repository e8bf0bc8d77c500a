"""The whole platform, end to end, as a user runs it: ``thaw serve`` as a subprocess (local Ray,
controller, node stores, workers, Ray Serve gateway), operated with the ``thaw`` CLI and called
with the official ``openai`` client over real HTTP.

One platform for the module, on a free port with a temporary state directory and a namespace of
its own; the tests run in file order against it (the demo model, a model deployed through the
CLI, tenants and keys, ``thaw status``, a client that leaves, scale to zero and back) and the
last one stops it with SIGINT and checks that nothing is left: no process it started, no
shared-memory directory. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.infra.running_platform import DEADLINE_S, RunningPlatform, start_platform, wait_for
from worker import DemoModelConfig, Engine, SamplingParams, write_demo_model

pytestmark = pytest.mark.slow

MODEL = "acme/tiny"
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "What is the capital?"}]
MAX_TOKENS = 10
MAX_MODEL_LEN = 2048
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def series(metrics: str, name: str, **labels: str) -> list[float]:
    """The values of `name`'s samples that carry `labels` (and maybe others: replica, node)."""
    found = []
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            found.append(float(line.rsplit(" ", 1)[1]))
    return found


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Iterator[RunningPlatform]:
    root = tmp_path_factory.mktemp("e2e")
    model_dir = write_demo_model(root / "tiny", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=MAX_MODEL_LEN, init_std=0.1, seed=5))
    with start_platform(root, model_dir, "--num-cpus", "2", "--worker-slots", "2", "--no-calibrate",
                        "--ssd-capacity-gb", "1", "--dram-capacity-gb", "0.25") as running:
        engine = Engine(model_dir)  # the references: the engine run directly, one request at a time
        running.references = {"completion": engine.generate([PROMPT], GREEDY)[0],
                              "chat": engine.generate([CHAT], GREEDY)[0], "tokenizer": engine.tokenizer}
        yield running


def test_serve_prints_the_admin_key_once_and_the_demo_model_answers(platform):
    banner = "".join(platform.output)
    assert platform.admin_key in banner and "shown once" in banner and "demo/tiny" in banner
    with urllib.request.urlopen(f"{platform.url}/readyz", timeout=10) as response:
        assert response.status == 200
    reply = platform.client(timeout_s=DEADLINE_S).chat.completions.create(
        model="demo/tiny", messages=CHAT, max_tokens=4)
    assert reply.usage.completion_tokens <= 4 and reply.choices[0].message.role == "assistant"


def test_a_model_deployed_with_the_cli_answers_the_openai_client_like_the_engine(platform):
    platform.thaw("deploy", "--name", MODEL, "--source", str(platform.model_dir), "--min-instances", "1",
                  "--max-instances", "1", "--keep-alive-s", "1", "--queue-timeout-s", "120")
    assert [m["name"] for m in json.loads(platform.thaw("list", "--json").stdout)] == ["tiny", "tiny"]
    client = platform.client()
    want = platform.references["completion"]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})  # waits for the instance to load
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.num_prompt_tokens, MAX_TOKENS)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    want = platform.references["chat"]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text and got.usage.prompt_tokens == want.num_prompt_tokens
    per_model = openai.OpenAI(base_url=f"{platform.url}/models/{MODEL}/v1", api_key=platform.admin_key,
                              max_retries=0, timeout=DEADLINE_S)
    chunks = list(per_model.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    with pytest.raises(openai.BadRequestError) as info:  # the worker's refusal, through Ray, names the field
        client.completions.create(model=MODEL, prompt="word " * (MAX_MODEL_LEN + 10), max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens <= 2


def test_tenants_see_and_call_only_their_models(platform):
    for tenant in ("acme", "other"):
        platform.thaw("tenants", "create", tenant)
        platform.tenant_keys[tenant] = platform.thaw("keys", "create", tenant).stdout.strip()
    acme = platform.client(platform.tenant_keys["acme"])
    assert [m.id for m in acme.models.list()] == [MODEL]
    assert acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens <= 2
    other = platform.client(platform.tenant_keys["other"])
    assert other.models.list().data == []
    with pytest.raises(openai.PermissionDeniedError):
        other.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="other/missing", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        platform.client("thaw_0123456789abcdef_" + "x" * 43).models.list()
    request = urllib.request.Request(f"{platform.url}/admin/status",
                                     headers={"Authorization": f"Bearer {platform.tenant_keys['acme']}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{platform.url}/v1/models", timeout=10)
    assert info.value.code == 401


def test_status_shows_models_instances_checkpoints_and_estimates(platform):
    wait_for(lambda: platform.model_status(MODEL)["num_ready_instances"] == 1, "acme/tiny ready in status")
    text = platform.thaw("status").stdout
    for part in ("MODELS", MODEL, "demo/tiny", "INSTANCES", "ready", "NODES", "CHECKPOINTS", "acme--tiny",
                 "LOAD ESTIMATES"):
        assert part in text, part
    status = platform.status()
    instance = next(i for i in status["instances"] if i["model_id"] == MODEL)
    tiers = {t["tier"]: [e["model"] for e in t["entries"]] for n in status["nodes"] for t in n["tiers"]}
    assert "acme--tiny" in tiers["ssd"] and instance["tier"] in ("dram", "ssd")
    request = urllib.request.Request(f"{platform.url}/metrics",  # needs the admin key (or the scrape token)
                                     headers={"Authorization": f"Bearer {platform.admin_key}"})
    metrics = urllib.request.urlopen(request, timeout=10).read().decode()
    assert f'thaw_model_instances{{model="{MODEL}"}} 1.0' in metrics
    # A gateway replica labels its request series with itself and its node (replicas share a scrape).
    assert series(metrics, "thaw_gateway_requests_total", endpoint="completions", model=MODEL, status="200")


def test_a_client_that_leaves_aborts_its_request_on_the_worker(platform):
    def tokens_so_far() -> int:
        return next(i for i in platform.status()["instances"] if i["model_id"] == MODEL)["num_generated_tokens"]

    before = tokens_so_far()
    limit = MAX_MODEL_LEN - 64
    stream = platform.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit, stream=True,
                                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    stream.close()  # the client goes away mid-stream
    platform.note_processes()
    wait_for(lambda: platform.model_status(MODEL)["num_ongoing_requests"] == 0, "the worker to drop the request")
    # The controller's stats lag one tick: give them two more, then the count must have stopped short.
    ticks = platform.status()["num_ticks"]
    wait_for(lambda: platform.status()["num_ticks"] >= ticks + 2, "two reconcile ticks")
    assert tokens_so_far() - before < limit // 2


def test_scale_to_zero_then_a_request_waits_for_the_cold_start_and_succeeds(platform):
    platform.thaw("scale", MODEL, "--min", "0")
    wait_for(lambda: (lambda m: m["num_ready_instances"] + m["num_loading_instances"] == 0)(
        platform.model_status(MODEL)), "acme/tiny scaled to zero")
    assert not any(i["model_id"] == MODEL for i in platform.status()["instances"])
    start = time.monotonic()
    got = platform.client(platform.tenant_keys["acme"]).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == platform.references["completion"].text
    assert time.monotonic() - start < DEADLINE_S
    request = urllib.request.Request(f"{platform.url}/metrics",  # needs the admin key (or the scrape token)
                                     headers={"Authorization": f"Bearer {platform.admin_key}"})
    metrics = urllib.request.urlopen(request, timeout=10).read().decode()
    queued = series(metrics, "thaw_queue_time_seconds_sum", model=MODEL)
    assert queued and sum(queued) > 0  # it waited in the cold model's queue
    platform.note_processes()


def test_sigint_stops_everything_it_started(platform):
    platform.note_processes()
    assert platform.pids, "the platform's processes were not found"
    platform.process.send_signal(signal.SIGINT)
    assert platform.process.wait(DEADLINE_S) == 0, "".join(platform.output[-20:])
    wait_for(lambda: not [pid for pid in platform.pids if psutil.pid_exists(pid)
                          and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE],
             "every process of the platform to exit")
    assert not (platform.state_dir / "gateway_url").exists()
    leftovers = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"thaw-{platform.namespace}.")]
    assert leftovers == [], f"shared memory left behind: {leftovers}"
    assert "[thaw] stopped" in "".join(platform.output)
