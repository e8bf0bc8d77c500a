"""Token sampler: turns one decode step's logits into one token id per request.

Each row of the batch is sampled under its own `SamplingParams`:

* greedy rows (temperature 0 or top_k 1) take the argmax, all greedy rows in one call;
* other rows go through temperature -> top-k -> softmax -> top-p -> multinomial, the
  elementwise steps batched over all sampled rows, and the draw done row by row with that
  row's `torch.Generator`.

Drawing row by row is what makes a seeded request reproducible: a row's random stream
is consumed only by that row, so its tokens do not depend on which other requests share
the batch (the same guarantee vLLM gives for per-request seeds). Rows without a generator
share the global RNG and are drawn together in one call.

The filters are the usual ones (Holtzman et al. 2019 for top-p); their exact tie and
rounding rules are spelled out in `apply_top_k` and `top_p_keep_mask`. The sampler holds
no state between steps and is device-agnostic: it runs where the logits are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.sampling_params import SamplingParams


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


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class Sampler:
    """Samples one token per row of a batch of logits, each row under its own params.

    Stateless: one instance can serve every step. Generators, when given, must live on the
    logits' device (`torch.Generator(device=logits.device)`).
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Pick one token id per row.

        logits: [N, V], any float dtype; not modified. params[i] and generators[i] belong to
        row i; a None generator draws from the global RNG.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        num_rows, vocab_size = logits.shape
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"need one SamplingParams and one generator per logits row: got "
                f"{num_rows} rows, {len(params)} params, {len(generators)} generators"
            )
        if num_rows == 0:
            return []
        device = logits.device

        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy_rows) == num_rows:
            return logits.argmax(dim=-1).tolist()

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [N]
        if greedy_rows:
            greedy_index = _index(greedy_rows, device)  # [G]
            token_ids[greedy_index] = logits[greedy_index].argmax(dim=-1)

        if len(random_rows) == num_rows:
            random_index = None
            random_logits = logits  # [M, V], M == N
        else:
            random_index = _index(random_rows, device)  # [M]
            random_logits = logits[random_index]  # [M, V]
        random_params = [params[i] for i in random_rows]
        random_generators = [generators[i] for i in random_rows]
        sampled = self._sample_random_rows(
            random_logits, random_params, random_generators, vocab_size
        )  # [M]
        if random_index is None:
            token_ids = sampled
        else:
            token_ids[random_index] = sampled
        # One device-to-host copy for the whole batch.
        return token_ids.tolist()

    @staticmethod
    def _sample_random_rows(
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
    ) -> torch.Tensor:
        """Temperature -> top-k -> softmax -> top-p -> multinomial. logits: [M, V]; returns [M]."""
        device = logits.device
        num_rows = len(params)
        temperatures = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=device
        )  # [M]
        # Out of place on purpose: `logits` may be the caller's tensor.
        scaled = logits.to(torch.float32).div(temperatures.unsqueeze(1))  # [M, V]

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
