"""Gemma 2 and Gemma 3 text beyond the float32 token-for-token check (tests/worker/engine/test_engine_vs_transformers.py):
their pieces bit for bit against transformers' in bfloat16 (whole-prompt bfloat16 logits are checked
with every family in tests/worker/models/test_families.py), Gemma 2's soft-capping shown to bite, the thaw
format (whole and layer by layer), an engine that starts before its weights (layer gate + zigzag
prefill), and the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from tests.model_factory import make_hf_checkpoint
from tests.worker.loading.test_layer_gate import Driver, FakeLayerSource, config_only, engine_config
from worker import Engine, EngineConfig, SamplingParams
from kernels import AttentionMetadata
from worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaRMSNorm
from worker.models.model_config import ModelConfig
from worker.models.model_family import build_model

MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_dir(request, tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=21)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("gemma2-caps"), "gemma2", seed=22)


def transformers_greedy(model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


def test_gemma_norm_matches_transformers_bit_for_bit_in_bfloat16():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    x = (torch.randn(9, 64, generator=gen) * 3).to(torch.bfloat16)  # [T, H]
    theirs = Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    ours = GemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        # Llama's order (cast, then multiply by w) differs: the test can tell them apart.
        llama_order = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        assert not torch.equal(ours(x), llama_order)


@pytest.mark.parametrize("dtype,scale", [("bfloat16", 55.5), ("float32", float(torch.tensor(3072 ** 0.5)))])
def test_embedding_scale_is_rounded_to_the_model_dtype(dtype, scale):
    config = ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=8, hidden_size=3072, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=16, qk_norm=True, query_pre_attn_scalar=8.0,
                         local_rope_theta=10000.0, tie_word_embeddings=True, dtype=dtype)
    with torch.device("meta"):
        model = build_model(config)
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.embed_scale == scale  # sqrt(3072) = 55.4256...; 55.5 in bfloat16, as transformers rounds it
    assert model.inv_freq.device.type == "cpu" and tuple(model.inv_freq.shape) == (2, 4)


def test_gemma2_soft_capping_bites_and_matches_transformers(gemma2_dir):
    """Whole-prompt float32 logits equal transformers' eager Gemma 2; with either cap switched off
    in the engine's model they would not, so both caps (2 on scores, 3 on logits) are in effect."""
    import transformers

    prompt = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(3))  # [T]
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(prompt[None]).logits[0]  # [T, V]
    engine = Engine(gemma2_dir, EngineConfig(block_size=16, num_kv_blocks=8))
    runner, model = engine.runner, engine.runner.model
    assert isinstance(model, Gemma2ForCausalLM) and not isinstance(model, Gemma3ForCausalLM)
    metadata = AttentionMetadata.build(block_tables=[[0, 1]], query_lens=[30], seq_lens=[30], block_size=16)

    def logits() -> torch.Tensor:  # [T, V] float32
        with torch.inference_mode():
            return runner.compute_logits(runner.forward(prompt, torch.arange(30), metadata))

    ours = logits()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours.abs().max() < 3.0 and ours.abs().max() > 2.0  # squashed into (-3, 3), and near the cap
    model.final_logit_softcapping = None
    assert (logits() - theirs).abs().max() > 0.3
    model.final_logit_softcapping = 3.0
    for layer in model.layers:
        assert layer.self_attn.softcap == 2.0 and layer.self_attn.q_norm is None  # Gemma 2: no q/k norms
        layer.self_attn.softcap = None
    assert (logits() - theirs).abs().max() > 0.3


def test_thaw_format_whole_and_layer_by_layer_matches_transformers(gemma_dir, tmp_path):
    from loader import convert_checkpoint
    from worker.loading.checkpoint import layer_state_dict, read_checkpoint, to_engine_state_dict

    index = convert_checkpoint(gemma_dir, tmp_path / "thaw", progress=False)
    ffn_norms = {t.name: t.layer for t in index.tensors if "feedforward_layernorm" in t.name}
    assert len(ffn_norms) == 2 * 4 and all(layer == int(name.split(".")[2]) for name, layer in ffn_norms.items())
    config = ModelConfig.from_model_dir(tmp_path / "thaw")
    assert config == ModelConfig.from_model_dir(gemma_dir) and config.is_gemma
    assert config.sliding_windows == (8, None, 8, None)
    tensors, how = read_checkpoint(tmp_path / "thaw")
    assert how.startswith("thaw format")
    whole = to_engine_state_dict(tensors, config)
    assert "layers.3.post_feedforward_layernorm.weight" in whole and "lm_head.weight" not in whole  # tied
    by_layer = {}
    for layer in range(-1, config.num_hidden_layers + 1):
        names = [t.name for t in index.tensors if t.layer == layer]
        by_layer |= layer_state_dict(layer, {n: tensors[n] for n in names}, config)
    assert sorted(by_layer) == sorted(whole)
    assert all(torch.equal(by_layer[n], whole[n]) for n in whole)

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    engine = Engine(tmp_path / "thaw", EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256))
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [list(c.output_token_ids) for c in completions] == transformers_greedy(gemma_dir, prompts)


def test_requests_sent_before_any_layer_match_transformers(gemma_dir, tmp_path):
    """Weights streamed in layer by layer with zigzag prefill: cos/sin (Gemma 3: for both RoPE
    settings) pass through the runner's per-layer path unchanged."""
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 11, 40)]
    source = FakeLayerSource(gemma_dir)
    engine = Engine(config_only(gemma_dir, tmp_path), engine_config(zigzag_prefill=True), weights=source)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts]
    driver = Driver(engine)
    source.release(-1, 0, 1)
    source.release_all()
    got = driver.join()
    assert driver.error is None
    want = transformers_greedy(gemma_dir, prompts)
    assert all(len(w) == MAX_TOKENS for w in want), "a prompt stopped early: pick prompts that do not hit EOS"
    assert [got[rid] for rid in ids] == want
    assert engine.weights_resident and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_greedy_matches_transformers_with_triton_kernels(gemma_dir):
    """Both Triton kernels (compiled on CUDA, interpreted on CPU) with Gemma's score scale, Gemma 2's
    score cap, and the sliding and full layers: prompts of 17 and 22 tokens exceed the window of 8."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 17, 22)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(gemma_dir, EngineConfig(block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
                                            attention_backend="triton", device=device))
    assert engine.runner.backend.name == "triton"
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [list(c.output_token_ids) for c in completions] == transformers_greedy(gemma_dir, prompts, 12)
