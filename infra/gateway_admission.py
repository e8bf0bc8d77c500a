"""A replica's bound on the requests it serves at once, refused in OpenAI's shape.

Ray Serve bounds a replica as well (``max_ongoing_requests``) and past that queues requests in
each proxy; when a proxy's queue is full it answers 503 itself, with a plain-text body that no
OpenAI client parses (Serve's `BackpressureConfig` sets the status and ``Retry-After``, not the
body). So the replica enforces its bound itself, below Serve's (`serve_max_ongoing_requests`
adds headroom): a request past it gets 503 with OpenAI's error body, code
``gateway_overloaded`` and ``Retry-After`` at once, so Serve's own queue fills only if a burst
larger than the headroom arrives within the instant it takes to refuse one.

Health, readiness, version, metrics and the admin routes are not counted and never refused: a
full gateway still says that it lives, and an operator can still act on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from infra.gateway_access import METRICS_PATH, PUBLIC_PATHS, route_path
from infra.openai_errors import OpenAIError

ADMIN_PREFIX = "/admin/"
# Serve's bound is this much above the replica's own: admin long polls and health checks
# count against Serve's, and a burst is refused by the app before Serve queues it.
MIN_HEADROOM = 64


def serve_max_ongoing_requests(max_ongoing_requests: int) -> int:
    """The ``max_ongoing_requests`` to give Serve for a replica that admits `max_ongoing_requests`."""
    return max_ongoing_requests + max(MIN_HEADROOM, max_ongoing_requests // 8)


def is_exempt(path: str) -> bool:
    """Whether a request to `path` is served whatever the load (see the module docstring)."""
    return path in PUBLIC_PATHS or path == METRICS_PATH or path.startswith(ADMIN_PREFIX)


class Admission:
    """ASGI middleware: at most `max_ongoing_requests` counted requests in the app at once.

    A request counts from its arrival until its response has ended (a stream's last chunk);
    `on_refused` sees each refusal before it is sent (the gateway counts them in its metrics).
    """

    def __init__(self, app: ASGIApp, max_ongoing_requests: int, retry_after_s: float = 1.0,
                 on_refused: Callable[[Request, OpenAIError], None] | None = None) -> None:
        if isinstance(max_ongoing_requests, bool) or not isinstance(max_ongoing_requests, int) \
                or max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be an integer >= 1, got {max_ongoing_requests!r}")
        if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, (int, float)) \
                or not math.isfinite(retry_after_s) or retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be a finite number of seconds > 0, got {retry_after_s!r}")
        self.app = app
        self.max_ongoing_requests = max_ongoing_requests
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused
        self._ongoing = 0

    @property
    def num_ongoing(self) -> int:
        """Counted requests in the app now."""
        return self._ongoing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_exempt(route_path(scope)):
            await self.app(scope, receive, send)
            return
        if self._ongoing >= self.max_ongoing_requests:
            retry = max(1, math.ceil(self.retry_after_s))
            error = OpenAIError(
                503, f"this gateway replica is serving its limit of {self.max_ongoing_requests} requests at once; "
                f"retry after {retry} s (or add replicas: thaw serve --gateway-replicas)", "service_unavailable",
                None, "gateway_overloaded", headers={"Retry-After": str(retry)})
            if self.on_refused is not None:
                self.on_refused(Request(scope), error)
            await error.to_response()(scope, receive, send)
            return
        self._ongoing += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._ongoing -= 1
