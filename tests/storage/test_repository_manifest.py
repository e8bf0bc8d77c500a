"""Repository manifests: round trip, revisions (and the version 1 layout without), and refusal of
anything a fetch could be tricked by."""

import json
import re

import pytest

from storage import ManifestError, ManifestFile, ModelManifest
from storage.repository_manifest import new_revision, revision_started_s


def manifest(**overrides) -> ModelManifest:
    fields = dict(model="m", kind="hf", pushed_at=12.5,
                  files=(ManifestFile("config.json", 10, "0123456789abcdef"),
                         ManifestFile("sub/model.safetensors", 90, "fedcba9876543210")))
    fields.update(overrides)
    return ModelManifest(**fields)


def test_round_trip_and_total():
    original = manifest()
    assert ModelManifest.from_json(original.to_json(), "x") == original
    assert original.total_bytes == 100


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/./b", "", "a\\b"])
def test_paths_that_could_escape_are_refused(path):
    with pytest.raises(ManifestError, match="file path"):
        ManifestFile(path, 1, "0123456789abcdef")


@pytest.mark.parametrize("overrides, message", [
    ({"model": "../m"}, "path separator"),
    ({"kind": "gguf"}, "kind 'gguf'"),
    ({"files": (ManifestFile("a", 1, "0123456789abcdef"),) * 2}, "listed twice"),
])
def test_inconsistent_manifests_are_refused(overrides, message):
    with pytest.raises(ManifestError, match=message):
        manifest(**overrides)


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    (json.dumps({"format": "other"}), "not a thaw repository manifest"),
    (json.dumps({"format": "thaw-repository-manifest", "version": 9}), "version 9 is not supported"),
    (json.dumps({"format": "thaw-repository-manifest", "version": 1, "model": "m"}), "missing or malformed"),
    (json.dumps({"format": "thaw-repository-manifest", "version": 1, "model": "m", "kind": "hf",
                 "pushed_at": "yesterday", "files": []}), "pushed_at"),
    (json.dumps({"format": "thaw-repository-manifest", "version": 1, "model": "m", "kind": "hf", "pushed_at": 1,
                 "files": [{"path": "a", "size": -1, "xxh3_64": "0123456789abcdef"}]}), "size -1"),
])
def test_malformed_json_names_the_origin(text, message):
    with pytest.raises(ManifestError, match=message) as info:
        ModelManifest.from_json(text, "s3://b/_manifests/m.json")
    assert "s3://b/_manifests/m.json" in str(info.value)


def test_a_revision_places_the_files_and_round_trips():
    revision = new_revision(1_700_000_000.25)
    assert re.fullmatch(r"1700000000250-[0-9a-f]{12}", revision) and revision_started_s(revision) == 1_700_000_000.25
    revised = manifest(revision=revision)
    assert json.loads(revised.to_json())["version"] == 2
    assert ModelManifest.from_json(revised.to_json(), "x") == revised
    assert revised.object_key("sub/model.safetensors") == f"m/.revisions/{revision}/sub/model.safetensors"
    legacy = manifest()  # as version 1 wrote it: files directly under the model's name
    assert json.loads(legacy.to_json())["version"] == 1 and "revision" not in json.loads(legacy.to_json())
    assert legacy.object_key("config.json") == "m/config.json"
    with pytest.raises(ManifestError, match="revision '../x' is not"):
        manifest(revision="../x")
    text = json.dumps({**json.loads(revised.to_json()), "revision": None})
    with pytest.raises(ManifestError, match="s3://b/_manifests/m.json: revision None is not"):
        ModelManifest.from_json(text, "s3://b/_manifests/m.json")


def test_a_converted_checkpoint_round_trips_is_optional_and_belongs_to_a_revised_hugging_face_push():
    revision = new_revision(1_700_000_000.25)
    converted = (ManifestFile("thaw_index.json", 7, "00000000000000aa"),
                 ManifestFile("partition_000.bin", 8192, "00000000000000bb"))
    published = manifest(revision=revision, converted=converted)
    data = json.loads(published.to_json())
    assert data["version"] == 2 and [f["path"] for f in data["converted"]] == ["thaw_index.json", "partition_000.bin"]
    assert ModelManifest.from_json(published.to_json(), "x") == published
    assert published.converted_key("partition_000.bin") == f"_thaw/m/{revision}/partition_000.bin"
    assert (published.total_bytes, published.checkpoint_bytes) == (100, 8199)
    plain = manifest(revision=revision)  # no conversion: the key is absent, and reads as none
    assert "converted" not in json.loads(plain.to_json())
    assert ModelManifest.from_json(plain.to_json(), "x").converted == () and plain.checkpoint_bytes == 100
    with pytest.raises(ManifestError, match="only a Hugging Face push with a revision"):
        manifest(kind="thaw", revision=revision, converted=converted)
    with pytest.raises(ManifestError, match="only a Hugging Face push with a revision"):
        manifest(converted=converted)
    with pytest.raises(ManifestError, match="a converted file is listed twice"):
        manifest(revision=revision, converted=converted[:1] * 2)
