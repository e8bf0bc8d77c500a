"""Several choices (``n``), ``echo`` and structured-output refusals through the gateway app over
the scripted backend of `test_gateway_app`."""

from __future__ import annotations

import pytest

from tests.infra.test_gateway_app import (  # noqa: F401 - fixtures
    ACME,
    CHAT,
    app,
    backend,
    client,
    error_of,
    metrics,
    sse_events,
)


def test_n_choices_are_requests_of_their_own_with_seeds_in_turn(client, backend):
    response = client.post("/v1/completions", headers=ACME,
                           json={"model": "acme/m", "prompt": "x", "n": 3, "seed": 2**64 - 2})
    body = response.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Hello!"), (1, "Hello!"), (2, "Hello!")]
    # The prompt counted once, the completions summed (OpenAI's rule).
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    ids = [call[1] for call in backend.calls]
    assert ids[0] == f"{body['id']}-0" and sorted(ids) == [f"{body['id']}-{i}" for i in range(3)]
    assert [call[3].seed for call in sorted(backend.calls, key=lambda c: c[1])] == [2**64 - 2, 2**64 - 1, 0]


def test_n_choices_stream_each_with_its_index(client, backend):
    response = client.post("/v1/chat/completions", headers=ACME, json={
        "model": "acme/m", "messages": CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_events(response.text)[:-1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine) == "Hello!"
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert {c["id"] for c in chunks} == {response.headers["x-request-id"]}


def test_when_the_first_choice_fails_the_others_are_never_sent(client, backend):
    error = error_of(client.post("/v1/completions", headers=ACME,
                                 json={"model": "acme/m", "prompt": "overloaded", "n": 4}), 429)
    assert error["code"] is not None and len(backend.calls) == 1


def test_echo_puts_the_prompt_before_the_completion(client):
    body = client.post("/v1/completions", headers=ACME, json={"model": "acme/m", "prompt": "say ", "echo": True}).json()
    assert body["choices"][0]["text"] == "say Hello!"
    chunks = sse_events(client.post("/v1/completions", headers=ACME, json={
        "model": "acme/m", "prompt": "say ", "echo": True, "stream": True}).text)[:-1]
    assert chunks[0]["choices"][0]["text"] == "say Hel"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "say Hello!"


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": {"not": {}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
])
def test_a_grammar_the_worker_cannot_enforce_is_a_400_naming_the_field_sent(client, fields, param):
    error = error_of(client.post("/v1/completions", headers=ACME,
                                 json={"model": "acme/m", "prompt": "bad grammar", **fields}), 400)
    assert error["param"] == param and "cannot be enforced" in error["message"]
