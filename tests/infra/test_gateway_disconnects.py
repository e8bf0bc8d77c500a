"""Client disconnects turning into backend aborts, for the gateway app over the scripted backend
of `test_gateway_app`.

These tests drive the ASGI app directly, so they decide exactly when the client goes away (after
the first event, or while the request still waits for its first chunk) without timing anything.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from infra.gateway_app import build_gateway_app
from infra.gateway_auth import GatewayAuth
from tests.infra.test_gateway_app import (  # noqa: F401 - fixtures
    DEADLINE_S,
    KEYS,
    SLOT_LINE,
    ScriptedBackend,
    app,
    backend,
    metrics,
)


def request_scope(path: str, raw: bytes) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    (b"authorization", b"Bearer key-acme")],
    }


async def call_app(app, path: str, body: dict, sent: list[dict], leave: asyncio.Event,
                   leave_when=lambda sent: False) -> None:
    """One HTTP request through the ASGI app. The client disconnects once `leave` is set, or
    once `leave_when(sent)` is true (checked after every message the app sends)."""
    raw = json.dumps(body).encode()
    body_delivered = False

    async def receive() -> dict:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if leave_when(sent):
            leave.set()

    await app(request_scope(path, raw), receive, send)


async def drive(app, path: str, body: dict, leave_when=lambda sent: False,
                leave_on: asyncio.Event | None = None) -> list[dict]:
    """`call_app` with a deadline; the client also leaves once `leave_on` is set. Returns what was sent."""
    sent: list[dict] = []
    leave = asyncio.Event()

    async def leave_once_set() -> None:
        await (leave_on or asyncio.Event()).wait()
        leave.set()

    watcher = asyncio.create_task(leave_once_set())
    try:
        await asyncio.wait_for(call_app(app, path, body, sent, leave, leave_when), DEADLINE_S)
    finally:
        watcher.cancel()
    return sent


async def call_with_channels(app, body: dict, after_body, on_send=None) -> list[dict]:
    """One request through the ASGI app whose server-side channels the test scripts: ``receive``
    delivers the body, then awaits ``after_body()``; ``on_send(sent)`` runs before each message is
    recorded (it may raise, as a server's write does). Returns what was sent."""
    raw = json.dumps(body).encode()
    delivered = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await after_body()

    async def send(message: dict) -> None:
        if on_send is not None:
            on_send(sent)
        sent.append(message)

    await asyncio.wait_for(app(request_scope("/v1/completions", raw), receive, send), DEADLINE_S)
    return sent


def after_first_event(sent: list[dict]) -> bool:
    return any(m["type"] == "http.response.body" and m.get("body") for m in sent)


def test_disconnect_mid_stream_aborts_the_request(app, backend, metrics):
    async def main():
        return await drive(app, "/v1/completions",
                           {"model": "acme/m", "prompt": "endless", "stream": True},
                           leave_on=backend.waiting_event())

    sent = asyncio.run(main())
    (_, request_id, _, _), = backend.calls
    assert sent[0]["status"] == 200
    assert json.loads(sent[1]["body"].removeprefix(b"data: "))["choices"][0]["text"] == "Hel"
    assert backend.aborts == [("acme/m", request_id)]
    assert backend.closed == [request_id]  # the backend's stream was closed too
    assert b'status="499"' in metrics.render()[0]


def test_disconnect_right_after_the_first_event_aborts(app, backend):
    async def main():
        return await drive(app, "/v1/chat/completions",
                           {"model": "acme/m", "messages": [{"role": "user", "content": "endless"}],
                            "stream": True}, after_first_event)

    asyncio.run(main())
    assert [a[1] for a in backend.aborts] == [backend.calls[0][1]]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued_for_a_cold_model_aborts(app, backend, stream):
    async def main():
        # The backend sets `waiting` once the request is blocked in its (never served) queue.
        return await drive(app, "/v1/completions", {"model": "acme/m", "prompt": "cold", "stream": stream},
                           leave_on=backend.waiting_event())

    sent = asyncio.run(main())
    assert sent == []  # nothing was sent: the client was gone before the first chunk
    assert backend.aborts == [("acme/m", backend.calls[0][1])] and backend.closed == [backend.calls[0][1]]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_after_progress_comments_aborts(app, backend, stream):
    async def main():
        # The backend sets `waiting` after its two progress records, still waiting for an instance.
        return await drive(app, "/v1/chat/completions",
                           {"model": "acme/m", "messages": [{"role": "user", "content": "queued forever"}],
                            "stream": stream}, leave_on=backend.waiting_event())

    sent = asyncio.run(main())
    if stream:
        assert sent[0]["status"] == 200
        assert [m["body"] for m in sent[1:]] == [f": {SLOT_LINE}\n\n".encode()] * 2
    else:
        assert sent == []  # a request without stream hears nothing until its answer
    assert backend.aborts == [("acme/m", backend.calls[0][1])] and backend.closed == [backend.calls[0][1]]


def test_finished_requests_are_not_aborted_even_if_the_client_leaves_after(app, backend):
    async def main():
        return await drive(app, "/v1/completions", {"model": "acme/m", "prompt": "x", "stream": True},
                           lambda sent: sent[-1].get("more_body") is False)

    sent = asyncio.run(main())
    assert sent[-1]["body"] == b"data: [DONE]\n\n" and backend.aborts == []


class SlowAbortBackend(ScriptedBackend):
    """Its abort takes a while (a remote call), and says when it started and when it is done."""

    def __init__(self) -> None:
        super().__init__()
        self.abort_started = asyncio.Event()
        self.may_finish_abort = asyncio.Event()
        self.abort_done = asyncio.Event()

    async def abort(self, model_id: str, request_id: str) -> None:
        self.abort_started.set()
        await self.may_finish_abort.wait()
        await super().abort(model_id, request_id)
        self.abort_done.set()


def test_a_cancelled_request_task_still_aborts_even_if_cancelled_again(metrics):
    """Ray Serve reports a client that left by cancelling the request's task, not with a disconnect message."""
    backend = SlowAbortBackend()
    app = build_gateway_app(backend, GatewayAuth(verify_api_key=KEYS.get), metrics)

    async def main():
        request = asyncio.create_task(call_app(app, "/v1/completions",
                                               {"model": "acme/m", "prompt": "endless", "stream": True},
                                               sent=[], leave=asyncio.Event()))
        await asyncio.wait_for(backend.waiting_event().wait(), DEADLINE_S)
        request.cancel()
        await asyncio.wait_for(backend.abort_started.wait(), DEADLINE_S)
        request.cancel()  # a second cancellation while the abort is on its way
        with pytest.raises(asyncio.CancelledError):
            await request
        backend.may_finish_abort.set()
        await asyncio.wait_for(backend.abort_done.wait(), DEADLINE_S)

    asyncio.run(main())
    assert backend.aborts == [("acme/m", backend.calls[0][1])] and backend.closed == [backend.calls[0][1]]


def test_a_failing_receive_channel_is_not_a_disconnect_and_the_stream_completes(app, backend):
    """Ray Serve's replica-side ``receive`` raises when its call to the proxy fails (under load, or
    as the cluster loses a process); that says nothing about the client. Seen in the chaos test as
    a stream cut mid-body (no final chunk): the stream must go on to its end instead."""
    async def failing_receive() -> dict:
        raise RuntimeError("the proxy's receive_asgi_messages call failed")

    async def main():
        return await call_with_channels(app, {"model": "acme/m", "prompt": "queued", "stream": True}, failing_receive)

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200
    assert sent[-1]["more_body"] is False and sent[-1]["body"] == b"data: [DONE]\n\n"
    texts = [json.loads(m["body"].removeprefix(b"data: "))["choices"][0]["text"] for m in sent[1:-1]
             if m["body"].startswith(b"data: {")]
    assert "".join(texts) == "Hello!" and backend.aborts == []


def test_a_timeout_inside_the_backend_is_reported_in_band_not_taken_for_a_client_that_left(app, backend, metrics):
    """A `TimeoutError` is an `OSError`, as is the error an ASGI server raises on a write to a closed
    connection. Only a failed write means the client left: a timeout from the backend's own calls
    (an unreachable actor) must end the stream with an error event and ``[DONE]``, counted as the
    error it is, not cut it mid-body and count a 499 (issue 44's cut stream in the chaos test)."""
    sent = asyncio.run(drive(app, "/v1/completions", {"model": "acme/m", "prompt": "timeout midway", "stream": True}))
    assert sent[0]["status"] == 200
    assert sent[-1]["more_body"] is False and sent[-1]["body"] == b"data: [DONE]\n\n"
    events = [json.loads(m["body"].removeprefix(b"data: ")) for m in sent[1:-1] if m["body"].startswith(b"data: {")]
    assert events[0]["choices"][0]["text"] == "Hel"
    assert events[-1]["error"]["type"] == "server_error"
    assert "timed out" not in json.dumps(events[-1])  # no internal exception text reaches the client
    counted = [line for line in metrics.render()[0].decode().splitlines()
               if line.startswith("thaw_gateway_requests_total{")]
    assert len(counted) == 1 and 'status="500"' in counted[0], counted
    assert backend.closed == [backend.calls[0][1]]


def test_a_failed_write_is_a_client_that_left_and_aborts_the_request(app, backend, metrics):
    """The other side of the rule above: an ASGI 2.4 server raises an `OSError` on a write to a closed
    connection (uvicorn drops it silently; both are covered), and that does mean the client left."""
    async def never_disconnects() -> dict:
        await asyncio.Event().wait()  # the server never reports the disconnect
        raise AssertionError("unreachable")

    def write_fails_after_first_event(sent: list[dict]) -> None:
        if after_first_event(sent):
            raise ConnectionResetError("the client closed the connection")

    async def main():
        return await call_with_channels(app, {"model": "acme/m", "prompt": "three chunks", "stream": True},
                                        never_disconnects, write_fails_after_first_event)

    sent = asyncio.run(main())
    (_, request_id, _, _), = backend.calls
    assert sent[0]["status"] == 200 and all(m.get("more_body", True) for m in sent[1:])
    assert backend.aborts == [("acme/m", request_id)] and backend.closed == [request_id]
    assert b'status="499"' in metrics.render()[0]
