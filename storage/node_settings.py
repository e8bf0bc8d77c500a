"""A node's own settings, given when it joins: where its SSD cache lives, what its SSD and DRAM
tiers may hold, and the memory its model instances may share (its worker memory budget).

The platform's settings (``thaw serve --ssd-capacity-gb ... --dram-capacity-gb ...``) are every
node's defaults. A machine with another disk or more memory says so when it joins (``thaw join
--ssd-dir /nvme/thaw --ssd-capacity-gb 2000 --dram-capacity-gb 96 --worker-memory-gb 64``). The
values travel in one environment variable of the node's Ray processes (`NODE_SETTINGS_ENV`, JSON),
which every actor on that node inherits from its raylet: the node store actor applies them to the
config the controller sent (`NodeSettings.apply`) and reports its tiers' capacities as always, and
the node's worker memory budget with them, so the controller places by the node's own figures and
``thaw status`` shows them. An environment
variable and not a Ray node label because a label's value cannot hold a path.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from storage.store_config import GIB, NodeStoreConfig

NODE_SETTINGS_ENV = "THAW_NODE_SETTINGS"

__all__ = ["NODE_SETTINGS_ENV", "NodeSettings"]


@dataclass(frozen=True)
class NodeSettings:
    """What one node overrides of the platform's store config; None keeps the platform's value.

    ``ssd_dir`` is the directory the node's SSD caches go under (each logical node of the machine
    in its own subdirectory, as under the platform's); capacities are bytes, and a DRAM capacity of
    0 gives the node no DRAM tier. ``worker_memory_bytes``: what the node's model instances may
    share (each logical node of the machine gets it, as with the platform's ``--worker-memory-gb``)."""

    ssd_dir: str | None = None
    ssd_capacity_bytes: int | None = None
    dram_capacity_bytes: int | None = None
    worker_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.ssd_dir is not None and (not isinstance(self.ssd_dir, str) or not Path(self.ssd_dir).is_absolute()):
            raise ValueError(f"node settings: ssd_dir must be an absolute path, got {self.ssd_dir!r}")
        for name, minimum in (("ssd_capacity_bytes", 1), ("dram_capacity_bytes", 0), ("worker_memory_bytes", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
                raise ValueError(f"node settings: {name} must be an integer >= {minimum}, got {value!r}")

    @classmethod
    def from_gb(cls, ssd_dir: str | Path | None = None, ssd_capacity_gb: float | None = None,
                dram_capacity_gb: float | None = None, worker_memory_gb: float | None = None) -> NodeSettings:
        """From a command line's units (GB as the platform's own flags count them, 2**30 bytes);
        raises `ValueError` naming the flag whose value is wrong."""
        def to_bytes(name: str, gb: float | None, minimum: float) -> int | None:
            if gb is None:
                return None
            if not math.isfinite(gb) or gb < minimum:
                raise ValueError(f"{name} must be a number of GB {'> 0' if minimum else '>= 0'}, got {gb:g}")
            return max(int(gb * GIB), 1 if minimum else 0)

        return cls(ssd_dir=None if ssd_dir is None else str(Path(ssd_dir).expanduser().absolute()),
                   ssd_capacity_bytes=to_bytes("--ssd-capacity-gb", ssd_capacity_gb, 1e-9),
                   dram_capacity_bytes=to_bytes("--dram-capacity-gb", dram_capacity_gb, 0.0),
                   worker_memory_bytes=to_bytes("--worker-memory-gb", worker_memory_gb, 1e-9))

    @property
    def empty(self) -> bool:
        return self == NodeSettings()

    def to_env(self) -> dict[str, str]:
        """The environment entry carrying these settings (none when there is nothing to override)."""
        if self.empty:
            return {}
        return {NODE_SETTINGS_ENV: json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None},
                                              sort_keys=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NodeSettings:
        """The settings `environ` carries (none: all None); raises `ValueError` for a malformed value."""
        text = environ.get(NODE_SETTINGS_ENV)
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"${NODE_SETTINGS_ENV} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"${NODE_SETTINGS_ENV} must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"${NODE_SETTINGS_ENV} has unknown field(s) {unknown}")
        return cls(**data)

    def apply(self, config: NodeStoreConfig) -> NodeStoreConfig:
        """`config` with this node's overrides: the SSD cache under ``ssd_dir``/<node id>."""
        changes: dict[str, object] = {}
        if self.ssd_dir is not None:
            changes["ssd_dir"] = Path(self.ssd_dir) / config.node_id
        if self.ssd_capacity_bytes is not None:
            changes["ssd_capacity_bytes"] = self.ssd_capacity_bytes
        if self.dram_capacity_bytes is not None:
            changes["dram_capacity_bytes"] = self.dram_capacity_bytes
        if self.worker_memory_bytes is not None:
            changes["worker_memory_bytes"] = self.worker_memory_bytes
        return dataclasses.replace(config, **changes) if changes else config
