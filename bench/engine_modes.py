"""The engine benchmark's modes (split from `bench/engine.py`): the sizes of each run.

`BenchMode` sizes the throughput and batch-1 run against transformers and vLLM (`FULL` is issue
2's benchmark, `QUICK` the CI smoke run); `SharedPrefixMode` sizes ``--shared-prefix``'s burst of
requests behind one system prompt (`SHARED_FULL`, `SHARED_QUICK`), on the same models.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.demo_model import DemoModelConfig


@dataclass(frozen=True)
class BenchMode:
    """Sizes of one benchmark mode; `full` is the issue's benchmark, `quick` the CI smoke run."""

    name: str
    model: DemoModelConfig
    num_requests: int
    prompt_len_range: tuple[int, int]  # inclusive
    output_len_range: tuple[int, int]  # inclusive
    hf_batch_sizes: tuple[int, ...]  # transformers' static batch sizes tried; the best one counts
    batch1_prompt_len: int
    batch1_output_len: int
    batch1_repeats: int

    def __post_init__(self) -> None:
        for name in ("num_requests", "batch1_prompt_len", "batch1_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError(f"hf_batch_sizes must be non-empty sizes >= 1, got {self.hf_batch_sizes}")
        if self.batch1_output_len < 2:
            raise ValueError(f"batch1_output_len must be >= 2 (decode time excludes the first token), "
                             f"got {self.batch1_output_len}")
        for name in ("prompt_len_range", "output_len_range"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")


FULL = BenchMode(
    name="full",
    # 768 hidden, 12 layers, GQA 12/4 heads, 32000-token vocab (tokenizer ids + padding rows),
    # tied embeddings: 100.1M parameters.
    model=DemoModelConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=32000, tie_word_embeddings=True, seed=0,
    ),
    num_requests=32,
    prompt_len_range=(16, 256),
    output_len_range=(16, 256),
    hf_batch_sizes=(8, 32),
    batch1_prompt_len=64,
    batch1_output_len=128,
    batch1_repeats=3,
)

QUICK = BenchMode(
    name="quick",
    model=DemoModelConfig(seed=0),  # ~3M parameters
    num_requests=6,
    prompt_len_range=(4, 32),
    output_len_range=(4, 16),
    hf_batch_sizes=(4,),
    batch1_prompt_len=16,
    batch1_output_len=16,
    batch1_repeats=2,
)


@dataclass(frozen=True)
class SharedPrefixMode:
    """Sizes of the shared-prefix (prefix caching) workload."""

    name: str
    model: DemoModelConfig
    num_requests: int
    system_prompt_len: int
    tail_len_range: tuple[int, int]  # inclusive
    num_output_tokens: int
    max_num_batched_tokens: int  # the engines' per-step budget: about two prompts, so the burst spans steps
    repeats: int  # fresh engine pairs, caching on and off alternating; the mean TTFT is over all of them


SHARED_FULL = SharedPrefixMode(name="full", model=FULL.model, num_requests=32, system_prompt_len=1024,
                               tail_len_range=(16, 64), num_output_tokens=8, max_num_batched_tokens=2048, repeats=2)
SHARED_QUICK = SharedPrefixMode(name="quick", model=QUICK.model, num_requests=6, system_prompt_len=64,
                                tail_len_range=(4, 12), num_output_tokens=2, max_num_batched_tokens=128, repeats=2)
