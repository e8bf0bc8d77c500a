"""The GPU benchmarks (`bench/engine_gpu.py`, `bench/coldstart_gpu.py`) without a GPU: their code
paths run end to end on the CPU (``--device cpu --quick``; the figures mean nothing, the lines'
shape and consistency do), and their pure pieces give exact results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.coldstart_gpu import BASELINE, case_lines
from bench.engine_gpu import match_fraction

ROOT = Path(__file__).resolve().parents[2]


def run_on_cpu(script: str) -> list[dict]:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--device", "cpu"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_engine_gpu_runs_on_cpu():
    vllm, line = run_on_cpu("engine_gpu.py")
    assert vllm["peer"] == "vllm-cuda" and vllm["skipped"].startswith("not run: vLLM's CUDA build")
    assert line["case"] == "vs-transformers-dynamic-cache" and line["device"] == "cpu"
    assert line["num_requests"] == 8 and line["generated_tokens"] > 0
    assert line["throughput_ratio"] == pytest.approx(line["thaw_tokens_per_s"] / line["transformers_tokens_per_s"],
                                                     rel=0.02)
    assert sorted(line["thaw_ms_per_decode_step"]) == sorted(line["transformers_ms_per_decode_step"]) == ["1", "4"]
    assert 0 <= line["first_request_match_fraction"] <= 1 and 0 <= line["mean_match_fraction"] <= 1
    assert line["summary"]["ratio"] == line["throughput_ratio"]
    assert line["summary"]["target_met"] is (line["throughput_ratio"] >= 1.0)


@pytest.mark.slow
def test_coldstart_gpu_runs_on_cpu():
    lines = run_on_cpu("coldstart_gpu.py")
    assert lines[0]["peer"] == "ray-serve" and lines[0]["skipped"].startswith("not run: the ray wheel")
    cases = {line["case"]: line for line in lines[1:]}
    assert list(cases) == ["thaw-ssd", "thaw-dram", BASELINE, "hf-replica-after-imports"]
    baseline_s = cases[BASELINE]["ttft_s"]
    assert cases["thaw-dram"]["fs"] == "tmpfs" and cases["thaw-ssd"]["fs"] != "tmpfs"
    assert cases["thaw-ssd"]["page_cache_drop"] in ("drop_caches", "fadvise")
    for case in ("thaw-ssd", "thaw-dram"):
        line = cases[case]
        assert line["errors"] == [] and len(line["ttft_all_s"]) == 1 and 0 < line["load_s"][0] <= line["ttft_s"]
        assert line["ratio_to_baseline"] == pytest.approx(baseline_s / line["ttft_s"], rel=0.02)
        # The same model, prompt and greedy step on the same device: the same first token.
        assert line["first_tokens"] == line["baseline_first_tokens"]
    assert cases["hf-replica-after-imports"]["ttft_s"] < baseline_s


def test_match_fraction_counts_tokens_before_the_first_difference():
    assert match_fraction((1, 2, 3, 4), (1, 2, 9, 4)) == 0.5
    assert match_fraction((1, 2, 3), (1, 2, 3)) == 1.0
    assert match_fraction((5, 2, 3), (1, 2, 3)) == 0.0


def test_case_lines_ratios_targets_and_failed_cases():
    hf = [{"from_process_start_s": s, "after_imports_s": s / 2, "load_s": 1.0, "token": 7} for s in (6.0, 8.0, 7.0)]
    dram = [{"first_token_s": s, "load_s": s / 2, "warm_up_s": 3.0, "token": 7, "load_report": "mapped",
             "page_cache_drop": None} for s in (0.5, 0.4, 0.7)]
    lines = case_lines({"bench": "coldstart_gpu"}, {"thaw-dram": dram, "thaw-ssd": [], "hf-replica": hf},
                       {"thaw-dram": [], "thaw-ssd": ["RuntimeError: boom"], "hf-replica": []},
                       {"thaw-dram": "tmpfs", "thaw-ssd": "xfs"})
    by_case = {line["case"]: line for line in lines}
    assert list(by_case) == ["thaw-dram", "thaw-ssd", BASELINE, "hf-replica-after-imports"]
    dram_line = by_case["thaw-dram"]
    assert (dram_line["ttft_s"], dram_line["baseline_s"], dram_line["ratio_to_baseline"]) == (0.5, 7.0, 14.0)
    assert dram_line["ratio_to_baseline_after_imports"] == 7.0
    assert dram_line["target_ratio"] == 15.0 and dram_line["target_met"] is False
    assert dram_line["summary"] == {"case": "thaw-dram", "ours": "0.500 s", "peer": "7.000 s (HF replica path)",
                                    "ratio": 14.0, "target_met": False}
    assert by_case["thaw-ssd"]["skipped"] == "every try failed: ['RuntimeError: boom']"
    assert by_case[BASELINE]["ttft_s"] == 7.0 and by_case["hf-replica-after-imports"]["ratio_to_baseline"] == 2.0
