"""Checkpoint loading refuses incomplete or foreign weights by name, and files outside the model dir."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loader import UnsafeModelDirError, convert_checkpoint
from worker.loading.checkpoint import CheckpointError, checkpoint_files, concat_rows, load_model
from worker.models.model_config import ModelConfig


@pytest.fixture()
def model_copy(tiny_llama_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def test_loads_all_weights_fused(model_copy):
    config = ModelConfig.from_model_dir(model_copy)
    model, how = load_model(model_copy, config)
    assert how.startswith("safetensors")
    hf = load_file(str(model_copy / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, expected)
    assert not any(p.is_meta for p in model.parameters())


def test_concat_rows_is_a_view_of_adjacent_parts_and_a_copy_otherwise():
    buffer = torch.arange(24, dtype=torch.float32)
    q, k, v = buffer[0:8].view(4, 2), buffer[8:12].view(2, 2), buffer[12:16].view(2, 2)
    fused = concat_rows([q, k, v])
    assert torch.equal(fused, torch.cat([q, k, v])) and fused.shape == (8, 2)
    assert fused.data_ptr() == q.data_ptr()  # no copy
    apart = concat_rows([q, buffer[16:20].view(2, 2), k])  # not back to back
    assert torch.equal(apart, torch.cat([q, buffer[16:20].view(2, 2), k]))
    assert apart.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    other = concat_rows([q, torch.arange(4, dtype=torch.float32).view(2, 2)])  # another buffer
    assert other.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_a_thaw_checkpoint_loads_fused_projections_without_copying_them(model_copy, tmp_path):
    config = ModelConfig.from_model_dir(model_copy)
    convert_checkpoint(model_copy, tmp_path / "thaw", progress=False)
    model, how = load_model(tmp_path / "thaw", config)
    assert how.startswith("thaw format")
    hf = load_file(str(model_copy / "model.safetensors"))
    embed = model.embed_tokens.weight  # a view of the loader's one host buffer
    for n in range(config.num_hidden_layers):
        qkv, gate_up = model.layers[n].self_attn.qkv_proj.weight, model.layers[n].mlp.gate_up_proj.weight
        assert torch.equal(qkv, torch.cat([hf[f"model.layers.{n}.self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(gate_up, torch.cat([hf[f"model.layers.{n}.mlp.{x}_proj.weight"] for x in ("gate", "up")]))
        for fused in (qkv, gate_up):
            assert fused.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()  # views, not copies


def test_missing_tensor_is_named(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(model_copy, ModelConfig.from_model_dir(model_copy))


def test_wrong_shape_and_extra_tensor_are_named(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        load_model(model_copy, ModelConfig.from_model_dir(model_copy))
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # tolerated legacy buffer
    tensors["model.visual.proj.weight"] = torch.ones(2, 2)
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.visual.proj.weight"):
        load_model(model_copy, ModelConfig.from_model_dir(model_copy))


def test_missing_files_are_named(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        checkpoint_files(model_copy)
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        checkpoint_files(model_copy)


def test_files_outside_the_model_dir_are_refused(model_copy, tmp_path):
    other = tmp_path / "other-tenant"
    other.mkdir()
    shutil.copy(model_copy / "model.safetensors", other / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    (model_copy / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(UnsafeModelDirError, match=r"the weights file \('model.safetensors'\) leads to .*other-tenant"):
        checkpoint_files(model_copy)
    for shard in ("../other-tenant/model.safetensors", str(other / "model.safetensors")):
        (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
        expected = f"weight_map entry 'lm_head.weight' ({shard!r}) is not a relative path"
        with pytest.raises(UnsafeModelDirError, match=re.escape(expected)):
            checkpoint_files(model_copy)


def test_truncated_file_is_refused(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(model_copy, ModelConfig.from_model_dir(model_copy))


def test_a_cpu_load_of_a_thaw_checkpoint_never_takes_the_device_loader(model_copy, tmp_path, monkeypatch):
    import worker.loading.checkpoint as checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path must not go through the device loader")

    monkeypatch.setattr(checkpoint, "read_checkpoint_to_device", refuse)
    config = ModelConfig.from_model_dir(model_copy)
    convert_checkpoint(model_copy, tmp_path / "thaw", progress=False)
    for device in ("cpu", torch.device("cpu")):
        model, how = load_model(tmp_path / "thaw", config, device)
        assert how.startswith("thaw format: ")
        assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.cuda
def test_a_cuda_load_of_a_thaw_checkpoint_reads_straight_into_gpu_memory(model_copy, tmp_path):
    config = ModelConfig.from_model_dir(model_copy)
    convert_checkpoint(model_copy, tmp_path / "thaw", progress=False)
    model, how = load_model(tmp_path / "thaw", config, "cuda")
    assert how.startswith("thaw format to cuda:")
    reference, _ = load_model(tmp_path / "thaw", config)
    on_gpu = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert on_gpu[name].device.type == "cuda", name
        assert torch.equal(on_gpu[name].cpu(), param), name
