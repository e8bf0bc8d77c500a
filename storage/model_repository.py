"""The model repository: the source of truth every node's caches fill from.

One small interface (`ModelRepository`: push, list_models, describe, fetch, delete) over two
backends that only move bytes: `LocalModelRepository` (a directory, the embedded default) and
`S3ModelRepository` (any S3-speaking store). Everything that makes the repository trustworthy
lives here, once, on top of a handful of object primitives:

- layout: a model's files under ``<model>/``, its manifest at ``_manifests/<model>.json``,
  calibration probes under ``_probes/`` (names cannot start with ``_``, so these never collide);
- completeness: a push deletes the old manifest, clears stale objects, uploads the files and
  writes the manifest *last*; listings read manifests only, so an interrupted push is invisible;
- fetch: every file split into ``part_bytes`` ranges, all ranges of all files downloaded on one
  pool of ``max_concurrency`` threads straight into their place in the destination files
  (parallel ranged GETs on S3, ``copy_file_range`` locally), then sizes and xxh3_64 verified.

A fetch writes into the directory it is given; making the result appear atomically (temp dir +
rename) is the caller's job -- the node store does exactly that.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import xxhash

from storage.model_name import validate_model_name
from storage.repository_manifest import ManifestFile, ModelManifest

MIB = 1 << 20
DEFAULT_PART_BYTES = 64 * MIB  # one ranged GET; big enough to amortise request latency, small enough to spread
DEFAULT_MAX_CONCURRENCY = 8
MANIFEST_PREFIX = "_manifests"
PROBE_PREFIX = "_probes"
THAW_INDEX_FILE = "thaw_index.json"  # what marks a thaw checkpoint dir (loader.format)
_HASH_BLOCK_BYTES = 8 * MIB
_MAX_NAMES_IN_ERROR = 10


class RepositoryError(Exception):
    """A repository operation failed (unreachable endpoint, missing bucket, refused credentials...)."""


class ModelNotFoundError(RepositoryError, LookupError):
    """The repository holds no complete model of that name."""


class ObjectNotFoundError(RepositoryError, LookupError):
    """A file a model's manifest lists is gone from the repository."""


class ModelExistsError(RepositoryError):
    """A push would replace a complete model, and overwrite was not asked for."""


class FetchVerificationError(RepositoryError):
    """A downloaded file's size or xxh3_64 differs from the manifest (corrupted in store or in transit)."""


@dataclass(frozen=True)
class FetchResult:
    """What one fetch did; `num_requests` counts ranged reads (GETs on S3)."""

    model: str
    kind: str
    num_files: int
    num_bytes: int
    num_requests: int
    elapsed_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0


def file_xxh3_64(path: Path) -> str:
    """xxh3_64 of a file's bytes as 16 hex digits, streamed (never the whole file in memory)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def source_files(src_dir: Path) -> list[tuple[str, Path]]:
    """(relative '/'-path, path) of every regular file under `src_dir`, sorted, hidden entries
    (any segment starting with '.', e.g. a Hugging Face ``.cache``) skipped, symlinks followed."""
    found = []
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        found.append((rel.as_posix(), path))
    return found


def model_kind(src_dir: Path, rel_paths: list[str]) -> str:
    """'thaw' for a thaw checkpoint, 'hf' for a dir with safetensors weights; anything else is refused."""
    if THAW_INDEX_FILE in rel_paths:
        # Imported here: the loader brings torch (seconds to import), which listing or pushing a
        # Hugging Face dir does not need.
        from loader import is_thaw_checkpoint

        if is_thaw_checkpoint(src_dir):
            return "thaw"
    if any(p.endswith(".safetensors") for p in rel_paths):
        return "hf"
    raise ValueError(f"{src_dir} is neither a thaw checkpoint (thaw_index.json) nor a Hugging Face model "
                     f"dir with *.safetensors weights")


class ModelRepository(ABC):
    """Source of truth for model files; see the module docstring. Thread-safe."""

    def __init__(self, *, part_bytes: int = DEFAULT_PART_BYTES, max_concurrency: int = DEFAULT_MAX_CONCURRENCY):
        if part_bytes < 1:
            raise ValueError(f"part_bytes is {part_bytes}; it must be >= 1")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency is {max_concurrency}; it must be >= 1")
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency

    # -- backend primitives: keys are '/'-separated, relative to the repository root -------------

    @property
    @abstractmethod
    def uri(self) -> str:
        """Where the repository lives, as a user would type it (a path or s3://bucket/prefix)."""

    @abstractmethod
    def _key_uri(self, key: str) -> str:
        """A key as a user-readable location, for error messages."""

    @abstractmethod
    def _read_object(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""

    @abstractmethod
    def _write_object(self, key: str, data: bytes) -> None:
        """Create or replace an object; readers see the old or the new bytes, never a part."""

    @abstractmethod
    def _upload_file(self, key: str, path: Path) -> None:
        """Create or replace an object with a local file's bytes."""

    @abstractmethod
    def _list_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under ``prefix/``."""

    @abstractmethod
    def _delete_objects(self, keys: list[str]) -> None:
        """Delete the objects; missing ones are ignored."""

    @abstractmethod
    def _download_range(self, key: str, start: int, length: int, fd: int) -> None:
        """Write the object's bytes [start, start + length) at the same offset of `fd`.

        Raises `ObjectNotFoundError` if the object is gone, `RepositoryError` if it is shorter."""

    def _prepare_for_push(self) -> None:
        """Create what a first push needs (a local repository creates its directory)."""

    # -- the interface ----------------------------------------------------------------------------

    @staticmethod
    def _manifest_key(model: str) -> str:
        return f"{MANIFEST_PREFIX}/{model}.json"

    def _model_names(self) -> list[str]:
        names = []
        for key, _ in self._list_objects(MANIFEST_PREFIX):
            name = key[len(MANIFEST_PREFIX) + 1:]
            if "/" not in name and name.endswith(".json"):
                names.append(name[: -len(".json")])
        return sorted(names)

    def exists(self, model: str) -> bool:
        return self._read_object(self._manifest_key(validate_model_name(model))) is not None

    def describe(self, model: str) -> ModelManifest:
        """The manifest of a complete model: kind, files with sizes and checksums, push time."""
        key = self._manifest_key(validate_model_name(model))
        data = self._read_object(key)
        if data is None:
            names = self._model_names()
            shown = ", ".join(names[:_MAX_NAMES_IN_ERROR]) + (", ..." if len(names) > _MAX_NAMES_IN_ERROR else "")
            raise ModelNotFoundError(f"model {model!r} not found in {self.uri} "
                                     f"({f'{len(names)} models there: {shown}' if names else 'it holds no models'})")
        return ModelManifest.from_json(data, origin=self._key_uri(key))

    def list_models(self) -> list[ModelManifest]:
        """Every complete model, sorted by name (an interrupted push is not listed)."""
        manifests = []
        for name in self._model_names():
            data = self._read_object(self._manifest_key(name))
            if data is not None:  # deleted since the listing
                manifests.append(ModelManifest.from_json(data, origin=self._key_uri(self._manifest_key(name))))
        return manifests

    def push(self, src_dir: str | Path, model: str, *, overwrite: bool = False) -> ModelManifest:
        """Upload a Hugging Face or thaw-format model dir as `model`; returns its manifest.

        The manifest goes last, so until this returns the model is absent from listings (with
        `overwrite`, the old version disappears first: readers never see a mix of the two)."""
        validate_model_name(model)
        src = Path(src_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"model directory {src} does not exist")
        files = source_files(src)
        kind = model_kind(src, [rel for rel, _ in files])
        self._prepare_for_push()
        manifest_key = self._manifest_key(model)
        if self._read_object(manifest_key) is not None:
            if not overwrite:
                raise ModelExistsError(f"model {model!r} already exists in {self.uri}; pass overwrite to replace it")
            self._delete_objects([manifest_key])
        stale = [key for key, _ in self._list_objects(model)]  # an old version or an interrupted push
        if stale:
            self._delete_objects(stale)

        def upload(rel: str, path: Path) -> ManifestFile:
            size = path.stat().st_size
            digest = file_xxh3_64(path)
            self._upload_file(f"{model}/{rel}", path)
            return ManifestFile(path=rel, size=size, xxh3_64=digest)

        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-push") as pool:
            entries = list(pool.map(lambda item: upload(*item), files))
        manifest = ModelManifest(model=model, kind=kind, files=tuple(entries), pushed_at=time.time())
        self._write_object(manifest_key, manifest.to_json().encode())
        return manifest

    def delete(self, model: str) -> None:
        """Remove a model: its manifest first (it stops being listed), then its files."""
        self.describe(model)
        self._delete_objects([self._manifest_key(model)])
        self._delete_objects([key for key, _ in self._list_objects(model)])

    def fetch(self, model: str, dest_dir: str | Path, *, verify: bool = True) -> FetchResult:
        """Download a complete model into `dest_dir` (absent or empty) with parallel ranged reads.

        With `verify`, every file's size and xxh3_64 are checked against the manifest
        (`FetchVerificationError` otherwise). On error, `dest_dir` is left partly written: the
        caller fetches into a temporary directory and discards it."""
        start = time.perf_counter()
        manifest = self.describe(model)
        dest = Path(dest_dir)
        if dest.exists() and any(dest.iterdir()):
            raise FileExistsError(f"fetch destination {dest} is not empty")
        dest.mkdir(parents=True, exist_ok=True)
        num_requests = self._download_files(model, [(f.path, f.size) for f in manifest.files], dest)
        if verify:
            with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-verify") as pool:
                list(pool.map(lambda f: self._verify_file(model, f, dest / f.path), manifest.files))
        return FetchResult(model=model, kind=manifest.kind, num_files=len(manifest.files),
                           num_bytes=manifest.total_bytes, num_requests=num_requests,
                           elapsed_s=time.perf_counter() - start)

    def _verify_file(self, model: str, entry: ManifestFile, path: Path) -> None:
        size = path.stat().st_size
        if size != entry.size:
            raise FetchVerificationError(f"{self._key_uri(f'{model}/{entry.path}')}: downloaded {size} bytes, "
                                         f"the manifest says {entry.size}")
        digest = file_xxh3_64(path)
        if digest != entry.xxh3_64:
            raise FetchVerificationError(f"{self._key_uri(f'{model}/{entry.path}')}: downloaded bytes have xxh3_64 "
                                         f"{digest}, the manifest says {entry.xxh3_64}; push the model again")

    def _download_files(self, prefix: str, files: list[tuple[str, int]], dest: Path) -> int:
        """Download ``prefix/<rel>`` to ``dest/<rel>`` for each (rel, size), all ranges on one pool."""
        fds: list[int] = []
        parts: list[tuple[str, int, int, int]] = []  # key, start, length, fd
        try:
            for rel, size in files:
                path = dest / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                os.ftruncate(fd, size)
                parts += [(f"{prefix}/{rel}", off, min(self.part_bytes, size - off), fd)
                          for off in range(0, size, self.part_bytes)]
            failed = threading.Event()

            def run(part: tuple[str, int, int, int]) -> None:
                if not failed.is_set():  # after one failure, skip the queued rest
                    try:
                        self._download_range(*part)
                    except BaseException:
                        failed.set()
                        raise

            with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-fetch") as pool:
                futures = [pool.submit(run, part) for part in parts]
                wait(futures, return_when=FIRST_EXCEPTION)
                for future in futures:
                    if future.done() and future.exception() is not None:
                        raise future.exception()
        finally:
            for fd in fds:
                os.close(fd)
        return len(parts)

    def measure_download_bytes_per_s(self, num_bytes: int, scratch_dir: str | Path, probe_id: str) -> float:
        """Upload a `num_bytes` probe object, time its download (same path as a fetch), delete it.

        Needs write access; the probe lives under ``_probes/``, never listed as a model."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes is {num_bytes}; it must be > 0")
        validate_model_name(probe_id)
        key = f"{PROBE_PREFIX}/{probe_id}"
        self._write_object(f"{key}/probe.bin", os.urandom(num_bytes))
        scratch = Path(tempfile.mkdtemp(prefix=".probe-", dir=scratch_dir))
        try:
            start = time.perf_counter()
            self._download_files(key, [("probe.bin", num_bytes)], scratch)
            elapsed = time.perf_counter() - start
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._delete_objects([f"{key}/probe.bin"])
        return num_bytes / max(elapsed, 1e-9)
