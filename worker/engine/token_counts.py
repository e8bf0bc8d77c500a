"""One request's token counts for the sampler's penalties, kept on the device and grown a step at a time.

The presence and frequency penalties need how often each vocabulary token occurs in the request's
output so far, the repetition penalty which tokens occur in its prompt or output. vLLM v1 rebuilds
them every step: the output ids of every penalised request go from Python lists to a padded tensor
and are scatter-added into fresh [N, V] counts, and the prompt ids are kept padded beside. That is
host work in the length of every sequence, every step (a 4k-token prompt is 4k ids to move for one
new token).

Here each penalised request keeps its own counts as tensors on the logits' device: ``output_counts``
[V] int32 and, for a repetition penalty, ``prompt_mask`` [V] bool, built once from the prompt.
`update` adds only the tokens sampled since the last call (normally one: a tiny host-to-device copy
and one ``index_add_``), so a step costs the same at token 10 as at token 10,000; the sampler stacks
the rows it needs ([P, V], a device copy). The price is memory: 5 bytes per vocabulary entry per
penalised request (0.75 MB for a 150k vocabulary), held only by requests that use a penalty.

The counts follow the request's tokens and nothing else, so they never need to travel: a request
moved to another engine, or preempted and recomputed, rebuilds or keeps them from its token ids.
Ids outside [0, V) are ignored (they can never be sampled, so no penalty can apply to them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TokenCounts"]


class TokenCounts:
    """Counts of one request's tokens; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str, prompt_token_ids: Sequence[int] | None = None
                 ) -> None:
        """`prompt_token_ids`: given, ``prompt_mask`` marks them (the repetition penalty needs it);
        None leaves ``prompt_mask`` None."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)  # [V]
        self.prompt_mask: torch.Tensor | None = None  # [V] bool
        if prompt_token_ids is not None:
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            ids = self._ids(prompt_token_ids)
            if ids is not None:
                self.prompt_mask[ids] = True
        self._num_counted = 0

    @property
    def num_counted(self) -> int:
        """How many output tokens ``output_counts`` holds."""
        return self._num_counted

    def update(self, output_token_ids: Sequence[int], start: int = 0) -> None:
        """Brings ``output_counts`` up to the request's output: ``output_token_ids[start:]`` (a view
        into a longer list, to spare copying it: ``seq.token_ids`` with ``start`` = the prompt's
        length). Adds only the tokens not counted yet; an output shorter than what was counted
        (never, in the engine) is counted afresh."""
        num_output = len(output_token_ids) - start
        if num_output < self._num_counted:
            self.output_counts.zero_()
            self._num_counted = 0
        if num_output == self._num_counted:
            return
        ids = self._ids(output_token_ids[start + self._num_counted:])
        if ids is not None:
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._num_counted = num_output

    def _ids(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """The ids inside the vocabulary, as a long tensor on the device; None if there are none."""
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        if not ids:
            return None
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return (f"TokenCounts(vocab_size={self.vocab_size}, device={self.device}, num_counted={self._num_counted}, "
                f"prompt_mask={self.prompt_mask is not None})")
