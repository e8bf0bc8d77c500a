"""The ``--quick`` modes of the engine- and kernel-level benchmarks (one process each, no platform:
shared out between the suite's workers, `tests/conftest.py`); those that start a platform are in
`test_quick_modes.py`. Each runs and prints its one JSON line (so benchmarks never rot). No timing
is asserted: only that the figures are there, positive, and consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.quick_mode import ROOT, run_quick


def test_kernels_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert lines and all(line["bench"] == "kernels" for line in lines)
    import torch

    if not torch.cuda.is_available():
        assert len(lines) == 1 and "no CUDA device" in lines[0]["skipped"]
    else:
        for line in lines:
            assert line["thaw_gbps"] > 0 and line["sdpa_gathered_gbps"] > 0
            assert line["max_abs_error_vs_sdpa"] < 0.05


def test_engine_gpu_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_gpu.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert lines and all(line["bench"] == "engine_gpu" and line["mode"] == "quick" for line in lines)
    import torch

    if not torch.cuda.is_available():
        assert len(lines) == 1 and "no CUDA device" in lines[0]["skipped"]
    else:
        assert lines[0]["peer"] == "vllm-cuda" and lines[0]["skipped"].startswith("not run: ")
        [line] = lines[1:]
        assert line["case"] == "vs-transformers-dynamic-cache"
        assert line["thaw_tokens_per_s"] > 0 and line["transformers_tokens_per_s"] > 0
        assert line["throughput_ratio"] == pytest.approx(
            line["thaw_tokens_per_s"] / line["transformers_tokens_per_s"], rel=0.02)
        assert sorted(line["thaw_ms_per_decode_step"]) == ["1", "4"]


def test_coldstart_gpu_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "coldstart_gpu.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert lines and all(line["bench"] == "coldstart_gpu" and line["mode"] == "quick" for line in lines)
    import torch

    if not torch.cuda.is_available():
        assert len(lines) == 1 and "no CUDA device" in lines[0]["skipped"]
    else:
        cases = {line["case"]: line for line in lines if "case" in line}
        assert sorted(cases) == sorted(["thaw-dram", "thaw-ssd", "hf-replica-from-process-start",
                                        "hf-replica-after-imports"])
        baseline_s = cases["hf-replica-from-process-start"]["ttft_s"]
        for case in ("thaw-dram", "thaw-ssd"):
            assert cases[case]["ttft_s"] > 0
            assert cases[case]["ratio_to_baseline"] == pytest.approx(baseline_s / cases[case]["ttft_s"], rel=0.02)
        assert cases["thaw-dram"]["fs"] == "tmpfs" and cases["thaw-dram"]["target_ratio"] == 15.0


def test_moe_benchmark_quick():
    figures = run_quick("moe.py")  # it first checks ours and transformers' outputs are equal
    assert figures["bench"] == "moe" and figures["mode"] == "quick"
    for shape in ("decode", "prefill"):
        for key in ("thaw_ms", "transformers_ms", "transformers_eager_ms"):
            assert figures[f"{shape}_{key}"] > 0, (shape, key)
        assert figures[f"{shape}_ratio_vs_transformers"] == pytest.approx(
            figures[f"{shape}_transformers_ms"] / figures[f"{shape}_thaw_ms"], rel=0.01, abs=0.002)
    assert figures["decode_per_token_loop_ms"] > 0


def test_grammar_benchmark_quick():
    figures = run_quick("grammar.py")  # every document is checked accepted by both libraries first
    assert figures["bench"] == "grammar" and figures["mode"] == "quick" and figures["chosen"] == "llguidance"
    assert figures["tokens"] > figures["documents"] > 0
    for library in ("llguidance", "xgrammar"):
        assert 0 < figures[f"{library}_p50_us"] <= figures[f"{library}_p99_us"], library
        assert figures[f"{library}_mean_us"] > 0, library
    for key in ("mean", "p99"):
        # rel 2%: the times are rounded to 0.01 us, the ratio is taken before that rounding
        assert figures[f"{key}_ratio_xgrammar_to_llguidance"] == pytest.approx(
            figures[f"xgrammar_{key}_us"] / figures[f"llguidance_{key}_us"], rel=0.02)
    assert figures["apply_one_row_us"]["thaw"] > 0 and figures["apply_one_row_us"]["xgrammar_cpu_kernel"] > 0


def test_structured_engine_benchmark_quick():
    figures = run_quick("structured_engine.py")
    assert figures["bench"] == "structured_engine" and figures["mode"] == "quick" and figures["rows"] == 8
    [tiny] = figures["models"]
    for key in ("free_ms_per_step", "structured_overlap_ms_per_step", "structured_inline_ms_per_step",
                "fill_ms_8_rows_replayed"):
        assert tiny[key] > 0, key
    for case in ("overlap", "inline"):
        assert tiny[f"ratio_{case}_to_free"] == pytest.approx(
            tiny[f"structured_{case}_ms_per_step"] / tiny["free_ms_per_step"], rel=0.01)
    assert sorted(tiny["steps_timed"]) == ["free", "structured_inline", "structured_overlap"]
    assert min(tiny["steps_timed"].values()) > 0


def test_engine_shared_prefix_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--shared-prefix", "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.strip()]
    figures = json.loads(line)
    assert figures["bench"] == "engine_prefix_cache" and figures["mode"] == "quick" and figures["num_requests"] == 6
    assert figures["mean_ttft_ms_caching"] > 0 and figures["mean_ttft_ms_no_caching"] > 0
    assert figures["ttft_ratio_no_caching_to_caching"] == pytest.approx(
        figures["mean_ttft_ms_no_caching"] / figures["mean_ttft_ms_caching"], rel=0.02)
    # 6 requests of a 64-token system prompt under a 128-token budget: the first computes it, the other
    # five share its blocks (not computing them again) and each reuse its 4 full 16-token blocks.
    assert figures["cached_prompt_tokens"] == 5 * 64 and figures["outputs_match"] == "6/6"


def test_cpu_prefill_benchmark_quick():
    figures = run_quick("cpu_prefill.py")  # each kernel's output is checked against a float64 softmax first
    assert figures["bench"] == "cpu_prefill" and figures["mode"] == "quick"
    assert set(figures["by_dtype"]) | set(figures["skipped"]) == {"float32", "bfloat16"}
    for shapes in figures["by_dtype"].values():
        for shape in ("causal", "cascade"):
            f = shapes[shape]
            assert f["thaw_ms"] > 0 and f["op_ms"] > 0 and f["thaw_gflops"] > 0 and f["op_gflops"] > 0, shape
            assert f["ratio_op_to_thaw"] == pytest.approx(f["op_ms"] / f["thaw_ms"], rel=0.02)


def test_engine_memory_benchmark_quick():
    figures = run_quick("engine_memory.py")
    assert figures["bench"] == "engine_memory" and figures["mode"] == "quick"
    assert figures["floor_bytes"] == figures["checkpoint_bytes"] + figures["kv_bytes"] > 0
    for key in ("added_bytes", "peak_added_bytes", "kept_plain_added_bytes", "build_s"):
        assert figures[key] > 0, key
    assert figures["peak_added_bytes"] >= figures["added_bytes"]
    assert figures["ratio_to_floor"] == pytest.approx(figures["added_bytes"] / figures["floor_bytes"], abs=0.001)
