"""Which running instance a new instance streams its weights from, or why it loads from a tier.

BlitzScale's scale-out path: when a model already runs somewhere, a new instance can take its
parameters from that instance over the interconnect, layer by layer (`loader.LayerStreamSource`
/ `LayerStreamReceiver`), instead of reading them from the node's DRAM/SSD tier or the
repository. `choose_stream_source` picks the peer, and `choose_load_path` compares that with the
tier placement chose, so the controller can say which path it took and why.

Rules for a source: the same model (the bytes must be the same weights); READY -- never a
loading instance (it does not hold every layer yet) nor a stopping one (it may be gone before the
stream ends) -- and not on a draining node; not saturated (its own requests would slow down, and
so would the stream: on a CPU node both compete for the cores). Among the rest: the least busy
(fewest ongoing requests: idle or decode-light first), then one on the new instance's own node
(loopback, no network hop), then the smallest instance id, so the choice is stable.

A pure function of `ManagedInstance` fields and numbers: tested with plain values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from controller.managed_instance import InstancePhase, ManagedInstance

__all__ = ["LoadPath", "choose_load_path", "choose_stream_source"]


def choose_stream_source(model_id: str, node_id: str, instances: Iterable[ManagedInstance],
                         draining_node_ids: Collection[str], saturated_requests: int
                         ) -> tuple[ManagedInstance | None, str]:
    """(the peer to stream from, "") or (None, why no peer can serve as a source)."""
    if not isinstance(saturated_requests, int) or isinstance(saturated_requests, bool) or saturated_requests < 1:
        raise ValueError(f"saturated_requests must be an integer >= 1, got {saturated_requests!r}")
    same = [i for i in instances if i.model_id == model_id]
    if not same:
        return None, f"no instance of {model_id} is running"
    ready = [i for i in same if i.phase is InstancePhase.READY and i.node_id not in draining_node_ids]
    if not ready:
        states = sorted({i.phase.value for i in same})
        return None, f"no ready instance of {model_id} to stream from (only {', '.join(states)} ones)"
    calm = [i for i in ready if i.num_ongoing_requests < saturated_requests]
    if not calm:
        return None, (f"every ready instance of {model_id} is saturated (>= {saturated_requests} ongoing "
                      "requests): streaming would slow them down")
    return min(calm, key=lambda i: (i.num_ongoing_requests, i.node_id != node_id, i.instance_id)), ""


@dataclass(frozen=True)
class LoadPath:
    """How a new instance gets its weights: from `source_instance_id` or from `tier`, and why."""

    kind: str  # "stream" or "tier"
    tier: str  # the tier placement chose (the fallback when streaming fails)
    estimate_s: float
    source_instance_id: str | None
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "tier": self.tier, "estimate_s": self.estimate_s,
                "source_instance_id": self.source_instance_id, "reason": self.reason}


def choose_load_path(model_id: str, node_id: str, model_bytes: int, tier: str, tier_estimate_s: float,
                     instances: Iterable[ManagedInstance], draining_node_ids: Collection[str], *,
                     link_bytes_per_s: float, saturated_requests: int) -> LoadPath:
    """Stream from a peer when one qualifies and its transfer (`model_bytes / link_bytes_per_s`) is
    estimated no slower than the tier placement chose; else the tier. The reason names both figures."""
    if not (isinstance(link_bytes_per_s, (int, float)) and math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
        raise ValueError(f"link_bytes_per_s must be a finite number > 0, got {link_bytes_per_s!r}")
    source, why = choose_stream_source(model_id, node_id, instances, draining_node_ids, saturated_requests)
    if source is None:
        return LoadPath("tier", tier, tier_estimate_s, None, f"{tier}: {why}")
    stream_s = model_bytes / link_bytes_per_s
    if stream_s > tier_estimate_s:
        return LoadPath("tier", tier, tier_estimate_s, None,
                        f"{tier} {tier_estimate_s:.3g}s beats streaming from {source.instance_id} ({stream_s:.3g}s)")
    return LoadPath("stream", tier, stream_s, source.instance_id,
                    f"stream from {source.instance_id} on {source.node_id} ({source.num_ongoing_requests} ongoing): "
                    f"{stream_s:.3g}s vs {tier} {tier_estimate_s:.3g}s; {tier} is the fallback")
