"""The locally built demo Llama: a real Hugging Face dir that transformers loads and runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from worker.models.demo_model import DemoModelConfig, demo_weight_shapes, write_demo_model
from worker.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def _expected_num_params(config: DemoModelConfig, vocab_size: int) -> int:
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h
    embeddings = vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + embeddings + h


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("models") / "demo")


def test_dir_contents(model_dir):
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # No temporary sibling is left behind.
    assert sorted(p.name for p in model_dir.parent.iterdir()) == ["demo"]
    config = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_dir(model_dir)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == tok.vocab_size == 1024
    assert config["bos_token_id"] == tok.bos_token_id
    assert set(config["eos_token_id"]) == set(tok.eos_token_ids)
    assert config["head_dim"] == 32 and config["rope_theta"] == 500000.0
    assert config["dtype"] == config["torch_dtype"] == "float32"


def test_loads_and_runs_in_transformers(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    config = DemoModelConfig()
    assert model.config.rope_parameters["rope_theta"] == config.rope_theta
    assert model.config.num_key_value_heads == 2
    assert model.num_parameters() == _expected_num_params(config, 1024)

    tok = Tokenizer.from_dir(model_dir)
    input_ids = torch.tensor([tok.encode_chat([{"role": "user", "content": "Hello there"}])])  # [1, T]
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, T, vocab]
    assert logits.shape == (1, input_ids.shape[1], 1024)
    assert torch.isfinite(logits).all()

    # The weights in the file are the ones transformers loaded (nothing re-initialised).
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        down_proj = f.get_tensor("model.layers.3.mlp.down_proj.weight")
        assert torch.equal(down_proj, model.model.layers[3].mlp.down_proj.weight)
        assert torch.equal(f.get_tensor("lm_head.weight"), model.lm_head.weight)


def test_same_seed_is_bit_identical(tmp_path):
    a = write_demo_model(tmp_path / "a", DemoModelConfig(seed=3))
    b = write_demo_model(tmp_path / "b", DemoModelConfig(seed=3))
    c = write_demo_model(tmp_path / "c", DemoModelConfig(seed=4))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_refuses_non_empty_dir(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="overwrite=True"):
        write_demo_model(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    write_demo_model(out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_empty_existing_dir_is_fine(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    write_demo_model(out)
    assert (out / "config.json").is_file()


def test_tied_embeddings_has_no_lm_head(tmp_path):
    config = DemoModelConfig(tie_word_embeddings=True, num_hidden_layers=1)
    out = write_demo_model(tmp_path / "tied", config)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.num_parameters() == _expected_num_params(config, 1024)


def test_padded_vocab_and_bf16(tmp_path):
    config = DemoModelConfig(vocab_size=1152, dtype="bfloat16", num_hidden_layers=2)
    out = write_demo_model(tmp_path / "bf16", config)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert embed.dtype == torch.bfloat16 and embed.shape == (1152, 256)
        assert set(f.keys()) == set(demo_weight_shapes(config, 1152))
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(256, dtype=torch.bfloat16))
        std = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float().std().item()
    assert 0.018 < std < 0.022
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1152


def test_param_count_of_a_100m_config():
    config = DemoModelConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=32000,
    )
    shapes = demo_weight_shapes(config, 32000)
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    assert num_params == _expected_num_params(config, 32000)
    assert 100e6 < num_params < 130e6


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"hidden_size": 250}, "divisible by num_attention_heads"),
        ({"num_key_value_heads": 3}, "divisible by num_key_value_heads"),
        ({"dtype": "float64"}, "dtype"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"init_std": -1.0}, "init_std"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DemoModelConfig(**kwargs)


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_demo_model(tmp_path / "small", DemoModelConfig(vocab_size=512))
    assert list(tmp_path.iterdir()) == []
