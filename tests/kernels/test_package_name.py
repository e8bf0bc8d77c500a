"""`import kernels` is this project's package wherever it runs: Hugging Face's distribution of the
same import name (a dependency of transformers >= 5.25) shadowed it in `thaw serve` and made
transformers import ours in the tests; pyproject.toml keeps transformers below 5.25 and
infra/setup.sh refuses a venv where the name resolves elsewhere."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_other_distribution_named_kernels_is_installed():
    names = {dist.metadata["Name"].lower() for dist in importlib.metadata.distributions()}
    assert "kernels" not in names, "Hugging Face's `kernels` is installed: it shadows Thaw's kernels package"


def test_import_kernels_outside_the_repository_finds_thaws():
    out = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd="/",
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert Path(out).resolve() == REPO / "kernels" / "__init__.py"
