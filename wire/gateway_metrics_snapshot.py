"""`GatewayMetricsSnapshot`: one gateway replica's per-request series, passed to its peers.

A scrape of ``/metrics`` reaches one gateway replica (Serve's proxy picks it), but each replica
counts only the requests it served. So every replica hands the controller the text of its own
per-request series now and then and gets its peers' latest back (gateway -> controller ->
gateway); any replica's ``/metrics`` then shows every replica's series, labelled with the
replica and its node. The text is Prometheus' exposition format, which the receiving replica
parses (`prometheus_client.parser`): a record of numbers would only restate that format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from wire.wire_record import WireRecord, check_name

__all__ = ["GatewayMetricsSnapshot", "MAX_SNAPSHOT_BYTES"]

# A replica's per-request series for a few hundred models fit well within this; a larger text is
# refused at the boundary rather than copied into every peer.
MAX_SNAPSHOT_BYTES = 8 << 20


@dataclass(frozen=True)
class GatewayMetricsSnapshot(WireRecord):
    """Fields: the replica's id (unique in the platform), the logical id of the node it runs on,
    and its per-request series in Prometheus' text format (without replica labels: the receiver
    adds them)."""

    SCHEMA: ClassVar[str] = "gateway_metrics_snapshot/1"

    replica_id: str
    node_id: str
    text: str = field(repr=False)

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "replica_id", self.replica_id)
        if not isinstance(self.node_id, str):
            raise ValueError(f"{name}.node_id must be a string, got {self.node_id!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{name}.text must be a string, got {type(self.text).__name__}")
        if len(self.text) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"{name}.text is {len(self.text)} characters, over the {MAX_SNAPSHOT_BYTES} allowed")
