"""`RequestSnapshot`: everything another engine needs to continue a request exactly where this one stands.

A live migration (see `migration/`) moves a generating request between instances of the same
model. The snapshot is the request's state without its KV cache: the KV either travels
separately as blocks (Llumnix-style) or is recomputed from these tokens (ServerlessLLM-style).
The source worker's engine takes it, the migration driver carries it, the destination worker's
engine continues from it -- three processes, over Ray -- so it is a wire record, defined here
once (it lived in `worker/`, which still re-exports it as ``worker.RequestSnapshot``).

What continuing *exactly* takes, and where it is in here:

* the tokens: prompt and output so far; the destination's next step starts from them;
* how far the KV cache has caught up (``num_computed_tokens``): KV for positions
  ``[0, num_computed_tokens)`` exists on the source, so that many tokens of KV are worth copying;
* the sampler's random stream: the request's ``torch.Generator`` state, as bytes, so seeded (and
  unseeded) sampling draws the very numbers it would have drawn on the source;
* the text already streamed: not stored as text. The detokenizer is deterministic in the token
  ids, so the destination rebuilds its state (the held-back bytes of an incomplete character,
  the held-back prefix of a stop string, the decode window) by replaying the output ids without
  emitting them. Text deltas then continue with no character lost or repeated;
* the weights it was computed with (``checkpoint_id``): KV and tokens of one version of a model
  are not continued by another (`worker.transfer.engine_migration.begin_import` refuses them).

Every output token in a snapshot has already been delivered to the engine's caller: the engine
emits each token in the step that samples it. The snapshot is engine-agnostic data (ids, params,
bytes; no tensor), so wire needs no torch for it; it prints without its token ids (logs never
carry prompts or completions). Its dict form keeps ``generator_state`` as bytes (pickle and Ray
carry them as one blob), so that form is for pickling, not for JSON.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wire.sampling_params import SamplingParams
from wire.wire_record import WireRecord, check_name, check_token_ids

__all__ = ["RequestSnapshot"]

# The device types a generator's state comes from; a state only fits a generator of its own type.
GENERATOR_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class RequestSnapshot(WireRecord):
    """Fields (positional in this order, as the engine and the tests build it):
        request_id: the request, unchanged by the move.
        prompt_token_ids / output_token_ids: its tokens so far (the prompt is never empty).
        params: how it samples and stops.
        num_computed_tokens: KV exists for positions [0, num_computed_tokens) on the engine that
            took the snapshot; below the token count (the last token's KV is the next step's).
        generator_state: ``torch.Generator.get_state()`` as bytes; None: none to carry over (e.g.
            rebuilt from a client's transcript), and the destination seeds a fresh generator from
            ``params.seed``.
        generator_device_type: "cpu" or "cuda": a generator's state only fits one of its type.
        checkpoint_id: the checkpoint it was taken on (`worker.loading.checkpoint_identity`), which a
            destination compares with its own; None: not known (rebuilt from a transcript).
    """

    SCHEMA: ClassVar[str] = "request_snapshot/1"

    request_id: str
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    output_token_ids: tuple[int, ...] = field(repr=False)
    params: SamplingParams = field(repr=False)
    num_computed_tokens: int
    generator_state: bytes | None = field(default=None, repr=False)
    generator_device_type: str = "cpu"
    checkpoint_id: str | None = None

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "request_id", self.request_id)
        if isinstance(self.prompt_token_ids, (tuple, list)) and not self.prompt_token_ids:
            raise ValueError(f"{name}.prompt_token_ids: a snapshot needs a non-empty prompt")
        object.__setattr__(self, "prompt_token_ids", check_token_ids(name, "prompt_token_ids", self.prompt_token_ids))
        object.__setattr__(self, "output_token_ids", check_token_ids(name, "output_token_ids", self.output_token_ids))
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"{name}.params must be SamplingParams, got {type(self.params).__name__}")
        num_tokens, num_computed = self.num_tokens, self.num_computed_tokens
        if not isinstance(num_computed, numbers.Integral) or isinstance(num_computed, bool) \
                or not 0 <= num_computed < num_tokens:
            raise ValueError(
                f"{name}.num_computed_tokens must be in [0, {num_tokens}) (the last token's KV is computed by the "
                f"next step), got {num_computed!r}"
            )
        object.__setattr__(self, "num_computed_tokens", int(num_computed))
        if self.generator_state is not None:
            if not isinstance(self.generator_state, (bytes, bytearray, memoryview)):
                raise ValueError(f"{name}.generator_state must be None or bytes (torch.Generator.get_state()), "
                                 f"got {type(self.generator_state).__name__}")
            if type(self.generator_state) is not bytes:
                object.__setattr__(self, "generator_state", bytes(self.generator_state))
        if self.generator_device_type not in GENERATOR_DEVICE_TYPES:
            raise ValueError(f"{name}.generator_device_type must be 'cpu' or 'cuda', "
                             f"got {self.generator_device_type!r}")
        check_name(name, "checkpoint_id", self.checkpoint_id, optional=True)

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> RequestSnapshot:
        params = values.get("params")
        if not isinstance(params, SamplingParams):
            try:
                params = SamplingParams.from_dict(params)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ValueError(f"{cls.record_name()}.params: {exc}") from None
        return super().from_fields({**values, "params": params})

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
