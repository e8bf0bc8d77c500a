"""Structured output enforced by the engine: every output a request with ``structured_output`` gets
is valid, whatever it is batched with, moved to or interrupted by.

A tiny random-weight Llama whose logits have 40 padding columns past its tokenizer's vocab (as
published models often do) serves, through `Engine.generate`, 100 seeded runs at temperature 1.0
(seeds 0..99, half of them with ``ignore_eos``) of each kind of constraint, all in one batch:

* a JSON schema (a bounded string, a bounded integer, an enum, an array of booleans, every key
  required, no other keys): every output ends with "stop" on the end-of-sequence token, parses,
  and passes each rule of the schema (checked by hand, and by `jsonschema` where installed); the
  masks computed on the helper thread during the forward pass give the very tokens of masks
  computed inline;
* any JSON object: every run that ends with "stop" parses to an object;
* a regex and a choice: every output fully matches / is one of the choices, greedy runs too.

Around them: a free seeded request batched beside structured ones gets the tokens it gets alone;
a structured request's logprobs are the model's own, before the mask; an engine that serves no
structured request never builds a grammar engine; a schema that cannot be enforced is refused at
admission with a message saying what to change; a structured request migrated mid-generation (by
recompute or with its KV blocks), preempted and recomputed, or prefilled layer by layer while
the weights arrive finishes valid, with the tokens of an undisturbed run; a migrated transcript
whose tokens the grammar refuses, and a request whose sampler is left no allowed token
(``min_tokens`` holding back the end), fail alone.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.model_factory import make_hf_checkpoint
from wire import GrammarSpec
from worker import Engine, EngineConfig, InvalidRequestError, SamplingParams
from worker.transfer.engine_migration import export_kv, freeze_request, import_request, release_request
from wire.request_snapshot import RequestSnapshot
from worker.text.tokenizer import Tokenizer

NUM_RUNS = 100
PADDING_COLUMNS = 40
CONFIG = EngineConfig(block_size=16, num_kv_blocks=4096, max_num_seqs=128, max_num_batched_tokens=2048)
PROMPT = "Answer in JSON:"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "flags"],
    "additionalProperties": False,
}
SCHEMA_SPEC = GrammarSpec.json_schema(SCHEMA)
PATTERN = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe later"]


def check_schema_by_hand(doc) -> None:
    """Every rule of SCHEMA, one assert each."""
    assert isinstance(doc, dict) and sorted(doc) == ["age", "flags", "name", "role"], doc
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 10
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 18 <= doc["age"] <= 99
    assert doc["role"] in ("admin", "user", "guest")
    assert isinstance(doc["flags"], list) and len(doc["flags"]) <= 4
    assert all(isinstance(flag, bool) for flag in doc["flags"])


def check_schema(text: str) -> None:
    doc = json.loads(text)  # strict: control characters inside strings are refused
    check_schema_by_hand(doc)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(doc, SCHEMA)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with the demo tokenizer, its logits PADDING_COLUMNS wider than the vocab."""
    from worker.models.demo_model import build_tokenizer

    tokenizer_dir = build_tokenizer(tmp_path_factory.mktemp("structured-tokenizer"))
    vocab_size = Tokenizer.from_dir(tokenizer_dir).vocab_size
    return make_hf_checkpoint(tmp_path_factory.mktemp("structured-engine"), "llama", seed=21,
                              max_position_embeddings=1024, vocab_size=vocab_size + PADDING_COLUMNS)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, CONFIG)


@pytest.fixture(scope="module")
def eos_id(engine) -> int:
    [eos] = engine.structured_output.grammar_engine().eos_token_ids
    return eos


def seeded(spec: GrammarSpec, max_tokens: int, **overrides) -> list[SamplingParams]:
    """NUM_RUNS seeded runs at temperature 1.0, the odd seeds with ignore_eos."""
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=seed % 2 == 1,
                           structured_output=spec, **overrides) for seed in range(NUM_RUNS)]


def collect(engine: Engine, request_ids: list[str]) -> dict[str, list]:
    """Steps until the engine is idle; every output of each request."""
    outputs = {rid: [] for rid in request_ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_json_schema_runs_all_validate_with_masks_overlapped_or_inline(engine, model_dir, eos_id):
    completions = engine.generate([PROMPT] * NUM_RUNS, seeded(SCHEMA_SPEC, 400))
    for completion in completions:
        assert completion.finish_reason == "stop", completion.text  # ignore_eos too: the grammar ended it
        assert completion.output_token_ids[-1] == eos_id
        assert completion.text == engine.tokenizer.decode(list(completion.output_token_ids[:-1]))
        check_schema(completion.text)
    assert len({c.text for c in completions}) == NUM_RUNS  # 100 different runs
    inline = Engine(model_dir, dataclasses.replace(CONFIG, overlap_structured_output=False))
    again = inline.generate([PROMPT] * NUM_RUNS, seeded(SCHEMA_SPEC, 400))
    assert [c.output_token_ids for c in again] == [c.output_token_ids for c in completions]


def test_json_object_runs_that_finish_all_parse(engine):
    # Any JSON object leaves strings and nesting unbounded: a run may use up max_tokens ("length").
    completions = engine.generate([PROMPT] * NUM_RUNS, seeded(GrammarSpec.json_object(), 200))
    finished = [c for c in completions if c.finish_reason == "stop"]
    assert {c.finish_reason for c in completions} <= {"stop", "length"}
    assert len(finished) >= 25, f"only {len(finished)} of {NUM_RUNS} runs ended within 200 tokens"
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict), completion.text
    for completion in completions:
        assert completion.text.lstrip(" \t\r\n").startswith("{"), completion.text


def test_json_object_runs_all_end_and_parse_when_the_model_leans_to_closing(engine):
    # A random model closes a string or an object with about 1/vocab odds; a bias on the closing
    # tokens gives it a real model's habit of ending, and then every one of the 100 runs must be
    # a JSON object (the grammar decides what is valid, the bias only what is likely).
    tokenizer = engine.tokenizer
    closers = {token_id: 6.0 for token_id in range(tokenizer.vocab_size)
               if tokenizer.decode([token_id]) in ('"', "}")}
    assert len(closers) == 2
    completions = engine.generate([PROMPT] * NUM_RUNS, seeded(GrammarSpec.json_object(), 400, logit_bias=closers))
    assert [c.finish_reason for c in completions] == ["stop"] * NUM_RUNS
    for completion in completions:
        assert isinstance(json.loads(completion.text), dict), completion.text


def test_regex_and_choice_runs_greedy_ones_too(engine):
    params = seeded(GrammarSpec.regex(PATTERN), 40) + seeded(GrammarSpec.choice(CHOICES), 20)
    params += [SamplingParams(temperature=0.0, max_tokens=40, structured_output=GrammarSpec.regex(PATTERN)),
               SamplingParams(temperature=0.0, max_tokens=20, structured_output=GrammarSpec.choice(CHOICES))]
    completions = engine.generate(["Email:"] * NUM_RUNS + ["Pick:"] * NUM_RUNS + ["Email:", "Pick:"], params)
    assert all(c.finish_reason == "stop" for c in completions)
    regex_texts = [c.text for c in completions[:NUM_RUNS]] + [completions[-2].text]
    for text in regex_texts:
        assert re.fullmatch(PATTERN, text), text
    choice_texts = [c.text for c in completions[NUM_RUNS:2 * NUM_RUNS]] + [completions[-1].text]
    assert set(choice_texts) == set(CHOICES)  # every choice taken, nothing else


def test_a_free_request_beside_structured_ones_gets_its_tokens_alone(model_dir):
    engine = Engine(model_dir, CONFIG)
    free = [SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=60, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]
    alone = engine.generate([PROMPT, PROMPT], free)
    assert not engine.structured_output.started  # no structured request: no grammar engine was built
    structured = [SamplingParams(temperature=1.0, seed=1, max_tokens=300, structured_output=SCHEMA_SPEC, logprobs=2),
                  SamplingParams(temperature=0.0, max_tokens=40, structured_output=GrammarSpec.regex(PATTERN))]
    mixed = engine.generate([PROMPT, PROMPT, PROMPT, "Email:"], free + structured)
    assert [c.output_token_ids for c in mixed[:2]] == [c.output_token_ids for c in alone]
    check_schema(mixed[2].text)
    assert re.fullmatch(PATTERN, mixed[3].text)


def test_logprobs_are_the_models_own_before_the_mask(engine):
    choice = SamplingParams(temperature=0.0, max_tokens=20, logprobs=5, structured_output=GrammarSpec.choice(CHOICES))
    free = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ids = [engine.add_request("Pick:", choice), engine.add_request("Pick:", free)]
    outputs = collect(engine, ids)
    first_structured = outputs[ids[0]][0].logprobs[0]
    first_free = outputs[ids[1]][0].logprobs[0]
    # The same position of the same prompt: the same raw distribution, whatever the grammar allowed.
    assert first_structured.top_token_ids == first_free.top_token_ids
    assert first_structured.top_logprobs == first_free.top_logprobs
    assert first_free.token_id != first_structured.token_id  # the model's favourite starts no choice: masked
    text = "".join(out.new_text for out in outputs[ids[0]])
    assert text in CHOICES


def test_a_sampled_token_the_grammar_refuses_fails_that_request_alone(engine):
    # min_tokens holds back the end-of-sequence token, the only one a complete choice allows: every
    # logit is -inf, the greedy row takes token 0 and the sampled row cannot draw.
    stuck = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            structured_output=GrammarSpec.choice(["no"])),
             SamplingParams(temperature=1.0, seed=2, max_tokens=20, min_tokens=10,
                            structured_output=GrammarSpec.choice(["no"]))]
    free = SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    [alone] = engine.generate([PROMPT], [free])
    completions = engine.generate(["Pick:", "Pick:", PROMPT], stuck + [free])
    assert [c.finish_reason for c in completions] == ["error", "error", "length"]
    assert completions[0].text == completions[1].text == "no"  # what was generated before stays
    assert completions[2].output_token_ids == alone.output_token_ids
    rid = engine.add_request("Pick:", stuck[0])
    assert collect(engine, [rid])[rid][-1].error == (
        "structured output failed: StructuredOutputError: the sampled token 0 does not fit the structured_output "
        "here: no allowed token was left (min_tokens holding back the end of a complete output?)")


def test_a_schema_that_cannot_be_enforced_is_refused_at_admission(engine):
    bad = SamplingParams(max_tokens=10, structured_output=GrammarSpec.json_schema({"type": "foo"}))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(PROMPT, bad)
    assert str(info.value) == ("structured_output: the JSON schema cannot be enforced: Invalid type: foo; "
                               "change or remove that part of the schema")
    unsatisfiable = GrammarSpec.json_schema({"type": "array", "minItems": 3, "maxItems": 1})
    with pytest.raises(InvalidRequestError, match=r"^structured_output: the JSON schema cannot be enforced: "
                                                  r"Unsatisfiable schema: minItems \(3\) is greater than maxItems"):
        engine.check_params(SamplingParams(structured_output=unsatisfiable))
    with pytest.raises(InvalidRequestError, match=r"^structured_output: the regex cannot be enforced: "):
        engine.prepare_request(PROMPT, SamplingParams(structured_output=GrammarSpec.regex("[a-z")))
    assert not engine.requests.request_ids()


MOVING = SamplingParams(temperature=1.0, seed=7, max_tokens=400, structured_output=SCHEMA_SPEC)


@pytest.fixture(scope="module")
def unmoved(engine) -> list[int]:
    [completion] = engine.generate([PROMPT], [MOVING])
    check_schema(completion.text)
    return list(completion.output_token_ids)


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-blocks"])
@pytest.mark.parametrize("num_steps", [1, 12])  # just after the prefill; mid-way through the JSON
def test_a_structured_request_migrated_mid_generation_finishes_valid(model_dir, engine, unmoved, with_kv, num_steps):
    source, dest = Engine(model_dir, CONFIG), engine
    rid = source.add_request(PROMPT, MOVING, request_id=f"moving-{with_kv}-{num_steps}")
    before = [t for _ in range(num_steps) for out in source.step() for t in out.new_token_ids]
    assert 0 < len(before) < len(unmoved)
    snapshot = freeze_request(source, rid)
    kv = export_kv(source, rid, 0, include_partial=True)[1] if with_kv else None
    import_request(dest, snapshot, kv)
    assert release_request(source, rid).finish_reason == "migrated"
    after = collect(dest, [rid])[rid]
    assert after[-1].finish_reason == "stop"
    tokens = before + [t for out in after for t in out.new_token_ids]
    assert tokens == unmoved  # the matcher rebuilt from the replayed tokens masks as the source's would have
    check_schema(dest.tokenizer.decode(tokens[:-1]))


def test_a_preempted_structured_request_is_recomputed_and_finishes_valid(model_dir, engine, unmoved):
    # Each run needs 8 of the 14 KV blocks by its end: three at once force preemptions and recomputes.
    tight = Engine(model_dir, EngineConfig(block_size=16, num_kv_blocks=14, max_num_batched_tokens=2048))
    params = dataclasses.replace(MOVING, max_tokens=200)  # room enough for its 124 tokens
    completions = tight.generate([PROMPT] * 3, [params] * 3)
    assert tight.scheduler.num_preemptions > 0
    assert [list(c.output_token_ids) for c in completions] == [unmoved] * 3


def test_a_transcript_the_grammar_refuses_fails_alone(engine):
    wrong = tuple(engine.tokenizer.encode("hello there", add_special_tokens=False))
    snapshot = RequestSnapshot("transcript", tuple(engine.tokenizer.encode(PROMPT)), wrong, MOVING,
                               num_computed_tokens=0)
    import_request(engine, snapshot)
    free = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outputs = collect(engine, ["transcript", free])
    [failed] = outputs["transcript"]
    assert failed.finish_reason == "error" and failed.new_token_ids == ()
    assert failed.error.startswith("structured output failed: StructuredOutputError: output token 0 (id "), failed.error
    assert sum(len(out.new_token_ids) for out in outputs[free]) == 8
    assert outputs[free][-1].finish_reason == "length"


def test_a_structured_prefill_computed_while_weights_arrive_is_masked(model_dir, tmp_path):
    from tests.worker.loading.test_layer_gate import FakeLayerSource, config_only, land

    source = FakeLayerSource(model_dir)
    engine = Engine(config_only(model_dir, tmp_path), CONFIG, weights=source)
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_output=GrammarSpec.choice(CHOICES)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_output=GrammarSpec.regex(PATTERN))]
    ids = [engine.add_request("Pick:", params[0]), engine.add_request("Email:", params[1])]
    land(source, engine.runner.layer_gate, -1, 0)
    assert engine.step() == []  # the prefills went through the resident layers and wait at the frontier
    assert engine.movable_prefill_ids() == ids  # mid-pass: their first tokens are sampled from the zigzag pass
    source.release_all()
    outputs = collect(engine, ids)
    texts = ["".join(out.new_text for out in outputs[rid]) for rid in ids]
    assert texts[0] in CHOICES and re.fullmatch(PATTERN, texts[1]), texts
    loaded = Engine(model_dir, CONFIG).generate(["Pick:", "Email:"], params)
    assert texts == [c.text for c in loaded]
