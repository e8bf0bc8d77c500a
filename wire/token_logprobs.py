"""`TokenLogprobs`: one generated token's log-probability and the most likely tokens at its place.

A request with ``SamplingParams.logprobs`` set gets one of these per generated token, beside the
token in its stream (`GenerationChunk.logprobs`), so the gateway can render OpenAI's ``logprobs``
(chat's ``content[i].top_logprobs``, completions' ``top_logprobs``) without a tokenizer of its own.

The numbers are vLLM's default ("raw_logprobs"): ``log_softmax`` of the model's own logits at that
position, before penalties, logit bias and temperature. ``top_*`` are the position's N most likely
tokens, most likely first (N is the request's ``logprobs``); the sampled token may be among them or
not, as in vLLM and OpenAI. The token strings are each token decoded alone with special tokens
kept (vLLM's way); a token holding part of a UTF-8 character decodes to U+FFFD. A log-probability
may be ``-inf`` (a token the model rules out; JSON has no such number, so the gateway renders it).

The record is flat -- parallel tuples, no nested records -- because a stream carries one per token:
its dict form is a handful of plain values and lists. It prints without its token strings (they are
completion text).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

from wire.wire_record import WireRecord, check_token_ids

__all__ = ["TokenLogprobs"]


def _check_logprob(record: str, name: str, value: object) -> float:
    """A log-probability: a real number, not NaN (``-inf`` allowed), as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{record}.{name} must be a log-probability (a number, -inf allowed), got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class TokenLogprobs(WireRecord):
    """Fields:
        token_id, token, logprob: the generated token, its text alone, and its log-probability.
        top_token_ids, top_tokens, top_logprobs: the N most likely tokens at this position, most
            likely first (N = the request's ``SamplingParams.logprobs``; 0 gives empty tuples).
    """

    SCHEMA: ClassVar[str] = "token_logprobs/1"

    token_id: int
    token: str = field(repr=False)
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = field(default=(), repr=False)
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        name = self.record_name()
        if not isinstance(self.token_id, numbers.Integral) or isinstance(self.token_id, bool) or self.token_id < 0:
            raise ValueError(f"{name}.token_id must be a token id (an integer >= 0), got {self.token_id!r}")
        object.__setattr__(self, "token_id", int(self.token_id))
        if not isinstance(self.token, str):
            raise ValueError(f"{name}.token must be a string, got {type(self.token).__name__}")
        object.__setattr__(self, "logprob", _check_logprob(name, "logprob", self.logprob))
        object.__setattr__(self, "top_token_ids", check_token_ids(name, "top_token_ids", self.top_token_ids))
        if not isinstance(self.top_tokens, (tuple, list)) or not all(isinstance(t, str) for t in self.top_tokens):
            raise ValueError(f"{name}.top_tokens must be a list of strings")
        object.__setattr__(self, "top_tokens", tuple(self.top_tokens))
        if not isinstance(self.top_logprobs, (tuple, list)):
            raise ValueError(f"{name}.top_logprobs must be a list of log-probabilities, "
                             f"got {type(self.top_logprobs).__name__}")
        object.__setattr__(self, "top_logprobs", tuple(
            _check_logprob(name, f"top_logprobs[{i}]", value) for i, value in enumerate(self.top_logprobs)))
        if not len(self.top_token_ids) == len(self.top_tokens) == len(self.top_logprobs):
            raise ValueError(f"{name}: top_token_ids, top_tokens and top_logprobs must have one entry per "
                             f"alternative, got {len(self.top_token_ids)}, {len(self.top_tokens)} and "
                             f"{len(self.top_logprobs)}")

    @property
    def top(self) -> tuple[tuple[int, str, float], ...]:
        """The alternatives as ``(token id, token, logprob)``, most likely first."""
        return tuple(zip(self.top_token_ids, self.top_tokens, self.top_logprobs))
