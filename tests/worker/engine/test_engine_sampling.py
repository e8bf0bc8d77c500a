"""The engine's OpenAI/vLLM sampling settings against `transformers` on the same tiny checkpoint.

* Log-probabilities: each generated token's, and its position's top-N, equal ``log_softmax`` of
  transformers' fp32 logits for the same tokens within 1e-4, with the same top-N token sets; they
  are the raw ones (a request with penalties, bias and a temperature reports the model's own), rows
  that do not ask get None, and the token strings are transformers' tokenizer's decode of each id.
* Penalties, ``logit_bias`` and ``min_tokens``: greedy generation equals ``transformers.generate``
  with ``repetition_penalty``, ``sequence_bias``, ``min_new_tokens`` and, for OpenAI's presence and
  frequency penalties (which transformers lacks), a logits processor with their formula
  ``logit - frequency * count_in_output - presence * (count_in_output > 0)``; token for token,
  several requests with different settings in one batch, prefills chunked over small KV blocks.
* A ``logit_bias`` token outside the vocabulary is refused at admission.
"""

from __future__ import annotations

import pytest
import torch

from worker import Engine, EngineConfig, InvalidRequestError, SamplingParams

CONFIG = EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 300, 301, 7, 7, 7, 8, 9, 10, 11, 12], [1, 99, 98], [1, 5, 6, 7, 8, 9, 200]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(tiny_llama_dir, CONFIG)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def run(engine: Engine, prompts, params):
    """Every request to the end, in one batch; returns each one's outputs."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[rid] for rid in ids]


def test_logprobs_equal_log_softmax_of_transformers_logits_with_the_same_top_n(engine, hf_model, tiny_llama_dir):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5),
        # Raw logprobs: the model's own, whatever the penalties, bias and temperature did to the draw.
        SamplingParams(temperature=1.3, seed=7, max_tokens=12, ignore_eos=True, logprobs=20, repetition_penalty=1.8,
                       presence_penalty=1.0, frequency_penalty=0.5, logit_bias={300: 5.0}, min_p=0.02),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # asks for none
    ]
    results = run(engine, PROMPTS, params)
    assert all(out.logprobs is None for out in results[3])
    for prompt, p, outputs in zip(PROMPTS, params[:3], results[:3]):
        generated = [t for out in outputs for t in out.new_token_ids]
        logprobs = [lp for out in outputs if out.new_token_ids for lp in out.logprobs]
        assert len(generated) == len(logprobs) == 12
        assert all(out.logprobs is None for out in outputs if not out.new_token_ids)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]  # [12, V]
        expected = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [12, V]
        for position, (token_id, lp) in enumerate(zip(generated, logprobs)):
            assert lp.token_id == token_id
            assert abs(lp.logprob - expected[position, token_id].item()) < 1e-4
            top = torch.topk(expected[position], p.logprobs)
            assert set(lp.top_token_ids) == set(top.indices.tolist())
            assert len(lp.top_token_ids) == len(lp.top_logprobs) == p.logprobs
            for token, value in zip(lp.top_token_ids, lp.top_logprobs):
                assert abs(value - expected[position, token].item()) < 1e-4
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            assert lp.token == hf_tokenizer.decode([token_id])
            assert list(lp.top_tokens) == [hf_tokenizer.decode([t]) for t in lp.top_token_ids]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class OpenAIPenalties:
    """transformers has no presence/frequency penalty: OpenAI's formula, over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len:]  # [1, T]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def transformers_greedy(hf_model, prompt, params: SamplingParams, eos_ids) -> list[int]:
    import transformers

    processors = transformers.LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    kwargs = {}
    if params.logit_bias:
        kwargs["sequence_bias"] = {(token_id,): bias for token_id, bias in params.logit_bias}
    out = hf_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=params.max_tokens,
        repetition_penalty=params.repetition_penalty, min_new_tokens=params.min_tokens or None,
        eos_token_id=None if params.ignore_eos else list(eos_ids), pad_token_id=0, logits_processor=processors,
        **kwargs)
    return out[0, len(prompt):].tolist()


def test_greedy_with_penalties_bias_and_min_tokens_equals_transformers_generate(engine, hf_model):
    eos = min(engine.eos_token_ids)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
        # EOS pushed to the top: min_tokens holds it back for 5 tokens, then the request stops on it.
        SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 30.0}, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=0.7, presence_penalty=-0.5,
                       frequency_penalty=0.3, logit_bias={7: 2.0, 12: -4.0}),
    ]
    plain = run(engine, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4)
    results = run(engine, PROMPTS, params)
    for prompt, p, outputs, plain_outputs in zip(PROMPTS, params, results, plain):
        tokens = [t for out in outputs for t in out.new_token_ids]
        assert tokens == transformers_greedy(hf_model, prompt, p, engine.eos_token_ids)
        assert tokens != [t for out in plain_outputs for t in out.new_token_ids]  # the settings changed the output
    stopped = [t for out in results[2] for t in out.new_token_ids]
    assert len(stopped) == 6 and stopped[-1] == eos and eos not in stopped[:5]
    assert results[2][-1].finish_reason == "stop"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias token ids must be in \[0, {vocab}\) \(this model's "
                                                  rf"vocabulary\), got \[{vocab}\]"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={5: 1.0, vocab: 1.0}))
    assert engine.num_unfinished_requests == 0


def test_generate_returns_each_tokens_logprobs_only_to_requests_that_ask(engine):
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    asked, plain = engine.generate(PROMPTS[:2], params)
    assert plain.logprobs is None
    assert [lp.token_id for lp in asked.logprobs] == list(asked.output_token_ids)  # one per token, in order
    assert "".join(lp.token for lp in asked.logprobs) == asked.text
    assert all(len(lp.top_token_ids) == 2 and lp.top_token_ids[0] == lp.token_id for lp in asked.logprobs)  # greedy
