"""Which partition files of a checkpoint were verified, and are still the very files verified.

Hashing every byte at every load costs as much CPU as copying it: on the 2-vCPU dev machine a
warm verified load ran at ~75% of the raw read rate, 85-90% without the hash. The hash guards
against bytes that changed since the checkpoint was written (a truncated or half-rewritten copy,
a bit flipped in transit or on the disk), and a file whose bytes were checked and that nobody has
written since cannot have changed through the filesystem. So after a load that verified a
partition, the loader records that file's version here, and a later load of the same, unchanged
file skips the hash (`LoaderConfig.trust_verified`; off re-hashes at every load).

A file's version is (device, inode, size, mtime, ctime). Any write changes mtime and ctime;
ctime cannot be set back by a user (``utime`` sets it to now); replacing the file (a new copy, a
re-conversion, a rename over it) changes the inode. One gap is closed explicitly: timestamps come
from a coarse clock (a few ms), so a write in the same tick as the previous one can leave both
unchanged (git's "racy clean" problem). A version is therefore recorded only once the file has
been still for `SETTLE_NS`; a file changed more recently is simply hashed again next time.
What this cannot see is a change below the filesystem (a bit rotting on the medium with no
write): that is the storage's own checksums' job, and `trust_verified=False` is the switch for
a paranoid load.

The record is a small JSON file in the checkpoint's directory (hidden, written to a temporary
name and renamed, so a reader sees the old or the new record, never half of one). Where the
directory is read-only the record is simply not kept: every load verifies.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from loader.format import INDEX_FILE
from loader.private_files import write_private

RECORD_FILE = ".thaw-verified.json"
RECORD_FORMAT = 1
# How long a file must have been unchanged before its version may stand for its bytes: well above
# any filesystem's timestamp granularity (1-10 ms locally; up to 1-2 s on some network mounts).
SETTLE_NS = 2_000_000_000
ClockNs = Callable[[], int]


@dataclass(frozen=True)
class FileVersion:
    """What changes whenever a file's bytes can have changed through the filesystem."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> FileVersion:
        st = os.stat(path)
        return cls(device=st.st_dev, inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns,
                   ctime_ns=st.st_ctime_ns)

    def settled(self, now_ns: int) -> bool:
        """Unchanged for at least SETTLE_NS: no write can still share its timestamps."""
        return now_ns - max(self.mtime_ns, self.ctime_ns) >= SETTLE_NS


def _read_record(ckpt_dir: Path) -> dict:
    try:
        record = json.loads((ckpt_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):  # none yet, unreadable or garbled: nothing is trusted
        return {}
    return record if isinstance(record, dict) and record.get("format") == RECORD_FORMAT else {}


def verified_files(ckpt_dir: str | Path, versions: dict[str, FileVersion]) -> set[str]:
    """The files (name -> the version the caller sees now) recorded as verified at exactly that
    version, with the index unchanged too (a re-conversion in place trusts nothing old)."""
    ckpt_dir = Path(ckpt_dir)
    record = _read_record(ckpt_dir)
    if not record:
        return set()
    try:
        if record.get("index") != asdict(FileVersion.of(ckpt_dir / INDEX_FILE)):
            return set()
    except OSError:
        return set()
    recorded = record.get("files")
    if not isinstance(recorded, dict):
        return set()
    return {name for name, version in versions.items() if recorded.get(name) == asdict(version)}


def record_verified(ckpt_dir: str | Path, versions: dict[str, FileVersion], *,
                    clock_ns: ClockNs = time.time_ns) -> list[str]:
    """Record that the files in `versions` (name -> the version seen when the load opened it) were
    verified. A file is recorded only if it is still that version and has settled; returns the
    names recorded. Never raises for an unwritable directory: the record is an optimisation."""
    ckpt_dir = Path(ckpt_dir)
    now = clock_ns()
    try:
        index_version = FileVersion.of(ckpt_dir / INDEX_FILE)
    except OSError:
        return []
    fresh = {}
    for name, version in versions.items():
        try:
            current = FileVersion.of(ckpt_dir / name)
        except OSError:
            continue
        if current == version and version.settled(now):
            fresh[name] = asdict(version)
    if not fresh:
        return []
    record = _read_record(ckpt_dir)
    files = record.get("files") if record.get("index") == asdict(index_version) else None
    files = {**(files or {}), **fresh}
    body = json.dumps({"format": RECORD_FORMAT, "index": asdict(index_version), "files": files}, sort_keys=True)
    tmp = ckpt_dir / f"{RECORD_FILE}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        write_private(tmp, body.encode())  # 0600, as every file of a cached checkpoint
        os.replace(tmp, ckpt_dir / RECORD_FILE)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return []
    return sorted(fresh)
