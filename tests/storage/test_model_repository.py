"""The repository contract, run against both backends: a local directory and a real S3-speaking
server (moto over HTTP). Push, list, describe, fetch with ranged parts, missing models and
objects, and pushes that stop half-way."""

from __future__ import annotations

import filecmp
import shutil
import threading

import pytest

from storage import (FetchVerificationError, InvalidModelNameError, LocalModelRepository, ModelExistsError,
                     ModelNotFoundError, ObjectNotFoundError)
from storage.model_repository import file_xxh3_64


@pytest.fixture(params=["local", "s3"])
def repository(request, tmp_path):
    if request.param == "local":
        return LocalModelRepository(tmp_path / "repo", part_bytes=16384, max_concurrency=4)
    return request.getfixturevalue("s3_repository")


def _same_tree(a, b) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def test_push_list_describe_fetch_round_trip(repository, hf_model_dir, thaw_model_dir, tmp_path):
    hf = repository.push(hf_model_dir, "tiny-hf")
    thaw = repository.push(thaw_model_dir, "tiny-thaw")
    assert (hf.kind, thaw.kind) == ("hf", "thaw")
    assert [f.path for f in hf.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert {f.path: f.size for f in hf.files} == {p.name: p.stat().st_size for p in hf_model_dir.iterdir()}
    assert hf.files[1].xxh3_64 == file_xxh3_64(hf_model_dir / "model.safetensors")
    assert [m.model for m in repository.list_models()] == ["tiny-hf", "tiny-thaw"]
    assert repository.describe("tiny-thaw") == thaw
    assert repository.exists("tiny-hf") and not repository.exists("other")

    result = repository.fetch("tiny-thaw", tmp_path / "fetched")
    assert _same_tree(thaw_model_dir, tmp_path / "fetched")
    # Every file split into 16 KiB ranges: the request count is exact.
    assert result.num_requests == sum(-(-f.size // 16384) for f in thaw.files)
    assert (result.num_files, result.num_bytes, result.kind) == (len(thaw.files), thaw.total_bytes, "thaw")


def test_missing_model_names_it_and_lists_what_is_there(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "present")
    with pytest.raises(ModelNotFoundError, match=r"model 'absent' not found in .*1 models there: present"):
        repository.fetch("absent", tmp_path / "out")
    with pytest.raises(ModelNotFoundError, match="absent"):
        repository.describe("absent")


def test_missing_object_is_named(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "tiny")
    repository._delete_objects(["tiny/model.safetensors"])  # lost behind the manifest's back
    with pytest.raises(ObjectNotFoundError, match=r"tiny/model\.safetensors.*push the model again"):
        repository.fetch("tiny", tmp_path / "out")


def test_corrupted_object_fails_verification(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "tiny")
    data = bytearray((hf_model_dir / "tokenizer.json").read_bytes())
    data[3] ^= 0xFF
    repository._write_object("tiny/tokenizer.json", bytes(data))  # same size, different bytes
    with pytest.raises(FetchVerificationError, match=r"tiny/tokenizer\.json.*xxh3_64"):
        repository.fetch("tiny", tmp_path / "out")
    repository.fetch("tiny", tmp_path / "unverified", verify=False)  # verification is what caught it


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "_manifests", "", "x" * 129, "a..b", "sp ace"])
def test_invalid_names_are_refused_before_any_io(repository, hf_model_dir, name):
    with pytest.raises(InvalidModelNameError):
        repository.push(hf_model_dir, name)
    with pytest.raises(InvalidModelNameError):
        repository.describe(name)


def test_existing_model_needs_overwrite_and_overwrite_replaces_everything(repository, hf_model_dir, thaw_model_dir,
                                                                          tmp_path):
    repository.push(hf_model_dir, "m")
    with pytest.raises(ModelExistsError, match="overwrite"):
        repository.push(thaw_model_dir, "m")
    manifest = repository.push(thaw_model_dir, "m", overwrite=True)
    assert manifest.kind == "thaw"
    # No stale Hugging Face file survives next to the new version.
    assert sorted(k for k, _ in repository._list_objects("m")) == sorted(f"m/{f.path}" for f in manifest.files)
    repository.fetch("m", tmp_path / "out")
    assert _same_tree(thaw_model_dir, tmp_path / "out")


def test_interrupted_push_is_not_listed_and_a_retry_succeeds(repository, thaw_model_dir, tmp_path, monkeypatch):
    uploaded = []
    real_upload = repository._upload_file
    lock = threading.Lock()

    def failing_upload(key, path):
        with lock:
            if len(uploaded) == 2:
                raise ConnectionError("network dropped")
            uploaded.append(key)
        real_upload(key, path)

    monkeypatch.setattr(repository, "_upload_file", failing_upload)
    with pytest.raises(ConnectionError):
        repository.push(thaw_model_dir, "partial")
    assert repository.list_models() == []
    assert repository._list_objects("partial") != []  # bytes were written, but no manifest
    with pytest.raises(ModelNotFoundError):
        repository.fetch("partial", tmp_path / "out")
    monkeypatch.undo()
    repository.push(thaw_model_dir, "partial")
    assert [m.model for m in repository.list_models()] == ["partial"]


def test_delete_removes_manifest_and_files(repository, hf_model_dir):
    repository.push(hf_model_dir, "gone")
    repository.delete("gone")
    assert repository.list_models() == [] and repository._list_objects("gone") == []
    with pytest.raises(ModelNotFoundError):
        repository.delete("gone")


def test_source_without_weights_is_refused(repository, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither a thaw checkpoint"):
        repository.push(tmp_path / "src", "empty")
    with pytest.raises(FileNotFoundError):
        repository.push(tmp_path / "nope", "nope")


def test_fetch_refuses_a_non_empty_destination(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "tiny")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        repository.fetch("tiny", tmp_path / "busy")


def test_hidden_files_are_not_pushed_and_subdirectories_are(repository, hf_model_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_model_dir, src)
    (src / ".cache").mkdir()
    (src / ".cache" / "lock").write_text("x")
    (src / "original").mkdir()
    (src / "original" / "params.json").write_text("{}")
    manifest = repository.push(src, "nested")
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "original/params.json",
                                                "tokenizer.json"]
    repository.fetch("nested", tmp_path / "out")
    assert (tmp_path / "out" / "original" / "params.json").read_text() == "{}"


def test_download_probe_measures_and_cleans_up(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "tiny")
    (tmp_path / "scratch").mkdir()
    rate = repository.measure_download_bytes_per_s(100_000, tmp_path / "scratch", "probe-1")
    assert rate > 0
    assert repository._list_objects("_probes") == [] and list((tmp_path / "scratch").iterdir()) == []
    assert [m.model for m in repository.list_models()] == ["tiny"]
