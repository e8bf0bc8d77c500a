"""The thaw index: layer assignment, JSON round trip, and the errors for bad or foreign indexes."""

import json

import pytest
import torch

from loader import FORMAT_VERSION, CheckpointFormatError, ThawIndex, convert_checkpoint, is_thaw_checkpoint
from loader.format import ChunkEntry, PartitionEntry, TensorEntry, layer_of_tensor
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint


@pytest.fixture(scope="module")
def thaw_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("format")
    write_hf_checkpoint(root / "hf", llama_tensors(2, torch.bfloat16))
    convert_checkpoint(root / "hf", root / "thaw", chunk_bytes=8192, progress=False)
    return root / "thaw"


def _edited_copy(thaw_dir, tmp_path, edit):
    data = json.loads((thaw_dir / "thaw_index.json").read_text())
    edit(data)
    (tmp_path / "thaw_index.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("name, layer", [
    ("model.embed_tokens.weight", -1),
    ("model.layers.0.self_attn.q_proj.weight", 0),
    ("model.layers.17.mlp.down_proj.weight", 17),
    ("layers.3.attention.wq.weight", 3),
    ("transformer.wte.embedding", -1),
    ("model.norm.weight", None),
    ("lm_head.weight", None),
    ("model.sublayers.2.weight", None),  # "layers.{i}." must start a name component
])
def test_layer_of_tensor(name, layer):
    assert layer_of_tensor(name) == layer


def test_index_round_trips_through_json(thaw_dir):
    index = ThawIndex.read(thaw_dir)
    assert index.format_version == FORMAT_VERSION == 1
    assert ThawIndex.from_dict(json.loads(index.to_json())) == index
    data = json.loads((thaw_dir / "thaw_index.json").read_text())
    assert list(data) == ["format", "format_version", "num_layers", "chunk_bytes", "partitions", "tensors", "source"]
    assert data["format"] == "thaw"
    assert data["tensors"][0] == {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [100, 48],
                                  "partition": 0, "offset": 0, "size": 9600, "layer": -1}
    assert data["source"] == {"format": "safetensors", "files": ["model.safetensors"], "dtype": None}


def test_is_thaw_checkpoint(thaw_dir, tmp_path):
    assert is_thaw_checkpoint(thaw_dir) is True
    assert is_thaw_checkpoint(thaw_dir.parent / "hf") is False
    assert is_thaw_checkpoint(tmp_path / "missing") is False
    newer = _edited_copy(thaw_dir, tmp_path, lambda d: d.update(format_version=2))
    assert is_thaw_checkpoint(newer) is False


def test_missing_index_names_the_file(tmp_path):
    with pytest.raises(CheckpointFormatError) as err:
        ThawIndex.read(tmp_path)
    assert str(tmp_path / "thaw_index.json") in str(err.value)


def test_unknown_version_names_found_and_supported(thaw_dir, tmp_path):
    with pytest.raises(CheckpointFormatError) as err:
        ThawIndex.read(_edited_copy(thaw_dir, tmp_path, lambda d: d.update(format_version=2)))
    assert "format_version 2 is not supported: this Thaw reads version 1" in str(err.value)


def test_unknown_format_names_it(thaw_dir, tmp_path):
    with pytest.raises(CheckpointFormatError) as err:
        ThawIndex.read(_edited_copy(thaw_dir, tmp_path, lambda d: d.update(format="sllm")))
    assert "field 'format' is 'sllm', expected 'thaw'" in str(err.value)


def test_not_json(tmp_path):
    (tmp_path / "thaw_index.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="is not valid JSON"):
        ThawIndex.read(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"][0].pop("dtype"), "tensors[0]: missing field 'dtype'"),
    (lambda d: d["tensors"][1].update(offset=100), "field 'offset' 100 is not a multiple of 4096"),
    (lambda d: d["tensors"][0].update(dtype="complex64"), "field 'dtype' is 'complex64'"),
    (lambda d: d["tensors"][0].update(size=9602), "field 'size' is 9602 bytes but bfloat16[100, 48] needs 9600"),
    (lambda d: d["tensors"][0].update(partition=3), "field 'partition' 3 but there are 1 partitions"),
    (lambda d: d["tensors"][0].update(layer=7), "field 'layer' 7 is above num_layers 2"),
    (lambda d: d["partitions"][0]["chunks"].pop(1), "field 'chunks'[1] starts at 16384, expected 8192"),
    (lambda d: d["partitions"][0].update(file="../x.bin"), "field 'file' '../x.bin' must be a plain file name"),
    (lambda d: d["partitions"][0]["chunks"][0].update(xxh3_64="xyz"), "field 'xxh3_64' 'xyz' is not 16 hex digits"),
    (lambda d: d.update(chunk_bytes=1000), "field 'chunk_bytes' 1000 must be a positive multiple of 4096"),
    (lambda d: d.pop("num_layers"), "missing field 'num_layers'"),
    (lambda d: d["tensors"][1].update(offset=8192), "field 'offset' 8192 overlaps the previous tensor"),
])
def test_malformed_entries_name_the_field(thaw_dir, tmp_path, edit, message):
    with pytest.raises(CheckpointFormatError) as err:
        ThawIndex.read(_edited_copy(thaw_dir, tmp_path, edit))
    assert message in str(err.value)


def test_entries_validate_on_construction():
    with pytest.raises(CheckpointFormatError, match="field .chunks. cover 4096 bytes, expected 8192"):
        PartitionEntry(file="p.bin", size=8192, chunks=(ChunkEntry(offset=0, size=4096, xxh3_64="0" * 16),))
    with pytest.raises(CheckpointFormatError, match="field 'shape'"):
        TensorEntry(name="w", dtype="float32", shape=(-1,), partition=0, offset=0, size=0, layer=0)
    entry = TensorEntry(name="w", dtype="float16", shape=(3, 5), partition=0, offset=4096, size=30, layer=1)
    assert entry.to_dict() == {"name": "w", "dtype": "float16", "shape": [3, 5], "partition": 0, "offset": 4096,
                               "size": 30, "layer": 1}
