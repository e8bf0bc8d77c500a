"""Structured output's per-token cost: llguidance (what Thaw uses) against xgrammar.

The cost a grammar adds to each decode step of a structured request is the time to compute the
next token's mask. Both libraries run the same task on the same tokenizer:

* tokenizer: a byte-level BPE with Llama 3's special tokens, trained here (no network) on a
  seeded generated corpus of prose, JSON and code, to 128k tokens (Llama 3's vocab size; 8k
  with ``--quick``), loaded through `worker.Tokenizer`;
* grammar: one JSON schema of a user record (bounded strings, an integer range, an enum, a
  boolean, an array, a nested object with a pattern; no additional properties), each library
  with its defaults for whitespace (any JSON whitespace; Thaw's engine bounds each run at 32);
* outputs: seeded documents valid against the schema (half compact, half indented), each
  tokenized as a model would emit it, then the end-of-sequence token. For every token, each
  library computes the mask (timed alone), the token is checked to be allowed, and accepted.

llguidance runs through `worker.text.structured_output.GrammarMatcher` (its small checks included);
xgrammar through its own `GrammarMatcher` on a `TokenizerInfo` built from the same vocab (its
grammar compiled ahead, as it must be). One warm-up document per library is not timed. Also
reported: each library's one-off set-up (tokenizer and grammar compile), and the cost of
applying one mask to one row of logits (`worker.text.structured_output.apply_token_bitmask` against
xgrammar's CPU kernel). Prints one JSON line; progress on stderr.

    python bench/grammar.py [--quick] [--documents 50] [--vocab-size 128000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.models.demo_model import BOS_TOKEN, EOT_TOKEN, SPECIAL_TOKENS  # noqa: E402
from wire import GrammarSpec  # noqa: E402
from worker.text.structured_output import GrammarEngine, apply_token_bitmask  # noqa: E402
from worker.text.tokenizer import Tokenizer  # noqa: E402

FULL = dict(vocab_size=128000, corpus_lines=200_000, documents=50)
QUICK = dict(vocab_size=8000, corpus_lines=8_000, documents=5)
CHOSEN = "llguidance"  # what worker.text.structured_output uses

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 40},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "active", "tags", "address"],
    "additionalProperties": False,
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_words(rng: random.Random, count: int) -> list[str]:
    onsets = ["", "b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
              "pl", "qu", "r", "s", "sh", "st", "str", "t", "th", "tr", "v", "w", "z"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ie", "ou", "oo", "y"]
    codas = ["", "", "n", "r", "s", "t", "st", "nd", "ng", "ck", "l", "m", "x", "rt"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                          for _ in range(rng.randint(1, 4))))
    return sorted(words)


def corpus(seed: int, num_lines: int, words: list[str]):
    """Prose, JSON and code lines over a Zipf-like vocabulary of made-up words."""
    rng = random.Random(seed)
    cum_weights = list(itertools.accumulate(1.0 / (i + 1) ** 0.9 for i in range(len(words))))
    for _ in range(num_lines):
        picked = rng.choices(words, cum_weights=cum_weights, k=rng.randint(5, 25))
        kind = rng.random()
        if kind < 0.6:
            text = " ".join(picked)
            yield text[0].upper() + text[1:] + rng.choice([".", "!", "?", ","])
        elif kind < 0.85:
            values = [rng.randint(-10**6, 10**6), round(rng.uniform(-1e3, 1e3), 3), True, None, [1, 2, 3],
                      " ".join(rng.choices(words, cum_weights=cum_weights, k=3))]
            yield json.dumps({w: rng.choice(values) for w in picked[:6]}, indent=rng.choice([None, 2]))
        else:
            yield f"def {picked[0]}({', '.join(picked[1:4])}):\n    return {' + '.join(picked[1:4])}\n"


def build_tokenizer_dir(out_dir: Path, vocab_size: int, num_lines: int, words: list[str]) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(0, num_lines, words), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN}))
    return out_dir


def make_documents(seed: int, count: int, words: list[str]) -> list[str]:
    """Documents valid against SCHEMA, half compact (", " / ": ") and half indented."""
    rng = random.Random(seed)

    def text(max_chars: int) -> str:
        out = " ".join(rng.choices(words, k=rng.randint(1, 6)))
        return out[:max_chars].strip() or "x"

    documents = []
    for index in range(count):
        doc = {
            "name": text(40), "age": rng.randint(0, 150), "email": f"{text(20).replace(' ', '.')}@{text(12)}.org",
            "role": rng.choice(["admin", "user", "guest"]), "active": rng.random() < 0.5,
            "tags": [text(20) for _ in range(rng.randint(0, 5))],
            "address": {"street": f"{rng.randint(1, 999)} {text(30)}", "zip": f"{rng.randint(0, 99999):05d}"},
        }
        documents.append(json.dumps(doc, indent=2 if index % 2 else None))
    return documents


def allowed(bitmask_row: torch.Tensor, token_id: int) -> bool:
    return bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)


def run_llguidance(engine: GrammarEngine, spec: GrammarSpec, docs: list[list[int]]) -> list[int]:
    bitmask = engine.allocate_bitmask(1)
    times_ns: list[int] = []
    for doc in docs:
        matcher = engine.matcher(spec)
        for token_id in doc:
            start = time.perf_counter_ns()
            matcher.fill_bitmask(bitmask, 0)
            times_ns.append(time.perf_counter_ns() - start)
            if not allowed(bitmask[0], token_id) or not matcher.accept_token(token_id):
                raise RuntimeError(f"llguidance refused token {token_id} of a valid document")
        if not matcher.is_terminated():
            raise RuntimeError("llguidance did not terminate at the end-of-sequence token")
    return times_ns


def run_xgrammar(compiled, vocab_size: int, docs: list[list[int]]) -> list[int]:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    times_ns: list[int] = []
    for doc in docs:
        matcher = xgrammar.GrammarMatcher(compiled)
        for token_id in doc:
            start = time.perf_counter_ns()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times_ns.append(time.perf_counter_ns() - start)
            if not allowed(bitmask[0], token_id) or not matcher.accept_token(token_id):
                raise RuntimeError(f"xgrammar refused token {token_id} of a valid document")
        if not matcher.is_terminated():
            raise RuntimeError("xgrammar did not terminate at the end-of-sequence token")
    return times_ns


def figures_us(times_ns: list[int]) -> dict:
    a = np.asarray(times_ns, dtype=np.float64) / 1e3
    return {"mean_us": round(float(a.mean()), 2), "p50_us": round(float(np.percentile(a, 50)), 2),
            "p99_us": round(float(np.percentile(a, 99)), 2)}


def time_apply_us(fn, vocab_size: int, repeats: int) -> float:
    """Median time to mask one row of float32 logits with a half-allowed mask."""
    logits = torch.randn(1, vocab_size)
    bitmask = torch.randint(-2**31, 2**31 - 1, (1, (vocab_size + 31) // 32), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn(logits, bitmask)
        samples.append(time.perf_counter_ns() - start)
    return round(float(np.median(samples)) / 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small vocab, few documents (CI smoke; figures meaningless)")
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    if args.documents is not None:
        settings["documents"] = args.documents
    if args.vocab_size is not None:
        settings["vocab_size"] = args.vocab_size
    torch.set_num_threads(1)

    import xgrammar

    words = make_words(random.Random(1), 60_000 if not args.quick else 6_000)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        tokenizer = Tokenizer.from_dir(build_tokenizer_dir(Path(tmp), settings["vocab_size"],
                                                           settings["corpus_lines"], words))
        log(f"trained a {tokenizer.vocab_size}-token BPE in {time.perf_counter() - start:.1f}s")
    vocab_size = tokenizer.vocab_size
    eos_id = tokenizer.eos_token_ids[0]
    docs = [tokenizer.encode(doc, add_special_tokens=False) + [eos_id]
            for doc in make_documents(2, settings["documents"] + 1, words)]
    spec = GrammarSpec.json_schema(SCHEMA)

    start = time.perf_counter()
    engine = GrammarEngine(tokenizer, vocab_size)
    llg_tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile(spec)
    llg_compile_s = time.perf_counter() - start

    start = time.perf_counter()
    vocab = tokenizer.convert_ids_to_tokens(range(vocab_size))
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                  stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    xgr_tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    xgr_compile_s = time.perf_counter() - start
    log(f"set-up: llguidance {llg_tokenizer_s:.2f}s + {llg_compile_s:.4f}s, "
        f"xgrammar {xgr_tokenizer_s:.2f}s + {xgr_compile_s:.2f}s")

    run_llguidance(engine, spec, docs[:1])  # warm-up
    run_xgrammar(compiled, vocab_size, docs[:1])
    llg = figures_us(run_llguidance(engine, spec, docs[1:]))
    xgr = figures_us(run_xgrammar(compiled, vocab_size, docs[1:]))
    log(f"llguidance {llg}, xgrammar {xgr}")

    repeats = 50 if args.quick else 500
    apply_thaw_us = time_apply_us(apply_token_bitmask, vocab_size, repeats)
    apply_xgr_us = time_apply_us(lambda logits, bitmask: xgrammar.apply_token_bitmask_inplace(logits, bitmask),
                                 vocab_size, repeats)

    print(json.dumps({
        "bench": "grammar", "mode": "quick" if args.quick else "full",
        "vocab_size": vocab_size, "documents": settings["documents"],
        "tokens": sum(len(doc) for doc in docs[1:]),
        "llguidance_mean_us": llg["mean_us"], "llguidance_p50_us": llg["p50_us"], "llguidance_p99_us": llg["p99_us"],
        "xgrammar_mean_us": xgr["mean_us"], "xgrammar_p50_us": xgr["p50_us"], "xgrammar_p99_us": xgr["p99_us"],
        # Four significant digits, not three decimals: a ratio of 0.03 (seen on a loaded machine)
        # kept only two, 1.3% off the figures it is computed from.
        "mean_ratio_xgrammar_to_llguidance": float(f"{xgr['mean_us'] / llg['mean_us']:.4g}"),
        "p99_ratio_xgrammar_to_llguidance": float(f"{xgr['p99_us'] / llg['p99_us']:.4g}"),
        "llguidance_setup_s": {"tokenizer": round(llg_tokenizer_s, 3), "grammar": round(llg_compile_s, 4)},
        "xgrammar_setup_s": {"tokenizer": round(xgr_tokenizer_s, 3), "grammar": round(xgr_compile_s, 4)},
        "apply_one_row_us": {"thaw": apply_thaw_us, "xgrammar_cpu_kernel": apply_xgr_us},
        "chosen": CHOSEN,
        "versions": {"llguidance": _version("llguidance"), "xgrammar": _version("xgrammar")},
    }))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
