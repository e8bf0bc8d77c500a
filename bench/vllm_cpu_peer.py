"""vLLM's CPU build as `bench/engine.py`'s peer: serves one job's token ids and reports the figures.

Two sides, one file. `bench/engine.py` (the project's venv) imports the records below, writes a
`PeerJob` as JSON and runs this file as a script under the python of vLLM's own venv
(`bench.vllm_cpu_venv`), which reads the job, serves it with offline `vllm.LLM` and writes one
`PeerResult` JSON line to the output file (vLLM logs to stdout, so stdout is not the channel). The
module level imports only the standard library, so both interpreters can load it; vLLM is imported
inside `serve`, in the peer only, and nothing of the project is imported there. `run_peer` is
the bench's side: it writes the job, runs the peer with the project's Python settings dropped from
its environment, and raises `PeerFailed` with the last lines of vLLM's log when no result comes.

How vLLM is run, as a user would on this CPU:

* Its default execution mode: what `vllm serve` does on CPU (0.32: the model traced once by
  dynamo and compiled by inductor, ``CompilationMode.DYNAMO_TRACE_ONCE``; no CUDA graphs). The
  result records the mode it reports, so a run that fell back to eager says so.
* Threads: ``VLLM_CPU_OMP_THREADS_BIND`` names the first ``threads`` CPUs this process may run on
  ("auto" would keep one core of two for the scheduler process and compute on one). vLLM sets
  ``OMP_NUM_THREADS`` and the affinity of its worker from it, and preloads its bundled tcmalloc
  and torch's libgomp itself. ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache explicitly:
  the automatic size is a fraction of the whole machine's memory, which a shared VM may not have free.
* Token ids in (`TokensPrompt`, ``skip_tokenizer_init``: no text either way), greedy,
  ``ignore_eos``, ``max_tokens`` = each request's planned count, so both systems produce exactly
  the planned tokens. The scheduler's per-step token budget and sequence limit come from the job
  (the bench passes Thaw's), prefix caching is on (vLLM's default, and Thaw's).
* A warm-up generate first, not timed.

Measurements (`PeerJob.measurements`):

* ``throughput``: every request through one ``LLM.generate`` call; elapsed, tokens/s, outputs.
* ``batch1``: one request alone through ``LLM.llm_engine`` (``add_request``/``step``), time per
  output token after the first, ``(last token - first token) / (n - 1)`` as the tokens reach the
  caller: the method the bench uses for Thaw; median over ``repeats``.
* ``shared_prefix``: the burst of requests added at once to ``LLM.llm_engine`` and stepped; each
  one's time to first token from the burst's arrival (as the bench's Thaw side measures it), the
  prompt tokens vLLM served from its prefix cache, the outputs. Before each of ``repeats`` bursts
  the prefix cache is reset, so each burst meets a cold cache (the warm-up burst used another
  system prompt).

    python bench/vllm_cpu_peer.py JOB.json RESULT.json     # under the vLLM venv's python
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MEASUREMENTS = ("throughput", "batch1", "shared_prefix")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PeerRequest:
    """One request: its prompt's token ids and how many tokens it must generate."""

    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or not all(isinstance(t, int) and t >= 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be a non-empty tuple of token ids >= 0")
        if not isinstance(self.num_output_tokens, int) or self.num_output_tokens < 1:
            raise ValueError(f"num_output_tokens must be an integer >= 1, got {self.num_output_tokens!r}")

    def __repr__(self) -> str:  # never print prompts, even random ones
        return f"PeerRequest(prompt_len={len(self.prompt_token_ids)}, num_output_tokens={self.num_output_tokens})"


@dataclass(frozen=True)
class PeerJob:
    """What the peer serves and measures; written by the bench, read by the peer.

    measurements: a subset of ``MEASUREMENTS``; ``shared_prefix`` goes alone (its own workload).
    requests: the workload (throughput, shared_prefix), in order.
    warmup_requests: served once before anything is timed.
    batch1_request: the lone request of ``batch1`` (required with it).
    repeats: batch1 runs (median taken) or shared-prefix bursts (mean TTFT over all).
    max_num_seqs, max_num_batched_tokens: vLLM's scheduler limits (the bench passes Thaw's).
    kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
    """

    model_dir: str
    dtype: str
    threads: int
    measurements: tuple[str, ...]
    requests: tuple[PeerRequest, ...]
    warmup_requests: tuple[PeerRequest, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    batch1_request: PeerRequest | None = None
    repeats: int = 1
    kv_cache_gib: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.measurements or any(m not in MEASUREMENTS for m in self.measurements):
            raise ValueError(f"measurements must be a non-empty subset of {MEASUREMENTS}, got {self.measurements!r}")
        if "shared_prefix" in self.measurements and len(self.measurements) > 1:
            raise ValueError("shared_prefix is measured alone (its own workload); run another job for "
                             f"{[m for m in self.measurements if m != 'shared_prefix']}")
        if "batch1" in self.measurements and self.batch1_request is None:
            raise ValueError("measurements include batch1: give batch1_request")
        if {"throughput", "shared_prefix"} & set(self.measurements) and not self.requests:
            raise ValueError("throughput and shared_prefix need a non-empty requests tuple")
        for name in ("threads", "max_num_seqs", "max_num_batched_tokens", "repeats", "kv_cache_gib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def __repr__(self) -> str:
        return (f"PeerJob(model_dir={self.model_dir!r}, dtype={self.dtype}, threads={self.threads}, "
                f"measurements={self.measurements}, num_requests={len(self.requests)})")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerJob:
        raw = json.loads(text)

        def request(item: dict) -> PeerRequest:
            return PeerRequest(tuple(item["prompt_token_ids"]), item["num_output_tokens"])

        return cls(
            model_dir=raw["model_dir"], dtype=raw["dtype"], threads=raw["threads"],
            measurements=tuple(raw["measurements"]),
            requests=tuple(request(r) for r in raw["requests"]),
            warmup_requests=tuple(request(r) for r in raw["warmup_requests"]),
            max_num_seqs=raw["max_num_seqs"], max_num_batched_tokens=raw["max_num_batched_tokens"],
            batch1_request=None if raw["batch1_request"] is None else request(raw["batch1_request"]),
            repeats=raw["repeats"], kv_cache_gib=raw["kv_cache_gib"],
        )


@dataclass(frozen=True)
class PeerResult:
    """What the peer measured; fields of measurements not asked for stay None / empty."""

    vllm_version: str
    torch_version: str
    dtype: str
    threads: int
    execution_mode: str  # "compiled" or "eager", from vLLM's own compilation config
    compilation: str  # the mode and backend vLLM reports, e.g. "DYNAMO_TRACE_ONCE/inductor"
    omp_threads_bind: str
    startup_s: float  # LLM(...) construction: load, compile, warm-up of vLLM's own
    elapsed_s: float | None = None
    num_generated_tokens: int | None = None
    tokens_per_s: float | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)  # per request, in job order
    batch1_s_per_token: float | None = None  # median over repeats
    batch1_s_per_token_runs: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # per request, last burst, from the burst's arrival
    mean_ttft_s: float | None = None  # over every request of every burst
    cached_prompt_tokens: int | None = None  # last burst
    burst_elapsed_s: list[float] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerResult:
        return cls(**json.loads(text))


def bind_cpus(threads: int, allowed_cpu_ids: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the first ``threads`` allowed CPUs, as ``"0,1"``."""
    if threads > len(allowed_cpu_ids):
        raise ValueError(f"threads ({threads}) exceeds the {len(allowed_cpu_ids)} CPUs this process may use; "
                         "pass --threads at most that")
    return ",".join(str(cpu) for cpu in sorted(allowed_cpu_ids)[:threads])


# ---- the bench side (the project's venv) ------------------------------------------------------


class PeerFailed(RuntimeError):
    """The peer process failed or wrote no result; the message carries its last log lines."""


# The project's environment must not leak into vLLM's interpreter.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def peer_env(environ: dict[str, str]) -> dict[str, str]:
    """The peer's environment: ``environ`` without the project's Python settings, unbuffered."""
    env = {k: v for k, v in environ.items() if k not in DROPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_peer(python: Path, job: PeerJob, work_dir: Path, timeout_s: float = 3600.0) -> PeerResult:
    """Runs this file under ``python`` (vLLM's venv) on ``job``; vLLM's log goes to a file in ``work_dir``."""
    name = f"vllm-{job.dtype}-{'-'.join(job.measurements)}"
    job_path, result_path, log_path = (work_dir / f"{name}{suffix}" for suffix in (".job.json", ".result.json", ".log"))
    job_path.write_text(job.to_json())
    result_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([str(python), str(Path(__file__).resolve()), str(job_path), str(result_path)],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=work_dir,
                                  env=peer_env(dict(os.environ)), timeout=timeout_s)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    if returncode == 0 and result_path.is_file():
        return PeerResult.from_json(result_path.read_text())
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    status = f"ran past {timeout_s:.0f} s" if returncode is None else f"exited with status {returncode}"
    raise PeerFailed(f"the vLLM peer ({job.dtype}, {'+'.join(job.measurements)}) {status}: "
                     f"{' | '.join(lines[-3:]) or 'no output'}")


# ---- the peer side (vLLM's venv) --------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[vllm-cpu-peer] {message}", file=sys.stderr, flush=True)


def _greedy(vllm, num_tokens: int):
    return vllm.SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def _prompt(vllm_inputs, request: PeerRequest):
    return vllm_inputs.TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))


def _generate(llm, vllm, vllm_inputs, requests: tuple[PeerRequest, ...]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate([_prompt(vllm_inputs, r) for r in requests],
                           [_greedy(vllm, r.num_output_tokens) for r in requests], use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    for request, ids in zip(requests, token_ids):
        if len(ids) != request.num_output_tokens:
            raise RuntimeError(f"vLLM produced {len(ids)} tokens for a request that planned {request.num_output_tokens}")
    return elapsed_s, token_ids


def _burst(engine, vllm, vllm_inputs, requests: tuple[PeerRequest, ...], tag: str):
    """Every request added at once, then stepped; (per-request TTFT, outputs, cached tokens, elapsed)."""
    start = time.perf_counter()
    request_ids = [f"{tag}-{i}" for i in range(len(requests))]
    for rid, request in zip(request_ids, requests):
        engine.add_request(rid, _prompt(vllm_inputs, request), _greedy(vllm, request.num_output_tokens))
    first_token_s: dict[str, float] = {}
    last_token_s: dict[str, float] = {}
    token_ids: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = list(out.outputs[0].token_ids)  # cumulative
            now = time.perf_counter() - start
            if ids and out.request_id not in first_token_s:
                first_token_s[out.request_id] = now
            if ids and len(ids) != len(token_ids.get(out.request_id, ())):
                last_token_s[out.request_id] = now
            token_ids[out.request_id] = ids
            cached[out.request_id] = out.num_cached_tokens or 0
    elapsed_s = time.perf_counter() - start
    outputs = [token_ids[rid] for rid in request_ids]
    for request, ids in zip(requests, outputs):
        if len(ids) != request.num_output_tokens:
            raise RuntimeError(f"vLLM produced {len(ids)} tokens for a request that planned {request.num_output_tokens}")
    return ([first_token_s[rid] for rid in request_ids], [last_token_s[rid] for rid in request_ids], outputs,
            sum(cached.values()), elapsed_s)


def serve(job: PeerJob) -> PeerResult:
    bind = bind_cpus(job.threads, sorted(os.sched_getaffinity(0)))
    # Read by vLLM when it builds its config and spawns its processes: set before `import vllm`.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job.kv_cache_gib)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import vllm
    import vllm.inputs as vllm_inputs

    started = time.perf_counter()
    llm = vllm.LLM(
        model=job.model_dir, dtype=job.dtype, skip_tokenizer_init=True, seed=0,
        max_num_seqs=job.max_num_seqs, max_num_batched_tokens=job.max_num_batched_tokens,
        enable_prefix_caching=True,
    )
    startup_s = time.perf_counter() - started
    compilation_config = llm.llm_engine.vllm_config.compilation_config
    mode = getattr(compilation_config.mode, "name", str(compilation_config.mode))
    backend = compilation_config.backend or "-"
    execution_mode = "eager" if mode == "NONE" or backend == "eager" else "compiled"
    _log(f"vLLM {vllm.__version__} up in {startup_s:.1f} s: {job.dtype}, {execution_mode} ({mode}/{backend}), "
         f"threads bound to {bind}")

    if job.warmup_requests:
        _generate(llm, vllm, vllm_inputs, job.warmup_requests)
        if "shared_prefix" in job.measurements:  # the burst path too, on another system prompt
            _burst(llm.llm_engine, vllm, vllm_inputs, job.warmup_requests, "warmup-burst")

    figures: dict = {}
    if "throughput" in job.measurements:
        elapsed_s, token_ids = _generate(llm, vllm, vllm_inputs, job.requests)
        num_tokens = sum(len(ids) for ids in token_ids)
        figures.update(elapsed_s=elapsed_s, num_generated_tokens=num_tokens, tokens_per_s=num_tokens / elapsed_s,
                       output_token_ids=token_ids)
        _log(f"throughput: {num_tokens} tokens in {elapsed_s:.2f} s = {num_tokens / elapsed_s:.1f} tok/s")
    if "batch1" in job.measurements:
        runs = []
        for i in range(job.repeats):
            first_s, last_s, _, _, _ = _burst(llm.llm_engine, vllm, vllm_inputs, (job.batch1_request,), f"batch1-{i}")
            runs.append((last_s[0] - first_s[0]) / (job.batch1_request.num_output_tokens - 1))
        figures.update(batch1_s_per_token=statistics.median(runs), batch1_s_per_token_runs=runs)
        _log(f"batch-1 decode: {statistics.median(runs) * 1e3:.2f} ms/token")
    if "shared_prefix" in job.measurements:
        all_ttft, bursts = [], []
        for i in range(job.repeats):
            llm.reset_prefix_cache()  # a cold cache for every burst, like Thaw's fresh engine
            burst = _burst(llm.llm_engine, vllm, vllm_inputs, job.requests, f"burst-{i}")
            all_ttft.extend(burst[0])
            bursts.append(burst)
            _log(f"shared prefix burst {i}: mean TTFT {statistics.mean(burst[0]) * 1e3:.1f} ms, "
                 f"{burst[3]} prompt tokens from the cache, all done in {burst[4]:.2f} s")
        ttft_s, _, token_ids, cached, _ = bursts[-1]
        figures.update(ttft_s=ttft_s, mean_ttft_s=statistics.mean(all_ttft), cached_prompt_tokens=cached,
                       output_token_ids=token_ids, burst_elapsed_s=[b[4] for b in bursts])

    return PeerResult(vllm_version=vllm.__version__, torch_version=torch.__version__, dtype=job.dtype,
                      threads=job.threads, execution_mode=execution_mode, compilation=f"{mode}/{backend}",
                      omp_threads_bind=bind, startup_s=startup_s, **figures)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_cpu_peer.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    # Run as a script, this file's folder (bench/) leads sys.path, and its kernels.py would shadow
    # the `kernels` package that transformers probes for inside vLLM: keep the project out.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    job = PeerJob.from_json(Path(argv[0]).read_text())
    result = serve(job)
    Path(argv[1]).write_text(result.to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
