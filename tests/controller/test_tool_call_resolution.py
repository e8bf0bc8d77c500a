"""A deploy resolves the spec's ``tool_call_parser: auto`` from the model's chat templates, stores
the result in the spec, and hands it to the gateway in the model's record; redeploying the same
"auto" spec stays a no-op; an explicit parser or "none" is kept as given."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from controller import ModelSpec
from controller.model_source import resolve_tool_call_format
from storage import LocalModelRepository
from tests.controller.test_controller import Harness, spec

HERMES = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
LLAMA = '<|start_header_id|>user<|end_header_id|>{"name": function name, "parameters": {...}}'


def reader(files: dict[str, str]):
    return lambda path: files[path].encode() if path in files else None


def model_spec(parser: str = "auto") -> ModelSpec:
    return ModelSpec(tenant="acme", name="m", source="/models/m", tool_call_parser=parser)


@pytest.mark.parametrize("files, expected", [
    ({"chat_template.jinja": HERMES}, "hermes"),
    ({"tokenizer_config.json": json.dumps({"chat_template": LLAMA})}, "llama3_json"),
    # The named form of tokenizer_config.json: the tool-use template is read first.
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": "plain"},
                                                             {"name": "tool_use", "template": HERMES}]})}, "hermes"),
    ({"additional_chat_templates/tool_use.jinja": "[TOOL_CALLS]", "chat_template.jinja": HERMES}, "mistral"),
    ({"chat_template.jinja": "{{ messages[0].content }}"}, None),
    ({}, None),
    ({"tokenizer_config.json": "{not json"}, None),
])
def test_auto_reads_the_format_the_templates_teach(files, expected):
    assert resolve_tool_call_format(model_spec(), reader(files)) == expected


def test_an_explicit_parser_or_none_is_kept_without_reading_anything():
    def unread(path):
        raise AssertionError(f"read {path}")
    assert resolve_tool_call_format(model_spec("llama3_json"), unread) == "llama3_json"
    assert resolve_tool_call_format(model_spec("none"), unread) is None


def test_deploy_stores_the_resolved_parser_and_the_record_carries_it(tmp_path):
    async def scenario():
        async with Harness(tmp_path) as h:
            controller = h.controller
            src: Path = h.source("m1")
            (src / "chat_template.jinja").write_text(HERMES)
            stored = await controller.deploy(spec("acme/m1", src))
            assert stored["tool_call_parser"] == "hermes"
            assert controller.model_record("acme/m1").tool_call_format == "hermes"
            # The same "auto" spec again changes nothing; it is not a different deploy.
            assert await controller.deploy(spec("acme/m1", src)) == stored
            # A model inside the repository (pushed earlier) is read there, file by file.
            other = h.source("m2", seed=2)
            (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA}))
            LocalModelRepository(tmp_path / "repo").push(other, "shared-m2")
            stored = await controller.deploy(spec("acme/m2", tmp_path / "repo" / "shared-m2"))
            assert stored["tool_call_parser"] == "llama3_json"
            # "none" turns parsing off whatever the template says.
            third = h.source("m3", seed=3)
            (third / "chat_template.jinja").write_text(HERMES)
            await controller.deploy({**spec("acme/m3", third), "tool_call_parser": "none"})
            assert controller.model_record("acme/m3").tool_call_format is None

    asyncio.run(scenario())
