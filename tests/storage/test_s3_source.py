"""`storage.S3Source`: a model directory in a bucket outside the repository, copied for a deploy,
against a real S3-speaking server (moto over HTTP): every file arrives with its bytes, hidden
files and directory markers are skipped, progress counts up to the total, and a missing bucket,
an empty prefix or a key that would land outside the directory is refused naming it."""

from __future__ import annotations

import pytest

from storage import S3Source, S3SourceError


def put(client, bucket: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


def test_the_files_under_the_prefix_arrive_whole_with_progress(s3_client, s3_bucket, tmp_path):
    big = bytes(range(256)) * 90_000  # 23 MB: more than one multipart part
    put(s3_client, s3_bucket, {"team/llama/config.json": b"{}", "team/llama/model.safetensors": big,
                               "team/llama/sub/tokenizer.json": b"tok", "team/llama/.gitattributes": b"x",
                               "team/llama/.cache/huggingface/lock": b"", "team/llama/": b"",
                               "team/llama-other/config.json": b"not this one"})
    source = S3Source(f"s3://{s3_bucket}/team/llama", s3_client)
    assert [f.path for f in source.files()] == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    seen: list[tuple[int, int]] = []
    total = source.download(tmp_path, lambda done, total: seen.append((done, total)))
    assert total == len(big) + 2 + 3
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == \
        ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert (tmp_path / "model.safetensors").read_bytes() == big
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o600
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert len(seen) > 3  # bytes reported as they arrived, not only at the end


def test_bad_sources_are_refused_naming_what_is_wrong(s3_client, s3_bucket, s3_endpoint, tmp_path):
    with pytest.raises(S3SourceError, match=f"bucket 'no-such-bucket' does not exist at {s3_endpoint}"):
        S3Source("s3://no-such-bucket/x", s3_client).files()
    with pytest.raises(S3SourceError, match="holds no files .is the prefix right"):
        S3Source(f"s3://{s3_bucket}/nothing-here", s3_client).files()
    put(s3_client, s3_bucket, {"odd/a//b.json": b"{}"})
    with pytest.raises(S3SourceError, match=r"odd/a//b.json cannot be a file of a model directory"):
        S3Source(f"s3://{s3_bucket}/odd", s3_client).files()
    with pytest.raises(S3SourceError, match="bucket name"):
        S3Source("s3://x", s3_client)
    assert list(tmp_path.iterdir()) == []
