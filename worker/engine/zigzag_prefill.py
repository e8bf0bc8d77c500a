"""Prefills that advance layer by layer while the weights are still arriving, swept zigzag.

BlitzScale (OSDI'25) serves requests on an instance whose parameters are still streaming in: the
queued prefill batches run through the layers that have landed; a batch that reaches the loaded
frontier waits there while the next batch advances to it, and when the next layer lands the
oldest batch moves first. When the last layer lands every batch is already at (or near) the
frontier, so the first tokens come out a few layers' compute after the load instead of a whole
prefill after it.

Here the batches are single requests: `ZigzagPrefill` takes waiting requests from the scheduler
(`Scheduler.admit_next`: the request's first chunk, its KV blocks allocated) and gives each its
own partial pass -- its hidden state ``[T, H]``, rope tables and attention metadata kept between
layers. Each `step` assigns whatever layers have landed, then repeatedly runs one layer of the
*oldest* pass whose next layer is resident, until no pass can move (every pass at the frontier).
Only then does it wait, for the lowest missing layer that a pass needs, and return, so requests
that arrived meanwhile join at the next step and catch up while the older ones wait. The wait is
cut into slices of `FRONTIER_POLL_S`: a step that found nothing to run returns empty after one
slice, so the engine's thread serves its pending calls in between -- among them a hand-over of a
waiting prefill to a fully loaded helper (`worker.transfer.layer_handoff`, which reads where the pass
stands through `layer_pass`), which must not wait for the very layer it is meant to avoid waiting
for. Passes finish (final norm, head, a token to sample) in the step where the last layer is in;
the engine then goes back to the scheduler's ordinary batched steps, and the rest of a long
prompt, past its first chunk, is prefilled there.

Per-request passes run smaller GEMMs than one batched pass would; that is the price of letting
requests that arrive mid-load catch up instead of waiting for the load to finish. Greedy outputs
are those of a fully loaded engine: the arithmetic per token is the same, only grouped differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from worker.loading.layer_gate import LayerGate
from worker.engine.model_runner import ModelRunner
from worker.models.rotary_embedding import rope_lengths_of_span
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence

# How long one step waits at the frontier before returning to the engine loop (which then serves
# calls and admits new requests, and steps again). Short next to a layer's transfer, long next to
# a loop iteration.
FRONTIER_POLL_S = 0.05


@dataclass(frozen=True, eq=False)
class LayerPass:
    """Where one request's pass stands, for a helper that would finish it (`worker.transfer.layer_handoff`).

    ``next_layer``: the layer it runs next, -1 (not embedded yet) .. N (the final norm and head).
    ``hidden``: [T, H] the state entering ``next_layer`` (None before the embedding); the pass's
    own tensor, so clone it to keep it. ``whole_prompt``: the pass holds the whole prompt (its
    last row is sampled), so computing its remaining layers finishes the prefill."""

    next_layer: int
    hidden: torch.Tensor | None
    whole_prompt: bool


@dataclass(eq=False)
class _PartialPrefill:
    """One request's chunk on its way through the layers; ``next_layer`` runs -1 .. N + 1 (done)."""

    seq: Sequence
    num_new: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    rope_lengths: torch.Tensor  # [T] int64: max(prompt length, position + 1), longrope's choice of set
    metadata: AttentionMetadata
    samples: bool  # the chunk ends the prompt: its last row is sampled
    next_layer: int = -1
    hidden: torch.Tensor | None = None  # [T, H]
    cos: torch.Tensor | None = None  # [T, 1, D]
    sin: torch.Tensor | None = None  # [T, 1, D]
    logits: torch.Tensor | None = None  # [1, V] float32, once done and if it samples


class ZigzagPrefill:
    def __init__(self, runner: ModelRunner, gate: LayerGate, scheduler: Scheduler, *, max_num_tokens: int) -> None:
        """`max_num_tokens`: the longest chunk a pass takes (the engine's per-step token budget)."""
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.runner = runner
        self.gate = gate
        self.scheduler = scheduler
        self.max_num_tokens = max_num_tokens
        self.num_layers = runner.config.num_hidden_layers
        self._passes: list[_PartialPrefill] = []  # oldest first

    @property
    def num_in_flight(self) -> int:
        return len(self._passes)

    @torch.inference_mode()
    def step(self) -> tuple[torch.Tensor, list[Sequence]]:
        """Admits, advances every pass as far as the resident layers allow (oldest first), waits for
        one layer if none could move. Returns the finished passes' logits ``[S, V]`` and the S
        sequences to sample (their ``num_computed_tokens`` already advanced). Raises
        `LayerLoadError` when a layer cannot arrive."""
        self._admit()
        if not self._passes and not self.scheduler.waiting:
            return self._finish()
        if self._advance() == 0 and not self.gate.complete:
            self._wait_for_next_layer()
        return self._finish()

    def movable_request_ids(self) -> list[str]:
        """Requests whose whole prompt is in one pass that waits for a layer not in yet: what a fully
        loaded helper could take over (`worker.transfer.layer_handoff`). Safe to call from another thread
        (a snapshot of the list; a pass moving meanwhile is only a stale hint)."""
        passes = list(self._passes)
        return [p.seq.request_id for p in passes
                if p.samples and p.seq.num_computed_tokens == 0 and p.next_layer <= self.num_layers
                and not self.gate.is_assigned(p.next_layer)]

    def layer_pass(self, seq: Sequence) -> LayerPass | None:
        """Where `seq`'s pass stands (`LayerPass`); None if it is in none. Engine thread only."""
        p = next((p for p in self._passes if p.seq is seq), None)
        return None if p is None else LayerPass(p.next_layer, p.hidden, p.samples)

    def drop(self, seq: Sequence) -> None:
        """Forgets `seq`'s pass (it was aborted, or paused to be handed over; its blocks are the
        scheduler's to free or keep)."""
        self._passes = [p for p in self._passes if p.seq is not seq]

    def _admit(self) -> None:
        runner = self.runner
        while (admitted := self.scheduler.admit_next(self.max_num_tokens)) is not None:
            seq, num_new = admitted
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            metadata = AttentionMetadata.build(
                block_tables=[self.scheduler.block_manager.block_table(seq.request_id)], query_lens=[num_new],
                seq_lens=[end], block_size=runner.block_size, device=runner.device,
            )
            self._passes.append(_PartialPrefill(
                seq=seq, num_new=num_new, metadata=metadata, samples=end == seq.num_tokens,
                input_ids=torch.tensor(seq.token_ids[start:end], dtype=torch.int64, device=runner.device),
                positions=torch.arange(start, end, dtype=torch.int64, device=runner.device),
                rope_lengths=torch.tensor(rope_lengths_of_span(seq.num_prompt_tokens, start, end), dtype=torch.int64,
                                          device=runner.device),
            ))

    def _advance(self) -> int:
        """The zigzag sweep: one layer at a time, of the oldest pass whose next layer is resident.
        Returns how many layers it ran."""
        num_run = 0
        while True:
            self.gate.assign_ready()
            ready = next((p for p in self._passes
                          if p.next_layer <= self.num_layers and self.gate.is_assigned(p.next_layer)), None)
            if ready is None:
                return num_run
            self._run_layer(ready)
            num_run += 1

    def _run_layer(self, p: _PartialPrefill) -> None:
        runner, layer = self.runner, p.next_layer
        if layer == -1:
            p.hidden, p.cos, p.sin = runner.embed(p.input_ids, p.positions, p.rope_lengths)  # [T, H], the rope tables
        elif layer < self.num_layers:
            p.hidden = runner.execute_layers(layer, layer + 1, p.hidden, p.cos, p.sin, p.metadata)  # [T, H]
        else:
            if p.samples:  # normed like the runner does (all rows), then the last row to the head
                p.logits = runner.compute_logits(runner.final_norm(p.hidden)[-1:])  # [1, V]
            p.hidden = p.cos = p.sin = None
        p.next_layer += 1

    def _wait_for_next_layer(self) -> None:
        pending = [p.next_layer for p in self._passes if p.next_layer <= self.num_layers]
        self.gate.wait_for(min(pending) if pending else min(self.gate.frontier - 1, self.num_layers), FRONTIER_POLL_S)

    def _finish(self) -> tuple[torch.Tensor, list[Sequence]]:
        done = [p for p in self._passes if p.next_layer > self.num_layers]
        self._passes = [p for p in self._passes if p.next_layer <= self.num_layers]
        self.scheduler.update_from_output(ScheduledBatch(seqs=[p.seq for p in done],
                                                         num_new_tokens=[p.num_new for p in done]))
        sampled = [p for p in done if p.samples]
        if not sampled:
            return torch.empty((0, self.runner.config.vocab_size), dtype=torch.float32), []
        return torch.cat([p.logits for p in sampled]), [p.seq for p in sampled]  # [S, V]
