"""A model repository in a local (or network-mounted) directory: the embedded default.

Keys map to paths under the root. Objects are written to a hidden temporary file, fsynced and
renamed into place, so a reader sees a whole object or none; ranged reads are
``os.copy_file_range`` (in-kernel, no copy through Python), so a fetch from a local repository
runs at the disk's speed on the same thread pool as an S3 fetch.

A conditional write (`_swap_object`, how a push makes its manifest visible) holds an exclusive
``flock`` on a per-key lock file under ``<root>/.locks/`` while it compares and replaces, so two
pushes -- threads or processes, on this machine or through a file system that honours locks --
cannot both win. What it writes is the owner's only: directories 0700, files 0600.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from loader import copy_private, make_private_dirs, open_private, write_private
from storage.model_repository import (DEFAULT_MAX_CONCURRENCY, DEFAULT_PART_BYTES, ModelRepository,
                                      ObjectNotFoundError, RepositoryError)


_CREATE_ATTEMPTS = 5


class LocalModelRepository(ModelRepository):
    """`ModelRepository` over a directory; created on the first push."""

    def __init__(self, root: str | Path, *, part_bytes: int = DEFAULT_PART_BYTES,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY, upload_bytes_per_s: float | None = None):
        super().__init__(part_bytes=part_bytes, max_concurrency=max_concurrency, upload_bytes_per_s=upload_bytes_per_s)
        self.root = Path(root).absolute()

    @property
    def uri(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def _key_uri(self, key: str) -> str:
        return str(self._path(key))

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise RepositoryError(f"repository directory {self.root} does not exist (push a model to create it)")

    def _prepare_for_push(self) -> None:
        make_private_dirs(self.root)

    def _read_object(self, key: str) -> bytes | None:
        self._check_root()
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def _temp_path(self, path: Path) -> Path:
        return path.parent / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"

    def _install(self, tmp: Path, path: Path) -> None:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def _create(tmp: Path, write: Callable[[Path], None]) -> None:
        """Create `tmp` with `write`, making its directories first. Another push's deletions prune
        directories they empty, so one may vanish between mkdir and create: then again (once the
        file is there, its directory is not empty and stays)."""
        for attempt in range(_CREATE_ATTEMPTS):
            make_private_dirs(tmp.parent)
            try:
                write(tmp)
                return
            except FileNotFoundError:
                if attempt == _CREATE_ATTEMPTS - 1:
                    raise

    def _write_object(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._temp_path(path)
        try:
            self._create(tmp, lambda p: write_private(p, data))
            self._install(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _tag(data: bytes) -> str:
        # Manifests carry a unique revision and push time, so their bytes identify them.
        return xxhash.xxh3_128(data).hexdigest()

    def _read_object_tagged(self, key: str) -> tuple[bytes, str] | None:
        data = self._read_object(key)
        return None if data is None else (data, self._tag(data))

    @contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        lock_dir = self.root / ".locks"
        make_private_dirs(lock_dir)
        fd = open_private(lock_dir / (key.replace("/", "%") + ".lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _swap_object(self, key: str, data: bytes, expected_tag: str | None) -> bool:
        with self._key_lock(key):
            current = self._read_object_tagged(key)
            if (current[1] if current is not None else None) != expected_tag:
                return False
            self._write_object(key, data)
            return True

    def _upload_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        tmp = self._temp_path(dest)
        try:
            self._create(tmp, lambda p: copy_private(path, p))
            self._install(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _adopt_file(self, key: str, path: Path) -> None:
        """A file the push made itself (its conversion, in scratch space) is moved in, not copied:
        a rename on the same filesystem (a 16 GB checkpoint costs no second write), a copy across."""
        dest = self._path(key)
        tmp = self._temp_path(dest)

        def move(target: Path) -> None:
            try:
                os.rename(path, target)
                os.chmod(target, 0o600)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                copy_private(path, target)

        try:
            self._create(tmp, move)
            self._install(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _list_objects(self, prefix: str) -> list[tuple[str, int]]:
        self._check_root()
        base = self._path(prefix)
        found = []
        # os.walk, not rglob: files and directories another push deletes meanwhile are skipped.
        for root, _, names in os.walk(base):
            for name in names:
                path = Path(root) / name
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                found.append((f"{prefix}/{path.relative_to(base).as_posix()}", size))
        return sorted(found)

    def _delete_objects(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        # Drop directories the deletions emptied (deepest first), never the root.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def _download_range(self, key: str, start: int, length: int, fd: int) -> None:
        path = self._path(key)
        try:
            src = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{path} is missing from the repository (its model's manifest lists it); "
                                      f"push the model again") from None
        try:
            done = 0
            while done < length:
                try:
                    n = os.copy_file_range(src, fd, length - done, start + done, start + done)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    n = self._copy_range_buffered(src, fd, start + done, length - done)
                if n == 0:
                    raise RepositoryError(f"{path} ended at byte {start + done}; the manifest expects at least "
                                          f"{start + length} bytes")
                done += n
        finally:
            os.close(src)

    @staticmethod
    def _copy_range_buffered(src: int, dst: int, offset: int, length: int) -> int:
        """Fallback where copy_file_range is refused: one buffered read and write at `offset`."""
        data = os.pread(src, min(length, 8 << 20), offset)
        if data:
            os.pwrite(dst, data, offset)
        return len(data)
