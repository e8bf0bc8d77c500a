"""Our Tokenizer against transformers.AutoTokenizer on the locally built demo tokenizer."""

from __future__ import annotations

import json

import pytest

from worker.demo_model import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, build_tokenizer
from worker.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " leading space and trailing space ",
    "The café was naïve about crème brûlée.",
    "日本語のテキスト",
    "Emoji: 😀🎉🚀 👍🏽 ❤️",
    "Zürich, São Paulo, Kraków",
    "tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x * 2",
    "text with <|eot_id|> inside and <|begin_of_text|> too",
]

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 😀 日本語"},
    ],
    [{"role": "user", "content": ""}, {"role": "tool", "content": '{"ok": true}'}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    # A generation config with an extra eos id, like Llama 3 instruct ships.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return out


@pytest.fixture(scope="module")
def ours(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def theirs(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_encode_prepends_bos(ours):
    assert ours.encode("Hello")[0] == ours.bos_token_id
    assert ours.encode("") == [ours.bos_token_id]
    assert ours.encode("", add_special_tokens=False) == []
    assert ours.encode("Hello", add_special_tokens=False)[0] != ours.bos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == text.replace("<|eot_id|>", "").replace("<|begin_of_text|>", "")


def test_convert_ids_to_tokens_matches_transformers(ours, theirs):
    ids = ours.encode("café 😀 <|eot_id|>")
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def test_special_ids(ours, theirs):
    assert ours.vocab_size == len(theirs) == 1024
    assert ours.bos_token_id == theirs.bos_token_id == ours.token_to_id(BOS_TOKEN)
    assert list(ours.all_special_ids) == theirs.all_special_ids
    # tokenizer_config's eos (<|eot_id|>) first, then generation_config's extra <|end_of_text|>, deduplicated.
    assert ours.eos_token_ids == (ours.token_to_id(EOT_TOKEN), ours.token_to_id(EOS_TOKEN))
    assert ours.eos_token_ids[0] == theirs.eos_token_id


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, chat, add_generation_prompt):
    rendered = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    expected_ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(expected_ids, list):  # transformers 5 returns a BatchEncoding by default
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(chat, add_generation_prompt=add_generation_prompt) == expected_ids


def test_chat_template_llama3_layout(ours):
    rendered = ours.apply_chat_template([{"role": "user", "content": " Hi "}])
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = ours.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages[0] must be a dict"),
        ([{"content": "x"}], "messages[0]['role']"),
        ([{"role": "robot", "content": "x"}], "messages[0]['role']"),
        ([{"role": 1, "content": "x"}], "messages[0]['role']"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1]['content']"),
        ([{"role": "user", "content": ["part"]}], "messages[0]['content']"),
    ],
)
def test_bad_messages_raise_value_error(ours, messages, needle):
    with pytest.raises(ValueError) as excinfo:
        ours.apply_chat_template(messages)
    assert needle in str(excinfo.value)


def test_bad_message_error_does_not_leak_content(ours):
    with pytest.raises(ValueError) as excinfo:
        ours.apply_chat_template([{"role": "villain", "content": "secret prompt text"}])
    assert "secret" not in str(excinfo.value)


def test_template_raise_exception_surfaces(tmp_path):
    build_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "unused"},
        {
            "name": "default",
            "template": "{{ raise_exception('no system role') if messages[0].role == 'system' }}"
            "{{ messages | tojson }}",
        },
    ]
    config_path.write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    with pytest.raises(ValueError, match="chat template refused these messages: no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_added_token_dicts_and_missing_template(tmp_path):
    build_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config["bos_token"] = {"__type": "AddedToken", "content": BOS_TOKEN, "special": True}
    config["eos_token"] = {"content": EOS_TOKEN}
    config_path.write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == tok.token_to_id(BOS_TOKEN)
    assert tok.eos_token_ids == (tok.token_to_id(EOS_TOKEN),)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError) as excinfo:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(excinfo.value)


def test_repr_has_no_text(ours):
    text = repr(ours)
    assert "Tokenizer(" in text and "vocab_size=1024" in text
    assert "<|" not in text and "start_header_id" not in text
