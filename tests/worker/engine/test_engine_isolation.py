"""Issue 19: one request's failure fails that request only.

A request that breaks inside the engine after admission (its sampling, its stop handling or
detokenizing) finishes with reason "error" while the others in its batch go on, token for token
as if it had never been there, seeded ones included. When the engine itself dies (its forward
pass raised), the requests that were in that pass are marked as suspects and the others are not,
which is what the gateway's poison-pill guard reads. The worker tokenizes a prompt once, off its
event loop.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker import (
    AsyncEngine, Engine, EngineConfig, EngineDeadError, InstanceWorker, RequestFailedError, SamplingParams,
)
from worker.engine.sampler import Sampler

CONFIG = EngineConfig(block_size=4, num_kv_blocks=128)
POISON_SEED = 666
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
POISON = SamplingParams(temperature=0.8, seed=POISON_SEED, max_tokens=8, ignore_eos=True)


class PoisonSampler(Sampler):
    """Samples the whole batch (every row's generator advances), then fails if a row is poisoned:
    the engine must put the generators back and redraw row by row, failing that row alone."""

    def sample(self, logits, params, generators, **rows):
        token_ids = super().sample(logits, params, generators, **rows)
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return token_ids


class BadTokenSampler(Sampler):
    """Hands the poisoned row a token id the tokenizer cannot decode: its stop handling or
    detokenizing fails, not its sampling."""

    def sample(self, logits, params, generators, **rows):
        token_ids = super().sample(logits, params, generators, **rows)
        return [-5 if p.seed == POISON_SEED else t for p, t in zip(params, token_ids)]


@pytest.mark.parametrize("sampler", [PoisonSampler, BadTokenSampler])
def test_a_request_that_fails_in_the_engine_fails_alone(tiny_llama_dir, sampler):
    prompts = ["alpha beta", "gamma delta", "epsilon"]
    clean = Engine(tiny_llama_dir, CONFIG).generate(prompts[:2], [GREEDY, SEEDED])

    engine = Engine(tiny_llama_dir, CONFIG)
    engine.sampler = sampler()
    done = engine.generate(prompts, [GREEDY, SEEDED, POISON])

    assert [c.output_token_ids for c in done[:2]] == [c.output_token_ids for c in clean]
    assert [c.text for c in done[:2]] == [c.text for c in clean]
    assert [c.finish_reason for c in done] == ["length", "length", "error"]
    if sampler is PoisonSampler:
        assert done[2].output_token_ids == ()  # it failed drawing its first token
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.num_unfinished_requests == 0


def test_the_failed_requests_stream_raises_and_the_engine_serves_on(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, CONFIG)
    engine.sampler = PoisonSampler()
    async_engine = AsyncEngine(engine)

    async def tokens(prompt, params):
        return [t async for out in async_engine.generate(prompt, params) for t in out.new_token_ids]

    async def main():
        good = asyncio.create_task(tokens("alpha beta", GREEDY))
        with pytest.raises(RequestFailedError, match="sampling failed: RuntimeError: probability tensor"):
            await tokens("epsilon", POISON)
        first = await good
        return first, await tokens("alpha beta", GREEDY)  # the engine still serves

    try:
        first, again = asyncio.run(main())
        assert len(first) == 8 and again == first
        assert async_engine.is_alive and async_engine.error is None
    finally:
        async_engine.shutdown()


def test_when_the_forward_pass_kills_the_engine_only_the_requests_in_it_are_suspects(tiny_llama_dir, monkeypatch):
    # One sequence per step: the second request waits while the first is in the fatal pass.
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=1))
    execute = engine.runner.execute

    def dies_on_poison(batch, block_tables):
        if any(seq.params.seed == POISON_SEED for seq in batch.seqs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(batch, block_tables)

    monkeypatch.setattr(engine.runner, "execute", dies_on_poison)
    async_engine = AsyncEngine(engine)

    async def outcome(prompt, params):
        try:
            async for _ in async_engine.generate(prompt, params):
                pass
        except EngineDeadError as exc:
            return exc
        return None

    async def main():
        poison = asyncio.create_task(outcome("epsilon", POISON))
        await asyncio.sleep(0)  # let the poison reach the inbox first
        return await asyncio.gather(poison, outcome("alpha beta", GREEDY))

    try:
        poisoned, bystander = asyncio.run(main())
        assert poisoned is not None and poisoned.suspect is True
        assert bystander is not None and bystander.suspect is False
        assert "illegal memory access" in str(poisoned)
        # The mark survives pickling (it crosses Ray to the gateway inside the error).
        import pickle
        assert pickle.loads(pickle.dumps(poisoned)).suspect is True
    finally:
        async_engine.shutdown()


def test_the_worker_tokenizes_a_prompt_once_and_off_its_event_loop(tiny_llama_dir, monkeypatch):
    calls: list[str] = []
    tokenize = Engine.tokenize_prompt

    def recording(self, prompt):
        calls.append(threading.current_thread().name)
        return tokenize(self, prompt)

    monkeypatch.setattr(Engine, "tokenize_prompt", recording)
    worker = InstanceWorker("inst-tok", "acme/tiny", tiny_llama_dir, {"block_size": 4, "num_kv_blocks": 128})

    async def main():
        await worker.ready()
        loop_thread = threading.current_thread().name
        chunks = [c async for c in worker.generate("r1", "alpha beta " * 20, {"max_tokens": 4, "temperature": 0.0})]
        return loop_thread, chunks

    try:
        loop_thread, chunks = asyncio.run(main())
        assert len(calls) == 1 and calls[0] != loop_thread
        assert chunks[-1].finish_reason is not None and chunks[-1].num_completion_tokens >= 1
    finally:
        asyncio.run(worker.shutdown())
