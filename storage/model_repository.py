"""The model repository: the source of truth every node's caches fill from.

One small interface (`ModelRepository`: push, list_models, describe, fetch, delete) over two
backends that only move bytes: `LocalModelRepository` (a directory, the embedded default) and
`S3ModelRepository` (any S3-speaking store). Everything that makes the repository trustworthy
lives here, once, on top of a handful of object primitives:

- layout: a model's manifest at ``_manifests/<model>.json``, the files of each push under a
  prefix of their own, ``<model>/.revisions/<revision>/`` (older repositories: directly under
  ``<model>/``, which the manifest's version says); calibration probes under ``_probes/`` (names
  cannot start with ``_``, so these never collide);
- staged pushes, made visible in one step: a push uploads into its own fresh revision, which no
  reader and no other push touches, and then writes the manifest *conditionally* -- create it
  only if absent (no overwrite), or replace it only if it still is the one the push started from
  (overwrite). Of two pushes of one name racing, exactly one wins; the other gets
  `PushConflictError` and deletes what it staged. Listings read manifests only, so an
  interrupted push is invisible, and readers see the old version whole until the new manifest
  replaces it; only then are the replaced version's files deleted. (The condition is a lock file
  locally, ``If-None-Match``/``If-Match`` on S3.) Revisions left by a crashed push are deleted by
  the next push or delete of that model once `ABANDONED_PUSH_S` old;
- the source directory is read through `loader.model_dir_files`: a symlink or index entry
  leading outside it is refused (`loader.UnsafeModelDirError`, a ValueError), so a push never
  uploads someone else's files;
- conversion once, at push, and the model stored once: a Hugging Face dir is converted to the
  thaw format (in a temporary directory under ``TMPDIR``) and only that checkpoint is uploaded
  (it carries the config, tokenizer and chat templates serving needs); the dir as pushed is kept
  as fingerprints (`ModelManifest.source`), which re-deploys compare their source with. Node
  stores fetch the checkpoint and only copy. A dir the converter cannot read is stored as given,
  with a warning: node stores then convert it on fetch (and report the same error when they do).
  Repositories pushed before stored the dir and the checkpoint beside it (``_thaw/<model>/...``,
  `ModelManifest.converted`); those are still read, and ``fetch(..., prefer_thaw=True)`` gets
  their checkpoint;
- fetch: every file split into ``part_bytes`` ranges, all ranges of all files downloaded on one
  pool of ``max_concurrency`` threads straight into their place in the destination files
  (parallel ranged GETs on S3, ``copy_file_range`` locally), then sizes and xxh3_64 verified.
  What it writes is the owner's only (directories 0700, files 0600).

A fetch writes into the directory it is given; making the result appear atomically (temp dir +
rename) is the caller's job -- the node store does exactly that.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import xxhash

from loader import make_private_dirs, model_dir_files, open_private
from storage.model_name import validate_model_name
from wire import DeployStage
from storage.repository_manifest import (CONVERTED_PREFIX, REVISIONS_DIR, ManifestError, ManifestFile, ModelManifest,
                                         new_revision, revision_started_s, validate_revision)

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_PART_BYTES = 64 * MIB  # one ranged GET; big enough to amortise request latency, small enough to spread
DEFAULT_MAX_CONCURRENCY = 8
MANIFEST_PREFIX = "_manifests"
PROBE_PREFIX = "_probes"
THAW_INDEX_FILE = "thaw_index.json"  # what marks a thaw checkpoint dir (loader.format)
ABANDONED_PUSH_S = 24 * 3600.0  # a revision no manifest names, older than this, is a crashed push's
_HASH_BLOCK_BYTES = 8 * MIB
_PACING_BYTES = 256 << 10  # a throttled upload's slice
_MAX_NAMES_IN_ERROR = 10


# What a push reports as it goes: (stage, bytes done, bytes total) -- CHECKING, CONVERTING (the
# weights converted to the thaw format), UPLOADING (bytes checksummed and uploaded). Called from the
# push's threads; the deploy job (`controller.DeployJob`) turns it into rate and ETA.
PushProgress = Callable[[DeployStage, int, int], None]


def _no_progress(stage: DeployStage, done: int, total: int) -> None:
    """A push nobody watches."""


class UploadThrottle:
    """Caps the bytes a repository's pushes upload per second, over all their threads and files
    together, on either backend: a deploy's push then leaves the link to the node stores' fetches.
    `take(n)` blocks until `n` more bytes fit the rate -- pacing, not synchronisation."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"upload bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._next_free = time.monotonic()  # when the bytes sent so far have "drained" at the rate

    def take(self, num_bytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + num_bytes / self.bytes_per_s
            wait_s = start - now
        if wait_s > 0:
            time.sleep(wait_s)


class RepositoryError(Exception):
    """A repository operation failed (unreachable endpoint, missing bucket, refused credentials...)."""


class ModelNotFoundError(RepositoryError, LookupError):
    """The repository holds no complete model of that name."""


class ObjectNotFoundError(RepositoryError, LookupError):
    """A file a model's manifest lists is gone from the repository."""


class ModelExistsError(RepositoryError):
    """A push would replace a complete model, and overwrite was not asked for."""


class PushConflictError(RepositoryError):
    """Another push of the same model became visible while this one was uploading; this one was
    discarded (exactly one of two racing pushes wins)."""


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


def model_kind(src_dir: Path, rel_paths: list[str]) -> str:
    """'thaw' for a thaw checkpoint, 'hf' for a dir with safetensors weights; anything else is refused."""
    if THAW_INDEX_FILE in rel_paths:
        # Imported here: it brings the loader's format module and so torch (seconds to import),
        # which listing or pushing a Hugging Face dir does not need.
        from loader import is_thaw_checkpoint

        if is_thaw_checkpoint(src_dir):
            return "thaw"
    if any(p.endswith(".safetensors") for p in rel_paths):
        return "hf"
    raise ValueError(f"{src_dir} is neither a thaw checkpoint (thaw_index.json) nor a Hugging Face model "
                     f"dir with *.safetensors weights")


def _object_keys(manifest: ModelManifest) -> list[str]:
    """Every object a manifest names: its files and its converted checkpoint's."""
    return ([manifest.object_key(f.path) for f in manifest.files]
            + [manifest.converted_key(f.path) for f in manifest.converted])


def _convert_for_push(src: Path, model: str, scratch: Path, progress: PushProgress) -> Path | None:
    """The Hugging Face dir `src` converted to a thaw checkpoint under `scratch`; None, with a
    warning, when the converter cannot read it (node stores then convert on fetch, as before)."""
    try:
        # Imported here: the converter brings torch, which a thaw push or a listing does not need.
        from loader import convert_checkpoint

        out = scratch / "checkpoint"
        convert_checkpoint(src, out, progress=lambda done, total: progress(DeployStage.CONVERTING, done, total))
        return out
    except Exception as exc:  # noqa: BLE001 - stored as given; the node store's conversion reports it at start
        logger.warning("model %r: converting %s to the thaw format at push failed (%s: %s); it is stored in "
                       "Hugging Face form and every node store will try converting it on fetch", model, src,
                       type(exc).__name__, exc)
        return None


class ModelRepository(ABC):
    """Source of truth for model files; see the module docstring. Thread-safe."""

    def __init__(self, *, part_bytes: int = DEFAULT_PART_BYTES, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 upload_bytes_per_s: float | None = None):
        if part_bytes < 1:
            raise ValueError(f"part_bytes is {part_bytes}; it must be >= 1")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency is {max_concurrency}; it must be >= 1")
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        # None: uploads as fast as the link goes; else every push's bytes paced to this rate.
        self.upload_throttle = UploadThrottle(upload_bytes_per_s) if upload_bytes_per_s is not None else None

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
    def _read_object_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and a tag that changes whenever it is replaced, or None if absent."""

    @abstractmethod
    def _swap_object(self, key: str, data: bytes, expected_tag: str | None) -> bool:
        """Atomically write the object if it is still as expected: absent (`expected_tag` None) or
        with that tag. False, writing nothing, if someone else created or replaced it first."""

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

    def _adopt_file(self, key: str, path: Path) -> None:
        """Create or replace an object with a file the push made itself and deletes afterwards (its
        conversion): a backend may move it in instead of copying it (a local repository does)."""
        self._upload_file(key, path)

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

    def read_small_file(self, model: str, path: str, max_bytes: int = 4 << 20) -> bytes | None:
        """One file of a complete model as pushed (e.g. its ``tokenizer_config.json``), without
        fetching the rest; None when the model has no such file or it is larger than `max_bytes`
        (this is for small metadata, read whole into memory)."""
        manifest = self.describe(model)
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None or entry.size > max_bytes:
            return None
        return self._read_object(manifest.object_key(path))

    def push(self, src_dir: str | Path, model: str, *, overwrite: bool = False, convert: bool = True,
             progress: PushProgress | None = None) -> ModelManifest:
        """Upload a Hugging Face or thaw-format model dir as `model`; returns its manifest.

        A Hugging Face dir is converted to the thaw format once, here, and only the checkpoint is
        uploaded (see the module docstring); `convert` False stores the dir as given (node stores
        convert it on fetch). Staged: the files go under a fresh revision and the
        manifest is swapped in last, so until this returns readers see the previous version whole
        (or no model). Raises `ModelExistsError` if the model exists and not `overwrite`,
        `PushConflictError` if a concurrent push of `model` won, `loader.UnsafeModelDirError`
        (a ValueError) if the dir names files outside itself. `progress` hears the conversion's and
        the upload's bytes as they go (from the push's threads)."""
        progress = progress or _no_progress
        validate_model_name(model)
        src = Path(src_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"model directory {src} does not exist")
        files = model_dir_files(src)
        kind = model_kind(src, [rel for rel, _ in files])
        self._prepare_for_push()
        manifest_key = self._manifest_key(model)
        current = self._read_object_tagged(manifest_key)
        if current is not None and not overwrite:
            raise ModelExistsError(f"model {model!r} already exists in {self.uri}; pass overwrite to replace it")
        with tempfile.TemporaryDirectory(prefix="thaw-push-") as scratch:
            if kind == "hf" and convert:
                source = self._fingerprints(files, progress)
                thaw_dir = _convert_for_push(src, model, Path(scratch), progress)
                if thaw_dir is not None:  # stored once: the checkpoint, and the dir's fingerprints
                    return self._upload_revision(model, "thaw", model_dir_files(thaw_dir), current, overwrite,
                                                 progress, source=source, adopt=True)
            return self._upload_revision(model, kind, files, current, overwrite, progress)

    def _fingerprints(self, files: list[tuple[str, Path]], progress: PushProgress) -> tuple[ManifestFile, ...]:
        """Size and xxh3_64 of each (rel, path) -- a source dir's identity, for the manifest's
        `source` -- hashed on the push's pool; `progress` hears the bytes (stage CHECKING)."""
        total_bytes, done = sum(path.stat().st_size for _, path in files), [0]
        lock = threading.Lock()

        def fingerprint(rel: str, path: Path) -> ManifestFile:
            entry = ManifestFile(path=rel, size=path.stat().st_size, xxh3_64=file_xxh3_64(path))
            with lock:
                done[0] += entry.size
                progress(DeployStage.CHECKING, done[0], total_bytes)
            return entry

        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-hash") as pool:
            return tuple(pool.map(lambda item: fingerprint(*item), files))

    def _upload_revision(self, model: str, kind: str, files: list[tuple[str, Path]],
                         current: tuple[bytes, str] | None, overwrite: bool, progress: PushProgress = _no_progress,
                         *, source: tuple[ManifestFile, ...] = (), adopt: bool = False) -> ModelManifest:
        """The staged part of `push`: upload into a fresh revision, swap the manifest in, delete
        what it replaced. `source`: the fingerprints of the dir `files` were converted from;
        `adopt`: `files` are the push's own scratch files (`_adopt_file` may move them in)."""
        manifest_key = self._manifest_key(model)
        revision = new_revision()
        prefix = f"{model}/{REVISIONS_DIR}/{revision}"

        jobs = [(f"{prefix}/{rel}", rel, path) for rel, path in files]
        total_bytes = sum(path.stat().st_size for _, _, path in jobs)
        uploaded = [0]
        lock = threading.Lock()
        progress(DeployStage.UPLOADING, 0, total_bytes)

        def advance(num_bytes: int) -> None:
            with lock:
                uploaded[0] += num_bytes
                progress(DeployStage.UPLOADING, uploaded[0], total_bytes)

        def upload(key: str, rel: str, path: Path) -> ManifestFile:
            size = path.stat().st_size
            digest = file_xxh3_64(path)
            paced = 0
            if self.upload_throttle is not None:  # paced in slices, so progress moves while it waits
                for offset in range(0, size, _PACING_BYTES):
                    self.upload_throttle.take(min(_PACING_BYTES, size - offset))
                    if offset:  # the file's first slice counts once it is uploaded
                        advance(_PACING_BYTES)
                        paced += _PACING_BYTES
            (self._adopt_file if adopt else self._upload_file)(key, path)
            advance(size - paced)
            return ManifestFile(path=rel, size=size, xxh3_64=digest)

        try:
            with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-push") as pool:
                entries = list(pool.map(lambda job: upload(*job), jobs))
            manifest = ModelManifest(model=model, kind=kind, files=tuple(entries), pushed_at=time.time(),
                                     revision=revision, source=source)
            if not self._swap_object(manifest_key, manifest.to_json().encode(), current[1] if current else None):
                again = "push again to replace it" if overwrite else "push again with overwrite to replace it"
                raise PushConflictError(f"model {model!r} in {self.uri} was pushed (or deleted) by someone else "
                                        f"while this push was uploading; this push was discarded and the repository "
                                        f"keeps theirs ({again})")
        except BaseException:
            self._discard_revision(model, revision)
            raise
        if current is not None:  # the replaced version: nothing names its files any more
            try:
                replaced = ModelManifest.from_json(current[0], origin=self._key_uri(manifest_key))
                self._delete_objects(_object_keys(replaced))
            except ManifestError:
                pass  # not ours to read; the sweep below removes what it can
        self._sweep(model, keep=revision)
        return manifest

    def _discard_revision(self, model: str, revision: str) -> None:
        """After a failed push: delete what it staged -- unless its manifest did get written (an
        error after the store applied the write), and best effort: a leftover is swept later."""
        try:
            data = self._read_object(self._manifest_key(model))
            if data is not None and ModelManifest.from_json(data, origin="").revision == revision:
                return
            self._delete_objects([key for prefix in (f"{model}/{REVISIONS_DIR}/{revision}",
                                                     f"{CONVERTED_PREFIX}/{model}/{revision}")
                                  for key, _ in self._list_objects(prefix)])
        except Exception:  # noqa: BLE001 -- the push's own error is the one to raise
            pass

    def _sweep(self, model: str, keep: str | None, now_s: float | None = None) -> None:
        """Delete objects under ``<model>/`` and ``_thaw/<model>/`` no manifest names: files of the
        unrevisioned layout (the current manifest has a revision) and revisions other than `keep`
        older than `ABANDONED_PUSH_S` (younger ones may be pushes in progress)."""
        now_s = time.time() if now_s is None else now_s
        doomed = []
        for key, _ in self._list_objects(model):
            parts = key.split("/")
            if len(parts) < 3 or parts[1] != REVISIONS_DIR:
                doomed.append(key)
                continue
            if self._abandoned(parts[2], keep, now_s):
                doomed.append(key)
        for key, _ in self._list_objects(f"{CONVERTED_PREFIX}/{model}"):
            parts = key.split("/")  # _thaw/<model>/<revision>/<file>
            if len(parts) < 4 or self._abandoned(parts[2], keep, now_s):
                doomed.append(key)
        if doomed:
            self._delete_objects(doomed)

    @staticmethod
    def _abandoned(revision: str, keep: str | None, now_s: float) -> bool:
        """Whether a revision's objects go: not `keep`, and older than `ABANDONED_PUSH_S`."""
        if revision == keep:
            return False
        try:
            return now_s - revision_started_s(validate_revision(revision)) > ABANDONED_PUSH_S
        except ManifestError:
            return True  # not a revision any push of ours makes

    def delete(self, model: str) -> None:
        """Remove a model: its manifest first (it stops being listed), then its files, then
        leftovers of crashed pushes (a push still in progress keeps its files)."""
        manifest = self.describe(model)
        self._delete_objects([self._manifest_key(model)])
        self._delete_objects(_object_keys(manifest))
        self._sweep(model, keep=None)

    def fetch(self, model: str, dest_dir: str | Path, *, verify: bool = True, prefer_thaw: bool = False,
              before_part: Callable[[int], None] | None = None) -> FetchResult:
        """Download a complete model into `dest_dir` (absent or empty) with parallel ranged reads.

        `prefer_thaw`: a Hugging Face push's converted thaw checkpoint instead of the dir as pushed,
        when it has one (what a node store serves from); the result's `kind` says which arrived.
        With `verify`, every file's size and xxh3_64 are checked against the manifest
        (`FetchVerificationError` otherwise). On error, `dest_dir` is left partly written: the
        caller fetches into a temporary directory and discards it. `before_part(bytes_left)` runs
        before each ranged read with the bytes not yet begun (that part's included); it may block,
        which pauses the fetch between parts (`storage.fetch_queue`: a short fetch passing)."""
        start = time.perf_counter()
        manifest = self.describe(model)
        dest = Path(dest_dir)
        if dest.exists() and any(dest.iterdir()):
            raise FileExistsError(f"fetch destination {dest} is not empty")
        make_private_dirs(dest)
        if prefer_thaw and manifest.converted:
            kind, entries, key = "thaw", manifest.converted, manifest.converted_key
        else:
            kind, entries, key = manifest.kind, manifest.files, manifest.object_key
        num_requests = self._download_files([(key(f.path), f.path, f.size) for f in entries], dest,
                                            before_part=before_part)
        if verify:
            with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="thaw-verify") as pool:
                list(pool.map(lambda f: self._verify_file(key(f.path), f, dest / f.path), entries))
        return FetchResult(model=model, kind=kind, num_files=len(entries), num_bytes=sum(f.size for f in entries),
                           num_requests=num_requests, elapsed_s=time.perf_counter() - start)

    def _verify_file(self, key: str, entry: ManifestFile, path: Path) -> None:
        size = path.stat().st_size
        if size != entry.size:
            raise FetchVerificationError(f"{self._key_uri(key)}: downloaded {size} bytes, "
                                         f"the manifest says {entry.size}")
        digest = file_xxh3_64(path)
        if digest != entry.xxh3_64:
            raise FetchVerificationError(f"{self._key_uri(key)}: downloaded bytes have xxh3_64 {digest}, the manifest "
                                         f"says {entry.xxh3_64}; push the model again")

    def _download_files(self, files: list[tuple[str, str, int]], dest: Path,
                        before_part: Callable[[int], None] | None = None) -> int:
        """Download each (key, rel, size) to ``dest/<rel>`` (0600), all ranges on one pool, in
        order; `before_part` as `fetch`'s."""
        fds: list[int] = []
        parts: list[tuple[str, int, int, int]] = []  # key, start, length, fd
        try:
            for key, rel, size in files:
                path = dest / rel
                make_private_dirs(path.parent)
                fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                fds.append(fd)
                os.ftruncate(fd, size)
                parts += [(key, off, min(self.part_bytes, size - off), fd) for off in range(0, size, self.part_bytes)]
            failed = threading.Event()
            begun = threading.Lock()
            bytes_left = [sum(part[2] for part in parts)]

            def run(part: tuple[str, int, int, int]) -> None:
                if not failed.is_set():  # after one failure, skip the queued rest
                    try:
                        if before_part is not None:
                            with begun:
                                left = bytes_left[0]
                                bytes_left[0] -= part[2]
                            before_part(left)
                            if failed.is_set():  # failed while this part waited
                                return
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
            self._download_files([(f"{key}/probe.bin", "probe.bin", num_bytes)], scratch)
            elapsed = time.perf_counter() - start
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._delete_objects([f"{key}/probe.bin"])
        return num_bytes / max(elapsed, 1e-9)
