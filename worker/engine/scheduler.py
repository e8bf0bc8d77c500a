"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` new tokens: first to
running sequences in admission order (a decoding sequence needs one, a sequence mid-prefill
gets as much of its remaining prompt as the budget allows), then to waiting sequences, oldest
first, while sequence slots and KV blocks last. When a running sequence cannot get a KV block,
the most recently admitted running sequence is preempted: its blocks are freed and it goes
back to the front of the queue to be recomputed later (recompute beats swapping on CPU, and
it keeps the block pool the single source of truth). Preemption victims are always the
youngest, so the oldest requests keep making progress and the system cannot livelock.

A sequence can also be paused (`pause`: out of both queues, its blocks kept) and resumed at the
front of the queue (`resume`): what a live migration holds still (`worker.engine.request_lifecycle`).

With prefix caching on in the block manager, a sequence admitted with no blocks (new, or
preempted) starts at its longest cached prefix: its table begins with those shared blocks and its
``num_computed_tokens`` with their tokens, so the token budget is spent only on the rest (a
preempted sequence usually finds most of its own blocks still cached). The first admission's hit
is the request's ``num_cached_tokens``. Each running sequence's newly computed full blocks are
named for reuse before it grows, and a finished or preempted one's before its blocks are freed.
A waiting sequence whose next uncached block another running sequence is computing (a burst of
requests behind one new system prompt) never computes the same KV again (vLLM computes the shared
prompt once in such a burst too). If that sequence's chunk in this very step completes the blocks
the two share, the waiting one rides along (`BlockManager.ride_in_flight`): its table starts with
them and this step computes only its tail, after them in the same forward pass (each layer writes
the step's KV before it attends). Otherwise it is passed over until the block is named, then starts
after it; those behind it in the queue are admitted meanwhile, and it keeps its place in line. If
the step's forward pass fails, `unwind_riders` puts the riders back in line as they were.
The scheduler is the one writer of a request's progress (``Sequence.num_computed_tokens``,
checked by `tests/test_boundaries.py`): a step that went well reports its batch back
(`update_from_output`, as vLLM's scheduler and nano-vllm's ``postprocess``), and KV that arrives
outside a scheduled step (a layer-by-layer pass finishing, a migration's import, a hand-off) is
recorded through `record_computed`; admission, preemption and unwinding set it here too.
`admit_next` (prefill while weights arrive) looks nothing up: a pass begun layer by layer must hold
its whole prompt to be handed to a loaded helper at a layer (`worker.transfer.layer_handoff`), and nothing
is cached before the last layer lands anyway.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.kv.block_manager import NO_HIT, BlockManager, PrefixHit
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one engine step computes: per sequence, how many of its pending tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences admitted on blocks this step computes (in `seqs` too; see `Scheduler.unwind_riders`).
    riders: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def awaits_first_token(self) -> bool:
        """Whether some unfinished request has produced no token yet (background work that would
        delay a first token waits for this to clear)."""
        return any(seq.num_output_tokens == 0 for queue in (self.waiting, self.running) for seq in queue)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        computed_through: dict[str, int] = {}  # sequences of this step: their computed tokens after it
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow_or_preempt(seq, num_new, batch):
                break  # seq itself was preempted: everything after it already was
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            computed_through[seq.request_id] = seq.num_computed_tokens + num_new
            budget -= num_new
            index += 1
        if batch.preempted:
            return batch  # memory is tight: admit nothing new this step
        passed_over: list[Sequence] = []  # waiting for a block another sequence is computing
        running_ids = {seq.request_id for seq in self.running}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._find_cached_prefix(seq)
            if hit.computing_by in computed_through:  # computing it in this step: ride along
                hit = self.block_manager.ride_in_flight(seq.request_id, seq.token_ids, seq.num_prompt_tokens, hit,
                                                        computed_through[hit.computing_by])
            if hit.computing_by in running_ids:
                passed_over.append(self.waiting.popleft())
                continue
            start = seq.num_computed_tokens + hit.num_tokens
            num_new = seq.num_tokens - start  # only what is not cached costs budget
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            elif num_new > budget and batch.seqs:
                break  # an unchunked prefill waits for a step of its own
            if not self.block_manager.can_allocate(seq.request_id, start + num_new, hit):
                break
            self._admit(seq, num_new, hit)
            running_ids.add(seq.request_id)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            computed_through[seq.request_id] = seq.num_computed_tokens + num_new
            if hit.num_in_flight:
                batch.riders.append(seq)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))  # back in their places, first in line
        return batch

    def unwind_riders(self, batch: ScheduledBatch) -> None:
        """After `batch`'s forward pass failed: its riders' shared blocks were never computed, so
        each goes back to the front of the queue as it was before admission (no blocks, nothing
        computed or cached), to look its prefix up again. The others need nothing: a failed step
        advanced none of them."""
        for seq in reversed(batch.riders):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
            seq.num_computed_tokens = 0
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def admit_next(self, max_num_tokens: int) -> tuple[Sequence, int] | None:
        """Admits the oldest waiting sequence for its next chunk (at most `max_num_tokens` tokens)
        outside `schedule`, when a sequence slot and the chunk's KV blocks are free: returns
        (seq, num_new), else None. The caller computes that chunk itself and reports it with
        `update_from_output` when it is done; it must not call `schedule` meanwhile, which would
        schedule the chunk again. No cached prefix is looked up (see the module docstring).
        (Used while weights are still arriving: `worker.engine.zigzag_prefill`.)"""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        seq = self.waiting[0]
        num_new = min(seq.num_tokens - seq.num_computed_tokens, max_num_tokens)
        if not self.block_manager.can_allocate(seq.request_id, seq.num_computed_tokens + num_new):
            return None
        self._admit(seq, num_new)
        return seq, num_new

    def update_from_output(self, batch: ScheduledBatch) -> None:
        """`batch`'s forward pass went well: each of its sequences now has KV for the chunk it was
        given (a step that raised reports nothing: `unwind_riders`)."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new

    def record_computed(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` has KV for its first ``num_tokens`` tokens, written outside a scheduled step (a
        migration's copied or recomputed KV, a hand-off's last layers); a paused request's only."""
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"request {seq.request_id!r} has {seq.num_tokens} tokens, not KV for {num_tokens}")
        seq.num_computed_tokens = num_tokens

    def _admit(self, seq: Sequence, num_new: int, hit: PrefixHit = NO_HIT) -> None:
        self.block_manager.allocate(seq.request_id, seq.num_computed_tokens + hit.num_tokens + num_new, hit)
        if hit.num_queried_tokens:  # looked up: it starts after its cached prefix
            seq.num_computed_tokens = hit.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
            self.block_manager.claim_uncomputed_blocks(seq.request_id, seq.token_ids, seq.num_prompt_tokens)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _grow_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Makes room for ``seq``'s next ``num_new`` tokens, preempting the youngest running
        sequences as needed. Returns False if ``seq`` itself had to be preempted."""
        self._cache_computed(seq)
        total = seq.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(seq.request_id, total):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq.request_id, total)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._cache_computed(seq)  # what it computed outlives it: its recompute will hit most of it
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def pause(self, seq: Sequence) -> None:
        """Takes ``seq`` out of both queues, keeping its blocks: it is neither scheduled nor chosen
        for preemption until `resume` (a request held by a live migration). Idempotent."""
        self._dequeue(seq)
        seq.status = SequenceStatus.PAUSED

    def resume(self, seq: Sequence) -> None:
        """Queues a paused ``seq`` again, first in line; `schedule` grows its block table and
        computes whatever KV it lacks."""
        if seq.status is not SequenceStatus.PAUSED:
            raise ValueError(f"request {seq.request_id!r} is {seq.status.value}, not paused")
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retires ``seq`` (running, waiting or paused) and frees its blocks."""
        self._dequeue(seq)
        self._cache_computed(seq)
        self.block_manager.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The cached prefix a sequence with no blocks and no KV starts from; `NO_HIT` for one that
        keeps its own (paused and resumed, imported by a migration)."""
        if seq.num_computed_tokens or self.block_manager.block_table(seq.request_id):
            return NO_HIT
        return self.block_manager.find_cached_prefix(seq.request_id, seq.token_ids, seq.num_prompt_tokens)

    def _cache_computed(self, seq: Sequence) -> None:
        """Names the sequence's full blocks whose KV is computed, for later prefixes to reuse."""
        self.block_manager.cache_full_blocks(seq.request_id, seq.token_ids, seq.num_prompt_tokens,
                                             seq.num_computed_tokens)

    def _dequeue(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
