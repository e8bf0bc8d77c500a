"""Per-request sampling settings: how the next token is picked and when generation stops.

`SamplingParams` is the immutable record a request carries from the HTTP edge to the
worker's `Sampler`. It follows the OpenAI/vLLM names (`temperature`, `top_k`, `top_p`,
`max_tokens`, `stop`, `seed`) so the API layer maps fields one to one. It lives in `wire/`
because it crosses from the gateway to the workers: the gateway builds it without importing the
engine (or torch), and, as every wire record, it crosses Ray tagged (`WireRecord`).

All validation happens here, once, in `__post_init__`: the sampler runs every decode step
and trusts these values. Collections are normalised to tuples so the record stays hashable
and cannot be changed behind the sampler's back.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

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
        model_defaults: the fields of `MODEL_DEFAULT_FIELDS` the client left out, which the model's
            own defaults (its ``generation_config.json``) fill in at the worker, as vLLM does: the
            gateway does not know the model's files, the worker does (`with_model_defaults`).
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

        defaults = self.model_defaults
        if not isinstance(defaults, (list, tuple)) or not set(defaults) <= set(MODEL_DEFAULT_FIELDS):
            raise ValueError(f"model_defaults must name fields of {', '.join(MODEL_DEFAULT_FIELDS)}, got {defaults!r}")
        object.__setattr__(self, "model_defaults", tuple(dict.fromkeys(defaults)))

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

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax: top_k 1, or a temperature below
        `MIN_SAMPLING_TEMPERATURE` (0 included). Dividing logits by a temperature that small
        overflows them to inf and the softmax to NaN (1e-39 did, killing the engine thread); at
        such a temperature sampling is the argmax anyway, so it is taken as greedy (as vLLM does
        below its epsilon)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1
