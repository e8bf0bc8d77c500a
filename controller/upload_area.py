"""Model directories uploaded through the admin API: `UploadArea`, where a deploy's source arrives
when the caller's files are not on the controller's machine.

``thaw deploy --source ./dir`` from a laptop names a path the controller cannot read. So the CLI
uploads the directory first, file by file in pieces (each one admin request, under the gateway's
body limit), and deploys from ``upload:<id>``. The area keeps each upload under
``<state_dir>/uploads/<id>/``:

- `create` opens an upload; `write` appends a piece to one of its files *at the offset the
  caller says*: a piece for another offset than the file's current size is refused with
  `UploadOffsetError`, naming that size, so a client that lost its place (a dropped connection,
  a restarted CLI) asks `status` and resumes where the bytes end, and a piece sent twice is never
  written twice;
- `seal` compares every file with the caller's list of sizes and xxh3_64 digests: a missing,
  extra, short or corrupted file is refused naming it, so a deploy reads exactly what the caller
  has. Only a sealed upload can be deployed (`path_of`);
- a deploy that succeeds deletes its upload (the repository holds the model now); uploads not
  touched for `UPLOAD_EXPIRY_S` are deleted by the next `create`.

Paths are checked like a model dir's (`validate_upload_path`): relative, no ``..``, no hidden
segment, so nothing lands outside the upload's directory. Files and directories are the owner's
only. All of this is blocking file I/O: the controller calls it in a thread.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from controller.controller_errors import InvalidUploadError, UnknownUploadError, UploadOffsetError
from loader import make_private_dirs, open_private, write_private
from storage import file_xxh3_64

__all__ = ["MAX_PIECE_BYTES", "UPLOAD_EXPIRY_S", "UPLOAD_SOURCE_PREFIX", "UploadArea", "upload_id_of",
           "validate_upload_path"]

UPLOAD_SOURCE_PREFIX = "upload:"  # a spec's source naming a sealed upload: upload:<id>
UPLOAD_EXPIRY_S = 24 * 3600.0
MAX_PIECE_BYTES = 64 << 20  # the most one `write` takes (the gateway sends ~4 MiB pieces)
_SEALED_FILE = ".sealed.json"  # hidden: an uploaded path never starts with '.'
_MAX_PATH_CHARS = 1024


def validate_upload_path(path: object) -> str:
    """A file path inside the uploaded dir: '/'-separated, relative, no empty, '.' or '..' segment,
    no hidden segment; `InvalidUploadError` on ``path`` otherwise."""
    if not isinstance(path, str) or not path or len(path) > _MAX_PATH_CHARS or "\\" in path or "\x00" in path:
        raise InvalidUploadError("path", f"must be a relative '/'-separated file path, got {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", ".", "..") or part.startswith(".") for part in parts):
        raise InvalidUploadError("path", f"{path!r} must stay inside the model directory (no leading '/', no empty, "
                                         f"'.', '..' or hidden segment)")
    return path


def upload_id_of(source: str) -> str | None:
    """The upload id a spec's ``upload:<id>`` source names; None for any other source."""
    if not source.startswith(UPLOAD_SOURCE_PREFIX):
        return None
    return source[len(UPLOAD_SOURCE_PREFIX):]


class UploadArea:
    """The uploads under `root` (see the module docstring). Thread-safe: one lock orders the writes
    of each upload, so two pieces of one file never interleave."""

    def __init__(self, root: Path, *, clock: Any = time.time) -> None:
        self.root = Path(root)
        self._clock = clock
        self._lock = threading.Lock()

    def _dir(self, upload_id: str) -> Path:
        if not isinstance(upload_id, str) or len(upload_id) != 32 or not all(c in "0123456789abcdef" for c in upload_id):
            raise UnknownUploadError(str(upload_id))
        path = self.root / upload_id
        if not path.is_dir():
            raise UnknownUploadError(upload_id)
        return path

    def create(self) -> str:
        """A new, empty upload's id (older uploads past their expiry are deleted first)."""
        make_private_dirs(self.root)
        self._expire()
        upload_id = uuid.uuid4().hex
        make_private_dirs(self.root / upload_id)
        return upload_id

    def write(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        """Appends `data` to the upload's file `path` at `offset`, which must be the file's current
        size; returns the new size. `UploadOffsetError` (naming the size) otherwise."""
        path = validate_upload_path(path)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidUploadError("offset", f"must be an integer >= 0, got {offset!r}")
        if len(data) > MAX_PIECE_BYTES:
            raise InvalidUploadError("body", f"a piece is at most {MAX_PIECE_BYTES} bytes, got {len(data)}")
        with self._lock:
            directory = self._dir(upload_id)
            if (directory / _SEALED_FILE).exists():
                raise UploadOffsetError(upload_id, path, offset, None, "the upload is sealed; start a new one")
            target = directory / path
            if target.parent != directory:
                make_private_dirs(target.parent)
            size = target.stat().st_size if target.is_file() else 0
            if offset != size:
                raise UploadOffsetError(upload_id, path, offset, size)
            fd = open_private(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.utime(directory)  # touched: its expiry counts from now
            return size + len(data)

    def status(self, upload_id: str) -> dict[str, Any]:
        """``{"upload_id", "sealed", "files": {path: size}}``: where a client resumes from."""
        directory = self._dir(upload_id)
        files = {str(p.relative_to(directory).as_posix()): p.stat().st_size
                 for p in sorted(directory.rglob("*")) if p.is_file() and p.name != _SEALED_FILE}
        return {"upload_id": upload_id, "sealed": (directory / _SEALED_FILE).exists(), "files": files}

    def seal(self, upload_id: str, expected: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Checks the upload holds exactly `expected` (path -> {"size", "xxh3_64"}) and seals it;
        `InvalidUploadError` naming the first file that differs. Sealing twice is fine."""
        if not isinstance(expected, dict) or not expected:
            raise InvalidUploadError("files", "give every file of the directory with its size and xxh3_64")
        for path, entry in expected.items():
            validate_upload_path(path)
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) \
                    or not isinstance(entry.get("xxh3_64"), str):
                raise InvalidUploadError("files", f"{path!r}: give {{'size': bytes, 'xxh3_64': 16 hex digits}}")
        with self._lock:
            directory = self._dir(upload_id)
            have = self.status(upload_id)["files"]
            missing = sorted(set(expected) - set(have))
            if missing:
                raise InvalidUploadError("files", f"{missing[0]!r} was never uploaded ({len(missing)} missing)")
            extra = sorted(set(have) - set(expected))
            if extra:
                raise InvalidUploadError("files", f"{extra[0]!r} was uploaded but is not in the list")
            for path, entry in sorted(expected.items()):
                if have[path] != entry["size"]:
                    raise InvalidUploadError("files", f"{path!r} has {have[path]} bytes uploaded, the list says "
                                                      f"{entry['size']}: resume it from byte {have[path]}")
                digest = file_xxh3_64(directory / path)
                if digest != entry["xxh3_64"]:
                    raise InvalidUploadError("files", f"{path!r} arrived with xxh3_64 {digest}, the list says "
                                                      f"{entry['xxh3_64']}: upload it again")
            write_private(directory / _SEALED_FILE, json.dumps(expected, sort_keys=True).encode())
        return self.status(upload_id)

    def path_of(self, upload_id: str) -> Path:
        """A sealed upload's directory (what a deploy reads); `InvalidUploadError` if not sealed."""
        directory = self._dir(upload_id)
        if not (directory / _SEALED_FILE).exists():
            raise InvalidUploadError("source", f"upload {upload_id} is not sealed yet: finish uploading it "
                                               f"(thaw deploy does), then deploy")
        return directory

    def delete(self, upload_id: str) -> None:
        with self._lock:
            shutil.rmtree(self._dir(upload_id), ignore_errors=True)

    def _expire(self) -> None:
        now = self._clock()
        for directory in self.root.iterdir():
            try:
                if directory.is_dir() and now - directory.stat().st_mtime > UPLOAD_EXPIRY_S:
                    shutil.rmtree(directory, ignore_errors=True)
            except OSError:  # deleted meanwhile
                continue
