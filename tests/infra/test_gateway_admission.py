"""The replica's own bound on concurrent requests (`infra.gateway_admission`), through the whole
gateway app over the scripted backend of `test_gateway_app`: past the bound a request gets 503
in OpenAI's shape with Retry-After, at once, and nothing reaches the backend; health and admin
routes are still answered; a slot freed by a client that leaves admits the next request."""

from __future__ import annotations

import asyncio
import json

import pytest

from infra.gateway_admission import Admission, is_exempt, serve_max_ongoing_requests
from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from tests.infra.test_gateway_app import ADMIN_KEY, DEADLINE_S, KEYS, ScriptedBackend


def scope(method: str, path: str, raw: bytes = b"") -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    (b"authorization", b"Bearer key-acme")],
    }


async def call(app, method: str, path: str, body: dict | None = None,
               leave: asyncio.Event | None = None) -> list[dict]:
    """One request through the ASGI app; the client leaves once `leave` is set. Returns what was sent."""
    raw = json.dumps(body).encode() if body is not None else b""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope(method, path, raw), receive, send)
    return sent


def response(sent: list[dict]) -> tuple[int, dict[str, str], bytes]:
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_past_its_bound_a_replica_answers_503_in_openai_shape_and_recovers():
    backend = ScriptedBackend()
    app = build_gateway_app(backend, GatewayAuth(verify_api_key=KEYS.get, admin_key=ADMIN_KEY),
                            max_ongoing_requests=2, retry_after_s=2.5)
    cold = {"model": "acme/m", "prompt": "cold", "stream": True}  # waits for an instance that never comes

    async def main():
        leave = [asyncio.Event(), asyncio.Event()]
        held = []
        for event in leave:
            backend.waiting_event().clear()
            held.append(asyncio.create_task(call(app, "POST", "/v1/completions", cold, event)))
            await asyncio.wait_for(backend.waiting_event().wait(), DEADLINE_S)
        refused = await asyncio.wait_for(
            call(app, "POST", "/v1/completions", {"model": "acme/m", "prompt": "x"}), DEADLINE_S)
        calls_when_full = len(backend.calls)
        health = await asyncio.wait_for(call(app, "GET", "/healthz"), DEADLINE_S)
        leave[0].set()
        await asyncio.wait_for(held[0], DEADLINE_S)
        admitted = await asyncio.wait_for(
            call(app, "POST", "/v1/completions", {"model": "acme/m", "prompt": "x"}), DEADLINE_S)
        leave[1].set()
        await asyncio.wait_for(held[1], DEADLINE_S)
        return refused, calls_when_full, health, admitted

    refused, calls_when_full, health, admitted = asyncio.run(main())
    status, headers, body = response(refused)
    assert status == 503 and headers["retry-after"] == "3"
    error = json.loads(body)["error"]
    assert error["code"] == "gateway_overloaded" and error["type"] == "service_unavailable"
    assert "limit of 2 requests at once" in error["message"] and "--gateway-replicas" in error["message"]
    assert calls_when_full == 2  # the refused request never reached the backend
    assert response(health)[0] == 200
    status, _, body = response(admitted)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "Hello!"


def test_the_openai_client_reads_the_refusal():
    """The official client parses the body: an `InternalServerError` whose code says why."""
    import httpx
    import openai

    backend = ScriptedBackend()
    app = build_gateway_app(backend, GatewayAuth(verify_api_key=KEYS.get, admin_key=ADMIN_KEY),
                            max_ongoing_requests=1)

    async def main():
        leave = asyncio.Event()
        held = asyncio.create_task(call(app, "POST", "/v1/completions",
                                        {"model": "acme/m", "prompt": "cold", "stream": True}, leave))
        await asyncio.wait_for(backend.waiting_event().wait(), DEADLINE_S)
        client = openai.AsyncOpenAI(api_key="key-acme", base_url="http://testserver/v1", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
        try:
            with pytest.raises(openai.InternalServerError) as info:
                await client.completions.create(model="acme/m", prompt="x", max_tokens=3)
        finally:
            leave.set()
            await asyncio.wait_for(held, DEADLINE_S)
            await client.close()
        return info.value

    error = asyncio.run(main())
    assert error.status_code == 503 and error.code == "gateway_overloaded"
    assert error.response.headers["retry-after"] == "1"


def test_exempt_routes_and_serve_headroom_and_settings():
    assert all(is_exempt(p) for p in ("/healthz", "/readyz", "/metrics", "/admin/models", "/admin/deploys/x"))
    assert not any(is_exempt(p) for p in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/acme/m/v1"))
    assert serve_max_ongoing_requests(8) == 72 and serve_max_ongoing_requests(4096) == 4608
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_ongoing_requests must be an integer >= 1"):
            Admission(None, bad)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="retry_after_s must be a finite number of seconds > 0"):
            Admission(None, 1, bad)
