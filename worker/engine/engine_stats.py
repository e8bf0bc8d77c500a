"""`EngineStats`: an engine's load at one instant, as one typed record.

Its callers (the instance's ``stats``, its load report, benchmarks) read this instead of reaching
through the engine into its scheduler and block manager: which parts hold each figure stays the
engine's business. Read between steps or from another thread alike: each figure is one attribute
read, so a snapshot taken mid-step is a little stale, never torn.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineStats"]


@dataclass(frozen=True)
class EngineStats:
    num_waiting_requests: int  # admitted, queued for a step (preempted ones included)
    num_running_requests: int  # holding KV blocks and scheduled each step
    num_kv_blocks: int  # the pool's size (0 while asleep: the pool is freed)
    num_free_kv_blocks: int  # free, or cached and reclaimable
    block_size: int  # tokens per KV block
    num_preemptions: int  # since the engine started
    num_prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hit_tokens: int  # of those, found cached

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"EngineStats.{name} must be >= 0, got {value}")
        if self.num_free_kv_blocks > self.num_kv_blocks:
            raise ValueError(f"{self.num_free_kv_blocks} free KV blocks of {self.num_kv_blocks}")
        if self.num_prefix_cache_hit_tokens > self.num_prefix_cache_queried_tokens:
            raise ValueError("more prefix-cache hits than tokens looked up")
