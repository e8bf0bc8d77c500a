"""Fixtures for the storage tests: tiny checkpoints, a real S3-speaking server, store configs.

The S3 server is moto in server mode on a free port, reached over HTTP through boto3 with dummy
credentials -- the same code path as a real bucket. Every store here uses the real /dev/shm with
a platform id unique to this test session, and the session ends by checking that none of this
session's shared-memory directories is left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch

from loader import convert_checkpoint
from storage import NodeStoreConfig, S3ModelRepository
from tests.loader.hf_checkpoint_builder import llama_tensors, write_hf_checkpoint

SHM_ROOT = Path("/dev/shm")
SESSION_PLATFORM_ID = f"t{os.getpid()}x{uuid.uuid4().hex[:6]}"
CHUNK_BYTES = 8192  # several checksum chunks per partition even in a tiny checkpoint
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Poll `predicate` until true; a deadline turns a bug into a failure instead of a hang."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        pause.wait(0.002)


def shm_leftovers() -> list[str]:
    """This session's entries in /dev/shm (store dirs and their temporary siblings)."""
    return sorted(p.name for p in SHM_ROOT.iterdir() if SESSION_PLATFORM_ID in p.name)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    yield
    leftovers = shm_leftovers()
    for name in leftovers:  # clean up, then fail: the next run must not inherit them
        shutil.rmtree(SHM_ROOT / name, ignore_errors=True)
    assert leftovers == [], f"shared-memory directories left behind by the storage tests: {leftovers}"


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama-shaped Hugging Face dir (bf16, 2 layers, ~96 KB)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", llama_tensors(2, torch.bfloat16, seed=3))


@pytest.fixture(scope="session")
def thaw_model_dir(tmp_path_factory, hf_model_dir) -> Path:
    """The same model in thaw format, 8 KiB checksum chunks (~148 KB)."""
    out = tmp_path_factory.mktemp("thaw") / "tiny"
    convert_checkpoint(hf_model_dir, out, chunk_bytes=CHUNK_BYTES, progress=False)
    return out


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free local port, with dummy credentials in the environment."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
    with pytest.MonkeyPatch.context() as mp:
        for key, value in DUMMY_CREDENTIALS.items():
            mp.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(key, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_endpoint):
    """One boto3 client for the session (building one costs ~0.3 s; clients are thread-safe)."""
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def s3_events(s3_client):
    """``s3_events(event, handler)`` hooks the shared client's botocore events for one test."""
    registered = []

    def register(event: str, handler) -> None:
        s3_client.meta.events.register(event, handler)
        registered.append((event, handler))

    yield register
    for event, handler in registered:
        s3_client.meta.events.unregister(event, handler)


@pytest.fixture
def s3_bucket(s3_client) -> str:
    """A fresh, empty bucket for one test."""
    name = f"thaw-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_repository(s3_client, s3_bucket) -> S3ModelRepository:
    """A repository under a prefix of a fresh bucket, 16 KiB ranges, 4 in flight."""
    return S3ModelRepository(f"s3://{s3_bucket}/models", part_bytes=16384, max_concurrency=4, client=s3_client)


@pytest.fixture
def store_config(tmp_path):
    """A factory of quick store configs: this session's platform id, no calibration unless asked."""
    counter = iter(range(1000))

    def make(**overrides) -> NodeStoreConfig:
        fields = dict(ssd_dir=tmp_path / f"ssd{next(counter)}", ssd_capacity_bytes=64 << 20,
                      dram_capacity_bytes=64 << 20, platform_id=SESSION_PLATFORM_ID,
                      node_id=f"n{uuid.uuid4().hex[:8]}", calibrate=False, calibration_bytes=256 << 10,
                      repository_calibration_bytes=64 << 10)
        fields.update(overrides)
        return NodeStoreConfig(**fields)

    return make
