"""transformers' side of the engine benchmark: `generate` in left-padded static batches (split from `bench/engine.py`).

Each batch generates as many tokens as its longest request wants (the usual way to serve a list
of prompts with `generate`); EOS is disabled, so every row produces exactly ``max_new_tokens``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.engine_workload import BenchRequest, WorkloadResult


def load_transformers_model(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # No EOS: every row generates exactly max_new_tokens, like Thaw with ignore_eos. An explicit
    # pad id keeps generate from borrowing EOS for it.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate(model, prompts: list[tuple[int, ...]], max_new_tokens: int) -> torch.Tensor:
    """Left-padded static batch; returns the new tokens, [B, max_new_tokens]."""
    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)  # [B, L], pad id 0
    attention_mask = torch.zeros(len(prompts), max_len, dtype=torch.long)  # [B, L]
    for row, prompt in enumerate(prompts):
        input_ids[row, max_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, max_len - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )  # [B, L + max_new_tokens]
    new_tokens = out[:, max_len:]
    if new_tokens.shape[1] != max_new_tokens:
        raise RuntimeError(f"transformers generated {new_tokens.shape[1]} tokens, asked for {max_new_tokens}")
    return new_tokens


def run_transformers(model, requests: list[BenchRequest], batch_size: int) -> WorkloadResult:
    """Arrival order, static batches; each batch runs to its longest request's output length."""
    start = time.perf_counter()
    token_ids: list[tuple[int, ...]] = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        new_tokens = _hf_generate(model, [r.prompt_token_ids for r in batch],
                                  max(r.num_output_tokens for r in batch))
        for row, request in enumerate(batch):
            token_ids.append(tuple(new_tokens[row, :request.num_output_tokens].tolist()))
    elapsed_s = time.perf_counter() - start
    return WorkloadResult(sum(len(ids) for ids in token_ids), elapsed_s, token_ids)


def transformers_batch1_s_per_token(model, prompt_token_ids: tuple[int, ...], num_output_tokens: int) -> float:
    """Decode time per token for one request alone: (t(n) - t(1)) / (n - 1)."""
    start = time.perf_counter()
    _hf_generate(model, [prompt_token_ids], 1)
    one_s = time.perf_counter() - start
    start = time.perf_counter()
    _hf_generate(model, [prompt_token_ids], num_output_tokens)
    all_s = time.perf_counter() - start
    return max(all_s - one_s, 0.0) / (num_output_tokens - 1)
