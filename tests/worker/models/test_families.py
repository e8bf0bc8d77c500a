"""Every family in bfloat16, and through `thaw generate`.

The token-for-token checks against transformers run in float32
(tests/worker/engine/test_engine_vs_transformers.py). In bfloat16 two correct implementations round
differently, so tokens can diverge where logits nearly tie; what is checked instead is the
logits of a whole prompt: relative error ||ours - theirs|| / ||theirs|| below 3e-2 (bf16 keeps 8
bits of mantissa, ~4e-3 per rounding, and two layers of a tiny random model stay well under that
bound). `thaw generate` is the CLI a user tries first: its greedy text must be transformers'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import AttentionMetadata
from tests.model_factory import make_hf_checkpoint
from tests.worker.bf16_greedy import assert_greedy_up_to_bf16_rounding
from worker import Engine, EngineConfig

BF16_RELATIVE_TOLERANCE = 3e-2
FAMILIES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "mistral": dict(arch="mistral", sliding_window=8),
    "mixtral": dict(arch="mixtral"),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "phi3": dict(arch="phi3", sliding_window=8),
    "gemma2": dict(arch="gemma2"),
    "gemma3": dict(arch="gemma3"),
}
THAW = str(Path(sys.executable).with_name("thaw"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    spec = dict(FAMILIES[request.param])
    return request.param, make_hf_checkpoint(tmp_path_factory.mktemp(request.param), **spec, seed=8)


def test_bfloat16_logits_match_transformers_within_tolerance(family):
    import transformers

    _, model_dir = family
    prompt = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(1))  # [T]
    engine = Engine(model_dir, EngineConfig(dtype="bfloat16", block_size=16, num_kv_blocks=8))
    runner = engine.runner
    metadata = AttentionMetadata.build(block_tables=[[0, 1, 2]], query_lens=[37], seq_lens=[37], block_size=16)
    with torch.inference_mode():
        hidden = runner.forward(prompt, torch.arange(37), metadata)  # [T, H]
        ours = runner.compute_logits(hidden)  # [T, V] float32
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        theirs = hf(prompt[None]).logits[0].float()  # [T, V]
    error = ((ours - theirs).norm() / theirs.norm()).item()
    assert error < BF16_RELATIVE_TOLERANCE, f"relative error {error:.4f}"


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "phi3", "gemma2", "gemma3"])
def test_thaw_generate_equals_transformers(tmp_path, arch):
    import transformers

    model_dir = make_hf_checkpoint(tmp_path / arch, **FAMILIES[arch], seed=9)
    result = subprocess.run([THAW, "generate", str(model_dir), "Once upon a time", "--max-tokens", "10",
                             "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False)[0, ids.shape[1]:]
    assert got["text"] == tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bfloat16_greedy_decode_picks_transformers_best_token_up_to_rounding(tmp_path, arch):
    """bfloat16 decode (the C++ paged kernel, oneDNN's packed bfloat16 GEMMs, batched rows): at every
    generated position the engine's greedy token is transformers' argmax or within bfloat16 rounding
    of it (its transformers logit at most 3e-2 of the row's range below the best), and most are equal."""
    from worker import SamplingParams

    model_dir = make_hf_checkpoint(tmp_path / arch, **FAMILIES[arch], seed=11)
    prompts = [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 40)]
    engine = Engine(model_dir, EngineConfig(dtype="bfloat16", block_size=16, num_kv_blocks=32))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for out in outputs:
        assert len(out.output_token_ids) == 24
    assert_greedy_up_to_bf16_rounding(model_dir, prompts, [list(out.output_token_ids) for out in outputs])


def test_bfloat16_prefill_through_the_prefill_kernel_matches_transformers(tmp_path, monkeypatch):
    """Head size 64 in bfloat16: whole prompts and a burst behind one cached prefix (a cascade) take
    Thaw's prefill kernel where it was built (`kernels/cpu_prefill_attention.cpp`); the burst's
    greedy tokens are transformers' argmax up to bfloat16 rounding, as above."""

    from kernels.cpu_dense_attention import kernel_usable
    from kernels.cpu_extension import try_build_cpu_extension
    from tests.worker.prefill_kernel_case import burst_behind_a_prefix, head64_llama, record_cascades
    from worker import SamplingParams

    model_dir = head64_llama(tmp_path / "llama64")
    cascades = record_cascades(monkeypatch)
    engine = Engine(model_dir, EngineConfig(dtype="bfloat16", block_size=16, num_kv_blocks=96,
                                            enable_prefix_caching=True))
    prompts = burst_behind_a_prefix()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert cascades, "the tails behind the prefix were not attended as a cascade"
    if kernel_usable(try_build_cpu_extension()[0]):
        assert all(cascades), "the cascade did not use the prefill kernel's one-pass cascade"
    assert_greedy_up_to_bf16_rounding(model_dir, prompts, [list(out.output_token_ids) for out in outputs],
                                      min_equal=0.0)
