"""The sparse MoE block against transformers' own Mixtral and Qwen3-MoE blocks (routing on near-ties
included), against a per-token reference, and its checkpoint layouts and CPU pre-packing."""

from __future__ import annotations

import pytest
import torch

from worker.loading.checkpoint import CheckpointError, expected_shapes, layer_state_dict, to_engine_state_dict
from worker.models.llama import LlamaForCausalLM
from worker.models.model_config import ModelConfig
from worker.models.moe import SparseMoeBlock

H, I, E, K = 32, 16, 4, 2
BASE = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _hf_block(family: str, dtype: torch.dtype, experts_implementation: str = "eager", **extra):
    """transformers' sparse MoE block with random weights, and our block holding the same weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "mixtral":
        hf_config = transformers.MixtralConfig(**BASE | dict(intermediate_size=I), num_local_experts=E,
                                               num_experts_per_tok=K, experts_implementation=experts_implementation)
        raw = {"architectures": ["MixtralForCausalLM"], **BASE, "intermediate_size": I, "num_local_experts": E,
               "num_experts_per_tok": K}
    else:
        hf_config = transformers.Qwen3MoeConfig(**BASE, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                                                experts_implementation=experts_implementation, **extra)
        raw = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_experts": E, "num_experts_per_tok": K,
               "moe_intermediate_size": I, **extra}
    block_cls = MixtralSparseMoeBlock if family == "mixtral" else Qwen3MoeSparseMoeBlock
    gen = torch.Generator().manual_seed(0)
    hf = block_cls(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf = hf.to(dtype)
    config = ModelConfig.from_hf_dict(raw, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    ours = SparseMoeBlock(config)
    ours.load_state_dict({"router_weight": hf.gate.weight.clone(), "gate_up_proj": hf.experts.gate_up_proj.clone(),
                          "down_proj": hf.experts.down_proj.clone()}, assign=True)
    return hf, ours


def _near_tie_inputs(hf, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose router logits tie exactly (experts 1 and 2 share their router row) or nearly
    (expert 3's row differs from expert 0's in the last place of one entry), plus random rows."""
    with torch.no_grad():
        w = hf.gate.weight
        w[2] = w[1]
        w[3] = w[0]
        w[3, 0] = torch.nextafter(w[0, 0].float(), torch.tensor(10.0)).to(dtype)
    return torch.randn(40, H, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])  # transformers' per-expert loop; its default
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,extra", [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": False}),
                                          ("qwen3_moe", {"norm_topk_prob": True})])
def test_routing_and_output_equal_transformers_on_near_ties(family, extra, dtype, implementation):
    """Bit for bit: the same experts, the same weights (float32 for Mixtral, the model dtype for
    Qwen3-MoE) and the same output, in float32 and bfloat16."""
    hf, ours = _hf_block(family, dtype, implementation, **extra)
    x = _near_tie_inputs(hf, dtype)
    ours.router_weight.data.copy_(hf.gate.weight)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.route(x)
        assert torch.equal(ids, hf_ids)
        assert weights.dtype == hf_weights.dtype == (torch.float32 if family == "mixtral" else dtype)
        assert torch.equal(weights, hf_weights)
        assert (ids[:, :2].sort(-1).values == torch.tensor([1, 2])).any(), "no exact tie was exercised"
        want = hf(x[None])[0]
        got = ours(x)
    assert got.dtype == dtype
    assert torch.equal(got, want)  # top-2: the eager path's expert-order adds and our slot sum agree exactly


def test_grouped_path_equals_a_per_token_loop():
    _, ours = _hf_block("qwen3_moe", torch.float32, norm_topk_prob=True)
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights, ids = ours.route(x)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(ids[t, k])
                gate, up = (ours.gate_up_proj[e] @ x[t]).split(I)
                want[t] += weights[t, k] * (ours.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(23))  # renormalised


def _qwen3_moe_config(**extra) -> ModelConfig:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_experts": E, "num_experts_per_tok": K,
           "moe_intermediate_size": I, "mlp_only_layers": [1], **extra}
    return ModelConfig.from_hf_dict(raw)


def _random_hf_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen) for name, shape in expected_shapes(config).items()}


def test_stacked_and_per_expert_layouts_load_the_same_weights():
    config = _qwen3_moe_config()
    per_expert = _random_hf_tensors(config)
    p = "model.layers.0.mlp."
    stacked = {n: t for n, t in per_expert.items() if ".experts." not in n}
    stacked[p + "experts.gate_up_proj"] = torch.stack(
        [torch.cat([per_expert[f"{p}experts.{e}.gate_proj.weight"], per_expert[f"{p}experts.{e}.up_proj.weight"]])
         for e in range(E)])
    stacked[p + "experts.down_proj"] = torch.stack([per_expert[f"{p}experts.{e}.down_proj.weight"] for e in range(E)])
    a, b = to_engine_state_dict(per_expert, config), to_engine_state_dict(stacked, config)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert tuple(a["layers.0.mlp.gate_up_proj"].shape) == (E, 2 * I, H)
    assert torch.equal(a["layers.0.mlp.gate_up_proj"][3, I:], per_expert[p + "experts.3.up_proj.weight"])
    assert tuple(a["layers.1.mlp.gate_up_proj.weight"].shape) == (2 * 48, H)  # layer 1 is dense
    layer0 = {n: t for n, t in stacked.items() if n.startswith("model.layers.0.")}
    assert all(torch.equal(t, a[n]) for n, t in layer_state_dict(0, layer0, config).items())

    stacked[p + "experts.down_proj"] = stacked[p + "experts.down_proj"][:, :, :-1]
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.down_proj has shape \(4, 32, 15\), "
                                              r"config implies \(4, 32, 16\)"):
        to_engine_state_dict(stacked, config)
    missing = dict(per_expert)
    del missing[p + "experts.2.gate_proj.weight"]
    with pytest.raises(CheckpointError, match="lacks tensor.*model.layers.0.mlp.experts.2.gate_proj.weight"):
        to_engine_state_dict(missing, config)


def test_mixtral_checkpoints_use_their_hub_names():
    raw = {"architectures": ["MixtralForCausalLM"], **BASE, "num_local_experts": E, "num_experts_per_tok": K}
    names = set(expected_shapes(ModelConfig.from_hf_dict(raw)))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


def test_prepacking_leaves_router_and_experts_alone():
    from kernels.cpu_linear import PrepackedLinear, cpu_prepack_unavailable_reason

    if cpu_prepack_unavailable_reason(torch.float32, torch.device("cpu")) is not None:
        pytest.skip("this torch build cannot pre-pack")
    config = _qwen3_moe_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = to_engine_state_dict(_random_hf_tensors(config), config)
    model.load_state_dict(state, assign=True, strict=True)
    model.requires_grad_(False)
    assert model.prepack_layer_for_cpu(0) == 2  # qkv_proj and o_proj; the MoE block has no nn.Linear
    assert model.prepack_layer_for_cpu(1) == 4  # qkv, o, and the dense MLP's gate_up and down
    assert isinstance(model.layers[0].mlp, SparseMoeBlock)
    assert isinstance(model.layers[1].mlp.gate_up_proj, PrepackedLinear)
