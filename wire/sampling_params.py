"""Per-request sampling settings: how the next token is picked and when generation stops.

`SamplingParams` is the immutable record a request carries from the HTTP edge to the
worker's `Sampler`. It follows the OpenAI/vLLM names (`temperature`, `top_k`, `top_p`,
`max_tokens`, `stop`, `seed`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`,
`min_p`, `logit_bias`, `min_tokens`, `logprobs`) and their meanings, so the API layer maps fields
one to one; every field defaults to "off". It lives in `wire/`
because it crosses from the gateway to the workers: the gateway builds it without importing the
engine (or torch), and, as every wire record, it crosses Ray tagged (`WireRecord`).

All validation happens here, once, in `__post_init__`: the sampler runs every decode step
and trusts these values. Each message starts with the field's name (the gateway maps it back to
the HTTP field). Collections are normalised to tuples (`logit_bias` to sorted ``(token id, bias)``
pairs) so the record stays hashable and cannot be changed behind the sampler's back. What needs
the model (a `logit_bias` token id inside the vocabulary) is checked by the worker's engine.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from wire.grammar_spec import GrammarSpec
from wire.wire_record import WireRecord

# torch.Generator.manual_seed accepts seeds up to 2**64 - 1.
_MAX_SEED_EXCLUSIVE = 2**64
# Bounds on the stop conditions, so one request's stop checks stay cheap (they run on every new
# token). OpenAI allows 4 stop sequences; ours are looser, but bounded.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# The fields a model's generation_config.json may default (vLLM's "auto" generation config).
MODEL_DEFAULT_FIELDS = ("temperature", "top_k", "top_p")
# Below this a temperature samples as greedy (see `SamplingParams.is_greedy`).
MIN_SAMPLING_TEMPERATURE = 1e-5
# OpenAI's ranges for the presence and frequency penalties, and for a logit bias.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
# Bound on `logit_bias` entries, so one request's bias stays cheap to apply every step.
MAX_LOGIT_BIAS_TOKENS = 1024
# Most alternatives `logprobs` may ask for per token (OpenAI's top_logprobs limit, vLLM's default).
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    """True for ints (numpy ints included), False for bools, which are ints in Python."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """True for ints and floats (numpy scalars included), False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams(WireRecord):
    """How to sample one request's tokens.

    Fields:
        max_tokens: most tokens to generate, >= 1.
        temperature: logits are divided by it before softmax; 0 (or anything below
            `MIN_SAMPLING_TEMPERATURE`, 1e-5) means greedy (argmax).
        top_k: keep only the k most likely tokens; 0 disables the filter.
        top_p: nucleus sampling; keep the smallest set of most likely tokens whose
            probability sums to at least top_p. 1.0 disables the filter.
        seed: when set, the request draws from its own generator seeded with it, so its
            tokens do not depend on which other requests share the batch.
        stop: strings that end generation when they appear in the output (at most
            `MAX_STOP_SEQUENCES`, each at most `MAX_STOP_CHARS` characters).
        stop_token_ids: token ids that end generation when sampled (at most `MAX_STOP_TOKEN_IDS`).
        ignore_eos: keep generating past the model's end-of-sequence token.
        skip_special_tokens: leave the text of special tokens out of the output (vLLM's default);
            False keeps them, e.g. Mistral's ``[TOOL_CALLS]``, which the gateway's tool-call parser
            needs. The token that ends a request (end-of-sequence, a stop token id) never adds text.
        structured_output: what the output must match (a JSON schema, any JSON object, a regex, one
            of a list of strings: `GrammarSpec`), enforced token by token; None: free text.
        model_defaults: the fields of `MODEL_DEFAULT_FIELDS` the client left out, which the model's
            own defaults (its ``generation_config.json``) fill in at the worker, as vLLM does: the
            gateway does not know the model's files, the worker does (`with_model_defaults`).
        presence_penalty: OpenAI's, in [-2, 2]: subtracted once from the logit of every token that
            occurs in the output so far (the prompt does not count). 0 is off.
        frequency_penalty: OpenAI's, in [-2, 2]: subtracted from a token's logit once per
            occurrence in the output so far. 0 is off.
        repetition_penalty: vLLM's and transformers', > 0: the logit of every token that occurs in
            the prompt or the output so far is divided by it if positive, multiplied by it
            otherwise. 1.0 is off.
        min_p: in [0, 1]: after temperature, drop the tokens whose probability is below min_p
            times the most likely token's. 0 is off; greedy rows ignore it (it keeps the argmax).
        logit_bias: ``(token id, bias)`` pairs, bias in [-100, 100], added to those tokens' logits
            (given as a mapping or pairs; stored sorted by id, at most `MAX_LOGIT_BIAS_TOKENS`;
            JSON's string keys of digits are read as ids). The worker checks the ids against its
            vocabulary.
        min_tokens: the end-of-sequence tokens and `stop_token_ids` cannot be sampled until this
            many tokens are generated (vLLM's meaning; at most ``max_tokens``). 0 is off.
        logprobs: None (off), or how many most likely alternatives to report with each generated
            token's own log-probability, 0 to `MAX_LOGPROBS`. Log-probabilities are those of the
            model's raw logits (before penalties, bias and temperature: vLLM's default).
    """

    SCHEMA: ClassVar[str] = "sampling_params/1"

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    model_defaults: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))

        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), "
                f"got {self.temperature!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))

        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 (disabled) or an integer >= 1, got {self.top_k!r}"
            )
        object.__setattr__(self, "top_k", int(self.top_k))

        # `not (0 < x <= 1)` also rejects nan, for which every comparison is False.
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", float(self.top_p))

        if self.seed is not None:
            if not _is_int(self.seed) or not (0 <= self.seed < _MAX_SEED_EXCLUSIVE):
                raise ValueError(
                    f"seed must be None or an integer in [0, 2**64), got {self.seed!r}"
                )
            object.__setattr__(self, "seed", int(self.seed))

        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        object.__setattr__(
            self, "stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids)
        )

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, GrammarSpec):
            raise ValueError(f"structured_output must be None or a GrammarSpec, got {self.structured_output!r}")

        defaults = self.model_defaults
        if not isinstance(defaults, (list, tuple)) or not set(defaults) <= set(MODEL_DEFAULT_FIELDS):
            raise ValueError(f"model_defaults must name fields of {', '.join(MODEL_DEFAULT_FIELDS)}, got {defaults!r}")
        object.__setattr__(self, "model_defaults", tuple(dict.fromkeys(defaults)))

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 is off), got {value!r}")
            object.__setattr__(self, name, float(value))
        penalty = self.repetition_penalty
        if not _is_real(penalty) or not math.isfinite(penalty) or penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(penalty))
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}")
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "logit_bias", self._normalise_logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise ValueError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}] (how many "
                                 f"alternatives to report per token), got {self.logprobs!r}")
            object.__setattr__(self, "logprobs", int(self.logprobs))

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> SamplingParams:
        grammar = values.get("structured_output")
        if isinstance(grammar, Mapping):
            try:
                values = {**values, "structured_output": GrammarSpec.from_dict(grammar)}
            except ValueError as exc:
                raise ValueError(f"{cls.record_name()}.structured_output: {exc}") from None
        return super().from_fields(values)

    def with_model_defaults(self, defaults: Mapping[str, float | int]) -> SamplingParams:
        """These settings with the model's `defaults` in the fields the client left out (those in
        `model_defaults`); a field the model does not set keeps the API's default."""
        chosen = {name: defaults[name] for name in self.model_defaults if name in defaults}
        return dataclasses.replace(self, **chosen, model_defaults=())

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        # A lone string is one stop sequence, not a sequence of one-character stops.
        if isinstance(stop, str):
            stop = (stop,)
        # Sets are refused: their order is not stable, and stop matching reports which
        # sequence matched first.
        if not isinstance(stop, (list, tuple)):
            raise ValueError(
                f"stop must be a string or a list/tuple of strings, got {type(stop).__name__}"
            )
        if len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}")
        for i, item in enumerate(stop):
            if not isinstance(item, str):
                raise ValueError(f"stop[{i}] must be a string, got {type(item).__name__}")
            if len(item) > MAX_STOP_CHARS:
                raise ValueError(f"stop[{i}] may be at most {MAX_STOP_CHARS} characters, got {len(item)}")
            if not item:
                raise ValueError(f"stop[{i}] must be a non-empty string, got ''")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(stop_token_ids: object) -> tuple[int, ...]:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list/tuple of integers >= 0, "
                f"got {type(stop_token_ids).__name__}"
            )
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
        for i, token_id in enumerate(stop_token_ids):
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(
                    f"stop_token_ids[{i}] must be an integer >= 0, got {token_id!r}"
                )
        return tuple(int(token_id) for token_id in stop_token_ids)

    @staticmethod
    def _normalise_logit_bias(logit_bias: object) -> tuple[tuple[int, float], ...]:
        if isinstance(logit_bias, Mapping):
            items = list(logit_bias.items())
        elif isinstance(logit_bias, (list, tuple)):
            items = list(logit_bias)
            for i, item in enumerate(items):
                if not isinstance(item, (list, tuple)) or len(item) != 2:
                    raise ValueError(f"logit_bias[{i}] must be a (token id, bias) pair, got {item!r}")
        else:
            raise ValueError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
        if len(items) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}")
        biases: dict[int, float] = {}
        for token_id, bias in items:
            # JSON object keys are strings: "50256" is token 50256.
            if isinstance(token_id, str) and token_id.isascii() and token_id.isdigit():
                token_id = int(token_id)
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not _is_real(bias) or not (-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token_id}")
            if int(token_id) in biases:
                raise ValueError(f"logit_bias names token {int(token_id)} twice")
            biases[int(token_id)] = float(bias)
        return tuple(sorted(biases.items()))

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence, frequency or repetition penalties is on: sampling then
        needs the request's token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax: top_k 1, or a temperature below
        `MIN_SAMPLING_TEMPERATURE` (0 included). Dividing logits by a temperature that small
        overflows them to inf and the softmax to NaN (1e-39 did, killing the engine thread); at
        such a temperature sampling is the argmax anyway, so it is taken as greedy (as vLLM does
        below its epsilon)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1
