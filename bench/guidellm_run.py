"""guidellm (vLLM's benchmark tool) against Thaw's gateway, as a user would run it.

guidellm 0.8.1 runs from a venv of its own (`bench.guidellm_venv`, made once and cached) with
its defaults for the OpenAI HTTP backend: a ``GET /health`` validation request first, then chat
completions, streamed, with ``stream_options.continuous_usage_stats`` and ``ignore_eos`` (what
vLLM accepts). What is set here is only what a run must name: the target and model, the
tokenizer (the served model's own folder, so nothing is fetched from a hub), synthetic data
(``prompt_tokens``/``output_tokens``), the ``concurrent`` profile with one benchmark per number
of streams, and a request count per benchmark (with a time cap that only a hung server reaches).

By default the target is an in-process gateway: `build_gateway_app` over `LocalEngineBackend`
serving the demo model (``demo/tiny``, what ``thaw serve --demo`` deploys) on a free loopback
port behind an API key (`local_gateway` serves any model folder that way; `bench/serving_sweep.py`
uses it). ``--target URL --model ID --tokenizer DIR`` points the same harness at any
OpenAI-compatible server instead (``vllm serve`` for a comparison). guidellm runs offline
(``HF_HUB_OFFLINE=1``); its console goes to a log whose tail is shown when it fails.

Prints one JSON line: the request counts (successful, errored, incomplete) over all benchmarks,
the backend settings guidellm recorded (proof that its defaults ran), and per number of streams
the successful requests' throughput and TTFT / inter-token latency p50 and p99. Without guidellm
(no package index) the line says ``skipped`` and why.

    python bench/guidellm_run.py [--quick] [--streams 1,4,16] [--max-requests 64]
        [--prompt-tokens 256] [--output-tokens 128] [--work-dir DIR]
        [--target URL --model ID --tokenizer DIR [--api-key KEY]]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.guidellm_venv import GuidellmUnavailable, GuidellmVenvConfig, prepare_guidellm_venv  # noqa: E402

DEMO_MODEL_ID = "demo/tiny"  # what `thaw serve --demo` deploys
QUICK = dict(streams=(1, 4), max_requests=8, prompt_tokens=64, output_tokens=32)
FULL = dict(streams=(1, 4, 16), max_requests=64, prompt_tokens=256, output_tokens=128)
# guidellm must not reach a hub: the tokenizer is a local folder and the data synthetic.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}


class GuidellmRunFailed(RuntimeError):
    """guidellm exited with an error or wrote no report; the message carries its log's tail."""


@dataclass(frozen=True)
class GuidellmRunConfig:
    """One guidellm run: where it sends requests, and how many.

    target: the server's base URL (``http://host:port``; guidellm strips a trailing ``/v1``).
    model: the model id sent in each request.
    tokenizer_dir: a local folder with the model's tokenizer (guidellm sizes prompts with it).
    streams: one ``concurrent`` benchmark per entry, with that many requests in flight.
    max_requests: requests per benchmark.
    max_seconds: a cap per benchmark; requests cut off by it count as incomplete.
    prompt_tokens / output_tokens: the synthetic requests' sizes (output forced with ignore_eos).
    api_key: sent as ``Authorization: Bearer``; None sends none.
    timeout_s: the longest the whole guidellm process may run.
    """

    target: str
    model: str
    tokenizer_dir: Path
    streams: tuple[int, ...] = QUICK["streams"]
    max_requests: int = QUICK["max_requests"]
    max_seconds: float = 120.0
    prompt_tokens: int = QUICK["prompt_tokens"]
    output_tokens: int = QUICK["output_tokens"]
    api_key: str | None = None
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.startswith(("http://", "https://")):
            raise ValueError(f"target must be a base URL like http://127.0.0.1:8000, got {self.target!r}")
        if not isinstance(self.model, str) or not self.model or "," in self.model:
            raise ValueError(f"model must be the served model id (no commas), got {self.model!r}")
        if not isinstance(self.tokenizer_dir, Path) or "," in str(self.tokenizer_dir):
            raise ValueError(f"tokenizer_dir must be a pathlib.Path without commas, got {self.tokenizer_dir!r}")
        if not self.streams or any(not isinstance(n, int) or n < 1 for n in self.streams):
            raise ValueError(f"streams must be a non-empty tuple of integers >= 1, got {self.streams!r}")
        for name in ("max_requests", "prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_seconds", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or "," in self.api_key):
            raise ValueError("api_key must be None or a string without commas")


def guidellm_argv(config: GuidellmRunConfig, guidellm: Path, report_path: Path) -> list[str]:
    """The ``guidellm run`` command line: only what a run must name; the backend's defaults stay."""
    backend = f"kind=openai_http,target={config.target},model={config.model}"
    if config.api_key is not None:
        backend += f",api_key={config.api_key}"
    first, *_ = config.streams
    return [
        str(guidellm), "run",
        "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={config.tokenizer_dir}",
        "--data", f"kind=synthetic_text,prompt_tokens={config.prompt_tokens},output_tokens={config.output_tokens}",
        "--profile", f"kind=concurrent,streams={first}",
        # guidellm's key=value parser splits on commas, so a list of streams goes in an override.
        "--override", "profile.streams", ",".join(str(n) for n in config.streams),
        "--constraint", f"kind=max_requests,count={config.max_requests}",
        "--constraint", f"kind=max_duration,seconds={config.max_seconds:g}",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]


def guidellm_env(environ: dict[str, str]) -> dict[str, str]:
    """The caller's environment, offline, without the project venv's Python settings."""
    env = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | OFFLINE_ENV


def run_guidellm(config: GuidellmRunConfig, guidellm: Path, work_dir: Path) -> dict:
    """Runs guidellm to the end; returns its JSON report (raises `GuidellmRunFailed`)."""
    report_path, log_path = work_dir / "guidellm-report.json", work_dir / "guidellm.log"
    report_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(guidellm_argv(config, guidellm, report_path), stdout=log,
                                    stderr=subprocess.STDOUT, env=guidellm_env(dict(os.environ)),
                                    cwd=work_dir, timeout=config.timeout_s)
            returncode = result.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    if returncode != 0 or not report_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        why = "timed out" if returncode is None else f"exited with status {returncode}"
        raise GuidellmRunFailed(f"guidellm {why}; the end of its log ({log_path}):\n{tail}")
    return json.loads(report_path.read_text())


@dataclass(frozen=True)
class LevelFigures:
    """One benchmark of the report: a number of streams and its successful requests' figures."""

    streams: int
    successful: int
    errored: int
    incomplete: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float


def _percentile(metrics: dict, name: str, key: str) -> float:
    return round(metrics[name]["successful"]["percentiles"][key], 3)


def figures_from_report(report: dict) -> list[LevelFigures]:
    """Each benchmark's figures, in the order guidellm ran them."""
    levels = []
    for benchmark in report["benchmarks"]:
        metrics, totals = benchmark["metrics"], benchmark["metrics"]["request_totals"]
        levels.append(LevelFigures(
            streams=benchmark["config"]["strategy"]["streams"],
            successful=totals["successful"], errored=totals["errored"], incomplete=totals["incomplete"],
            requests_per_s=round(metrics["requests_per_second"]["successful"]["mean"], 3),
            output_tokens_per_s=round(metrics["output_tokens_per_second"]["successful"]["mean"], 3),
            ttft_ms_p50=_percentile(metrics, "time_to_first_token_ms", "p50"),
            ttft_ms_p99=_percentile(metrics, "time_to_first_token_ms", "p99"),
            itl_ms_p50=_percentile(metrics, "inter_token_latency_ms", "p50"),
            itl_ms_p99=_percentile(metrics, "inter_token_latency_ms", "p99"),
        ))
    return levels


def first_error(report: dict) -> str | None:
    """The first errored request's message (what to look at when ``errored`` is not 0)."""
    for benchmark in report["benchmarks"]:
        for request in benchmark["requests"]["errored"]:
            return str(request["info"].get("error"))
    return None


def summarize(config: GuidellmRunConfig, report: dict) -> dict:
    """The JSON line's figures (without the bench's own fields)."""
    levels = figures_from_report(report)
    backend = report["benchmarks"][0]["config"]["backend"]
    return {
        "guidellm_version": report["metadata"]["guidellm_version"],
        "model": config.model,
        "request_format": backend["request_format"], "stream": backend["stream"],
        "validate_backend": backend["validate_backend"],
        "prompt_tokens": config.prompt_tokens, "output_tokens": config.output_tokens,
        "successful": sum(level.successful for level in levels),
        "errored": sum(level.errored for level in levels),
        "incomplete": sum(level.incomplete for level in levels),
        "first_error": first_error(report),
        "levels": [asdict(level) for level in levels],
    }


@contextmanager
def local_gateway(model_dir: Path, model_id: str, api_key: str, engine_config=None) -> Iterator[str]:
    """The gateway over `LocalEngineBackend` serving ``model_dir`` as ``model_id`` (``tenant/name``;
    ``api_key`` is the tenant's) with ``engine_config`` (None: the defaults); yields its base URL."""
    from infra.gateway_app import build_gateway_app
    from infra.gateway_auth import GatewayAuth
    from infra.local_engine_backend import LocalEngineBackend
    from infra.threaded_server import served_app
    from worker import AsyncEngine, Engine, EngineConfig

    async_engine = AsyncEngine(Engine(model_dir, EngineConfig() if engine_config is None else engine_config))
    tenant = model_id.partition("/")[0]
    app = build_gateway_app(LocalEngineBackend({model_id: async_engine}),
                            GatewayAuth(verify_api_key={api_key: tenant}.get))
    try:
        with served_app(app, health_path="/health") as base_url:
            yield base_url
    finally:
        async_engine.shutdown()


@contextmanager
def demo_gateway(work_dir: Path, api_key: str) -> Iterator[tuple[str, Path]]:
    """The gateway over `LocalEngineBackend` serving the demo model; yields (base URL, model dir)."""
    from worker import write_demo_model

    model_dir = write_demo_model(work_dir / "demo-model", overwrite=True)
    with local_gateway(model_dir, DEMO_MODEL_ID, api_key) as base_url:
        yield base_url, model_dir


def _streams(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams takes integers separated by commas (e.g. 1,4,16), "
                                         f"got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of small requests")
    parser.add_argument("--streams", type=_streams, help="numbers of concurrent streams, e.g. 1,4,16")
    parser.add_argument("--max-requests", type=int, help="requests per number of streams")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="cap per number of streams")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--work-dir", type=Path, help="keep the demo model, guidellm's log and report here")
    parser.add_argument("--target", help="an OpenAI-compatible server's base URL instead of the in-process gateway")
    parser.add_argument("--model", help="with --target: the model id to request")
    parser.add_argument("--tokenizer", type=Path, help="with --target: a local folder with the model's tokenizer")
    parser.add_argument("--api-key", help="with --target: the key to send")
    args = parser.parse_args(argv)
    if args.target and (not args.model or not args.tokenizer):
        parser.error("--target needs --model and --tokenizer (a local folder, so guidellm stays offline)")
    sizes = {name: default if getattr(args, name) is None else getattr(args, name)
             for name, default in (QUICK if args.quick else FULL).items()}

    def make_config(target: str, model: str, tokenizer_dir: Path, api_key: str | None) -> GuidellmRunConfig:
        try:
            return GuidellmRunConfig(target=target, model=model, tokenizer_dir=tokenizer_dir, api_key=api_key,
                                     max_seconds=args.max_seconds, **sizes)
        except ValueError as exc:
            parser.error(str(exc))

    if args.target:
        make_config(args.target, args.model, args.tokenizer, args.api_key)  # bad arguments fail before any work
    line = {"bench": "guidellm", "mode": "quick" if args.quick else "full",
            "target": args.target or "in-process gateway (LocalEngineBackend, demo model)"}

    try:
        guidellm = prepare_guidellm_venv(GuidellmVenvConfig.default())
    except GuidellmUnavailable as exc:
        print(json.dumps(line | {"skipped": f"guidellm unavailable: {exc}"}))
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="thaw-guidellm-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        try:
            if args.target:
                config = make_config(args.target, args.model, args.tokenizer, args.api_key)
                report = run_guidellm(config, guidellm, work_dir)
            else:
                api_key = f"thaw_bench_{secrets.token_hex(8)}"
                with demo_gateway(work_dir, api_key) as (base_url, model_dir):
                    config = make_config(base_url, DEMO_MODEL_ID, model_dir, api_key)
                    report = run_guidellm(config, guidellm, work_dir)
        except GuidellmRunFailed as exc:
            sys.exit(str(exc))
    print(json.dumps(line | summarize(config, report) | {"wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
