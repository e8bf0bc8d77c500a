"""Who is calling: an API key from ``Authorization: Bearer ...`` turned into a `Principal`.

Keys are verified by a callable the gateway is given (normally the state store's
`verify_api_key`, which checks a salted hash and returns the key's tenant), so the HTTP
surface never sees how keys are stored and tests can pass a dict lookup. The callable may
do I/O (SQLite, Redis): it runs on a worker thread, never on the event loop that streams
everyone's tokens.

Three kinds of caller:
- a tenant's key: sees and calls only the tenant's models (``tenant/...``);
- the admin key: sees and calls every model, and may use the admin API;
- anyone, in ``--no-auth`` mode (local experiments): treated as admin, with no key needed
  (the gateway then answers only requests addressed to a loopback name: `gateway_access`).

One more secret is recognised but is no caller: the optional metrics scrape token
(`MetricsToken`), which opens ``GET /metrics`` and nothing else (`is_metrics_token`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

import anyio.to_thread

from infra.metrics_token import MetricsToken

_BEARER = "bearer "


class AuthenticationFailed(Exception):
    """No key, a malformed header, or a key nobody issued (401). The message says which."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. `tenant` is None for the admin and in no-auth mode: all models."""

    tenant: str | None
    is_admin: bool

    def may_use(self, model_id: str) -> bool:
        """True when the model belongs to the caller's tenant (ids are ``tenant/name``)."""
        if self.tenant is None:
            return True
        owner, _, _ = model_id.partition("/")
        return owner == self.tenant


@dataclass(frozen=True)
class GatewayAuth:
    """How the gateway authenticates: a key verifier, an optional admin key, or no auth at all.

    verify_api_key: key -> tenant, or None for an unknown/revoked/malformed key (blocking is
        fine: it runs on a thread).
    admin_key: the key that grants admin rights; compared in constant time.
    enabled: False is ``--no-auth``: every caller is admin, and keys are ignored.
    metrics_token: the scrape token that may read ``/metrics`` (besides the admin key); None: none.
    """

    verify_api_key: Callable[[str], str | None] | None = None
    admin_key: str | None = None
    enabled: bool = True
    metrics_token: MetricsToken | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be True or False, got {self.enabled!r}")
        if self.verify_api_key is not None and not callable(self.verify_api_key):
            raise ValueError("verify_api_key must be a callable taking a key and returning a tenant or None")
        if self.admin_key is not None and (not isinstance(self.admin_key, str) or len(self.admin_key) < 16):
            raise ValueError("admin_key must be a string of at least 16 characters (a generated secret)")
        if self.metrics_token is not None and not isinstance(self.metrics_token, MetricsToken):
            raise ValueError("metrics_token must be a MetricsToken or None")
        if self.enabled and self.verify_api_key is None and self.admin_key is None:
            raise ValueError(
                "auth is enabled but there is no way to accept a key: give verify_api_key and/or admin_key, "
                "or use GatewayAuth.no_auth() for local experiments"
            )

    @classmethod
    def no_auth(cls) -> GatewayAuth:
        """``--no-auth``: anyone may call anything (never expose such a gateway)."""
        return cls(enabled=False)

    def is_metrics_token(self, authorization: str | None) -> bool:
        """True when the header carries the metrics scrape token (never raises: a bad header is
        simply not the token, and `authenticate` then says what is wrong with it)."""
        if self.metrics_token is None:
            return False
        try:
            key = bearer_key(authorization)
        except AuthenticationFailed:
            return False
        return self.metrics_token.matches(key)

    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an ``Authorization`` header value; raises `AuthenticationFailed`."""
        if not self.enabled:
            return Principal(tenant=None, is_admin=True)
        key = bearer_key(authorization)
        if self.admin_key is not None and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            return Principal(tenant=None, is_admin=True)
        tenant = None
        if self.verify_api_key is not None:
            tenant = await anyio.to_thread.run_sync(self.verify_api_key, key)
        if tenant is None:
            raise AuthenticationFailed("the API key is not valid (unknown, revoked or mistyped)")
        return Principal(tenant=tenant, is_admin=False)


def bearer_key(authorization: str | None) -> str:
    """The key in an ``Authorization: Bearer <key>`` header value; `AuthenticationFailed` saying
    what is wrong when there is none."""
    if not authorization:
        raise AuthenticationFailed("no API key: send it as 'Authorization: Bearer <key>' (the openai client's api_key)")
    if not authorization[: len(_BEARER)].lower() == _BEARER:
        raise AuthenticationFailed("the Authorization header must be 'Bearer <key>'")
    key = authorization[len(_BEARER):].strip()
    if not key:
        raise AuthenticationFailed("the Authorization header has an empty key")
    return key
