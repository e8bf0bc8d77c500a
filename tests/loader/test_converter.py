"""Converter: layer-ordered aligned layout, partition splits, chunk coverage, copied files, crash safety,
sources that name files outside themselves, owner-only output."""

import json
import os
import re
import stat

import pytest
import torch
import xxhash

import loader.converter
from loader import ThawIndex, UnsafeModelDirError, convert_checkpoint
from tests.loader.hf_checkpoint_builder import CONFIG_TEXT, TOKENIZER_TEXT, llama_tensors, write_hf_checkpoint

EXPECTED_ORDER = [  # layer order; inside a layer the projections the engine fuses come first, back to
    # back (q, k, v then gate, up), then the rest in the source files' (sorted) order
    "model.embed_tokens.weight",
    *[f"model.layers.{i}.{s}" for i in range(2) for s in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "input_layernorm.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight",
        "self_attn.o_proj.weight")],
    "lm_head.weight",
    "model.norm.weight",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tensors = llama_tensors(2, torch.bfloat16)
    return {1: write_hf_checkpoint(root / "single", tensors),
            3: write_hf_checkpoint(root / "sharded", tensors, num_shards=3)}


def _round_up(n):
    return -(-n // 4096) * 4096


@pytest.mark.parametrize("num_shards", [1, 3])
def test_layout_is_layer_ordered_and_aligned(hf_dirs, tmp_path, num_shards):
    index = convert_checkpoint(hf_dirs[num_shards], tmp_path / "thaw", chunk_bytes=8192, progress=False)
    assert [t.name for t in index.tensors] == EXPECTED_ORDER
    assert [t.layer for t in index.tensors] == [-1] + [0] * 9 + [1] * 9 + [2, 2]
    assert index.num_layers == 2
    assert len(index.partitions) == 1
    offset = 0
    for t in index.tensors:  # back to back, each padded to the next 4096 boundary
        assert (t.partition, t.offset) == (0, offset)
        offset += _round_up(t.size)
    assert index.partitions[0].size == offset == 143360
    assert os.path.getsize(tmp_path / "thaw" / "partition_000.bin") == 143360
    assert ThawIndex.read(tmp_path / "thaw") == index


def test_chunks_cover_every_byte_with_matching_hashes(hf_dirs, tmp_path):
    index = convert_checkpoint(hf_dirs[1], tmp_path / "thaw", chunk_bytes=3 * 4096, progress=False)
    partition = index.partitions[0]
    assert [(c.offset, c.size) for c in partition.chunks] == (
        [(i * 12288, 12288) for i in range(11)] + [(135168, 8192)])
    data = (tmp_path / "thaw" / "partition_000.bin").read_bytes()
    assert [c.xxh3_64 for c in partition.chunks] == [
        xxhash.xxh3_64_hexdigest(data[c.offset: c.offset + c.size]) for c in partition.chunks]
    # Padding is zeros: bytes after the embedding (9600 bytes) up to the next tensor at 12288.
    assert data[9600:12288] == bytes(12288 - 9600)


def test_small_partition_bytes_splits_without_spanning(hf_dirs, tmp_path):
    index = convert_checkpoint(hf_dirs[1], tmp_path / "thaw", partition_bytes=16384, chunk_bytes=4096, progress=False)
    assert [(t.partition, t.offset) for t in index.tensors] == [
        (0, 0),                                   # embed 9600 B
        (1, 0), (1, 8192), (1, 12288),            # layers.0 q (7680 B), k, v
        (2, 0), (2, 8192),                        # gate, up (7680 B each)
        (3, 0), (3, 4096), (3, 12288),            # input_layernorm, down, post_attention_layernorm
        (4, 0), (4, 8192),                        # o, layers.1 q
        (5, 0), (5, 4096), (5, 8192),             # k, v, gate
        (6, 0), (6, 8192),                        # up, input_layernorm
        (7, 0), (7, 8192),                        # down, post_attention_layernorm
        (8, 0),                                   # o
        (9, 0), (9, 12288),                       # lm_head, norm
    ]
    assert [p.file for p in index.partitions] == [f"partition_{i:03d}.bin" for i in range(10)]
    assert [p.size for p in index.partitions] == [12288, 16384, 16384, 16384, 16384, 16384, 12288, 12288, 8192,
                                                  16384]
    for p in index.partitions:
        assert os.path.getsize(tmp_path / "thaw" / p.file) == p.size
        assert sum(c.size for c in p.chunks) == p.size


def test_tensor_larger_than_partition_gets_its_own(hf_dirs, tmp_path):
    index = convert_checkpoint(hf_dirs[1], tmp_path / "thaw", partition_bytes=4096, chunk_bytes=4096, progress=False)
    embed = index.tensors[0]
    assert (embed.partition, embed.offset, index.partitions[0].size) == (0, 0, 12288)
    assert [t.partition for t in index.tensors[:3]] == [0, 1, 2]


def test_non_weight_files_are_copied(hf_dirs, tmp_path):
    src = hf_dirs[3]
    (src / "generation_config.json").write_text('{"do_sample": false}')
    (src / "tokenizer.model").write_bytes(b"\x00spm")
    (src / "README.md").write_text("not copied")
    convert_checkpoint(src, tmp_path / "thaw", progress=False)
    assert sorted(os.listdir(tmp_path / "thaw")) == [
        "config.json", "generation_config.json", "partition_000.bin", "thaw_index.json", "tokenizer.json",
        "tokenizer.model"]
    assert (tmp_path / "thaw" / "config.json").read_text() == CONFIG_TEXT
    assert (tmp_path / "thaw" / "tokenizer.json").read_text() == TOKENIZER_TEXT
    assert (tmp_path / "thaw" / "tokenizer.model").read_bytes() == b"\x00spm"
    assert ThawIndex.read(tmp_path / "thaw").source["files"] == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def test_progress_callback_and_stderr(hf_dirs, tmp_path, capsys):
    calls = []
    convert_checkpoint(hf_dirs[1], tmp_path / "a", progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == 22  # one per tensor, then the final padded total
    assert calls[0] == (9600, 143360)
    assert calls[-1] == (143360, 143360)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    convert_checkpoint(hf_dirs[1], tmp_path / "b", progress=True)
    err = capsys.readouterr().err  # "\r"-overwritten lines, the last one complete
    assert re.fullmatch(r"(\rthaw convert: [\d.,]+ / 0\.1 MB \([\d,]+ MB/s\))+\n", err), err
    assert err.rsplit("\r", 1)[1].startswith("thaw convert: 0.1 / 0.1 MB (")
    convert_checkpoint(hf_dirs[1], tmp_path / "c", progress=False)
    assert capsys.readouterr().err == ""


def test_refuses_non_empty_out_dir_and_overwrites(hf_dirs, tmp_path):
    out = tmp_path / "thaw"
    out.mkdir()
    convert_checkpoint(hf_dirs[1], out, progress=False)  # an empty dir is fine
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        convert_checkpoint(hf_dirs[1], out, dtype="float32", progress=False)
    assert ThawIndex.read(out).tensors[0].dtype == "bfloat16"
    index = convert_checkpoint(hf_dirs[1], out, dtype="float32", progress=False, overwrite=True)
    assert ThawIndex.read(out) == index
    assert index.tensors[0].dtype == "float32"
    assert sorted(os.listdir(tmp_path)) == ["thaw"]  # no temp or old dir left beside it


def _raise_midway(done, total):
    if done > 20000:
        raise RuntimeError("disk full (simulated)")


def test_interrupted_conversion_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="disk full"):
        convert_checkpoint(hf_dirs[3], tmp_path / "thaw", progress=_raise_midway)
    assert os.listdir(tmp_path) == []

    def failing_index_write(tmp_dir, index):
        (tmp_dir / "thaw_index.json").write_text("{")  # half-written, then the crash
        raise OSError("power cut (simulated)")

    monkeypatch.setattr(loader.converter, "_write_index", failing_index_write)
    with pytest.raises(OSError, match="power cut"):
        convert_checkpoint(hf_dirs[3], tmp_path / "thaw", progress=False)
    assert os.listdir(tmp_path) == []


def test_interrupted_overwrite_keeps_the_old_checkpoint(hf_dirs, tmp_path):
    old = convert_checkpoint(hf_dirs[1], tmp_path / "thaw", progress=False)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_checkpoint(hf_dirs[1], tmp_path / "thaw", dtype="float32", progress=_raise_midway, overwrite=True)
    assert ThawIndex.read(tmp_path / "thaw") == old
    assert os.listdir(tmp_path) == ["thaw"]


def test_input_errors(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported for conversion"):
        convert_checkpoint(hf_dirs[1], tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="chunk_bytes is 1000; it must be a positive multiple of 4096"):
        convert_checkpoint(hf_dirs[1], tmp_path / "x", chunk_bytes=1000)
    with pytest.raises(ValueError, match="out_dir must differ from hf_dir"):
        convert_checkpoint(hf_dirs[1], hf_dirs[1], overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weights in .*: expected model.safetensors or model.safetensors.index"):
        convert_checkpoint(empty, tmp_path / "x")
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_missing_shard_is_named(tmp_path):
    src = write_hf_checkpoint(tmp_path / "hf", llama_tensors(2, torch.float16), num_shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        convert_checkpoint(src, tmp_path / "thaw")
    assert f"shard {src / 'model-00002-of-00002.safetensors'} listed in" in str(err.value)
    assert not (tmp_path / "thaw").exists()


@pytest.mark.parametrize("case", ["index-dotdot", "index-absolute", "weights-symlink", "config-symlink"])
def test_a_source_naming_files_outside_itself_is_refused(tmp_path, case):
    other = write_hf_checkpoint(tmp_path / "other-tenant", llama_tensors(2, torch.float16, seed=9), num_shards=2)
    src = write_hf_checkpoint(tmp_path / "hf", llama_tensors(2, torch.float16), num_shards=2)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensor = sorted(index["weight_map"])[0]
    if case.startswith("index"):
        shard = (f"../other-tenant/{index['weight_map'][tensor]}" if case == "index-dotdot"
                 else str(other / index["weight_map"][tensor]))
        index["weight_map"][tensor] = shard
        index_path.write_text(json.dumps(index))
        expected = f"weight_map entry {tensor!r} ({shard!r}) is not a relative path inside the directory"
    else:
        name = "model-00001-of-00002.safetensors" if case == "weights-symlink" else "config.json"
        (src / name).unlink()
        (src / name).symlink_to(other / name)
        expected = f"{name!r} is a symlink to {other / name}, outside the directory"
    with pytest.raises(UnsafeModelDirError) as info:
        convert_checkpoint(src, tmp_path / "thaw", progress=False)
    assert expected in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["hf", "other-tenant"]  # nothing written


def test_output_is_the_owners_only(hf_dirs, tmp_path):
    convert_checkpoint(hf_dirs[1], tmp_path / "out" / "thaw", progress=False)
    out = tmp_path / "out" / "thaw"
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o600, "partition_000.bin": 0o600, "thaw_index.json": 0o600, "tokenizer.json": 0o600}
