"""`controller.UploadArea`: pieces land only where their file's bytes end, a seal checks every file
against the caller's list, nothing is written outside the upload, and old uploads expire."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
import xxhash

from controller import InvalidUploadError, UnknownUploadError, UploadOffsetError
from controller.upload_area import UPLOAD_EXPIRY_S, UploadArea, upload_id_of, validate_upload_path


def entry(data: bytes) -> dict:
    return {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}


def test_pieces_append_at_their_offset_and_a_misplaced_one_names_where_to_resume(tmp_path):
    area = UploadArea(tmp_path / "uploads")
    upload_id = area.create()
    assert area.write(upload_id, "config.json", 0, b"{}") == 2
    assert area.write(upload_id, "model.safetensors", 0, b"a" * 5) == 5
    assert area.write(upload_id, "model.safetensors", 5, b"b" * 3) == 8
    with pytest.raises(UploadOffsetError) as stale:  # a piece sent again, or out of order
        area.write(upload_id, "model.safetensors", 5, b"b" * 3)
    assert stale.value.size == 8 and "send the piece at offset 8, not 5" in str(stale.value)
    copy = pickle.loads(pickle.dumps(stale.value))  # crosses Ray with its fields
    assert (copy.size, str(copy)) == (8, str(stale.value))
    assert area.write(upload_id, "additional_chat_templates/tool_use.jinja", 0, b"t") == 1
    assert area.status(upload_id) == {"upload_id": upload_id, "sealed": False, "files": {
        "additional_chat_templates/tool_use.jinja": 1, "config.json": 2, "model.safetensors": 8}}
    directory = tmp_path / "uploads" / upload_id
    assert (directory / "model.safetensors").read_bytes() == b"aaaaabbb"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "model.safetensors").stat().st_mode) == 0o600


@pytest.mark.parametrize("path", ["../escape", "/abs", "a//b", "./a", ".hidden", "dir/.git/x", "a\\b", ""])
def test_a_path_outside_the_directory_is_refused(tmp_path, path):
    area = UploadArea(tmp_path)
    upload_id = area.create()
    with pytest.raises(InvalidUploadError) as bad:
        area.write(upload_id, path, 0, b"x")
    assert bad.value.field == "path"
    assert sorted(p.name for p in (tmp_path / upload_id).iterdir()) == []


def test_unknown_ids_and_bad_offsets_are_refused(tmp_path):
    area = UploadArea(tmp_path)
    for upload_id in ("nope", "0" * 32, "../" + "0" * 29):
        with pytest.raises(UnknownUploadError):
            area.status(upload_id)
    upload_id = area.create()
    with pytest.raises(InvalidUploadError, match="offset: must be an integer >= 0"):
        area.write(upload_id, "a", -1, b"x")
    assert upload_id_of(f"upload:{upload_id}") == upload_id and upload_id_of("/models/x") is None
    assert validate_upload_path("tokenizer.json") == "tokenizer.json"


def test_a_seal_checks_every_file_and_only_a_sealed_upload_is_deployed(tmp_path):
    area = UploadArea(tmp_path)
    upload_id = area.create()
    weights, config = b"w" * 100, b'{"a": 1}'
    area.write(upload_id, "model.safetensors", 0, weights[:60])
    area.write(upload_id, "config.json", 0, config)
    with pytest.raises(InvalidUploadError, match="source: upload .* is not sealed yet"):
        area.path_of(upload_id)
    listed = {"model.safetensors": entry(weights), "config.json": entry(config)}
    with pytest.raises(InvalidUploadError, match="'model.safetensors' has 60 bytes uploaded, the list says 100: "
                                                 "resume it from byte 60"):
        area.seal(upload_id, listed)
    area.write(upload_id, "model.safetensors", 60, weights[60:])
    with pytest.raises(InvalidUploadError, match="'tokenizer.json' was never uploaded"):
        area.seal(upload_id, {**listed, "tokenizer.json": entry(b"t")})
    with pytest.raises(InvalidUploadError, match="'config.json' was uploaded but is not in the list"):
        area.seal(upload_id, {"model.safetensors": entry(weights)})
    with pytest.raises(InvalidUploadError, match="'config.json' arrived with xxh3_64 .* upload it again"):
        area.seal(upload_id, {**listed, "config.json": entry(b'{"a": 2}')})
    assert area.seal(upload_id, listed)["sealed"] is True
    assert area.path_of(upload_id) == tmp_path / upload_id
    with pytest.raises(UploadOffsetError, match="the upload is sealed"):
        area.write(upload_id, "more.json", 0, b"x")
    assert area.status(upload_id)["files"] == {"config.json": len(config), "model.safetensors": 100}
    area.delete(upload_id)
    with pytest.raises(UnknownUploadError):
        area.path_of(upload_id)


def test_uploads_untouched_for_a_day_are_deleted_by_the_next_create(tmp_path):
    now = [1_000_000.0]
    area = UploadArea(tmp_path, clock=lambda: now[0])
    old = area.create()
    area.write(old, "a", 0, b"x")
    os.utime(tmp_path / old, (now[0] - UPLOAD_EXPIRY_S - 1, now[0] - UPLOAD_EXPIRY_S - 1))
    fresh = area.create()
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh]
