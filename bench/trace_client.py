"""The client side of `bench/multimodel.py` and `bench/sim_fidelity.py`: a trace replayed open loop
(every request sent at its arrival time, whatever the others do) as streaming completions, what
the client saw of each request, and the percentiles taken of it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.bursty_trace import TraceRequest
from bench.multimodel_setup import log

STREAM_DEADLINE_S = 120.0  # after the first token, for the rest of the answer
SAMPLE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Outcome:
    """What the client saw of one request; times in seconds from the trace's start."""

    model_index: int
    arrival_s: float
    sent_s: float
    ttft_s: float | None  # None: no output arrived
    end_s: float
    failure: str | None  # None: it succeeded
    estimate: tuple[float, float] | None = None  # the first "about N s" it was told: (when, N), seconds from its send
    tokens: tuple[str, ...] | None = None  # each output token's text, where the stream carried logprobs


@dataclass(frozen=True)
class Sent:
    ttft_s: float | None  # None: no output arrived
    failure: str | None  # None: it succeeded
    estimate: tuple[float, float] | None = None  # the first wait estimate: (seconds after sending, N)
    tokens: tuple[str, ...] | None = None  # the output tokens' texts (completions' logprobs.tokens)


_ABOUT = re.compile(rb"about ([0-9.]+) s")


async def stream_request(session: Any, url: str, body: dict[str, Any], first_token_deadline_s: float) -> Sent:
    """POSTs one streaming request and reads it to its end: its TTFT, failure, the first wait
    estimate a ``: waiting ..., about N s`` comment gave, and (a request that asked for logprobs)
    its tokens' texts."""
    import aiohttp

    loop = asyncio.get_running_loop()
    start = loop.time()
    ttft_s, finish_reason, done, phase = None, None, False, "first-token"
    estimate: tuple[float, float] | None = None
    tokens: list[str] | None = [] if body.get("logprobs") is not None else None
    try:
        async with asyncio.timeout_at(start + first_token_deadline_s) as deadline:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    return Sent(None, f"http-{response.status}", estimate)
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        about = _ABOUT.search(line) if estimate is None and line.startswith(b":") else None
                        if about is not None:  # what the platform says the wait will be
                            estimate = (loop.time() - start, float(about.group(1)))
                        continue  # blank separators and ": ..." comments (progress while waiting)
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        code = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
                        return Sent(ttft_s, f"error-event:{code or 'unknown'}", estimate)
                    choices = event.get("choices") or []
                    if ttft_s is None and ("token" in event or choices):
                        ttft_s = loop.time() - start
                        phase = "stream"
                        deadline.reschedule(loop.time() + STREAM_DEADLINE_S)
                    for choice in choices:
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if tokens is not None and choice.get("logprobs"):
                            tokens.extend(choice["logprobs"].get("tokens") or ())
    except TimeoutError:
        return Sent(ttft_s, f"client-timeout-{phase}", estimate)
    except aiohttp.ClientError as exc:
        return Sent(ttft_s, f"connection-error:{type(exc).__name__}", estimate)
    if not done:
        return Sent(ttft_s, "stream-cut", estimate)
    if ttft_s is None:
        return Sent(None, "no-output", estimate)
    if finish_reason is not None and finish_reason not in ("length", "stop"):
        return Sent(ttft_s, f"finish-{finish_reason}", estimate)
    return Sent(ttft_s, None, estimate, tuple(tokens) if tokens is not None else None)


async def replay(trace: list[TraceRequest], send: Callable[[TraceRequest], Awaitable[Sent]],
                 ready_models: Callable[[], Awaitable[list[int]]]) -> tuple[list[Outcome], float, float]:
    """Sends every request at its arrival time (open loop) and samples the slots once a second
    until the last answer; returns (outcomes, idle slot-seconds, seconds from start to last answer)."""
    loop = asyncio.get_running_loop()
    in_flight: collections.Counter[int] = collections.Counter()
    finished: list[Outcome] = []
    start = loop.time()

    async def one(request: TraceRequest) -> Outcome:
        await asyncio.sleep(max(0.0, start + request.arrival_s - loop.time()))
        sent_s = loop.time() - start
        in_flight[request.model_index] += 1
        try:
            sent = await send(request)
        finally:
            in_flight[request.model_index] -= 1
        outcome = Outcome(request.model_index, request.arrival_s, sent_s, sent.ttft_s, loop.time() - start,
                          sent.failure, sent.estimate, sent.tokens)
        finished.append(outcome)
        return outcome

    async def sample(stop: asyncio.Event) -> float:
        idle_s, last = 0.0, loop.time()
        next_log = 10.0
        while not stop.is_set():
            try:
                ready = await ready_models()
            except Exception as exc:  # noqa: BLE001 - a missed sample only loses that second
                log(f"slot sample failed: {type(exc).__name__}: {exc}")
                ready = None
            now = loop.time()
            if ready is not None:
                idle_s += sum(1 for m in ready if in_flight[m] == 0) * (now - last)
            last = now
            if now - start >= next_log:
                next_log += 10.0
                log(f"  t={now - start:5.1f}s: {len(finished)}/{len(trace)} done "
                    f"({sum(o.failure is not None for o in finished)} failed), {sum(in_flight.values())} in flight, "
                    f"ready slots: {sorted(ready) if ready is not None else '?'}")
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)
            except TimeoutError:
                pass
        return idle_s

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(stop))
    outcomes = await asyncio.gather(*(one(r) for r in trace))
    duration_s = loop.time() - start
    stop.set()
    return list(outcomes), await sampler, duration_s


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    return censored_percentile([(v, False) for v in values], q)[0]


def censored_percentile(values: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """The q-th percentile of (value, censored) pairs, and whether it rests on a censored value
    (a lower bound standing in for a request that never got its token)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low][0] + (ordered[high][0] - ordered[low][0]) * (position - low)
    return value, ordered[low][1] or (ordered[high][1] and position > low)
