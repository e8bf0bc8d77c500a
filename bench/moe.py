"""Mixture-of-experts block throughput: Thaw's grouped expert path against transformers' own.

One Mixtral-shaped sparse MoE block (8 experts, top-2; hidden 1024 and expert width 3584, a
scaled-down Mixtral-8x7B; tiny with ``--quick``) with random weights, the same weights in both:

* Thaw: `worker.models.moe.SparseMoeBlock` -- the step's (token, slot) pairs sorted by expert, one
  gate/up GEMM and one down GEMM per expert that received rows (a loop over experts, never
  over tokens);
* transformers 5: `MixtralSparseMoeBlock` with its default experts implementation (what a user
  of `generate` gets), and its "eager" one (a Python loop over the experts hit, `index_add_`);
* a per-token loop (each token through its k experts alone), the naive path the grouped one
  replaces, timed on the decode shape only.

Two shapes: a decode step (32 tokens: 32 sequences decoding) and a prefill chunk (512 tokens).
Each case is timed as the median of `repeats` calls after a warm-up, in the given dtype, on the
threads given. The outputs are checked equal first (bit for bit in float32, where both sum the
same two products). Prints one JSON line; progress on stderr.

    python bench/moe.py [--quick] [--dtype float32|bfloat16] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.models.model_config import ModelConfig  # noqa: E402
from worker.models.moe import SparseMoeBlock  # noqa: E402

FULL = dict(hidden_size=1024, intermediate_size=3584, num_experts=8, top_k=2)
QUICK = dict(hidden_size=64, intermediate_size=96, num_experts=8, top_k=2)
SHAPES = {"decode": 32, "prefill": 512}


def build_blocks(shape: dict, dtype: torch.dtype, experts_implementation: str):
    """transformers' block and ours, holding the same random weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    h, i, e, k = shape["hidden_size"], shape["intermediate_size"], shape["num_experts"], shape["top_k"]
    common = dict(vocab_size=64, hidden_size=h, intermediate_size=i, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    hf_config = transformers.MixtralConfig(**common, num_local_experts=e, num_experts_per_tok=k,
                                           experts_implementation=experts_implementation)
    gen = torch.Generator().manual_seed(0)
    hf = MixtralSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * h ** -0.5)
    hf = hf.to(dtype)
    raw = {"architectures": ["MixtralForCausalLM"], **common, "num_local_experts": e, "num_experts_per_tok": k}
    config = ModelConfig.from_hf_dict(raw, dtype=str(dtype).removeprefix("torch."))
    ours = SparseMoeBlock(config)
    ours.load_state_dict({"router_weight": hf.gate.weight.clone(), "gate_up_proj": hf.experts.gate_up_proj.clone(),
                          "down_proj": hf.experts.down_proj.clone()}, assign=True)
    return hf, ours.eval()


def per_token_loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
    """Each token through its experts one at a time: the naive path."""
    weights, expert_ids = block.route(x)  # [T, k] each
    out = torch.zeros_like(x)
    i = block.intermediate_size
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), expert_ids[t].tolist()):
            gate, up = torch.nn.functional.linear(x[t], block.gate_up_proj[e]).split(i)  # [I] each
            out[t] += w * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, block.down_proj[e])
    return out


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def hf_output(hf, x: torch.Tensor) -> torch.Tensor:
    out = hf(x[None])  # [1, T, H] (transformers 5 returns the hidden states, or a tuple with router logits)
    return (out[0] if isinstance(out, tuple) else out)[0]


def run(quick: bool, dtype: torch.dtype, repeats: int) -> dict:
    shape = QUICK if quick else FULL
    hf_default, ours = build_blocks(shape, dtype, "grouped_mm")
    hf_eager, _ = build_blocks(shape, dtype, "eager")
    figures: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, tokens in SHAPES.items():
            x = torch.randn(tokens, shape["hidden_size"], generator=torch.Generator().manual_seed(1)).to(dtype)
            ours_out = ours(x)
            for label, hf in (("transformers", hf_default), ("transformers_eager", hf_eager)):
                error = (ours_out.float() - hf_output(hf, x).float()).abs().max().item()
                if dtype == torch.float32 and error > 1e-5:
                    raise AssertionError(f"{name}: ours and {label} differ by {error}")
            print(f"[bench/moe] {name}: {tokens} tokens", file=sys.stderr)
            figures[name] = {
                "thaw_ms": median_ms(lambda: ours(x), repeats),
                "transformers_ms": median_ms(lambda: hf_output(hf_default, x), repeats),
                "transformers_eager_ms": median_ms(lambda: hf_output(hf_eager, x), repeats),
            }
            if name == "decode":
                figures[name]["per_token_loop_ms"] = median_ms(lambda: per_token_loop(ours, x), max(3, repeats // 4))
    line = {"bench": "moe", "mode": "quick" if quick else "full", "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), **{k: v for k, v in shape.items()}}
    for name, f in figures.items():
        for key, value in f.items():
            line[f"{name}_{key}"] = round(value, 3)
        line[f"{name}_tokens_per_s"] = round(SHAPES[name] / f["thaw_ms"] * 1e3, 1)
        line[f"{name}_ratio_vs_transformers"] = round(f["transformers_ms"] / f["thaw_ms"], 3)
    line["decode_ratio_vs_per_token_loop"] = round(figures["decode"]["per_token_loop_ms"] / figures["decode"]["thaw_ms"],
                                                   3)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny block (seconds; what the tests run)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args.quick, getattr(torch, args.dtype), args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
