"""A tenant's quota: `TenantQuota`, and the pure check the controller places by.

Two limits, each optional (None: no limit):

- ``max_instances``: model instances the tenant may have loading or ready at once, over all its
  models. The controller enforces it when it places (`instances_over_quota`): a tenant at its
  quota starts nothing more until one of its instances stops, though its instances are evicted,
  preempted and stopped as anyone's. The autoscaler still wants what it wants; placement refuses
  and says why (``thaw status``, the model's last placement).
- ``max_queued_requests``: requests the tenant may have waiting for an instance in one gateway,
  over all its models; past it a request is refused with 429 naming the quota (the model's own
  ``max_queued_requests`` in its spec still applies as well).

A typed record defined once and imported by both sides (house rule 11): the controller keeps it
in the state store and hands it to the gateway and the admin API as `to_dict`, and they read it
back with `from_dict`. A bad value raises `SpecError` naming the field, which the admin API
answers with 400 and ``param``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.model_spec import SpecError

__all__ = ["QUOTA_FIELDS", "TenantQuota", "instances_over_quota", "queued_over_quota"]

QUOTA_FIELDS = ("max_instances", "max_queued_requests")


@dataclass(frozen=True, kw_only=True)
class TenantQuota:
    """A tenant's limits (see the module docstring); the default has none."""

    max_instances: int | None = None
    max_queued_requests: int | None = None

    def __post_init__(self) -> None:
        for name in QUOTA_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise SpecError(name, f"must be an integer >= 1, or null for no limit; got {value!r}")
            object.__setattr__(self, name, int(value))

    @property
    def unlimited(self) -> bool:
        return self.max_instances is None and self.max_queued_requests is None

    def to_dict(self) -> dict[str, int | None]:
        return {"max_instances": self.max_instances, "max_queued_requests": self.max_queued_requests}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TenantQuota:
        """The quota `data` describes; a missing field is no limit, an unknown one is refused."""
        if not isinstance(data, Mapping):
            raise SpecError("quota", f"must be an object with {' and/or '.join(QUOTA_FIELDS)}, "
                                     f"got {type(data).__name__}")
        unknown = sorted(str(name) for name in data if name not in QUOTA_FIELDS)
        if unknown:
            raise SpecError(unknown[0], f"unknown quota field; the fields are {', '.join(QUOTA_FIELDS)}")
        return cls(**{name: data[name] for name in QUOTA_FIELDS if name in data})

    def updated(self, changes: Mapping[str, Any]) -> TenantQuota:
        """This quota with the fields named in `changes` replaced (None lifts that limit); the
        fields not named keep their value."""
        if not isinstance(changes, Mapping):
            return TenantQuota.from_dict(changes)  # refused, with the message from_dict gives
        return TenantQuota.from_dict({**self.to_dict(), **changes})


def instances_over_quota(tenant: str, quota: TenantQuota, num_tenant_instances: int, num_new: int = 1) -> str | None:
    """Why `num_new` more instances would break the tenant's ``max_instances`` when it has
    `num_tenant_instances` loading or ready (over all its models); None when they fit."""
    limit = quota.max_instances
    if limit is None or num_tenant_instances + num_new <= limit:
        return None
    return (f"tenant {tenant!r} has {num_tenant_instances} instances loading or ready, its quota "
            f"(max_instances {limit}); no new instance until one of them stops")


def queued_over_quota(tenant: str, quota: TenantQuota, num_tenant_queued: int) -> str | None:
    """Why one more request may not wait when the tenant has `num_tenant_queued` waiting for
    instances (over all its models, in one gateway); None when it may."""
    limit = quota.max_queued_requests
    if limit is None or num_tenant_queued < limit:
        return None
    return (f"tenant {tenant!r} has {num_tenant_queued} requests waiting for instances, its quota "
            f"(max_queued_requests {limit}); retry later")
