"""bench/density.py: the density rule with numbers, and its --quick mode's one JSON line (no
figure asserted: only that each policy's density follows from its attainments by the rule)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.density import max_models

ROOT = Path(__file__).resolve().parents[2]


def test_density_is_the_largest_catalog_held_on_every_seed_and_every_smaller_one():
    attainment = {8: [1.0, 0.995], 16: [0.999, 0.991], 24: [0.999, 0.98], 32: [1.0, 1.0]}
    assert max_models(attainment, 0.99) == 16  # 24 misses on a seed; 32 passing after it does not count
    assert max_models(attainment, 0.97) == 32
    assert max_models({8: [0.98], 16: [1.0]}, 0.99) == 0  # even the smallest misses


def test_density_quick_prints_one_line_whose_figures_follow_from_its_attainments():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "density.py"), "--quick", "--workers", "1"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert line["bench"] == "density" and line["mode"] == "quick" and line["threshold"] == 0.99
    assert sorted(line["policies"]) == ["rayserve", "serverlessllm", "thaw", "thaw_slot_hosts"]
    assert line["models_per_gpu"] == 8
    for policy, figures in line["policies"].items():
        attainment = {int(n): v for n, v in figures["slo_attainment"].items()}
        assert sorted(attainment) == line["grid"] and all(len(v) == len(line["seeds"]) for v in attainment.values())
        assert all(0 <= a <= 1 for v in attainment.values() for a in v)
        assert figures["max_models"] == max_models(attainment, 0.99)
        assert line["models_per_accelerator"][policy] == round(figures["max_models"] / line["accelerators"], 3)
    peer = line["models_per_accelerator"]["serverlessllm"]
    ours = line["models_per_accelerator"]["thaw_slot_hosts"]  # Thaw with its GPUs as slot hosts is "ours"
    assert line["ratio_to_serverlessllm"] == (round(ours / peer, 3) if peer else None)
    assert line["ratio_to_anchor"] == round(ours / line["anchor_models_per_gpu"], 3)
