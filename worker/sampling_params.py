"""Per-request sampling settings: `SamplingParams` now lives in `wire/` (`wire.sampling_params`).

It crosses from the gateway to the workers, and the gateway must build it without importing the
engine (or torch), so it moved to the torch-free `wire` package, where every record that crosses
a process boundary is defined once. This module re-exports it, with its limits, for the worker's
own modules and for callers of ``worker.sampling_params``; ``from worker import SamplingParams``
works as before.
"""

from wire.sampling_params import (MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_SEQUENCES,
                                  MAX_STOP_TOKEN_IDS, MIN_SAMPLING_TEMPERATURE, SamplingParams)

__all__ = ["MAX_LOGIT_BIAS_TOKENS", "MAX_LOGPROBS", "MAX_STOP_CHARS", "MAX_STOP_SEQUENCES", "MAX_STOP_TOKEN_IDS",
           "MIN_SAMPLING_TEMPERATURE", "SamplingParams"]
