"""A bfloat16 model on CPU is held once: as each linear weight is pre-packed for oneDNN, its plain
copy in the checkpoint buffer is released (`loader.release_pages`), and the engine's outputs are
exactly those of the same engine that keeps the plain copies (what is released is never read)."""

from __future__ import annotations

import pytest
import torch

import worker.models.llama
from kernels.cpu_linear import cpu_prepack_unavailable_reason
from loader import convert_checkpoint
from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model

WHY_NOT = cpu_prepack_unavailable_reason(torch.bfloat16, torch.device("cpu"))
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no bfloat16 pre-packing here: {WHY_NOT}")
ENGINE = EngineConfig(block_size=16, num_kv_blocks=64)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = ["The quick brown fox", "A tale of two", "Once upon a time in"]


@pytest.fixture(scope="module")
def bf16_thaw_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    hf = write_demo_model(root / "hf", DemoModelConfig(hidden_size=512, num_hidden_layers=3, num_attention_heads=8,
                                                       num_key_value_heads=2, intermediate_size=1536,
                                                       dtype="bfloat16", seed=5, init_std=0.05))
    convert_checkpoint(hf, root / "thaw")
    return root / "thaw"


def outputs(engine: Engine) -> dict[str, list]:
    """Each request's tokens with their logprobs, step by step."""
    seen: dict[str, list] = {engine.add_request(p, PARAMS): [] for p in PROMPTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((tuple(out.new_token_ids), out.logprobs))
    return {f"r{i}": v for i, v in enumerate(seen.values())}


def test_plain_weights_are_released_and_the_outputs_do_not_change(bf16_thaw_dir, monkeypatch):
    released: list[int] = []
    real = worker.models.llama.release_pages
    monkeypatch.setattr(worker.models.llama, "release_pages", lambda t: released.append(real(t)) or released[-1])
    with_release = outputs(Engine(bf16_thaw_dir, ENGINE))
    linear_bytes = 3 * 2 * (512 * 512 * 2 + 2 * 128 * 512 + 3 * 1536 * 512)  # q,o + k,v + gate,up,down, bf16
    assert len(released) == 3 * 4 + 1  # each layer's qkv, o, gate_up, down (fused) and the (untied) head
    assert sum(released) >= 0.95 * linear_bytes
    monkeypatch.setattr(worker.models.llama, "release_pages", lambda t: 0)  # keep every plain copy
    assert outputs(Engine(bf16_thaw_dir, ENGINE)) == with_release
