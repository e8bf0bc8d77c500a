"""The engine benchmark's workload and Thaw's side of it (split from `bench/engine.py`).

A workload is a seeded list of `BenchRequest` (prompt token ids and a planned number of output
tokens); `run_thaw` serves it on an `Engine` all at once and `thaw_batch1_s_per_token` times one
request alone. Both decode greedily with EOS ignored, so every side produces exactly the planned
tokens; `WorkloadResult` counts only those.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

from worker.engine.engine import Engine
from wire.sampling_params import SamplingParams


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int

    def __repr__(self) -> str:  # never print prompts, even random ones
        return f"BenchRequest(prompt_len={len(self.prompt_token_ids)}, num_output_tokens={self.num_output_tokens})"


@dataclass(frozen=True)
class WorkloadResult:
    num_generated_tokens: int  # planned (useful) tokens only
    elapsed_s: float
    output_token_ids: list[tuple[int, ...]]  # per request, in workload order

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s


def log(message: str) -> None:
    print(f"[bench/engine] {message}", file=sys.stderr, flush=True)


def make_requests(num_requests: int, vocab_size: int, prompt_len_range: tuple[int, int],
                  output_len_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    """A seeded workload: uniform prompt and output lengths, uniform random prompt ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
        requests.append(BenchRequest(prompt, rng.randint(*output_len_range)))
    return requests


def greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


def run_thaw(engine: Engine, requests: list[BenchRequest]) -> WorkloadResult:
    """All requests at once; the engine's scheduler batches them."""
    start = time.perf_counter()
    request_ids = [engine.add_request(list(r.prompt_token_ids), greedy(r.num_output_tokens)) for r in requests]
    outputs: dict[str, list[int]] = {rid: [] for rid in request_ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    elapsed_s = time.perf_counter() - start
    token_ids = [tuple(outputs[rid]) for rid in request_ids]
    for request, ids in zip(requests, token_ids):
        if len(ids) != request.num_output_tokens:
            raise RuntimeError(f"thaw produced {len(ids)} tokens for a request that planned {request.num_output_tokens}")
    return WorkloadResult(sum(len(ids) for ids in token_ids), elapsed_s, token_ids)


def thaw_batch1_s_per_token(engine: Engine, prompt_token_ids: tuple[int, ...], num_output_tokens: int) -> float:
    """Decode time per token for one request alone: (end - first token) / (n - 1)."""
    engine.add_request(list(prompt_token_ids), greedy(num_output_tokens))
    first_token_at = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()
    end = time.perf_counter()
    if num_tokens != num_output_tokens or first_token_at is None:
        raise RuntimeError(f"thaw produced {num_tokens} tokens, planned {num_output_tokens}")
    return (end - first_token_at) / (num_output_tokens - 1)
