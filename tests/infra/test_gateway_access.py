"""`AccessGate`: the key before the body, who may read ``/metrics`` and the schema, and the
``Host`` check of a no-auth gateway (issue 19, items 3, 4 and 10).

The body-before-key test calls the real app as an ASGI callable with a `receive` that would
never finish (TestClient always sends the whole body first, so it could not tell): a 401
must come back without `receive` having been called at all. The rest go through TestClient.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from infra.gateway_access import AccessGate, is_loopback_host, split_host
from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.gateway_metrics import GatewayMetrics
from infra.metrics_token import MetricsToken
from tests.infra.test_gateway_app import ADMIN_KEY, KEYS, ScriptedBackend

SCRAPE_TOKEN = "scrape-token-0123456789abcdef"
DEADLINE_S = 10.0


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
def metrics() -> GatewayMetrics:
    return GatewayMetrics()


@pytest.fixture()
def client(metrics):
    auth = GatewayAuth(verify_api_key=KEYS.get, admin_key=ADMIN_KEY,
                       metrics_token=MetricsToken.from_secret(SCRAPE_TOKEN))
    with TestClient(build_gateway_app(ScriptedBackend(), auth, metrics), raise_server_exceptions=False) as c:
        yield c


class NeverEndingBody:
    """An ASGI `receive` whose body never completes: optionally one chunk, then nothing ever."""

    def __init__(self, first_chunk: bytes | None = None) -> None:
        self.first_chunk = first_chunk
        self.num_calls = 0

    async def __call__(self) -> dict:
        self.num_calls += 1
        if self.num_calls == 1 and self.first_chunk is not None:
            return {"type": "http.request", "body": self.first_chunk, "more_body": True}
        await asyncio.Event().wait()  # the client never sends the rest
        raise AssertionError("unreachable")


async def call_asgi(app, path: str, headers: dict[str, str], receive) -> tuple[int, dict]:
    """POSTs through `app` directly; the status and the JSON body it answered."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), DEADLINE_S)
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


# ---- the key before the body -------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer key-nobody"}])
def test_no_key_gets_401_without_a_byte_of_the_body_being_read(headers):
    app = build_gateway_app(ScriptedBackend(), GatewayAuth(verify_api_key=KEYS.get))
    body = NeverEndingBody()
    status, error = asyncio.run(call_asgi(app, "/v1/completions", {
        "Host": "gateway.example", "Content-Type": "application/json", "Content-Length": "1000000", **headers}, body))
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    assert body.num_calls == 0


def test_a_valid_key_with_a_stalled_body_gets_408_naming_the_timeout():
    app = build_gateway_app(ScriptedBackend(), GatewayAuth(verify_api_key=KEYS.get), body_timeout_s=0.05)
    body = NeverEndingBody(b'{"model": "acme/m", "prom')
    status, error = asyncio.run(call_asgi(app, "/v1/completions", {
        "Host": "gateway.example", "Content-Type": "application/json", "Content-Length": "100", **bearer("key-acme")},
        body))
    assert status == 408
    assert error["error"] == {
        "message": "the request body did not arrive within 0.05 s; send it without pauses (or raise the gateway's "
                   "body timeout)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}


def test_a_refused_generation_is_still_counted_in_the_metrics(client, metrics):
    assert client.post("/v1/completions", json={"model": "acme/m", "prompt": "x"}).status_code == 401
    text = metrics.render()[0].decode()
    assert 'thaw_gateway_requests_total{endpoint="completions",model="",status="401"} 1.0' in text


# ---- /metrics, /openapi.json, /docs ------------------------------------------------------------


def test_metrics_answer_the_admin_key_and_the_scrape_token_only(client, metrics):
    metrics.set_instances("acme/m", 1)
    sample = 'thaw_model_instances{model="acme/m"} 1.0'
    for headers in (bearer(ADMIN_KEY), bearer(SCRAPE_TOKEN)):
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 200 and sample in response.text
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401 and "acme/m" not in anonymous.text
    tenant = client.get("/metrics", headers=bearer("key-acme"))
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "metrics_forbidden"
    assert "--metrics-token-file" in tenant.json()["error"]["message"] and "acme/m" not in tenant.text
    assert client.get("/metrics", headers=bearer("scrape-token-0123456789abcdeX")).status_code == 401


def test_the_scrape_token_opens_nothing_but_metrics(client):
    for method, path in (("GET", "/v1/models"), ("GET", "/openapi.json"), ("GET", "/admin/status"),
                         ("POST", "/v1/completions")):
        response = client.request(method, path, headers=bearer(SCRAPE_TOKEN), json={"model": "acme/m", "prompt": "x"})
        assert response.status_code == 401, (method, path)


def test_the_schema_needs_a_key_and_the_interactive_docs_are_off(client):
    assert client.get("/openapi.json").status_code == 401
    schema = client.get("/openapi.json", headers=bearer("key-acme"))
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    for path in ("/docs", "/redoc"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers=bearer("key-acme")).status_code == 404


def test_probes_stay_open(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}


# ---- no-auth: loopback names only --------------------------------------------------------------


@pytest.fixture()
def local_client():
    app = build_gateway_app(ScriptedBackend(), GatewayAuth.no_auth(), http_port=8000)
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        yield c


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "LOCALHOST:8000", "[::1]:8000"])
def test_no_auth_answers_requests_addressed_to_loopback(local_client, host):
    response = local_client.get("/v1/models", headers={"Host": host})
    assert response.status_code == 200 and len(response.json()["data"]) == 3


@pytest.mark.parametrize("host", ["rebound.example:8000", "127.0.0.1:9000", "localhost", "192.0.2.7:8000",
                                  "127.0.0.1.rebound.example:8000", ""])
def test_no_auth_refuses_any_other_host_with_421_and_says_what_to_do(local_client, host):
    response = local_client.post("/admin/models", headers={"Host": host}, json={"tenant": "x"})
    assert response.status_code == 421, host
    error = response.json()["error"]
    assert error["code"] == "host_not_allowed"
    assert "--no-auth" in error["message"] and "http://127.0.0.1:8000/" in error["message"]


def test_no_auth_serves_the_interactive_docs_and_metrics_locally(local_client):
    assert local_client.get("/docs").status_code == 200
    assert local_client.get("/openapi.json").status_code == 200
    assert local_client.get("/metrics").status_code == 200


def test_loopback_host_parsing():
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("Localhost") == ("localhost", None)
    assert split_host("::1") == ("::1", None)
    for bad in ("[::1", "[::1]x", "host:port", "host:0", "host:70000", ":8000"):
        assert split_host(bad) is None, bad
    assert is_loopback_host("localhost", 80) and is_loopback_host("localhost:1234", None)
    assert not is_loopback_host("localhost", 8000) and not is_loopback_host(None, None)


def test_gate_settings_are_checked():
    auth = GatewayAuth.no_auth()
    with pytest.raises(ValueError, match="http_port must be None or a port number"):
        AccessGate(lambda *a: None, auth, http_port=0)
    with pytest.raises(ValueError, match="auth must be a GatewayAuth"):
        AccessGate(lambda *a: None, object())
