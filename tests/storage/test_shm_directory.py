"""Owned shared-memory directories: exclusive, removed on close and on collection, and reclaimed
after a hard kill by the next owner under its prefix (a node store's covers every Thaw platform)
-- but never a directory whose owner might still be alive."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from storage.shm_directory import OWNER_FILE, ShmDirectory, owner_is_gone, owner_record, sweep_stale
from tests.storage.conftest import SESSION_PLATFORM_ID, SHM_ROOT

MODULE = Path(__file__).resolve().parents[2] / "storage" / "shm_directory.py"
WAIT_S = 30


@pytest.fixture
def prefix() -> str:
    return f"thaw-{SESSION_PLATFORM_ID}-{uuid.uuid4().hex[:6]}."


def test_created_with_owner_record_and_removed_on_close(prefix):
    shm = ShmDirectory(SHM_ROOT, prefix + "a")
    assert json.loads((shm.path / OWNER_FILE).read_text())["pid"] == os.getpid()
    # tmpfs is shared by every user of the node: the directory is the owner's only.
    assert stat.S_IMODE(shm.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((shm.path / OWNER_FILE).stat().st_mode) == 0o600
    (shm.path / "data.bin").write_bytes(b"x" * 4096)
    with pytest.raises(FileExistsError, match="in use"):
        ShmDirectory(SHM_ROOT, prefix + "a")
    shm.close()
    assert not shm.path.exists() and shm.closed
    shm.close()


def test_removed_when_the_object_is_collected(prefix):
    path = ShmDirectory(SHM_ROOT, prefix + "b").path
    gc.collect()
    assert not path.exists()


def test_missing_root_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="is tmpfs mounted there"):
        ShmDirectory(tmp_path / "nope", "x")


def test_killed_owner_is_reclaimed_by_the_next_owner_under_its_prefix(prefix, tmp_path):
    # A root of its own: node stores that other tests start meanwhile sweep /dev/shm's dead
    # directories of every platform, and would reclaim this one before the test looks.
    root = tmp_path
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import importlib.util, sys, pathlib\n"
         f"spec = importlib.util.spec_from_file_location('shm_directory', {str(MODULE)!r})\n"
         "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
         f"shm = mod.ShmDirectory(pathlib.Path({str(root)!r}), {prefix + 'dead'!r})\n"
         "(shm.path / 'weights.bin').write_bytes(b'x' * 65536)\n"
         "print('ready', flush=True)\n"
         "sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        dead_dir = root / (prefix + "dead")
        assert dead_dir.is_dir()
        assert not owner_is_gone(json.loads((dead_dir / OWNER_FILE).read_text()))  # alive: untouchable
        assert sweep_stale(root, prefix) == []
    finally:
        child.send_signal(signal.SIGKILL)  # no atexit, no finalizer: the memory stays behind
        child.wait(WAIT_S)
    assert dead_dir.is_dir()
    other_prefix = ShmDirectory(root, f"thaw-{SESSION_PLATFORM_ID}-other.n", sweep_prefix=prefix + "x")
    assert dead_dir.is_dir()  # another prefix: not its business
    other_prefix.close()
    successor = ShmDirectory(root, "thaw-another-platform.n", sweep_prefix="thaw-")
    assert successor.swept == [dead_dir] and not dead_dir.exists()  # a node store's prefix: every platform's
    successor.close()


def test_a_dead_owners_directory_of_the_same_name_is_taken_over(prefix):
    path = SHM_ROOT / (prefix + "same")
    path.mkdir()
    record = owner_record() | {"start_time": "0"}  # our pid, but not our process: a reused pid
    (path / OWNER_FILE).write_text(json.dumps(record))
    shm = ShmDirectory(SHM_ROOT, prefix + "same")
    assert json.loads((shm.path / OWNER_FILE).read_text()) == owner_record()
    shm.close()


@pytest.mark.parametrize("change, gone", [
    ({}, False),  # ourselves
    ({"start_time": "0"}, True),  # the pid now runs another process
    ({"boot_id": "another-boot"}, True),  # recorded before a reboot
    ({"pid_namespace": "pid:[1]", "start_time": "0"}, False),  # another container: cannot judge
    ({"start_time": None}, False),  # incomplete record: cannot judge
    ({"pid": 2**22 + 7}, True),  # no such process
])
def test_owner_liveness(change, gone):
    assert owner_is_gone(owner_record() | change) is gone


def test_unjudgeable_directories_are_left_alone(prefix):
    path = SHM_ROOT / (prefix + "foreign")
    path.mkdir()
    try:
        (path / OWNER_FILE).write_text(json.dumps(owner_record() | {"pid_namespace": "pid:[1]", "start_time": "0"}))
        (SHM_ROOT / (prefix + "no-owner")).mkdir()
        assert sweep_stale(SHM_ROOT, prefix) == []
    finally:
        for name in ("foreign", "no-owner"):
            shutil.rmtree(SHM_ROOT / (prefix + name), ignore_errors=True)
