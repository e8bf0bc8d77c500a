"""Numeric extremes in every numeric field of the generation routes (issue 19): never a 5xx.

The fuzz pass (test_gateway_fuzz.py) draws values the schema describes; this is the explicit
grid it may miss: each numeric field of ``/v1/completions`` and ``/v1/chat/completions`` set, one
at a time, to zero, negatives, the smallest subnormal, the largest double, a literal that
overflows to infinity, ``NaN``/``Infinity`` (which Python's JSON parser accepts), the 32- and
64-bit integer edges and beyond, and values of the wrong type. The app and engine are the fuzz
pass's (`LocalEngineBackend` over a tiny demo Llama, the real app, real keys). Every answer is
a 2xx or a 4xx with an OpenAI error body; a 200 carries a completion; and the engine still
serves a plain request at the end.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from fastapi.testclient import TestClient

from tests.infra.test_gateway_fuzz import MODEL, gateway  # noqa: F401 - the fixture, shared

# Raw JSON literals: some are not valid JSON for strict parsers, which is the point.
EXTREMES = (
    "0", "-0.0", "-1", "1", "1e-39", "5e-324", "-5e-324", "1.7976931348623157e308", "1e400", "-1e400",
    "NaN", "Infinity", "-Infinity", "2147483647", "2147483648", "9007199254740993", "9223372036854775807",
    "9223372036854775808", "18446744073709551616", "-9223372036854775809", "1" + "0" * 100, "0.5", "true",
    '"7"', "null", "[]", "{}",
)
SCALAR_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs", "top_logprobs",
                 "presence_penalty", "frequency_penalty")
COMPLETION_ONLY = ("best_of",)
CHAT_ONLY = ("max_completion_tokens",)


def bodies(path: str):
    """(label, raw JSON body) for every field x extreme, scalar fields and inside lists/maps."""
    base = ('{"model": "%s", "prompt": "hello", "max_tokens": 4' % MODEL if path == "/v1/completions"
            else '{"model": "%s", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4' % MODEL)
    fields = SCALAR_FIELDS + (COMPLETION_ONLY if path == "/v1/completions" else CHAT_ONLY)
    for value in EXTREMES:
        for name in fields:
            if name == "max_tokens":
                yield name, base.replace('"max_tokens": 4', f'"max_tokens": {value}') + "}"
            else:
                yield name, f'{base}, "{name}": {value}}}'
        yield "stop_token_ids", f'{base}, "stop_token_ids": [{value}]}}'
        yield "logit_bias", f'{base}, "logit_bias": {{"5": {value}}}}}'
        if path == "/v1/completions":
            yield "prompt ids", ('{"model": "%s", "prompt": [1, %s], "max_tokens": 4}' % (MODEL, value))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_numeric_extremes_get_a_clean_answer_never_a_5xx(gateway, path):  # noqa: F811 - the imported fixture
    _, app, keys = gateway
    headers = {"Authorization": f"Bearer {keys['tenant']}", "Content-Type": "application/json"}
    statuses: Counter = Counter()
    with TestClient(app, raise_server_exceptions=False) as client:
        for field, body in bodies(path):
            response = client.post(path, content=body, headers=headers)
            seen = (field, body, response.status_code, response.text[:300])
            assert response.status_code < 500, seen
            if response.status_code == 200:
                assert response.json()["choices"], seen
            else:
                error = response.json()["error"]
                assert 400 <= response.status_code < 500 and error["message"] and error["type"], seen
                assert "Traceback" not in response.text and "Error:" not in error["message"], seen
            statuses[response.status_code] += 1
        # The engine took every accepted extreme and still serves.
        plain = client.post(path, content=next(bodies(path))[1].replace('"max_tokens": 0', '"max_tokens": 4'),
                            headers=headers)
        assert plain.status_code == 200, plain.text
    assert statuses[200] > 0 and sum(statuses.values()) == len(list(bodies(path)))
    print(f"RELIABILITY numeric extremes {path}: {sum(statuses.values())} requests, "
          f"{json.dumps(dict(sorted(statuses.items())))}, no 5xx")
