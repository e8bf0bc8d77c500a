"""ASGI middleware refusing request bodies over a size limit with 413.

A prompt is tokenized before the engine can say it is too long for the model, and the JSON
parser holds the whole body in memory, so a multi-gigabyte body would cost the gateway
memory and CPU for every other client. The declared ``Content-Length`` is checked before a
byte is read; a chunked body is counted as it arrives and cut off at the limit.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infra.openai_errors import body_too_large


class BodySizeLimit:
    """Wraps an ASGI app; bodies over `max_body_bytes` get an OpenAI-shaped 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await body_too_large(self.max_body_bytes).to_response()(scope, receive, send)
            return
        received = 0
        limit = self.max_body_bytes

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the app's body read: FastAPI passes HTTPExceptions through, and the
                    # app's handler renders it in OpenAI's shape.
                    raise HTTPException(413, body_too_large(limit).message)
            return message

        await self.app(scope, counting_receive, send)
