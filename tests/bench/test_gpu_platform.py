"""`bench/gpu_platform.py` without a GPU: the budget arithmetic (which models fit), the JSON line
and its checks from given figures, what a try was (a wake, a new instance), the commands and
specs it starts the platform with, the dry run, the random checkpoints it writes
(`bench.random_llama`, read back exactly), and -- slow -- its ``--quick`` run end to end on the
CPU: real Ray, the real platform, the real openai client."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_platform import GIB, main, model_spec, plan_budget, result_line, sequence_checks, serve_command
from bench.gpu_platform_alternation import big_instance, describe_try
from bench.gpu_platform_setup import ASLEEP, COLD, DRAM, FILL, FULL, QUICK, SETUP, SMALL
from bench.random_llama import (is_published, num_weight_bytes, publish_random_llama, random_block, tile_offset,
                                write_random_llama)
from worker.models.demo_model import DemoModelConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, vocab_size=1200, tie_word_embeddings=True, max_position_embeddings=256,
                       dtype="bfloat16", seed=5)


# ---- the budget --------------------------------------------------------------------------------


def test_the_issue_shapes_have_their_parameter_counts():
    assert num_weight_bytes(FULL.big) == 2 * 8_030_261_248  # Llama-3-8B
    assert num_weight_bytes(FULL.small) == 2 * 1_235_814_400  # Llama-3.2-1B, tied embeddings


def test_the_gpu_budget_holds_the_8b_and_two_1bs_not_three():
    plan = plan_budget(num_weight_bytes(FULL.big), num_weight_bytes(FULL.small), FULL.kv_cache_bytes, 4)
    assert (plan.big_instance_bytes, plan.small_instance_bytes) == (16_597_393_408, 3_008_499_712)
    assert plan.budget_bytes == 16_597_393_408 + 2 * 3_008_499_712 + 3_008_499_712 // 2 == 24_118_642_688
    assert plan.budget_gb == "22.462236404"
    assert [plan.fits(1, n) for n in range(5)] == [True, True, True, False, False]
    assert plan.fits(0, 4)  # the four 1Bs alone fit: only the 8B beside them does not
    assert plan.num_small_beside_big == 2
    assert plan.lines() == [
        "8B instance: 16,597,393,408 B; 1B instance: 3,008,499,712 B (checkpoint + KV pool each)",
        "budget 24,118,642,688 B = 22.462236404 GiB",
        "8B + 2 x 1B = 22,614,392,832 B fits; 8B + 3 x 1B = 25,622,892,544 B does not; all five = "
        "28,631,392,256 B do not"]


def test_the_budget_survives_the_flags_rounding():
    """``--gpu-memory-gb`` / ``--worker-memory-gb`` take GiB as a float and keep int(gb * GiB)."""
    for big, small, kv in ((16_060_522_496, 2_471_628_800, 512 << 20), (9_835_437, 1_869_145, 1 << 20),
                           (7, 3, 1)):
        plan = plan_budget(big, small, kv, 4)
        flagged = dataclasses.replace(plan, budget_bytes=int(float(plan.budget_gb) * GIB))
        assert (flagged.fits(1, 2), flagged.fits(1, 3)) == (True, False), (big, small, kv)


def test_a_budget_that_would_hold_every_model_is_refused():
    with pytest.raises(ValueError, match="with 2 small models beside room for 2, all would fit"):
        plan_budget(100, 10, 1, 2)


# ---- the line and its checks -------------------------------------------------------------------


def _try(phase: str, ttft_s: float | None, failure: str | None = None, **extra) -> dict:
    return {"phase": phase, "ttft_s": ttft_s, "failure": failure, **extra}


TRIES = [_try(COLD, 4.0, host_was_empty=True, new_instance=True, load_s=3.0), _try(SMALL, 1.0), _try(SMALL, 3.0),
         _try(SETUP, 0.9), _try(ASLEEP, 0.30, woke=True), _try(ASLEEP, 0.20, woke=True), _try(ASLEEP, 0.40, woke=True),
         _try(FILL, None, "no-output"), _try(DRAM, 0.5, new_instance=True, placed_tier="dram", load_s=0.4),
         _try(DRAM, 0.7, new_instance=True, placed_tier="ssd", tier="dram", load_s=0.5),
         _try(DRAM, 0.55, new_instance=True, placed_tier="dram", load_s=0.45)]
COUNTS = {"sleeps": 4, "wakes": 3, "evictions": 2, "preemptions_migrated": 0}


def test_the_line_has_each_case_its_targets_and_ratios():
    plan = plan_budget(1000, 100, 10, 4)
    checks = {"every_request_succeeded": True, "other": True}
    line = result_line("full", "NVIDIA H200, 143771 MiB", plan, TRIES, COUNTS, checks, on_gpu=True)
    assert {k: line[k] for k in ("asleep_ttft_s", "asleep_ttft_min_s", "asleep_ttft_all_s", "dram_ttft_s",
                                 "dram_ttft_min_s", "dram_ttft_all_s", "cold_fresh_host_ttft_s",
                                 "cold_fresh_host_ttft_all_s", "small_ttft_s")} == {
        "asleep_ttft_s": 0.3, "asleep_ttft_min_s": 0.2, "asleep_ttft_all_s": [0.3, 0.2, 0.4], "dram_ttft_s": 0.55,
        "dram_ttft_min_s": 0.5, "dram_ttft_all_s": [0.5, 0.7, 0.55], "cold_fresh_host_ttft_s": 4.0,
        "cold_fresh_host_ttft_all_s": [4.0], "small_ttft_s": 2.0}
    assert (line["dram_load_s"], line["dram_load_all_s"], line["cold_fresh_host_load_s"]) == (
        0.45, [0.4, 0.5, 0.45], 3.0)
    assert (line["target_asleep_s"], line["target_dram_s"], line["peer_dram_load_s"]) == (0.35, 0.6, 0.678)
    assert (line["ratio_asleep_to_target"], line["ratio_dram_to_target"], line["ratio_dram_to_peer"],
            line["ratio_dram_load_to_peer"]) == (0.857, 0.917, 0.811, 0.664)
    assert line["peer"].startswith("ServerlessLLM: 0.678 s for Llama-3.1-8B's load alone on an H100 (reported")
    assert (line["num_requests"], line["num_failed"], line["failures"]) == (11, 1, {"no-output": 1})
    assert (line["sleeps"], line["wakes"], line["evictions"]) == (4, 3, 2)
    assert (line["budget_bytes"], line["budget_gb"], line["num_small_beside_big"]) == (1285, "0.000001197", 2)
    assert line["device"] == "NVIDIA H200, 143771 MiB" and line["targets_met"] is True
    assert line["summary"] == {"case": "8B first token: asleep / DRAM tier / cold in a fresh host",
                               "ours": "0.300 s / 0.550 s / 4.000 s",
                               "peer": "targets 0.35 / 0.6 s; ServerlessLLM load 0.678 s (reported)",
                               "ratio": 0.811, "target_met": True}
    json.dumps(line)  # one JSON line


def test_targets_are_judged_only_on_a_gpu_and_only_when_every_check_holds():
    plan = plan_budget(1000, 100, 10, 4)
    assert result_line("quick", "cpu", plan, TRIES, COUNTS, {"a": True}, on_gpu=False)["targets_met"] is None
    assert result_line("full", "gpu", plan, TRIES, COUNTS, {"a": True, "b": False}, on_gpu=True)["targets_met"] is False
    slow = [t if t["phase"] != ASLEEP else {**t, "ttft_s": t["ttft_s"] + 0.1} for t in TRIES]  # median 0.40
    assert result_line("full", "gpu", plan, slow, COUNTS, {"a": True}, on_gpu=True)["targets_met"] is False
    empty = result_line("full", "gpu", plan, [], {}, {}, on_gpu=True)
    assert (empty["asleep_ttft_s"], empty["ratio_dram_to_peer"], empty["targets_met"]) == (None, None, False)
    assert empty["summary"]["ours"] == "— / — / —"


def test_the_sequence_checks_name_what_the_run_did_not_show():
    assert sequence_checks(TRIES, COUNTS, 3) == {
        "every_request_succeeded": False, "slept_woke_evicted": True, "cold_try_in_a_fresh_host": True,
        "asleep_tries_were_wakes": True, "dram_tries_loaded_from_dram": True}
    answered = [t for t in TRIES if t["failure"] is None]
    assert all(sequence_checks(answered, COUNTS, 3).values())
    assert not sequence_checks(answered, COUNTS, 4)["asleep_tries_were_wakes"]  # too few tries
    reloaded = [t if t["phase"] != ASLEEP else {**t, "woke": False} for t in answered]
    assert not sequence_checks(reloaded, COUNTS, 3)["asleep_tries_were_wakes"]
    from_ssd = [t if t["phase"] != DRAM else {**t, "placed_tier": "ssd", "tier": "ssd"} for t in answered]
    assert not sequence_checks(from_ssd, COUNTS, 3)["dram_tries_loaded_from_dram"]
    assert not sequence_checks(answered, {**COUNTS, "evictions": 0}, 3)["slept_woke_evicted"]


def test_a_try_is_a_wake_only_of_the_same_instance_with_the_counter_moved():
    asleep = {"instance_id": "m-1", "state": "asleep"}
    ready = {"instance_id": "m-1", "state": "ready", "tier": "dram", "load_s": 0.4}
    fresh = {"instance_id": "m-2", "state": "ready", "tier": "dram", "load_s": 0.3}
    assert describe_try(asleep, ready, True, None) == {
        "instance_id": "m-1", "state_before": "asleep", "woke": True, "new_instance": False, "placed_tier": None,
        "tier": None, "load_s": None}
    assert describe_try(asleep, ready, False, None)["woke"] is False  # no wake counted: not a wake
    assert describe_try(asleep, fresh, True, "dram") == {
        "instance_id": "m-2", "state_before": "asleep", "woke": False, "new_instance": True, "placed_tier": "dram",
        "tier": "dram", "load_s": 0.3}
    assert describe_try(None, fresh, False, "repository")["placed_tier"] == "repository"
    assert describe_try(ready, None, False, None) == {
        "instance_id": None, "state_before": "ready", "woke": False, "new_instance": False, "placed_tier": None,
        "tier": None, "load_s": None}


def test_a_stopping_instance_is_not_the_models_instance():
    status = {"instances": [{"instance_id": "a-1", "model_id": "bench/a", "state": "stopping"},
                            {"instance_id": "b-1", "model_id": "bench/b", "state": "ready"},
                            {"instance_id": "a-2", "model_id": "bench/a", "state": "loading"}]}
    assert big_instance(status, "bench/a")["instance_id"] == "a-2"
    assert big_instance({"instances": status["instances"][:2]}, "bench/a") is None


# ---- what it starts --------------------------------------------------------------------------------


def test_the_platform_command_and_specs():
    plan = plan_budget(1000, 100, 10, 4)
    gpu = serve_command(True, plan, 8123, Path("/s"), Path("/dev/shm/r"), 28.0, 27.0, "ns")
    assert gpu[1:] == ["-m", "infra.cli", "serve", "--no-auth", "--port", "8123", "--namespace", "ns", "--state", "/s",
                       "--repository", "/dev/shm/r", "--ssd-capacity-gb", "28", "--dram-capacity-gb", "27",
                       "--no-calibrate", "--models-per-process", "5", "--gpu-memory-gb", "0.000001197"]
    cpu = serve_command(False, plan, 8123, Path("/s"), Path("/r"), 2.0, 2.0, "ns")
    assert cpu[-6:] == ["--worker-memory-gb", "0.000001197", "--worker-slots", "5", "--num-cpus", "2"]
    assert "--gpu-memory-gb" not in cpu
    assert model_spec("llama3-8b", Path("/dev/shm/r"), FULL, True, 8.0) == {
        "tenant": "bench", "name": "llama3-8b", "source": "/dev/shm/r/llama3-8b", "kv_cache_bytes": 512 << 20,
        "resources": {"num_cpus": 1, "num_gpus": 1},
        "autoscaling": {"min_instances": 0, "max_instances": 1, "keep_alive_s": 8.0, "upscale_delay_s": 0.0,
                        "downscale_delay_s": 0.0, "queue_timeout_s": 300.0}}
    assert model_spec("x", Path("/r"), QUICK, False, 600.0)["resources"] == {"num_cpus": 1, "num_gpus": 0}


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    model_dir = tmp_path / "models"
    assert main(["--dry-run", "--model-dir", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "  8B + 2 x 1B = 22,614,392,832 B fits; 8B + 3 x 1B = 25,622,892,544 B does not; all five = " \
           "28,631,392,256 B do not\n" in out
    assert "  llama3-8b: 16,060,522,496 B; llama32-1b-0, llama32-1b-1, llama32-1b-2, llama32-1b-3: " \
           "2,471,628,800 B each; total 25.95 GB\n" in out
    platform = next(line for line in out.splitlines() if line.startswith("platform: "))
    assert "--models-per-process 5 --gpu-memory-gb 22.462236404" in platform
    assert f"--repository {model_dir / 'repository'} " in platform
    deploys = [json.loads(line[len("deploy: "):]) for line in out.splitlines() if line.startswith("deploy: ")]
    assert [(d["name"], d["resources"]["num_gpus"], d["autoscaling"]["keep_alive_s"]) for d in deploys] == [
        ("llama3-8b", 1, 8.0), *((f"llama32-1b-{i}", 1, 600.0) for i in range(4))]
    assert not model_dir.exists()


def test_without_cuda_the_full_run_is_one_skipped_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--model-dir", str(tmp_path / "models")]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "bench": "gpu_platform", "mode": "full",
        "skipped": "no CUDA device: the platform's GPU run needs one (--quick runs the same sequence on the CPU)"}
    assert not (tmp_path / "models").exists()


def test_the_full_shapes_are_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu"])
    assert exc.value.code == 2
    assert "the full shapes need a GPU (an 8B model on CPU cores); use --quick on a CPU" in capsys.readouterr().err


# ---- the random checkpoints ------------------------------------------------------------------------


def test_a_random_llama_reads_back_exactly(tmp_path):
    import torch
    from safetensors import safe_open

    from worker import ModelConfig

    out = write_random_llama(tmp_path / "m", TINY)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim",
                                   "max_position_embeddings", "torch_dtype")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 1200, "tie_word_embeddings": True, "head_dim": 16,
        "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
    assert ModelConfig.from_model_dir(out).vocab_size == 1200  # what the engine reads
    block = torch.frombuffer(bytearray(random_block(TINY, 1200 * 64)), dtype=torch.bfloat16)  # the largest tensor
    data = (out / "model.safetensors").read_bytes()
    header_bytes = int.from_bytes(data[:8], "little")
    order = [name for name in json.loads(data[8:8 + header_bytes]) if name != "__metadata__"]  # as written
    assert len(data) == 8 + header_bytes + num_weight_bytes(TINY)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(order) and "lm_head.weight" not in order and len(order) == 1 + 2 * 9 + 1
        for index, name in enumerate(order):
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.bfloat16
            if name.endswith("norm.weight"):
                assert torch.equal(tensor, torch.ones_like(tensor)), name
                continue
            start = tile_offset(index, block.numel())
            tiled = torch.cat([block[start:], block.repeat(tensor.numel() // block.numel() + 1)])[:tensor.numel()]
            assert torch.equal(tensor.flatten(), tiled), name


def test_a_published_model_is_written_once(tmp_path):
    repository = tmp_path / "repository"
    assert not is_published(repository, "tiny")
    num_bytes, reused = publish_random_llama(repository, "tiny", TINY)
    assert not reused and is_published(repository, "tiny")
    assert num_bytes > num_weight_bytes(TINY)  # plus the aligned layout, tokenizer and config
    assert publish_random_llama(repository, "tiny", TINY) == (num_bytes, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repository"]  # no scratch left


# ---- the quick run, end to end ------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_run_sleeps_wakes_and_evicts_through_the_http_api(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_platform.py"), "--quick",
                             "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=400, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    line = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    stopped = result.stderr.find("stopped early")  # what went wrong, then the platform's log tail
    why = result.stderr[stopped:stopped + 6000] if stopped >= 0 else result.stderr[-6000:]
    assert result.returncode == 0 and len(lines) == 1, (f"exit {result.returncode}, error {line.get('error')}, "
                                                        f"checks {line.get('checks')}:\n{why}")
    assert (line["bench"], line["mode"], line["device"], line["error"]) == ("gpu_platform", "quick", "cpu", None)
    assert all(line["checks"].values()) and set(line["checks"]) == {
        "every_request_succeeded", "slept_woke_evicted", "cold_try_in_a_fresh_host", "asleep_tries_were_wakes",
        "dram_tries_loaded_from_dram", "memory_within_budget"}
    assert line["num_failed"] == 0 and line["targets_met"] is None
    assert line["sleeps"] >= 2 and line["wakes"] >= 2 and line["evictions"] >= 2
    assert [t["phase"] for t in line["tries"] if t["phase"] != FILL] == [
        COLD, SMALL, SMALL, SMALL, SMALL, SETUP, ASLEEP, ASLEEP, DRAM, DRAM]
    assert all(t["ttft_s"] > 0 for t in line["tries"])
    assert line["platform_budgets"]["worker_memory"] == int(float(line["budget_gb"]) * GIB)
    assert line["max_used_bytes"]["worker_memory"] <= line["platform_budgets"]["worker_memory"]
