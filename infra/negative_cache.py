"""A short-lived memory of names that were looked up and not found: `NegativeCache`.

The gateway answers a model it has cached at once, but a name it does not know costs a call
to the controller (the model may have been deployed since the last routing refresh). Without
a memory of "no", a client repeating a made-up or mistyped name — or a flood of them — turns
every request into a controller call. This remembers each "not found" for `ttl_s` seconds;
the owner forgets an entry early the moment it learns the name exists (a refresh lists the
model), so a model deployed right after a miss is not hidden for the whole TTL.

Bounded: at most `max_entries` names are kept, the oldest dropped first, so made-up names
cannot grow the gateway's memory. A TTL of 0 turns the cache off (every miss asks again).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

DEFAULT_MAX_ENTRIES = 4096


class NegativeCache:
    """Names known not to exist, each for `ttl_s` seconds of `clock` (see the module docstring)."""

    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s < 0:
            raise ValueError(f"NegativeCache ttl_s must be a finite number >= 0 (0: no caching), got {ttl_s!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"NegativeCache max_entries must be an integer >= 1, got {max_entries!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self._clock = clock
        self._expiry: OrderedDict[str, float] = OrderedDict()  # name -> forgotten at (clock), oldest first

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, name: str) -> None:
        """Remembers that `name` was not found (for `ttl_s` from now)."""
        if self.ttl_s == 0:
            return
        self._expiry.pop(name, None)
        self._expiry[name] = self._clock() + self.ttl_s
        while len(self._expiry) > self.max_entries:
            self._expiry.popitem(last=False)

    def __contains__(self, name: str) -> bool:
        """True while `name`'s "not found" is fresh; an expired entry is dropped."""
        until = self._expiry.get(name)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._expiry[name]
        return False

    def discard(self, names: Iterable[str]) -> None:
        """Forgets `names` (they exist now)."""
        if not self._expiry:
            return
        for name in names:
            self._expiry.pop(name, None)
