"""Engine behaviour beyond greedy correctness: request validation, stopping, aborts,
seeded sampling and KV accounting. A bad request must fail alone, with a message naming the
problem, while the requests around it finish exactly as they would without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker import Engine, EngineConfig, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def engine(tiny_llama_dir):
    return Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128, max_num_batched_tokens=32))


def run_all(engine):
    """Steps until idle; returns {request_id: (token ids, text, finish_reason)}."""
    tokens, texts, reasons = {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens.get(rid, []), texts.get(rid, ""), reasons[rid]) for rid in reasons}


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ("", GREEDY, "prompt must not be empty"),
        ([], GREEDY, "prompt must not be empty"),
        ([1, 2, 10**9], GREEDY, "token ids must be in"),
        ("hello " * 400, GREEDY, "context is 256 tokens"),
        ([{"role": "wizard", "content": "hi"}], GREEDY, "role"),
        (42, GREEDY, "prompt must be a string"),
        ("hello", SamplingParams(max_tokens=120), None),  # valid: control case
    ],
)
def test_invalid_requests_fail_alone(engine, prompt, params, message):
    good_ids = [engine.add_request(p, GREEDY) for p in ("the cat sat", "a long walk home")]
    baseline = Engine(engine.model_dir, engine.config).generate(["the cat sat", "a long walk home"], GREEDY)
    if message is None:
        engine.add_request(prompt, params)
    else:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params)
    results = run_all(engine)
    for rid, want in zip(good_ids, baseline):
        assert results[rid][0] == list(want.output_token_ids)
        assert results[rid][2] == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"max_tokens": 0}, "max_tokens"), ({"top_k": -1}, "top_k")],
)
def test_bad_sampling_params_are_refused_by_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_larger_than_the_kv_pool_is_refused(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=8))  # 32 slots
    with pytest.raises(InvalidRequestError, match="cache holds 32"):
        engine.add_request("hello there", SamplingParams(max_tokens=40))
    engine.add_request("hello there", SamplingParams(max_tokens=8))
    assert engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("hi", GREEDY, request_id="r1")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("hello", GREEDY, request_id="r1")


def test_stop_token_ids_and_max_tokens(engine):
    [ref] = engine.generate(["the quick brown fox"], GREEDY)
    stop_at = ref.output_token_ids[4]
    first = ref.output_token_ids.index(stop_at)
    [out] = engine.generate(["the quick brown fox"],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]))
    assert out.finish_reason == "stop"
    assert list(out.output_token_ids) == list(ref.output_token_ids[: first + 1])
    [short] = engine.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert short.finish_reason == "length" and list(short.output_token_ids) == list(ref.output_token_ids[:3])


def test_stop_string_truncates_text(engine):
    [ref] = engine.generate(["once upon a time"], GREEDY)
    assert len(ref.text) > 6, "fixture model should produce some text"
    stop = ref.text[3:6]
    [out] = engine.generate(["once upon a time"],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == ref.text[: ref.text.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    [ref] = engine.generate(["the dog"], GREEDY)
    # Make the 3rd generated token an end-of-sequence id for this engine: it must stop there.
    engine.eos_token_ids = frozenset({ref.output_token_ids[2]})
    first = ref.output_token_ids.index(ref.output_token_ids[2])
    [out] = engine.generate(["the dog"], SamplingParams(temperature=0.0, max_tokens=12))
    assert out.finish_reason == "stop" and len(out.output_token_ids) == first + 1
    [ignored] = engine.generate(["the dog"], GREEDY)
    assert ignored.output_token_ids == ref.output_token_ids


def test_abort_frees_blocks_and_reports(engine):
    a = engine.add_request("first request here", GREEDY)
    b = engine.add_request("second request", GREEDY)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort(a) is None  # already gone
    assert engine.abort("no-such-request") is None
    results = run_all(engine)
    assert set(results) == {b} and results[b][2] == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_of_a_waiting_request(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=1))
    engine.add_request("one", GREEDY)
    waiting = engine.add_request("two", GREEDY)
    engine.step()
    assert engine.scheduler.num_waiting == 1
    assert engine.abort(waiting).finish_reason == "abort"
    assert engine.scheduler.num_waiting == 0


def test_seeded_sampling_is_reproducible_and_independent_of_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    [alone] = engine.generate(["a seeded prompt"], params)
    batch = engine.generate(
        ["other prompt", "a seeded prompt", "yet another"],
        [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), params,
         SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True)],
    )
    assert batch[1].output_token_ids == alone.output_token_ids
    [other_seed] = engine.generate(["a seeded prompt"], SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=4321, max_tokens=12, ignore_eos=True))
    assert other_seed.output_token_ids != alone.output_token_ids


def test_top_k_one_equals_greedy(engine):
    [greedy] = engine.generate(["greedy check"], GREEDY)
    [topk] = engine.generate(["greedy check"], SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True))
    assert topk.output_token_ids == greedy.output_token_ids


def test_chat_prompt_uses_the_template(engine):
    messages = [{"role": "user", "content": "hello"}]
    seq = engine.prepare_request(messages, GREEDY)
    assert seq.prompt_token_ids == engine.tokenizer.encode_chat(messages)
    assert seq.prompt_token_ids[0] == engine.tokenizer.bos_token_id


def test_streamed_text_equals_decoded_tokens(engine):
    rid = engine.add_request("streaming text", SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    tokens, text, _ = run_all(engine)[rid]
    assert text == engine.tokenizer.decode(tokens)


def test_thaw_format_loads_the_same_model(tiny_llama_dir, tmp_path):
    from loader import convert_checkpoint

    thaw_dir = tmp_path / "thaw"
    convert_checkpoint(tiny_llama_dir, thaw_dir, progress=False)
    from_hf = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    from_thaw = Engine(thaw_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    assert from_thaw.load_report.startswith("thaw format") and "checksums verified" in from_thaw.load_report
    prompts = ["the thaw format", "loads the same weights"]
    want = from_hf.generate(prompts, GREEDY)
    got = from_thaw.generate(prompts, GREEDY)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in want]
    for name, param in from_hf.runner.model.state_dict().items():
        assert torch.equal(param, from_thaw.runner.model.state_dict()[name]), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_refused_clearly(tiny_llama_dir):
    with pytest.raises(ValueError, match="no usable CUDA device"):
        Engine(tiny_llama_dir, EngineConfig(device="cuda"))


def test_special_tokens_text_is_kept_only_when_asked_and_the_ending_token_adds_none(engine):
    tokenizer = engine.tokenizer
    header = tokenizer.token_to_id("<|start_header_id|>")
    (eot,) = [t for t in engine.eos_token_ids if tokenizer.convert_ids_to_tokens([t]) == ["<|eot_id|>"]]
    forced = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={header: 100.0})
    [skipped] = engine.generate(["hello"], forced)
    [kept] = engine.generate(["hello"], dataclasses.replace(forced, skip_special_tokens=False))
    assert list(skipped.output_token_ids) == list(kept.output_token_ids) == [header, header]
    assert skipped.text == "" and kept.text == "<|start_header_id|><|start_header_id|>"
    # The end-of-sequence token ends the request without adding its name, special tokens kept or not.
    [ended] = engine.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={eot: 100.0},
                                                        skip_special_tokens=False))
    assert (list(ended.output_token_ids), ended.text, ended.finish_reason) == ([eot], "", "stop")
