"""A model directory in a bucket outside the platform's repository, read for a deploy: `S3Source`.

``thaw deploy --source s3://bucket/some/model`` names checkpoint files that someone published in
their own bucket (a Hugging Face dir, or a thaw one). The controller cannot deploy from a bucket
directly -- the push hashes, converts and stores a directory -- so the deploy first copies the
objects under the prefix into a private directory on the controller's machine, reporting bytes
as they arrive, and deploys that; the copy is deleted once the deploy ends, so the repository
alone holds the model.

What is read is checked before any byte is: each key below the prefix becomes a relative path
(no ``..``, no empty segment: nothing lands outside the directory); hidden files
(``.gitattributes``, ``.cache/...``) and directory markers are skipped, as a local push skips
them; at most `MAX_FILES` files; the directory's filesystem must have room for all of them.
Errors name the bucket and key and what to do (`RepositoryError`), never a boto traceback.

The client is the repository's own when the repository is in S3 (its endpoint and credentials),
else one from boto3's usual chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from storage.s3_repository import S3ModelRepository, make_s3_client, parse_s3_uri

__all__ = ["MAX_FILES", "S3Source", "S3SourceError", "SourceFile", "source_client"]

MAX_FILES = 10_000
_PART_BYTES = 16 << 20
_MAX_CONCURRENCY = 8


class S3SourceError(ValueError):
    """The source cannot be read: a message a user can act on (bucket, key, what to change)."""


@dataclass(frozen=True)
class SourceFile:
    """One object to copy: its key and the relative path it takes in the directory."""

    key: str
    path: str
    size: int


def source_client(repository):
    """The client to read a source with: the repository's own when it is in S3, else one from
    boto3's usual chain (``AWS_ENDPOINT_URL``, credentials, profile) sized like the download."""
    if isinstance(repository, S3ModelRepository):
        return repository.client
    return make_s3_client(max_concurrency=_MAX_CONCURRENCY)


class S3Source:
    """The objects under ``s3://bucket/prefix`` as a model directory (see the module docstring)."""

    def __init__(self, uri: str, client) -> None:
        try:
            self.bucket, self.prefix = parse_s3_uri(uri)
        except ValueError as exc:
            raise S3SourceError(str(exc)) from None
        self.uri = uri
        self.client = client

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        endpoint = self.client.meta.endpoint_url
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code == "NoSuchBucket":
                raise S3SourceError(f"bucket {self.bucket!r} does not exist at {endpoint}") from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise S3SourceError(f"{action} {self.uri}: access denied at {endpoint} ({code}); the controller "
                                    f"reads with its own credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                                    f"or a profile on its machine)") from None
            raise S3SourceError(f"{action} {self.uri} failed: {code} {error.get('Message', '')}".rstrip()) from None
        except botocore.exceptions.NoCredentialsError:
            raise S3SourceError(f"{action} {self.uri}: the controller has no S3 credentials (set "
                                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile, where it runs)") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise S3SourceError(f"{action} {self.uri} failed: {exc}") from None

    def files(self) -> list[SourceFile]:
        """The files to copy, checked (see the module docstring), sorted by path."""
        root = f"{self.prefix}/" if self.prefix else ""
        found: list[SourceFile] = []
        with self._errors("listing"):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root)
            for page in pages:
                for item in page.get("Contents", ()):
                    key: str = item["Key"]
                    path = key[len(root):]
                    if not path or path.endswith("/"):
                        continue  # the prefix itself, a directory marker
                    parts = path.split("/")
                    if any(part in ("", ".", "..") for part in parts) or "\\" in path or "\x00" in path:
                        raise S3SourceError(f"s3://{self.bucket}/{key} cannot be a file of a model directory "
                                            f"(an empty, '.' or '..' path segment); remove or rename it")
                    if any(part.startswith(".") for part in parts):
                        continue  # hidden: .gitattributes, .cache/huggingface/...
                    found.append(SourceFile(key=key, path=path, size=int(item["Size"])))
                    if len(found) > MAX_FILES:
                        raise S3SourceError(f"{self.uri} holds more than {MAX_FILES} files; point the source at "
                                            f"one model directory")
        if not found:
            raise S3SourceError(f"{self.uri} holds no files (is the prefix right? keys are case-sensitive)")
        return sorted(found, key=lambda f: f.path)

    def download(self, dest: Path, progress: Callable[[int, int], None] | None = None) -> int:
        """Copy every file into `dest` (a fresh private directory); returns the bytes copied.
        `progress(done, total)` hears the bytes as they arrive (from the transfer's threads)."""
        files = self.files()
        total = sum(f.size for f in files)
        free = shutil.disk_usage(dest).free
        if total > free:
            raise S3SourceError(f"{self.uri} is {total} bytes but the controller's disk has {free} bytes free "
                                f"under {dest}; free space there or deploy from a smaller source")
        transfer = TransferConfig(multipart_threshold=_PART_BYTES, multipart_chunksize=_PART_BYTES,
                                  max_concurrency=_MAX_CONCURRENCY)
        done = 0

        def count(num_bytes: int) -> None:
            nonlocal done
            done += num_bytes  # boto calls back from its threads; a lost update only lags the display
            if progress is not None:
                progress(min(done, total), total)

        if progress is not None:
            progress(0, total)
        for file in files:
            target = dest / file.path
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self._errors(f"reading s3://{self.bucket}/{file.key} of"):
                self.client.download_file(self.bucket, file.key, str(target), Config=transfer, Callback=count)
            os.chmod(target, 0o600)
            if target.stat().st_size != file.size:
                raise S3SourceError(f"s3://{self.bucket}/{file.key} changed while it was read ({file.size} bytes "
                                    f"listed, {target.stat().st_size} read); deploy again once it is written")
        if progress is not None:
            progress(total, total)
        return total
