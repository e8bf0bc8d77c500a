"""The CPU kernels' extension loads its current build without PyTorch's build lock, so a lock left
by a process killed while loading (an out-of-memory kill) no longer hangs every later worker; a
lock older than any build takes is dropped before a build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_extension
from kernels.cpu_isa import best_isa, levels

ROOT = Path(__file__).resolve().parents[2]


def test_a_current_build_loads_even_with_a_lock_left_behind(tmp_path):
    module, why = cpu_extension.try_build_cpu_extension()
    if module is None:
        pytest.skip(f"the CPU extension cannot be built here: {why}")
    lock = Path(cpu_extension._build_directory(best_isa())) / "lock"
    lock.touch()  # what a process killed inside torch's load() leaves
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from kernels.cpu_extension import try_build_cpu_extension as t; "
                                   "m, why = t(); print(m.__name__ if m else why)"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert loaded.returncode == 0 and loaded.stdout.strip() == cpu_extension.module_name(best_isa()), loaded.stderr
    finally:
        lock.unlink(missing_ok=True)


def test_only_a_lock_older_than_any_build_is_dropped(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    cpu_extension._drop_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - cpu_extension.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_extension._drop_stale_lock(tmp_path)
    assert not lock.exists()
    cpu_extension._drop_stale_lock(tmp_path)  # none: nothing to do


def test_a_build_from_other_sources_or_flags_is_not_loaded(tmp_path):
    level = best_isa()
    name = cpu_extension.module_name(level)
    assert cpu_extension._load_if_current(tmp_path, level) is None  # never built here
    (tmp_path / f"{name}.so").write_bytes(b"not a library")
    assert cpu_extension._load_if_current(tmp_path, level) is None  # no stamp: load() decides
    (tmp_path / f"{name}.stamp").write_text("made from other sources")
    assert cpu_extension._load_if_current(tmp_path, level) is None
    other = next(lv for lv in levels() if lv != level) if len(levels()) > 1 else level
    (tmp_path / f"{name}.stamp").write_text(cpu_extension._inputs_key(other))  # another level's flags
    assert other == level or cpu_extension._load_if_current(tmp_path, level) is None
