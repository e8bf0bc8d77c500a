"""Where the model repository is and how to transfer from it: one frozen, validating config.

A Ray actor cannot receive a live boto3 client, so nodes receive this config and build their
own repository with `open_repository`; the URI decides the backend (``s3://`` or a path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from storage.local_repository import LocalModelRepository
from storage.model_repository import DEFAULT_MAX_CONCURRENCY, DEFAULT_PART_BYTES, ModelRepository
from storage.s3_repository import S3_SCHEME, S3ModelRepository, parse_s3_uri

_MIN_PART_BYTES = 4096
_MAX_CONCURRENCY = 256


@dataclass(frozen=True)
class RepositoryConfig:
    """`uri`: a directory path or ``s3://bucket/prefix``. `endpoint_url`/`region`: S3 only (None:
    boto3's environment, e.g. ``AWS_ENDPOINT_URL``). `part_bytes`: the size of one ranged read;
    `max_concurrency`: ranges (and uploads) in flight. `upload_bytes_per_s`: a cap on what pushes
    (deploys) upload per second, all together, so they leave the link to node fetches (None: none)."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    part_bytes: int = DEFAULT_PART_BYTES
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    upload_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ValueError("RepositoryConfig.uri must be a directory path or s3://bucket/prefix")
        if self.is_s3:
            parse_s3_uri(self.uri)
        elif self.uri.startswith(("s3:", "http://", "https://")) or "://" in self.uri:
            raise ValueError(f"RepositoryConfig.uri {self.uri!r}: only s3://bucket/prefix URIs and local paths "
                             f"are supported")
        if self.endpoint_url is not None:
            if not self.is_s3:
                raise ValueError(f"RepositoryConfig.endpoint_url is set but uri {self.uri!r} is not an s3:// URI")
            if not self.endpoint_url.startswith(("http://", "https://")):
                raise ValueError(f"RepositoryConfig.endpoint_url {self.endpoint_url!r} must start with "
                                 f"http:// or https://")
        for name, value, low, high in (("part_bytes", self.part_bytes, _MIN_PART_BYTES, None),
                                       ("max_concurrency", self.max_concurrency, 1, _MAX_CONCURRENCY)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                bound = f"in {low}..{high}" if high else f">= {low}"
                raise ValueError(f"RepositoryConfig.{name} is {value!r}; it must be an integer {bound}")

        value = self.upload_bytes_per_s
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"RepositoryConfig.upload_bytes_per_s is {value!r}; it must be None (no cap) or a "
                             f"number of bytes per second > 0")

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith(S3_SCHEME)


def open_repository(config: RepositoryConfig) -> ModelRepository:
    """The repository `config` describes (no I/O until it is used)."""
    if config.is_s3:
        return S3ModelRepository(config.uri, endpoint_url=config.endpoint_url, region=config.region,
                                 part_bytes=config.part_bytes, max_concurrency=config.max_concurrency,
                                 upload_bytes_per_s=config.upload_bytes_per_s)
    return LocalModelRepository(config.uri, part_bytes=config.part_bytes, max_concurrency=config.max_concurrency,
                                upload_bytes_per_s=config.upload_bytes_per_s)
