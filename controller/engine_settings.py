"""A model's engine settings, derived from its spec in one place.

An instance's `worker.EngineConfig` is the platform's defaults (`ControllerConfig.engine_defaults`)
with the spec's own choices on top: dtype, ``max_model_len``, the KV pool's size and the batch
limit, and the device (CUDA where the spec asks for GPUs). The instance manager starts workers
with it and a deploy checks the model's context against the same pool, so the two cannot drift;
`instance_memory_bytes` prices an instance against a node's worker memory budget from the same
settings.
"""

from __future__ import annotations

from typing import Any

from controller.controller_config import ControllerConfig
from controller.model_spec import ModelSpec


def engine_config_for(spec: ModelSpec, config: ControllerConfig) -> Any:
    """The `worker.EngineConfig` of every instance of `spec` (imports worker, hence torch)."""
    overrides: dict[str, Any] = {}
    if spec.dtype != "auto":
        overrides["dtype"] = spec.dtype
    if spec.max_model_len is not None:
        overrides["max_model_len"] = spec.max_model_len
    if spec.kv_cache_bytes is not None:
        overrides["kv_cache_bytes"] = spec.kv_cache_bytes
        overrides["num_kv_blocks"] = None  # the spec's size wins over a platform-wide block count
    if spec.max_num_seqs is not None:
        overrides["max_num_seqs"] = spec.max_num_seqs
    if spec.resources.num_gpus > 0 and "device" not in config.engine_defaults:
        overrides["device"] = "cuda"  # Ray makes the instance's GPU the visible one
    return config.engine_config(overrides)


def instance_memory_bytes(spec: ModelSpec, weight_bytes: int, config: ControllerConfig) -> int:
    """What one instance of `spec` takes of its node's worker memory budget: its checkpoint's
    bytes (the weights as they load; a ``dtype`` wider than the checkpoint's is not priced) plus
    its KV pool (the spec's ``kv_cache_bytes``, else the platform's; a pool fixed as a block count
    depends on the model's shape and is priced at the platform's byte size)."""
    return weight_bytes + instance_kv_bytes(spec, config)


def instance_kv_bytes(spec: ModelSpec, config: ControllerConfig) -> int:
    """The KV pool's part of `instance_memory_bytes`: what an instance frees when it sleeps."""
    return spec.kv_cache_bytes if spec.kv_cache_bytes is not None else config.default_kv_cache_bytes
