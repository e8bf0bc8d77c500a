"""What a model waiting for an instance can expect: `SlotOutlook`, the controller's answer to a
gateway's queue report.

The gateway reports every second while requests wait (`Controller.notify_demand`); the answer
says where the model stands (an instance loading, its place among the models waiting for a
slot, or nothing to wait for), about how long until an instance is ready, and who holds the
slots meanwhile. The gateway turns it into the SSE comment lines a waiting stream receives
(``: waiting for a slot: position 2, about 1.4 s``) and into the reason and ``Retry-After`` of
a 503/429 at the deadline, so a client learns why it waits without another controller call
on the request path.

A typed record defined once and imported by both sides (house rule 11); it pickles through
Ray as it is, and holds no prompt text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OUTLOOK_STATUSES", "SlotHolder", "SlotOutlook"]

# ready: an instance serves the model (requests wait only for room on it);
# loading: an instance of it is starting, `estimate_s` is what its load has left;
# waiting_for_slot: no slot is free; `position` among the models waiting (1 = next);
# unplaced: no node can take it now for another reason (`reason` says which).
OUTLOOK_STATUSES = ("ready", "loading", "waiting_for_slot", "unplaced")


@dataclass(frozen=True, kw_only=True)
class SlotHolder:
    """One occupied worker slot, as a waiting client is told about it.

    Fields:
        node_id / instance_id / model_id: where, which instance, of which model.
        state: the instance's phase ("ready", "loading", "stopping", "suspending").
        num_ongoing_requests: its requests at the last report.
        idle_s: seconds since it last had a request (None while busy or unknown).
    """

    node_id: str
    instance_id: str
    model_id: str
    state: str
    num_ongoing_requests: int = 0
    idle_s: float | None = None

    def describe(self, viewer_tenant: str | None = None) -> str:
        """One line; with `viewer_tenant`, a model of another tenant is not named (a client learns
        that a slot is busy, not what other tenants run)."""
        name = self.model_id
        if viewer_tenant is not None and name.partition("/")[0] != viewer_tenant:
            name = "another tenant's model"
        if self.state != "ready":
            return f"{name} ({self.state})"
        if self.num_ongoing_requests:
            return f"{name} (serving {self.num_ongoing_requests})"
        return f"{name} (idle{f' {self.idle_s:.0f}s' if self.idle_s is not None else ''})"


@dataclass(frozen=True, kw_only=True)
class SlotOutlook:
    """Where `model_id` stands; see the module docstring.

    Fields:
        model_id: the model the report was about.
        status: one of `OUTLOOK_STATUSES`.
        position: 1-based place among the models waiting for a slot (0 unless waiting_for_slot).
        estimate_s: about how long until an instance is ready (0 when ready, None when unknown).
        reason: one line a user can read: why it waits, what the controller does about it.
        holders: the slots of the nodes it could go to, and who holds them.
    """

    model_id: str
    status: str
    position: int = 0
    estimate_s: float | None = None
    reason: str = ""
    holders: tuple[SlotHolder, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in OUTLOOK_STATUSES:
            raise ValueError(f"SlotOutlook.status must be one of {OUTLOOK_STATUSES}, got {self.status!r}")
        if not isinstance(self.position, int) or isinstance(self.position, bool) or self.position < 0:
            raise ValueError(f"SlotOutlook.position must be an integer >= 0, got {self.position!r}")
        if self.estimate_s is not None and (not math.isfinite(self.estimate_s) or self.estimate_s < 0):
            raise ValueError(f"SlotOutlook.estimate_s must be None or a finite number >= 0, got {self.estimate_s!r}")
        object.__setattr__(self, "holders", tuple(self.holders))

    def progress_line(self) -> str:
        """The text of one SSE comment line for a waiting stream (no leading ``: ``)."""
        about = f", about {self.estimate_s:.1f} s" if self.estimate_s is not None else ""
        if self.status == "waiting_for_slot":
            return f"waiting for a slot: position {self.position}{about}"
        if self.status == "loading":
            return f"waiting for an instance to load{about}"
        if self.status == "ready":
            return "waiting for room on a ready instance"
        return f"waiting: {self.reason}" if self.reason else "waiting for an instance"

    def explain(self) -> str:
        """Why the model waits, with who holds the slots: for a 503/429 body and the logs. Only
        the waiting model's own tenant's models are named (the client is of that tenant)."""
        tenant = self.model_id.partition("/")[0]
        held = "; ".join(h.describe(tenant) for h in self.holders)
        parts = [self.reason or self.progress_line()]
        if held:
            parts.append(f"slots held by {held}")
        if self.estimate_s is not None:
            parts.append(f"estimated {self.estimate_s:.1f} s until an instance is ready")
        return "; ".join(parts)
