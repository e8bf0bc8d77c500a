"""RequestAdmission: the checks a request passes before it is queued, by whose fault a refusal
is, and the one KV-fit rule that admission and a migration's import both apply."""

from __future__ import annotations

import pytest

from wire import InvalidRequestError, SamplingParams
from worker import Engine, EngineConfig
from worker.transfer.engine_migration import MigrationRefusedError, begin_import, export_request

BLOCK, BLOCKS = 4, 16  # a 64-token KV pool


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(tiny_llama_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=BLOCKS))


def test_the_kv_fit_rule_counts_prompt_and_max_tokens_up_to_the_context(engine):
    admission = engine.admission
    assert admission.capacity_tokens == BLOCK * BLOCKS == 64
    assert admission.kv_shortfall(10, 54) is None  # exactly the pool
    assert admission.kv_shortfall(10, 55) == 65
    assert admission.kv_shortfall(10, 10**6) == min(10 + 10**6, engine.max_model_len)


def test_each_refusal_names_what_to_change(engine):
    ids = engine.tokenize_prompt("hello there")
    seq = engine.prepare_tokens(ids, SamplingParams(max_tokens=8), "r-1")
    assert seq.request_id == "r-1" and seq.prompt_token_ids == ids
    with pytest.raises(InvalidRequestError, match=r"needs up to \d+ KV-cache slots .* holds 64; lower max_tokens"):
        engine.prepare_tokens(ids, SamplingParams(max_tokens=64))
    with pytest.raises(InvalidRequestError, match="prompt token ids must be in"):
        engine.tokenize_prompt([1, 2, engine.model_config.vocab_size])
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        engine.tokenize_prompt("")
    with pytest.raises(InvalidRequestError, match="logit_bias token ids must be in"):
        engine.check_params(SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))


def test_a_migrated_request_the_pool_cannot_hold_is_refused_by_the_same_rule(engine, tiny_llama_dir):
    small = Engine(tiny_llama_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=4))  # 16 tokens
    seq = engine.prepare_tokens(engine.tokenize_prompt("hello there"), SamplingParams(max_tokens=30), "r-big")
    engine.enqueue(seq)
    try:
        snapshot = export_request(engine, seq.request_id)
        assert small.admission.kv_shortfall(snapshot.num_prompt_tokens, snapshot.params.max_tokens) is not None
        with pytest.raises(MigrationRefusedError, match="KV-cache slots but this instance's cache holds 16"):
            begin_import(small, snapshot)
    finally:
        engine.abort(seq.request_id)
