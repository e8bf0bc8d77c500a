"""`MigrationReport`: the controller's answer to ``migrate`` (controller -> admin API -> CLI).

One call moves one request, or every request of an instance, to one destination; the report
names the source, the destination and its node, the method, and each request's
`MigrationOutcome`. A wire record rather than a dict, so the controller, its Ray actor, the admin
API and the CLI read the same fields (issue 40: the control plane's replies were untyped dicts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wire.migration_outcome import MigrationMethod, MigrationOutcome, MigrationStatus
from wire.wire_record import WireRecord, check_member, check_name

__all__ = ["MigrationReport"]


@dataclass(frozen=True)
class MigrationReport(WireRecord):
    """Fields:
        source_id / destination_id: the instances the requests moved between.
        node_id: the destination's node.
        method: how they were moved (`MigrationMethod`).
        outcomes: one per request asked to move, in the order they were (none: it had no request).
    """

    SCHEMA: ClassVar[str] = "migration_report/1"

    source_id: str
    destination_id: str
    node_id: str
    method: MigrationMethod
    outcomes: tuple[MigrationOutcome, ...] = ()

    def __post_init__(self) -> None:
        name = self.record_name()
        check_name(name, "source_id", self.source_id)
        check_name(name, "destination_id", self.destination_id)
        check_name(name, "node_id", self.node_id)
        object.__setattr__(self, "method", check_member(name, "method", MigrationMethod, self.method))
        if not isinstance(self.outcomes, (tuple, list)) or not all(isinstance(o, MigrationOutcome)
                                                                   for o in self.outcomes):
            raise ValueError(f"{name}.outcomes must be a list of MigrationOutcome, got {self.outcomes!r}")
        object.__setattr__(self, "outcomes", tuple(self.outcomes))

    @property
    def num_migrated(self) -> int:
        return sum(o.status is MigrationStatus.MIGRATED for o in self.outcomes)

    @property
    def stop_s_max(self) -> float:
        """The longest pause a moved request's client saw (0.0 with none)."""
        return max((o.stop_s for o in self.outcomes), default=0.0)

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> MigrationReport:
        outcomes = values.get("outcomes", ())
        if not isinstance(outcomes, (list, tuple)):
            raise ValueError(f"{cls.record_name()}.outcomes must be a list, got {type(outcomes).__name__}")
        parsed = []
        for i, item in enumerate(outcomes):
            try:
                parsed.append(item if isinstance(item, MigrationOutcome) else MigrationOutcome.from_dict(item))
            except ValueError as exc:
                raise ValueError(f"{cls.record_name()}.outcomes[{i}]: {exc}") from None
        return super().from_fields({**values, "outcomes": tuple(parsed)})
