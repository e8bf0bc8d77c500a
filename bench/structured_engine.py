"""Structured output's cost to the engine's decode step: 8 structured requests against 8 free ones.

The same engine decodes 8 requests at a time, seeded sampling at temperature 1.0, either free
(the no-grammar baseline) or each under a JSON schema (bench/grammar.py's user record), and every
decode step with all 8 rows in it is timed (`Engine.step`, whole: forward pass, masks, sampling,
acceptance, detokenizing). Structured rows run twice: with the grammar masks computed on the
engine's helper thread while the forward pass runs (``overlap_structured_output=True``, the
default) and inline before it (False). Also timed alone: the batched mask fill of the 8 rows
(`GrammarEngine.fill_bitmasks`) at each position of the structured runs' outputs, replayed -- the
work the overlap hides, though replayed back to back it runs from warm caches, where a step's fill
follows a forward pass that evicted them (the steps' own difference, inline minus free, is the
whole grammar cost: fill, masking the logits, accepting the tokens).

Models, float32 on CPU, random weights (`worker.models.demo_model`):

* ``tiny``: 2 layers of 64, the demo tokenizer (1k tokens): the forward pass is cheap, so the
  grammar's share of a step is as large as it gets;
* ``large-128k`` (full mode only): bench/engine.py's ~100M-parameter shape (12 layers of 768) with
  Llama 3's 128k-token vocab (174M parameters with the tied embedding) and a byte-level BPE of 128k
  tokens trained here (bench/grammar.py's, no network).

Rounds alternate the cases (free, overlapped, inline) so drift on a shared machine hits each alike;
each case's figure is the median step. Prints one JSON line; progress on stderr.

    python bench/structured_engine.py [--quick] [--steps 24] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grammar import SCHEMA, build_tokenizer_dir, make_words  # noqa: E402
from wire import GrammarSpec  # noqa: E402
from worker.models.demo_model import DemoModelConfig, demo_weight_shapes, write_demo_model  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.engine_config import EngineConfig  # noqa: E402
from wire.sampling_params import SamplingParams  # noqa: E402

NUM_ROWS = 8
TINY = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=1024, init_std=0.1, seed=0)
# bench/engine.py's ~100M shape, with Llama 3's vocab size.
LARGE = DemoModelConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        intermediate_size=2048, vocab_size=128000, tie_word_embeddings=True,
                        max_position_embeddings=1024, seed=0)
LARGE_TOKENIZER = dict(vocab_size=128000, corpus_lines=200_000, num_words=60_000)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_model(out_dir: Path, config: DemoModelConfig, tokenizer: dict | None) -> Path:
    """The demo model; with `tokenizer` settings, its tokenizer.json swapped for a BPE trained to
    that size (the same special tokens first, so the model's special ids hold)."""
    model_dir = write_demo_model(out_dir / "model", config, overwrite=True)
    if tokenizer is not None:
        words = make_words(random.Random(1), tokenizer["num_words"])
        trained = build_tokenizer_dir(Path(tempfile.mkdtemp(dir=out_dir)), tokenizer["vocab_size"],
                                      tokenizer["corpus_lines"], words)
        shutil.copy(trained / "tokenizer.json", model_dir / "tokenizer.json")
    return model_dir


def params(structured: bool, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          structured_output=GrammarSpec.json_schema(SCHEMA) if structured else None)


def decode_steps_ms(engine: Engine, structured: bool, num_steps: int, round_index: int,
                    outputs_seen: list[list[int]] | None = None) -> list[float]:
    """Times up to `num_steps` decode steps with all NUM_ROWS rows in them; then aborts the rest,
    adding their output tokens to `outputs_seen`."""
    ids = [engine.add_request(f"Record {i} as JSON:", params(structured, 100 * round_index + i, num_steps + 2))
           for i in range(NUM_ROWS)]
    engine.step()  # the prefills, and the first tokens
    times_ms = []
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) != NUM_ROWS or any(out.finished for out in outputs):
            break  # a row finished (or failed): the step no longer has the 8 rows
        times_ms.append(elapsed * 1e3)
    for rid in ids:
        if outputs_seen is not None:
            outputs_seen.append(list(engine.requests.sequence(rid).output_token_ids))
        engine.abort(rid)
    return times_ms


def fill_ms(engine: Engine, outputs: list[list[int]]) -> float:
    """Median time of one batched mask fill of NUM_ROWS matchers, at every position of the outputs
    given (NUM_ROWS at a time), as the steps that generated them filled them."""
    grammar = engine.structured_output.grammar_engine()
    spec = GrammarSpec.json_schema(SCHEMA)
    bitmask = grammar.allocate_bitmask(NUM_ROWS)
    times = []
    for first in range(0, len(outputs) - NUM_ROWS + 1, NUM_ROWS):
        group = outputs[first:first + NUM_ROWS]
        matchers = [grammar.matcher(spec) for _ in group]
        for position in range(min(len(tokens) for tokens in group)):
            start = time.perf_counter()
            grammar.fill_bitmasks([(m, row) for row, m in enumerate(matchers)], bitmask)
            times.append((time.perf_counter() - start) * 1e3)
            for matcher, tokens in zip(matchers, group):
                if not matcher.accept_token(tokens[position]):
                    raise RuntimeError("a generated token does not fit the grammar: the masks were not applied")
    return statistics.median(times)


def measure(name: str, model_dir: Path, num_params: int, num_steps: int, rounds: int) -> dict:
    config = EngineConfig(block_size=16, num_kv_blocks=NUM_ROWS * (-(-(num_steps + 40) // 16)) + 16,
                          max_num_seqs=NUM_ROWS, dtype="float32", device="cpu",
                          cpu_prepack_defer_bytes=None)  # packed at load: the steady state
    engines = {"overlap": Engine(model_dir, config),
               "inline": Engine(model_dir, replace(config, overlap_structured_output=False))}
    start = time.perf_counter()
    for engine in engines.values():  # warm-up: builds the grammar engines and compiles the schema
        decode_steps_ms(engine, True, 2, 0)
        decode_steps_ms(engine, False, 2, 0)
    log(f"{name}: warm-up in {time.perf_counter() - start:.1f}s")
    cases = {"free": (engines["overlap"], False), "structured_overlap": (engines["overlap"], True),
             "structured_inline": (engines["inline"], True)}
    steps: dict[str, list[float]] = {case: [] for case in cases}
    structured_outputs: list[list[int]] = []
    for round_index in range(1, rounds + 1):
        for case, (engine, structured) in cases.items():
            steps[case].extend(decode_steps_ms(engine, structured, num_steps, round_index,
                                               structured_outputs if structured else None))
        log(f"{name}: round {round_index}: " + ", ".join(
            f"{case} {statistics.median(times):.2f} ms" for case, times in steps.items() if times))
    figures = {case: round(statistics.median(times), 3) for case, times in steps.items()}
    vocab_size = engines["overlap"].model_config.vocab_size
    return {
        "model": name, "params_m": round(num_params / 1e6, 1), "vocab_size": vocab_size,
        "tokenizer_vocab_size": engines["overlap"].tokenizer.vocab_size,
        "free_ms_per_step": figures["free"],
        "structured_overlap_ms_per_step": figures["structured_overlap"],
        "structured_inline_ms_per_step": figures["structured_inline"],
        "ratio_overlap_to_free": round(figures["structured_overlap"] / figures["free"], 3),
        "ratio_inline_to_free": round(figures["structured_inline"] / figures["free"], 3),
        "fill_ms_8_rows_replayed": round(fill_ms(engines["overlap"], structured_outputs), 3),
        "steps_timed": {case: len(times) for case, times in steps.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only, few steps (CI smoke)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per round and case")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args()
    num_steps = args.steps or (6 if args.quick else 24)
    rounds = args.rounds or (1 if args.quick else 5)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    models = [("tiny", TINY, None)] + ([] if args.quick else [("large-128k", LARGE, LARGE_TOKENIZER)])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, tokenizer in models:
            start = time.perf_counter()
            model_dir = write_model(Path(tmp) / name, config, tokenizer)
            vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            num_params = sum(torch.Size(s).numel() for s in demo_weight_shapes(config, vocab_size).values())
            log(f"{name}: {num_params / 1e6:.1f}M parameters, written in {time.perf_counter() - start:.1f}s")
            results.append(measure(name, model_dir, num_params, num_steps, rounds))
    print(json.dumps({
        "bench": "structured_engine", "mode": "quick" if args.quick else "full", "rows": NUM_ROWS,
        "threads": threads, "cpus": os.cpu_count(), "models": results,
    }))


if __name__ == "__main__":
    main()
