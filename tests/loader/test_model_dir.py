"""A model directory names only its own files: index entries and symlinks leading outside are
refused with the entry named; links that stay inside are fine."""

from __future__ import annotations

import json
import os

import pytest

from loader import UnsafeModelDirError, contained_path, model_dir_files, shard_paths


@pytest.fixture
def layout(tmp_path):
    """``tmp_path/model`` (the directory under test) and ``tmp_path/other`` (another tenant's)."""
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    (model / "model.safetensors").write_bytes(b"mine")
    (model / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"theirs")
    return model, other


@pytest.mark.parametrize("name", ["../other/model.safetensors", "a/../../x", "/etc/passwd", "./x", "a//b", "",
                                  "a\\b", 7, None])
def test_names_that_are_not_relative_paths_inside_are_refused(layout, name):
    model, _ = layout
    with pytest.raises(UnsafeModelDirError) as info:
        contained_path(model, name, "the entry")
    assert str(info.value) == (f"{model}: the entry ({name!r}) is not a relative path inside the directory "
                               f"(no absolute path, no '..'); name a file in the directory")


def test_a_name_reaching_outside_through_a_symlink_is_refused(layout):
    model, other = layout
    (model / "shards").symlink_to(other, target_is_directory=True)
    with pytest.raises(UnsafeModelDirError, match=rf"the entry \('shards/model.safetensors'\) leads to "
                                                  rf"{other}/model.safetensors through a symlink, outside"):
        contained_path(model, "shards/model.safetensors", "the entry")
    (model / "inside").symlink_to(model / "model.safetensors")
    assert contained_path(model, "inside", "the entry") == model / "inside"
    assert contained_path(model, "config.json", "the entry") == model / "config.json"


def test_shard_paths_names_the_tensor_of_a_bad_entry(layout):
    model, other = layout
    ok = {"a.weight": "model.safetensors", "b.weight": "model.safetensors", "c.weight": "sub/part.safetensors"}
    assert shard_paths(model, ok) == [model / "model.safetensors", model / "sub" / "part.safetensors"]
    with pytest.raises(UnsafeModelDirError, match=r"weight_map entry 'lm_head.weight' \('\.\./other/model"):
        shard_paths(model, {**ok, "lm_head.weight": "../other/model.safetensors"})
    with pytest.raises(UnsafeModelDirError, match=rf"weight_map entry 'x' \({str(other)!r}"):
        shard_paths(model, {"x": str(other)})
    with pytest.raises(UnsafeModelDirError, match=r"weight_map entry 'x' \(3\)"):
        shard_paths(model, {"x": 3})
    with pytest.raises(ValueError, match="'weight_map' must map tensor names to files"):
        shard_paths(model, ["model.safetensors"])


def test_model_dir_files_lists_own_files_and_refuses_links_leading_out(layout):
    model, other = layout
    (model / ".cache").mkdir()
    (model / ".cache" / "blob").write_bytes(b"blob")
    (model / "weights-link.safetensors").symlink_to(model / ".cache" / "blob")  # inside: fine
    (model / ".cache" / "outside").symlink_to(other)  # hidden entries are never read
    assert [rel for rel, _ in model_dir_files(model)] == ["config.json", "model.safetensors",
                                                         "weights-link.safetensors"]
    (model / "tokenizer.json").symlink_to(other / "model.safetensors")
    with pytest.raises(UnsafeModelDirError) as info:
        model_dir_files(model)
    assert str(info.value).startswith(f"{model}: 'tokenizer.json' is a symlink to {other / 'model.safetensors'}, "
                                      f"outside the directory; copy the real files into the directory")
    os.unlink(model / "tokenizer.json")
    (model / "sub").mkdir()
    (model / "sub" / "linked").symlink_to(other, target_is_directory=True)
    with pytest.raises(UnsafeModelDirError, match="'sub/linked' is a symlink to"):
        model_dir_files(model)


def test_model_dir_files_checks_the_index(layout):
    model, _ = layout
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "/abs/model.safetensors"}}))
    with pytest.raises(UnsafeModelDirError, match="weight_map entry 'w' \\('/abs/model.safetensors'\\)"):
        model_dir_files(model)
    (model / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match="is not a valid safetensors index"):
        model_dir_files(model)
