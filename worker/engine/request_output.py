"""What the engine hands back: per-step deltas for streaming and whole completions.

Both print without their text (house rule: logs never carry prompts or completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request: the tokens and text added since the last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str = field(repr=False)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" once finished ("error": see `error`)
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # why this request alone failed (finish reason "error"); for logs, not clients
    # One per new token, for a request that asked for them (SamplingParams.logprobs); else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # Prompt tokens whose KV came from the prefix cache, not computed for this request.
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Completion:
    """A finished request, gathered from its outputs."""

    request_id: str
    output_token_ids: tuple[int, ...]
    text: str = field(repr=False)
    finish_reason: str
    num_prompt_tokens: int
    # One per output token, for a request that asked for them (SamplingParams.logprobs); else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
