"""The engine's side of live migration: take a request out as a snapshot, bring one in, and
move its KV blocks — all without disturbing the other requests in the batch.

These are plain functions over an `Engine`, not methods on it, so the engine stays about serving
and this file is the one place that knows the migration protocol. They are built only on the
engine's public surface for moving requests (``engine.requests``, a
`worker.engine.request_lifecycle.RequestLifecycle`: snapshot, pause, resume, adopt, replay, retire, KV
blocks in and out) and its block manager's check/commit pair. They change the engine's state, so
they run on the thread that steps it, between two steps (`AsyncEngine.call` does that); a
function here either finishes its change or raises before making one, so a failed call leaves
the engine as it was.

Source side: `export_request` (read-only), `freeze_request` (stop scheduling it, keep its KV),
`unfreeze_request` (the migration failed, or its driver went silent: carry on), `release_request`
(handed over: retire it as ``"migrated"`` and free its blocks; refused if the request runs again),
`export_kv` (a snapshot and the KV blocks that match it, taken at the same instant). Nothing here
keeps time: how long a freeze may last is the caller's lease (`migration.engine_endpoint`).

Destination side, in order: `begin_import` (the handshake: creates the request *paused*,
holding reserved blocks, or raises `MigrationRefusedError`), then any of `extend_import` (newer
tokens), `prefill_import` (recompute KV for tokens it has: token-based migration) and
`import_kv` (write copied KV blocks: KV migration), then `commit_import` (last tokens, the
sampler's generator) and `unfreeze_request` (schedule it). `cancel_import` undoes all of it and
frees every block. `import_request` does the whole thing in one call. The handshake compares
the snapshot's checkpoint (`RequestSnapshot.checkpoint_id`) with this instance's, given by the
caller (`worker.loading.checkpoint_identity`): a request computed by other weights is refused, whatever
its shapes and vocabulary. A snapshot with no checkpoint (rebuilt from a client's transcript) is
only checked against the vocabulary.

`request_progress` reads where a request stands (queued, running, frozen, how far computed) for
a client whose stream went quiet.

A paused request (`SequenceStatus.PAUSED`) is tracked by the engine and owns KV blocks, but sits
in neither of the scheduler's queues: it is never scheduled and never chosen for preemption, so
its blocks and its KV stay exactly as they are until the migration resumes or retires it.

The destination never trusts the source's KV to be complete: it counts the positions it holds
KV for in ``num_computed_tokens`` (contiguous from 0), and the scheduler recomputes whatever is
missing once the request is resumed. So both methods end the same way, and a KV migration whose
last copy came up short degrades to a short recompute instead of a wrong answer.
"""

from __future__ import annotations

import torch

from worker.engine.engine import Engine
from worker.engine.request_lifecycle import UnknownRequestError
from worker.engine.request_output import RequestOutput
from worker.transfer.request_progress import RequestProgress, RequestState
from wire.request_snapshot import RequestSnapshot
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "MigrationRefusedError", "UnknownRequestError", "begin_import", "cancel_import", "check_checkpoint",
    "commit_import", "export_kv", "export_request", "extend_import", "freeze_request", "import_kv", "import_request",
    "kv_blocks_per_call", "prefill_import", "read_kv_blocks", "release_request", "request_progress",
    "reserve_blocks", "unfreeze_request", "write_kv_blocks",
]


class MigrationRefusedError(RuntimeError):
    """The destination cannot take the request (KV blocks, id in use, incompatible cache, another
    checkpoint), or the source no longer holds it stopped (it runs there again).
    The refusing call changed nothing; the message says why."""


# ---- source side ---------------------------------------------------------------------------


def export_request(engine: Engine, request_id: str) -> RequestSnapshot:
    """The request's state now; the request carries on untouched (the generator is copied)."""
    _check_resident(engine)
    return engine.requests.snapshot(request_id)


def freeze_request(engine: Engine, request_id: str) -> RequestSnapshot:
    """Stops scheduling the request, keeping its KV blocks; returns its final snapshot.
    Idempotent. Its stream stays open: `unfreeze_request` or `release_request` decides."""
    _check_resident(engine)
    engine.requests.pause(request_id)
    return engine.requests.snapshot(request_id)


def unfreeze_request(engine: Engine, request_id: str) -> None:
    """Schedules a paused request again, first in line (a frozen source request after a failed
    migration, or an imported one after `commit_import`). The scheduler grows its existing block
    table and computes whatever KV it lacks. A request that is not paused is left alone."""
    engine.requests.resume(request_id)


def release_request(engine: Engine, request_id: str) -> RequestOutput:
    """Retires a frozen request as handed over: its blocks are freed and the returned final
    output (no new tokens, ``finish_reason="migrated"``) ends its stream here."""
    seq = engine.requests.sequence(request_id)
    if seq.status is not SequenceStatus.PAUSED:  # never frozen, or unfrozen since (its freeze lapsed)
        raise MigrationRefusedError(f"request {request_id!r} is {seq.status.value} here, not frozen: it carries on "
                                    "on this instance and cannot be handed over")
    return engine.requests.retire(request_id, FinishReason.MIGRATED)


def export_kv(engine: Engine, request_id: str, first_block: int, *, include_partial: bool,
              max_bytes: int | None = None) -> tuple[RequestSnapshot, torch.Tensor]:
    """The snapshot and the request's KV blocks from table index ``first_block`` on, taken at one
    instant: the full blocks only (they never change again), or also the last, partly written one
    (``include_partial``, for a frozen request). ``max_bytes`` caps the copy (at least one block),
    so a long context is read over several calls and no single one stalls the engine for long; the
    caller sees it got them all when ``first_block + n`` reaches the snapshot's full blocks.
    Returns kv: [L, 2, n, block_size, Hkv, D]."""
    seq = engine.requests.sequence(request_id)
    block_size = engine.requests.block_size
    computed = seq.num_computed_tokens
    end_block = -(-computed // block_size) if include_partial else computed // block_size
    if max_bytes is not None:
        end_block = min(end_block, first_block + kv_blocks_per_call(engine, max_bytes))
    block_ids = engine.requests.block_table(request_id)[first_block:end_block]
    return engine.requests.snapshot(request_id), read_kv_blocks(engine, block_ids)


def kv_blocks_per_call(engine: Engine, max_bytes: int) -> int:
    """How many KV blocks fit in ``max_bytes`` (at least one): the slice one engine call copies."""
    return max(1, max_bytes // engine.requests.kv_block_bytes)


def read_kv_blocks(engine: Engine, block_ids: list[int]) -> torch.Tensor:
    """A copy of the given blocks of the KV pool: [L, 2, len(block_ids), block_size, Hkv, D]."""
    return engine.requests.read_kv(block_ids)


def write_kv_blocks(engine: Engine, block_ids: list[int], kv: torch.Tensor) -> None:
    """Writes kv [L, 2, len(block_ids), block_size, Hkv, D] into those blocks of the KV pool."""
    pool_shape = engine.requests.kv_pool_shape  # [L, 2, num_blocks, block_size, Hkv, D]
    expected = (pool_shape[0], pool_shape[1], len(block_ids), *pool_shape[3:])
    if tuple(kv.shape) != expected:
        raise MigrationRefusedError(
            f"KV blocks of shape {tuple(kv.shape)} do not fit this cache, which takes {expected} "
            "(a different model, block size or head layout)"
        )
    engine.requests.write_kv(block_ids, kv)


# ---- destination side ----------------------------------------------------------------------


def begin_import(engine: Engine, snapshot: RequestSnapshot, num_reserved_tokens: int = 0, *,
                 checkpoint_id: str | None = None) -> None:
    """The handshake: admits the request paused, with blocks reserved for ``num_reserved_tokens``
    tokens, and replays its output through a fresh detokenizer (no text is emitted: the source
    delivered it). ``checkpoint_id``: this instance's checkpoint identity, which a snapshot that
    names one must match. Raises `MigrationRefusedError`, changing nothing, if it cannot."""
    _check_resident(engine)
    if engine.asleep:  # its instance refuses first; this is the backstop
        raise MigrationRefusedError("this instance is asleep (its KV pool freed, its weights maybe in host "
                                    "memory); wake it before moving a request in")
    request_id = snapshot.request_id
    if request_id in engine.requests:
        raise MigrationRefusedError(f"request id {request_id!r} is already in use on this instance")
    check_checkpoint(snapshot, checkpoint_id)
    _check_fits(engine, snapshot)
    short = engine.requests.blocks_short(request_id, num_reserved_tokens)
    if short is not None:
        raise MigrationRefusedError(
            f"needs {short[0]} KV blocks for {num_reserved_tokens} tokens but only {short[1]} are free"
        )
    seq = Sequence(
        request_id=request_id,
        prompt_token_ids=list(snapshot.prompt_token_ids),
        params=snapshot.params,
        max_model_len=engine.max_model_len,
    )
    engine.requests.adopt(seq)  # tracked paused, with a detokenizer built the way every request's is
    engine.requests.reserve(request_id, num_reserved_tokens)
    _append_outputs(engine, seq, snapshot)


def extend_import(engine: Engine, snapshot: RequestSnapshot) -> None:
    """Appends the tokens the source generated since the last snapshot (replayed, not emitted)."""
    seq = _paused(engine, snapshot.request_id)
    _append_outputs(engine, seq, snapshot)


def reserve_blocks(engine: Engine, request_id: str, num_tokens: int) -> list[int]:
    """Grows a paused import's block table to hold ``num_tokens`` tokens (check, then commit);
    returns the new block ids. Raises `MigrationRefusedError`, changing nothing, if they are not free."""
    _paused(engine, request_id)
    short = engine.requests.blocks_short(request_id, num_tokens)
    if short is not None:
        raise MigrationRefusedError(
            f"needs {short[0]} more KV blocks for {num_tokens} tokens but only {short[1]} are free"
        )
    return engine.requests.reserve(request_id, num_tokens)


def prefill_import(engine: Engine, request_id: str, max_num_tokens: int) -> int:
    """Recomputes KV for up to ``max_num_tokens`` more of a paused import's tokens, stopping one
    short of the last (whose logits the first step after the hand-off needs); returns how many
    tokens have KV now. One forward pass of this request alone: call it repeatedly, between steps,
    so a long catch-up does not stall the other requests."""
    seq = _paused(engine, request_id)
    num_new = min(seq.num_tokens - 1 - seq.num_computed_tokens, max_num_tokens)
    if num_new <= 0:
        return seq.num_computed_tokens
    reserve_blocks(engine, request_id, seq.num_computed_tokens + num_new)
    # The span ends before the last token, so nothing is sampled (no logits are made).
    return engine.requests.compute_kv(request_id, num_new)


def import_kv(engine: Engine, snapshot: RequestSnapshot, first_block: int, kv: torch.Tensor) -> int:
    """Writes KV blocks copied from the source (``export_kv``'s, taken with ``snapshot``) at table
    index ``first_block`` on; returns how many tokens have KV now. kv: [L, 2, n, block_size, Hkv, D].
    Blocks for all of the snapshot's tokens are reserved first (refusable)."""
    seq = _paused(engine, snapshot.request_id)
    block_size = engine.requests.block_size
    if first_block * block_size > seq.num_computed_tokens:
        raise ValueError(
            f"KV blocks from index {first_block} would leave a gap: this instance holds KV for "
            f"{seq.num_computed_tokens} tokens"
        )
    _check_extends(seq, snapshot)
    pool_shape = engine.requests.kv_pool_shape  # [L, 2, num_blocks, block_size, Hkv, D]
    if kv.dim() != 6 or kv.shape[:2] != pool_shape[:2] or kv.shape[3:] != pool_shape[3:]:
        raise MigrationRefusedError(
            f"KV blocks of shape {tuple(kv.shape)} do not fit this cache of {tuple(pool_shape)} "
            "(a different model, block size or head layout)"
        )
    end_block = first_block + kv.shape[2]
    reserve_blocks(engine, snapshot.request_id, max(snapshot.num_tokens, end_block * block_size))
    _append_outputs(engine, seq, snapshot)
    table = engine.requests.block_table(snapshot.request_id)
    write_kv_blocks(engine, table[first_block:end_block], kv)
    covered = min(snapshot.num_computed_tokens, end_block * block_size)
    return engine.requests.record_computed(snapshot.request_id, max(seq.num_computed_tokens, covered))


def commit_import(engine: Engine, snapshot: RequestSnapshot) -> None:
    """Takes the source's final snapshot: the last tokens, the sampler's generator, and blocks for
    every token (refusable). The request stays paused; `unfreeze_request` starts it."""
    seq = _paused(engine, snapshot.request_id)
    _check_extends(seq, snapshot)
    generator = _generator(engine, snapshot)
    reserve_blocks(engine, snapshot.request_id, snapshot.num_tokens)
    _append_outputs(engine, seq, snapshot)
    seq.generator = generator
    # The last token's KV is computed by the first step here, which also yields the next logits.
    engine.requests.record_computed(snapshot.request_id, min(seq.num_computed_tokens, seq.num_tokens - 1))


def cancel_import(engine: Engine, request_id: str) -> RequestOutput | None:
    """Drops an import wherever it got to (paused, or already running after a commit whose answer
    was lost) and frees all its blocks; returns its final "abort" output, None if unknown."""
    return engine.abort(request_id)


def import_request(engine: Engine, snapshot: RequestSnapshot, kv: torch.Tensor | None = None, *,
                   checkpoint_id: str | None = None) -> None:
    """The whole import in one call: with ``kv`` ([L, 2, n, block_size, Hkv, D], the request's
    first n blocks) the KV is written into reserved blocks; without, the request is queued and the
    scheduler recomputes prompt + output in a prefill. Either way it continues exactly where the
    snapshot stands. Raises `MigrationRefusedError` and leaves nothing behind if it cannot
    (``checkpoint_id`` as for `begin_import`)."""
    begin_import(engine, snapshot, snapshot.num_tokens, checkpoint_id=checkpoint_id)
    try:
        if kv is not None:
            import_kv(engine, snapshot, 0, kv)
        commit_import(engine, snapshot)
    except BaseException:
        cancel_import(engine, snapshot.request_id)
        raise
    unfreeze_request(engine, snapshot.request_id)


def check_checkpoint(snapshot: RequestSnapshot, checkpoint_id: str | None) -> None:
    """Raises `MigrationRefusedError` if the snapshot names a checkpoint other than ``checkpoint_id``
    (an instance's own); a snapshot or an instance that names none is not compared."""
    if snapshot.checkpoint_id is not None and checkpoint_id is not None and snapshot.checkpoint_id != checkpoint_id:
        raise MigrationRefusedError(
            f"request {snapshot.request_id!r} was computed by checkpoint {snapshot.checkpoint_id} and this instance "
            f"serves checkpoint {checkpoint_id} (the model was deployed again with other weights); it can only move "
            "between instances of the same checkpoint"
        )


def request_progress(engine: Engine, request_id: str) -> RequestProgress:
    """Where the request stands here (`RequestProgress`); ``unknown`` if it is not here."""
    seq = engine.requests.find(request_id)
    if seq is None:
        return RequestProgress(request_id, RequestState.UNKNOWN)
    state = _PROGRESS_STATES.get(seq.status, RequestState.UNKNOWN)
    return RequestProgress(request_id, state, seq.num_tokens, seq.num_computed_tokens)


_PROGRESS_STATES = {
    SequenceStatus.WAITING: RequestState.QUEUED,
    SequenceStatus.RUNNING: RequestState.RUNNING,
    SequenceStatus.PAUSED: RequestState.FROZEN,
}


# ---- helpers -------------------------------------------------------------------------------


def _check_resident(engine: Engine) -> None:
    """A request on an instance whose weights are still arriving may be mid-way through a
    layer-by-layer prefill pass (`worker.engine.zigzag_prefill`), which migration cannot capture."""
    if engine.steps_layer_by_layer:
        raise MigrationRefusedError("this instance's weights are still arriving layer by layer; "
                                    "migrate its requests once it is fully loaded")


def _paused(engine: Engine, request_id: str) -> Sequence:
    seq = engine.requests.sequence(request_id)
    if seq.status is not SequenceStatus.PAUSED:
        raise ValueError(f"request {request_id!r} is {seq.status.value}, not a paused import")
    return seq


def _append_outputs(engine: Engine, seq: Sequence, snapshot: RequestSnapshot) -> None:
    """Brings a paused import up to the snapshot's tokens, replaying new ones through its
    detokenizer (the text was streamed by the source)."""
    _check_extends(seq, snapshot)
    engine.requests.replay(seq.request_id, snapshot.token_ids[seq.num_tokens:])


def _check_extends(seq: Sequence, snapshot: RequestSnapshot) -> None:
    token_ids = snapshot.token_ids
    if len(token_ids) < seq.num_tokens or tuple(seq.token_ids) != token_ids[:seq.num_tokens]:
        raise ValueError(f"snapshot of {snapshot.request_id!r} does not extend the tokens this instance holds")


def _check_fits(engine: Engine, snapshot: RequestSnapshot) -> None:
    vocab_size = engine.model_config.vocab_size
    if any(not 0 <= t < vocab_size for t in snapshot.token_ids):
        raise MigrationRefusedError(f"snapshot has token ids outside this model's vocabulary of {vocab_size}")
    if snapshot.num_tokens >= engine.max_model_len or snapshot.num_output_tokens >= snapshot.params.max_tokens:
        raise MigrationRefusedError(
            f"request {snapshot.request_id!r} has no token left to generate here "
            f"({snapshot.num_tokens} tokens, context {engine.max_model_len})"
        )
    needed = engine.admission.kv_shortfall(snapshot.num_prompt_tokens, snapshot.params.max_tokens)
    if needed is not None:
        raise MigrationRefusedError(
            f"request needs up to {needed} KV-cache slots but this instance's cache holds "
            f"{engine.admission.capacity_tokens}"
        )
    if snapshot.generator_state is not None and snapshot.generator_device_type != engine.device.type:
        raise MigrationRefusedError(
            f"the request's sampler state is for a {snapshot.generator_device_type} generator; this instance "
            f"samples on {engine.device.type}"
        )


def _generator(engine: Engine, snapshot: RequestSnapshot) -> torch.Generator:
    """The source's generator, continued; or, with no state to carry, one seeded as on admission."""
    generator = torch.Generator(device=engine.device)
    if snapshot.generator_state is not None:
        generator.set_state(torch.frombuffer(bytearray(snapshot.generator_state), dtype=torch.uint8))
    elif snapshot.params.seed is not None:
        generator.manual_seed(snapshot.params.seed)
    else:
        generator.seed()
    return generator
