"""Errors in OpenAI's shape, with the status a client acts on.

Every error the gateway returns — a bad body, a missing key, a cold model's full queue, a
route that does not exist — has the body OpenAI's API returns and its SDKs parse::

    {"error": {"message": "...", "type": "...", "param": "temperature" | null, "code": ... | null}}

The status decides what the official clients raise (`openai.BadRequestError` for 400,
`AuthenticationError` 401, `PermissionDeniedError` 403, `NotFoundError` 404,
`RateLimitError` 429, `InternalServerError` 5xx) and whether they retry (429 and 5xx, after
``Retry-After``). So the mapping lives here, once:

- 400 bad body, each bad field named (``param`` is the first, the message lists them all);
  a prompt over the model's context is 400 with code ``context_length_exceeded``, like OpenAI;
- 401 no key or an unknown one; 403 a model of another tenant; 404 an unknown model or route;
- 413 a request body over the gateway's size limit;
- 429 (queue full) and 503 (queue deadline passed, backend down) with ``Retry-After``;
- 500 for anything unexpected, without internals in the message.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infra.gateway_auth import AuthenticationFailed
from infra.gateway_backend import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    ModelNotFound,
    ModelOverloaded,
    QueueTimeout,
    RequestFailed,
)

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error response: status, OpenAI error fields, and extra headers (``Retry-After``).

    A plain exception, not a frozen dataclass: the interpreter and contextlib assign
    ``__traceback__`` / ``__context__`` on exceptions they pass along.
    """

    def __init__(self, status_code: int, message: str, type: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def __str__(self) -> str:
        return f"{self.status_code} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=dict(self.headers))

    def sse_event(self) -> bytes:
        """The error as one server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def authentication_failed(message: str) -> OpenAIError:
    return OpenAIError(401, message, "authentication_error", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})


def model_forbidden(model_id: str) -> OpenAIError:
    return OpenAIError(403, f"model {model_id!r} belongs to another tenant; this API key cannot use it",
                       "permission_error", "model", "model_not_permitted")


def model_not_found(model_id: str) -> OpenAIError:
    return OpenAIError(404, f"model {model_id!r} does not exist or is not deployed; "
                       "GET /v1/models lists the models this key can use",
                       "not_found_error", "model", "model_not_found")


def body_too_large(limit_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the gateway's limit of {limit_bytes} bytes",
                       "invalid_request_error", None, "request_too_large")


def internal_error() -> OpenAIError:
    return OpenAIError(500, "the server hit an internal error; it has been logged", "server_error")


def _retry_after(seconds: float | None) -> dict[str, str]:
    # Retry-After takes whole seconds; round up so a client never comes back too early.
    if seconds is None or not math.isfinite(seconds):
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_from_backend(exc: BackendError) -> OpenAIError:
    """The response for a backend failure (see `gateway_backend` for each case)."""
    if isinstance(exc, InvalidRequest):
        return bad_request(exc.message, exc.param, exc.code)
    if isinstance(exc, ModelNotFound):
        return model_not_found(exc.model_id)
    if isinstance(exc, ModelOverloaded):
        return OpenAIError(429, str(exc), "rate_limit_error", None, "model_overloaded",
                           _retry_after(exc.retry_after_s))
    if isinstance(exc, QueueTimeout):
        return OpenAIError(503, str(exc), "service_unavailable", None, "queue_timeout",
                           _retry_after(exc.retry_after_s))
    if isinstance(exc, RequestFailed):
        return OpenAIError(500, str(exc), "server_error", None, "request_failed")
    if isinstance(exc, BackendUnavailable):
        return OpenAIError(503, str(exc), "service_unavailable", None, "backend_unavailable",
                           _retry_after(exc.retry_after_s))
    logger.error("unmapped backend error %s: %s", type(exc).__name__, exc)
    return internal_error()


# Pydantic puts the branch of a union it tried into an error's location: a type name
# ("str", "list[int]", a model's class name) or a validator tag ("function-after[...]").
# None of those is part of the client's JSON.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_union_tag(item: Any) -> bool:
    return isinstance(item, str) and (not item.isidentifier() or item in _TYPE_TAGS or item[:1].isupper())


def param_from_loc(loc: Sequence[Any]) -> str | None:
    """A pydantic error location as OpenAI names a param: ``messages[0].content``.

    FastAPI's leading ``body`` and pydantic's union-branch tags are dropped.
    """
    parts: list[str] = []
    for index, item in enumerate(loc):
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
        elif not (index == 0 and item == "body") and not _is_union_tag(item):
            parts.append(str(item))
    return ".".join(parts) or None


def _message(error: Mapping[str, Any]) -> str:
    kind = error.get("type")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a known field"
    # pydantic prefixes messages from our own validators with "Value error, ".
    return str(error.get("msg", "is invalid")).removeprefix("Value error, ")


def _closest_branch(errors: list[Mapping[str, Any]], tag_at: int) -> list[tuple[str | None, str]]:
    """For a value no branch of a union accepted: the errors of the branch that got furthest
    (it is most likely the one meant), or the list of accepted forms if none got past the top."""
    depth = {id(e): len(e["loc"]) - tag_at - 1 for e in errors}
    deepest = max(depth.values())
    if deepest == 0:
        forms = ", ".join(dict.fromkeys(str(e["loc"][tag_at]) for e in errors))
        return [(param_from_loc(errors[0]["loc"][:tag_at]), f"must be one of these forms: {forms}")]
    branch = next(e["loc"][tag_at] for e in errors if depth[id(e)] == deepest)
    return [(param_from_loc(e["loc"]), _message(e)) for e in errors if e["loc"][tag_at] == branch]


def error_from_validation(errors: Iterable[Mapping[str, Any]]) -> OpenAIError:
    """400 naming every bad field: ``param`` is the first, the message lists each with its reason."""
    named: list[tuple[str | None, str]] = []
    unions: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            return bad_request(f"the request body is not valid JSON ({error.get('msg', 'parse error')})")
        loc = tuple(error.get("loc", ()))
        tag_at = next((i for i, item in enumerate(loc) if i > 0 and _is_union_tag(item)), None)
        if tag_at is None:
            named.append((param_from_loc(loc), _message(error)))
        else:
            if loc[:tag_at] not in unions:
                named.append((loc[:tag_at], ""))  # placeholder keeps the field's place in the order
            unions.setdefault(loc[:tag_at], []).append({**error, "loc": loc})
    flat: list[tuple[str | None, str]] = []
    for param, message in named:
        items = _closest_branch(unions[param], len(param)) if isinstance(param, tuple) else [(param, message)]
        flat.extend(item for item in items if item not in flat)
    if not flat:
        return bad_request("the request body is invalid")
    text = "; ".join(f"{param}: {message}" if param else message for param, message in flat)
    return bad_request(f"invalid request: {text}", flat[0][0])


ErrorObserver = Callable[[Request, OpenAIError], None]


def install_error_handlers(app: FastAPI, observe: ErrorObserver | None = None) -> None:
    """Makes every error `app` returns an OpenAI error body with the right status.

    `observe` sees each error response before it is sent (the gateway counts them per model).
    """

    def respond(request: Request, error: OpenAIError) -> JSONResponse:
        if observe is not None:
            observe(request, error)
        return error.to_response()

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return respond(request, exc)

    async def on_backend_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BackendError)
        return respond(request, error_from_backend(exc))

    async def on_auth_failed(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, authentication_failed(str(exc)))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, error_from_validation(exc.errors()))

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's own errors (no such route, wrong method, body too large) in OpenAI's shape too.
        assert isinstance(exc, StarletteHTTPException)
        kinds = {404: ("not_found_error", None), 408: ("invalid_request_error", "request_timeout"),
                 413: ("invalid_request_error", "request_too_large")}
        kind, code = kinds.get(exc.status_code, ("invalid_request_error", None))
        return respond(request, OpenAIError(exc.status_code, str(exc.detail), kind, None, code,
                                            dict(exc.headers or {})))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return respond(request, internal_error())

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(BackendError, on_backend_error)
    app.add_exception_handler(AuthenticationFailed, on_auth_failed)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
