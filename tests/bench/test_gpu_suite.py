"""`bench/gpu_suite.py` on a machine without a GPU: the dry run lists every step and checks their
imports, a real run of one step writes the output files, and the pure pieces (summary table, JUnit
counts, a script's imports) give exact results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_suite import STEP_NAMES, Step, dry_run, junit_counts, main, script_imports
from bench.gpu_summary import summary_table

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["pytest-cuda", "pytest-cuda-files", "kernels", "loader_gpu", "engine_gpu", "coldstart_gpu", "gpu_platform"]


def test_dry_run_lists_every_step_and_finds_every_module(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(STEP_NAMES) == STEPS
    listed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert listed == STEPS
    assert "all 7 steps can start: every module they need imports" in result.stdout
    assert "peer vllm-cuda: not run" in result.stdout and "peer ray-serve: not run" in result.stdout
    assert not out.exists()  # a dry run writes nothing


def test_dry_run_names_what_does_not_import(tmp_path, capsys):
    steps = [Step("fine", ("-c", "pass"), 10, ("json",)),
             Step("broken", ("-c", "pass"), 10, ("json", "no_such_module_for_the_suite"),
                  optional_modules=("no_such_peer_either",))]
    assert dry_run(steps, tmp_path, quick=False) == 1
    out = capsys.readouterr().out
    assert "1 problem(s):\n  - broken: no_such_module_for_the_suite does not import (ModuleNotFoundError: " in out
    assert "peer no_such_peer_either: missing; the step reports it skipped" in out


def test_unknown_step_is_refused_with_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--only", "kernels,warp-drive", "--dry-run"])
    assert exc.value.code == 2
    assert "unknown step(s) warp-drive; choose from " + ", ".join(STEPS) in capsys.readouterr().err


def test_one_step_writes_results_summary_and_log(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--only", "kernels", "--quick",
                             "--out", str(out), "--work-dir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "suite.log", "summary.md"]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    records = {line["step"]: line for line in lines if line.get("suite") == "gpu_suite"}
    assert list(records) == ["peers", "install", "kernels"]
    assert records["kernels"]["status"] == "ok" and records["kernels"]["rc"] == 0
    kernel_lines = [line for line in lines if line["step"] == "kernels" and "suite" not in line]
    assert kernel_lines and all(line["bench"] == "kernels" for line in kernel_lines)
    assert [line["peer"] for line in lines if line["step"] == "peers" and "suite" not in line] == ["vllm-cuda",
                                                                                                   "ray-serve"]
    summary = (out / "summary.md").read_text()
    assert summary in result.stdout and "| kernels | ok | " in summary
    assert "===== kernels: " in (out / "suite.log").read_text()


def test_summary_table_turns_lines_into_rows():
    records = [
        {"step": "pytest-cuda", "status": "failed", "duration_s": 61.0,
         "detail": "40 passed, 1 failed, 0 errors, 2 skipped, 7 not collected"},
        {"step": "kernels", "status": "ok", "duration_s": 12.0, "detail": "1 JSON lines"},
        {"step": "engine_gpu", "status": "timeout after 300 s", "duration_s": 300.04, "detail": "2 JSON lines"},
        {"step": "loader_gpu", "status": "skipped", "duration_s": None, "detail": "budget spent"},
    ]
    lines = [
        {"step": "pytest-cuda", "bench": "pytest", "passed": 40, "failed": 1, "skipped": 2,
         "failed_ids": ["tests.worker.engine.test_engine::test_cuda"]},
        {"step": "kernels", "bench": "kernels", "batch": 16, "context": 4096, "thaw_gbps": 2500.4,
         "sdpa_gathered_gbps": 1800.0, "ratio": 1.389, "thaw_peak_fraction": 0.746, "target_peak_fraction": 0.7},
        {"step": "engine_gpu", "bench": "engine_gpu", "peer": "vllm-cuda", "skipped": "not run: no | wheel"},
        {"step": "engine_gpu", "bench": "engine_gpu", "summary": {
            "case": "throughput", "ours": "9000 tok/s", "peer": "4500 tok/s (HF)", "ratio": 2.0, "target_met": True}},
        {"step": "loader_gpu", "bench": "loader_gpu", "source": "disk", "loader": "fastsafetensors", "gbps": 4.0,
         "thaw_gbps": 5.0, "ratio_thaw_to_this": 1.25},
        {"step": "loader_gpu", "bench": "loader_gpu", "source": "disk", "loader": "thaw-staged", "gbps": 5.0,
         "thaw_gbps": 5.0, "limit_gbps": 6.25, "fraction_of_limit": 0.8,
         "peers_gbps": {"fastsafetensors": 4.0, "safetensors-load_file": 2.5},
         "ratio_thaw_to_peer": {"fastsafetensors": 1.25, "safetensors-load_file": 2.0},
         "target": {"meets_fraction": True, "faster_than_each_peer": True}},
        {"step": "loader_gpu", "bench": "other", "loader": "thaw", "state": "cold", "gbps": 20.5,
         "ratio_to_limit": 0.91, "target_met": False},
        {"step": "elsewhere", "bench": "kernels", "skipped": "not in any record: left out"},
    ]
    assert summary_table(records, lines) == (
        "| step | status | time, s | case | ours | peer | ratio | target met |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
        "| pytest-cuda | failed | 61.0 | 40 passed, 1 failed, 0 errors, 2 skipped, 7 not collected |  |  |  |  |\n"
        "|  |  |  | failed: tests.worker.engine.test_engine::test_cuda |  |  | — | — |\n"
        "| kernels | ok | 12.0 | 1 JSON lines |  |  |  |  |\n"
        "|  |  |  | decode attention B=16 ctx=4096 | 2500 GB/s (75% of peak) | 1800 GB/s (SDPA, gathered K/V) | 1.39x "
        "| yes |\n"
        "| engine_gpu | timeout after 300 s | 300.0 | 2 JSON lines |  |  |  |  |\n"
        "|  |  |  | vllm-cuda: skipped (not run: no \\| wheel) |  |  | — | — |\n"
        "|  |  |  | throughput | 9000 tok/s | 4500 tok/s (HF) | 2.00x | yes |\n"
        "| loader_gpu | skipped | — | budget spent |  |  |  |  |\n"
        "|  |  |  | disk: fastsafetensors | 5 GB/s | 4 GB/s | 1.25x | — |\n"
        "|  |  |  | disk: thaw-staged | 5 GB/s (80% of 6.25 GB/s limit) | fastsafetensors 4 GB/s, "
        "safetensors-load_file 2.5 GB/s | 1.25x | yes |\n"
        "|  |  |  | thaw cold | 20.5 GB/s |  | 0.91x | **no** |\n"
    )


def test_a_passing_pytest_step_has_no_figure_rows():
    records = [{"step": "pytest-cuda", "status": "ok", "duration_s": 5.0, "detail": "3 passed"}]
    lines = [{"step": "pytest-cuda", "bench": "pytest", "passed": 3, "failed": 0, "skipped": 0, "failed_ids": []}]
    assert summary_table(records, lines).splitlines()[2:] == ["| pytest-cuda | ok | 5.0 | 3 passed |  |  |  |  |"]


def test_junit_counts_tell_failures_from_modules_that_did_not_import(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">'
        '<testcase classname="" name="tests.storage.test_store">'
        '<error message="collection failure">ImportError while importing test module.\nTraceback:\n'
        "E   ModuleNotFoundError: No module named 'boto3'</error></testcase>"
        '<testcase classname="tests.worker.engine.test_engine" name="test_a"/>'
        '<testcase classname="tests.worker.engine.test_engine" name="test_b"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="tests.worker.engine.test_engine" name="test_c"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="tests.kernels.test_x" name="test_d"><error message="fixture failed"/></testcase>'
        '</testsuite></testsuites>')
    assert junit_counts(report) == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1, "not_collected": 1,
        "failed_ids": ["tests.worker.engine.test_engine::test_b", "tests.kernels.test_x::test_d"],
        "not_collected_modules": ["tests.storage.test_store (ModuleNotFoundError: No module named 'boto3')"],
    }


def test_script_imports_are_the_top_level_third_party_and_repo_modules(tmp_path):
    script = tmp_path / "bench_x.py"
    script.write_text("from __future__ import annotations\nimport os, json\nimport torch\n"
                      "from worker.engine.engine import Engine\nfrom . import sibling\n"
                      "def f():\n    import transformers\n")
    assert script_imports(script) == ["torch", "worker.engine.engine"]
