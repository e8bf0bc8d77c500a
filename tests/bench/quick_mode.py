"""Runs one benchmark's ``--quick`` mode and reads its one JSON line (the tests of the quick modes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {lines!r}"
    return json.loads(lines[0])
