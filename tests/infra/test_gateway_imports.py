"""The gateway's HTTP app does not import torch (nor Ray): it needs the request records
(`wire.SamplingParams`, `wire.GenerationChunk`), not the engine. Checked in a fresh interpreter,
since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_gateway_app_imports_neither_torch_nor_ray():
    script = "import infra.gateway_app, sys; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
