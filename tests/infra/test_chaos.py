"""Chaos under load (issue 19): processes die while 32 streams run, and no client notices.

``thaw serve`` as a subprocess with a model on two instances; each wave opens 32 concurrent
streams through the official ``openai`` client (greedy ones, greedy ones with ``stop`` strings
that cut them mid-way, seeded sampled ones), waits until they are under way, and then kills a
part of the platform outright with SIGKILL — not Ray's own ``ray.kill``, and not after freezing
anything first:

1. the worker process of the busier instance (its streams resume on the other instance from the
   tokens their clients have, and the controller replaces it);
2. the controller actor's process (Ray restarts it; the gateway serves on from its routing table);
3. a node store's process (the controller starts a new one);
4. the replacement worker from wave 1 and the controller together.

Every client must receive its complete output: a greedy stream exactly the engine's own (run
offline, one request at a time: no token lost or repeated), with its stop string honoured; a
seeded stream all its tokens; the usage of every stream matching what it received. Afterwards
no request is left ongoing on any instance, the gateway answered no 5xx, and after SIGINT no
process of the platform is left. The figures go to RELIABILITY.md.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.infra.running_platform import DEADLINE_S, RunningPlatform, start_platform, wait_for
from worker import DemoModelConfig, Engine, SamplingParams, write_demo_model

pytestmark = pytest.mark.slow

MODEL = "acme/chaos"
NUM_STREAMS = 32
MAX_TOKENS = 96
MAX_MODEL_LEN = 512
SEEDED_TEMPERATURE = 0.8


@dataclass(frozen=True)
class StreamCase:
    """One client's request: its prompt and sampling, and for greedy ones the reference output."""

    index: int
    prompt: str = field(repr=False)
    kind: str  # "greedy", "stop" or "seeded"
    seed: int | None = None
    stop: tuple[str, ...] = ()
    want_text: str | None = field(default=None, repr=False)
    want_tokens: int | None = None
    want_prompt_tokens: int | None = None
    want_finish: str | None = None


@dataclass
class StreamResult:
    text: str = field(default="", repr=False)
    num_chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None


def build_cases(engine: Engine, wave: int) -> list[StreamCase]:
    """16 greedy, 8 greedy with a stop string taken from the middle of their own output, 8 seeded."""
    cases = []
    for i in range(NUM_STREAMS):
        prompt = f"Wave {wave}, story {i}: once upon a time in a land far away"
        if i < 24:
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            [full] = engine.generate([prompt], greedy)
            if i < 16:
                cases.append(StreamCase(i, prompt, "greedy", want_text=full.text, want_tokens=MAX_TOKENS,
                                        want_prompt_tokens=full.num_prompt_tokens, want_finish="length"))
                continue
            middle = len(full.text) // 2
            stop = full.text[middle:middle + 3]
            if not stop.strip():
                stop = full.text[middle:middle + 6]
            stopped_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
            [cut] = engine.generate([prompt], stopped_params)
            cases.append(StreamCase(i, prompt, "stop", stop=(stop,), want_text=cut.text,
                                    want_tokens=len(cut.output_token_ids),
                                    want_prompt_tokens=cut.num_prompt_tokens, want_finish=cut.finish_reason))
        else:
            cases.append(StreamCase(i, prompt, "seeded", seed=1000 * wave + i, want_tokens=MAX_TOKENS,
                                    want_finish="length"))
    return cases


def run_stream(platform: RunningPlatform, case: StreamCase, started: threading.Semaphore) -> StreamResult:
    result = StreamResult()
    client = platform.client(timeout_s=DEADLINE_S * 2)
    try:
        stream = client.completions.create(
            model=MODEL, prompt=case.prompt, max_tokens=MAX_TOKENS, stream=True,
            temperature=0.0 if case.kind != "seeded" else SEEDED_TEMPERATURE, seed=case.seed,
            stop=list(case.stop) or None, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices:
                result.text += chunk.choices[0].text or ""
                result.finish_reason = chunk.choices[0].finish_reason or result.finish_reason
                result.num_chunks += 1
                if result.num_chunks == 2:
                    started.release()
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
                result.prompt_tokens = chunk.usage.prompt_tokens
    except Exception as exc:  # noqa: BLE001 - reported with the case, the test fails on it below
        result.error = f"{type(exc).__name__}: {exc} (cause: {exc.__cause__!r}) at {time.strftime('%X')}"
    finally:
        if result.num_chunks < 2:
            started.release()  # never block the waiting side on a stream that ended early
    return result


def processes_named(platform: RunningPlatform, title: str) -> list[psutil.Process]:
    """The platform's processes whose title (Ray sets ``ray::Class.method``) starts with `title`."""
    found = []
    for process in platform.processes():
        try:
            if " ".join(process.cmdline()).startswith(title):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def sigkill(process_id: int) -> None:
    os.kill(process_id, signal.SIGKILL)


def ready_instances(platform: RunningPlatform) -> list[dict]:
    return [i for i in platform.status()["instances"] if i["model_id"] == MODEL and i["state"] == "ready"]


def busiest_worker_pid(platform: RunningPlatform) -> int:
    instances = sorted(ready_instances(platform), key=lambda i: -i["num_ongoing_requests"])
    assert instances and instances[0]["pid"] > 0, instances
    return instances[0]["pid"]


def answers_status(platform: RunningPlatform) -> bool:
    result = platform.thaw("status", "--json", check=False)
    if result.returncode != 0:
        print(time.strftime("%X"), "thaw status:", result.stderr.strip()[-300:], flush=True)
    return result.returncode == 0


def kill_controller(platform: RunningPlatform) -> None:
    [controller] = processes_named(platform, "ray::ControllerActor")
    sigkill(controller.pid)


def kill_node_store(platform: RunningPlatform) -> None:
    stores = processes_named(platform, "ray::NodeStoreActor")
    assert stores, "no node store process found"
    sigkill(stores[0].pid)


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    model_dir = write_demo_model(root / "chaos", DemoModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=MAX_MODEL_LEN, init_std=0.1, seed=21))
    with start_platform(root, model_dir, "--num-cpus", "2", "--worker-slots", "2", "--no-calibrate",
                        "--ssd-capacity-gb", "1", "--dram-capacity-gb", "0.25", prefix="chaos") as running:
        running.thaw("deploy", "--name", MODEL, "--source", str(model_dir), "--min-instances", "2",
                     "--max-instances", "2", "--queue-timeout-s", "300", "--max-queued-requests", "256")
        running.references["engine"] = Engine(model_dir)
        yield running


def wave(platform: RunningPlatform, number: int, kill) -> dict[str, int]:
    """Runs 32 streams, kills with `kill` once 8 of them are under way; checks every one."""
    wait_for(lambda: answers_status(platform) and len(ready_instances(platform)) == 2,
             f"two ready instances before wave {number}", timeout_s=DEADLINE_S * 2, interval_s=0.5)
    cases = build_cases(platform.references["engine"], number)
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(run_stream, platform, case, started) for case in cases]
        for _ in range(8):
            assert started.acquire(timeout=DEADLINE_S), "streams did not get under way"
        platform.note_processes()
        kill(platform)
        results = [f.result(timeout=DEADLINE_S * 3) for f in futures]
    for case, result in zip(cases, results):
        # The platform's last output (its processes' logs) with the failure: issue 44's cut stream.
        assert result.error is None, (case, result.error, "".join(platform.output[-60:]))
        assert result.finish_reason == case.want_finish, (case, result)
        assert result.completion_tokens == case.want_tokens, (case, result)
        if case.kind == "seeded":
            assert result.prompt_tokens and result.prompt_tokens > 0
        else:
            assert result.text == case.want_text, (case, result.text, case.want_text)
            assert result.prompt_tokens == case.want_prompt_tokens, case
    return {"streams": len(results), "greedy_exact": sum(c.kind != "seeded" for c in cases)}


def test_streams_survive_a_worker_killed_with_sigkill(platform):
    killed: list[int] = []

    def kill_worker(p: RunningPlatform) -> None:
        killed.append(busiest_worker_pid(p))
        sigkill(killed[0])

    wave(platform, 1, kill_worker)
    # The controller replaces the dead instance: two ready again, neither in the killed process.
    wait_for(lambda: (lambda ready: len(ready) == 2 and killed[0] not in {i["pid"] for i in ready})(
        ready_instances(platform)), "the killed instance to be replaced", timeout_s=DEADLINE_S * 2, interval_s=0.5)


def test_streams_survive_the_controller_killed_with_sigkill(platform):
    wave(platform, 2, kill_controller)
    # Ray restarted it, on the same state: the model and its two instances are still there (a
    # status asked while it restarts fails, and is asked again).
    wait_for(lambda: answers_status(platform), "the restarted controller to answer", interval_s=0.5,
             timeout_s=DEADLINE_S * 2)
    assert len(ready_instances(platform)) == 2


def test_streams_survive_a_node_store_killed_with_sigkill(platform):
    wave(platform, 3, kill_node_store)
    wait_for(lambda: processes_named(platform, "ray::NodeStoreActor"), "a new node store")


def test_streams_survive_a_worker_and_the_controller_killed_together(platform):
    def both(p: RunningPlatform) -> None:
        pid = busiest_worker_pid(p)
        kill_controller(p)
        sigkill(pid)

    wave(platform, 4, both)


def test_afterwards_nothing_is_ongoing_no_5xx_and_nothing_is_left_after_sigint(platform):
    wait_for(lambda: answers_status(platform) and all(i["num_ongoing_requests"] == 0
                                                       for i in platform.status()["instances"]),
             "every instance's ongoing count back to 0", interval_s=0.5, timeout_s=DEADLINE_S * 2)
    request = urllib.request.Request(f"{platform.url}/metrics",
                                     headers={"Authorization": f"Bearer {platform.admin_key}"})
    metrics = urllib.request.urlopen(request, timeout=10).read().decode()
    served = [line for line in metrics.splitlines()
              if line.startswith("thaw_gateway_requests_total{") and f'model="{MODEL}"' in line]
    assert served, "no request counted"
    assert not [line for line in served if 'status="5' in line], served
    ok = sum(float(line.split()[-1]) for line in served if 'status="200"' in line)
    assert ok == 4 * NUM_STREAMS, served  # every status the gateway counted, to tell a 499 from a lost count
    platform.note_processes()
    platform.process.send_signal(signal.SIGINT)
    assert platform.process.wait(DEADLINE_S) == 0, "".join(platform.output[-20:])
    wait_for(lambda: not platform.leftover_pids(), "every process of the platform to exit")
    leftovers = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"thaw-{platform.namespace}.")]
    assert leftovers == [], f"shared memory left behind: {leftovers}"
