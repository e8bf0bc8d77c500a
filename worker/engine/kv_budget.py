"""How many tokens an instance's KV pool holds, and whether a model's context fits in it.

The pool is sized once per instance (`EngineConfig.kv_cache_bytes`, or `num_kv_blocks`), and one
token of context costs ``2 x layers x KV heads x head size x element size`` bytes in it. A
deployment whose longest request (``max_model_len``, by default the model's own
``max_position_embeddings``) needs more than the whole pool could admit such a request and then
never finish it, so a deploy refuses it up front with the numbers (as vLLM refuses to start);
the engine itself does not, since tests and the preemption path run deliberately small pools.
"""

from __future__ import annotations

from worker.engine.engine_config import EngineConfig
from worker.models.model_config import ModelConfig
from worker.engine.model_runner import kv_bytes_per_block

__all__ = ["kv_bytes_per_token", "kv_pool_tokens", "max_model_len_problem"]


def kv_bytes_per_token(model: ModelConfig) -> int:
    """Bytes of KV cache one token of context takes, in the model's dtype."""
    return kv_bytes_per_block(model, 1, model.torch_dtype)


def kv_pool_tokens(model: ModelConfig, engine: EngineConfig) -> int:
    """Tokens of context the instance's whole KV pool holds (whole blocks only)."""
    block_bytes = kv_bytes_per_block(model, engine.block_size, model.torch_dtype)
    num_blocks = engine.num_kv_blocks or engine.kv_cache_bytes // block_bytes
    return num_blocks * engine.block_size


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


def max_model_len_problem(model: ModelConfig, engine: EngineConfig, max_model_len: int | None) -> str | None:
    """Why `max_model_len` (None: the model's own limit) cannot be served -- longer than the
    model's context, or more than this pool holds --, with what to change; None when it fits."""
    if max_model_len is not None and max_model_len > model.max_position_embeddings:
        # The engine refuses it at load (`Engine`): a deploy must not succeed and then fail every start.
        return (f"max_model_len {max_model_len} exceeds the model's context (max_position_embeddings "
                f"{model.max_position_embeddings}): set it to at most {model.max_position_embeddings}, or leave it out")
    wanted = max_model_len or model.max_position_embeddings
    tokens = kv_pool_tokens(model, engine)
    if wanted <= tokens:
        return None
    per_token = kv_bytes_per_token(model)
    blocks = -(-wanted // engine.block_size)
    needed = blocks * engine.block_size * per_token
    which = "max_model_len" if max_model_len else "the model's max_position_embeddings"
    return (f"{which} {wanted} needs {_size(needed)} of KV cache ({per_token} bytes per token in {model.dtype}), "
            f"but an instance's KV pool holds {tokens} tokens ({_size(tokens * per_token)}): set kv_cache_bytes "
            f"to at least {needed}, or max_model_len to at most {tokens}")
