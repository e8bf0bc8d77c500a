"""The sparse mixture-of-experts block of Mixtral and Qwen3-MoE: a router picks each token's top-k
experts, and the token's MLP output is the routing-weighted sum of those experts' SwiGLU MLPs.

Routing is transformers' own, step for step, because a near-tie between two experts is decided by
the last bit of a probability: the router logits are a GEMM in the model dtype, the softmax over
all experts runs in float32, then ``torch.topk``, then (Mixtral always, Qwen3-MoE when
``norm_topk_prob``) the k probabilities are divided by their sum. Mixtral multiplies each expert's
output by the float32 weight; Qwen3-MoE first casts the weights to the model dtype
(``moe_weights_float32`` in `ModelConfig`). The k weighted outputs of a token are summed over its
k slots, as transformers 5's default ``grouped_mm`` experts path does (its eager path adds them one
expert at a time with ``index_add_``; for k = 2 the two are bit-identical, for larger k ours is the
default path's order). Scattering into one row per (token, slot) pair writes every row once, so
the result is deterministic on GPUs too, where ``index_add_`` with repeated rows is not.

The grouped computation: the T*k (token, slot) pairs are sorted by expert, each expert's rows are
gathered into one block and run through one gate/up GEMM and one down GEMM, and the results are
written back to their slots. That is a loop over the experts that received rows (at most E, a few
dozen to a few hundred), never over tokens, and every GEMM is as tall as the expert's share of the
step. The weights are stacked per layer, ``gate_up_proj`` [E, 2I, H] (gate rows first, as in
transformers) and ``down_proj`` [E, H, I]: one parameter each instead of 3E modules, which keeps
meta-device construction and assign-style loading (`checkpoint.py`) one tensor per name, and is
the layout a grouped GEMM kernel takes. The router is a plain [E, H] parameter, not an
``nn.Linear``, so `prepack_linear_layers` leaves it alone: its GEMM is tiny, and a oneDNN
re-blocking would change its rounding and could flip near-ties. The experts are not pre-packed
either (they are no ``nn.Linear``); their GEMMs use ``F.linear`` on the plain weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.model_config import ModelConfig


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts over one step's tokens, ``[T, H] -> [T, H]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.num_experts < 1:
            raise ValueError("SparseMoeBlock needs a config with num_experts >= 1")
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_float32 = config.moe_weights_float32
        h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.router_weight = nn.Parameter(torch.empty(e, h))  # [E, H]
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights: ([T, k] weights, [T, k] int64 expert ids), experts in
        descending probability. Weights are float32 or the model dtype (see the module docstring)."""
        logits = F.linear(x, self.router_weight)  # [T, E] in the model dtype, as transformers
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_float32:
            weights = weights.to(logits.dtype)
        return weights, expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        num_tokens, hidden = x.shape
        weights, expert_ids = self.route(x)  # [T, k], [T, k]
        flat_ids = expert_ids.reshape(-1)  # [T*k]: slot s is token s // k, rank s % k
        order = torch.argsort(flat_ids, stable=True)  # [T*k]: slots grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        rows = x[order // self.top_k]  # [T*k, H] gathered, expert by expert
        flat_weights = weights.reshape(-1, 1)[order]  # [T*k, 1]
        out_dtype = torch.promote_types(x.dtype, weights.dtype)
        out = torch.empty(num_tokens * self.top_k, hidden, dtype=out_dtype, device=x.device)  # [T*k, H]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate, up = F.linear(rows[start:end], self.gate_up_proj[expert]).split(self.intermediate_size, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [count, H]
            out[order[start:end]] = y * flat_weights[start:end]
            start = end
        return out.view(num_tokens, self.top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
