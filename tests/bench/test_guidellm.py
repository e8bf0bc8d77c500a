"""guidellm (vLLM's benchmark tool) against the gateway, with its OpenAI HTTP backend's defaults.

The slow test runs ``bench/guidellm_run.py --quick`` end to end: guidellm 0.8.1 from its own
cached venv (`bench.guidellm_venv`; skipped, with the reason, where it cannot be installed)
validates the gateway with ``GET /health``, then streams chat completions with
``continuous_usage_stats`` at 1 and 4 concurrent streams. Every request must succeed.
The fast tests pin the harness's pieces: the command line, the report parsing, the venv's
reuse marker and its failure message when no package can be had.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.guidellm_run import GuidellmRunConfig, figures_from_report, first_error, guidellm_argv, guidellm_env
from bench.guidellm_venv import (
    MARKER,
    GuidellmUnavailable,
    GuidellmVenvConfig,
    default_venv_dir,
    is_ready,
    prepare_guidellm_venv,
)

ROOT = Path(__file__).resolve().parents[2]


def test_argv_names_only_what_a_run_must_and_keeps_the_backend_defaults():
    config = GuidellmRunConfig(target="http://127.0.0.1:8123", model="demo/tiny", tokenizer_dir=Path("/m/tiny"),
                               streams=(1, 4), max_requests=8, max_seconds=120.0, prompt_tokens=64,
                               output_tokens=32, api_key="thaw_k")
    assert guidellm_argv(config, Path("/v/bin/guidellm"), Path("/w/report.json")) == [
        "/v/bin/guidellm", "run",
        "--backend", "kind=openai_http,target=http://127.0.0.1:8123,model=demo/tiny,api_key=thaw_k",
        "--tokenizer", "kind=huggingface_auto,model=/m/tiny",
        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", "1,4",
        "--constraint", "kind=max_requests,count=8",
        "--constraint", "kind=max_duration,seconds=120",
        "--output", "kind=json,path=/w/report.json",
        "--disable-console-interactive",
    ]


def test_env_is_offline_and_drops_the_project_venv():
    env = guidellm_env({"PATH": "/bin", "PYTHONPATH": "/work/main", "VIRTUAL_ENV": "/work/main/.venv",
                        "HF_HUB_OFFLINE": "0"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("field, value, message", [
    ("target", "127.0.0.1:8000", "target must be a base URL like http://127.0.0.1:8000"),
    ("streams", (), "streams must be a non-empty tuple of integers >= 1"),
    ("streams", (1, 0), "streams must be a non-empty tuple of integers >= 1"),
    ("max_requests", 0, "max_requests must be an integer >= 1"),
    ("model", "a,b", "model must be the served model id (no commas)"),
])
def test_config_refuses_what_guidellm_would_misread(field, value, message):
    base = dict(target="http://127.0.0.1:8000", model="demo/tiny", tokenizer_dir=Path("/m"))
    with pytest.raises(ValueError, match=re.escape(message)):
        GuidellmRunConfig(**(base | {field: value}))


def _stats(p50: float, p99: float, mean: float = 0.0) -> dict:
    return {"successful": {"mean": mean, "percentiles": {"p50": p50, "p99": p99}}}


def _benchmark(streams: int, successful: int, errored: list[dict]) -> dict:
    return {
        "config": {"strategy": {"streams": streams}},
        "metrics": {
            "request_totals": {"successful": successful, "errored": len(errored), "incomplete": 1},
            "requests_per_second": _stats(0, 0, mean=6.38749),
            "output_tokens_per_second": _stats(0, 0, mean=204.3871),
            "time_to_first_token_ms": _stats(20.4011, 40.8144),
            "inter_token_latency_ms": _stats(4.0712, 4.4763),
        },
        "requests": {"successful": [], "errored": errored, "incomplete": []},
    }


def test_report_figures_are_read_per_number_of_streams():
    report = {"benchmarks": [_benchmark(1, 8, []),
                             _benchmark(4, 6, [{"info": {"error": "HTTPStatusError: 400 Bad Request"}}] * 2)]}
    levels = figures_from_report(report)
    assert [(lv.streams, lv.successful, lv.errored, lv.incomplete) for lv in levels] == [(1, 8, 0, 1), (4, 6, 2, 1)]
    assert (levels[0].requests_per_s, levels[0].output_tokens_per_s) == (6.387, 204.387)
    assert (levels[0].ttft_ms_p50, levels[0].ttft_ms_p99, levels[0].itl_ms_p50, levels[0].itl_ms_p99) == (
        20.401, 40.814, 4.071, 4.476)
    assert first_error(report) == "HTTPStatusError: 400 Bad Request"
    assert first_error({"benchmarks": [_benchmark(1, 8, [])]}) is None


def test_default_venv_dir_honours_the_override_and_the_cache_home():
    assert default_venv_dir("0.8.1", {"THAW_GUIDELLM_VENV": "/opt/g"}) == Path("/opt/g")
    assert default_venv_dir("0.8.1", {"XDG_CACHE_HOME": "/c"}) == Path("/c/thaw/venvs/guidellm-0.8.1")


def test_a_venv_is_reused_only_when_its_marker_names_these_versions(tmp_path):
    config = GuidellmVenvConfig(venv_dir=tmp_path / "g")
    for name in ("python", "guidellm"):
        (tmp_path / "g" / "bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "g" / "bin" / name).write_text("")
    assert not is_ready(config)  # no marker: a half-made venv
    (tmp_path / "g" / MARKER).write_text(json.dumps({"guidellm": "0.8.0", "torch": config.torch_spec}))
    assert not is_ready(config)
    (tmp_path / "g" / MARKER).write_text(json.dumps(config.marker()))
    assert is_ready(config)


def test_the_projects_own_venv_is_refused():
    with pytest.raises(GuidellmUnavailable, match="is the venv this Python runs in"):
        prepare_guidellm_venv(GuidellmVenvConfig(venv_dir=Path(sys.prefix)))


def test_no_package_index_gives_a_reason_to_skip_with(tmp_path, monkeypatch):
    # pip sees no index and an empty wheel folder (and not this machine's pip config): what a
    # machine without network sees.
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    config = GuidellmVenvConfig(venv_dir=tmp_path / "g", torch_spec="torch==0.0.1")
    with pytest.raises(GuidellmUnavailable) as caught:
        prepare_guidellm_venv(config, log=lambda line: None)
    message = str(caught.value)
    assert message.startswith("pip install torch==0.0.1 failed (")
    assert "No matching distribution found for torch==0.0.1" in message
    assert message.endswith("check that a package index is reachable (pip's index-url / PIP_EXTRA_INDEX_URL)")
    assert not (tmp_path / "g" / MARKER).exists()


@pytest.mark.slow
def test_guidellm_defaults_against_the_gateway_error_nothing():
    try:
        prepare_guidellm_venv()  # cached after the first run (about a minute to install)
    except GuidellmUnavailable as exc:
        pytest.skip(f"guidellm cannot be installed here: {exc}")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "guidellm_run.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {lines!r}"
    figures = json.loads(lines[0])
    # guidellm's own defaults for the OpenAI HTTP backend, as its report recorded them.
    assert (figures["request_format"], figures["stream"], figures["validate_backend"]) == (
        "/v1/chat/completions", True, True)
    assert (figures["errored"], figures["incomplete"], figures["first_error"]) == (0, 0, None)
    assert figures["successful"] == 16  # 8 requests at each of 1 and 4 streams
    assert [(level["streams"], level["successful"]) for level in figures["levels"]] == [(1, 8), (4, 8)]
    for level in figures["levels"]:
        assert level["output_tokens_per_s"] > 0 and level["ttft_ms_p50"] > 0 and level["itl_ms_p50"] > 0
