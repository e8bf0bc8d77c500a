"""`BodyLimit` on its own: a body must arrive within its timeout (408), but once it is complete
the wait for the client to disconnect (a streaming response's listener) is not timed; settings
are checked. The 408 through the whole app is in test_gateway_access.py, the 413s in
test_gateway_app.py."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from starlette.exceptions import HTTPException

from infra.gateway_body_limit import BodyLimit

DEADLINE_S = 10.0
SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"2")]}


async def _ignore(message: dict) -> None:
    pass


def test_a_complete_body_leaves_later_receives_untimed():
    timeout_s = 0.02
    seen: list[dict] = []

    async def main() -> None:
        started = anyio.current_time()

        async def receive() -> dict:
            if not seen:
                return {"type": "http.request", "body": b"{}", "more_body": False}
            # The client stays until well past the body's deadline (polled, not slept), then leaves.
            while anyio.current_time() < started + 10 * timeout_s:
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def app(scope, receive, send) -> None:
            seen.append(await receive())  # the body
            seen.append(await receive())  # a streaming response listening for the disconnect

        await asyncio.wait_for(BodyLimit(app, 100, body_timeout_s=timeout_s)(SCOPE, receive, _ignore), DEADLINE_S)

    asyncio.run(main())
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect"]


def test_a_body_in_slow_chunks_times_out_as_a_whole():
    """Each chunk arrives before the timeout would end on its own, but the body as a whole does not."""
    num_chunks = 0

    async def receive() -> dict:
        nonlocal num_chunks
        num_chunks += 1
        until = anyio.current_time() + 0.02  # a pause shorter than the timeout
        while anyio.current_time() < until:
            await asyncio.sleep(0.002)
        return {"type": "http.request", "body": b"x", "more_body": True}

    async def app(scope, receive, send) -> None:
        while True:
            await receive()

    with pytest.raises(HTTPException) as info:
        asyncio.run(asyncio.wait_for(BodyLimit(app, 10**6, body_timeout_s=0.1)(SCOPE, receive, _ignore), DEADLINE_S))
    assert info.value.status_code == 408 and info.value.headers == {"Connection": "close"}
    assert 2 <= num_chunks < 1000


def test_settings_are_checked():
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="body_timeout_s must be a finite number of seconds > 0"):
            BodyLimit(_ignore, 100, body_timeout_s=bad)
    with pytest.raises(ValueError, match="max_body_bytes must be a positive integer"):
        BodyLimit(_ignore, 0)
