"""Token sampler: turns one decode step's logits into one token id per request.

Each row of the batch is sampled under its own `SamplingParams`, in vLLM v1's order
(vllm/v1/sample/sampler.py):

1. the adjustments that can change the argmax, on a float32 copy of the rows that have any:
   ``min_tokens`` (the end-of-sequence ids and ``stop_token_ids`` set to -inf while the request
   has fewer output tokens), ``logit_bias`` (added), then the penalties -- repetition (a logit of
   a token seen in the prompt or output divided by it if positive, multiplied otherwise),
   frequency (minus penalty x its count in the output), presence (minus penalty if in the output);
2. greedy rows (temperature 0 or top_k 1) take the argmax, all greedy rows in one call;
3. other rows go through temperature -> min-p -> top-k -> softmax -> top-p -> multinomial, the
   elementwise steps batched over all sampled rows, and the draw done row by row with that row's
   `torch.Generator`.

Every step is batched over the rows that use it and skipped when none does, so a batch without
these settings costs what it did before them. The penalties read each request's `TokenCounts`
(kept per request, on the device, grown a token at a time: see `worker.engine.token_counts` for why not
rebuilt every step as vLLM does); `min_tokens` reads its number of output tokens.

Drawing row by row is what makes a seeded request reproducible: a row's random stream
is consumed only by that row, so its tokens do not depend on which other requests share
the batch (the same guarantee vLLM gives for per-request seeds). Rows without a generator
share the global RNG and are drawn together in one call.

Log-probabilities (`Sampler.logprobs`) are vLLM's default "raw_logprobs": ``log_softmax`` of the
model's logits as they came, before any of the above, computed only for the rows that ask.

The filters are the usual ones (Holtzman et al. 2019 for top-p, Nguyen et al. 2024 for min-p);
their exact tie and rounding rules are spelled out in `apply_top_k`, `top_p_keep_mask` and
`_mask_min_p_rows_`. The sampler holds no state between steps (the end-of-sequence ids it is built
with are the model's) and is device-agnostic: it runs where the logits are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from wire.sampling_params import SamplingParams
from worker.engine.token_counts import TokenCounts


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Return a copy of `logits` with all but the `k` largest entries of each row set to -inf.

    logits: [V] or [N, V], any float dtype. k == 0 or k >= V returns `logits` unchanged
    (the same tensor, not a copy). Entries tied with the k-th largest value are kept too,
    so on ties more than k tokens survive; this keeps the result independent of the order
    in which `torch.topk` returns equal values.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0 (0 disables top-k), got {k!r}")
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [N, V], got shape {tuple(logits.shape)}")
    vocab_size = logits.shape[-1]
    if k == 0 or k >= vocab_size:
        return logits
    rows = logits.reshape(-1, vocab_size)  # [N, V]
    out = rows.clone()
    ks = torch.full((rows.shape[0],), k, dtype=torch.long, device=logits.device)  # [N]
    _mask_top_k_rows_(out, ks, k)
    return out.reshape(logits.shape)


def top_p_keep_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens nucleus (top-p) sampling keeps.

    probs: [V] or [N, V], non-negative (normally a softmax output). Returns a bool tensor
    of the same shape.

    Exact rule, per row: sort the probabilities in descending order, ties broken by lower
    token id first (a stable sort). Walking that order, token j is kept iff the sum of the
    probabilities before it is < top_p. So tokens are kept until the running total first
    reaches top_p, the token that reaches it is kept, and the first (most likely) token is
    always kept. The running total is accumulated in float64, in sorted order, so summing
    up to ~150k float32 terms cannot shift the cut by accumulated rounding.
    """
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if probs.dim() not in (1, 2):
        raise ValueError(f"probs must be [V] or [N, V], got shape {tuple(probs.shape)}")
    rows = probs.reshape(-1, probs.shape[-1])  # [N, V]
    top_ps = torch.full((rows.shape[0],), float(top_p), dtype=torch.float64, device=probs.device)
    return _top_p_keep_mask_rows(rows, top_ps).reshape(probs.shape)


def _mask_top_k_rows_(logits: torch.Tensor, ks: torch.Tensor, max_k: int) -> None:
    """In place: set every entry below row i's ks[i]-th largest value to -inf.

    logits: [M, V]; ks: [M] long, each in [1, max_k]; max_k <= V. Only the max_k largest
    values per row are selected, so the cost is a top-k, not a full sort.
    """
    top_values = torch.topk(logits, max_k, dim=-1, sorted=True).values  # [M, max_k], descending
    thresholds = top_values.gather(1, (ks - 1).unsqueeze(1))  # [M, 1]: k-th largest per row
    logits.masked_fill_(logits < thresholds, float("-inf"))


def _top_p_keep_mask_rows(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Row-wise `top_p_keep_mask`. probs: [M, V]; top_ps: [M] float64. Returns bool [M, V]."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [M, V] each
    cumulative = torch.cumsum(sorted_probs, dim=-1, dtype=torch.float64)  # [M, V]
    # Token j (in sorted order) is kept iff the total *before* it is < top_p.
    keep_sorted = torch.empty_like(sorted_probs, dtype=torch.bool)  # [M, V]
    keep_sorted[:, 0] = True
    torch.lt(cumulative[:, :-1], top_ps.unsqueeze(1), out=keep_sorted[:, 1:])
    # Back to token-id order: keep[i, order[i, j]] = keep_sorted[i, j].
    return torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)  # [M, V]


def _mask_min_p_rows_(logits: torch.Tensor, min_ps: torch.Tensor) -> None:
    """In place: min-p over temperature-scaled logits [M, V], min_ps [M] float32 in (0, 1]. A token
    is dropped (-inf) iff its probability is below min_p times the row's largest probability, so the
    most likely token always stays (transformers' `MinPLogitsWarper` and vLLM's rule)."""
    probs = torch.softmax(logits, dim=-1)  # [M, V]
    thresholds = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)  # [M, 1]
    logits.masked_fill_(probs < thresholds, float("-inf"))


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class RawLogprobs(NamedTuple):
    """One row's log-probabilities: its sampled token's and its `num_top` most likely tokens', most
    likely first (ties in the order `torch.topk` gives)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class Sampler:
    """Samples one token per row of a batch of logits, each row under its own params.

    Stateless: one instance can serve every step. Generators, when given, must live on the
    logits' device (`torch.Generator(device=logits.device)`); so must `TokenCounts`.
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        """`eos_token_ids`: the model's end-of-sequence ids, which ``min_tokens`` holds back."""
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        num_output_tokens: Sequence[int] | None = None,
        token_counts: Sequence[TokenCounts | None] | None = None,
    ) -> list[int]:
        """Pick one token id per row.

        logits: [N, V], any float dtype; not modified. params[i] and generators[i] belong to
        row i; a None generator draws from the global RNG. num_output_tokens[i]: how many tokens
        row i has generated (needed for a row with ``min_tokens``); token_counts[i]: its counts
        (needed for a row with a penalty, with a ``prompt_mask`` for a repetition penalty).
        """
        num_rows, vocab_size = self._check(logits, params, generators, num_output_tokens, token_counts)
        if num_rows == 0:
            return []
        device = logits.device
        adjusted = [self._adjusts(p, num_output_tokens, i) for i, p in enumerate(params)]

        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy_rows) == num_rows and not any(adjusted):
            return logits.argmax(dim=-1).tolist()

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [N]
        if greedy_rows:
            if any(adjusted[i] for i in greedy_rows):
                greedy_logits = self._adjusted_rows(logits, greedy_rows, params, num_output_tokens, token_counts)
            else:
                greedy_logits = logits if len(greedy_rows) == num_rows else logits[_index(greedy_rows, device)]
            if len(greedy_rows) == num_rows:
                return greedy_logits.argmax(dim=-1).tolist()
            token_ids[_index(greedy_rows, device)] = greedy_logits.argmax(dim=-1)

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        weights = self._random_weights(logits, random_rows, params, num_output_tokens, token_counts,
                                       any(adjusted[i] for i in random_rows))  # [M, V]
        random_generators = [generators[i] for i in random_rows]
        sampled = self._draw(weights, random_generators)  # [M]
        if len(random_rows) == num_rows:
            token_ids = sampled
        else:
            token_ids[_index(random_rows, device)] = sampled
        # One device-to-host copy for the whole batch.
        return token_ids.tolist()

    def probabilities(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        num_output_tokens: Sequence[int] | None = None,
        token_counts: Sequence[TokenCounts | None] | None = None,
    ) -> torch.Tensor:
        """The distribution `sample` draws each row's token from: [N, V] float32, each row summing
        to 1 (up to the softmax's rounding); a greedy row has all its mass on its argmax. For tests
        and inspection (`sample` does not build it for greedy rows)."""
        num_rows, vocab_size = self._check(logits, params, [None] * len(params), num_output_tokens, token_counts)
        probs = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)  # [N, V]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            adjusted = self._adjusted_rows(logits, greedy_rows, params, num_output_tokens, token_counts)
            probs[_index(greedy_rows, logits.device), adjusted.argmax(dim=-1)] = 1.0
        if random_rows:
            weights = self._random_weights(logits, random_rows, params, num_output_tokens, token_counts, True)
            # A softmax is normalised already; only what top-p cut needs it again.
            cut = torch.tensor([params[i].top_p < 1.0 for i in random_rows], device=logits.device).unsqueeze(1)
            weights = torch.where(cut, weights / weights.sum(dim=-1, keepdim=True), weights)
            probs[_index(random_rows, logits.device)] = weights
        return probs

    @staticmethod
    def logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[RawLogprobs]:
        """Row i's log-probability of ``token_ids[i]`` and its ``num_top[i]`` most likely tokens, from
        ``log_softmax`` of `logits` [L, V] in float32 (pass the model's raw logits: vLLM's
        "raw_logprobs"). One top-k over the batch, two device-to-host copies."""
        if logits.dim() != 2 or len(token_ids) != logits.shape[0] or len(num_top) != logits.shape[0]:
            raise ValueError(f"need one token id and one count per logits row: got logits of shape "
                             f"{tuple(logits.shape)}, {len(token_ids)} token ids, {len(num_top)} counts")
        if not token_ids:
            return []
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [L, V]
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)  # [L]
        chosen = logprobs.gather(1, ids.unsqueeze(1))  # [L, 1]
        max_top = min(max(num_top), logprobs.shape[1])
        if max_top == 0:
            return [RawLogprobs(value, [], []) for value in chosen.squeeze(1).tolist()]
        top_values, top_ids = torch.topk(logprobs, max_top, dim=-1)  # [L, K] each, descending
        values = torch.cat([chosen, top_values], dim=1).tolist()  # [L, 1 + K]
        top_ids_list = top_ids.tolist()
        return [RawLogprobs(row[0], row_ids[:n], row[1:1 + n])
                for row, row_ids, n in zip(values, top_ids_list, num_top)]

    # ---- the steps -----------------------------------------------------------------------------

    def _check(self, logits, params, generators, num_output_tokens, token_counts) -> tuple[int, int]:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        num_rows, vocab_size = logits.shape
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"need one SamplingParams and one generator per logits row: got "
                f"{num_rows} rows, {len(params)} params, {len(generators)} generators"
            )
        if num_output_tokens is not None and len(num_output_tokens) != num_rows:
            raise ValueError(f"need one output token count per logits row: got {num_rows} rows, "
                             f"{len(num_output_tokens)} counts")
        if token_counts is not None and len(token_counts) != num_rows:
            raise ValueError(f"need one TokenCounts (or None) per logits row: got {num_rows} rows, "
                             f"{len(token_counts)}")
        for i, p in enumerate(params):
            if p.min_tokens and num_output_tokens is None:
                raise ValueError(f"row {i} has min_tokens {p.min_tokens}: pass num_output_tokens")
            if p.has_penalties:
                counts = None if token_counts is None else token_counts[i]
                if counts is None or counts.vocab_size != vocab_size:
                    raise ValueError(f"row {i} has a penalty: pass its TokenCounts over the {vocab_size} logits")
                if p.repetition_penalty != 1.0 and counts.prompt_mask is None:
                    raise ValueError(f"row {i} has a repetition penalty: its TokenCounts needs the prompt")
        return num_rows, vocab_size

    @staticmethod
    def _adjusts(p: SamplingParams, num_output_tokens: Sequence[int] | None, row: int) -> bool:
        """Whether step 1 (see the module docstring) changes this row's logits now."""
        return bool(p.logit_bias) or p.has_penalties or (p.min_tokens > 0 and num_output_tokens[row] < p.min_tokens)

    def _adjusted_rows(self, logits, rows, params, num_output_tokens, token_counts) -> torch.Tensor:
        """A float32 copy of `rows` of `logits` [M, V] (owned by the caller) with step 1 applied."""
        if len(rows) == logits.shape[0]:
            out = logits.to(torch.float32, copy=True)  # [M, V]
        else:
            out = logits[_index(rows, logits.device)].to(torch.float32)  # [M, V]: the gather copies
        self._adjust_(out, [params[i] for i in rows],
                      None if num_output_tokens is None else [num_output_tokens[i] for i in rows],
                      None if token_counts is None else [token_counts[i] for i in rows])
        return out

    def _adjust_(self, logits, params, num_output_tokens, token_counts) -> None:
        """In place on float32 logits [M, V]: min_tokens, logit_bias, then the penalties."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        rows: list[int] = []
        token_ids: list[int] = []
        for j, p in enumerate(params):
            if p.min_tokens > 0 and num_output_tokens[j] < p.min_tokens:
                # vLLM holds back every stop id, the end-of-sequence ones even under ignore_eos.
                held = [t for t in dict.fromkeys((*self.eos_token_ids, *p.stop_token_ids)) if t < vocab_size]
                rows.extend([j] * len(held))
                token_ids.extend(held)
        if rows:
            logits[_index(rows, device), _index(token_ids, device)] = float("-inf")

        rows, token_ids, biases = [], [], []
        for j, p in enumerate(params):
            if not p.logit_bias:
                continue
            if p.logit_bias[-1][0] >= vocab_size:  # sorted by id: the last is the largest
                raise ValueError(f"logit_bias names token {p.logit_bias[-1][0]}, outside the model's vocabulary "
                                 f"[0, {vocab_size})")
            ids, values = zip(*p.logit_bias)
            rows.extend([j] * len(ids))
            token_ids.extend(ids)
            biases.extend(values)
        if rows:
            logits.index_put_((_index(rows, device), _index(token_ids, device)),
                              torch.tensor(biases, dtype=torch.float32, device=device), accumulate=True)

        penalised = [j for j, p in enumerate(params) if p.has_penalties]
        if not penalised:
            return
        index = None if len(penalised) == num_rows else _index(penalised, device)
        sub = logits if index is None else logits[index]  # [P, V]
        counts = torch.stack([token_counts[j].output_counts for j in penalised])  # [P, V] int32
        seen = counts > 0  # [P, V]: in the output so far
        repeating = [k for k, j in enumerate(penalised) if params[j].repetition_penalty != 1.0]
        if repeating:
            in_context = seen.clone()  # [P, V]: in the prompt or the output
            prompt = torch.stack([token_counts[penalised[k]].prompt_mask for k in repeating])  # [R, V]
            if len(repeating) == len(penalised):
                in_context |= prompt
            else:
                repeating_index = _index(repeating, device)
                in_context[repeating_index] |= prompt
            penalty = torch.tensor([params[j].repetition_penalty for j in penalised], dtype=torch.float32,
                                   device=device).unsqueeze(1)  # [P, 1]
            # transformers' RepetitionPenaltyLogitsProcessor, elementwise (0 is unchanged either way).
            sub = torch.where(in_context, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
        frequency = torch.tensor([params[j].frequency_penalty for j in penalised], dtype=torch.float32,
                                 device=device).unsqueeze(1)  # [P, 1]
        presence = torch.tensor([params[j].presence_penalty for j in penalised], dtype=torch.float32,
                                device=device).unsqueeze(1)  # [P, 1]
        # OpenAI's definition: logit - frequency * count - presence * (count > 0).
        sub = sub - frequency * counts
        sub = sub - presence * seen
        if index is None:
            logits.copy_(sub)
        else:
            logits[index] = sub

    def _random_weights(self, logits, rows, params, num_output_tokens, token_counts, adjust: bool) -> torch.Tensor:
        """Temperature -> min-p -> top-k -> softmax -> top-p over `rows` (after step 1 if `adjust`):
        the unnormalised weights [M, V] float32 that `torch.multinomial` draws from."""
        device = logits.device
        num_rows = len(rows)
        vocab_size = logits.shape[1]
        if adjust:
            scaled = self._adjusted_rows(logits, rows, params, num_output_tokens, token_counts)  # [M, V]
        params = [params[i] for i in rows]
        temperatures = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)  # [M, 1]
        if adjust:
            scaled.div_(temperatures)  # [M, V]
        else:
            raw = logits if num_rows == logits.shape[0] else logits[_index(rows, device)]  # [M, V]
            # Out of place on purpose: `logits` may be the caller's tensor.
            scaled = raw.to(torch.float32).div(temperatures)  # [M, V]

        min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
        if min_p_rows:
            min_ps = torch.tensor([params[j].min_p for j in min_p_rows], dtype=torch.float32, device=device)  # [Q]
            if len(min_p_rows) == num_rows:
                _mask_min_p_rows_(scaled, min_ps)
            else:
                min_p_index = _index(min_p_rows, device)  # [Q]
                subset = scaled[min_p_index]  # [Q, V]
                _mask_min_p_rows_(subset, min_ps)
                scaled[min_p_index] = subset

        top_k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab_size]
        if top_k_rows:
            ks = [params[j].top_k for j in top_k_rows]
            ks_tensor = torch.tensor(ks, dtype=torch.long, device=device)  # [K]
            if len(top_k_rows) == num_rows:
                _mask_top_k_rows_(scaled, ks_tensor, max(ks))
            else:
                top_k_index = _index(top_k_rows, device)  # [K]
                subset = scaled[top_k_index]  # [K, V]
                _mask_top_k_rows_(subset, ks_tensor, max(ks))
                scaled[top_k_index] = subset

        probs = torch.softmax(scaled, dim=-1)  # [M, V] float32

        top_p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if top_p_rows:
            top_ps = torch.tensor(
                [params[j].top_p for j in top_p_rows], dtype=torch.float64, device=device
            )  # [P]
            if len(top_p_rows) == num_rows:
                probs.masked_fill_(~_top_p_keep_mask_rows(probs, top_ps), 0.0)
            else:
                top_p_index = _index(top_p_rows, device)  # [P]
                subset = probs[top_p_index]  # [P, V]
                subset.masked_fill_(~_top_p_keep_mask_rows(subset, top_ps), 0.0)
                probs[top_p_index] = subset
        # No explicit renormalisation: torch.multinomial takes unnormalised non-negative
        # weights, so zeroing the dropped tokens samples from the renormalised nucleus.
        return probs

    @staticmethod
    def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of weights [M, V], each seeded row from its own generator; returns [M]."""
        device = probs.device
        num_rows = probs.shape[0]
        sampled = torch.empty(num_rows, dtype=torch.long, device=device)  # [M]
        seeded_rows = [j for j, g in enumerate(generators) if g is not None]
        unseeded_rows = [j for j, g in enumerate(generators) if g is None]
        if unseeded_rows:
            # All rows on the global RNG are drawn in one call; they have no per-request
            # stream to protect.
            if len(unseeded_rows) == num_rows:
                return torch.multinomial(probs, 1).squeeze(1)
            unseeded_index = _index(unseeded_rows, device)  # [U]
            sampled[unseeded_index] = torch.multinomial(probs[unseeded_index], 1).squeeze(1)
        if seeded_rows:
            draws = [
                torch.multinomial(probs[j], 1, generator=generators[j])  # [1]
                for j in seeded_rows
            ]
            sampled[_index(seeded_rows, device)] = torch.cat(draws)
        return sampled
