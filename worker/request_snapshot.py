"""Everything another engine needs to continue a request exactly where this one stands.

A live migration (see `migration/`) moves a generating request between instances of the same
model. The snapshot is the request's state without its KV cache: the KV either travels
separately as blocks (Llumnix-style) or is recomputed from these tokens (ServerlessLLM-style).

What continuing *exactly* takes, and where it is in here:

* the tokens: prompt and output so far; the destination's next step starts from them;
* how far the KV cache has caught up (``num_computed_tokens``): KV for positions
  ``[0, num_computed_tokens)`` exists on the source, so that many tokens of KV are worth copying;
* the sampler's random stream: the request's ``torch.Generator`` state, so seeded (and
  unseeded) sampling draws the very numbers it would have drawn on the source;
* the text already streamed: not stored as text. The detokenizer is deterministic in the token
  ids, so the destination rebuilds its state (the held-back bytes of an incomplete character,
  the held-back prefix of a stop string, the decode window) by replaying the output ids without
  emitting them. Text deltas then continue with no character lost or repeated;
* the weights it was computed with (``checkpoint_id``): KV and tokens of one version of a model
  are not continued by another (`worker.engine_migration.begin_import` refuses them).

Every output token in a snapshot has already been delivered to the engine's caller: the engine
emits each token in the step that samples it. The snapshot is engine-agnostic data (ids, params,
bytes), so it pickles across processes; it prints without its token ids (logs never carry
prompts or completions).

This lives in `worker/` because the engine both produces and consumes it
(`worker/engine_migration.py`); `migration/` moves it around.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    output_token_ids: tuple[int, ...] = field(repr=False)
    params: SamplingParams = field(repr=False)
    # KV exists for positions [0, num_computed_tokens) on the engine that took the snapshot.
    num_computed_tokens: int
    # torch.Generator.get_state() as bytes; None: none to carry over (e.g. rebuilt from a client's
    # transcript), and the destination seeds a fresh generator from ``params.seed``.
    generator_state: bytes | None = field(default=None, repr=False)
    # "cpu" or "cuda": a generator's state only fits a generator of the same device type.
    generator_device_type: str = "cpu"
    # The checkpoint it was taken on (`worker.checkpoint_identity`), which a destination compares
    # with its own; None: not known (a request rebuilt from its client's transcript).
    checkpoint_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not self.prompt_token_ids:
            raise ValueError("a snapshot needs a non-empty prompt")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if not 0 <= self.num_computed_tokens < self.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be in [0, {self.num_tokens}) (the last token's KV is computed by the "
                f"next step), got {self.num_computed_tokens}"
            )
        if self.checkpoint_id is not None and (not isinstance(self.checkpoint_id, str) or not self.checkpoint_id):
            raise ValueError(f"checkpoint_id must be None or a non-empty string, got {self.checkpoint_id!r}")
        if self.generator_device_type not in ("cpu", "cuda"):
            raise ValueError(f"generator_device_type must be 'cpu' or 'cuda', got {self.generator_device_type!r}")

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
