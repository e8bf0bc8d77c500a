"""The gateway app against a scripted backend: routes, every error status with its body,
auth and tenancy, metrics, and progress comments for requests that wait in a queue, through
Starlette's TestClient. Client disconnects are in `test_gateway_disconnects`, several choices
and echo in `test_gateway_choices`; both reuse this file's backend and fixtures.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import openai
import pytest
from fastapi.testclient import TestClient

from infra.gateway_app import build_gateway_app, thaw_version
from infra.gateway_auth import GatewayAuth, Principal
from infra.gateway_backend import (
    BackendUnavailable,
    GatewayBackend,
    ContextLengthExceeded,
    GenerationChunk,
    InvalidRequest,
    ModelCard,
    ModelNotFound,
    ModelOverloaded,
    QueueProgress,
    QueueTimeout,
)
from infra.gateway_metrics import GatewayMetrics
from wire import ChatPrompt
from worker import SamplingParams

KEYS = {"key-acme": "acme", "key-other": "other"}
ADMIN_KEY = "admin-key-0123456789"
ACME = {"Authorization": "Bearer key-acme"}
CHAT = [{"role": "user", "content": "hi"}]
LOOPBACK = "http://localhost"  # a no-auth gateway answers only loopback names in Host
DEADLINE_S = 10.0
SLOT_LINE = "waiting for a slot: position 2, about 1.4 s"


class ScriptedBackend:
    """A `GatewayBackend` whose behaviour is picked by the prompt text; records what it was asked."""

    def __init__(self) -> None:
        self.cards = {m: ModelCard(model_id=m, owned_by=m.split("/")[0], created_s=100, max_model_len=64)
                      for m in ("acme/m", "acme/n", "other/m")}
        self.calls: list[tuple[str, str, object, SamplingParams]] = []
        self.aborts: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.ready: bool | Exception = True
        self._waiting: asyncio.Event | None = None

    def waiting_event(self) -> asyncio.Event:
        if self._waiting is None:
            self._waiting = asyncio.Event()
        return self._waiting

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        return [c for m, c in sorted(self.cards.items()) if tenant is None or c.owned_by == tenant]

    async def describe_model(self, model_id: str) -> ModelCard:
        if model_id not in self.cards:
            raise ModelNotFound(model_id)
        return self.cards[model_id]

    async def generate(self, model_id: str, request_id: str, prompt, params: SamplingParams
                       ) -> AsyncIterator[GenerationChunk]:
        self.calls.append((model_id, request_id, prompt, params))
        text = prompt if isinstance(prompt, str) else prompt.messages[-1]["content"]
        try:
            if text == "overloaded":
                raise ModelOverloaded("model acme/m has 8 requests queued, the most it holds", 2.5)
            if text == "timeout":
                raise QueueTimeout("no instance of acme/m became ready within 30 s", 10)
            if text == "too long":
                raise ContextLengthExceeded("the prompt is 99 tokens but the model's context is 64 tokens", "prompt")
            if text == "bad ids":
                raise InvalidRequest("prompt token ids must be in [0, 10)", "prompt")
            if text == "bad grammar":  # what a worker says of a schema its grammar engine cannot enforce
                raise InvalidRequest("structured_output: the JSON schema cannot be enforced: Unimplemented keys "
                                     '["not"]; change or remove that part of the schema', "structured_output")
            if text == "dead":
                raise BackendUnavailable("the engine stopped", retry_after_s=1)
            if text == "bug":
                raise RuntimeError("an internal detail that must not leak")
            if text == "cold":  # waits for an instance that never comes
                self.waiting_event().set()
                await asyncio.Event().wait()
            if text.startswith("queued"):  # waits in a queue, with news, before an instance takes it
                yield QueueProgress(text=SLOT_LINE)
                yield QueueProgress(text="a line\ndata: {\"forged\": 1}" if text == "queued forged" else SLOT_LINE)
                if text == "queued until timeout":
                    raise QueueTimeout(f"no instance of acme/m became ready within 30 s: {SLOT_LINE}", 2)
                if text == "queued forever":
                    self.waiting_event().set()
                    await asyncio.Event().wait()
            words = ["Hel", "lo", "!"]
            for i, word in enumerate(words):
                if text == "fail midway" and i == 1:
                    raise BackendUnavailable("the instance was lost")
                if text == "timeout midway" and i == 1:  # e.g. a call to an unreachable actor
                    raise TimeoutError("a call the backend made timed out")
                if text == "endless" and i == 1:
                    self.waiting_event().set()
                    await asyncio.Event().wait()
                last = i == len(words) - 1
                yield GenerationChunk(request_id=request_id, text=word, token_ids=(10 + i,),
                                      finish_reason="length" if last else None, num_prompt_tokens=4,
                                      num_completion_tokens=i + 1, queue_s=0.25 if i == 0 else None)
        finally:
            self.closed.append(request_id)

    async def abort(self, model_id: str, request_id: str) -> None:
        self.aborts.append((model_id, request_id))

    async def is_ready(self) -> bool:
        if isinstance(self.ready, Exception):
            raise self.ready
        return self.ready


@pytest.fixture()
def backend() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture()
def metrics() -> GatewayMetrics:
    return GatewayMetrics()


@pytest.fixture()
def app(backend, metrics):
    return build_gateway_app(backend, GatewayAuth(verify_api_key=KEYS.get, admin_key=ADMIN_KEY), metrics,
                             max_body_bytes=4096)


@pytest.fixture()
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def error_of(response, status: int) -> dict:
    """The OpenAI error object of a response, checking its status and exact shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"]
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def sse_events(text: str) -> list:
    """The decoded `data:` payloads of an SSE body; "[DONE]" stays a string."""
    assert text.endswith("data: [DONE]\n\n")
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert all(not e.startswith("data:") for e in events)
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# ---- the happy paths ---------------------------------------------------------------------------


def test_completion_whole(client, backend):
    response = client.post("/v1/completions", json={"model": "acme/m", "prompt": "say hi", "temperature": 0},
                           headers=ACME)
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == response.headers["x-request-id"] and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion" and body["model"] == "acme/m"
    assert body["choices"] == [{"index": 0, "text": "Hello!", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    (model_id, request_id, prompt, params), = backend.calls
    assert (model_id, request_id, prompt) == ("acme/m", body["id"], "say hi")
    # Left out: top_k and top_p, which the model's generation_config.json may set at the worker.
    assert params == SamplingParams(max_tokens=16, temperature=0.0, model_defaults=("top_k", "top_p"))
    assert backend.aborts == []  # finished normally: nothing to abort


def test_chat_stream_with_usage(client, backend):
    response = client.post("/v1/chat/completions", headers=ACME, json={
        "model": "acme/m", "messages": CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {response.headers["x-request-id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    # A chat without max_tokens may use the model's whole context.
    assert backend.calls[0][3].max_tokens == 64 and backend.calls[0][2] == ChatPrompt(messages=tuple(CHAT))


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    # vLLM's extension, which its benchmark tool (guidellm) sends on every request.
    response = client.post("/v1/chat/completions", headers=ACME, json={
        "model": "acme/m", "messages": CHAT, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = sse_events(response.text)[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 1, 2, 3, 3]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {4}
    assert chunks[-1]["choices"] == []  # include_usage's closing chunk as well
    response = client.post("/v1/completions", headers=ACME, json={
        "model": "acme/m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    chunks = sse_events(response.text)[:-1]
    assert [c["usage"]["total_tokens"] for c in chunks] == [5, 6, 7]


def test_stream_without_include_usage_has_no_usage_chunk(client):
    response = client.post("/v1/completions", headers=ACME,
                           json={"model": "acme/m", "prompt": "x", "stream": True})
    chunks = sse_events(response.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello!"
    assert all(c["choices"] and c["usage"] is None for c in chunks)


def test_per_model_routes(client, backend):
    base = "/models/acme/m/v1"
    response = client.post(f"{base}/chat/completions", json={"messages": CHAT}, headers=ACME)
    assert response.status_code == 200 and response.json()["model"] == "acme/m"
    response = client.post(f"{base}/completions", json={"model": "acme/m", "prompt": "x"}, headers=ACME)
    assert response.status_code == 200
    assert [c[0] for c in backend.calls] == ["acme/m", "acme/m"]
    error = error_of(client.post(f"{base}/completions", json={"model": "acme/n", "prompt": "x"}, headers=ACME), 400)
    assert error["param"] == "model" and "does not match" in error["message"]
    assert [m["id"] for m in client.get(f"{base}/models", headers=ACME).json()["data"]] == ["acme/m"]
    assert client.get(f"{base}/models/acme/m", headers=ACME).json()["id"] == "acme/m"
    error_of(client.get(f"{base}/models/acme/n", headers=ACME), 404)
    error_of(client.post("/models/acme/zz/v1/completions", json={"prompt": "x"}, headers=ACME), 404)
    error_of(client.post("/models/other/m/v1/completions", json={"prompt": "x"}, headers=ACME), 403)


def test_a_gateway_wide_chat_default_replaces_the_model_context(backend):
    with TestClient(build_gateway_app(backend, GatewayAuth.no_auth(), chat_default_max_tokens=5),
                    base_url=LOOPBACK) as client:
        client.post("/v1/chat/completions", json={"model": "acme/m", "messages": CHAT})
        client.post("/v1/chat/completions", json={"model": "acme/m", "messages": CHAT, "max_tokens": 9})
    assert [call[3].max_tokens for call in backend.calls] == [5, 9]


def test_model_listing_is_per_tenant(client):
    def ids(headers):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 200 and response.json()["object"] == "list"
        return [m["id"] for m in response.json()["data"]]

    assert ids(ACME) == ["acme/m", "acme/n"]
    assert ids({"Authorization": "Bearer key-other"}) == ["other/m"]
    assert ids({"Authorization": f"Bearer {ADMIN_KEY}"}) == ["acme/m", "acme/n", "other/m"]
    assert client.get("/v1/models/acme/n", headers=ACME).json() == {
        "id": "acme/n", "object": "model", "created": 100, "owned_by": "acme", "max_model_len": 64}


def test_no_auth_mode_lets_anyone_use_everything(backend):
    with TestClient(build_gateway_app(backend, GatewayAuth.no_auth()), base_url=LOOPBACK) as client:
        assert len(client.get("/v1/models").json()["data"]) == 3
        assert client.post("/v1/completions", json={"model": "other/m", "prompt": "x"}).status_code == 200


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers, words", [
    ({}, "no API key"),
    ({"Authorization": "Basic a2V5"}, "Bearer"),
    ({"Authorization": "Bearer "}, "empty key"),
    ({"Authorization": "Bearer key-nobody"}, "not valid"),
])
def test_401_for_a_missing_or_unknown_key(client, backend, headers, words):
    for path, body in (("/v1/completions", {"model": "acme/m", "prompt": "x", "temperature": -1}),
                       ("/v1/chat/completions", {"model": "acme/m", "messages": CHAT})):
        response = client.post(path, json=body, headers=headers)
        error = error_of(response, 401)
        assert words in error["message"] and error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    error_of(client.get("/v1/models", headers=headers), 401)
    assert backend.calls == []


def test_403_for_a_model_of_another_tenant(client, backend):
    error = error_of(client.post("/v1/completions", json={"model": "other/m", "prompt": "x"}, headers=ACME), 403)
    assert error["param"] == "model" and error["code"] == "model_not_permitted"
    error_of(client.get("/v1/models/other/m", headers=ACME), 403)
    # Not even whether it exists is revealed: an unknown model of another tenant is 403 too.
    error_of(client.get("/v1/models/other/zz", headers=ACME), 403)
    assert backend.calls == []


@pytest.mark.parametrize("model", ["acme/zz", "gpt-4", "a/b/c", "Acme/M"])
def test_404_for_an_unknown_model(client, model):
    error = error_of(client.post("/v1/chat/completions", json={"model": model, "messages": CHAT}, headers=ACME), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and model in error["message"]
    error_of(client.get(f"/v1/models/{model}", headers=ACME), 404)


def test_400_bad_bodies_name_their_fields(client, backend):
    error = error_of(client.post("/v1/completions", headers=ACME, json={
        "model": "acme/m", "prompt": "x", "temperature": -1, "max_tokens": 0}), 400)
    # Both are named; param is the first in the schema's order.
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert "temperature:" in error["message"] and "max_tokens:" in error["message"]
    error = error_of(client.post("/v1/completions", json={"prompt": "x"}, headers=ACME), 400)
    assert error["param"] == "model" and "required" in error["message"]
    error = error_of(client.post("/v1/completions", content=b'{"model": "acme/m", "prompt": ',
                                 headers={**ACME, "content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    error = error_of(client.post("/v1/completions", json=["not", "an", "object"], headers=ACME), 400)
    error = error_of(client.post("/v1/chat/completions", headers=ACME, json={
        "model": "acme/m", "messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}), 400)
    assert error["param"] == "messages[1].role"
    assert backend.calls == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt, status, code, param, retry_after", [
    ("overloaded", 429, "model_overloaded", None, "3"),
    ("timeout", 503, "queue_timeout", None, "10"),
    ("dead", 503, "backend_unavailable", None, "1"),
    ("too long", 400, "context_length_exceeded", "prompt", None),
    ("bad ids", 400, None, "prompt", None),
    ("bug", 500, None, None, None),
])
def test_backend_refusals_keep_their_status_even_when_streaming(client, backend, stream, prompt, status, code,
                                                                 param, retry_after):
    response = client.post("/v1/completions", headers=ACME,
                           json={"model": "acme/m", "prompt": prompt, "stream": stream})
    error = error_of(response, status)
    assert (error["code"], error["param"]) == (code, param)
    assert response.headers.get("retry-after") == retry_after
    assert "internal detail" not in error["message"]
    assert backend.aborts == []  # the backend ended the request itself


def test_failure_mid_stream_is_reported_in_band(client):
    response = client.post("/v1/completions", headers=ACME,
                           json={"model": "acme/m", "prompt": "fail midway", "stream": True})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[0]["choices"][0]["text"] == "Hel"
    assert events[1]["error"]["code"] == "backend_unavailable" and events[2] == "[DONE]"


def test_failure_mid_request_without_stream_is_an_error_status(client):
    error = error_of(client.post("/v1/completions", headers=ACME,
                                 json={"model": "acme/m", "prompt": "fail midway"}), 503)
    assert error["message"] == "the instance was lost"


# ---- requests that wait in a queue ---------------------------------------------------------------


def sse_blocks(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


def streamed_text(path: str, events: list) -> str:
    if path == "/v1/chat/completions":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


WAITING_BODIES = [("/v1/chat/completions", {"model": "acme/m", "messages": [{"role": "user", "content": "queued"}]}),
                  ("/v1/completions", {"model": "acme/m", "prompt": "queued"})]


@pytest.mark.parametrize("path, body", WAITING_BODIES)
def test_a_waiting_stream_gets_progress_comments_before_its_data(client, path, body):
    response = client.post(path, headers=ACME, json={**body, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = sse_blocks(response.text)
    assert blocks[:2] == [f": {SLOT_LINE}", f": {SLOT_LINE}"]
    assert all(block.startswith("data: ") for block in blocks[2:])
    events = sse_events(response.text.split("\n\n", 2)[2])
    assert streamed_text(path, events) == "Hello!" and events[-1] == "[DONE]"
    if path == "/v1/chat/completions":  # the role still comes with the first data chunk
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("path, body", WAITING_BODIES)
def test_a_waiting_request_without_stream_gets_plain_json(client, path, body):
    response = client.post(path, headers=ACME, json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"] if "message" in choice else choice["text"]) == "Hello!"
    assert response.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_a_deadline_after_progress_is_in_band_for_a_stream_and_503_otherwise(client):
    body = {"model": "acme/m", "prompt": "queued until timeout"}
    streamed = client.post("/v1/completions", headers=ACME, json={**body, "stream": True})
    assert streamed.status_code == 200  # the status went out with the first comment
    assert sse_blocks(streamed.text)[:2] == [f": {SLOT_LINE}", f": {SLOT_LINE}"]
    error, done = sse_events(streamed.text.split("\n\n", 2)[2])
    assert error["error"]["code"] == "queue_timeout" and SLOT_LINE in error["error"]["message"] and done == "[DONE]"
    whole = client.post("/v1/completions", headers=ACME, json=body)
    error = error_of(whole, 503)
    assert error["code"] == "queue_timeout" and error["message"].endswith(SLOT_LINE)
    assert whole.headers["retry-after"] == "2"


def test_a_progress_line_cannot_break_out_of_its_comment(client):
    response = client.post("/v1/completions", headers=ACME,
                           json={"model": "acme/m", "prompt": "queued forged", "stream": True})
    assert sse_blocks(response.text)[:2] == [f": {SLOT_LINE}", ': a line data: {"forged": 1}']
    assert "forged" not in json.dumps(sse_events(response.text.split("\n\n", 2)[2]))


def test_the_openai_client_skips_progress_comments(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="key-acme", http_client=client, max_retries=0)
    stream = sdk.chat.completions.create(model="acme/m", messages=[{"role": "user", "content": "queued"}],
                                         stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "Hello!"
    with pytest.raises(openai.APIError, match="within 30 s"):
        list(sdk.completions.create(model="acme/m", prompt="queued until timeout", stream=True))


def test_413_for_a_body_over_the_limit(client, backend):
    big = {"model": "acme/m", "prompt": "x" * 5000}
    error = error_of(client.post("/v1/completions", json=big, headers=ACME), 413)
    assert error["code"] == "request_too_large" and "4096" in error["message"]

    def chunked():  # no Content-Length: counted as it arrives
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            yield payload[i:i + 1000]

    error_of(client.post("/v1/completions", content=chunked(),
                         headers={**ACME, "content-type": "application/json"}), 413)
    assert backend.calls == []


def test_unknown_routes_and_methods_answer_in_openai_shape(client):
    error_of(client.get("/v1/nothing-here", headers=ACME), 404)
    error_of(client.get("/v1/completions", headers=ACME), 405)


def test_unexpected_backend_failure_outside_generation_is_a_500_without_details(backend):
    async def broken(model_id):
        raise RuntimeError("secret internals")

    backend.describe_model = broken
    with TestClient(build_gateway_app(backend, GatewayAuth.no_auth()), raise_server_exceptions=False,
                    base_url=LOOPBACK) as client:
        error = error_of(client.get("/v1/models/acme/m"), 500)
        assert error["type"] == "server_error" and "secret" not in error["message"]


# ---- health, readiness, metrics ----------------------------------------------------------------


def test_health_and_readiness(client, backend):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    backend.ready = False
    error_of(client.get("/readyz"), 503)
    backend.ready = ConnectionError("controller unreachable")
    assert error_of(client.get("/readyz"), 503)["code"] == "backend_unavailable"


def test_vllm_probes_and_version_need_no_key(client, backend):
    # guidellm checks GET /health before a run; SageMaker calls /ping.
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        response = client.request(method, path)
        assert (response.status_code, response.content) == (200, b"")
    assert client.get("/version").json() == {"version": thaw_version()} and thaw_version() != ""
    backend.ready = False
    assert error_of(client.get("/health"), 503)["code"] == "backend_unavailable"
    error_of(client.post("/ping"), 503)


def test_metrics_count_requests_per_model_and_status(client, metrics):
    client.post("/v1/completions", json={"model": "acme/m", "prompt": "x", "stream": True}, headers=ACME)
    client.post("/v1/completions", json={"model": "acme/m", "prompt": "overloaded"}, headers=ACME)
    client.post("/v1/chat/completions", json={"model": "acme/made-up-1", "messages": CHAT}, headers=ACME)
    client.post("/v1/chat/completions", json={"model": "acme/m", "messages": CHAT}, headers={})
    metrics.record_cold_start("acme/m", "dram", 0.2)
    metrics.set_instances("acme/m", 2)
    text = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text

    def value(line_start: str) -> float:
        (line,) = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])

    assert value('thaw_gateway_requests_total{endpoint="completions",model="acme/m",status="200"}') == 1
    assert value('thaw_gateway_requests_total{endpoint="completions",model="acme/m",status="429"}') == 1
    # A made-up model name never becomes a label.
    assert value('thaw_gateway_requests_total{endpoint="chat",model="",status="404"}') == 1
    assert value('thaw_gateway_requests_total{endpoint="chat",model="",status="401"}') == 1
    assert "made-up" not in text
    assert value('thaw_time_to_first_token_seconds_count{model="acme/m"}') == 1
    assert value('thaw_inter_token_latency_seconds_count{model="acme/m"}') == 2
    assert value('thaw_e2e_request_latency_seconds_count{model="acme/m"}') == 1
    assert value('thaw_queue_time_seconds_sum{model="acme/m"}') == 0.25
    assert value('thaw_generation_tokens_total{model="acme/m"}') == 3
    assert value('thaw_cold_starts_total{model="acme/m",tier="dram"}') == 1
    assert value('thaw_load_seconds_count{model="acme/m",tier="dram"}') == 1
    assert value('thaw_model_instances{model="acme/m"}') == 2
    # The same observations under vLLM's names and label, for dashboards built for vLLM.
    assert value('vllm:time_to_first_token_seconds_count{model_name="acme/m"}') == 1
    assert value('vllm:inter_token_latency_seconds_count{model_name="acme/m"}') == 2
    assert value('vllm:e2e_request_latency_seconds_count{model_name="acme/m"}') == 1
    assert value('vllm:request_queue_time_seconds_sum{model_name="acme/m"}') == 0.25
    assert value('vllm:generation_tokens_total{model_name="acme/m"}') == 3
    assert value('vllm:prompt_tokens_total{model_name="acme/m"}') == value('thaw_prompt_tokens_total{model="acme/m"}')


def test_two_apps_in_one_process_keep_separate_metrics(backend):
    first, second = GatewayMetrics(), GatewayMetrics()
    for metrics in (first, second):
        build_gateway_app(backend, GatewayAuth.no_auth(), metrics)
    first.record_request("acme/m", "chat", 200)
    assert b'status="200"' in first.render()[0] and b'status="200"' not in second.render()[0]


# ---- auth configuration ------------------------------------------------------------------------


def test_auth_configuration_is_checked():
    with pytest.raises(ValueError, match="no way to accept a key"):
        GatewayAuth()
    with pytest.raises(ValueError, match="at least 16"):
        GatewayAuth(admin_key="short")
    assert Principal(tenant="acme", is_admin=False).may_use("acme/m")
    assert not Principal(tenant="acme", is_admin=False).may_use("acmex/m")
    assert Principal(tenant=None, is_admin=True).may_use("anyone/m")


def test_keys_come_from_the_state_store(tmp_path, backend):
    from controller import open_state_store

    with open_state_store(tmp_path) as store:
        store.add_tenant("acme")
        key = store.create_api_key("acme")
        app = build_gateway_app(backend, GatewayAuth(verify_api_key=store.verify_api_key))
        with TestClient(app) as client:
            headers = {"Authorization": f"Bearer {key}"}
            assert [m["id"] for m in client.get("/v1/models", headers=headers).json()["data"]] == ["acme/m", "acme/n"]
            error_of(client.get("/v1/models/other/m", headers=headers), 403)
            (record,) = store.list_api_keys("acme")
            store.revoke_api_key(record.key_id)
            error_of(client.get("/v1/models", headers=headers), 401)


def test_scripted_backend_meets_the_protocol(backend):
    assert isinstance(backend, GatewayBackend)


def test_admin_key_alone_is_enough():
    auth = GatewayAuth(admin_key=ADMIN_KEY)
    assert asyncio.run(auth.authenticate(f"Bearer {ADMIN_KEY}")) == Principal(tenant=None, is_admin=True)
    assert asyncio.run(auth.authenticate(f"bearer {ADMIN_KEY}")).is_admin
