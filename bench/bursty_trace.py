"""A seeded bursty multi-model workload for bench/multimodel.py: `bursty_trace`.

Zipf popularity over the models (ranks shuffled by the seed, so a model's size and its popularity
are unrelated), each model alternating between on and off bursts of exponential length, Poisson
arrivals within its on bursts, scaled so all models together average `mean_rate_per_s`. Every
request is a short prompt of random token ids with a fixed ``max_tokens``. A pure function of its
config and seed: one stream of random numbers per model, so adding a model moves no other's
requests. (The public traces under shared/traces have no request rows for many named models;
a seeded generator with their shape is what a replay of the same workload on three systems needs.)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["BurstyTraceConfig", "TraceRequest", "bursty_trace", "popularity"]


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace; the prompt stays out of its repr (logs must not carry prompts)."""

    arrival_s: float
    model_index: int
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    max_tokens: int


@dataclass(frozen=True)
class BurstyTraceConfig:
    """A bursty multi-model workload: Zipf popularity over `num_models`, on/off bursts per model
    (exponential lengths, means `mean_on_s`/`mean_off_s`), Poisson arrivals within a burst, so that
    the long-run rate of all models together is `mean_rate_per_s`."""

    num_models: int
    duration_s: float
    mean_rate_per_s: float
    mean_on_s: float
    mean_off_s: float
    zipf_s: float = 1.1
    min_prompt_tokens: int = 8
    max_prompt_tokens: int = 32
    max_tokens: int = 16
    max_token_id: int = 1000  # prompt ids are drawn from [3, max_token_id): the demo tokenizer's ordinary ids

    def __post_init__(self) -> None:
        if not isinstance(self.num_models, int) or self.num_models < 1:
            raise ValueError(f"BurstyTraceConfig.num_models must be an integer >= 1, got {self.num_models!r}")
        for name in ("duration_s", "mean_rate_per_s", "mean_on_s", "mean_off_s", "zipf_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"BurstyTraceConfig.{name} must be a number > 0, got {value!r}")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(f"BurstyTraceConfig needs 1 <= min_prompt_tokens <= max_prompt_tokens, got "
                             f"{self.min_prompt_tokens}..{self.max_prompt_tokens}")
        if self.max_tokens < 1 or self.max_token_id <= 3:
            raise ValueError("BurstyTraceConfig.max_tokens must be >= 1 and max_token_id > 3")

    def describe(self) -> str:
        return (f"synthetic: Zipf s={self.zipf_s:g} popularity over {self.num_models} models, on/off bursts "
                f"(exponential, means {self.mean_on_s:g} s on / {self.mean_off_s:g} s off), Poisson arrivals "
                f"in bursts, {self.mean_rate_per_s:g} req/s on average over {self.duration_s:g} s")


def popularity(config: BurstyTraceConfig, seed: int) -> list[float]:
    """Each model's share of the requests: Zipf over ranks, the ranks shuffled by `seed`."""
    weights = [1.0 / (rank + 1) ** config.zipf_s for rank in range(config.num_models)]
    total = sum(weights)
    ranks = list(range(config.num_models))
    random.Random(f"{seed}/ranks").shuffle(ranks)
    return [weights[ranks[model]] / total for model in range(config.num_models)]


def bursty_trace(config: BurstyTraceConfig, seed: int) -> list[TraceRequest]:
    """The trace, sorted by arrival; a pure function of `config` and `seed`."""
    duty = config.mean_on_s / (config.mean_on_s + config.mean_off_s)
    requests = []
    for model, share in enumerate(popularity(config, seed)):
        rng = random.Random(f"{seed}/model{model}")  # one stream per model: adding one moves no other
        rate_on = config.mean_rate_per_s * share / duty  # so the long-run rate is share * mean rate
        on = rng.random() < duty
        t = 0.0
        while t < config.duration_s:
            mean_s = config.mean_on_s if on else config.mean_off_s
            period_end = min(config.duration_s, t + rng.expovariate(1.0 / mean_s))
            if on:
                arrival = t + rng.expovariate(rate_on)
                while arrival < period_end:
                    length = rng.randint(config.min_prompt_tokens, config.max_prompt_tokens)
                    prompt = tuple(rng.randrange(3, config.max_token_id) for _ in range(length))
                    requests.append(TraceRequest(round(arrival, 6), model, prompt, config.max_tokens))
                    arrival += rng.expovariate(rate_on)
            t, on = period_end, not on
    return sorted(requests, key=lambda r: (r.arrival_s, r.model_index))
