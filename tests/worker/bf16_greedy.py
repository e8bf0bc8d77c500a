"""What "the same greedy tokens" can mean in bfloat16: two correct computations that round in
different places (another attention path, another chunking of a prompt, another GEMM blocking)
may pick different tokens where two logits lie within bfloat16 rounding of each other. So each
chosen token is held to transformers' logits: the row's best, or within `tolerance` of the row's
range below it, and most of them its argmax exactly."""

from __future__ import annotations

from pathlib import Path

import torch


def assert_greedy_up_to_bf16_rounding(model_dir: Path, prompts: list[list[int]], generated: list[list[int]],
                                      tolerance: float = 3e-2, min_equal: float = 0.9) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    equal = total = 0
    for prompt, tokens in zip(prompts, generated, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()  # [P + N, V]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # [N, V]: what each token was chosen from
        best = rows.max(dim=-1).values
        chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        spread = best - rows.min(dim=-1).values
        assert bool(((best - chosen) <= tolerance * spread).all()), (best - chosen) / spread
        equal += int((rows.argmax(dim=-1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    assert equal >= min_equal * total, f"{equal}/{total} greedy tokens equal transformers' argmax"
