"""Automatic prefix caching through the scheduler and the engine.

With plain numbers (a `Scheduler` over a caching `BlockManager`): a sequence admitted after a shared
prefix was computed starts there, spends budget only on its tail and records its cached tokens; a
burst behind a prefix being computed rides along with the step that completes it (and goes back in
line if that step fails);
preemption, abort and finishing drop exactly one reference per block, so a shared block stays with
its other holder, and a preempted sequence recomputes little because its own blocks are still cached.

With a tiny fp32 model: the outputs with caching equal those without, token for token (a shared
system prompt, a whole cached prompt, a chat's next turn reusing generated blocks), and one of them
equals transformers'; the cached-token counts per request and in total are exact; longrope prompts
past the original context never reuse short prompts' blocks; and a request whose blocks are shared
migrates with its KV while the request it shares them with carries on.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_factory import make_hf_checkpoint
from worker import Engine, EngineConfig, SamplingParams
from worker.kv.block_manager import BlockManager
from worker.transfer.engine_migration import export_kv, freeze_request, import_request, release_request
from worker.kv.prefix_hasher import PrefixHasher
from worker.engine.scheduler import Scheduler
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(token_ids),
                    params=SamplingParams(max_tokens=16), max_model_len=4096)


def caching_scheduler(num_blocks: int, budget: int = 100) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK, prefix_hasher=PrefixHasher("test-model", BLOCK))
    return Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=budget)


def run_step(s, batch) -> None:
    """Stands in for the engine: report the step, append a token where the KV caught up."""
    s.update_from_output(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)


SYSTEM = list(range(100, 112))  # 3 full blocks


# ---- the scheduler, with plain numbers ----------------------------------------------------------


def test_a_sequence_starts_after_its_cached_prefix_and_spends_budget_on_its_tail_only():
    s = caching_scheduler(40, budget=10)
    a, b = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5])
    s.add(a)
    run_step(s, s.schedule())  # a: 10 of 14
    run_step(s, s.schedule())  # a: the last 4, and its first token
    s.add(b)
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [1, 3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    manager = s.block_manager
    assert manager.block_table("b")[:3] == manager.block_table("a")[:3] == [0, 1, 2]
    assert manager.block_table("b") == [0, 1, 2, 4]
    assert (manager.num_prefix_queried_tokens, manager.num_prefix_hit_tokens) == (14 + 15, 12)


def test_a_burst_behind_one_new_prefix_computes_it_once():
    s = caching_scheduler(40, budget=10)
    a, b = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5])
    other = make_seq("other", [50, 51, 52])
    for seq in (a, b, other):
        s.add(seq)
    batch = s.schedule()  # b waits for a's blocks (a is computing them); "other" behind it goes ahead
    assert [x.request_id for x in batch.seqs] == ["a"] and batch.num_new_tokens == [10]
    assert list(s.waiting) == [b, other]  # the budget went to a; b keeps its place in line
    run_step(s, batch)
    batch = s.schedule()  # a named blocks 0-1 and completes block 2 in this step: b rides along
    assert [x.request_id for x in batch.seqs] == ["a", "b", "other"] and batch.num_new_tokens == [4, 3, 3]
    assert batch.riders == [b] and not s.waiting
    assert b.num_computed_tokens == b.num_cached_tokens == 12 and s.block_manager.num_prefix_hit_tokens == 12
    manager = s.block_manager
    assert manager.block_table("b")[:3] == manager.block_table("a")[:3]
    assert [manager.ref_count(i) for i in manager.block_table("a")[:3]] == [2, 2, 2]
    assert manager.num_cached_blocks == 2  # block 2 is shared before it is named
    run_step(s, batch)
    s.schedule()  # a names block 2 (b could have too: the same block, the same name)
    assert manager.num_cached_blocks == 3


def test_a_burst_rides_along_with_the_step_that_computes_its_prefix():
    s = caching_scheduler(40, budget=40)
    a, b, c = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5]), make_seq("c", SYSTEM[:8] + [9] * 6)
    for seq in (a, b, c):
        s.add(seq)
    batch = s.schedule()  # one step: a computes the prompt, b and c only their tails
    assert [x.request_id for x in batch.seqs] == ["a", "b", "c"] and batch.num_new_tokens == [14, 3, 6]
    assert batch.riders == [b, c] and (b.num_cached_tokens, c.num_cached_tokens) == (12, 8)
    manager = s.block_manager
    a_table = manager.block_table("a")
    assert manager.block_table("b")[:3] == a_table[:3] and manager.block_table("c")[:2] == a_table[:2]
    assert manager.block_table("c")[2] not in a_table  # c's third block differs from a's
    assert [manager.ref_count(i) for i in a_table] == [3, 3, 2, 1]
    run_step(s, batch)
    s.schedule()
    assert manager.num_cached_blocks == 3 + 1  # a's three and c's own third block


def test_a_sequence_does_not_ride_on_a_block_computed_in_a_later_step():
    # a's first chunk completes blocks 0-1 but block 2 comes in a later chunk: b would have to
    # compute block 2 itself, so it waits instead (as before riding existed).
    s = caching_scheduler(40, budget=10)
    a, b = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5])
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [x.request_id for x in batch.seqs] == ["a"] and not batch.riders and list(s.waiting) == [b]
    assert [s.block_manager.ref_count(i) for i in s.block_manager.block_table("a")] == [1, 1, 1]


def test_a_failed_step_puts_its_riders_back_as_they_were():
    s = caching_scheduler(40, budget=40)
    a, b = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5])
    s.add(a)
    s.add(b)
    manager = s.block_manager
    batch = s.schedule()
    assert batch.riders == [b]
    s.unwind_riders(batch)  # the forward pass raised: block 0-2 hold no KV
    assert list(s.waiting) == [b] and s.running == [a] and b.status is SequenceStatus.WAITING
    assert manager.block_table("b") == [] and b.num_computed_tokens == b.num_cached_tokens == 0
    assert [manager.ref_count(i) for i in manager.block_table("a")] == [1, 1, 1, 1]
    batch = s.schedule()  # a is computed again from its start, and b rides along again
    assert [x.request_id for x in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [14, 3]
    assert batch.riders == [b]


def test_sharing_a_block_in_flight_needs_a_holder():
    from worker.kv.block_pool import BlockPool

    pool = BlockPool(4)
    [block] = pool.take(1)
    pool.share_held([block])
    assert pool.ref_count(block) == 2 and not pool.is_cached(block)
    with pytest.raises(RuntimeError, match="held by no sequence"):
        pool.share_held([3])


def test_a_claim_ends_when_its_sequence_names_the_block_or_lets_it_go():
    manager = BlockManager(20, BLOCK, prefix_hasher=PrefixHasher("test-model", BLOCK))
    prompt_a, prompt_b = SYSTEM + [1, 2], SYSTEM + [3, 4, 5]
    assert manager.find_cached_prefix("a", prompt_a, len(prompt_a)).computing_by is None
    manager.allocate("a", len(prompt_a))
    assert manager.claim_uncomputed_blocks("a", prompt_a, len(prompt_a)) == 3  # 14 tokens: 3 full blocks
    assert manager.claim_uncomputed_blocks("a", prompt_a, len(prompt_a)) == 0  # claimed already
    hit = manager.find_cached_prefix("b", prompt_b, len(prompt_b))
    assert hit.computing_by == "a" and hit.num_tokens == 0
    assert manager.find_cached_prefix("a", prompt_a, len(prompt_a)).computing_by is None  # never itself
    manager.cache_full_blocks("a", prompt_a, len(prompt_a), 8)  # blocks 0-1 named, block 2 still a's
    hit = manager.find_cached_prefix("b", prompt_b, len(prompt_b))
    assert hit.computing_by == "a" and hit.num_tokens == 8
    manager.free("a")  # a gives up (preempted, aborted): nobody computes block 2 any more
    hit = manager.find_cached_prefix("b", prompt_b, len(prompt_b))
    assert hit.computing_by is None and hit.num_tokens == 8  # the named blocks wait in the LRU
    plain = BlockManager(20, BLOCK)
    plain.allocate("a", len(prompt_a))
    assert plain.claim_uncomputed_blocks("a", prompt_a, len(prompt_a)) == 0  # caching off: no claims


def test_a_sequence_does_not_wait_for_a_paused_one():
    s = caching_scheduler(40, budget=10)
    a, b = make_seq("a", SYSTEM + [1, 2]), make_seq("b", SYSTEM + [3, 4, 5])
    s.add(a)
    s.schedule()  # a claims its three blocks and computes 10 tokens... then a migration holds it
    s.pause(a)
    s.add(b)
    batch = s.schedule()  # a is not running: b computes the prefix itself rather than wait
    assert [x.request_id for x in batch.seqs] == ["b"] and b.num_cached_tokens == 0


def test_preemption_abort_and_finish_drop_one_reference_each():
    s = caching_scheduler(9)
    manager = s.block_manager
    a, b = make_seq("a", SYSTEM + [1, 2, 3]), make_seq("b", SYSTEM + [4, 5, 6])
    s.add(a)
    run_step(s, s.schedule())  # a's 15 prompt tokens computed: blocks 0-2 full
    s.add(b)
    run_step(s, s.schedule())  # b takes blocks 0-2 and computes its 3-token tail only
    assert manager.block_table("a") == [0, 1, 2, 3] and manager.block_table("b") == [0, 1, 2, 4]
    assert [manager.ref_count(i) for i in range(5)] == [2, 2, 2, 1, 1] and b.num_cached_tokens == 12
    for _ in range(3):
        run_step(s, s.schedule())
    filler = make_seq("filler", list(range(500, 507)))
    s.add(filler)
    while True:  # decode until the pool runs out: the youngest (filler), then b, are preempted
        batch = s.schedule()
        run_step(s, batch)
        if b in batch.preempted:
            break
    assert filler.num_preemptions == 1 and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert manager.block_table("b") == [] and (b.num_tokens, a.num_computed_tokens) == (24, 25)
    # b dropped one reference per block: the shared ones stay a's, its own full ones (4, 6) are cached,
    # tail first in the LRU.
    assert [manager.ref_count(i) for i in range(9)] == [1, 1, 1, 1, 0, 1, 0, 1, 1]
    assert manager.evictable_block_ids() == [6, 4]
    s.finish(a, FinishReason.ABORT)  # a's full blocks 0-3, 5, 8 join the LRU; 7 (partial) is just free
    assert manager.evictable_block_ids() == [6, 4, 8, 5, 3, 2, 1, 0] and manager.num_free_blocks == 9
    batch = s.schedule()
    # b comes back first and finds 5 of its own blocks still cached: it recomputes 4 tokens, not 24.
    assert [(x.request_id, n) for x, n in zip(batch.seqs, batch.num_new_tokens)] == [("b", 4), ("filler", 8)]
    assert manager.block_table("b") == [0, 1, 2, 4, 6, 7] and b.num_computed_tokens == 20
    assert b.num_cached_tokens == 12  # a request's count is its first admission's
    assert manager.block_table("filler") == [8, 5]  # its cached block was evicted for b earlier; LRU order
    run_step(s, batch)
    s.finish(b, FinishReason.STOP)
    s.finish(filler, FinishReason.ABORT)
    assert not s.has_unfinished() and manager.num_free_blocks == 9
    assert [manager.ref_count(i) for i in range(9)] == [0] * 9 and b.status is SequenceStatus.FINISHED


# ---- the engine --------------------------------------------------------------------------------

CONFIG = EngineConfig(block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    """A 22-token system prompt with several tails, and a prompt that is whole blocks of it."""
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, 250, (22,), generator=gen).tolist()
    tails = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (3, 5, 1, 9)]
    return [system + tail for tail in tails] + [system[:20]]


def run_one_by_one(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order (so each can reuse the ones before): (output ids, cached tokens)."""
    results = []
    for prompt in prompts:
        rid = engine.add_request(prompt, GREEDY)
        tokens, cached = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == rid
                tokens.extend(out.new_token_ids)
                cached = out.num_cached_tokens
        results.append((tokens, cached))
    return results


def test_outputs_with_caching_equal_outputs_without_and_the_cached_counts_are_exact(tiny_llama_dir, prompts):
    plain = Engine(tiny_llama_dir, EngineConfig(**{**CONFIG.__dict__, "enable_prefix_caching": False}))
    cached = Engine(tiny_llama_dir, CONFIG)
    want = run_one_by_one(plain, prompts)
    got = run_one_by_one(cached, prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    # The first computes everything; the next three reuse the system prompt's 5 full blocks; the
    # last (20 tokens, all cached) recomputes its last block.
    assert [n for _, n in got] == [0, 20, 20, 20, 16] and [n for _, n in want] == [0] * 5
    # A chat's next turn: the first prompt, its answer and more; every full block computed is reused
    # (25 prompt + 24 generated tokens, the last never fed back: 48 computed, 12 blocks).
    turn2 = prompts[0] + want[0][0] + [17, 18]
    [(tokens_plain, _)] = run_one_by_one(plain, [turn2])
    [(tokens_cached, num_cached)] = run_one_by_one(cached, [turn2])
    assert tokens_cached == tokens_plain and num_cached == 48
    # All at once: the same tokens again, every block free afterwards in both engines.
    batch = [list(c.output_token_ids) for c in cached.generate(prompts, GREEDY)]
    assert batch == [tokens for tokens, _ in want]
    manager = cached.block_manager
    queried = sum(len(p) for p in prompts) * 2 + len(turn2)
    assert manager.num_prefix_queried_tokens == queried
    # One by one 0+20+20+20+16, the next turn 48, then all at once each prompt's full blocks up to
    # its last token's: 24 + 24 + 20 + 28 + 16.
    assert manager.num_prefix_hit_tokens == 76 + 48 + 112
    assert manager.num_free_blocks == manager.num_blocks and manager.num_cached_blocks > 0
    assert plain.block_manager.num_prefix_queried_tokens == 0 and plain.block_manager.num_cached_blocks == 0


def test_a_burst_sharing_a_new_system_prompt_computes_it_once(tiny_llama_dir, prompts):
    plain = Engine(tiny_llama_dir, EngineConfig(**{**CONFIG.__dict__, "enable_prefix_caching": False}))
    cached = Engine(tiny_llama_dir, CONFIG)
    want = [list(c.output_token_ids) for c in plain.generate(prompts[:4], GREEDY)]
    ids = [cached.add_request(prompt, GREEDY) for prompt in prompts[:4]]  # all at once, nothing cached yet
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    num_cached: dict[str, int] = {}
    while cached.has_unfinished_requests():
        for out in cached.step():
            tokens[out.request_id].extend(out.new_token_ids)
            num_cached[out.request_id] = out.num_cached_tokens
    assert [tokens[rid] for rid in ids] == want
    # The first computes the 22-token system prompt; the others share its 5 full blocks.
    assert [num_cached[rid] for rid in ids] == [0, 20, 20, 20]


def test_a_burst_gets_its_first_tokens_in_the_step_that_computes_the_prefix(tiny_llama_dir, prompts, monkeypatch):
    """A tail rides along with the step that completes the system prompt's blocks: the budget of 16
    takes the first prompt (25 tokens) in two chunks, and the second's 7-token tail fits in the
    second step beside the first's last 9; the third's tail waits for the next step. Their tokens
    are still those of an engine without caching, and a forward pass that fails puts the riders
    back, so nothing is lost."""
    plain = Engine(tiny_llama_dir, EngineConfig(**{**CONFIG.__dict__, "enable_prefix_caching": False}))
    want = [list(c.output_token_ids) for c in plain.generate(prompts[:3], GREEDY)]
    cached = Engine(tiny_llama_dir, CONFIG)
    ids = [cached.add_request(prompt, GREEDY) for prompt in prompts[:3]]
    real_execute = cached.runner.execute
    failures = []

    def fail_once(batch, block_tables):  # the step with riders fails once, before computing anything
        if batch.riders and not failures:
            failures.append([seq.request_id for seq in batch.riders])
            raise RuntimeError("a forward pass failed")
        return real_execute(batch, block_tables)

    monkeypatch.setattr(cached.runner, "execute", fail_once)
    first_step: dict[str, int] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    step = 0
    while cached.has_unfinished_requests():
        try:
            outs = cached.step()
        except RuntimeError:
            assert cached.request_ids_in_step[:1] == (ids[0],)
            continue
        step += 1
        for out in outs:
            first_step.setdefault(out.request_id, step)
            tokens[out.request_id].extend(out.new_token_ids)
    assert failures == [ids[1:2]]
    assert [tokens[rid] for rid in ids] == want
    assert [first_step[rid] for rid in ids] == [2, 2, 3]


def test_a_cached_prefix_gives_transformers_tokens(tiny_llama_dir, prompts):
    import transformers

    engine = Engine(tiny_llama_dir, CONFIG)
    engine.generate([prompts[0]], GREEDY)
    [completion] = run_one_by_one(engine, [prompts[1]])
    assert completion[1] == 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompts[1]]), attention_mask=torch.ones(1, len(prompts[1]), dtype=torch.long),
                          max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None)
    assert completion[0] == out[0, len(prompts[1]):].tolist()


def test_two_requests_sharing_three_blocks_take_three_fewer_fresh_blocks(tiny_llama_dir, prompts):
    engine = Engine(tiny_llama_dir, CONFIG)
    manager = engine.block_manager
    system = prompts[0][:12]
    a = engine.add_request(system + [40, 41], GREEDY)
    while not engine.requests.sequence(a).num_output_tokens:
        engine.step()
    b = engine.add_request(system + [50, 51, 52], GREEDY)
    engine.step()
    table_a, table_b = engine.requests.block_table(a), engine.requests.block_table(b)
    assert table_b[:3] == table_a[:3] and len(table_b) == 4
    assert manager.num_used_blocks == len(table_a) + len(table_b) - 3
    assert engine.requests.sequence(b).num_cached_tokens == 12
    assert (manager.num_prefix_queried_tokens, manager.num_prefix_hit_tokens) == (14 + 15, 12)
    engine.abort(a)
    assert [manager.ref_count(i) for i in table_b[:3]] == [1, 1, 1]
    engine.abort(b)
    assert manager.num_free_blocks == manager.num_blocks


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 16.0]}


def test_longrope_prompts_past_the_original_context_never_reuse_short_ones(tmp_path):
    model_dir = make_hf_checkpoint(tmp_path / "longrope", "llama", rope_parameters=LONGROPE, seed=11)
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, 250, (20,), generator=gen).tolist()
    short = system + [60] * 6  # 26 tokens: rotated with the short set (32 is the original context)
    long = system + [61] * 20  # 40 tokens: every token rotated with the long set
    prompts = [short, long, short + [62], long + [63]]
    plain = Engine(model_dir, EngineConfig(**{**CONFIG.__dict__, "enable_prefix_caching": False}))
    cached = Engine(model_dir, CONFIG)
    want = run_one_by_one(plain, prompts)
    got = run_one_by_one(cached, prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert [n for _, n in got] == [0, 0, 24, 40]  # the long prompt shares 20 tokens with the short, but no KV


def test_a_request_whose_blocks_are_shared_migrates_with_its_kv(tiny_llama_dir, prompts):
    source, dest = Engine(tiny_llama_dir, CONFIG), Engine(tiny_llama_dir, CONFIG)
    alone = Engine(tiny_llama_dir, EngineConfig(**{**CONFIG.__dict__, "enable_prefix_caching": False}))
    want = [list(c.output_token_ids) for c in alone.generate(prompts[:2], GREEDY)]
    manager = source.block_manager
    got: dict[str, list[int]] = {"a": [], "b": []}
    source.add_request(prompts[0], GREEDY, request_id="a")
    while not got["a"]:
        for out in source.step():
            got[out.request_id].extend(out.new_token_ids)
    source.add_request(prompts[1], GREEDY, request_id="b")
    for _ in range(5):
        for out in source.step():
            got[out.request_id].extend(out.new_token_ids)
    shared = source.requests.block_table("b")[:5]
    assert shared == source.requests.block_table("a")[:5] and source.requests.sequence("b").num_cached_tokens == 20
    assert [manager.ref_count(i) for i in shared] == [2] * 5
    snapshot = freeze_request(source, "b")
    _, kv = export_kv(source, "b", 0, include_partial=True)
    import_request(dest, snapshot, kv)
    release_request(source, "b")
    assert [manager.ref_count(i) for i in shared] == [1] * 5  # a keeps them
    while source.has_unfinished_requests() or dest.has_unfinished_requests():
        for engine in (source, dest):
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
    assert [got["a"], got["b"]] == want
    for engine in (source, dest):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_enable_prefix_caching_must_be_a_bool():
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false, got 'yes'"):
        EngineConfig(enable_prefix_caching="yes")
