"""Whether a platform served greedy outputs exactly: each request's tokens, as a client received
them, against the engine run directly on the same checkpoint (issue 38: "every greedy output exact"
while models share processes, sleep, wake and are evicted).

The reference runs every request of a model in one `worker.Engine` in this process, greedy with
EOS ignored, asking for the two most likely tokens at every position. A served output is judged
by its tokens' texts (what completions' ``logprobs.tokens`` carries), position by position:

* ``exact``: every token the reference's;
* ``near-tie``: the first token that differs is the reference's runner-up, and the reference put
  its top two within ``near_tie_nats`` of each other there. Random-weight models have such near
  ties, and a row computed in another batch (other kernels' summation order, in bfloat16) may
  flip one; everything after it then follows another prefix, so only the first difference is
  judged;
* ``differs``: anything else -- a wrong token where the model was sure, a missing or extra token.
  This is what a lost KV block, a woken pool that kept stale state, or a request answered by the
  wrong model looks like; the benchmark's target is none.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEAR_TIE_NATS = 0.05  # a top-two gap this small is a coin that rounding may flip (bf16 logits)


@dataclass(frozen=True)
class GreedyRequest:
    """One request to replay: its prompt's token ids and how many tokens it generates."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class ReferenceToken:
    """The reference's token at one position and its margin over the runner-up."""

    text: str
    runner_up: str | None  # None: the model's vocabulary has one token
    gap_nats: float  # top-1 minus top-2 log-probability (inf without a runner-up)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "exact" | "near-tie" | "differs"
    position: int | None = None  # the first position that differs
    gap_nats: float | None = None  # the reference's top-two gap there


def reference_outputs(model_dir: Path, requests: Sequence[GreedyRequest]) -> list[tuple[ReferenceToken, ...]]:
    """Every request's greedy tokens from the engine run directly (all in one batch: the engine's
    batching does not change a row's tokens beyond near ties, which `judge` allows)."""
    from worker import Engine, SamplingParams

    if not requests:
        return []
    engine = Engine(model_dir)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2) for r in requests]
    completions = engine.generate([list(r.prompt_token_ids) for r in requests], params)
    outputs = []
    for completion in completions:
        tokens = []
        for entry in completion.logprobs or ():
            runner_up = entry.top_tokens[1] if len(entry.top_tokens) > 1 else None
            gap = entry.top_logprobs[0] - entry.top_logprobs[1] if len(entry.top_logprobs) > 1 else math.inf
            tokens.append(ReferenceToken(entry.token, runner_up, gap))
        outputs.append(tuple(tokens))
    return outputs


def judge(served: Sequence[str], reference: Sequence[ReferenceToken], near_tie_nats: float = NEAR_TIE_NATS) -> Verdict:
    """The served tokens' texts against the reference's, as the module docstring describes."""
    for position, (got, want) in enumerate(zip(served, reference)):
        if got == want.text:
            continue
        near = want.runner_up is not None and got == want.runner_up and want.gap_nats <= near_tie_nats
        return Verdict("near-tie" if near else "differs", position, round(want.gap_nats, 5))
    if len(served) != len(reference):
        return Verdict("differs", min(len(served), len(reference)))
    return Verdict("exact")


def summarize(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """Counts by kind, and the widest gap a near tie was allowed at (how close the calls were)."""
    kinds = collections.Counter(v.kind for v in verdicts)
    gaps = [v.gap_nats for v in verdicts if v.kind == "near-tie" and v.gap_nats is not None]
    return {"num_checked": len(verdicts), "exact": kinds["exact"], "near_ties": kinds["near-tie"],
            "differs": kinds["differs"], "near_tie_nats": NEAR_TIE_NATS,
            "widest_near_tie_gap_nats": max(gaps) if gaps else None}
