"""The repository contract, run against both backends: a local directory and a real S3-speaking
server (moto over HTTP). Push, list, describe, fetch with ranged parts, missing models and
objects, pushes that stop half-way, pushes that race (exactly one wins, readers never see a
half-pushed version), source directories that name files outside themselves, file modes."""

from __future__ import annotations

import filecmp
import json
import shutil
import stat
import threading
import time

import pytest

from loader import UnsafeModelDirError
from storage import (FetchVerificationError, InvalidModelNameError, LocalModelRepository, ManifestFile,
                     ModelExistsError, ModelManifest, ModelNotFoundError, ObjectNotFoundError, PushConflictError)
from storage.model_repository import ABANDONED_PUSH_S, file_xxh3_64
from storage.repository_manifest import new_revision


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
    hf = repository.push(hf_model_dir, "tiny-hf", convert=False)
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
    repository.push(hf_model_dir, "present", convert=False)
    with pytest.raises(ModelNotFoundError, match=r"model 'absent' not found in .*1 models there: present"):
        repository.fetch("absent", tmp_path / "out")
    with pytest.raises(ModelNotFoundError, match="absent"):
        repository.describe("absent")


def test_missing_object_is_named(repository, hf_model_dir, tmp_path):
    manifest = repository.push(hf_model_dir, "tiny", convert=False)
    repository._delete_objects([manifest.object_key("model.safetensors")])  # lost behind the manifest's back
    with pytest.raises(ObjectNotFoundError, match=rf"tiny/\.revisions/{manifest.revision}/model\.safetensors.*"
                                                  r"push the model again"):
        repository.fetch("tiny", tmp_path / "out")


def test_corrupted_object_fails_verification(repository, hf_model_dir, tmp_path):
    manifest = repository.push(hf_model_dir, "tiny", convert=False)
    data = bytearray((hf_model_dir / "tokenizer.json").read_bytes())
    data[3] ^= 0xFF
    repository._write_object(manifest.object_key("tokenizer.json"), bytes(data))  # same size, different bytes
    with pytest.raises(FetchVerificationError, match=r"tiny/\.revisions/.*/tokenizer\.json.*xxh3_64"):
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
    repository.push(hf_model_dir, "m", convert=False)
    with pytest.raises(ModelExistsError, match="overwrite"):
        repository.push(thaw_model_dir, "m")
    manifest = repository.push(thaw_model_dir, "m", overwrite=True)
    assert manifest.kind == "thaw"
    # No stale Hugging Face file survives next to the new version.
    assert sorted(k for k, _ in repository._list_objects("m")) == sorted(
        f"m/.revisions/{manifest.revision}/{f.path}" for f in manifest.files)
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
    assert uploaded != [] and repository._list_objects("partial") == []  # what it staged was deleted
    with pytest.raises(ModelNotFoundError):
        repository.fetch("partial", tmp_path / "out")
    monkeypatch.undo()
    repository.push(thaw_model_dir, "partial")
    assert [m.model for m in repository.list_models()] == ["partial"]


def test_delete_removes_manifest_and_files(repository, hf_model_dir):
    repository.push(hf_model_dir, "gone", convert=False)
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
    repository.push(hf_model_dir, "tiny", convert=False)
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
    manifest = repository.push(src, "nested", convert=False)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "original/params.json",
                                                "tokenizer.json"]
    repository.fetch("nested", tmp_path / "out")
    assert (tmp_path / "out" / "original" / "params.json").read_text() == "{}"


def test_download_probe_measures_and_cleans_up(repository, hf_model_dir, tmp_path):
    repository.push(hf_model_dir, "tiny", convert=False)
    (tmp_path / "scratch").mkdir()
    rate = repository.measure_download_bytes_per_s(100_000, tmp_path / "scratch", "probe-1")
    assert rate > 0
    assert repository._list_objects("_probes") == [] and list((tmp_path / "scratch").iterdir()) == []
    assert [m.model for m in repository.list_models()] == ["tiny"]


# --- staged pushes: exactly one of racing pushes wins, readers never see a half-pushed version -----

WAIT_S = 30.0  # a guard so a bug fails a test instead of hanging it; never reached when correct


def _variant(hf_model_dir, root, tag: str):
    """The tiny Hugging Face model with a different tokenizer.json: same files, other content."""
    src = root / tag
    shutil.copytree(hf_model_dir, src)
    (src / "tokenizer.json").write_text('{"variant": "%s"}' % tag)
    return src


def _object_keys(repository, model: str) -> list[str]:
    return sorted(key for key, _ in repository._list_objects(model))


@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_pushes_of_one_name_exactly_one_wins(repository, hf_model_dir, tmp_path, monkeypatch, overwrite):
    sources = [_variant(hf_model_dir, tmp_path, "a"), _variant(hf_model_dir, tmp_path, "b")]
    old = repository.push(hf_model_dir, "m", convert=False) if overwrite else None
    # Both pushes past their "does it exist" check, both uploading, before either writes its manifest.
    both_uploading = threading.Barrier(2, timeout=WAIT_S)
    started: set[str] = set()
    lock = threading.Lock()
    real_upload, real_swap = repository._upload_file, repository._swap_object

    def upload(key, path):
        revision = key.split("/")[2]
        with lock:
            first = revision not in started
            started.add(revision)
        if first:
            both_uploading.wait()
        real_upload(key, path)

    def swap(key, data, expected_tag):
        with lock:  # one conditional write at a time: moto checks and writes non-atomically, S3 does not
            return real_swap(key, data, expected_tag)

    monkeypatch.setattr(repository, "_upload_file", upload)
    monkeypatch.setattr(repository, "_swap_object", swap)
    outcomes: dict[int, object] = {}

    def push(i: int) -> None:
        try:
            outcomes[i] = repository.push(sources[i], "m", overwrite=overwrite, convert=False)
        except Exception as exc:  # noqa: BLE001 -- the outcome is what the test checks
            outcomes[i] = exc

    threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    monkeypatch.undo()
    winners = [i for i, outcome in outcomes.items() if isinstance(outcome, ModelManifest)]
    losers = [i for i, outcome in outcomes.items() if isinstance(outcome, PushConflictError)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    [winner], [loser] = winners, losers
    assert "was pushed (or deleted) by someone else while this push was uploading" in str(outcomes[loser])
    manifest = outcomes[winner]
    assert repository.describe("m") == manifest
    # The winner's objects are intact and exactly what is left: the loser's staging and the
    # replaced version are gone.
    assert _object_keys(repository, "m") == sorted(manifest.object_key(f.path) for f in manifest.files)
    if old is not None:
        assert old.revision != manifest.revision
    repository.fetch("m", tmp_path / "out")  # verified against the manifest's checksums
    assert _same_tree(sources[winner], tmp_path / "out")


def test_an_overwrite_keeps_the_old_version_whole_until_the_new_one_is_complete(repository, hf_model_dir,
                                                                                 tmp_path, monkeypatch):
    old = repository.push(hf_model_dir, "m", convert=False)
    new_src = _variant(hf_model_dir, tmp_path, "new")
    uploading, release = threading.Event(), threading.Event()
    real_upload = repository._upload_file

    def gated_upload(key, path):
        uploading.set()
        assert release.wait(WAIT_S)
        real_upload(key, path)

    monkeypatch.setattr(repository, "_upload_file", gated_upload)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(repository.push(new_src, "m", overwrite=True, convert=False)))
    thread.start()
    try:
        assert uploading.wait(WAIT_S)
        assert repository.describe("m") == old  # still listed, still the old version ...
        repository.fetch("m", tmp_path / "during")  # ... and whole
        assert _same_tree(hf_model_dir, tmp_path / "during")
    finally:
        release.set()
        thread.join(WAIT_S)
    [new] = result
    assert repository.describe("m") == new and new.revision != old.revision
    repository.fetch("m", tmp_path / "after")
    assert _same_tree(new_src, tmp_path / "after")
    assert _object_keys(repository, "m") == sorted(new.object_key(f.path) for f in new.files)


def test_a_repository_of_the_unrevisioned_layout_is_read_and_replaced(repository, hf_model_dir, tmp_path):
    files = tuple(ManifestFile(p.name, p.stat().st_size, file_xxh3_64(p)) for p in sorted(hf_model_dir.iterdir()))
    for p in sorted(hf_model_dir.iterdir()):
        repository._write_object(f"old/{p.name}", p.read_bytes())
    legacy = ModelManifest(model="old", kind="hf", files=files, pushed_at=1.0)
    assert '"version": 1' in legacy.to_json() and "revision" not in legacy.to_json()
    repository._write_object("_manifests/old.json", legacy.to_json().encode())
    assert repository.describe("old") == legacy
    repository.fetch("old", tmp_path / "legacy")
    assert _same_tree(hf_model_dir, tmp_path / "legacy")
    new = repository.push(hf_model_dir, "old", overwrite=True, convert=False)
    assert _object_keys(repository, "old") == sorted(f"old/.revisions/{new.revision}/{f.path}" for f in new.files)


def test_revisions_of_crashed_pushes_are_swept_once_abandoned(repository, hf_model_dir):
    abandoned = new_revision(time.time() - ABANDONED_PUSH_S - 60)
    in_progress = new_revision()
    repository._write_object(f"m/.revisions/{abandoned}/model.safetensors", b"crashed")
    repository._write_object(f"m/.revisions/{in_progress}/model.safetensors", b"uploading")
    manifest = repository.push(hf_model_dir, "m", convert=False)
    assert _object_keys(repository, "m") == sorted(
        [f"m/.revisions/{in_progress}/model.safetensors"] + [manifest.object_key(f.path) for f in manifest.files])
    repository.delete("m")  # a push still in progress keeps its files
    assert _object_keys(repository, "m") == [f"m/.revisions/{in_progress}/model.safetensors"]


# --- a source directory never makes a push read files outside it -----------------------------------


def _unsafe_sources(hf_model_dir, root):
    """(name, dir, the entry the refusal must name) for each way out of a model directory."""
    outside = root / "other-tenant"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes((hf_model_dir / "model.safetensors").read_bytes())
    cases = []

    def make(name: str):
        src = root / name
        shutil.copytree(hf_model_dir, src)
        return src

    src = make("file-link")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(outside / "model.safetensors")
    cases.append(("file-link", src, "'model.safetensors' is a symlink to"))
    src = make("dir-link")
    (src / "original").symlink_to(outside, target_is_directory=True)
    cases.append(("dir-link", src, "'original' is a symlink to"))
    for name, shard in (("dotdot", "../other-tenant/model.safetensors"),
                        ("absolute", str(outside / "model.safetensors"))):
        src = make(name)
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": shard}}))
        cases.append((name, src, f"weight_map entry 'lm_head.weight' ({shard!r}) is not a relative path"))
    return cases


def test_a_directory_naming_files_outside_itself_is_refused_and_nothing_is_written(repository, hf_model_dir,
                                                                                   tmp_path):
    repository.push(hf_model_dir, "ok", convert=False)
    for name, src, entry in _unsafe_sources(hf_model_dir, tmp_path):
        with pytest.raises(UnsafeModelDirError) as info:
            repository.push(src, name)
        assert entry in str(info.value) and str(src) in str(info.value)
        assert repository._list_objects(name) == []
    assert [m.model for m in repository.list_models()] == ["ok"]


def test_a_symlink_that_stays_inside_the_directory_is_fine(repository, hf_model_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_model_dir, src)
    (src / ".blobs").mkdir()
    (src / "model.safetensors").rename(src / ".blobs" / "weights")
    (src / "model.safetensors").symlink_to(src / ".blobs" / "weights")
    manifest = repository.push(src, "linked", convert=False)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    repository.fetch("linked", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (hf_model_dir / "model.safetensors").read_bytes()


# --- what a repository and a fetch write is the owner's only ---------------------------------------


def _modes(root) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


def test_local_repository_and_fetched_files_are_the_owners_only(repository, hf_model_dir, tmp_path):
    manifest = repository.push(hf_model_dir, "tiny", convert=False)
    repository.fetch("tiny", tmp_path / "fetched" / "tiny")
    fetched = _modes(tmp_path / "fetched")
    assert fetched == {"tiny": 0o700, **{f"tiny/{f.path}": 0o600 for f in manifest.files}}
    if isinstance(repository, LocalModelRepository):
        modes = _modes(repository.root)
        assert stat.S_IMODE(repository.root.stat().st_mode) == 0o700
        assert {mode for path, mode in modes.items() if (repository.root / path).is_dir()} == {0o700}
        assert {mode for path, mode in modes.items() if (repository.root / path).is_file()} == {0o600}
        assert modes[f"tiny/.revisions/{manifest.revision}/model.safetensors"] == 0o600


# --- a Hugging Face push is converted once and stored once: the thaw checkpoint ------------------


def test_a_hugging_face_push_is_stored_once_as_its_thaw_conversion_with_the_dir_as_fingerprints(
        repository, hf_model_dir, tmp_path):
    from loader import convert_checkpoint
    from worker import checkpoint_identity

    seen = []
    manifest = repository.push(hf_model_dir, "tiny", progress=lambda stage, done, total: seen.append(stage.value))
    assert manifest.kind == "thaw" and manifest.converted == ()
    assert [f.path for f in manifest.files] == ["config.json", "partition_000.bin", "thaw_index.json",
                                                "tokenizer.json"]
    assert [(f.path, f.size, f.xxh3_64) for f in manifest.source] == [
        (p.name, p.stat().st_size, file_xxh3_64(p)) for p in sorted(hf_model_dir.iterdir())]
    assert manifest.source_files == manifest.source
    assert repository.describe("tiny") == manifest
    # Stored once: only the checkpoint's objects exist (no copy of the safetensors weights).
    assert _object_keys(repository, "tiny") == sorted(manifest.object_key(f.path) for f in manifest.files)
    assert _object_keys(repository, "_thaw/tiny") == []
    assert seen[0] == "checking" and "converting" in seen and seen[-1] == "uploading"
    # What a node store copies is exactly what converting the dir gives, so a copy converted at
    # push and one a node converted (an older repository) are one checkpoint.
    result = repository.fetch("tiny", tmp_path / "thaw", prefer_thaw=True)
    assert (result.kind, result.num_files, result.num_bytes) == ("thaw", 4, manifest.checkpoint_bytes)
    convert_checkpoint(hf_model_dir, tmp_path / "local", progress=False)
    assert _same_tree(tmp_path / "local", tmp_path / "thaw")
    assert checkpoint_identity(tmp_path / "thaw") == checkpoint_identity(tmp_path / "local")
    # Replaced by a plain thaw push (no source), then deleted: nothing is left.
    thaw = repository.push(tmp_path / "local", "tiny", overwrite=True)
    assert thaw.source == () and thaw.source_files == thaw.files
    repository.push(hf_model_dir, "tiny", overwrite=True)
    repository.delete("tiny")
    assert _object_keys(repository, "_thaw/tiny") == [] and _object_keys(repository, "tiny") == []


def test_a_repository_written_before_keeps_serving_its_converted_copy(repository, hf_model_dir, tmp_path):
    """A manifest of the older layout (the dir as pushed, and its checkpoint under ``_thaw/``) is
    still read: a node store's fetch gets the checkpoint, a plain one the dir."""
    from loader import convert_checkpoint, model_dir_files
    from storage.repository_manifest import new_revision

    convert_checkpoint(hf_model_dir, tmp_path / "checkpoint", progress=False)
    revision = new_revision()
    files, converted = [], []
    for rel, path in model_dir_files(hf_model_dir):
        repository._upload_file(f"tiny/.revisions/{revision}/{rel}", path)
        files.append(ManifestFile(rel, path.stat().st_size, file_xxh3_64(path)))
    for rel, path in model_dir_files(tmp_path / "checkpoint"):
        repository._upload_file(f"_thaw/tiny/{revision}/{rel}", path)
        converted.append(ManifestFile(rel, path.stat().st_size, file_xxh3_64(path)))
    old = ModelManifest(model="tiny", kind="hf", files=tuple(files), pushed_at=1.0, revision=revision,
                        converted=tuple(converted))
    repository._write_object("_manifests/tiny.json", old.to_json().encode())
    assert repository.describe("tiny") == old and old.source_files == old.files
    assert repository.fetch("tiny", tmp_path / "thaw", prefer_thaw=True).kind == "thaw"
    assert _same_tree(tmp_path / "checkpoint", tmp_path / "thaw")
    assert repository.fetch("tiny", tmp_path / "as-pushed").kind == "hf"
    assert _same_tree(hf_model_dir, tmp_path / "as-pushed")
    repository.delete("tiny")
    assert _object_keys(repository, "_thaw/tiny") == [] and _object_keys(repository, "tiny") == []


def test_an_unconverted_push_and_a_dir_the_converter_cannot_read_are_stored_as_given(repository, hf_model_dir,
                                                                                     tmp_path, caplog):
    plain = repository.push(hf_model_dir, "plain", convert=False)
    assert plain.converted == () and _object_keys(repository, "_thaw/plain") == []
    assert repository.fetch("plain", tmp_path / "plain", prefer_thaw=True).kind == "hf"  # the store converts it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x07" * 1000)  # not a safetensors file
    manifest = repository.push(broken, "broken")
    assert (manifest.kind, manifest.converted, [f.path for f in manifest.files]) == ("hf", (), ["model.safetensors"])
    [warning] = [r for r in caplog.records if r.name == "storage.model_repository"]
    assert warning.levelname == "WARNING"
    assert warning.getMessage().startswith(f"model 'broken': converting {broken} to the thaw format at push failed")
    assert warning.getMessage().endswith("it is stored in Hugging Face form and every node store will try "
                                         "converting it on fetch")
