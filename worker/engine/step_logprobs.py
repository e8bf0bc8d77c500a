"""The log-probabilities a step's sampled tokens report, for the requests that asked for them.

Out of the engine's step because it is its own rule: computed from the model's raw logits (before
any grammar mask, penalty or temperature), in one batch for every row that asked, each token's
text decoded alone with special tokens kept (vLLM's way); one row's failure is that request's,
not the batch's.
"""

from __future__ import annotations

import torch

from wire import TokenLogprobs
from worker.engine.sampler import RawLogprobs, Sampler
from worker.engine.sequence import Sequence
from worker.text.tokenizer import Tokenizer

__all__ = ["step_logprobs"]


def step_logprobs(sampler: Sampler, tokenizer: Tokenizer, logits: torch.Tensor, seqs: list[Sequence],
                  token_ids: list[int | BaseException]) -> list[TokenLogprobs | BaseException | None]:
    """Each sampled token's `TokenLogprobs` for the rows that asked (logits: [S, V], raw); None for
    the others, and the exception for rows whose logprobs failed (or whose sampling did: none)."""
    rows = [i for i, (seq, token_id) in enumerate(zip(seqs, token_ids))
            if seq.params.logprobs is not None and not isinstance(token_id, BaseException)]
    found: list[TokenLogprobs | BaseException | None] = [None] * len(seqs)
    if not rows:
        return found
    try:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)  # [R]
        raw = sampler.logprobs(logits[index], [token_ids[i] for i in rows],
                               [seqs[i].params.logprobs for i in rows])
        for i, values in zip(rows, raw):
            found[i] = _token_logprobs(tokenizer, token_ids[i], values)
    except Exception as exc:  # noqa: BLE001 - these rows' failure, not the batch's
        for i in rows:
            found[i] = exc
    return found


def _token_logprobs(tokenizer: Tokenizer, token_id: int, values: RawLogprobs) -> TokenLogprobs:
    decode = tokenizer.decode
    return TokenLogprobs(
        token_id=token_id, token=decode([token_id], skip_special_tokens=False), logprob=values.logprob,
        top_token_ids=tuple(values.top_token_ids),
        top_tokens=tuple(decode([t], skip_special_tokens=False) for t in values.top_token_ids),
        top_logprobs=tuple(values.top_logprobs),
    )
