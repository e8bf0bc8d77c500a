"""Engine throughput and decode latency on a GPU: Thaw's engine against `transformers.generate`.

`bench/engine.py`'s workload, on CUDA in bfloat16. One run writes a random-weight Llama with
Qwen2-0.5B's body (hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864) and a
32000-token vocabulary (so the locally trained tokenizer stays small), tied embeddings: 0.39B
parameters, 0.77 GB in bf16 (``--quick``: the ~3M-parameter demo model). A seeded workload of
requests with varied prompt lengths (given as token ids) and output lengths, greedy, EOS ignored,
is served in the same process:

* ours: `worker.Engine` on the GPU (Triton paged attention, KV cache on the GPU, ``max_model_len``
  the workload's longest), every request added at once, stepped until all are done (continuous
  batching, chunked prefill), after one untimed pass of the same workload (the engine captures a
  CUDA graph per decode batch size on its first use; vLLM captures them at start);
* the peer: the transformers model in bf16 on the same GPU, the requests in arrival order in
  static left-padded batches of each size in ``hf_batch_sizes`` (its best size counts) with the
  default dynamic KV cache; a second line compares with a static KV cache at the best size
  (transformers compiles the decode step for it, with CUDA graphs; a failure is reported, not raised).

vLLM's CUDA build is the issue's peer but cannot run on the lent machine: a line says why.

Besides tokens/s and their ratio, each line reports per-step decode latency at batch 1 and 32
(1 and 4 with ``--quick``; ours: the median time of an engine step in which every request decodes; transformers: from
``generate(n) - generate(1)``), and how far the first request's tokens match between the two
(greedy in bf16 on random weights has near-ties that rounding may flip, so a fraction, not a check).
Target (issue 26): throughput >= 1.0x vLLM's; measured here against transformers.

    python bench/engine_gpu.py [--quick] [--device cuda] [--num-requests N] [--work-dir DIR] [--no-static-cache]

One JSON line per comparison on stdout; without a CUDA device one skipped line, exit 0.
``--device cpu`` runs the same code on the CPU (a smoke run; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import VLLM_NOT_RUN, cuda_missing_reason, emit, log  # noqa: E402

BENCH = "engine_gpu"
TARGET_THROUGHPUT_RATIO = 1.0  # vs vLLM in the issue; vs transformers here


@dataclass(frozen=True)
class GpuEngineMode:
    """Sizes of one run; `FULL` is the issue's benchmark, `QUICK` a smoke run."""

    name: str
    model_kwargs: dict  # DemoModelConfig(**model_kwargs); a dict keeps torch out of the import
    num_requests: int
    prompt_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    hf_batch_sizes: tuple[int, ...]
    latency_batch_sizes: tuple[int, ...]
    latency_prompt_len: int
    latency_output_len: int
    latency_repeats: int
    static_cache: bool

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError("num_requests and every hf batch size must be >= 1")
        if self.latency_output_len < 2:
            raise ValueError(f"latency_output_len must be >= 2, got {self.latency_output_len}")

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_len_range[1] + self.output_len_range[1],
                   self.latency_prompt_len + self.latency_output_len)


FULL = GpuEngineMode(
    name="full",
    model_kwargs=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=32000, tie_word_embeddings=True,
                      max_position_embeddings=2048, dtype="bfloat16", seed=0),
    num_requests=128, prompt_len_range=(16, 512), output_len_range=(16, 256), hf_batch_sizes=(32, 128),
    latency_batch_sizes=(1, 32), latency_prompt_len=128, latency_output_len=64, latency_repeats=3,
    static_cache=True,
)
QUICK = GpuEngineMode(
    name="quick", model_kwargs=dict(dtype="bfloat16", seed=0), num_requests=8, prompt_len_range=(4, 32),
    output_len_range=(4, 16), hf_batch_sizes=(8,), latency_batch_sizes=(1, 4), latency_prompt_len=16,
    latency_output_len=8, latency_repeats=1, static_cache=False,
)


def _log(message: str) -> None:
    log("bench/engine_gpu", message)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- ours --------------------------------------------------------------------------------------


def greedy(num_tokens: int):
    from worker import SamplingParams

    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)


def thaw_ms_per_step(engine, prompts: list[tuple[int, ...]], num_tokens: int) -> float:
    """Median wall time of the engine steps in which every one of `prompts` decodes (each had its
    first token before the step, and each gets one from it)."""
    request_ids = {engine.add_request(list(p), greedy(num_tokens)) for p in prompts}
    started: set[str] = set()
    step_s = []
    while engine.has_unfinished_requests():
        all_decoding = started == request_ids
        start = time.perf_counter()
        outputs = engine.step()  # tokens come back as Python ints: the step is finished on the GPU
        elapsed_s = time.perf_counter() - start
        got = {o.request_id for o in outputs if o.new_token_ids}
        started |= got
        if all_decoding and got == request_ids:
            step_s.append(elapsed_s)
    if not step_s:
        raise RuntimeError(f"no decode-only step among {len(prompts)} requests of {num_tokens} tokens")
    return statistics.median(step_s) * 1e3


# ---- transformers -------------------------------------------------------------------------------


def load_transformers_model(model_dir: Path, device):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None  # every row generates max_new_tokens, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts: list[tuple[int, ...]], max_new_tokens: int, static_cache: dict | None = None
                ) -> list[list[int]]:
    """One left-padded static batch; the new tokens per row. `static_cache`: use a static KV cache,
    with these extra generate arguments (``max_cache_len``: the same size for every batch, so the
    compiled decode step is reused)."""
    import torch

    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)  # [B, L], pad id 0
    attention_mask = torch.zeros(len(prompts), max_len, dtype=torch.long)  # [B, L]
    for row, prompt in enumerate(prompts):
        input_ids[row, max_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, max_len - len(prompt):] = 1
    kwargs = {} if static_cache is None else {"cache_implementation": "static", **static_cache}
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    new_tokens = out[:, max_len:].tolist()  # [B, max_new_tokens]; waits for the GPU
    if len(new_tokens[0]) != max_new_tokens:
        raise RuntimeError(f"transformers generated {len(new_tokens[0])} tokens, asked for {max_new_tokens}")
    return new_tokens


def run_transformers(model, requests, batch_size: int, static_cache: dict | None = None):
    """Arrival order, static batches, each run to its longest request's output length."""
    from bench.engine import WorkloadResult

    start = time.perf_counter()
    token_ids = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        rows = hf_generate(model, [r.prompt_token_ids for r in batch], max(r.num_output_tokens for r in batch),
                           static_cache)
        token_ids += [tuple(row[:r.num_output_tokens]) for row, r in zip(rows, batch)]
    elapsed_s = time.perf_counter() - start
    return WorkloadResult(sum(len(ids) for ids in token_ids), elapsed_s, token_ids)


def transformers_ms_per_step(model, prompts: list[tuple[int, ...]], num_tokens: int) -> float:
    """Decode time per step for a batch of equal-length prompts: (t(n) - t(1)) / (n - 1)."""
    start = time.perf_counter()
    hf_generate(model, prompts, 1)
    one_s = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, prompts, num_tokens)
    all_s = time.perf_counter() - start
    return max(all_s - one_s, 0.0) / (num_tokens - 1) * 1e3


# ---- the run -------------------------------------------------------------------------------------


def match_fraction(ours: tuple[int, ...], theirs: tuple[int, ...]) -> float:
    """Share of the planned tokens before the first difference (greedy: later tokens follow from it)."""
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return round(same / max(len(ours), 1), 3)


def engine_config(mode: GpuEngineMode, requests, device: str, block_size: int = 16):
    from worker import EngineConfig

    # KV for every request at full length (the benchmark measures batching, not preemption), and
    # for the largest latency batch.
    num_blocks = sum(-(-(len(r.prompt_token_ids) + r.num_output_tokens) // block_size) for r in requests)
    latency_blocks = max(mode.latency_batch_sizes) * -(-mode.max_model_len // block_size)
    return EngineConfig(block_size=block_size, num_kv_blocks=max(num_blocks, latency_blocks) + 16,
                        max_num_seqs=max(len(requests), *mode.latency_batch_sizes), max_num_batched_tokens=4096,
                        max_model_len=mode.max_model_len, dtype="bfloat16", device=device)


def run(mode: GpuEngineMode, num_requests: int, device_name: str, model_dir: Path) -> Iterator[dict]:
    """Yields each comparison's line as soon as it is measured."""
    import torch

    from bench.engine import BenchRequest, make_requests, run_thaw
    from worker import DemoModelConfig, Engine, write_demo_model
    from worker.models.demo_model import demo_weight_shapes

    device = torch.device(device_name)
    model_config = DemoModelConfig(**mode.model_kwargs)
    write_demo_model(model_dir, model_config, overwrite=True)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    num_params = sum(torch.Size(s).numel() for s in demo_weight_shapes(model_config, vocab_size).values())
    requests = make_requests(num_requests, vocab_size, mode.prompt_len_range, mode.output_len_range, seed=0)
    _log(f"model {num_params / 1e6:.1f}M params bf16 on {device_name}; {len(requests)} requests, "
         f"{sum(r.num_output_tokens for r in requests)} output tokens")
    engine = Engine(model_dir, engine_config(mode, requests, device_name))
    hf = load_transformers_model(model_dir, device)

    latency_prompts = {b: [r.prompt_token_ids for r in make_requests(b, vocab_size, (mode.latency_prompt_len,) * 2,
                                                                     (1, 1), seed=b)] for b in mode.latency_batch_sizes}
    warmup = [BenchRequest(latency_prompts[1][0][:8], 4), BenchRequest(latency_prompts[1][0][:5], 3)]
    run_thaw(engine, warmup)  # compiles the Triton kernels
    run_transformers(hf, warmup, 2)
    # An untimed pass of the workload: our engine captures a decode graph for each batch size on
    # first use (vLLM captures them at start), so the timed pass measures the steady state.
    run_thaw(engine, requests)
    for prompts in latency_prompts.values():
        thaw_ms_per_step(engine, prompts, 4)
    _sync(device)

    thaw = run_thaw(engine, requests)
    _log(f"thaw: {thaw.tokens_per_s:.1f} tok/s")
    hf_by_batch = {}
    for batch_size in mode.hf_batch_sizes:
        hf_by_batch[batch_size] = run_transformers(hf, requests, batch_size)
        _log(f"transformers, batches of {batch_size}: {hf_by_batch[batch_size].tokens_per_s:.1f} tok/s")
    best_batch = max(hf_by_batch, key=lambda b: hf_by_batch[b].tokens_per_s)

    thaw_ms, hf_ms = {}, {}
    for batch, prompts in latency_prompts.items():
        ours, theirs = [], []
        for _ in range(mode.latency_repeats):  # interleaved, so drift hits both alike
            ours.append(thaw_ms_per_step(engine, prompts, mode.latency_output_len))
            theirs.append(transformers_ms_per_step(hf, prompts, mode.latency_output_len))
        thaw_ms[str(batch)], hf_ms[str(batch)] = round(statistics.median(ours), 3), round(statistics.median(theirs), 3)
    _log(f"ms per decode step by batch: thaw {thaw_ms}, transformers {hf_ms}")

    common = {
        "bench": BENCH, "mode": mode.name, "device": _device_label(device), "params_m": round(num_params / 1e6, 1),
        "model_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")), "dtype": "bfloat16",
        "num_requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "generated_tokens": thaw.num_generated_tokens, "thaw_tokens_per_s": round(thaw.tokens_per_s, 1),
        "thaw_ms_per_decode_step": thaw_ms, "transformers_ms_per_decode_step": hf_ms,
        "latency_prompt_len": mode.latency_prompt_len, "target_throughput_ratio": TARGET_THROUGHPUT_RATIO,
        "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
    }
    yield _comparison(common, "vs-transformers-dynamic-cache", thaw, hf_by_batch[best_batch], best_batch, "dynamic",
                      {str(b): round(r.tokens_per_s, 1) for b, r in hf_by_batch.items()})
    if not mode.static_cache:
        return
    failures = []
    # One cache size for all batches where this transformers takes max_cache_len, else its default.
    for static_cache in ({"max_cache_len": mode.max_model_len}, {}):
        try:
            run_transformers(hf, requests[:best_batch], best_batch, static_cache)  # compiles the decode step
            static = run_transformers(hf, requests, best_batch, static_cache)
        except Exception as exc:  # noqa: BLE001 - the peer's optional mode; report why and go on
            failures.append(f"{static_cache or 'default size'}: {type(exc).__name__}: {str(exc)[:300]}")
            _log(f"transformers' static cache failed with {failures[-1]}")
            continue
        _log(f"transformers, static cache, batches of {best_batch}: {static.tokens_per_s:.1f} tok/s")
        yield _comparison(common, "vs-transformers-static-cache", thaw, static, best_batch, "static", {})
        return
    yield {"bench": BENCH, "mode": mode.name, "case": "vs-transformers-static-cache",
           "skipped": "transformers' static cache failed: " + "; ".join(failures)}


def _comparison(common: dict, case: str, thaw, peer, batch_size: int, cache: str, by_batch: dict) -> dict:
    ratio = thaw.tokens_per_s / peer.tokens_per_s
    fractions = [match_fraction(a, b) for a, b in zip(thaw.output_token_ids, peer.output_token_ids)]
    line = {**common, "case": case, "transformers_cache": cache, "transformers_batch_size": batch_size,
            "transformers_tokens_per_s": round(peer.tokens_per_s, 1), "throughput_ratio": round(ratio, 3),
            "first_request_match_fraction": fractions[0],
            "mean_match_fraction": round(sum(fractions) / len(fractions), 3)}
    if by_batch:
        line["transformers_tokens_per_s_by_batch_size"] = by_batch
    line["summary"] = {"case": f"throughput {case}", "ours": f"{thaw.tokens_per_s:.0f} tok/s",
                       "peer": f"{peer.tokens_per_s:.0f} tok/s (HF {cache} cache, batch {batch_size})",
                       "ratio": round(ratio, 3), "target_met": ratio >= TARGET_THROUGHPUT_RATIO}
    return line


def _device_label(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--num-requests", type=int, default=None, help="requests in the workload (full: 128)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model is written (default: temp)")
    parser.add_argument("--no-static-cache", action="store_true", help="skip transformers' static-cache run")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.no_static_cache:
        mode = dataclasses.replace(mode, static_cache=False)
    num_requests = mode.num_requests if args.num_requests is None else args.num_requests
    if num_requests < 1:
        parser.error("--num-requests must be >= 1")
    missing = cuda_missing_reason(args.device)
    if missing is not None:
        emit({"bench": BENCH, "mode": mode.name, "skipped": missing})
        return 0
    emit({"bench": BENCH, "mode": mode.name, "peer": "vllm-cuda", "skipped": VLLM_NOT_RUN})
    with tempfile.TemporaryDirectory(prefix="thaw-engine-gpu-", dir=args.work_dir) as tmp:
        for line in run(mode, num_requests, args.device, Path(tmp) / "model"):
            emit(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
