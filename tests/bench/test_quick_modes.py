"""The ``--quick`` modes of the benchmarks that start a platform, Ray, or a long trace (marked
slow: the suite runs them one after another, `tests/conftest.py`); the engine- and kernel-level
ones are in `test_engine_quick_modes.py`. Each runs and prints its one JSON line (so benchmarks
never rot). No timing is asserted: only that the figures are there, positive, and consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.quick_mode import ROOT, run_quick


@pytest.mark.slow
def test_engine_benchmark_quick():
    figures = run_quick("engine.py")
    assert figures["bench"] == "engine" and figures["mode"] == "quick"
    for key in ("thaw_tokens_per_s", "transformers_tokens_per_s", "thaw_batch1_ms_per_token",
                "transformers_batch1_ms_per_token"):
        assert figures[key] > 0, key
    assert figures["throughput_ratio"] == pytest.approx(
        figures["thaw_tokens_per_s"] / figures["transformers_tokens_per_s"], rel=0.02)
    assert figures["outputs_match"].split("/")[0] == figures["outputs_match"].split("/")[1]


@pytest.mark.slow
def test_loader_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "loader.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    by_name = {(line["loader"], line.get("state")): line for line in lines}
    for name in ("limit-read", "thaw", "thaw-fresh-process", "safetensors", "torch.load-mmap"):
        for state in ("cold", "warm"):
            line = by_name[(name, state)]
            assert line["gbps"] > 0, line
    assert by_name[("thaw", "cold")]["ratio_to_limit"] > 0
    for peer in ("runai-model-streamer", "tensorizer", "fastsafetensors"):
        assert any(line["loader"] == peer for line in lines)  # measured, or a line saying why not


@pytest.mark.slow
def test_coldstart_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "coldstart.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line["case"]: line for line in map(json.loads, result.stdout.splitlines()) if line}
    assert sorted(lines) == sorted(["thaw-repository", "thaw-ssd", "thaw-dram", "thaw-warm", "serve-default",
                                    "serve-tuned", "serve-warm"])
    tuned_s = lines["serve-tuned"]["ttft_s"]
    import torch

    from kernels.cpu_linear import cpu_prepack_unavailable_reason

    bf16_packs = cpu_prepack_unavailable_reason(torch.bfloat16, torch.device("cpu")) is None
    for case, line in lines.items():
        assert line["bench"] == "coldstart" and line["mode"] == "quick" and line["ttft_s"] > 0, case
        assert line["baseline_ttft_s"] == tuned_s
        assert line["ratio_to_tuned"] == pytest.approx(tuned_s / line["ttft_s"], rel=0.02), case
    for case in ("thaw-repository", "thaw-ssd", "thaw-dram"):
        # Every cold start was served by a warm spare worker, from the tier the store put it in.
        assert lines[case]["from_spare"] == [True] and lines[case]["loaded_from"][0] in ("dram", "ssd"), case
        assert lines[case]["load_s"][0] > 0
        # The start's packing is reported (the quick model is small: packed at load, inside load_s,
        # where this CPU packs bf16 at all).
        assert 0 <= lines[case]["pack_s"][0] <= lines[case]["load_s"][0], case
        assert (lines[case]["pack_s"][0] > 0) == bf16_packs, case
    assert lines["thaw-dram"]["target_ratio"] == 15.0 and lines["thaw-ssd"]["target_ratio"] == 5.0
    ssd = lines["thaw-ssd"]  # the SSD floor: the disk's read of the checkpoint, measured in the run, + a warm token
    assert ssd["disk_gb_per_s"] > 0 and ssd["floor_s"] > lines["thaw-warm"]["ttft_s"]
    assert ssd["ratio_to_floor"] == pytest.approx(ssd["ttft_s"] / ssd["floor_s"], rel=0.02)


@pytest.mark.slow
def test_scaleout_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "scaleout.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line["case"]: line for line in map(json.loads, result.stdout.splitlines()) if line}
    assert set(lines) == {"ssd", "stream", "zigzag", "multicast-1", "multicast-3"}
    for case in ("ssd", "stream", "zigzag"):
        line = lines[case]
        assert line["mean_ttft_s"] > 0 and len(line["ttft_s"][0]) == line["requests"]
        assert line["ratio_to_ssd"] == pytest.approx(line["mean_ttft_s"] / lines["ssd"]["mean_ttft_s"], rel=0.01)
    assert isinstance(lines["zigzag"]["target_met"], bool)
    assert lines["multicast-1"]["link_gbps"] > 0
    assert lines["multicast-3"]["ratio_to_single"] == pytest.approx(
        lines["multicast-3"]["total_s"] / lines["multicast-1"]["total_s"], rel=0.01)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multimodel_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "multimodel.py"), "--quick"],
                            capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line["policy"]: line for line in map(json.loads, result.stdout.splitlines()) if line}
    assert sorted(lines) == sorted(["thaw", "thaw-shared", "thaw-keepalive-wait", "rayserve"])
    num_requests = lines["thaw"]["num_requests"]
    assert num_requests > 0
    for policy, line in lines.items():
        assert line["bench"] == "multimodel" and line["mode"] == "quick" and line["trace"] and line["seed"] == 0, policy
        # The same seeded trace for every policy.
        assert line["num_requests"] == num_requests, policy
        assert line["requests_per_model"] == lines["thaw"]["requests_per_model"], policy
        assert 0 <= line["num_failed"] <= num_requests and sum(line["failures"].values()) == line["num_failed"]
        assert 0 <= line["ttft_p50_s"] <= line["ttft_p99_s"], policy
        assert line["idle_slot_s"] >= 0 and line["duration_s"] > 0, policy
        tiers = line["cold_starts_by_tier"]
        assert isinstance(tiers, dict) and sum(tiers.values()) > 0 and min(tiers.values()) > 0, policy
    thaw = lines["thaw"]
    for key, peer in (("keepalive_wait", "thaw-keepalive-wait"), ("rayserve", "rayserve")):
        assert thaw[f"p99_ratio_to_{key}"] == pytest.approx(thaw["ttft_p99_s"] / lines[peer]["ttft_p99_s"], rel=0.01)
    assert isinstance(thaw["targets_met"], bool)
    # Memory as the slot: the budget holds every model, so nothing is evicted or preempted.
    shared = lines["thaw-shared"]
    assert shared["slot_sharing"]["evictions"] == 0 and shared["slot_sharing"]["preemptions_suspended"] == 0
    memory = shared["worker_memory"]
    assert 0 < memory["max_used_bytes"] <= memory["budget_bytes"] and lines["thaw"]["worker_memory"]["budget_bytes"] is None
    assert shared["p99_ratio_to_thaw"] == pytest.approx(shared["ttft_p99_s"] / thaw["ttft_p99_s"], rel=0.01)
    assert shared["target_ttft_p99_s"] == pytest.approx(12.1 / 4) and isinstance(shared["targets_met"], bool)
    # Every answered request's greedy tokens are the engine's run directly (near ties aside).
    for policy in ("thaw", "thaw-shared", "thaw-keepalive-wait"):
        greedy = lines[policy]["greedy"]
        assert greedy["differs"] == 0 and greedy["num_checked"] == num_requests - lines[policy]["num_failed"], policy
    assert "greedy" not in lines["rayserve"]  # its replica gives no token texts
    estimates = thaw["wait_estimates"]  # what waiting streams were told, against what came
    assert estimates["num"] >= 0 and lines["rayserve"]["wait_estimates"] == {"num": 0}  # Serve tells nothing
    if estimates["num"]:
        assert 0 <= estimates["ratio_p10"] <= estimates["ratio_median"] <= estimates["ratio_p90"]
        assert 0 <= estimates["abs_error_median"] <= estimates["abs_error_p90"]


@pytest.mark.slow
def test_deploy_benchmark_quick():
    figures = run_quick("deploy.py")
    assert figures["bench"] == "deploy" and figures["mode"] == "quick" and figures["model_bytes"] > 1_000_000
    for key in ("send_s", "deploy_s", "first_token_s", "floor_s", "floor_copy_bytes_per_s"):
        assert figures[key] > 0, key
    assert figures["total_s"] == pytest.approx(figures["send_s"] + figures["deploy_s"], abs=0.02)
    assert figures["ratio_to_floor"] == pytest.approx(figures["total_s"] / figures["floor_s"], rel=0.05)
    assert "checking" in figures["stages_s"]


# Serial (slow): its request must still be running when the migration starts, which a loaded
# core can delay past the quick mode's 256 tokens (seen when it ran beside the end-to-end tests).
@pytest.mark.slow
def test_migration_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "migration.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    # One line per (method, context length); every migrated client got exactly the unmigrated output.
    assert sorted((line["method"], line["context_tokens"]) for line in lines) == sorted(
        (method, length) for method in ("tokens", "kv", "restart") for length in (16, 64))
    for line in lines:
        assert line["bench"] == "migration" and line["mode"] == "quick"
        assert line["output_matches"] is True, line
        assert line["pause_ms"] > 0 and line["normal_gap_ms"] > 0
        assert line["ratio_to_normal_gap"] == pytest.approx(line["pause_ms"] / line["normal_gap_ms"], rel=0.02)
    kv = [line for line in lines if line["method"] == "kv"]
    assert all(line["blocks_copied"][0] > 0 and line["tokens_recomputed_after_stop"] == [0] for line in kv)
