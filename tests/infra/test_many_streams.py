"""A thousand concurrent streams (issue 19): all complete, none gets a 5xx, nothing leaks.

``thaw serve`` as a subprocess, with a model configured to queue that many requests
(``--max-queued-requests 1000``; with the defaults most of them would get a clean 429). The
official ``openai`` async client opens 1,000 streams at once; each must end with all its
tokens and its usage. This is done three times, and after each round the gateway's processes (the
Serve proxy and the gateway replica) are measured: the last round must leave their open file
descriptors and resident memory about where the one before left them, so a long-running gateway
does not leak a socket or a buffer per request. The figures are recorded in RELIABILITY.md.
"""

from __future__ import annotations

import asyncio

import openai
import psutil
import pytest

from tests.infra.running_platform import DEADLINE_S, RunningPlatform, start_platform, wait_for
from worker import DemoModelConfig, write_demo_model

pytestmark = pytest.mark.slow

MODEL = "acme/crowd"
NUM_STREAMS = 1000
MAX_TOKENS = 8
# A socket or a few buffers may stay pooled; one per request would be hundreds.
FD_SLACK = 32
RSS_SLACK_BYTES = 64 << 20


def gateway_processes(platform: RunningPlatform) -> list[psutil.Process]:
    """The Serve proxy and the gateway replica: where 1,000 connections and streams are held."""
    found = []
    for process in platform.processes():
        try:
            title = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        if title.startswith(("ray::ProxyActor", "ray::ServeReplica")):
            found.append(process)
    assert len(found) == 2, [" ".join(p.cmdline()) for p in found]
    return found


def footprint(processes: list[psutil.Process]) -> tuple[int, int]:
    """Open file descriptors and resident bytes, summed over `processes`."""
    return sum(p.num_fds() for p in processes), sum(p.memory_info().rss for p in processes)


async def run_streams(platform: RunningPlatform, count: int) -> list[tuple[str | None, int | None]]:
    """`count` streams at once; per stream (finish reason, completion tokens), or its exception."""
    # The client's default pool holds 1,000 connections: all the streams at once.
    async with openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key, max_retries=0,
                                  timeout=DEADLINE_S * 4) as client:
        async def one(i: int) -> tuple[str | None, int | None]:
            stream = await client.completions.create(
                model=MODEL, prompt=f"Request {i} says hello", max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            reason, tokens = None, None
            async for chunk in stream:
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return reason, tokens

        return await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("crowd")
    model_dir = write_demo_model(root / "crowd", DemoModelConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        max_position_embeddings=128, init_std=0.1, seed=3))
    with start_platform(root, model_dir, "--num-cpus", "2", "--worker-slots", "1", "--no-calibrate",
                        "--ssd-capacity-gb", "1", "--dram-capacity-gb", "0.25", prefix="crowd") as running:
        running.thaw("deploy", "--name", MODEL, "--source", str(model_dir), "--min-instances", "1",
                     "--max-instances", "1", "--queue-timeout-s", "600", "--max-queued-requests", str(NUM_STREAMS))
        yield running


def test_a_thousand_concurrent_streams_all_complete_with_no_5xx_and_no_leak(platform):
    """Three rounds of 1,000: the first two bring the gateway's processes near their high-water
    mark (an allocator keeps what a peak needed, and settles over a few peaks: measured 45, 30,
    20 MiB more after each of rounds 2 to 4), the third must add less than `RSS_SLACK_BYTES` (a
    leak of one buffer per request would keep adding its full size every round)."""
    wait_for(lambda: platform.model_status(MODEL)["num_ready_instances"] == 1, "the model's instance",
             timeout_s=DEADLINE_S * 2, interval_s=0.5)
    processes = gateway_processes(platform)
    footprints = []
    for _ in range(3):
        results = asyncio.run(run_streams(platform, NUM_STREAMS))
        failures = [r for r in results if r != ("length", MAX_TOKENS)]
        assert failures == [], (len(failures), failures[:5])
        wait_for(lambda: platform.model_status(MODEL)["num_ongoing_requests"] == 0, "the instance to be idle")
        footprints.append(footprint(processes))
    (fds_before, rss_before), (fds_after, rss_after) = footprints[1:]
    assert fds_after <= fds_before + FD_SLACK, (fds_before, fds_after)
    assert rss_after <= rss_before + RSS_SLACK_BYTES, (rss_before, rss_after)
    print(f"RELIABILITY many-streams: 3 x {NUM_STREAMS} streams, 0 failed; gateway fds {fds_before} -> {fds_after}, "
          f"rss {rss_before >> 20} -> {rss_after >> 20} MiB")
