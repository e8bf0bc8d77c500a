"""The gateway's HTTP surface: an OpenAI-compatible FastAPI app over a `GatewayBackend`.

`build_gateway_app` makes a plain FastAPI app from injected parts — the backend (what serves
models), the auth (keys to tenants) and the metrics (a registry of their own) — and keeps all
its state in those, so the Ray Serve ingress can mount it and tests can run it in-process
against `LocalEngineBackend` with the real `openai` client.

Routes (``{model}`` is ``tenant/name``, slash included):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: SSE when ``stream`` (``data: ...``
  events, then ``data: [DONE]``; while the request waits for an instance, a comment line such
  as ``: waiting for a slot: position 2, about 1.4 s`` about once a second), one JSON body
  otherwise; ``usage`` always filled in, and in a stream as a last chunk when
  ``stream_options.include_usage`` and on every chunk when ``continuous_usage_stats`` (vLLM's);
- ``GET /v1/models``, ``GET /v1/models/{model}``: the models the caller's key may use;
- the same under ``/models/{model}/v1/...``, where the model is in the URL and a body's
  ``model`` is optional (and must match when given);
- ``GET /healthz`` (process up), ``GET /readyz`` (backend ready), and vLLM's ``GET /health`` and
  ``GET|POST /ping`` (backend ready, empty body) and ``GET /version``: open to anyone;
- ``GET /metrics`` (Prometheus): the admin key or the metrics scrape token;
- ``GET /openapi.json``: any valid key; ``/docs`` and ``/redoc`` only in no-auth mode.

Order of checks on a generation request: the key (401, before a byte of the body is read:
`gateway_access.AccessGate`; in no-auth mode the ``Host`` instead, 421 unless a loopback
name), the body's size and arrival time (413, 408: `gateway_body_limit.BodyLimit`), the body
(400, each field named), the model's tenant (403), the model's existence (404), then the
backend's own verdicts (400 prompt over context, 429/503 for a cold model's queue). A bad
request fails on its own: nothing is shared between requests but the backend, which validates
before admitting.
"""

# No `from __future__ import annotations` here: FastAPI reads the route functions' annotations,
# and `Caller` is local to the factory, which a string annotation could not be resolved against.
import dataclasses
import importlib.metadata
import random
import time
import uuid
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from controller import parse_model_id
from infra.gateway_access import AccessGate, principal_of
from infra.gateway_admission import Admission
from infra.gateway_auth import GatewayAuth, Principal
from infra.gateway_backend import GatewayBackend, ModelCard
from infra.gateway_body_limit import DEFAULT_BODY_TIMEOUT_S, BodyLimit
from infra.gateway_metrics import UNKNOWN_MODEL, GatewayMetrics
from infra.choice_streams import ChoiceStreams
from infra.gateway_stream import GenerationResponse, Renderer
from infra.generation_stream import GenerationStream, RequestInfo
from infra.openai_errors import OpenAIError, bad_request, install_error_handlers, model_forbidden, model_not_found
from infra.openai_protocol import COMPLETION_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from infra.openai_renderers import ChatRenderer, CompletionRenderer
from infra.openai_responses import ChatCompletionResponse, CompletionResponse, ModelList, ModelObject
from infra.forced_tool_calls import ForcedToolCalls, forced_tool_grammar
from infra.tool_call_parser import TOOL_CALL_FORMATS, ToolCallStreamParser

DEFAULT_MAX_BODY_BYTES = 8 << 20
# Chat requests without max_tokens may run to the end of the model's context (as OpenAI's and
# vLLM's do); this bounds them when the backend does not know the context length.
FALLBACK_CHAT_MAX_TOKENS = 1024
SEED_MODULUS = 2**64  # seeds are unsigned 64-bit
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_ERROR_RESPONSES = {
    status: {"description": text, "content": {"application/json": {}}}
    for status, text in ((400, "bad request"), (401, "no or unknown API key"), (403, "model of another tenant"),
                         (404, "unknown model"), (408, "body not received in time"), (413, "body too large"),
                         (429, "model queue full"),
                         (503, "queue deadline passed or backend unavailable"))
}


def build_gateway_app(
    backend: GatewayBackend,
    auth: GatewayAuth,
    metrics: GatewayMetrics | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    http_port: int | None = None,
    chat_default_max_tokens: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    title: str = "Thaw gateway",
    max_ongoing_requests: int | None = None,
    retry_after_s: float = 1.0,
) -> FastAPI:
    """The OpenAI-compatible app over `backend`.

    metrics: where request metrics go (a fresh `GatewayMetrics` when None; pass one to share it
        with the code that records cold starts and instance counts).
    max_body_bytes: larger request bodies get 413.
    body_timeout_s: a body not complete this long after the request arrived gets 408.
    http_port: the port clients reach the gateway on; with auth off, a request's ``Host`` must
        name it (None: any port on a loopback name).
    chat_default_max_tokens: a chat's limit when it gives none; None means up to the model's context.
    clock: monotonic seconds, for latency metrics.
    max_ongoing_requests: the requests it serves at once; past them a request gets 503 in
        OpenAI's shape with Retry-After `retry_after_s` (`infra.gateway_admission`; None: no bound).
    """
    metrics = metrics if metrics is not None else GatewayMetrics()
    if chat_default_max_tokens is not None and (not isinstance(chat_default_max_tokens, int)
                                                or chat_default_max_tokens < 1):
        raise ValueError(f"chat_default_max_tokens must be None or an integer >= 1, got {chat_default_max_tokens!r}")
    # With keys on, the interactive docs stay off: their page fetches the schema without a key.
    docs = {} if not auth.enabled else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title=title, version="1", description="OpenAI-compatible serving of Thaw's models.", **docs)
    bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer thaw_...`")

    def observe_error(request: Request, error: OpenAIError) -> None:
        endpoint = _endpoint_of(request)
        if endpoint is not None:
            model_id = getattr(request.state, "model_id", UNKNOWN_MODEL)
            metrics.record_request(model_id, endpoint, error.status_code)

    install_error_handlers(app, observe_error)
    # Added last, so outermost: the key (or the Host) is checked before the body is read.
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(AccessGate, auth=auth, http_port=http_port, on_refused=observe_error)
    if max_ongoing_requests is not None:  # outermost: a full replica refuses before any other work
        app.add_middleware(Admission, max_ongoing_requests=max_ongoing_requests, retry_after_s=retry_after_s,
                           on_refused=observe_error)

    async def principal(request: Request,
                        _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        checked = principal_of(request)  # the gate verified the key already
        if checked is not None:
            return checked
        # The raw header, not HTTPBearer's parse: a malformed one gets its own message.
        return await auth.authenticate(request.headers.get("authorization"))

    Caller = Annotated[Principal, Depends(principal)]

    async def resolve(caller: Principal, model_id: str) -> ModelCard:
        try:
            parse_model_id(model_id)
        except ValueError:
            raise model_not_found(model_id) from None
        if not caller.may_use(model_id):
            raise model_forbidden(model_id)
        return await backend.describe_model(model_id)

    def model_of(body_model: str | None, url_model: str | None) -> str:
        if url_model is None:
            if body_model is None:
                raise bad_request("invalid request: model: is required", "model")
            return body_model
        if body_model is not None and body_model != url_model:
            raise bad_request(f"model {body_model!r} in the body does not match {url_model!r} in the URL; "
                              "leave it out or make them equal", "model")
        return url_model

    async def generate(request: Request, caller: Principal, body: CompletionRequest | ChatCompletionRequest,
                       url_model: str | None) -> GenerationResponse:
        arrival_s = clock()
        card = await resolve(caller, model_of(body.model, url_model))
        request.state.model_id = card.model_id  # from here on, metrics may carry the model's name
        if isinstance(body, ChatCompletionRequest):
            endpoint, prefix, prompt = "chat", "chatcmpl", body.chat_prompt()
            default_max_tokens = chat_default_max_tokens or card.max_model_len or FALLBACK_CHAT_MAX_TOKENS
        else:
            endpoint, prefix, prompt = "completions", "cmpl", body.prompt_input()
            default_max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        params = body.to_sampling_params(default_max_tokens)
        is_chat = isinstance(body, ChatCompletionRequest)
        if is_chat and (probe := tool_parser(body, card)) is not None and probe.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        if is_chat and body.forces_tool_calls:
            if params.structured_output is not None:
                raise bad_request("tool_choice forces tool calls, which constrains the output as the response "
                                  "format does; send one of them", "tool_choice")
            grammar = forced_tool_grammar(body.tools or [], body.forced_function, body.parallel_tool_calls is not False)
            params = dataclasses.replace(params, structured_output=grammar)
        info = RequestInfo(model_id=card.model_id, request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint,
                           arrival_s=arrival_s)
        created = int(time.time())
        num_choices = body.n or 1
        streams: list[GenerationStream] = []
        renderers: list[Renderer] = []
        for index in range(num_choices):
            # Several choices are several requests (see choice_streams.py); a seeded one gets seed + i.
            child = info if num_choices == 1 else dataclasses.replace(info, request_id=f"{info.request_id}-{index}")
            child_params = params if params.seed is None else dataclasses.replace(
                params, seed=(params.seed + index) % SEED_MODULUS)
            streams.append(GenerationStream(backend, metrics, child, prompt, child_params, clock))
            if is_chat:
                renderers.append(ChatRenderer(request_id=info.request_id, model=card.model_id, created=created,
                                              index=index, tool_parser=tool_parser(body, card)))
            else:
                echo = prompt if body.echo and isinstance(prompt, str) else ""
                renderers.append(CompletionRenderer(request_id=info.request_id, model=card.model_id,
                                                    created=created, index=index, echo=echo))
        return GenerationResponse(
            ChoiceStreams(info.request_id, streams), renderers, streaming=bool(body.stream),
            include_usage=body.include_usage, continuous_usage=body.continuous_usage,
            param_names={"structured_output": "tool_choice" if is_chat and body.forces_tool_calls
                         else body.grammar_field() or "response_format"},
            on_done=lambda status: metrics.record_request(card.model_id, endpoint, status),
        )

    def tool_parser(body: ChatCompletionRequest, card: ModelCard) -> ToolCallStreamParser | ForcedToolCalls | None:
        """The parser for a chat whose output may hold tool calls: forced ones (tool_choice
        "required" or a function) are JSON the grammar enforces; with "auto" (OpenAI's default
        with tools) the model's own format is parsed -- 400 when the model's format is unknown."""
        if not body.tools or body.tool_choice == "none":
            return None
        if body.forces_tool_calls:
            return ForcedToolCalls(body.forced_function, random.Random())
        if card.tool_call_format is None:
            raise bad_request(
                f"model {card.model_id!r} has no tool-call format this server can read (its chat template "
                f"teaches none of {', '.join(TOOL_CALL_FORMATS)}): deploy it with --tool-call-parser naming "
                "the format, or send tool_choice \"none\" to show the tools to the model and get its reply as "
                "text", "tool_choice")
        return ToolCallStreamParser(card.tool_call_format, random.Random())

    async def list_models(caller: Principal, url_model: str | None) -> ModelList:
        if url_model is not None:
            cards = [await resolve(caller, url_model)]
        else:
            cards = await backend.list_models(caller.tenant)
        return ModelList(data=[_model_object(card) for card in cards if caller.may_use(card.model_id)])

    async def describe(caller: Principal, model_id: str, url_model: str | None) -> ModelObject:
        if url_model is not None and model_id != url_model:
            raise model_not_found(model_id)
        return _model_object(await resolve(caller, model_id))

    # ---- routes -------------------------------------------------------------------------------

    generation_doc = {"responses": _ERROR_RESPONSES}

    @app.post("/v1/completions", response_model=CompletionResponse, **generation_doc)
    async def completions(request: Request, body: CompletionRequest, caller: Caller) -> Response:
        return await generate(request, caller, body, None)

    @app.post("/models/{model:path}/v1/completions", response_model=CompletionResponse, **generation_doc)
    async def model_completions(request: Request, model: str, body: CompletionRequest, caller: Caller) -> Response:
        return await generate(request, caller, body, model)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, **generation_doc)
    async def chat_completions(request: Request, body: ChatCompletionRequest, caller: Caller) -> Response:
        return await generate(request, caller, body, None)

    @app.post("/models/{model:path}/v1/chat/completions", response_model=ChatCompletionResponse, **generation_doc)
    async def model_chat_completions(request: Request, model: str, body: ChatCompletionRequest,
                                     caller: Caller) -> Response:
        return await generate(request, caller, body, model)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def models(caller: Caller) -> ModelList:
        return await list_models(caller, None)

    @app.get("/v1/models/{model_id:path}", response_model=ModelObject, responses=_ERROR_RESPONSES)
    async def model_info(model_id: str, caller: Caller) -> ModelObject:
        return await describe(caller, model_id, None)

    @app.get("/models/{model:path}/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def per_model_models(model: str, caller: Caller) -> ModelList:
        return await list_models(caller, model)

    @app.get("/models/{model:path}/v1/models/{model_id:path}", response_model=ModelObject,
             responses=_ERROR_RESPONSES)
    async def per_model_model_info(model: str, model_id: str, caller: Caller) -> ModelObject:
        return await describe(caller, model_id, model)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    async def backend_ready() -> bool:
        try:
            return await backend.is_ready()
        except Exception:  # noqa: BLE001 - an unreachable controller is "not ready", not a crash
            return False

    def not_ready() -> JSONResponse:
        return OpenAIError(503, "the serving backend is not ready", "service_unavailable", None,
                           "backend_unavailable", {"Retry-After": "1"}).to_response()

    @app.get("/readyz", responses={503: _ERROR_RESPONSES[503]})
    async def readyz() -> JSONResponse:
        return JSONResponse({"status": "ready"}) if await backend_ready() else not_ready()

    # vLLM's probes, which its tooling (guidellm, the production stack) and SageMaker call: 200 with
    # an empty body once requests can be served, like /readyz.
    @app.get("/health", responses={503: _ERROR_RESPONSES[503]})
    async def health() -> Response:
        return Response(status_code=200) if await backend_ready() else not_ready()

    @app.get("/ping", responses={503: _ERROR_RESPONSES[503]})
    async def ping() -> Response:
        return Response(status_code=200) if await backend_ready() else not_ready()

    @app.post("/ping", responses={503: _ERROR_RESPONSES[503]})
    async def ping_post() -> Response:
        return await ping()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": thaw_version()}

    @app.get("/metrics", responses={401: _ERROR_RESPONSES[401],
                                    403: {"description": "neither the admin key nor the scrape token",
                                          "content": {"application/json": {}}}})
    async def metrics_endpoint() -> Response:  # who may read it: AccessGate
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


def thaw_version() -> str:
    """The installed thaw package's version ("unknown" when run from a tree that is not installed)."""
    try:
        return importlib.metadata.version("thaw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _endpoint_of(request: Request) -> str | None:
    path = request.url.path
    for suffix, endpoint in _ENDPOINTS.items():
        if path.endswith(suffix):
            return endpoint
    return None


def _model_object(card: ModelCard) -> ModelObject:
    return ModelObject(id=card.model_id, created=card.created_s, owned_by=card.owned_by,
                       max_model_len=card.max_model_len)
