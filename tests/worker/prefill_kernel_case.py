"""The engine-level case of the prefill kernels (bf16 and float32): a head-size-64 Llama (the kernels
take head sizes 64 and 128; the other test checkpoints have smaller heads) and a burst of prompts
behind one 144-token prefix, whose first prompt is attended whole and the rest as a cascade; with a
record of which cascades took a kernel's one-pass path."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.model_factory import make_hf_checkpoint


def head64_llama(directory: Path) -> Path:
    return make_hf_checkpoint(directory, arch="llama", hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, seed=12)  # head size 64


def burst_behind_a_prefix() -> list[list[int]]:
    """Five prompts: one 144-token prefix (9 blocks of 16), tails of 5-20 tokens."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 400, (144,), generator=gen).tolist()
    return [prefix + torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 9, 14, 20, 7)]


def record_cascades(monkeypatch) -> list[bool]:
    """Per cascade the CPU backend runs from now on: whether it took a kernel's one-pass path."""
    import kernels.cpu_attention as cpu_attention

    fused: list[bool] = []
    real = cpu_attention.run_cascade
    monkeypatch.setattr(cpu_attention, "run_cascade",
                        lambda group, *args: fused.append(args[-1] is not None) or real(group, *args))
    return fused
