"""Who may come into the gateway, decided before a byte of the request body is read: `AccessGate`.

FastAPI reads and parses a route's JSON body before it resolves the route's dependencies, so a
key checked in a dependency is checked only after the body has arrived: an anonymous client
could hold a connection open by sending a body slowly, or make the gateway parse megabytes,
without ever holding a key. This ASGI middleware sits in front of everything and looks only at
the request line and headers:

- with auth on (the normal case):
  - the probes (``/healthz``, ``/readyz``, ``/health``, ``/ping``) and ``/version`` are open: they
    carry no key;
  - ``/metrics`` answers the admin key or the metrics scrape token (`infra.metrics_token`):
    it names every tenant's models and their traffic, so a tenant's key gets 403 and no key 401;
  - everything else, ``/openapi.json`` and the admin API included, needs a valid key (401
    without one). The key's `Principal` rides along in the ASGI scope (`principal_of`), so the
    route does not verify it a second time. The interactive ``/docs`` and ``/redoc`` pages are
    not served at all (a browser cannot send the bearer key their schema fetch would need):
    fetch ``/openapi.json`` with a key instead.
- with ``--no-auth`` (every caller is admin, for local experiments): only requests addressed to
  a loopback name (``127.0.0.1``, ``localhost``, ``[::1]``, at the gateway's port when it is
  known) are answered; any other ``Host`` gets 421. ``thaw serve`` refuses ``--no-auth`` on a
  non-loopback ``--host``, and this check closes the remaining hole, DNS rebinding: a web page
  whose own name resolves to 127.0.0.1 could otherwise drive the admin API from the user's
  browser, since the browser sends that page's name as ``Host``.

A refusal is answered here in OpenAI's error shape, and its body, if any, is never read.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from infra.gateway_auth import AuthenticationFailed, GatewayAuth, Principal
from infra.openai_errors import OpenAIError, authentication_failed

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/health", "/ping", "/version"})
METRICS_PATH = "/metrics"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
PRINCIPAL_SCOPE_KEY = "thaw.principal"
_MAX_ECHOED_HOST_CHARS = 100

RefusalObserver = Callable[[Request, OpenAIError], None]


def principal_of(request: Request) -> Principal | None:
    """The caller `AccessGate` authenticated for this request, or None (a public path, or an
    app without the gate)."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)
    return principal if isinstance(principal, Principal) else None


def split_host(host_header: str) -> tuple[str, int | None] | None:
    """``Host`` header value -> (lowercased name, port or None); None when malformed."""
    value = host_header.strip().lower()
    if value.startswith("["):  # [v6 address] or [v6 address]:port
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, _, port_text = value.partition(":")
    else:  # a bare name, or an unbracketed v6 address (no port can be told apart)
        name, port_text = value, None
    if not name:
        return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def is_loopback_host(host_header: str | None, port: int | None) -> bool:
    """True when the ``Host`` header names a loopback address (``127.0.0.1``, ``localhost``,
    ``[::1]``) and, if `port` is given, that port (no port in the header means 80)."""
    if not host_header:
        return False
    parts = split_host(host_header)
    if parts is None:
        return False
    name, header_port = parts
    if name not in LOOPBACK_NAMES:
        return False
    return port is None or (header_port if header_port is not None else 80) == port


class AccessGate:
    """ASGI middleware enforcing the rules in the module docstring.

    auth: who the keys belong to (and whether auth is on at all).
    http_port: the port clients reach the gateway on; in no-auth mode a ``Host`` must name it
        (None: any port on a loopback name).
    on_refused: sees each refusal before it is sent (the gateway counts them in its metrics).
    """

    def __init__(self, app: ASGIApp, auth: GatewayAuth, http_port: int | None = None,
                 on_refused: RefusalObserver | None = None) -> None:
        if not isinstance(auth, GatewayAuth):
            raise ValueError(f"auth must be a GatewayAuth, got {type(auth).__name__}")
        if http_port is not None and (isinstance(http_port, bool) or not isinstance(http_port, int)
                                      or not 0 < http_port < 65536):
            raise ValueError(f"http_port must be None or a port number in 1..65535, got {http_port!r}")
        self.app = app
        self.auth = auth
        self.http_port = http_port
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self.auth.enabled:
            host = headers.get("host")
            if not is_loopback_host(host, self.http_port):
                await self._refuse(scope, receive, send, self._wrong_host(host))
                return
            await self.app({**scope, PRINCIPAL_SCOPE_KEY: Principal(tenant=None, is_admin=True)}, receive, send)
            return
        path = route_path(scope)
        if path in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = headers.get("authorization")
        if path == METRICS_PATH and self.auth.is_metrics_token(authorization):
            await self.app(scope, receive, send)
            return
        try:
            principal = await self.auth.authenticate(authorization)
        except AuthenticationFailed as exc:
            await self._refuse(scope, receive, send, authentication_failed(str(exc)))
            return
        if path == METRICS_PATH and not principal.is_admin:
            await self._refuse(scope, receive, send, OpenAIError(
                403, "GET /metrics needs the admin key or the metrics scrape token (thaw serve --metrics-token-file); "
                "a tenant's key cannot read it, since it names every tenant's models", "permission_error", None,
                "metrics_forbidden"))
            return
        await self.app({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)

    def _wrong_host(self, host: str | None) -> OpenAIError:
        where = "127.0.0.1, localhost or [::1]" + (f" at port {self.http_port}" if self.http_port is not None else "")
        seen = "no Host header" if not host else f"Host {host[:_MAX_ECHOED_HOST_CHARS]!r}"
        return OpenAIError(
            421, f"this gateway runs without API keys (--no-auth) and answers only requests addressed to {where}, "
            f"got {seen}; use http://127.0.0.1:{self.http_port or 'PORT'}/, or run `thaw serve` with API keys "
            "(without --no-auth) to serve other names", "invalid_request_error", None, "host_not_allowed")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
        if self.on_refused is not None:
            self.on_refused(Request(scope), error)
        await error.to_response()(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the app routes on (Starlette's rule: the path less the mount's root_path)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path) and path != root_path:
        return path[len(root_path):]
    return path
