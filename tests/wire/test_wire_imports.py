"""`wire` is imported by every folder, so it imports none of them, nor torch or Ray (checked in a
fresh interpreter: this test process has them all loaded already)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("controller", "infra", "kernels", "loader", "migration", "storage", "worker")


def test_importing_wire_loads_no_other_folder_nor_torch_nor_ray():
    script = ("import sys, wire; print(sorted({m.split('.')[0] for m in sys.modules} & "
              f"{set(FOLDERS) | {'torch', 'ray'}!r}))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_importing_the_ray_gateway_backend_imports_neither_torch_nor_ray():
    """The gateway's Ray Serve backend catches the worker's errors by class; they are `wire`'s,
    so it does not import the engine (and torch) for them, and it reaches Ray only through
    `wire`'s helpers, which import Ray when called."""
    script = "import infra.ray_gateway_backend, sys; print(sorted({'torch', 'ray', 'worker'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
