"""Configuration of one node's store: paths, shared-memory names, capacities, calibration sizes.

Frozen and validated on construction (no I/O: whether the paths exist is the store's business at
start). Nothing here is global: the shared-memory directory's name is derived from `platform_id`
and `node_id`, so two platforms -- or two stores of one platform simulating two nodes -- on one
machine never share a byte. The default `platform_id` is random, which is always safe; a platform
passes its own stable id so that a restarted store reclaims the memory of a crashed predecessor.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}")
_ALIGNMENT_BYTES = 4096  # calibration reads use O_DIRECT, which needs aligned sizes
SHM_DIR_PREFIX = "thaw-"
CAST_DTYPES = ("float32", "float16", "bfloat16")


def _random_platform_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class NodeStoreConfig:
    """One node's tiers. Sizes in bytes; paths must be absolute (a Ray actor's working directory
    is not the caller's)."""

    ssd_dir: Path
    ssd_capacity_bytes: int
    dram_capacity_bytes: int = 0  # 0: no DRAM tier on this node
    platform_id: str = field(default_factory=_random_platform_id)
    node_id: str = "node0"
    shm_root: Path = Path("/dev/shm")
    calibrate: bool = True
    calibration_bytes: int = 64 * MIB  # disk and DRAM probes
    repository_calibration_bytes: int = 8 * MIB  # 0: no repository probe (then the first fetch measures it)
    # Converting a model the repository holds in Hugging Face form only (a push converts it otherwise):
    convert_dtype: str | None = None  # cast Hugging Face weights on conversion; None keeps their dtype
    convert_chunk_bytes: int | None = None  # checksum/read chunk of converted checkpoints; None: the loader's default
    copy_threads: int = 4  # threads promoting a checkpoint from SSD to DRAM
    verify_fetches: bool = True  # check every downloaded file's xxh3_64 against the repository manifest
    # Repository fetches in flight at once; the rest wait in arrival order (`storage.fetch_queue`:
    # one fetch keeps the network busy, and side by side every fetch ends later).
    max_concurrent_fetches: int = 1
    # A fetch this many times smaller than one waiting or in flight goes first, pausing the long
    # one between its parts (`storage.fetch_queue`); 0: strict arrival order. 8 measured best in
    # the simulator (issue 39, `sim.node_loader.ShortFirstLoader`).
    short_fetch_ratio: float = 8.0
    # The node's own worker memory budget (`thaw join --worker-memory-gb`), which its reports carry
    # to the controller; the store itself holds no worker. None: the platform's budget.
    worker_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("ssd_dir", "shm_root"):
            value = getattr(self, name)
            if not isinstance(value, (str, Path)) or not str(value):
                raise ValueError(f"NodeStoreConfig.{name} must be a path, got {value!r}")
            path = Path(value)
            if not path.is_absolute():
                raise ValueError(f"NodeStoreConfig.{name} {str(value)!r} must be an absolute path")
            object.__setattr__(self, name, path)
        for name in ("platform_id", "node_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
                raise ValueError(f"NodeStoreConfig.{name} {value!r} must be 1-48 letters, digits, '_' or '-', "
                                 f"starting with a letter or digit (it names a shared-memory directory)")
        self._check_int("ssd_capacity_bytes", 1)
        self._check_int("dram_capacity_bytes", 0)
        self._check_int("repository_calibration_bytes", 0)
        if self.worker_memory_bytes is not None:
            self._check_int("worker_memory_bytes", 1)
        self._check_int("copy_threads", 1, 256)
        self._check_int("max_concurrent_fetches", 1, 256)
        ratio = self.short_fetch_ratio
        if (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio)
                or (ratio != 0 and ratio < 1)):
            raise ValueError(f"NodeStoreConfig.short_fetch_ratio must be 0 (arrival order) or a number >= 1, "
                             f"got {ratio!r}")
        self._check_int("calibration_bytes", _ALIGNMENT_BYTES)
        if self.calibration_bytes % _ALIGNMENT_BYTES:
            raise ValueError(f"NodeStoreConfig.calibration_bytes {self.calibration_bytes} must be a multiple of "
                             f"{_ALIGNMENT_BYTES} (the probe reads with O_DIRECT)")
        if self.convert_dtype is not None and self.convert_dtype not in CAST_DTYPES:
            raise ValueError(f"NodeStoreConfig.convert_dtype {self.convert_dtype!r} must be None or one of "
                             f"{', '.join(CAST_DTYPES)}")
        if self.convert_chunk_bytes is not None:
            self._check_int("convert_chunk_bytes", _ALIGNMENT_BYTES)
            if self.convert_chunk_bytes % _ALIGNMENT_BYTES:
                raise ValueError(f"NodeStoreConfig.convert_chunk_bytes {self.convert_chunk_bytes} must be a "
                                 f"multiple of {_ALIGNMENT_BYTES}")
        for name in ("calibrate", "verify_fetches"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NodeStoreConfig.{name} must be True or False")
        shm_dir, ssd_dir = self.shm_dir, self.ssd_dir
        if shm_dir == ssd_dir or shm_dir in ssd_dir.parents or ssd_dir in shm_dir.parents:
            raise ValueError(f"NodeStoreConfig.ssd_dir {ssd_dir} and the shared-memory dir {shm_dir} "
                             f"must not contain each other")

    def _check_int(self, name: str, low: int, high: int | None = None) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise ValueError(f"NodeStoreConfig.{name} is {value!r}; it must be an integer {bound}")

    @property
    def shm_dir_prefix(self) -> str:
        """Every shared-memory directory of this platform starts with this (and no other platform's does)."""
        return f"{SHM_DIR_PREFIX}{self.platform_id}."  # '.' is not allowed in ids: no platform's prefix is another's

    @property
    def shm_dir(self) -> Path:
        return self.shm_root / f"{self.shm_dir_prefix}{self.node_id}"
