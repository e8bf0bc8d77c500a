"""Whether a platform served greedy outputs exactly: each request's tokens, as a client received
them, against the engine run directly on the same checkpoint (issue 38: "every greedy output exact"
while models share processes, sleep, wake and are evicted).

The reference runs every request of a model in one `worker.Engine` in this process, greedy with
EOS ignored, asking for the `TOP_K` most likely tokens at every position. A served output is judged
by its tokens' texts (what completions' ``logprobs.tokens`` carries), position by position:

* ``exact``: every token the reference's;
* ``near-tie``: the first token that differs is one the reference put within a tolerance of its
  top token there (`near_tie_nats`). A row computed in another batch (other kernels' summation
  order) gets slightly other logits, and random-weight models have many near ties, exact ones too.
  Everything after the first difference follows another prefix, so only it is judged;
* ``differs``: anything else -- a wrong token where the model was sure, a missing or extra token.
  This is what a lost KV block, a woken pool that kept stale state, or a request answered by the
  wrong model looks like; the benchmark's target is none.

Only float32 makes this a check. In float32 another batch moves a logit by about 1e-5, and the
tolerance is 1e-3 nats. A bfloat16 model's logits are bfloat16 (steps of 1/32 between 4 and 8),
and rounding in every layer compounds: on `bench/multimodel.py`'s bfloat16 models (init std 0.1)
the engine's greedy choice, teacher-forced through transformers in float32, is up to 1.2 nats
below the float32 top, and the same request computed alone or in a batch of 40 parted at a token
0.375 nats ahead of the other's choice. For bfloat16 the counts are reported (tolerance 0.125 nats,
four steps) but say nothing about correctness: ``exact_check`` is False.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEAR_TIE_NATS = {"float32": 1e-3, "bfloat16": 0.125}  # by the model's dtype: see the module docstring
TOP_K = 5  # the reference's most likely tokens kept per position (exact ties may be several)


def near_tie_nats(dtype: str) -> float:
    """The tolerance for a model of `dtype` ("float32" or "bfloat16")."""
    if dtype not in NEAR_TIE_NATS:
        raise ValueError(f"no near-tie tolerance for dtype {dtype!r}: one of {sorted(NEAR_TIE_NATS)}")
    return NEAR_TIE_NATS[dtype]


@dataclass(frozen=True)
class GreedyRequest:
    """One request to replay: its prompt's token ids and how many tokens it generates."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class ReferenceToken:
    """The reference's token at one position and the others nearly as likely."""

    text: str
    gap_nats: float  # top-1 minus top-2 log-probability (inf without a runner-up)
    close: tuple[tuple[str, float], ...] = ()  # other top tokens' texts within the widest tolerance, and their gaps


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
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_K)
              for r in requests]
    completions = engine.generate([list(r.prompt_token_ids) for r in requests], params)
    outputs = []
    for completion in completions:
        tokens = []
        for entry in completion.logprobs or ():
            top = entry.top_logprobs[0] if entry.top_logprobs else entry.logprob
            gap = top - entry.top_logprobs[1] if len(entry.top_logprobs) > 1 else math.inf
            close = tuple((text, top - logprob) for text, logprob in zip(entry.top_tokens[1:], entry.top_logprobs[1:])
                          if top - logprob <= max(NEAR_TIE_NATS.values()))
            tokens.append(ReferenceToken(entry.token, gap, close))
        outputs.append(tuple(tokens))
    return outputs


def judge(served: Sequence[str], reference: Sequence[ReferenceToken], tolerance_nats: float) -> Verdict:
    """The served tokens' texts against the reference's, as the module docstring describes."""
    for position, (got, want) in enumerate(zip(served, reference)):
        if got == want.text:
            continue
        near = next((gap for text, gap in want.close if text == got and gap <= tolerance_nats), None)
        if near is not None:
            return Verdict("near-tie", position, round(near, 5))
        return Verdict("differs", position, round(want.gap_nats, 5))
    if len(served) != len(reference):
        return Verdict("differs", min(len(served), len(reference)))
    return Verdict("exact")


def summarize(verdicts: Sequence[Verdict], dtype: str) -> dict[str, Any]:
    """Counts by kind, and the widest gap a near tie was allowed at (how close the calls were);
    ``exact_check``: whether the counts are a correctness check (float32 only)."""
    kinds = collections.Counter(v.kind for v in verdicts)
    gaps = [v.gap_nats for v in verdicts if v.kind == "near-tie" and v.gap_nats is not None]
    return {"num_checked": len(verdicts), "exact": kinds["exact"], "near_ties": kinds["near-tie"],
            "differs": kinds["differs"], "dtype": dtype, "exact_check": dtype == "float32",
            "near_tie_nats": near_tie_nats(dtype), "widest_near_tie_gap_nats": max(gaps) if gaps else None}
