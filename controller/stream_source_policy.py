"""Which running instance a new instance streams its weights from, or why it loads from a tier.

BlitzScale's scale-out path: when a model already runs somewhere, a new instance can take its
parameters from that instance over the interconnect, layer by layer (`loader.LayerStreamSource`
/ `LayerStreamReceiver`), instead of reading them from the node's DRAM/SSD tier or the
repository. `choose_stream_source` picks the peer, and `choose_load_path` compares that with the
tier placement chose, so the controller can say which path it took and why.

Rules for a source: the same model (the bytes must be the same weights); READY with every layer
resident -- never a loading instance, nor one still receiving its own stream (it does not hold
every layer yet), nor a stopping one (it may be gone before the stream ends) -- and not on a
draining node; not saturated (its own requests would slow down, and
so would the stream: on a CPU node both compete for the cores). Among the rest: the least busy
(fewest ongoing requests: idle or decode-light first), then one on the new instance's own node
(loopback, no network hop), then the smallest instance id, so the choice is stable.

A pure function of `ManagedInstance` fields and numbers: tested with plain values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from controller.managed_instance import ManagedInstance
from wire import InstanceState

__all__ = ["LoadPath", "PeerStreamSettings", "choose_load_path", "choose_stream_source"]


@dataclass(frozen=True)
class PeerStreamSettings:
    """When and how the controller streams a new instance's weights from a running peer.

    `link_bytes_per_s`: the rate assumed for a peer stream when comparing it with the tier
    placement chose (measured here: 1.75 GB/s over loopback gloo on 2 vCPUs; NCCL between GPUs
    is far faster). `saturated_requests`: a peer with this many ongoing requests is not asked to
    stream (its requests and the stream would slow each other). `timeout_s`: longest wait for any
    step of the stream; a dead peer is given up on after this, and the new instance reads the
    node's copy instead. `chunk_bytes`: the stream's message size. `hand_over_prefills`: a
    prompt waiting on a streamed instance for a layer still on its way is finished by a fully
    loaded, unsaturated instance of the model (`controller.prefill_helper`)."""

    link_bytes_per_s: float = 1.5e9
    saturated_requests: int = 4
    timeout_s: float = 30.0
    chunk_bytes: int = 16 << 20
    hand_over_prefills: bool = True

    def __post_init__(self) -> None:
        for name in ("link_bytes_per_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"PeerStreamSettings.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.saturated_requests, int) or isinstance(self.saturated_requests, bool) \
                or self.saturated_requests < 1:
            raise ValueError(f"PeerStreamSettings.saturated_requests must be an integer >= 1, "
                             f"got {self.saturated_requests!r}")
        if not isinstance(self.hand_over_prefills, bool):
            raise ValueError(f"PeerStreamSettings.hand_over_prefills must be True or False, "
                             f"got {self.hand_over_prefills!r}")
        self.stream_config()  # chunk_bytes is checked where it is used

    def stream_config(self):
        """The `loader.StreamConfig` a source is asked to stream with (imported here: loader brings torch)."""
        from loader import StreamConfig

        try:
            return StreamConfig(timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes)
        except ValueError as exc:
            raise ValueError(f"PeerStreamSettings: {exc}") from None


def choose_stream_source(model_id: str, node_id: str, instances: Iterable[ManagedInstance],
                         draining_node_ids: Collection[str], saturated_requests: int
                         ) -> tuple[ManagedInstance | None, str]:
    """(the peer to stream from, "") or (None, why no peer can serve as a source)."""
    if not isinstance(saturated_requests, int) or isinstance(saturated_requests, bool) or saturated_requests < 1:
        raise ValueError(f"saturated_requests must be an integer >= 1, got {saturated_requests!r}")
    same = [i for i in instances if i.model_id == model_id]
    if not same:
        return None, f"no instance of {model_id} is running"
    ready = [i for i in same if i.phase is InstanceState.READY and i.node_id not in draining_node_ids]
    if not ready:
        states = sorted({i.phase.value for i in same})
        return None, f"no ready instance of {model_id} to stream from (only {', '.join(states)} ones)"
    ready = [i for i in ready if i.weights_resident]
    if not ready:
        return None, f"every ready instance of {model_id} is still receiving its own weights"
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
    estimated no slower than the tier placement chose; else the tier. The reason names both figures.

    A peer on the new instance's own node never qualifies: a CPU worker streams its node's copy of
    the checkpoint (its engine holds repacked weights, see `worker.loading.peer_weights`), which the new
    instance reads itself without the extra hop."""
    if not (isinstance(link_bytes_per_s, (int, float)) and math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
        raise ValueError(f"link_bytes_per_s must be a finite number > 0, got {link_bytes_per_s!r}")
    instances = list(instances)
    elsewhere = [i for i in instances if i.node_id != node_id]
    if len(elsewhere) < len(instances) and not any(i.model_id == model_id for i in elsewhere) \
            and any(i.model_id == model_id for i in instances):
        return LoadPath("tier", tier, tier_estimate_s, None,
                        f"{tier}: every instance of {model_id} runs on {node_id}, whose own copy it would send")
    source, why = choose_stream_source(model_id, node_id, elsewhere, draining_node_ids, saturated_requests)
    if source is None:
        return LoadPath("tier", tier, tier_estimate_s, None, f"{tier}: {why}")
    stream_s = model_bytes / link_bytes_per_s
    if stream_s > tier_estimate_s:
        return LoadPath("tier", tier, tier_estimate_s, None,
                        f"{tier} {tier_estimate_s:.3g}s beats streaming from {source.instance_id} ({stream_s:.3g}s)")
    return LoadPath("stream", tier, stream_s, source.instance_id,
                    f"stream from {source.instance_id} on {source.node_id} ({source.num_ongoing_requests} ongoing): "
                    f"{stream_s:.3g}s vs {tier} {tier_estimate_s:.3g}s; {tier} is the fallback")
