"""``thaw models push`` / ``thaw models ls``, run as a user runs them (a real subprocess), against a
local repository directory and a real S3-speaking server (moto over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The S3 server, its client and a tiny Hugging Face model are the storage tests' fixtures.
from tests.storage.conftest import hf_model_dir, s3_bucket, s3_client, s3_endpoint  # noqa: F401

THAW = str(Path(sys.executable).parent / "thaw")


def thaw(*args, env: dict | None = None, timeout=300):
    return subprocess.run([THAW, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_push_and_ls_local_repository(hf_model_dir, tmp_path):  # noqa: F811
    repo = tmp_path / "repo"
    empty = thaw("models", "ls", str(tmp_path))
    assert empty.returncode == 0 and "no models" in empty.stderr
    pushed = thaw("models", "push", str(hf_model_dir), str(repo), "--name", "tiny-llama")
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed tiny-llama (thaw, 4 files" in pushed.stderr  # converted at push, and stored so only
    table = thaw("models", "ls", str(repo))
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split()[:3] == ["MODEL", "KIND", "FILES"] and row.split()[:3] == ["tiny-llama", "thaw", "4"]
    again = thaw("models", "push", str(hf_model_dir), str(repo), "--name", "tiny-llama")
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
    replaced = thaw("models", "push", str(hf_model_dir), str(repo), "--name", "tiny-llama", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr


def test_push_and_ls_s3_with_flag_and_with_environment(hf_model_dir, s3_endpoint, s3_bucket):  # noqa: F811
    uri = f"s3://{s3_bucket}/team"
    pushed = thaw("models", "push", str(hf_model_dir), uri, "--endpoint-url", s3_endpoint)  # name from the dir
    assert pushed.returncode == 0, pushed.stderr
    listed = thaw("models", "ls", uri, "--json", env={"AWS_ENDPOINT_URL": s3_endpoint})
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert (entry["model"], entry["kind"], entry["num_files"]) == ("tiny", "thaw", 4)
    assert entry["total_bytes"] > sum(p.stat().st_size for p in hf_model_dir.iterdir())  # the weights, aligned


@pytest.mark.parametrize("args, message", [
    (["push", "{src}", "{repo}", "--name", "../escape"], "path separator"),
    (["push", "{missing}", "{repo}"], "source model directory not found"),
    (["push", "{src}", "s3://x"], "bucket name 'x'"),
    (["ls", "{repo}", "--endpoint-url", "http://localhost:9000"], "not an s3:// URI"),
])
def test_usage_errors_exit_2(hf_model_dir, tmp_path, args, message):  # noqa: F811
    filled = [a.format(src=hf_model_dir, repo=tmp_path / "repo", missing=tmp_path / "nope") for a in args]
    result = thaw("models", *filled)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_runtime_errors_exit_1_with_one_line(s3_endpoint, tmp_path):  # noqa: F811
    missing_bucket = thaw("models", "ls", "s3://no-such-bucket", "--endpoint-url", s3_endpoint)
    assert missing_bucket.returncode == 1
    assert missing_bucket.stderr.strip().splitlines() == [
        f"thaw models: error: bucket 'no-such-bucket' does not exist at {s3_endpoint}"]
    missing_dir = thaw("models", "ls", str(tmp_path / "nope"))
    assert missing_dir.returncode == 1 and "does not exist" in missing_dir.stderr


def test_push_of_a_directory_naming_files_outside_itself_exits_2(hf_model_dir, tmp_path):  # noqa: F811
    src = tmp_path / "src"
    src.mkdir()
    for path in hf_model_dir.iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(hf_model_dir / "model.safetensors")  # someone else's weights
    result = thaw("models", "push", str(src), str(tmp_path / "repo"), "--name", "linked")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (f"'model.safetensors' is a symlink to {hf_model_dir / 'model.safetensors'}, outside the directory; "
            f"copy the real files into the directory") in result.stderr
    assert not (tmp_path / "repo").exists()
