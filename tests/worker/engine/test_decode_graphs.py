"""Decode steps through CUDA graphs: the padded sizes (CPU), and on a GPU the same tokens as
eager steps and as transformers, at batch sizes that hit several graphs and their padding."""

from __future__ import annotations

import pytest
import torch

from worker import Engine, EngineConfig, SamplingParams
from worker.engine.decode_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 48)
    for limit in (1, 3, 9, 17, 100):
        sizes = capture_sizes(limit)
        assert all(any(s >= b for s in sizes) for b in range(1, limit + 1))
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        capture_sizes(0)


def test_graphs_refuse_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(None, max_batch=4, max_model_len=64, block_size=16, device=torch.device("cpu"))


def test_cpu_engines_never_capture(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(num_kv_blocks=32))
    assert engine.runner.decode_graphs is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager_decode(tiny_llama_dir, dtype):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 31, 17, 2, 64, 9, 40)]
    # Requests finish at different steps, so the decode batch shrinks through several graph sizes.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 10, 3, 17, 24, 5, 12)]
    results = {}
    for graphs in (False, True):
        engine = Engine(tiny_llama_dir, EngineConfig(num_kv_blocks=128, max_num_seqs=8, device="cuda",
                                                     dtype=dtype, cuda_graphs=graphs))
        outs = engine.generate(prompts, params)
        results[graphs] = [list(o.output_token_ids) for o in outs]
        if graphs:
            assert len(engine.runner.decode_graphs.captured) >= 3
    assert results[True] == results[False]


@pytest.mark.cuda
def test_graph_decode_matches_transformers(tmp_path):
    import transformers

    from tests.model_factory import make_hf_checkpoint

    model_dir = make_hf_checkpoint(tmp_path / "llama", "llama", seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (4, 19, 33)]
    engine = Engine(model_dir, EngineConfig(num_kv_blocks=64, device="cuda", dtype="float32"))
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert engine.runner.decode_graphs.captured
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
            assert list(completion.output_token_ids) == want
