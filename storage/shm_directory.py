"""A directory in shared memory (tmpfs, normally under /dev/shm) owned by one live process.

The DRAM tier keeps checkpoints as files in tmpfs: any process on the node can read them with the
same loader it uses for the SSD, no disk involved, and the memory is the kernel's page cache, so
it survives the reading worker. But tmpfs outlives processes too: whatever a store leaves there
stays in RAM until reboot. So the directory is owned:

- its name comes from configuration (platform id + node id), so two platforms never collide;
- it is created with an owner record (pid, process start time, pid namespace, boot id) in one
  rename, and refused while a live owner holds it (two stores configured alike);
- `close()` removes it, and so does a `weakref.finalize` when the object is collected or the
  interpreter exits normally (atexit);
- a process killed outright (SIGKILL, OOM) cannot clean up, so every new owner first sweeps the
  directories under its prefix (a node store's: every Thaw platform's, ``thaw-``) whose owner
  process is gone (checked on this boot and in this pid namespace only -- a directory it cannot
  judge is left alone). A dead owner's directory serves nobody; a running worker that loaded from
  it no longer reads it;
- it is the owner's only (0700, its owner record 0600): tmpfs is shared by every user of the
  node, and what the DRAM tier keeps in it is tenants' weights.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from pathlib import Path

from loader import PRIVATE_DIR_MODE, write_private

OWNER_FILE = ".owner.json"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot): tells a reused pid apart."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after "pid (comm)" start at field 3


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner_record() -> dict[str, object]:
    """Who this process is, in terms another process on the node can check later."""
    pid = os.getpid()
    return {"pid": pid, "start_time": _process_start_time(pid), "pid_namespace": _pid_namespace(),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id")}


def owner_is_gone(owner: dict[str, object]) -> bool:
    """True only when the recorded owner is certainly dead: same boot and pid namespace as us, and
    its pid no longer runs the process that started then. Anything uncertain counts as alive."""
    if owner.get("boot_id") is None or owner.get("pid_namespace") is None or owner.get("start_time") is None:
        return False
    if owner["boot_id"] != _read_text("/proc/sys/kernel/random/boot_id"):
        return True  # the machine rebooted: no process of that boot exists (tmpfs normally empties anyway)
    if owner["pid_namespace"] != _pid_namespace() or not isinstance(owner.get("pid"), int):
        return False
    return _process_start_time(owner["pid"]) != owner["start_time"]


def _read_owner(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(root: Path, name_prefix: str) -> list[Path]:
    """Remove directories in `root` named `name_prefix`* whose owner process is gone; returns them."""
    removed = []
    for path in sorted(root.glob(f"{name_prefix}*")):
        owner = _read_owner(path) if path.is_dir() else None
        if owner is not None and owner_is_gone(owner):
            _remove(path)
            removed.append(path)
    return removed


class ShmDirectory:
    """Creates ``root/name`` for this process and removes it on `close()`, collection or exit.

    `sweep_prefix`: before creating, remove dead owners' directories starting with it (a store
    passes its platform's prefix, so a crashed predecessor's memory is reclaimed)."""

    def __init__(self, root: Path, name: str, *, sweep_prefix: str | None = None):
        if not root.is_dir():
            raise FileNotFoundError(f"shared-memory root {root} does not exist (is tmpfs mounted there?)")
        self.path = root / name
        self.swept = sweep_stale(root, sweep_prefix) if sweep_prefix else []
        if self.path.exists():
            owner = _read_owner(self.path)
            if owner is None or not owner_is_gone(owner):
                raise FileExistsError(f"{self.path} is in use (owner {owner}); two stores on one node need "
                                      f"different platform_id or node_id")
            _remove(self.path)
        tmp = root / f".{name}.tmp-{os.getpid()}"
        _remove(tmp)
        tmp.mkdir(mode=PRIVATE_DIR_MODE)
        try:
            write_private(tmp / OWNER_FILE, json.dumps(owner_record()).encode())
            os.rename(tmp, self.path)  # fails if a racing store created it first
        except BaseException:
            _remove(tmp)
            raise
        self._finalizer = weakref.finalize(self, _remove, self.path)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the directory and everything in it (idempotent)."""
        self._finalizer()
