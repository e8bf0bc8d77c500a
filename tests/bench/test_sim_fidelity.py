"""bench/sim_fidelity.py --quick runs the real platform and the simulator on one trace and prints
one JSON line with both sides' figures, their ratios and whether each is within 20%, for Thaw's
policy and keep-alive as a hard lease, and whether the simulator ranks the two as the real platform
does. No timing is asserted: only that the figures are there, that both sides saw the same
requests, and that the policies are what they say (`ranking` itself is tested with numbers in
test_sim_fidelity_ranking.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("slo_attainment", "ttft_p50_s", "ttft_p99_s", "cold_starts", "cold_starts_dram", "cold_starts_ssd", "cold_starts_repository")


@pytest.mark.slow
def test_sim_fidelity_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_fidelity.py"), "--quick",
                             "--policies", "thaw,thaw-keepalive-wait"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {lines!r}"
    line = json.loads(lines[0])
    assert line["bench"] == "sim_fidelity" and line["mode"] == "quick" and line["seed"] == 0
    for key in ("trace", "num_models", "num_slots", "first_token_deadline_s", "real", "sim", "ratio_sim_to_real",
                "within_20pct", "all_within_20pct", "profile", "profile_measured_from", "machine", "torch"):
        assert key in line, key
    peer = line["peers"]["thaw-keepalive-wait"]
    for compared in (line, peer):
        real, sim = compared["real"], compared["sim"]
        assert real["num_requests"] == sim["num_requests"] > 0  # the same trace on both sides
        # Every simulated request is served or failed by the queue timeout, as the gateway fails it.
        assert sim["num_served"] + sim["num_failed"] == sim["num_requests"]
        for side in (real, sim):
            for name in FIGURES:
                assert side[name] >= 0, name
            assert 0 <= side["slo_attainment"] <= 1
            assert side["cold_starts"] == (side["cold_starts_dram"] + side["cold_starts_ssd"]
                                           + side["cold_starts_repository"] + side["cold_starts_other"])
        assert sorted(compared["ratio_sim_to_real"]) == sorted(compared["within_20pct"]) == sorted(FIGURES)
        assert all(isinstance(v, bool) for v in compared["within_20pct"].values())
        assert compared["all_within_20pct"] == all(compared["within_20pct"].values())
    # Keep-alive as a hard lease, in both worlds: nothing is evicted or preempted.
    assert peer["real"]["evictions"] == peer["real"]["preemptions"] == 0
    assert peer["sim"]["evictions"] == peer["sim"]["preemptions"] == 0
    ranking = line["ranking"]
    assert sorted(ranking["by_figure"]) == ["slo_attainment", "ttft_p50_s", "ttft_p99_s"]
    for figure in ranking["by_figure"].values():
        [pair] = figure["pairs"]
        assert pair["pair"] == ["thaw", "thaw-keepalive-wait"] and pair["agrees"] == (pair["real"] == pair["sim"])
    assert ranking["all_agree"] == all(f["agrees"] for f in ranking["by_figure"].values())
    profile = line["profile"]
    assert profile["num_slots"] == 2 and len(profile["models"]) == line["num_models"] == 8
    assert all(timing["decode_step_s"] > 0 for timing in profile["models"].values())


def test_policies_start_with_thaw_and_name_each_known_policy_once():
    from bench.sim_fidelity import valid_policies

    assert valid_policies(("thaw",)) and valid_policies(("thaw", "thaw-keepalive-wait"))
    for bad in ((), ("thaw-keepalive-wait",), ("thaw", "thaw"), ("thaw", "rayserve")):
        assert not valid_policies(bad), bad
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_fidelity.py"), "--policies",
                             "thaw-keepalive-wait"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "--policies takes thaw, then optionally thaw-keepalive-wait" in result.stderr
