"""The engine's public surface for moving requests (``Engine.requests``), on one tiny engine stepped
by hand: a paused request keeps its blocks and KV and, resumed, ends with the tokens it would have
had unpaused; retire ends it with the reason given and frees every block; an adopted request whose
tokens are replayed emits no text for them and continues the unmoved output exactly; KV blocks
copied out and back in are bit-identical, and the wrong shape or state is refused naming why."""

from __future__ import annotations

import pytest
import torch

from worker import DemoModelConfig, Engine, EngineConfig, RequestOutput, SamplingParams, write_demo_model
from worker.engine.request_lifecycle import UnknownRequestError
from wire import FinishReason
from worker.engine.sequence import Sequence, SequenceStatus

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
CONFIG = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
PROMPT = "Paged attention stores keys and values"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(write_demo_model(tmp_path_factory.mktemp("lifecycle") / "demo", TINY_DEMO), CONFIG)


@pytest.fixture(scope="module")
def unmoved(engine):
    """The greedy run left alone: (token ids, text)."""
    done = engine.generate([PROMPT], GREEDY)[0]
    return list(done.output_token_ids), done.text


@pytest.fixture(autouse=True)
def idle_afterwards(engine):
    yield
    manager = engine.block_manager
    assert engine.requests.request_ids() == [] and manager.num_free_blocks == manager.num_blocks


def step_until(engine: Engine, done) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(500):
        if done():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine never got there")


def test_a_paused_request_keeps_its_kv_is_not_stepped_and_resumed_ends_as_if_never_paused(engine, unmoved):
    requests = engine.requests
    rid = engine.add_request(PROMPT, GREEDY)
    step_until(engine, lambda: requests.sequence(rid).num_output_tokens == 5)
    seq = requests.pause(rid)
    table, computed = requests.block_table(rid), seq.num_computed_tokens
    kv = requests.read_kv(table)
    other = engine.add_request("another prompt", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outputs = step_until(engine, lambda: other not in requests)
    assert list(outputs) == [other] and seq.status is SequenceStatus.PAUSED  # only the other one was stepped
    assert (requests.block_table(rid), seq.num_computed_tokens) == (table, computed)
    assert torch.equal(requests.read_kv(table), kv)
    requests.resume(rid)
    requests.resume(rid)  # not paused any more: left alone
    step_until(engine, lambda: rid not in requests)
    assert seq.output_token_ids == unmoved[0] and seq.finish_reason is FinishReason.LENGTH


def test_retire_ends_the_request_with_the_reason_and_frees_its_blocks(engine, unmoved):
    requests = engine.requests
    rid = engine.add_request(PROMPT, GREEDY)
    step_until(engine, lambda: requests.sequence(rid).num_output_tokens == 2)
    requests.pause(rid)
    final = requests.retire(rid, FinishReason.MIGRATED)
    num_prompt_tokens = len(engine.tokenizer.encode(PROMPT, add_special_tokens=True))
    cached = (num_prompt_tokens - 1) // CONFIG.block_size * CONFIG.block_size  # `unmoved` ran the prompt first
    assert final == RequestOutput(request_id=rid, new_token_ids=(), new_text="", finished=True,
                                  finish_reason="migrated", num_prompt_tokens=num_prompt_tokens, num_output_tokens=2,
                                  num_cached_tokens=cached)
    assert rid not in requests and requests.find(rid) is None
    with pytest.raises(UnknownRequestError, match="not on this instance"):
        requests.sequence(rid)


def test_an_adopted_request_replays_its_tokens_silently_and_continues_the_unmoved_output(engine, unmoved):
    tokens, text = unmoved
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    seq = Sequence(request_id="adopted", prompt_token_ids=list(prompt_ids), params=GREEDY,
                   max_model_len=engine.max_model_len)
    requests = engine.requests
    requests.adopt(seq)
    requests.replay("adopted", tokens[:7])
    assert seq.status is SequenceStatus.PAUSED and seq.output_token_ids == tokens[:7] and seq.num_computed_tokens == 0
    detokenizer = requests.detokenizer("adopted")
    replayed_text = detokenizer.output_text  # decoded, not emitted: the client has it
    assert detokenizer.num_generated_tokens == 7 and replayed_text == engine.tokenizer.decode(tokens[:7]) != ""
    assert engine.step() == []  # paused: nothing runs
    requests.resume("adopted")  # the scheduler recomputes prompt + replayed tokens in a prefill
    outputs = step_until(engine, lambda: "adopted" not in requests)["adopted"]
    assert [t for out in outputs for t in out.new_token_ids] == tokens[7:]
    assert replayed_text + "".join(out.new_text for out in outputs) == text


def test_kv_blocks_copied_out_and_in_are_identical_and_a_wrong_shape_is_refused(engine):
    requests = engine.requests
    rid = engine.add_request(PROMPT, GREEDY)
    step_until(engine, lambda: requests.sequence(rid).num_output_tokens == 1)
    requests.pause(rid)
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = requests.kv_pool_shape
    assert (num_layers, num_blocks, block_size) == (2, 64, 4)
    table = requests.block_table(rid)
    kv = requests.read_kv(table)  # [L, 2, n, block_size, Hkv, D]
    assert kv.shape == (2, 2, len(table), 4, num_kv_heads, head_dim) and kv.abs().sum() > 0
    assert torch.equal(requests.read_kv(table, num_layers=1), kv[:1])
    assert requests.kv_block_bytes == 2 * 2 * 4 * num_kv_heads * head_dim * kv.element_size()
    spare = [b for b in range(num_blocks) if b not in table][:len(table)]
    requests.write_kv(spare, kv)
    assert torch.equal(requests.read_kv(spare), kv)
    requests.write_kv(spare, torch.zeros_like(kv[:1]))  # the first layer only
    assert torch.equal(requests.read_kv(spare)[1], kv[1]) and requests.read_kv(spare)[0].abs().sum() == 0
    with pytest.raises(ValueError, match=r"KV blocks of shape \(2, 2, 2, 4, 2, 16\) do not fit 3 blocks"):
        requests.write_kv(spare[:3], kv[:, :, :2])
    requests.retire(rid, FinishReason.ABORT)


def test_kv_is_computed_only_for_a_paused_request_and_never_up_to_its_last_token(engine):
    requests = engine.requests
    rid = engine.add_request(PROMPT, GREEDY)
    seq = requests.sequence(rid)
    with pytest.raises(ValueError, match=f"request '{rid}' is waiting, not paused"):
        requests.compute_kv(rid, 1)
    requests.pause(rid)
    engine.block_manager.allocate(rid, seq.num_tokens)
    with pytest.raises(ValueError, match=f"compute 1 to {seq.num_tokens - 1} of them, not {seq.num_tokens}"):
        requests.compute_kv(rid, seq.num_tokens)
    assert requests.compute_kv(rid, 3) == 3 and requests.compute_kv(rid, seq.num_tokens - 4) == seq.num_tokens - 1
    requests.retire(rid, FinishReason.ABORT)


def test_blocks_short_says_what_a_reserve_would_lack_and_reserve_grows_the_table(engine):
    seq = engine.prepare_request(PROMPT, GREEDY, "reserving")
    free = engine.stats().num_free_kv_blocks
    assert engine.requests.blocks_short("reserving", 4 * (free + 3)) == (free + 3, free)
    engine.requests.adopt(seq)
    assert engine.requests.blocks_short("reserving", 8) is None
    new = engine.requests.reserve("reserving", 8)
    assert len(new) == 2 and engine.requests.block_table("reserving") == new
    assert engine.stats().num_free_kv_blocks == free - 2
    engine.requests.retire("reserving", FinishReason.ABORT)
