"""Structured output: every output a grammar lets through is valid, and bad grammars are refused.

The walks use a tiny random-weight Llama (transformers' own, decoding with its KV cache) whose
logits have 40 padding columns past the tokenizer's vocab, as published models often do: 100
seeded walks at once, each step masking the logits with the matchers' bitmasks and sampling one
allowed token. Every walk must end (end-of-sequence accepted) within the token budget, and each
output must parse and validate: the json_schema's every rule is checked by hand (and by
`jsonschema` too where it is installed), json_object outputs must be JSON objects, regex outputs
must fully match, choice outputs must be one of the choices.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.model_factory import make_hf_checkpoint
from wire import GrammarSpec
from worker.text.structured_output import GrammarEngine, StructuredOutputConfig, apply_token_bitmask
from worker.text.tokenizer import Tokenizer

NUM_WALKS = 100
PADDING_COLUMNS = 40

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "note": {"type": ["string", "null"], "maxLength": 6}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}


def check_schema_by_hand(doc) -> None:
    """Every rule of SCHEMA, one assert each."""
    assert isinstance(doc, dict)
    assert set(doc) <= set(SCHEMA["properties"]) and set(SCHEMA["required"]) <= set(doc), sorted(doc)
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 12
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 120
    if "score" in doc:
        assert isinstance(doc["score"], (int, float)) and not isinstance(doc["score"], bool)
    assert doc["role"] in ("admin", "user", "guest")
    assert isinstance(doc["active"], bool)
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 8 for tag in doc["tags"])
    address = doc["address"]
    assert isinstance(address, dict) and set(address) <= {"zip", "note"} and "zip" in address
    assert isinstance(address["zip"], str) and re.fullmatch(r"[0-9]{5}", address["zip"])
    if "note" in address:
        assert address["note"] is None or (isinstance(address["note"], str) and len(address["note"]) <= 6)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from worker.models.demo_model import build_tokenizer

    return Tokenizer.from_dir(build_tokenizer(tmp_path_factory.mktemp("structured-tokenizer")))


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A tiny random Llama (the same tokenizer) whose logits are PADDING_COLUMNS wider than its vocab."""
    import transformers

    model_dir = make_hf_checkpoint(tmp_path_factory.mktemp("structured-model"), "llama", seed=21,
                                   max_position_embeddings=1024,
                                   vocab_size=tokenizer.vocab_size + PADDING_COLUMNS)
    assert Tokenizer.from_dir(model_dir).vocab_size == tokenizer.vocab_size
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return GrammarEngine(tokenizer, tokenizer.vocab_size + PADDING_COLUMNS)


def walk(engine: GrammarEngine, model, tokenizer: Tokenizer, spec: GrammarSpec, *, seed: int,
         max_tokens: int, num_walks: int = NUM_WALKS, enough: int | None = None) -> list[str | None]:
    """`num_walks` seeded walks decoded together; each step samples one token from the model's
    masked distribution. Returns each walk's text (None if it did not end within max_tokens, or
    before `enough` walks had ended)."""
    matchers = [engine.matcher(spec) for _ in range(num_walks)]
    outputs: list[list[int]] = [[] for _ in range(num_walks)]
    bitmask = engine.allocate_bitmask(num_walks)
    gen = torch.Generator().manual_seed(seed)
    prompt = tokenizer.encode("Answer in JSON:")
    input_ids = torch.tensor([prompt] * num_walks)
    past = None
    eos = min(engine.eos_token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
            if not live or (enough is not None and num_walks - len(live) >= enough):
                break
            out = model(input_ids=input_ids, cache=past, use_cache=True)
            past = out.cache
            logits = out.logits[:, -1, :].clone()  # [num_walks, V + padding]
            bitmask.fill_(-1)
            engine.fill_bitmasks([(matchers[i], i) for i in live], bitmask)
            apply_token_bitmask(logits, bitmask)
            probs = torch.softmax(logits, dim=-1)
            assert torch.isfinite(probs[live]).all() and (probs[live].sum(-1) > 0.99).all()
            next_ids = torch.multinomial(probs, 1, generator=gen).view(-1)
            for i in range(num_walks):
                if i not in live:
                    next_ids[i] = eos  # finished rows decode padding, never read
                    continue
                token_id = int(next_ids[i])
                assert token_id < tokenizer.vocab_size, "a padding column was sampled"
                assert matchers[i].accept_token(token_id), f"walk {i}: a token allowed by its mask was refused"
                if not matchers[i].is_terminated():
                    outputs[i].append(token_id)
            input_ids = next_ids.view(-1, 1)
    return [tokenizer.decode(ids, skip_special_tokens=False) if m.is_terminated() else None
            for ids, m in zip(outputs, matchers)]


def test_json_schema_walks_all_validate(engine, model, tokenizer):
    texts = walk(engine, model, tokenizer, GrammarSpec.json_schema(SCHEMA), seed=0, max_tokens=400)
    assert all(text is not None for text in texts), f"{texts.count(None)} walks did not end in 400 tokens"
    docs = [json.loads(text) for text in texts]  # strict: control characters in strings refused
    for doc in docs:
        check_schema_by_hand(doc)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        for doc in docs:
            jsonschema.validate(doc, SCHEMA)
    assert len({json.dumps(doc, sort_keys=True) for doc in docs}) == NUM_WALKS  # 100 different walks


def test_json_object_walks_all_parse(engine, model, tokenizer):
    # Any JSON object leaves string lengths and nesting unbounded, so a random walk may run out of
    # tokens (a request would end with finish_reason "length"); 120 walks give 100 finished ones.
    texts = walk(engine, model, tokenizer, GrammarSpec.json_object(), seed=1, max_tokens=1000, num_walks=120,
                 enough=NUM_WALKS)
    finished = [text for text in texts if text is not None]
    assert len(finished) >= NUM_WALKS, f"only {len(finished)} of 120 walks ended within 1000 tokens"
    for text in finished:
        assert isinstance(json.loads(text), dict), text


def test_regex_and_choice_walks(engine, model, tokenizer):
    pattern = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
    for text in walk(engine, model, tokenizer, GrammarSpec.regex(pattern), seed=2, max_tokens=40):
        assert text is not None and re.fullmatch(pattern, text), text
    choices = ["yes", "no", "maybe later"]
    texts = walk(engine, model, tokenizer, GrammarSpec.choice(choices), seed=3, max_tokens=20)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_invalid_schemas_are_refused_with_the_reason(engine):
    cases = {
        json.dumps({"type": "foo"}): "the JSON schema cannot be enforced: Invalid type: foo; "
                                     "change or remove that part of the schema",
        json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}):
            'the JSON schema cannot be enforced: Unimplemented keys: ["not"]; change or remove that part of the schema',
        json.dumps({"type": "string", "pattern": "(?<=a)b"}):
            "the JSON schema cannot be enforced: look-around, including look-ahead and look-behind, is not "
            "supported; change or remove that part of the schema",
        json.dumps({"type": "array", "minItems": 3, "maxItems": 1}):
            "the JSON schema cannot be enforced: Unsatisfiable schema: minItems (3) is greater than maxItems (1); "
            "change or remove that part of the schema",
    }
    num_cached = engine.num_cached_grammars
    for schema, message in cases.items():
        with pytest.raises(ValueError) as info:
            engine.compile(GrammarSpec.json_schema(schema))
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"^the regex cannot be enforced: unclosed character class \(the regex "
                                         r"syntax is Rust's"):
        engine.matcher(GrammarSpec.regex("[a-z"))
    with pytest.raises(ValueError, match="^the JSON schema is not valid JSON: Expecting property name"):
        GrammarSpec.json_schema("{type: object}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        GrammarSpec.json_schema("[1, 2]")
    assert engine.num_cached_grammars == num_cached  # refused specs are not cached


def test_grammar_spec_validation_and_repr():
    assert GrammarSpec.json_schema({"type": "object"}) == GrammarSpec.json_schema('{ "type" : "object" }')
    assert GrammarSpec.json_schema({"b": 1, "a": 2}).text == '{"b":1,"a":2}'  # key order kept
    with pytest.raises(ValueError, match="kind must be one of json_object, json_schema, regex, choice, structural_tag"):
        GrammarSpec("grammar", "x")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        GrammarSpec.choice([])
    with pytest.raises(ValueError, match=r"choice\[1\] must be a non-empty string"):
        GrammarSpec.choice(["a", 3])
    with pytest.raises(ValueError, match="non-empty string"):
        GrammarSpec.regex("")
    with pytest.raises(ValueError, match="takes no schema"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(ValueError, match=r"structures\[0\].begin must start with one of the triggers"):
        GrammarSpec.structural_tag([{"begin": "<tool>", "schema": {}, "end": "</tool>"}], ["<function="])
    spec = GrammarSpec.json_schema({"properties": {"secret": {"const": "hunter2"}}})
    assert "hunter2" not in repr(spec) and repr(spec).startswith("GrammarSpec(kind='json_schema', sha256=")


def test_cache_is_lru_per_grammar(tokenizer):
    engine = GrammarEngine(tokenizer, tokenizer.vocab_size, StructuredOutputConfig(max_cached_grammars=2))
    a, b, c = (GrammarSpec.choice([word]) for word in ("alpha", "beta", "gamma"))
    engine.compile(a)
    engine.compile(b)
    engine.matcher(a)  # a hit: a becomes the most recent
    engine.compile(c)  # evicts b
    assert (engine.num_cache_hits, engine.num_cache_misses, engine.num_cached_grammars) == (1, 3, 2)
    engine.compile(a)
    engine.compile(b)
    assert (engine.num_cache_hits, engine.num_cache_misses) == (2, 4)
    with pytest.raises(ValueError, match="max_cached_grammars must be a positive integer"):
        StructuredOutputConfig(max_cached_grammars=0)


def test_matcher_refuses_without_breaking(engine, tokenizer):
    eos = min(engine.eos_token_ids)
    matcher = engine.matcher(GrammarSpec.choice(["yes", "no"]))
    assert not matcher.accept_token(eos)  # nothing generated yet: the grammar is not complete
    assert not matcher.accept_token(tokenizer.vocab_size + 1)  # a padding id
    assert not matcher.accept_token(tokenizer.encode("maybe", add_special_tokens=False)[0])
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert not matcher.is_terminated()
    assert matcher.accept_token(eos) and matcher.is_terminated()
    assert not matcher.accept_token(eos)  # nothing after the end
    with pytest.raises(ValueError, match="can roll back 0 to 3 tokens, got 4"):
        matcher.rollback(4)


# A choice cannot grow after "yes" (the library does not count the end-of-sequence token there);
# a regex still could (it does).
@pytest.mark.parametrize("spec", [GrammarSpec.choice(["yes", "no"]), GrammarSpec.regex("(yes)+")],
                         ids=["grammar-complete", "grammar-could-grow"])
def test_rollback_across_the_end(engine, tokenizer, spec):
    eos = min(engine.eos_token_ids)
    ids = tokenizer.encode("yes", add_special_tokens=False)
    assert len(ids) >= 2
    matcher = engine.matcher(spec)
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos)
    matcher.rollback(2)  # the end and the last token
    assert not matcher.is_terminated() and matcher.num_tokens == len(ids) - 1
    assert not matcher.accept_token(eos)  # "ye" is not complete
    assert matcher.accept_token(ids[-1]) and matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(matcher.num_tokens)  # back to the start: the same walk again
    assert matcher.num_tokens == 0 and not matcher.accept_token(eos)
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos)
    matcher.rollback(1)
    assert matcher.num_tokens == len(ids) and not matcher.is_terminated()
    bitmask = engine.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    assert (int(bitmask[0, eos // 32]) >> (eos % 32)) & 1  # "yes" is complete again: the end is allowed


def test_masks_never_allow_padding_or_special_tokens(engine, tokenizer):
    matcher = engine.matcher(GrammarSpec.json_schema(SCHEMA))
    bitmask = engine.allocate_bitmask(2)
    text = '{"name": "'
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token_id)
    matcher.fill_bitmask(bitmask, 1)
    allowed = ((bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1).bool()
    assert allowed.shape[0] == engine.bitmask_width * 32 >= tokenizer.vocab_size + PADDING_COLUMNS
    assert not allowed[tokenizer.vocab_size:].any()
    for special_id in tokenizer.all_special_ids:
        assert not allowed[special_id]
    assert allowed[tokenizer.encode("fox", add_special_tokens=False)[0]]
    assert (bitmask[0] == -1).all()  # other rows untouched
    with pytest.raises(ValueError, match="contiguous CPU int32 tensor"):
        matcher.fill_bitmask(torch.zeros(1, engine.bitmask_width, dtype=torch.int64), 0)


def test_batch_fill_equals_one_by_one(engine, tokenizer):
    specs = [GrammarSpec.json_object(), GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex("[0-9]+")]
    prefixes = ['{"a": [1, ', '{"name": "x", "age": 1', "12"]
    matchers = []
    for spec, prefix in zip(specs, prefixes):
        matcher = engine.matcher(spec)
        for token_id in tokenizer.encode(prefix, add_special_tokens=False):
            assert matcher.accept_token(token_id)
        matchers.append(matcher)
    one_by_one = engine.allocate_bitmask(4)
    for row, matcher in zip((3, 0, 2), matchers):
        matcher.fill_bitmask(one_by_one, row)
    batched = engine.allocate_bitmask(4)
    engine.fill_bitmasks(list(zip(matchers, (3, 0, 2))), batched)
    assert torch.equal(batched, one_by_one)
    assert (batched[1] == -1).all() and not torch.equal(batched[0], batched[3])


def test_structural_tag_constrains_only_the_tagged_segment(engine, tokenizer):
    spec = GrammarSpec.structural_tag(
        [{"begin": "<function=get_weather>", "end": "</function>",
          "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                     "additionalProperties": False}}],
        triggers=["<function="])
    eos = min(engine.eos_token_ids)

    def accepts(text: str) -> bool:
        matcher = engine.matcher(spec)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False) + [eos])

    assert accepts('Let me look. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert accepts("No tool needed here.")
    assert not accepts('<function=get_weather>{"town": "Paris"}</function>')
    assert not accepts('<function=get_weather>{"city": 3}</function>')


def test_apply_token_bitmask_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(5)
    vocab = 70  # 3 words cover 96 ids; 2 words (64 ids) leave columns 64..69 uncovered
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32, generator=gen)
    expected = logits.clone()
    for row in range(4):
        for token in range(vocab):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    assert torch.equal(masked, expected)

    # Rows 3 and 1 only, with a mask narrower than the logits: the uncovered columns are masked.
    narrow = bitmask[[0, 2], :2].contiguous()
    masked = logits.clone()
    apply_token_bitmask(masked, narrow, rows=[3, 1])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for masked_row, mask_row in ((3, 0), (1, 1)):
        want = logits[masked_row].clone()
        for token in range(vocab):
            if token >= 64 or not (int(narrow[mask_row, token // 32]) >> (token % 32)) & 1:
                want[token] = float("-inf")
        assert torch.equal(masked[masked_row], want)
    with pytest.raises(ValueError, match="2 rows for 1 masked logits rows"):
        apply_token_bitmask(masked, narrow, rows=[0])


def test_engine_needs_an_end_of_sequence_token(tmp_path):
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    with pytest.raises(ValueError, match="needs the model's end-of-sequence token"):
        GrammarEngine(Tokenizer(backend), 16)



def test_a_schema_may_ask_for_compact_json_but_not_for_unbounded_whitespace(engine, tokenizer):
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    open_brace = tokenizer.encode("{", add_special_tokens=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible = engine.matcher(GrammarSpec.json_schema(schema))
    compact = engine.matcher(GrammarSpec.json_schema({**schema, "x-guidance": {"whitespace_flexible": False}}))
    for matcher in (flexible, compact):
        for token_id in open_brace:
            assert matcher.accept_token(token_id)
    assert flexible.accept_token(space[0])  # the default allows (bounded) whitespace
    assert not compact.accept_token(space[0])  # the schema tightened it to none
