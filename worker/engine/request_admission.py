"""What a request must satisfy before the engine queues it: `RequestAdmission`.

Every check here is about the request against this engine's model and pool, never about the
engine's state now, so all of it is thread-safe and runs off the engine thread (a long prompt is
best tokenized off an event loop). The checks are split by whose fault a refusal is, so a worker
can name the field at fault (`worker.serving.instance_worker`): `tokenize_prompt` (the prompt alone: well
formed, ids in the vocabulary, room for it plus one output token in the context and the KV pool),
`check_params` (``logit_bias`` ids in the vocabulary, a ``structured_output`` this model can
enforce) and `prepare_tokens` (the prompt with ``max_tokens`` in the KV pool; the `Sequence`).

The KV-fit rule is written once, `kv_shortfall`, and also read by a migration's import
(`worker.transfer.engine_migration`), which refuses a request the pool could not hold to its end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from wire import InvalidRequestError, Prompt, SamplingParams
from worker.loading.layer_gate import LayerLoadError
from worker.models.model_config import ModelConfig
from worker.engine.sequence import Sequence
from worker.engine.structured_output_manager import StructuredOutputManager
from worker.text.tokenizer import Tokenizer

__all__ = ["RequestAdmission"]


class RequestAdmission:
    """See the module docstring. `capacity_tokens`: the KV pool's size in tokens (blocks x block
    size); `weights_error`: why the engine's weights can never be complete, if they cannot (it
    then refuses every request); `generation_defaults`: the model's own sampling defaults for the
    fields a request leaves out."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, *, max_model_len: int, capacity_tokens: int,
                 device: torch.device, generation_defaults: Mapping[str, float | int],
                 structured_output: StructuredOutputManager,
                 weights_error: Callable[[], LayerLoadError | None]) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.device = device
        self.generation_defaults = generation_defaults
        self.structured_output = structured_output
        self._weights_error = weights_error
        self._next_id = itertools.count()

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked alone (see the module docstring). Raises
        `InvalidRequestError`, which is then the prompt's fault."""
        self._check_weights()
        prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(prompt_ids)} tokens but the model's context is {self.max_model_len} tokens "
                "(including at least one output token); shorten the prompt"
            )
        self._check_kv_room(len(prompt_ids), 1)
        return prompt_ids

    def prepare_tokens(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> Sequence:
        """A request from ids `tokenize_prompt` returned: checks that prompt + ``max_tokens`` fit
        the KV pool (else `InvalidRequestError`, then ``max_tokens``'s fault) and builds its
        `Sequence` (its id ``req-<n>`` unless given, its generator seeded)."""
        self._check_weights()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.model_defaults:  # fields the client left out: the model's generation_config.json fills them
            params = params.with_model_defaults(self.generation_defaults)
        self.check_params(params)
        self._check_kv_room(len(prompt_ids), params.max_tokens)
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        return Sequence(
            request_id=request_id if request_id is not None else f"req-{next(self._next_id)}",
            prompt_token_ids=prompt_ids,
            params=params,
            max_model_len=self.max_model_len,
            generator=generator,
        )

    def check_params(self, params: SamplingParams) -> None:
        """The checks of `params` that need the model (`SamplingParams` checks the rest itself):
        ``logit_bias`` names tokens of the vocabulary, and `check_structured_output`. Raises
        `InvalidRequestError` naming the field."""
        vocab = self.model_config.vocab_size
        bad = [token_id for token_id, _ in params.logit_bias if token_id >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}) (this model's vocabulary), "
                                      f"got {bad[:5]}")
        self.check_structured_output(params)

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compiles ``structured_output`` (cached for the request's steps), if any; raises
        `InvalidRequestError` ("structured_output: ..." and what to change) if this model cannot
        enforce it. The first structured request builds the grammar engine (about a second for a
        128k-token vocabulary)."""
        if params.structured_output is not None:
            self.structured_output.check(params.structured_output)

    def kv_shortfall(self, num_prompt_tokens: int, max_tokens: int) -> int | None:
        """The KV slots a request of `num_prompt_tokens` may need to its end (prompt + `max_tokens`,
        at most the context) when the pool holds fewer; None when it fits."""
        needed = min(num_prompt_tokens + max_tokens, self.max_model_len)
        return needed if needed > self.capacity_tokens else None

    def _check_kv_room(self, num_prompt_tokens: int, max_tokens: int) -> None:
        needed = self.kv_shortfall(num_prompt_tokens, max_tokens)
        if needed is not None:
            raise InvalidRequestError(
                f"request needs up to {needed} KV-cache slots (prompt + max_tokens) but this instance's cache "
                f"holds {self.capacity_tokens}; lower max_tokens or shorten the prompt"
            )

    def _check_weights(self) -> None:
        error = self._weights_error()
        if error is not None:
            raise LayerLoadError(f"this engine cannot serve: its weights failed to load: {error}")

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("prompt must not be empty")
        try:
            ids = self.tokenizer.encode_prompt(prompt)
        except ValueError as exc:  # a chat the template refused, or a prompt of no known form
            raise InvalidRequestError(str(exc)) from exc
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):  # token ids
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise InvalidRequestError("prompt must not be empty")
        return ids
