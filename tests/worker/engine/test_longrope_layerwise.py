"""longrope prompts longer than the original context, prefilled through the layer-by-layer paths:
the zigzag prefill of an engine whose weights are still arriving (`worker.engine.zigzag_prefill`) and a
prefill handed over at layer k to a fully loaded helper (`worker.transfer.layer_handoff`, which finishes it
with `RequestLifecycle.compute_kv_from_layer`). Both must rotate a prompt token for its prompt's
length, as the model runner does (and transformers), not for its position + 1: with an original
context of 4, every prompt token of a 5- or 7-token prompt uses the long factor set, including the
first four. Greedy outputs equal an engine that loaded everything first (which
`test_engine_vs_transformers.py` holds equal to transformers)."""

from __future__ import annotations

import pytest

from tests.model_factory import make_hf_checkpoint
from tests.worker.loading.test_layer_gate import FakeLayerSource, config_only, engine_config, land, run_all
from worker.engine.engine import Engine
from worker.transfer.layer_handoff import hand_over_prefill, take_over_prefill
from wire.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 17)), list(range(20, 25)), list(range(30, 33))]  # 7, 5 and 3 tokens
# head_dim 16: 8 factors per set; the long set far from the short one so a wrong choice shows.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4,
            "short_factor": [1.0] * 8, "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]}


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("longrope-llama"), "llama", seed=14, num_hidden_layers=4,
                              rope_parameters=LONGROPE)


def test_zigzag_prefill_rotates_a_long_prompt_for_its_length(longrope_dir, tmp_path):
    config = engine_config(zigzag_prefill=True)
    want = [list(c.output_token_ids) for c in Engine(longrope_dir, config).generate(PROMPTS, GREEDY)]
    source = FakeLayerSource(longrope_dir)
    engine = Engine(config_only(longrope_dir, tmp_path), config, weights=source)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    land(source, engine.runner.layer_gate, -1, 0, 1)
    assert engine.step() == []  # every prompt embedded and through layers 0 and 1, waiting at layer 2
    source.release_all()
    got = run_all(engine)
    assert [got[rid] for rid in ids] == want


def test_a_prefill_finished_from_layer_k_rotates_a_long_prompt_for_its_length(longrope_dir, tmp_path):
    config = engine_config()
    want = [list(c.output_token_ids) for c in Engine(longrope_dir, config).generate(PROMPTS[:2], GREEDY)]
    source = FakeLayerSource(longrope_dir)
    receiver = Engine(config_only(longrope_dir, tmp_path), config, weights=source)
    helper = Engine(longrope_dir, config)
    ids = [receiver.add_request(p, GREEDY) for p in PROMPTS[:2]]
    land(source, receiver.runner.layer_gate, -1, 0, 1)
    assert receiver.step() == []
    for rid in ids:
        partial, _ = hand_over_prefill(receiver, rid)
        assert partial.next_layer == 2
        take_over_prefill(helper, partial)
    got = run_all(helper)
    assert [got[rid] for rid in ids] == want
    source.release_all()  # let the receiver's gate thread finish
