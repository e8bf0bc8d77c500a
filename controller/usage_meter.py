"""A model's recent request count, decayed with age: the frequency in the eviction score.

One float and the time it was last brought up to date: ``value(now)`` is the sum over requests
of 2^(-age / half_life). Exponential decay keeps it O(1) in memory and update, forgets an old
burst smoothly, and needs no window to be tuned against the traffic. Pure arithmetic on the
caller's clock, so it is tested with numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class UsageMeter:
    """Decayed request count (see the module docstring); `half_life_s` > 0."""

    half_life_s: float
    _value: float = 0.0
    _at_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.half_life_s, (int, float)) or isinstance(self.half_life_s, bool) \
                or not math.isfinite(self.half_life_s) or self.half_life_s <= 0:
            raise ValueError(f"UsageMeter.half_life_s must be a finite number > 0, got {self.half_life_s!r}")

    def value(self, now: float) -> float:
        """The decayed count at `now` (a time before the last update counts as that time)."""
        if self._at_s is None:
            return 0.0
        return self._value * 2.0 ** (-max(0.0, now - self._at_s) / self.half_life_s)

    def add(self, num_requests: float, now: float) -> None:
        """Count `num_requests` requests seen at `now`."""
        if not isinstance(num_requests, (int, float)) or isinstance(num_requests, bool) \
                or not math.isfinite(num_requests) or num_requests < 0:
            raise ValueError(f"num_requests must be a finite number >= 0, got {num_requests!r}")
        if not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ValueError(f"now must be a finite number, got {now!r}")
        self._value = self.value(now) + num_requests
        self._at_s = now if self._at_s is None else max(self._at_s, now)
