"""Live-migration benchmark: the pause a client sees when its generating request moves to another
instance, by token-based migration, by KV-block migration, and by the baseline of aborting it and
restarting it elsewhere.

One run builds a randomly initialised Llama (`worker.write_demo_model`, fixed seed, float32 on CPU)
and starts two in-process instances of it, each an `AsyncEngine` stepping on its own thread with an
`EngineEndpoint` over it (source and destination; KV blocks travel by `InProcessKVTransport`). For
each context length L it sends one request whose prompt is L random token ids, decoding greedily,
and the client records when each token arrives:

* unmigrated, on the source: the normal inter-token gap is the median gap after the first token
  (its largest gap is reported too: what a request that never moves already sees on this machine);
* migrated once ``migrate_after`` tokens have arrived, by each method, the client following the
  request to the destination as the gateway does (a stream that ends "migrated" continues with the
  destination's adopted stream, so every token is counted once):
  - ``tokens``: `migrate_by_tokens` (the destination recomputes the KV from the tokens in rounds);
  - ``kv``: `migrate_by_kv` (the KV blocks are copied in stages while the source decodes);
  - ``restart`` (the peer): the client's stream on the source is dropped (which aborts it) and
    the request is sent again to the destination with prompt + tokens received so far as its
    prompt, for the tokens still to come: the client waits for a full re-prefill.

The pause is the largest gap between consecutive tokens from the token at which the migration
started until the second token produced by the destination (so the stages or rounds, the stop and
the first step after it all count). Each migrated case runs ``repeats`` times, the methods
interleaved so drift hits all alike; a line reports the median pause, every pause, the stop's own
gap (``handoff_gap_ms``), the protocol's costs (rounds, blocks copied, tokens recomputed after the
stop) and whether the client received exactly the unmigrated output, token for token.

Each engine gets ``--threads`` intra-op threads (default: half the cores), so the destination's
work does not steal the source's cores, as it could not on two machines. Both engines still share
one Python process (and its GIL), which two real workers would not.

Targets (issue 8): KV-migration pause at most 2x the normal inter-token gap and flat in context
length; token-based pause independent of the length generated beyond its last round (it recomputes
at most ``max_delta_tokens`` at the stop). One JSON line per (method, context length) on stdout,
progress on stderr.

    python bench/migration.py [--quick] [--repeats N] [--seed 0] [--threads N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __package__ in (None, ""):
    # Run as a script (`python bench/migration.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migration import (  # noqa: E402
    EngineEndpoint, KVMigrationConfig, MigrationOutcome, TokenMigrationConfig, migrate_by_kv, migrate_by_tokens,
)
from worker import AsyncEngine, DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model  # noqa: E402

TARGET_KV_RATIO_TO_NORMAL_GAP = 2.0
METHODS = ("tokens", "kv", "restart")


@dataclass(frozen=True)
class BenchMode:
    """Sizes of one benchmark mode; `FULL` is the issue's benchmark, `QUICK` the CI smoke run."""

    name: str
    model: DemoModelConfig
    context_lengths: tuple[int, ...]  # prompt tokens of the request, one case each
    num_output_tokens: int  # per request: enough that token rounds end before the request does
    migrate_after: int  # output tokens the client has when the migration starts
    repeats: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("num_output_tokens", "migrate_after", "repeats", "block_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.context_lengths or min(self.context_lengths) < 1:
            raise ValueError(f"context_lengths must be non-empty lengths >= 1, got {self.context_lengths}")
        if self.migrate_after + 2 >= self.num_output_tokens:
            raise ValueError(f"migrate_after ({self.migrate_after}) must leave at least 3 tokens of "
                             f"num_output_tokens ({self.num_output_tokens}) to generate after it")
        longest = max(self.context_lengths) + self.num_output_tokens
        if longest > self.model.max_position_embeddings:
            raise ValueError(f"the longest request needs {longest} positions but the model has "
                             f"max_position_embeddings={self.model.max_position_embeddings}")


FULL = BenchMode(
    name="full",
    # 384 hidden, 4 layers, GQA 6/2 heads, the demo tokenizer's vocabulary: a few million parameters,
    # small enough that a 4096-token prefill takes about a second on one core.
    model=DemoModelConfig(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                          intermediate_size=1024, max_position_embeddings=8192, seed=0),
    context_lengths=(256, 1024, 4096),
    num_output_tokens=768,
    migrate_after=16,
    repeats=3,
)

QUICK = BenchMode(
    name="quick",
    model=DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, max_position_embeddings=512, seed=0),
    context_lengths=(16, 64),
    num_output_tokens=256,  # decode got faster (the GEMV kernel): 48 once ended before a migration began
    migrate_after=4,
    repeats=1,
    block_size=8,
    max_num_batched_tokens=32,
)


@dataclass
class ClientStream:
    """What the client received: every token once, when it arrived, and where the request moved."""

    token_ids: list[int] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)  # perf_counter per token
    handoff_index: int | None = None  # index of the first token produced by the destination
    outcome: MigrationOutcome | None = None

    def __repr__(self) -> str:  # never print token ids
        return f"ClientStream(num_tokens={len(self.token_ids)}, handoff_index={self.handoff_index})"

    def receive(self, token_ids: tuple[int, ...]) -> None:
        now = time.perf_counter()
        self.token_ids.extend(token_ids)
        self.arrival_s.extend([now] * len(token_ids))

    def gaps_s(self, first: int, end: int) -> list[float]:
        """Gaps ending at tokens ``first .. end - 1`` (token i's gap: arrival i - arrival i-1)."""
        first, end = max(first, 1), min(end, len(self.arrival_s))
        return [self.arrival_s[i] - self.arrival_s[i - 1] for i in range(first, end)]


def _log(message: str) -> None:
    print(f"[bench/migration] {message}", file=sys.stderr, flush=True)


def _greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


async def stream_following(source: EngineEndpoint, dest: EngineEndpoint, request_id: str, prompt_ids: list[int],
                           num_tokens: int, migrate_after: int | None = None,
                           migrate: Callable[[str], Awaitable[MigrationOutcome]] | None = None) -> ClientStream:
    """Streams the request from ``source``; once ``migrate_after`` tokens arrived, starts ``migrate``
    beside the stream; a stream ending "migrated" continues with the destination's adopted stream."""
    received = ClientStream()
    task: asyncio.Task | None = None
    outputs = source.async_engine.generate(prompt_ids, _greedy(num_tokens), request_id)
    while True:
        finish_reason = None
        async for out in outputs:
            received.receive(out.new_token_ids)
            finish_reason = out.finish_reason
            if task is None and migrate is not None and len(received.token_ids) >= migrate_after:
                task = asyncio.create_task(migrate(request_id))
        if finish_reason != "migrated":
            break
        if source.handoff_target(request_id) != dest.instance_id:
            raise RuntimeError(f"request {request_id} was handed to an unknown instance")
        received.handoff_index = len(received.token_ids)
        outputs = dest.adopted_stream(request_id)
    if task is not None:
        received.outcome = await task
    return received


async def stream_restarting(source: EngineEndpoint, dest: EngineEndpoint, request_id: str, prompt_ids: list[int],
                            num_tokens: int, migrate_after: int) -> ClientStream:
    """The baseline: after ``migrate_after`` tokens the client's stream on the source is closed
    (aborting the request there) and the request is sent again to ``dest`` with everything so far
    as its prompt."""
    received = ClientStream()
    outputs = source.async_engine.generate(prompt_ids, _greedy(num_tokens), request_id)
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            received.receive(out.new_token_ids)
            if len(received.token_ids) >= migrate_after:
                break
    received.handoff_index = len(received.token_ids)
    remaining = num_tokens - len(received.token_ids)
    async for out in dest.async_engine.generate(prompt_ids + received.token_ids, _greedy(remaining), request_id):
        received.receive(out.new_token_ids)
    return received


@dataclass(frozen=True)
class CaseRun:
    """One migrated request: its pause, its stop's gap, and whether the client got the right tokens."""

    pause_s: float
    handoff_gap_s: float
    output_matches: bool
    outcome: MigrationOutcome | None


def measure(stream: ClientStream, migrate_after: int, expected: list[int]) -> CaseRun:
    if stream.handoff_index is None:
        status = stream.outcome.status.value if stream.outcome is not None else "no outcome"
        raise RuntimeError(f"the request was not migrated ({status}); raise num_output_tokens")
    # From the token at which the migration started to the destination's second token.
    window = stream.gaps_s(migrate_after, stream.handoff_index + 2)
    handoff = stream.gaps_s(stream.handoff_index, stream.handoff_index + 1)
    return CaseRun(max(window), handoff[0], stream.token_ids == expected, stream.outcome)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def case_line(mode: BenchMode, method: str, context_tokens: int, runs: list[CaseRun], normal_gaps: list[float],
              restart_pause_s: float, shortest_pause_s: float | None) -> dict:
    pause_s = statistics.median(run.pause_s for run in runs)
    normal_gap_s = statistics.median(normal_gaps)
    line = {
        "bench": "migration",
        "mode": mode.name,
        "method": method,
        "context_tokens": context_tokens,
        "pause_ms": _ms(pause_s),
        "pauses_ms": [_ms(run.pause_s) for run in runs],
        "handoff_gap_ms": _ms(statistics.median(run.handoff_gap_s for run in runs)),
        "normal_gap_ms": _ms(normal_gap_s),
        "normal_max_gap_ms": _ms(max(normal_gaps)),
        "ratio_to_normal_gap": round(pause_s / normal_gap_s, 3),
        "restart_pause_ms": _ms(restart_pause_s),
        "ratio_to_restart": round(pause_s / restart_pause_s, 4),
        "pause_ratio_to_shortest_context": None if shortest_pause_s is None else round(pause_s / shortest_pause_s, 3),
        "output_matches": all(run.output_matches for run in runs),
        "migrate_after_tokens": mode.migrate_after,
        "num_output_tokens": mode.num_output_tokens,
        "repeats": len(runs),
    }
    outcomes = [run.outcome for run in runs if run.outcome is not None]
    if outcomes:
        line.update({
            "stop_ms": _ms(statistics.median(o.stop_s for o in outcomes)),
            "migration_total_ms": _ms(statistics.median(o.total_s for o in outcomes)),
            "rounds": [o.num_rounds for o in outcomes],
            "tokens_at_stop": [o.num_tokens_at_stop for o in outcomes],
            "tokens_recomputed_after_stop": [o.num_tokens_after_stop for o in outcomes],
            "blocks_copied": [o.num_blocks_copied for o in outcomes],
            "bytes_copied": [o.num_bytes_copied for o in outcomes],
        })
    if method == "kv":
        line["target_ratio_to_normal_gap"] = TARGET_KV_RATIO_TO_NORMAL_GAP
        line["meets_target"] = pause_s <= TARGET_KV_RATIO_TO_NORMAL_GAP * normal_gap_s
    return line


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cpus"


async def run_cases(mode: BenchMode, source: EngineEndpoint, dest: EngineEndpoint, vocab_size: int, seed: int,
                    emit: Callable[[dict], None]) -> None:
    rng = random.Random(seed)
    token_config, kv_config = TokenMigrationConfig(), KVMigrationConfig()
    migrations = {
        "tokens": lambda request_id: migrate_by_tokens(source, dest, request_id, token_config),
        "kv": lambda request_id: migrate_by_kv(source, dest, request_id, kv_config),
    }
    shortest: dict[str, float] = {}
    for context_tokens in sorted(mode.context_lengths):
        prompt_ids = [rng.randrange(vocab_size) for _ in range(context_tokens)]
        n = mode.num_output_tokens
        _log(f"L={context_tokens}: unmigrated request on the destination (warm-up) and on the source")
        warm = await stream_following(dest, source, f"warm-{context_tokens}", prompt_ids, n)
        unmoved = await stream_following(source, dest, f"unmoved-{context_tokens}", prompt_ids, n)
        if warm.token_ids != unmoved.token_ids:
            _log(f"WARNING: L={context_tokens}: the two instances disagree on the unmigrated output")
        normal_gaps = unmoved.gaps_s(1, n)
        _log(f"L={context_tokens}: normal gap {statistics.median(normal_gaps) * 1e3:.2f} ms "
             f"(largest {max(normal_gaps) * 1e3:.2f} ms)")
        runs: dict[str, list[CaseRun]] = {method: [] for method in METHODS}
        for repeat in range(mode.repeats):
            for method in METHODS:
                request_id = f"{method}-{context_tokens}-{repeat}"
                if method == "restart":
                    stream = await stream_restarting(source, dest, request_id, prompt_ids, n, mode.migrate_after)
                else:
                    stream = await stream_following(source, dest, request_id, prompt_ids, n, mode.migrate_after,
                                                    migrations[method])
                run = measure(stream, mode.migrate_after, unmoved.token_ids)
                runs[method].append(run)
                _log(f"L={context_tokens} {method} #{repeat}: pause {run.pause_s * 1e3:.2f} ms, hand-off gap "
                     f"{run.handoff_gap_s * 1e3:.2f} ms, output {'matches' if run.output_matches else 'DIFFERS'}")
        restart_pause_s = statistics.median(run.pause_s for run in runs["restart"])
        for method in METHODS:
            pause_s = statistics.median(run.pause_s for run in runs[method])
            shortest.setdefault(method, pause_s)
            emit(case_line(mode, method, context_tokens, runs[method], normal_gaps, restart_pause_s,
                           shortest[method]))


def run(mode: BenchMode, seed: int, threads: int, model_dir: Path, emit: Callable[[dict], None]) -> None:
    # Process-wide, and each engine thread picks it up: with threads = cores / 2 the two engines
    # do not compete for cores.
    torch.set_num_threads(threads)
    _log(f"mode={mode.name} threads={threads} per engine; writing the demo model to {model_dir}")
    write_demo_model(model_dir, mode.model, overwrite=True)
    longest = max(mode.context_lengths) + mode.num_output_tokens
    # Room for two requests at full length: the restart baseline's may overlap its source's abort.
    num_blocks = 2 * -(-longest // mode.block_size) + 8
    config = EngineConfig(block_size=mode.block_size, num_kv_blocks=num_blocks, max_num_seqs=4,
                          max_num_batched_tokens=mode.max_num_batched_tokens, dtype="float32", device="cpu")
    engines = [AsyncEngine(Engine(model_dir, config)) for _ in range(2)]
    try:
        source = EngineEndpoint(engines[0], instance_id="source")
        dest = EngineEndpoint(engines[1], instance_id="destination")
        model_config = engines[0].engine.model_config
        _log(f"model: {model_config.num_params / 1e6:.1f}M parameters, vocab {model_config.vocab_size}; "
             f"{num_blocks} KV blocks of {mode.block_size} tokens per instance")
        extra = {"params_m": round(model_config.num_params / 1e6, 1), "threads_per_engine": threads,
                 "torch": torch.__version__, "machine": _machine()}
        asyncio.run(run_cases(mode, source, dest, model_config.vocab_size, seed, lambda line: emit({**line, **extra})))
    finally:
        for engine in engines:
            engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and contexts (seconds; what CI runs)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"migrations per case (default {FULL.repeats}, {QUICK.repeats} with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (the model's seed is fixed)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch intra-op threads per engine (default: half the cores)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write the demo model (replaced if present; default: a temp dir)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        mode = dataclasses.replace(mode, repeats=args.repeats)
    if args.threads < 1:
        parser.error("--threads must be >= 1")

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)

    start = time.perf_counter()
    if args.out_dir is not None:
        run(mode, args.seed, args.threads, args.out_dir, emit)
    else:
        with tempfile.TemporaryDirectory(prefix="thaw-bench-migration-") as tmp:
            run(mode, args.seed, args.threads, Path(tmp) / "model", emit)
    _log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
