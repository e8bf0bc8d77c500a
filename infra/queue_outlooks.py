"""What the gateway tells a request waiting in a model's queue: `QueueOutlooks`.

While requests wait, `RayGatewayBackend` reports each model's queue to the controller about
every second, and each report is answered with a `controller.slot_outlook.SlotOutlook`: the
model is loading, or waits for a slot at some position, with an estimate and who holds the
slots. This keeps the latest answer per model until its queue empties, and turns it into what a
waiting client hears:

- the line of each `QueueProgress` (a streaming client gets it as an SSE comment);
- the reason appended to the message of a 429 (queue full) or 503 (deadline passed);
- the Retry-After hint: the estimate in whole seconds, between 1 and a cap, else a default;
- the ``cause`` label of the queue-wait metric (the outlook's status, ``unknown`` without one).

Plain bookkeeping over strings and numbers, so it is tested without a backend or a controller.
"""

from __future__ import annotations

import math

from controller import SlotOutlook
from infra.gateway_metrics import QUEUE_WAIT_CAUSES

# What a waiting request hears before the controller has answered (or when it gave no outlook).
NO_OUTLOOK_LINE = "waiting for an instance"


class QueueOutlooks:
    """The controller's last outlook per model with a waiting queue; see the module docstring."""

    def __init__(self, default_retry_after_s: float, max_retry_after_s: float) -> None:
        for name, value in (("default_retry_after_s", default_retry_after_s), ("max_retry_after_s", max_retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"QueueOutlooks {name} must be a finite number > 0, got {value!r}")
        self._default_retry_after_s = default_retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._outlooks: dict[str, SlotOutlook] = {}

    def update(self, model_id: str, outlook: SlotOutlook | None) -> None:
        """Takes the controller's answer to a report; None (no outlook to give) forgets the old
        one, which would only grow stale."""
        if isinstance(outlook, SlotOutlook):
            self._outlooks[model_id] = outlook
        else:
            self._outlooks.pop(model_id, None)

    def forget(self, model_id: str) -> None:
        """Drops the model's outlook (its queue emptied, or it was deleted)."""
        self._outlooks.pop(model_id, None)

    def get(self, model_id: str) -> SlotOutlook | None:
        return self._outlooks.get(model_id)

    def model_ids(self) -> list[str]:
        """The models with an outlook, sorted."""
        return sorted(self._outlooks)

    def progress_line(self, model_id: str) -> str:
        """The text of a `QueueProgress` for a request waiting for the model."""
        outlook = self._outlooks.get(model_id)
        return outlook.progress_line() if outlook is not None else NO_OUTLOOK_LINE

    def reason(self, model_id: str) -> str:
        """The outlook's explanation as the tail of an error message (``": ..."``), or ``""``."""
        outlook = self._outlooks.get(model_id)
        return f": {outlook.explain()}" if outlook is not None else ""

    def retry_after_s(self, model_id: str) -> float:
        """The outlook's estimate rounded up to whole seconds, at least 1 and at most the cap;
        the default hint when there is no estimate."""
        outlook = self._outlooks.get(model_id)
        if outlook is None or outlook.estimate_s is None:
            return self._default_retry_after_s
        return float(min(max(1, math.ceil(outlook.estimate_s)), self._max_retry_after_s))

    def cause(self, model_id: str) -> str:
        """Why requests for the model wait, as the queue-wait metric's label."""
        outlook = self._outlooks.get(model_id)
        return outlook.status if outlook is not None and outlook.status in QUEUE_WAIT_CAUSES else "unknown"
