"""Our Tokenizer against transformers.AutoTokenizer on the locally built demo tokenizer."""

from __future__ import annotations

import json

import pytest

from worker.models.demo_model import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, build_tokenizer
from worker.text.tokenizer import Tokenizer

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


# ---- chat templates saved as files (transformers >= 4.50), tools and template arguments ---------

# A Qwen3-like template: tools rendered into the system turn, `enable_thinking` read as a variable.
FILE_TEMPLATE = (
    "{%- if tools %}<|tools|>{{ tools | tojson }}\n{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>{%- endif %}{%- endif %}"
)
TOOL_USE_TEMPLATE = "TOOLS:{{ tools | length }}|{%- for m in messages %}{{ m['content'] }}{%- endfor %}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, tok_dir):
    """A tokenizer saved by transformers with a default and a named template: transformers writes
    chat_template.jinja and additional_chat_templates/tool_use.jinja, not tokenizer_config's key."""
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf.chat_template = {"default": FILE_TEMPLATE, "tool_use": TOOL_USE_TEMPLATE}
    out = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(str(out))
    assert (out / "chat_template.jinja").is_file() and (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return out


@pytest.mark.parametrize("chat", CHATS[:2])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_template_files_match_transformers(saved_dir, chat, kwargs):
    ours, theirs = Tokenizer.from_dir(saved_dir), transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    assert ours.has_chat_template and ours.chat_template_names == ("default", "tool_use")
    want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.apply_chat_template(chat, template_kwargs=kwargs) == want
    assert ours.encode_chat(chat, template_kwargs=kwargs) == theirs.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs)


def test_tools_pick_the_tool_use_template_as_transformers_does(saved_dir):
    ours, theirs = Tokenizer.from_dir(saved_dir), transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    want = theirs.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat, tools=TOOLS) == want == "TOOLS:1|Weather in Oslo?"


def test_tools_reach_the_default_template_without_a_tool_use_one(tmp_path, tok_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf.chat_template = FILE_TEMPLATE
    hf.save_pretrained(str(tmp_path))
    ours, theirs = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    rendered = ours.apply_chat_template(chat, tools=TOOLS)
    assert rendered == theirs.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"get_weather"' in rendered


def test_the_template_file_wins_over_the_config(tmp_path, tok_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "CONFIG"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "CONFIG"
    (tmp_path / "chat_template.jinja").write_text("FILE")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE"


def test_template_arguments_may_not_replace_the_request(ours):
    with pytest.raises(ValueError, match="may not set add_generation_prompt, messages"):
        ours.apply_chat_template([{"role": "user", "content": "x"}],
                                 template_kwargs={"messages": [], "add_generation_prompt": False})


def test_a_sentencepiece_only_dir_gets_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(FileNotFoundError, match=r"has only tokenizer.model .*save_pretrained"):
        Tokenizer.from_dir(tmp_path)


def test_the_thaw_format_keeps_every_chat_template(tmp_path, saved_dir):
    """The converter copies chat_template.jinja and additional_chat_templates/*.jinja."""
    import shutil

    from loader import convert_checkpoint
    from tests.model_factory import make_hf_checkpoint

    model_dir = make_hf_checkpoint(tmp_path / "hf", "llama", seed=1)
    for path in saved_dir.rglob("*"):
        if path.is_file():
            (model_dir / path.relative_to(saved_dir)).parent.mkdir(exist_ok=True)
            shutil.copy(path, model_dir / path.relative_to(saved_dir))
    convert_checkpoint(model_dir, tmp_path / "thaw", progress=False)
    converted = Tokenizer.from_dir(tmp_path / "thaw")
    assert converted.chat_template_names == ("default", "tool_use")
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    assert converted.apply_chat_template(chat, tools=TOOLS) == "TOOLS:1|Weather in Oslo?"
