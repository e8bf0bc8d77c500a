"""Every request an engine holds, from admission to retirement, and the KV blocks it owns.

`RequestLifecycle` is the engine's request table (``Engine.requests``): each admitted request's
`Sequence` and its `IncrementalDetokenizer`, kept until the request is retired. The engine admits
requests through it and retires them through it when they finish or fail.

It is also the engine's public surface for moving a request between engines, in the spirit of
vLLM v1's KV connector: the lifecycle operations and the KV block copies that live migration
(`worker.transfer.engine_migration`) and the partial-prefill hand-off (`worker.transfer.layer_handoff`) are built
from, so neither reaches into the engine, its scheduler or its model runner:

- ``snapshot``: the request's state without its KV (`RequestSnapshot`);
- ``pause`` / ``resume``: hold a request still (out of the scheduler's queues and out of a
  layer-by-layer prefill pass, its KV blocks kept) and queue it again, first in line;
- ``adopt``: take in a request built elsewhere, paused; ``replay``: append tokens it already
  generated (through its detokenizer, emitting nothing: its client has the text);
- ``retire``: finish it with a reason (``"migrated"`` for one handed over) and free its blocks;
- ``blocks_short`` / ``reserve``: whether a request's blocks can grow, and grow them;
- ``read_kv`` / ``write_kv`` / ``compute_kv`` / ``compute_kv_from_layer`` / ``record_computed``: copy KV blocks out of
  and into the pool, or compute a paused request's KV from its tokens (a token-based migration's
  catch-up) or from the hidden state a layer-by-layer prefill reached elsewhere (the hand-off);
- ``layer_pass``: where its layer-by-layer prefill stands (`worker.engine.zigzag_prefill.LayerPass`).

Like the engine it is single threaded: call it on the thread that steps the engine, between two
steps (`AsyncEngine.call`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from worker.text.detokenizer import IncrementalDetokenizer
from worker.engine.model_runner import ModelRunner, kv_bytes_per_block
from worker.engine.request_output import RequestOutput
from wire.request_snapshot import RequestSnapshot
from worker.models.rotary_embedding import rope_lengths_of_span
from worker.engine.scheduler import ScheduledBatch, Scheduler
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus
from worker.text.tokenizer import Tokenizer
from worker.engine.zigzag_prefill import LayerPass, ZigzagPrefill
from wire import TokenLogprobs

__all__ = ["RequestLifecycle", "UnknownRequestError", "request_output"]


class UnknownRequestError(LookupError):
    """The request is not in this engine (any more): it finished, was aborted, or never came."""


@dataclass
class _Tracked:
    seq: Sequence
    detokenizer: IncrementalDetokenizer


def request_output(seq: Sequence, new_token_ids: tuple[int, ...] = (), text: str = "",
                   logprobs: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
    """The news about `seq` after a step: its new tokens and text (with their log-probabilities, if
    it asked for them), and whether (and why) it finished."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        new_text=text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        logprobs=logprobs,
        num_cached_tokens=seq.num_cached_tokens,
    )


class RequestLifecycle:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer, *,
                 layer_prefill: ZigzagPrefill | None = None) -> None:
        """`layer_prefill`: the engine's layer-by-layer prefill while its weights arrive. It is
        kept for the engine's life: once the weights are in it holds no pass and never takes one."""
        self._scheduler = scheduler
        self._runner = runner
        self._tokenizer = tokenizer
        self._layer_prefill = layer_prefill
        self._tracked: dict[str, _Tracked] = {}

    # ---- the request table ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracked

    def request_ids(self) -> list[str]:
        """Every request held, in admission order."""
        return list(self._tracked)

    def find(self, request_id: str) -> Sequence | None:
        """The request's `Sequence`, or None if it is not here."""
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.seq

    def sequence(self, request_id: str) -> Sequence:
        """The request's `Sequence`; raises `UnknownRequestError` if it is not here."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            raise UnknownRequestError(f"request {request_id!r} is not on this instance (finished, aborted or "
                                      "never here)")
        return tracked.seq

    def detokenizer(self, request_id: str) -> IncrementalDetokenizer:
        """The request's detokenizer (the engine feeds it each sampled token)."""
        self.sequence(request_id)
        return self._tracked[request_id].detokenizer

    def admit(self, seq: Sequence) -> None:
        """Tracks a new request and queues it. Raises `ValueError` if its id is in use (the engine
        checks first and says so to its caller)."""
        self._track(seq)
        self._scheduler.add(seq)

    def retire(self, request_id: str, reason: FinishReason) -> RequestOutput:
        """Finishes the request wherever it is (queued, running, in a layer pass, paused) with
        `reason`, frees its KV blocks and forgets it; returns its final output, with no new tokens."""
        seq = self.sequence(request_id)
        if self._layer_prefill is not None:
            self._layer_prefill.drop(seq)
        self._scheduler.finish(seq, reason)
        del self._tracked[request_id]
        return request_output(seq)

    # ---- moving a request -------------------------------------------------------------------

    def snapshot(self, request_id: str) -> RequestSnapshot:
        """The request's state now, without its KV; the request is untouched (the generator's
        state is copied)."""
        seq = self.sequence(request_id)
        generator = seq.generator
        return RequestSnapshot(
            request_id=seq.request_id,
            prompt_token_ids=tuple(seq.prompt_token_ids),
            output_token_ids=tuple(seq.output_token_ids),
            params=seq.params,
            num_computed_tokens=seq.num_computed_tokens,
            generator_state=None if generator is None else generator.get_state().numpy().tobytes(),
            generator_device_type="cpu" if generator is None else generator.device.type,
        )

    def pause(self, request_id: str) -> Sequence:
        """Holds the request still: out of the scheduler's queues and out of its layer-by-layer
        prefill pass, if any, keeping its KV blocks and ``num_computed_tokens``; it is neither
        scheduled nor preempted until `resume` or `retire`. Idempotent; returns its `Sequence`."""
        seq = self.sequence(request_id)
        if self._layer_prefill is not None:
            self._layer_prefill.drop(seq)
        self._scheduler.pause(seq)
        return seq

    def resume(self, request_id: str) -> None:
        """Queues a paused request again, first in line; a request that is not paused is left alone."""
        seq = self.sequence(request_id)
        if seq.status is SequenceStatus.PAUSED:
            self._scheduler.resume(seq)

    def adopt(self, seq: Sequence) -> None:
        """Tracks a request built elsewhere (an import), paused: `resume` schedules it. Its
        detokenizer is built as every request's is. Raises `ValueError` if its id is in use."""
        self._track(seq)
        seq.status = SequenceStatus.PAUSED

    def replay(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Appends tokens the request already generated elsewhere, through its detokenizer,
        emitting nothing (its client received their text from where they were generated)."""
        self.sequence(request_id)
        tracked = self._tracked[request_id]
        for token_id in token_ids:
            tracked.seq.append_token(token_id)
            tracked.detokenizer.append(token_id)

    def layer_pass(self, request_id: str) -> LayerPass | None:
        """Where the request's layer-by-layer prefill pass stands; None if it is in none."""
        seq = self.sequence(request_id)
        return None if self._layer_prefill is None else self._layer_prefill.layer_pass(seq)

    # ---- KV blocks -------------------------------------------------------------------------

    @property
    def kv_pool_shape(self) -> tuple[int, ...]:
        """The KV pool's shape: [L, 2, num_blocks, block_size, Hkv, D]."""
        return tuple(self._runner.kv_pool.shape)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across all layers (what one block costs to copy)."""
        return kv_bytes_per_block(self._runner.config, self._runner.block_size, self._runner.kv_pool.dtype)

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._scheduler.block_manager.block_size

    def blocks_short(self, request_id: str, num_tokens: int) -> tuple[int, int] | None:
        """(blocks missing, blocks free) when the request's table (none for a request not yet
        here) cannot grow to hold ``num_tokens`` tokens from the free blocks; None when it can."""
        manager = self._scheduler.block_manager
        if manager.can_allocate(request_id, num_tokens):
            return None
        return manager.num_missing_blocks(request_id, num_tokens), manager.num_free_blocks

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Grows a request's block table to hold ``num_tokens`` tokens; returns the new block ids.
        Check `blocks_short` first: what does not fit raises the block manager's error."""
        self.sequence(request_id)
        return self._scheduler.block_manager.allocate(request_id, num_tokens)

    def block_table(self, request_id: str) -> list[int]:
        """The request's KV block ids, in token order."""
        self.sequence(request_id)
        return self._scheduler.block_manager.block_table(request_id)

    def read_kv(self, block_ids: list[int], num_layers: int | None = None) -> torch.Tensor:
        """A copy of the given blocks of the KV pool, of its first `num_layers` layers (all if None):
        [num_layers, 2, len(block_ids), block_size, Hkv, D]."""
        pool = self._runner.kv_pool  # [L, 2, num_blocks, block_size, Hkv, D]
        if num_layers is not None:
            pool = pool[:num_layers]
        index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)  # [n]
        return pool.index_select(2, index)

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Writes kv [l, 2, len(block_ids), block_size, Hkv, D] into those blocks of the pool's first
        l layers (l <= L). Raises `ValueError` if kv does not have that shape."""
        pool = self._runner.kv_pool  # [L, 2, num_blocks, block_size, Hkv, D]
        expected = (pool.shape[1], len(block_ids), *pool.shape[3:])
        if kv.dim() != 6 or kv.shape[0] > pool.shape[0] or tuple(kv.shape[1:]) != expected:
            raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not fit {len(block_ids)} blocks of a pool of "
                             f"shape {tuple(pool.shape)}")
        index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)  # [n]
        pool[:kv.shape[0]].index_copy_(2, index, kv.to(device=pool.device, dtype=pool.dtype))

    def compute_kv(self, request_id: str, num_new_tokens: int) -> int:
        """One forward pass of a paused request alone over its next `num_new_tokens` tokens, writing
        their KV into blocks already reserved for them; returns how many tokens have KV now. The span
        must end before the request's last token, so nothing is sampled (no logits are made)."""
        seq = self.sequence(request_id)
        if seq.status is not SequenceStatus.PAUSED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not paused")
        if not 0 < num_new_tokens < seq.num_tokens - seq.num_computed_tokens:
            raise ValueError(f"request {request_id!r} has {seq.num_tokens - seq.num_computed_tokens} tokens without "
                             f"KV; compute 1 to {seq.num_tokens - seq.num_computed_tokens - 1} of them, not "
                             f"{num_new_tokens}")
        batch = ScheduledBatch(seqs=[seq], num_new_tokens=[num_new_tokens])
        self._runner.execute(batch, [self.block_table(request_id)])
        self._scheduler.update_from_output(batch)
        return seq.num_computed_tokens

    @torch.inference_mode()
    def compute_kv_from_layer(self, request_id: str, first_layer: int, hidden: torch.Tensor) -> None:
        """Writes the KV of layers ``first_layer``..L-1 for a paused request's first T tokens, computed
        from ``hidden`` [T, H], the state entering ``first_layer`` there (the KV of the layers before
        it is the caller's to write: `write_kv`); its blocks must be reserved. Then T tokens have KV.
        T must stop short of the last token, whose logits the request's next step computes.
        (A prefill begun layer by layer on an engine still loading, finished here: `worker.transfer.layer_handoff`.)"""
        seq = self.sequence(request_id)
        num_tokens = hidden.shape[0]
        if seq.status is not SequenceStatus.PAUSED or seq.num_computed_tokens != 0:
            raise ValueError(f"request {request_id!r} must be paused with no KV computed")
        if not 0 < num_tokens < seq.num_tokens:
            raise ValueError(f"request {request_id!r} has {seq.num_tokens} tokens; compute KV for 1 to "
                             f"{seq.num_tokens - 1} of them, not {num_tokens}")
        runner = self._runner
        table = self.block_table(request_id)
        ids = torch.tensor(seq.token_ids[:num_tokens], dtype=torch.int64, device=runner.device)  # [T]
        positions = torch.arange(num_tokens, dtype=torch.int64, device=runner.device)  # [T]
        lengths = torch.tensor(rope_lengths_of_span(seq.num_prompt_tokens, 0, num_tokens), dtype=torch.int64,
                               device=runner.device)  # [T]: longrope picks its set by them
        _, cos, sin = runner.embed(ids, positions, lengths)  # the rope tables; the embedding is the hidden's past
        hidden = hidden.to(device=runner.device, dtype=runner.config.torch_dtype)  # [T, H]
        metadata = AttentionMetadata.build(block_tables=[table], query_lens=[num_tokens], seq_lens=[num_tokens],
                                           block_size=runner.block_size, device=runner.device)
        runner.execute_layers(first_layer, runner.config.num_hidden_layers, hidden, cos, sin, metadata)
        self._scheduler.record_computed(seq, num_tokens)

    def record_computed(self, request_id: str, num_tokens: int) -> int:
        """A paused request has KV for its first ``num_tokens`` tokens now (blocks copied in by
        `write_kv`, or a migration's import trimming what its next step recomputes); returns it.
        The scheduler records it: it is the one writer of a request's progress."""
        seq = self.sequence(request_id)
        if seq.status is not SequenceStatus.PAUSED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not paused")
        self._scheduler.record_computed(seq, num_tokens)
        return num_tokens

    def _track(self, seq: Sequence) -> None:
        if seq.request_id in self._tracked:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        detokenizer = IncrementalDetokenizer(self._tokenizer, seq.prompt_token_ids, stop=seq.params.stop,
                                             skip_special_tokens=seq.params.skip_special_tokens)
        self._tracked[seq.request_id] = _Tracked(seq, detokenizer)
