"""What only the S3 backend does: ranged GETs in parallel, multipart uploads, URI parsing and
the errors of a missing bucket or an unreachable endpoint -- against a real S3-speaking server."""

from __future__ import annotations

import threading

import pytest

from storage import RepositoryConfig, RepositoryError, S3ModelRepository, open_repository
from storage.s3_repository import parse_s3_uri

WAIT_S = 30  # a guard so a bug fails the test instead of hanging it


def test_fetch_issues_exact_ranged_gets_in_parallel(s3_repository, s3_events, thaw_model_dir, tmp_path, monkeypatch):
    manifest = s3_repository.push(thaw_model_dir, "tiny")
    ranges: dict[str, list[str]] = {}
    lock = threading.Lock()

    def record(params, **_):
        with lock:
            ranges.setdefault(params["Key"].rsplit("/", 1)[-1], []).append(params.get("Range"))  # by file name

    s3_events("before-parameter-build.s3.GetObject", record)
    # The first two ranges wait for each other: a sequential download would break the barrier.
    barrier = threading.Barrier(2, timeout=WAIT_S)
    seen = []
    real = s3_repository._download_range

    def gated(key, start, length, fd):
        with lock:
            seen.append(key)
            first_two = len(seen) <= 2
        if first_two:
            barrier.wait()
        real(key, start, length, fd)

    monkeypatch.setattr(s3_repository, "_download_range", gated)
    result = s3_repository.fetch("tiny", tmp_path / "out")

    partition = next(f for f in manifest.files if f.path == "partition_000.bin")
    expected = [f"bytes={o}-{min(o + 16384, partition.size) - 1}" for o in range(0, partition.size, 16384)]
    assert sorted(ranges["partition_000.bin"]) == sorted(expected) and len(expected) > 2
    assert sum(len(v) for k, v in ranges.items() if not k.endswith("tiny.json")) == result.num_requests
    assert (tmp_path / "out" / "partition_000.bin").read_bytes() == (thaw_model_dir / "partition_000.bin").read_bytes()


def test_large_file_goes_up_in_multipart_and_comes_back_intact(s3_client, s3_events, s3_bucket, tmp_path):
    repo = S3ModelRepository(f"s3://{s3_bucket}", part_bytes=5 << 20, max_concurrency=4, client=s3_client)
    src = tmp_path / "big"
    src.mkdir()
    payload = bytes(range(256)) * (45_000)  # 11.5 MB: 3 upload parts, 3 ranges
    (src / "model.safetensors").write_bytes(payload)
    calls = []
    s3_events("before-parameter-build.s3.UploadPart", lambda params, **_: calls.append(params["PartNumber"]))
    repo.push(src, "big")
    assert sorted(calls) == [1, 2, 3]
    result = repo.fetch("big", tmp_path / "out")
    assert result.num_requests == 3
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == payload


def test_repository_at_bucket_root_and_under_prefix_do_not_see_each_other(s3_client, s3_bucket, hf_model_dir):
    root = S3ModelRepository(f"s3://{s3_bucket}", client=s3_client)
    nested = S3ModelRepository(f"s3://{s3_bucket}/team/a/", client=s3_client)
    assert nested.uri == f"s3://{s3_bucket}/team/a"
    nested.push(hf_model_dir, "tiny")
    assert [m.model for m in nested.list_models()] == ["tiny"]
    assert root.list_models() == []


def test_missing_bucket_and_unreachable_endpoint_are_clear(s3_endpoint):
    missing = open_repository(RepositoryConfig("s3://no-such-bucket/x", endpoint_url=s3_endpoint))
    with pytest.raises(RepositoryError, match="bucket 'no-such-bucket' does not exist"):
        missing.list_models()
    unreachable = S3ModelRepository("s3://bucket1", endpoint_url="http://127.0.0.1:9", max_concurrency=1)
    unreachable.client.meta.config.retries = {"max_attempts": 1}
    with pytest.raises(RepositoryError, match="Could not connect"):
        unreachable.describe("x")


@pytest.mark.parametrize("uri, expected", [
    ("s3://bucket", ("bucket", "")), ("s3://bucket/", ("bucket", "")), ("s3://my.bucket/a/b/", ("my.bucket", "a/b")),
])
def test_parse_s3_uri(uri, expected):
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize("uri", ["bucket/x", "s3://", "s3://b", "s3://bad_bucket", "s3://bucket/a/../b", "s3://bucket/a//b"])
def test_parse_s3_uri_refuses(uri):
    with pytest.raises(ValueError):
        parse_s3_uri(uri)


@pytest.mark.parametrize("kwargs, message", [
    ({"uri": ""}, "uri must be"),
    ({"uri": "http://host/x"}, "only s3://"),
    ({"uri": "/tmp/repo", "endpoint_url": "http://x"}, "not an s3:// URI"),
    ({"uri": "s3://bucket", "endpoint_url": "localhost:9000"}, "must start with http"),
    ({"uri": "s3://bucket", "part_bytes": 100}, "part_bytes"),
    ({"uri": "s3://bucket", "max_concurrency": 0}, "max_concurrency"),
    ({"uri": "s3://bucket", "max_concurrency": True}, "max_concurrency"),
])
def test_repository_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RepositoryConfig(**kwargs)


def test_open_repository_picks_the_backend(tmp_path):
    from storage import LocalModelRepository

    assert isinstance(open_repository(RepositoryConfig(str(tmp_path))), LocalModelRepository)
    s3 = open_repository(RepositoryConfig("s3://bucket/p", endpoint_url="http://127.0.0.1:9", part_bytes=8192))
    assert isinstance(s3, S3ModelRepository) and s3.part_bytes == 8192 and s3.uri == "s3://bucket/p"
