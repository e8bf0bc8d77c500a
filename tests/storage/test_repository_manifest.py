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
