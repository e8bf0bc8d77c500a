"""One request's state inside the engine: its tokens, how far the KV cache has caught up,
and how it is sampled.

There is no prefill or decode phase (vLLM v1's idea): a sequence has ``num_tokens`` tokens
and ``num_computed_tokens`` of them have KV entries; each step the scheduler gives it some
of the gap. A fresh prompt has a large gap, a decoding sequence a gap of one, and a
sequence preempted for recompute simply has its computed count reset to zero.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from wire import FinishReason
from wire.sampling_params import SamplingParams
from worker.engine.token_counts import TokenCounts

if TYPE_CHECKING:  # for the annotation only: a sequence never calls the grammar library
    from worker.text.structured_output import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Held by a live migration: keeps its KV blocks but is not scheduled (a source request
    # frozen for the hand-off, or a request being imported on the destination).
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int] = field(repr=False)
    params: SamplingParams
    max_model_len: int
    generator: torch.Generator | None = field(default=None, repr=False)
    arrival_s: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list, repr=False)  # prompt + output
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prompt tokens whose KV its first admission found in the prefix cache (`worker.kv.block_manager`).
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    # The sampler's penalty counts, made at the first step that needs them (`worker.engine.token_counts`).
    token_counts: TokenCounts | None = field(default=None, repr=False)
    # Where its output stands in its structured_output grammar, made at its first step and kept up
    # with its output tokens (`worker.engine.structured_output_manager`); None without structured_output.
    grammar: GrammarMatcher | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        self.token_ids.append(token_id)
