"""`bench/gpu_platform.py`'s set-up, shared with its alternation (`bench/gpu_platform_alternation.py`):
the modes (the models' shapes, KV pools and lifetimes), the phases a try is in, and the deadline of
one request.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.demo_model import DemoModelConfig

BENCH = "gpu_platform"
NUM_SMALL_BESIDE_BIG = 2  # the budget holds the 8B and this many 1Bs, not one more
REQUEST_DEADLINE_S = 300.0  # also each spec's queue_timeout_s: a cold 8B start waits, it does not fail
# Phases of the alternation (the "phase" of each try).
COLD, SMALL, SETUP, ASLEEP, FILL, DRAM = "cold-fresh-host", "1b", "setup", "asleep", "fill", "dram"


@dataclass(frozen=True)
class PlatformMode:
    """One mode's models and lifetimes (`FULL`: the issue's shapes; `QUICK`: a CPU smoke run)."""

    name: str
    big: DemoModelConfig
    small: DemoModelConfig
    kv_cache_bytes: int  # every instance's KV pool (the spec's kv_cache_bytes): exact arithmetic
    prompt_tokens: int
    max_tokens: int
    repeats: int
    # Short, so the 8B sleeps between tries, but past the node's settling (the controller's
    # spare_refill_delay_s, 5 s) after its cold start, when the controller copies it into DRAM.
    big_keep_alive_s: float
    small_keep_alive_s: float  # long: the 1Bs stay resident, so the 8B is the one sleeper
    judged: bool  # the shapes: targets judged (on a GPU)
    num_small: int = 4

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.num_small <= NUM_SMALL_BESIDE_BIG:
            raise ValueError(f"num_small must exceed {NUM_SMALL_BESIDE_BIG}, or every model fits the budget")


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool,
           seed: int, max_len: int) -> DemoModelConfig:
    return DemoModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                           tie_word_embeddings=tied, max_position_embeddings=max_len, dtype="bfloat16", seed=seed)


FULL = PlatformMode("full", big=_llama(4096, 32, 32, 8, 14336, 128256, False, 0, 2048),
                    small=_llama(2048, 16, 32, 8, 8192, 128256, True, 1, 2048), kv_cache_bytes=512 << 20,
                    prompt_tokens=128, max_tokens=2, repeats=3, big_keep_alive_s=8.0, small_keep_alive_s=600.0,
                    judged=True)
QUICK = PlatformMode("quick", big=_llama(256, 4, 8, 2, 688, 4096, False, 0, 512),
                     small=_llama(128, 2, 4, 2, 352, 4096, True, 1, 512), kv_cache_bytes=1 << 20,
                     prompt_tokens=16, max_tokens=2, repeats=2, big_keep_alive_s=6.0, small_keep_alive_s=600.0,
                     judged=False)
