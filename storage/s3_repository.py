"""A model repository in S3 or any S3-speaking store (MinIO, Ceph RGW, R2, moto...), via boto3.

``s3://bucket/prefix`` holds the same layout as a local repository. Credentials and region come
from boto3's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles, instance
roles); the endpoint from `endpoint_url` or ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``.

Downloads are the base class's parallel ranged reads: one ``GetObject`` with a ``Range`` header
per part, streamed with ``readinto`` into a reused buffer and ``pwrite`` at the part's offset, so
parts land out of order with no reassembly and at most one buffer per thread. (A single GET
stream is bounded by one TCP connection's throughput; several in flight is how S3 is read fast,
the same reason ServerlessLLM and the AWS CRT split objects into ranges.) Uploads use boto3's
managed multipart transfer. Every boto error surfaces as a `RepositoryError` naming the object.

A push's manifest is written conditionally (`_swap_object`): ``If-None-Match: *`` to create it,
``If-Match: <ETag>`` to replace the version the push started from; the store answers 412 (or
409 for a conditional write racing another) to the loser. AWS S3, MinIO and R2 honour these
headers; a store that ignores them degrades to last-writer-wins, where each manifest still names
only its own push's complete files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from storage.model_repository import (DEFAULT_MAX_CONCURRENCY, DEFAULT_PART_BYTES, MIB, ModelRepository,
                                      ObjectNotFoundError, RepositoryError)

S3_SCHEME = "s3://"
_MIN_MULTIPART_BYTES = 5 * MIB  # S3's smallest multipart part
_STREAM_BUFFER_BYTES = 1 * MIB
_MISSING_CODES = ("NoSuchKey", "404", "NotFound")
_PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_DELETE_BATCH = 1000  # DeleteObjects' limit per request


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix"); raises ValueError if malformed."""
    if not isinstance(uri, str) or not uri.startswith(S3_SCHEME):
        raise ValueError(f"{uri!r} is not an S3 URI; expected s3://bucket or s3://bucket/prefix")
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not bucket or not all(c.isalnum() or c in ".-" for c in bucket) or not 3 <= len(bucket) <= 63:
        raise ValueError(f"{uri!r}: bucket name {bucket!r} must be 3-63 characters of letters, digits, '.' and '-'")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"{uri!r}: prefix {prefix!r} has an empty, '.' or '..' segment")
    return bucket, prefix


def make_s3_client(endpoint_url: str | None = None, region: str | None = None,
                   max_concurrency: int = DEFAULT_MAX_CONCURRENCY):
    """A boto3 S3 client (credentials from boto3's usual chain) for up to `max_concurrency`
    transfers at once: one client shared by all threads (boto3 clients are thread-safe, sessions
    are not), its connection pool covering every range in flight, retries in standard mode."""
    config = botocore.config.Config(max_pool_connections=max(10, 2 * max_concurrency),
                                    retries={"max_attempts": 5, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


class S3ModelRepository(ModelRepository):
    """`ModelRepository` over ``s3://bucket/prefix``. `client` may be given (tests hook its events)."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None, region: str | None = None,
                 part_bytes: int = DEFAULT_PART_BYTES, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 upload_bytes_per_s: float | None = None, client=None):
        super().__init__(part_bytes=part_bytes, max_concurrency=max_concurrency, upload_bytes_per_s=upload_bytes_per_s)
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.client = client if client is not None else make_s3_client(endpoint_url, region, max_concurrency)
        self._transfer = TransferConfig(multipart_threshold=max(part_bytes, _MIN_MULTIPART_BYTES),
                                        multipart_chunksize=max(part_bytes, _MIN_MULTIPART_BYTES),
                                        max_concurrency=max_concurrency)

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key_uri(self, key: str) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self._key(key)}"

    @contextmanager
    def _errors(self, action: str, key: str, missing_hint: str = "") -> Iterator[None]:
        """Turn boto's errors into `RepositoryError`s a user can act on."""
        where = self._key_uri(key)
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code == "NoSuchBucket":
                raise RepositoryError(f"bucket {self.bucket!r} does not exist at "
                                      f"{self.client.meta.endpoint_url}") from None
            if code in _MISSING_CODES:
                raise ObjectNotFoundError(f"{where} does not exist{missing_hint}") from None
            raise RepositoryError(f"{action} {where} failed: {code} {error.get('Message', '')}".rstrip()) from None
        except botocore.exceptions.NoCredentialsError:
            raise RepositoryError(f"{action} {where}: no S3 credentials (set AWS_ACCESS_KEY_ID and "
                                  f"AWS_SECRET_ACCESS_KEY, or a profile)") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise RepositoryError(f"{action} {where} failed: {exc}") from None

    def _read_object(self, key: str) -> bytes | None:
        try:
            with self._errors("reading", key):
                return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ObjectNotFoundError:
            return None

    def _write_object(self, key: str, data: bytes) -> None:
        with self._errors("writing", key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _read_object_tagged(self, key: str) -> tuple[bytes, str] | None:
        try:
            with self._errors("reading", key):
                response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
                return response["Body"].read(), response["ETag"]
        except ObjectNotFoundError:
            return None

    def _swap_object(self, key: str, data: bytes, expected_tag: str | None) -> bool:
        condition = {"IfNoneMatch": "*"} if expected_tag is None else {"IfMatch": expected_tag}
        with self._errors("writing", key):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
            except botocore.exceptions.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                # If-Match on an object deleted meanwhile answers "missing": the expectation failed too.
                if code in _PRECONDITION_CODES or (expected_tag is not None and code in _MISSING_CODES):
                    return False
                raise
        return True

    def _upload_file(self, key: str, path: Path) -> None:
        with self._errors("uploading to", key):
            self.client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)

    def _list_objects(self, prefix: str) -> list[tuple[str, int]]:
        full = self._key(prefix) + "/"
        strip = len(self._key(""))
        found = []
        with self._errors("listing", prefix + "/"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                found += [(item["Key"][strip:], item["Size"]) for item in page.get("Contents", ())]
        return found

    def _delete_objects(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i: i + _DELETE_BATCH]
            with self._errors("deleting", batch[0]):
                response = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True})
            if response.get("Errors"):
                first = response["Errors"][0]
                raise RepositoryError(f"deleting {S3_SCHEME}{self.bucket}/{first.get('Key')} failed: "
                                      f"{first.get('Code')} {first.get('Message', '')}".rstrip())

    def _download_range(self, key: str, start: int, length: int, fd: int) -> None:
        with self._errors("downloading", key, " (its model's manifest lists it); push the model again"):
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={start}-{start + length - 1}")["Body"]
            buffer = bytearray(min(_STREAM_BUFFER_BYTES, length))
            view = memoryview(buffer)
            done = 0
            try:
                while done < length:
                    n = body.readinto(view[: min(len(view), length - done)])
                    if not n:
                        break
                    os.pwrite(fd, view[:n], start + done)
                    done += n
            finally:
                body.close()
        if done != length:
            raise RepositoryError(f"{self._key_uri(key)}: range [{start}, {start + length}) returned {done} bytes; "
                                  f"the object is shorter than its manifest says")
