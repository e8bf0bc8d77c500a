"""`GatewayBackend` over in-process `worker.AsyncEngine`s: the gateway without Ray.

Each model id maps to one engine running in this process. It serves local experiments and
the gateway's end-to-end tests (real HTTP, the real `openai` client, real tokens) without a
cluster, and it is the reference for what a backend must do:

- tokenize here, so a prompt over the model's context is `ContextLengthExceeded` (400,
  ``context_length_exceeded``) and other refusals are `InvalidRequest` naming the field, all
  raised before the first chunk and touching no other request;
- stream `GenerationChunk`s with running token counts, so the last one carries the usage;
- on an early close or `abort`, cancel the request on the engine, which frees its KV blocks.

It tokenizes exactly as `Engine` does (`encode` with special tokens for text, the chat
template for messages) and hands the engine token ids, so its output is the engine's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

from controller import parse_model_id
from infra.gateway_backend import (
    BackendUnavailable,
    ContextLengthExceeded,
    GenerationChunk,
    InvalidRequest,
    ModelCard,
    ModelNotFound,
    Prompt,
    RequestFailed,
)
from wire import ChatPrompt
from worker import AsyncEngine, EngineDeadError, InvalidRequestError, RequestFailedError, SamplingParams

logger = logging.getLogger(__name__)


class LocalEngineBackend:
    """Serves ``{model_id: AsyncEngine}``; the engines stay the caller's to shut down."""

    def __init__(self, engines: Mapping[str, AsyncEngine], created_s: int | None = None) -> None:
        for model_id in engines:
            parse_model_id(model_id)  # raises SpecError (a ValueError) naming the bad part
        self._engines = dict(engines)
        self._created_s = int(time.time()) if created_s is None else created_s

    def _engine(self, model_id: str) -> AsyncEngine:
        engine = self._engines.get(model_id)
        if engine is None:
            raise ModelNotFound(model_id)
        return engine

    def _card(self, model_id: str) -> ModelCard:
        engine = self._engine(model_id)
        return ModelCard(model_id=model_id, owned_by=model_id.partition("/")[0], created_s=self._created_s,
                         max_model_len=engine.engine.max_model_len,
                         tool_call_format=engine.engine.tokenizer.tool_call_format())

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        return [self._card(m) for m in sorted(self._engines) if tenant is None or m.partition("/")[0] == tenant]

    async def describe_model(self, model_id: str) -> ModelCard:
        return self._card(model_id)

    async def generate(self, model_id: str, request_id: str, prompt: Prompt,
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        engine = self._engine(model_id)
        prompt_ids = self._tokenize(engine, prompt)
        try:
            outputs = engine.generate(prompt_ids, params, request_id)
            async with aclosing(outputs):  # closing it early aborts the request on the engine
                first = True
                async for out in outputs:
                    yield GenerationChunk(
                        request_id=request_id, text=out.new_text, token_ids=out.new_token_ids,
                        finish_reason=out.finish_reason,
                        num_prompt_tokens=out.num_prompt_tokens, num_completion_tokens=out.num_output_tokens,
                        queue_s=0.0 if first else None,  # an in-process engine is always ready
                        logprobs=out.logprobs, num_cached_tokens=out.num_cached_tokens,
                    )
                    first = False
        except InvalidRequestError as exc:
            raise InvalidRequest(str(exc), _param_of(str(exc))) from None
        except EngineDeadError as exc:
            raise BackendUnavailable(f"model {model_id!r} is unavailable: its engine stopped") from exc
        except RequestFailedError as exc:
            logger.error("request %s on %s failed: %s", request_id, model_id, exc)
            raise RequestFailed(f"model {model_id!r} could not complete this request; "
                                "the failure has been logged") from None

    @staticmethod
    def _tokenize(engine: AsyncEngine, prompt: Prompt) -> list[int]:
        tokenizer, max_model_len = engine.engine.tokenizer, engine.engine.max_model_len
        is_chat = isinstance(prompt, ChatPrompt) or (
            not isinstance(prompt, str) and bool(prompt) and all(isinstance(m, dict) for m in prompt))
        param = "messages" if is_chat else "prompt"
        try:
            ids = tokenizer.encode_prompt(prompt)
        except (ValueError, TypeError) as exc:  # the template refused the chat; text no tokenizer takes
            raise InvalidRequest(f"{param} cannot be tokenized: {exc}", param) from None
        if not ids:
            raise InvalidRequest(f"{param} must not be empty", param)
        if len(ids) >= max_model_len:
            raise ContextLengthExceeded(
                f"the prompt is {len(ids)} tokens but the model's context is {max_model_len} tokens, "
                "including at least one generated token; shorten the prompt", param)
        return ids

    async def abort(self, model_id: str, request_id: str) -> None:
        engine = self._engines.get(model_id)
        if engine is not None:
            engine.abort(request_id)

    async def is_ready(self) -> bool:
        return bool(self._engines)


def _param_of(message: str) -> str | None:
    # The engine's refusals of token-id prompts and of the KV-cache budget name what to change.
    if message.startswith("prompt"):
        return "prompt"
    if message.startswith("logit_bias"):  # a token id outside the model's vocabulary
        return "logit_bias"
    if "max_tokens" in message:
        return "max_tokens"
    return None
