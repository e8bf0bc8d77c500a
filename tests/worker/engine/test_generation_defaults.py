"""A model's generation_config.json sampling defaults fill exactly the fields a request left out,
as vLLM does; explicit settings win; a value the sampler would refuse is skipped, not fatal."""

from __future__ import annotations

import json
import logging

import pytest

from tests.model_factory import make_hf_checkpoint
from wire import SamplingParams
from worker import Engine, EngineConfig
from worker.engine.generation_defaults import read_generation_defaults


def test_sampling_params_fill_only_the_fields_left_out():
    left_out = SamplingParams(temperature=1.0, top_p=0.5, model_defaults=("temperature", "top_k"))
    filled = left_out.with_model_defaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert (filled.temperature, filled.top_k, filled.top_p, filled.model_defaults) == (0.6, 20, 0.5, ())
    assert SamplingParams(model_defaults=("top_p",)).with_model_defaults({}).top_p == 1.0  # the model sets none
    assert SamplingParams.from_dict(left_out.to_dict()) == left_out  # it crosses the wire
    with pytest.raises(ValueError, match="model_defaults must name fields of temperature, top_k, top_p"):
        SamplingParams(model_defaults=("max_tokens",))


def test_reading_skips_what_the_sampler_would_refuse(tmp_path, caplog):
    assert read_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 5.0, "do_sample": True, "eos_token_id": [1, 2]}))
    with caplog.at_level(logging.WARNING):
        assert read_generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20}
    assert "top_p must be in (0, 1], got 5.0" in caplog.text


def test_the_engine_applies_the_models_defaults_to_left_out_fields(tmp_path):
    model_dir = make_hf_checkpoint(tmp_path / "m", "llama", seed=6)
    prompt = [[5, 9, 2, 7, 11]]
    engine = Engine(model_dir, EngineConfig(num_kv_blocks=32))
    greedy = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    sampled = engine.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    assert greedy[0].output_token_ids != sampled[0].output_token_ids

    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    engine = Engine(model_dir, EngineConfig(num_kv_blocks=32))
    assert engine.generation_defaults == {"temperature": 0.0}
    left_out = SamplingParams(seed=3, max_tokens=12, ignore_eos=True, model_defaults=("temperature",))
    assert engine.generate(prompt, left_out)[0].output_token_ids == greedy[0].output_token_ids
    explicit = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    assert engine.generate(prompt, explicit)[0].output_token_ids == sampled[0].output_token_ids
