"""ASGI middleware bounding a request body's size (413) and the time it takes to arrive (408).

A prompt is tokenized before the engine can say it is too long for the model, and the JSON
parser holds the whole body in memory, so a multi-gigabyte body would cost the gateway
memory and CPU for every other client. The declared ``Content-Length`` is checked before a
byte is read; a chunked body is counted as it arrives and cut off at the limit.

A body that trickles in (a byte every few seconds) would hold its request, and its share of the
deployment's request slots, for as long as the client likes. So the whole body must have
arrived within `body_timeout_s` of the request reaching this middleware, or the request gets
408 and its connection is closed. Only the body is timed: once it is complete, later
``receive`` calls (a streaming response listening for the client to disconnect) wait as long
as they need to. The key is checked before this (`infra.gateway_access`), so an anonymous
client never gets this far.
"""

from __future__ import annotations

import math

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infra.openai_errors import body_too_large

DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyLimit:
    """Wraps an ASGI app; bodies over `max_body_bytes` get an OpenAI-shaped 413, bodies not
    complete within `body_timeout_s` a 408."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        if isinstance(body_timeout_s, bool) or not isinstance(body_timeout_s, (int, float)) \
                or not math.isfinite(body_timeout_s) or body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be a finite number of seconds > 0, got {body_timeout_s!r}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = float(body_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await body_too_large(self.max_body_bytes).to_response()(scope, receive, send)
            return
        received = 0
        complete = False
        limit, timeout_s = self.max_body_bytes, self.body_timeout_s
        deadline = anyio.current_time() + timeout_s

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            # Raised inside the app's body read: FastAPI passes HTTPExceptions through, and the
            # app's handler renders them in OpenAI's shape.
            with anyio.move_on_after(deadline - anyio.current_time()) as timer:
                message = await receive()
            if timer.cancelled_caught:
                raise HTTPException(408, f"the request body did not arrive within {timeout_s:g} s; send it "
                                         "without pauses (or raise the gateway's body timeout)",
                                    headers={"Connection": "close"})
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, body_too_large(limit).message)
                complete = not message.get("more_body", False)
            else:  # http.disconnect: nothing more will come
                complete = True
            return message

        await self.app(scope, limited_receive, send)
