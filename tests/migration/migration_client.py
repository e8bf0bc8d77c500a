"""What the migration tests share: a client that streams a request and follows it to wherever it
is migrated, and an endpoint that fails on purpose at a chosen step."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from migration import EngineEndpoint, MigrationOutcome
from worker import SamplingParams

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "def add(a, b):", "Once upon a time there",
           "Serverless inference", "A long walk home"]
# 200 tokens: migrations started up to 60 tokens in still find the request decoding on a loaded
# machine (100 once ended first in CI after decode got faster).
GREEDY = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=200, ignore_eos=True)


@dataclass
class Received:
    """What the client got: tokens and text joined over every instance, and how it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_handoffs: int = 0
    outcome: MigrationOutcome | None = None

    @property
    def whole(self) -> tuple[list[int], str, str | None]:
        return self.token_ids, self.text, self.finish_reason


async def stream_following(source: EngineEndpoint, destinations: dict[str, EngineEndpoint], request_id: str,
                           prompt: str, params: SamplingParams, *, migrate_after: int | None = None,
                           migrate: Callable[[], Awaitable[MigrationOutcome]] | None = None,
                           first_token: asyncio.Event | None = None) -> Received:
    """Streams the request from ``source``; once ``migrate_after`` tokens arrived, starts ``migrate``
    beside the stream; follows a "migrated" ending to the destination's adopted stream. Sets
    ``first_token`` when the first token arrived."""
    received = Received()
    task: asyncio.Task | None = None
    if migrate is not None and migrate_after == 0:
        task = asyncio.create_task(migrate())
    outputs = source.async_engine.generate(prompt, params, request_id)
    endpoint = source
    while True:
        async for out in outputs:
            assert received.finish_reason is None, "nothing may arrive after the end"
            received.token_ids.extend(out.new_token_ids)
            received.text += out.new_text
            if first_token is not None and received.token_ids:
                first_token.set()
            if out.finish_reason is not None:
                received.finish_reason = out.finish_reason
            if task is None and migrate is not None and len(received.token_ids) >= migrate_after:
                task = asyncio.create_task(migrate())
        if received.finish_reason != "migrated":
            break
        received.finish_reason = None
        received.num_handoffs += 1
        endpoint = destinations[endpoint.handoff_target(request_id)]
        outputs = endpoint.adopted_stream(request_id)
    if task is not None:
        received.outcome = await task
    return received


class FaultyEndpoint:
    """Forwards to an endpoint, but the ``fail_at``-th call of method ``method`` raises ``error``
    instead (after forwarding it, if ``after_forwarding``: the step happened, its answer was lost)."""

    def __init__(self, inner: EngineEndpoint, method: str, error: Exception, fail_at: int = 1,
                 after_forwarding: bool = False) -> None:
        self.inner = inner
        self.method = method
        self.error = error
        self.fail_at = fail_at
        self.after_forwarding = after_forwarding
        self.num_calls = 0

    @property
    def instance_id(self) -> str:
        return self.inner.instance_id

    def __getattr__(self, name: str):
        target = getattr(self.inner, name)
        if name != self.method:
            return target

        async def call(*args, **kwargs):
            self.num_calls += 1
            if self.num_calls != self.fail_at:
                return await target(*args, **kwargs)
            if self.after_forwarding:
                await target(*args, **kwargs)
            raise self.error

        return call


class RecordingEndpoint:
    """Forwards to an endpoint and keeps what the steps a token migration makes there returned:
    the size of every snapshot the source exported or froze, and every destination prefill's
    ``num_tokens_with_kv`` -- so a test can say what the stop recomputed and why, whatever the
    machine's speed."""

    def __init__(self, inner: EngineEndpoint) -> None:
        self.inner = inner
        self.exported: list[int] = []
        self.frozen: list[int] = []
        self.prefilled: list[int] = []

    @property
    def instance_id(self) -> str:
        return self.inner.instance_id

    async def export_request(self, *args, **kwargs):
        snapshot = await self.inner.export_request(*args, **kwargs)
        self.exported.append(snapshot.num_tokens)
        return snapshot

    async def freeze_request(self, *args, **kwargs):
        snapshot = await self.inner.freeze_request(*args, **kwargs)
        self.frozen.append(snapshot.num_tokens)
        return snapshot

    async def prefill_import(self, *args, **kwargs):
        num_tokens_with_kv = await self.inner.prefill_import(*args, **kwargs)
        self.prefilled.append(num_tokens_with_kv)
        return num_tokens_with_kv

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
