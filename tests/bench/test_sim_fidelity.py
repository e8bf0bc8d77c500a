"""bench/sim_fidelity.py --quick runs the real platform and the simulator on one trace and prints
one JSON line with both sides' figures, their ratios and whether each is within 20%. No timing is
asserted: only that the figures are there and that both sides saw the same requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("ttft_p50_s", "ttft_p99_s", "cold_starts", "cold_starts_dram", "cold_starts_ssd", "cold_starts_repository")


@pytest.mark.slow
def test_sim_fidelity_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_fidelity.py"), "--quick"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {lines!r}"
    line = json.loads(lines[0])
    assert line["bench"] == "sim_fidelity" and line["mode"] == "quick" and line["seed"] == 0
    for key in ("trace", "num_models", "num_slots", "first_token_deadline_s", "real", "sim", "ratio_sim_to_real",
                "within_20pct", "all_within_20pct", "profile", "profile_measured_from", "machine", "torch"):
        assert key in line, key
    real, sim = line["real"], line["sim"]
    assert real["num_requests"] == sim["num_requests"] > 0  # the same trace on both sides
    assert sim["num_served"] == sim["num_requests"]
    for side in (real, sim):
        for name in FIGURES:
            assert side[name] >= 0, name
        assert side["cold_starts"] == (side["cold_starts_dram"] + side["cold_starts_ssd"]
                                       + side["cold_starts_repository"] + side["cold_starts_other"])
    assert sorted(line["ratio_sim_to_real"]) == sorted(line["within_20pct"]) == sorted(FIGURES)
    assert all(isinstance(v, bool) for v in line["within_20pct"].values())
    assert line["all_within_20pct"] == all(line["within_20pct"].values())
    profile = line["profile"]
    assert profile["num_slots"] == 2 and len(profile["models"]) == line["num_models"] == 8
    assert all(timing["decode_step_s"] > 0 for timing in profile["models"].values())
