"""Scheduler decisions with plain numbers: budgets, chunking, admission, preemption order, pause and resume."""

import pytest

from worker.kv.block_manager import BlockManager
from wire.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id, prompt_len, max_tokens=16):
    return Sequence(request_id=request_id, prompt_token_ids=list(range(prompt_len)),
                    params=SamplingParams(max_tokens=max_tokens), max_model_len=4096)


def run_step(scheduler, batch):
    """Stands in for the engine: report the step, append a token where the KV caught up."""
    scheduler.update_from_output(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)


def test_chunked_prefill_under_token_budget():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq("a", 13), make_seq("b", 6)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["a"] and batch.num_new_tokens == [10]
    run_step(s, batch)
    batch = s.schedule()  # a finishes its prompt (3), b gets the rest of the budget (6 <= 7)
    assert [x.request_id for x in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [3, 6]
    run_step(s, batch)
    batch = s.schedule()  # both decode
    assert batch.num_new_tokens == [1, 1]
    assert s.block_manager.block_table("a") == [0, 1, 2, 3]  # 15 tokens -> 4 blocks


def test_without_chunking_a_long_prompt_waits_for_its_own_step():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(make_seq("short", 4))
    s.add(make_seq("long", 25))
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["short"]
    run_step(s, batch)
    s.finish(batch.seqs[0], FinishReason.STOP)
    batch = s.schedule()  # alone in the step, it may exceed the budget rather than starve
    assert [x.request_id for x in batch.seqs] == ["long"] and batch.num_new_tokens == [25]


def test_max_num_seqs_limits_admission():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for name in "abc":
        s.add(make_seq(name, 3))
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["a", "b"]
    assert s.num_waiting == 1


def test_preempts_youngest_and_requeues_it_first():
    # 6 blocks of 2 tokens. a, b, c each have 3-token prompts (2 blocks each): pool full.
    s = Scheduler(BlockManager(6, 2), max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make_seq(n, 3) for n in "abc"]
    for seq in seqs:
        s.add(seq)
    run_step(s, s.schedule())  # all prefilled, each now 4 tokens, needs no new block yet
    batch = s.schedule()
    assert batch.num_new_tokens == [1, 1, 1] and not batch.preempted
    run_step(s, batch)  # each has 5 tokens; next step needs a third block each
    batch = s.schedule()
    # a needs a block and none is free: c (the youngest) is preempted, freeing 2; a and b take one each.
    assert [x.request_id for x in batch.preempted] == ["c"]
    assert [x.request_id for x in batch.seqs] == ["a", "b"]
    c = seqs[2]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(s.waiting) == [c] and s.num_preemptions == 1
    assert s.block_manager.num_free_blocks == 0
    # finishing a frees room; c is readmitted first and recomputes prompt + generated tokens
    run_step(s, batch)
    s.finish(seqs[0], FinishReason.LENGTH)
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["b", "c"]
    assert batch.num_new_tokens == [1, 5]


def test_a_sequence_that_cannot_grow_preempts_itself_last():
    s = Scheduler(BlockManager(2, 2), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq("a", 2), make_seq("b", 2)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # each 3 tokens, 1 block each, both need a 2nd block next
    batch = s.schedule()
    assert [x.request_id for x in batch.preempted] == ["b"]
    assert [x.request_id for x in batch.seqs] == ["a"]


def test_abort_from_waiting_and_running_frees_blocks():
    bm = BlockManager(10, 4)
    s = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = make_seq("a", 5), make_seq("b", 5)
    s.add(a)
    s.add(b)
    s.schedule()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    s.finish(b, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert not s.has_unfinished() and bm.num_free_blocks == 10
    assert a.finish_reason is FinishReason.ABORT and a.is_finished


def test_a_paused_sequence_keeps_its_blocks_is_never_scheduled_and_resumes_first_in_line():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = make_seq("a", 6), make_seq("b", 3), make_seq("c", 5)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # a: 6 tokens of KV in blocks [0, 1]; b: 3 in [2]
    s.add(c)
    s.pause(a)
    s.pause(a)  # idempotent
    assert a.status is SequenceStatus.PAUSED and s.running == [b] and list(s.waiting) == [c]
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["b", "c"] and batch.num_new_tokens == [1, 5]
    run_step(s, batch)
    assert s.block_manager.block_table("a") == [0, 1] and a.num_computed_tokens == 6
    s.resume(a)
    assert a.status is SequenceStatus.WAITING and list(s.waiting) == [a]
    batch = s.schedule()  # a's last token is computed into its own blocks
    assert [x.request_id for x in batch.seqs] == ["b", "c", "a"] and batch.num_new_tokens == [1, 1, 1]
    assert s.block_manager.block_table("a") == [0, 1]


def test_only_a_paused_sequence_resumes_and_a_paused_one_finishes_freeing_its_blocks():
    s = Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq("a", 6)
    s.add(a)
    run_step(s, s.schedule())
    with pytest.raises(ValueError, match=r"^request 'a' is running, not paused$"):
        s.resume(a)
    s.pause(a)
    s.finish(a, FinishReason.MIGRATED)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.MIGRATED
    assert s.block_manager.num_free_blocks == 10 and not s.has_unfinished()
