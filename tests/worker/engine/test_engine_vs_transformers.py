"""Greedy output of our engine equals `transformers.generate`, token for token.

Tiny checkpoints of each supported family are built here with transformers' own random
initialisation and saved in Hugging Face format; our engine loads them from disk and runs
eight prompts of different lengths concurrently with small KV blocks (so prompts cross
block boundaries), a small token budget (so prefills are chunked), and once more with a KV
pool too small for all of them (so sequences are preempted and recomputed). Every variant
must reproduce transformers' tokens exactly and leave every KV block free at the end.
The mixture-of-experts checkpoints are also converted to the thaw format and must give the
same tokens from there.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_factory import make_hf_checkpoint
from worker import Engine, EngineConfig, SamplingParams

PROMPT_LENS = [3, 7, 13, 17, 22, 30, 5, 40]
MAX_TOKENS = 24

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
# head_dim 16: 8 factors each; no explicit factor, so 256 / 32 = 8 sets the attention factor.
LONGROPE_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 16.0]}
# Phi-4-mini's shape of RoPE: 3/4 of each head rotated (12 of 16 dimensions, 6 factors per set).
# transformers' Phi3 recomputes a sequence's whole KV cache when it grows past the original context,
# which the engine does not (see the report); an original context of 2 keeps every sequence long
# throughout, so the long set, partial rotation and the attention factor sqrt(1 + ln 128 / ln 2) run.
PHI4_MINI_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                  "original_max_position_embeddings": 2,
                  "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0], "long_factor": [1.0, 1.5, 3.0, 5.0, 8.0, 12.0]}
CHECKPOINTS = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied-sharded": dict(arch="llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                                     max_shard_size="100KB", seed=1),
    "qwen2": dict(arch="qwen2", seed=2),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=8, seed=3),
    # q/k RMSNorm per head, and a head size that is not hidden / heads (64 / 4 = 16; 32 here).
    "qwen3-head-dim-32-tied": dict(arch="qwen3", head_dim=32, tie_word_embeddings=True, seed=4),
    "qwen3-attention-bias": dict(arch="qwen3", attention_bias=True, seed=5),
    # YaRN x4 over a 64-token original context: a ramp of interpolated frequencies and cos/sin
    # scaled by the attention factor (0.1 ln 4 + 1).
    "llama-yarn": dict(arch="llama", rope_parameters=YARN_ROPE, seed=9),
    # Dynamic NTK: rescales only past max_position_embeddings (256), which the engine never runs.
    "llama-dynamic": dict(arch="llama", rope_parameters=DYNAMIC_ROPE, seed=10),
    # longrope over a 32-token original context: prompts of 3..30 tokens start short and switch to
    # the long set mid-generation (position 32 on), the 40-token prompt is long from its first token;
    # transformers picks the set per forward pass, the engine per token from its sequence's length.
    "llama-longrope": dict(arch="llama", rope_parameters=LONGROPE_ROPE, seed=11),
    # Phi-3: q/k/v and gate/up stored fused. Phi-3-mini's sliding window over every layer, default RoPE.
    "phi3-sliding-window": dict(arch="phi3", sliding_window=8, seed=12),
    # Phi-4-mini: partial rotary + longrope + tied embeddings.
    "phi3-partial-longrope-tied": dict(arch="phi3", rope_parameters=PHI4_MINI_ROPE, original_max_position_embeddings=2,
                                       tie_word_embeddings=True, seed=13),
    # Gemma 3 (tests/model_factory.py): sliding (window 8) and full layers with their two RoPE settings,
    # query_pre_attn_scalar 24 for head_dim 32, scaled and tied embeddings, (1 + w) norms, GELU-tanh.
    "gemma3-sliding-full-linear-rope": dict(arch="gemma3", seed=14),
    # Gemma 2 (tests/model_factory.py): the same layers without q/k norms, one RoPE setting, attention
    # scores capped at 2 and final logits at 3 (transformers runs it with eager attention: SDPA cannot cap).
    "gemma2-softcap-sliding-full": dict(arch="gemma2", seed=15),
    # Mixture of experts: 4 experts, top-2 (tests/model_factory.py). Mixtral renormalises the top-k
    # probabilities; this one also has a sliding window.
    "mixtral-sliding-window": dict(arch="mixtral", sliding_window=8, init_std=0.2, seed=6),
    # Qwen3-MoE without renormalisation and with layer 1 a dense MLP (mlp_only_layers).
    "qwen3-moe-unnormalised-dense-layer": dict(arch="qwen3_moe", norm_topk_prob=False, mlp_only_layers=[1],
                                               init_std=0.2, seed=7),
    # Renormalised, 3 layers with decoder_sparse_step 2 (only layer 1 sparse), saved in transformers
    # 5's stacked expert layout.
    "qwen3-moe-sparse-step-stacked": dict(arch="qwen3_moe", norm_topk_prob=True, num_hidden_layers=3,
                                          decoder_sparse_step=2, stacked_experts=True, init_std=0.2, seed=8),
}
MOE_CHECKPOINTS = ("mixtral-sliding-window", "qwen3-moe-unnormalised-dense-layer")
ENGINE_CONFIGS = {
    "chunked": EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256),
    "preempting": EngineConfig(block_size=4, max_num_batched_tokens=32, num_kv_blocks=30),
    "reference-attention": EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
                                        attention_backend="reference"),
    # The plain F.linear path (what non-float32 and non-oneDNN builds use).
    "unpacked-linear": EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
                                    cpu_weight_prepack=False),
    # Packing deferred past the start (`worker.models.weight_packing`): the prefills run on plain weights,
    # then a layer is packed after each decode-only step, so generations cross the switch mid-way.
    "deferred-packing": EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
                                     cpu_prepack_defer_bytes=0),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory):
    """(model_dir, prompts, transformers' greedy continuations) for one checkpoint."""
    import transformers

    spec = dict(CHECKPOINTS[request.param])
    model_dir = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), **spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    return model_dir, prompts, expected


@pytest.mark.parametrize("engine_config", sorted(ENGINE_CONFIGS))
def test_greedy_matches_transformers(reference, engine_config):
    model_dir, prompts, expected = reference
    engine = Engine(model_dir, ENGINE_CONFIGS[engine_config])
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for i, (completion, want) in enumerate(zip(completions, expected)):
        assert list(completion.output_token_ids) == want, f"prompt {i} (length {PROMPT_LENS[i]}) diverged"
        assert completion.finish_reason == ("stop" if len(want) < MAX_TOKENS else "length")
    if engine_config == "preempting":
        assert engine.scheduler.num_preemptions > 0, "the small KV pool was meant to force preemption"
    if engine_config == "deferred-packing" and engine.packing is not None:  # None: no oneDNN for float32 here
        assert engine.packing.deferred and engine.packing.later_s > 0 and engine.packing.load_s == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_moe_checkpoint_in_thaw_format_matches_transformers(name, tmp_path):
    """A MoE checkpoint converted to the thaw format (each expert tensor in its layer's group) loads,
    whole and layer by layer, into the same model and gives transformers' tokens."""
    import transformers

    from loader import convert_checkpoint
    from worker.loading.checkpoint import layer_state_dict, read_checkpoint, to_engine_state_dict
    from worker.models.model_config import ModelConfig

    hf_dir = make_hf_checkpoint(tmp_path / "hf", **CHECKPOINTS[name])
    index = convert_checkpoint(hf_dir, tmp_path / "thaw", progress=False)
    expert_layers = {t.layer for t in index.tensors if ".experts." in t.name}
    assert expert_layers == ({0, 1} if name.startswith("mixtral") else {0})  # qwen3-moe: layer 1 is dense
    for entry in index.tensors:
        if ".experts." in entry.name:
            assert entry.layer == int(entry.name.split(".")[2]), entry.name

    config = ModelConfig.from_model_dir(tmp_path / "thaw")
    tensors, how = read_checkpoint(tmp_path / "thaw")
    assert how.startswith("thaw format")
    whole = to_engine_state_dict(tensors, config)
    by_layer = {}
    for layer in range(-1, config.num_hidden_layers + 1):
        names = [t.name for t in index.tensors if t.layer == layer]
        by_layer |= layer_state_dict(layer, {n: tensors[n] for n in names}, config)
    assert sorted(by_layer) == sorted(whole)
    assert all(torch.equal(by_layer[n], whole[n]) for n in whole)

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    engine = Engine(tmp_path / "thaw", ENGINE_CONFIGS["chunked"])
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):].tolist()
            assert list(completion.output_token_ids) == want


@pytest.mark.slow
def test_greedy_matches_transformers_with_triton_kernels(tmp_path):
    """The same check with the Triton kernels (compiled on CUDA, interpreted on CPU)."""
    import transformers

    from tests.model_factory import make_hf_checkpoint as make

    model_dir = make(tmp_path / "qwen2", "qwen2", seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 22, 40)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(model_dir, EngineConfig(block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
                                            attention_backend="triton", device=device))
    assert engine.runner.backend.name == "triton"
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
            assert list(completion.output_token_ids) == want
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_float32_prefill_through_the_prefill_kernel_matches_transformers(tmp_path, monkeypatch):
    """Head size 64 in float32: whole prompts and a burst behind one cached prefix (a cascade) take
    Thaw's float32 prefill kernel where it was built (`kernels/cpu_prefill_attention_f32.cpp`; the
    checkpoints above have smaller heads, which it leaves to PyTorch); the tokens are still
    transformers' own, exactly."""
    import transformers

    import kernels.cpu_dense_attention as cpu_dense_attention
    from kernels.cpu_extension import try_build_cpu_extension
    from tests.worker.prefill_kernel_case import burst_behind_a_prefix, head64_llama, record_cascades

    if not cpu_dense_attention.kernel_usable(try_build_cpu_extension()[0], torch.float32):
        pytest.skip("the float32 prefill kernel was not built here (no AVX-512)")
    model_dir = head64_llama(tmp_path / "llama64")
    fused = record_cascades(monkeypatch)
    dense_calls = []
    real_kernel_dense = cpu_dense_attention.kernel_dense

    def counting_kernel_dense(extension):  # the kernel's dense calls, counted by dtype
        attend = real_kernel_dense(extension)
        return lambda q, *rest, **kw: dense_calls.append(q.dtype) or attend(q, *rest, **kw)

    monkeypatch.setattr(cpu_dense_attention, "kernel_dense", counting_kernel_dense)
    engine = Engine(model_dir, EngineConfig(block_size=16, num_kv_blocks=96, enable_prefix_caching=True))
    assert engine.runner.backend.name == "cpu"
    prompts = burst_behind_a_prefix()
    completions = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert dense_calls and set(dense_calls) == {torch.float32}, "the first prompt did not take the kernel"
    assert fused and all(fused), "the burst behind the prefix did not take the kernel's one-pass cascade"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
            assert list(completion.output_token_ids) == want
