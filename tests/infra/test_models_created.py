"""``GET /v1/models`` on the Ray path reports when the model was deployed: the real controller
records the time in its `wire.ModelRecord`, the record crosses to the gateway (pickled, as Ray
moves it), `RayGatewayBackend` reads it, and the app shows it as OpenAI's ``created``. The
controller runs over tests/controller's fake cluster, the gateway over tests/infra's fake
`ServingCluster` holding the controller's records; the request goes through the real ASGI app,
on the test's event loop (where the backend's background tasks run too)."""

from __future__ import annotations

import asyncio
import json
import pickle

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from infra.gateway_metrics import GatewayMetrics
from infra.gateway_model_info import model_info_from_record
from infra.ray_gateway_backend import RayGatewayBackend
from tests.controller.test_controller import Harness, spec
from tests.infra.fake_serving_cluster import FAST, FakeCluster
from wire import ModelRecord

DEPLOYED_S = 1_700_000_123.9


async def controller_records(tmp_path) -> list[ModelRecord]:
    """What a real controller, deploying acme/m1 at `DEPLOYED_S`, tells the gateway."""
    async with Harness(tmp_path, wall_clock=lambda: DEPLOYED_S) as h:
        await h.controller.deploy({**spec("acme/m1", h.source("m1")), "max_model_len": 256})
        return [pickle.loads(pickle.dumps(record)) for record in h.controller.model_records()]


async def get_json(cluster: FakeCluster, path: str) -> dict:
    """``GET path`` on a gateway app over a `RayGatewayBackend` (no auth, from loopback)."""
    backend = RayGatewayBackend(cluster, FAST, GatewayMetrics())
    app = build_gateway_app(backend, GatewayAuth.no_auth())
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 50000), "server": ("localhost", 80)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    try:
        await app(scope, receive, send)
    finally:
        await backend.close()
    [start] = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 200, body
    return json.loads(body)


def test_models_show_the_deploy_time_the_controller_recorded(tmp_path):
    async def main():
        cluster = FakeCluster()
        for record in await controller_records(tmp_path):
            cluster.records[record.model_id] = record
        return await get_json(cluster, "/v1/models"), await get_json(cluster, "/v1/models/acme/m1")

    listing, one = asyncio.run(main())
    model = {"id": "acme/m1", "object": "model", "created": 1_700_000_123, "owned_by": "acme", "max_model_len": 256}
    assert listing == {"object": "list", "data": [model]}
    assert one == model


def test_a_model_whose_deploy_time_is_unknown_shows_created_zero():
    record = ModelRecord(model_id="acme/m1", deployed_s=None, max_model_len=None, max_queued_requests=3,
                         queue_timeout_s=2.0)
    info = model_info_from_record(record)
    assert (info.card.created_s, info.card.owned_by, info.max_queued_requests, info.queue_timeout_s) == (0, "acme",
                                                                                                         3, 2.0)
