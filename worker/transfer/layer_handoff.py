"""A prefill half-computed on an instance still receiving its weights, finished by one that has them all.

BlitzScale's helper: a new instance runs a queued prompt through the layers it has (zigzag,
`worker.engine.zigzag_prefill`) and, instead of waiting for the rest, hands the batch to an instance
that holds every layer. The request moves with what was computed: the hidden state entering
layer k and the KV of layers < k. The helper runs layers k..N-1 from that hidden state, writes
their KV, and from then on the request is one of its own -- decoding continues there, with the
full KV cache in one place.

Functions over engines, on the thread that steps each (as `worker.transfer.engine_migration`'s), built on
the engine's public request surface (``engine.requests``: `RequestLifecycle.layer_pass`, ``pause``,
``snapshot``, KV blocks in and out) and the migration import:

- `export_partial_prefill` (the new instance): takes the request out of its layer-wise pass at
  the layer it reached and freezes it, returning a `PartialPrefill`. Its stream stays open and its
  blocks held: once the helper has it, `engine_migration.release_request` retires it as
  ``"migrated"`` (a follower resumes it on the helper); if the helper fails,
  `engine_migration.unfreeze_request` queues it again and a new pass prefills it from layer -1.
  `hand_over_prefill` is both steps at once;
- `take_over_prefill` (the helper): admits it through the migration import (refusable, undone
  on any failure), writes the KV of layers < k, computes layers k..N-1 for every prompt token
  but the last, and schedules it. Its first step computes the last prompt token through every
  layer and samples the first output token -- the same hand-off point as a KV migration
  (`commit_import`), so the sampler's generator and the output's arithmetic are the migration
  path's, and greedy output equals an unmoved run's.

Only a prompt prefilled in one pass can move at a layer (a longer prompt's first chunk would
leave the rest uncomputed on either side); such a request waits for the weights instead. A
request whose pass has not started (no layer computed) moves with no hidden state, and the
helper prefills it from its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.engine import Engine
from worker.transfer.engine_migration import (MigrationRefusedError, begin_import, cancel_import, commit_import,
                                              release_request, unfreeze_request)
from worker.engine.request_output import RequestOutput
from wire.request_snapshot import RequestSnapshot


@dataclass(frozen=True)
class PartialPrefill:
    """A prompt computed through layers -1..next_layer-1 (``next_layer`` 0..N; -1: not started).

    hidden: [T, H] the state entering layer ``next_layer`` for the T prompt tokens (None if not started).
    kv: [min(next_layer, N), 2, n, block_size, Hkv, D] the KV of the layers done, for the request's n blocks."""

    snapshot: RequestSnapshot
    next_layer: int
    hidden: torch.Tensor | None
    kv: torch.Tensor


def hand_over_prefill(engine: Engine, request_id: str) -> tuple[PartialPrefill, RequestOutput]:
    """`export_partial_prefill` then `release_request`: the request's state and its final
    ``"migrated"`` output here, in one call (for a caller that cannot fail after it)."""
    partial = export_partial_prefill(engine, request_id)
    return partial, release_request(engine, request_id)


def export_partial_prefill(engine: Engine, request_id: str) -> PartialPrefill:
    """Takes `request_id` out of its layer-wise prefill on `engine` and freezes it (see the module
    docstring). Raises `MigrationRefusedError`, changing nothing, when the request is not in such
    a pass or its prompt spans several passes."""
    seq = engine.requests.sequence(request_id)
    p = engine.requests.layer_pass(request_id)
    if p is None:
        raise MigrationRefusedError(f"request {request_id!r} is not in a layer-by-layer prefill pass")
    if seq.num_computed_tokens != 0 or not p.whole_prompt:
        raise MigrationRefusedError(f"request {request_id!r}'s prompt ({seq.num_prompt_tokens} tokens) spans "
                                    "several passes; it cannot move at a layer")
    num_layers = engine.model_config.num_hidden_layers
    done = max(0, min(p.next_layer, num_layers))
    table = engine.requests.block_table(request_id)
    kv = engine.requests.read_kv(table, num_layers=done)  # [done, 2, n, block_size, Hkv, D]
    hidden = p.hidden.clone() if p.hidden is not None and p.next_layer >= 0 else None
    partial = PartialPrefill(engine.requests.snapshot(request_id), p.next_layer if hidden is not None else -1,
                             hidden, kv)
    engine.requests.pause(request_id)  # out of its pass and the scheduler's queues, its blocks kept
    return partial


@torch.inference_mode()
def take_over_prefill(engine: Engine, partial: PartialPrefill, *, schedule: bool = True) -> None:
    """Finishes `partial`'s prefill on `engine`, which must hold every layer, and schedules the
    request (see the module docstring). Raises `MigrationRefusedError` and leaves nothing behind
    if it cannot take it. ``schedule=False`` leaves it paused, for a caller that opens its stream
    first and then calls `engine_migration.unfreeze_request` (or `cancel_import`)."""
    snapshot = partial.snapshot
    num_tokens = len(snapshot.prompt_token_ids)
    if snapshot.output_token_ids or snapshot.num_computed_tokens:
        raise MigrationRefusedError(f"request {snapshot.request_id!r} is past its prefill; migrate it instead")
    begin_import(engine, snapshot, num_tokens)
    try:
        if partial.hidden is not None:
            _compute_from_layer(engine, partial, num_tokens - 1)
        commit_import(engine, snapshot)
    except BaseException:
        cancel_import(engine, snapshot.request_id)
        raise
    if schedule:
        unfreeze_request(engine, snapshot.request_id)


def _compute_from_layer(engine: Engine, partial: PartialPrefill, num_rows: int) -> None:
    """Writes the KV of every layer for the first `num_rows` prompt tokens: layers < k copied,
    layers k..N-1 computed from the hidden state (causal: those rows never look at later ones)."""
    request_id = partial.snapshot.request_id
    num_layers = engine.model_config.num_hidden_layers
    first = max(0, min(partial.next_layer, num_layers))
    pool_shape = engine.requests.kv_pool_shape  # [L, 2, num_blocks, block_size, Hkv, D]
    table = engine.requests.block_table(request_id)
    expected = (first, *pool_shape[1:2], len(table), *pool_shape[3:])
    if tuple(partial.kv.shape) != expected:
        raise MigrationRefusedError(f"KV of shape {tuple(partial.kv.shape)} does not fit this cache, which takes "
                                    f"{expected} (a different model, block size or head layout)")
    if partial.hidden.shape != (num_rows + 1, engine.model_config.hidden_size):
        raise MigrationRefusedError(f"hidden state of shape {tuple(partial.hidden.shape)} does not match a "
                                    f"{num_rows + 1}-token prompt of hidden size {engine.model_config.hidden_size}")
    if first:
        engine.requests.write_kv(table, partial.kv)  # layers < first
    if num_rows == 0:
        return
    engine.requests.compute_kv_from_layer(request_id, first, partial.hidden[:num_rows])  # [T-1, H]
