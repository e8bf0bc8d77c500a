"""`bench/multimodel.py`'s set-up, shared with `bench/sim_fidelity.py`: the policies and how Thaw's
configure the platform, the modes (models by size class, trace, lifetimes) and the models written
for a run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from bench.bursty_trace import BurstyTraceConfig
from worker import DemoModelConfig, write_demo_model

POLICIES = ("thaw", "thaw-shared", "thaw-hosts", "thaw-hosts-tight", "thaw-keepalive-wait", "rayserve")
DEFAULT_POLICIES = ("thaw", "thaw-shared", "thaw-keepalive-wait", "rayserve")  # the hosts' two: on request
TARGET_P99_RATIO_TO_KEEPALIVE_WAIT = 0.5
TARGET_SHARED_P99_S = 12.1 / 4  # issue 38: a quarter of thaw's last recorded P99 on this trace
TARGET_P99_RATIO_TO_RAYSERVE = 0.2
NUM_SLOTS = 2
THREADS_PER_INSTANCE = 1
FIRST_TOKEN_GRACE_S = 5.0  # past the queue timeout, before the client gives up on a first token
START_TIMEOUT_S = 300.0
TENANT = "bench"
NUM_SLOT_HOSTS = 2  # thaw-hosts: the 8 models share two warm processes
TIGHT_BUDGET_SHARE = 0.5  # thaw-hosts-tight: half the budget that holds every model


@dataclass(frozen=True)
class ThawPolicy:
    """How one of Thaw's policies configures the platform."""

    slot_sharing: bool  # evict an idle instance for a waiting model (else keep-alive is a hard lease)
    memory_is_the_slot: bool = False  # a slot per model, a worker memory budget the instances share
    slot_hosts: int = 0  # 0: a process per instance; N: N warm slot hosts hold the models
    budget_share: float = 1.0  # of the budget that holds every model at once


THAW_POLICIES = {
    "thaw": ThawPolicy(slot_sharing=True),
    "thaw-shared": ThawPolicy(slot_sharing=True, memory_is_the_slot=True),
    "thaw-hosts": ThawPolicy(slot_sharing=True, memory_is_the_slot=True, slot_hosts=NUM_SLOT_HOSTS),
    "thaw-hosts-tight": ThawPolicy(slot_sharing=True, memory_is_the_slot=True, slot_hosts=NUM_SLOT_HOSTS,
                                   budget_share=TIGHT_BUDGET_SHARE),
    "thaw-keepalive-wait": ThawPolicy(slot_sharing=False),
}


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int,
           dtype: str) -> DemoModelConfig:
    return DemoModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=512,
                           dtype=dtype, init_std=0.1, seed=seed)


@dataclass(frozen=True)
class BenchMode:
    """One mode's models (by size class), trace and lifetimes; the same for every policy."""

    name: str
    sizes: dict[str, tuple[int, int, int, int, int]]  # class -> (hidden, layers, heads, kv heads, intermediate)
    trace: BurstyTraceConfig
    keep_alive_s: float
    queue_timeout_s: float
    first_token_deadline_s: float | None = None  # None: queue_timeout_s + FIRST_TOKEN_GRACE_S
    # The models' dtype. Greedy exactness is a check only in float32: a bfloat16 model's greedy
    # tokens move with the batch a row is computed in (see `bench.greedy_reference`).
    dtype: str = "bfloat16"

    @property
    def effective_first_token_deadline_s(self) -> float:
        """How long the client waits for a first token, the same for every policy."""
        if self.first_token_deadline_s is not None:
            return self.first_token_deadline_s
        return self.queue_timeout_s + FIRST_TOKEN_GRACE_S


FULL = BenchMode("full", {"tiny": (512, 4, 8, 2, 1376), "small": (768, 6, 12, 4, 2048),
                          "medium": (1024, 8, 16, 4, 2816)},
                 BurstyTraceConfig(num_models=8, duration_s=300.0, mean_rate_per_s=1.0, mean_on_s=15.0,
                                   mean_off_s=30.0, min_prompt_tokens=16, max_prompt_tokens=64, max_tokens=32),
                 keep_alive_s=30.0, queue_timeout_s=60.0)
QUICK = BenchMode("quick", {"tiny": (64, 2, 4, 2, 128), "small": (128, 2, 4, 2, 352), "medium": (256, 4, 8, 2, 688)},
                  BurstyTraceConfig(num_models=8, duration_s=20.0, mean_rate_per_s=2.0, mean_on_s=4.0,
                                    mean_off_s=8.0, min_prompt_tokens=8, max_prompt_tokens=32, max_tokens=16),
                  keep_alive_s=10.0, queue_timeout_s=30.0, dtype="float32")


@dataclass(frozen=True)
class BenchModel:
    index: int
    name: str  # "m3-small": the Thaw model name and the Serve application name
    size: str
    path: Path
    num_bytes: int

    @property
    def model_id(self) -> str:
        return f"{TENANT}/{self.name}"


def write_models(mode: BenchMode, root: Path) -> list[BenchModel]:
    """The mode's models, the size classes taken in turn (3 tiny, 3 small, 2 medium of 8)."""
    classes = list(mode.sizes)
    models = []
    for index in range(mode.trace.num_models):
        size = classes[index % len(classes)]
        name = f"m{index}-{size}"
        path = write_demo_model(root / name, _llama(*mode.sizes[size], seed=index, dtype=mode.dtype), overwrite=True)
        models.append(BenchModel(index, name, size, path, sum(p.stat().st_size for p in path.glob("*.safetensors"))))
    return models


def log(message: str) -> None:
    print(f"[multimodel] {message}", file=sys.stderr, flush=True)
