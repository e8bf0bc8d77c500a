"""Sending a model directory to the platform: what ``thaw deploy --source ./dir`` does when the
controller cannot read the caller's path (a laptop or a CI runner deploying to a cluster).

`upload_directory` lists the directory as a push would (`loader.model_dir_files`: a symlink or an
index entry leading outside it is refused before a byte is sent), fingerprints every file (size
and xxh3_64), and sends the files through the admin API in pieces of `PIECE_BYTES` (each one
request under the gateway's body limit), `CONCURRENT_FILES` files at a time, with a progress bar.
Then it seals the upload -- the controller checks every file against the fingerprints -- and
returns its id; the deploy names ``upload:<id>`` as its source.

Resumable: the upload's id is kept in the state directory (`ResumeRecords`) with the listing it
was made from, so running the same deploy again after an interruption asks the platform what has
arrived and sends only the rest (a piece the platform refuses as out of place, 409, makes the
sender ask where the file's bytes end and continue from there). A directory that changed since
(another listing) starts a new upload.

`wants_upload` decides when to upload: always with ``--upload``, never with ``--no-upload``, and by
default when the platform is not on this machine (its URL's host is not a loopback address).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import xxhash
from tqdm import tqdm

from infra.admin_client import AdminApiError, AdminClient
from loader import model_dir_files, write_private

__all__ = ["CONCURRENT_FILES", "PIECE_BYTES", "ResumeRecords", "upload_directory", "wants_upload"]

PIECE_BYTES = 4 << 20  # one request's body: under the gateway's 8 MiB limit, large enough to stream
CONCURRENT_FILES = 4
RESUME_FILE = "uploads.json"
_HASH_BLOCK_BYTES = 8 << 20
_LOOPBACK_NAMES = ("localhost",)


def wants_upload(choice: str, url: str) -> bool:
    """`choice` "always", "never" or "auto" (when the platform's host is not a loopback address)."""
    if choice in ("always", "never"):
        return choice == "always"
    host = urlsplit(url).hostname or ""
    if host in _LOOPBACK_NAMES:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: another machine, as far as this one can tell
        return True


def _listing_key(files: list[tuple[str, Path]]) -> str:
    """What a resumable upload is of: every file's path, size and modification time."""
    digest = hashlib.sha256()
    for rel, path in files:
        stat = path.stat()
        digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _fingerprint(path: Path) -> dict[str, Any]:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return {"size": path.stat().st_size, "xxh3_64": digest.hexdigest()}


class ResumeRecords:
    """The uploads this machine started, by source directory and platform: ``STATE/uploads.json``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / RESUME_FILE

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        write_private(tmp, json.dumps(data, indent=1, sort_keys=True).encode())
        os.replace(tmp, self.path)

    @staticmethod
    def _key(src: Path, url: str) -> str:
        return f"{url} {src}"

    def get(self, src: Path, url: str, listing: str) -> str | None:
        record = self._read().get(self._key(src, url))
        if isinstance(record, dict) and record.get("listing") == listing:
            return record.get("upload_id")
        return None

    def put(self, src: Path, url: str, listing: str, upload_id: str) -> None:
        data = self._read()
        data[self._key(src, url)] = {"listing": listing, "upload_id": upload_id}
        self._write(data)

    def forget(self, src: Path, url: str) -> None:
        data = self._read()
        if data.pop(self._key(src, url), None) is not None:
            self._write(data)


async def _send_file(client: AdminClient, upload_id: str, rel: str, path: Path, size: int, offset: int,
                     bar: Any) -> None:
    """Sends `path` from `offset` on; after a 409 asks where the platform's copy ends and goes on from there."""
    with open(path, "rb") as f:
        while offset < size:
            f.seek(offset)
            data = f.read(min(PIECE_BYTES, size - offset))
            try:
                new_offset = await client.upload_piece(upload_id, rel, offset, data)
            except AdminApiError as exc:
                if exc.status != 409:
                    raise
                new_offset = int((await client.upload_status(upload_id))["files"].get(rel, 0))
                if new_offset > size:
                    raise
            bar.update(new_offset - offset)
            offset = new_offset


async def upload_directory(client: AdminClient, src: Path, records: ResumeRecords, out: TextIO | None = None) -> str:
    """Uploads `src` (see the module docstring); returns the sealed upload's id. Raises ValueError
    for a directory that names files outside itself, `AdminApiError` for a refusal."""
    out = out if out is not None else sys.stderr
    files = model_dir_files(src)
    listing = _listing_key(files)
    sizes = {rel: path.stat().st_size for rel, path in files}
    upload_id = records.get(src, client.url, listing)
    arrived: dict[str, int] = {}
    if upload_id is not None:
        try:
            status = await client.upload_status(upload_id)
        except AdminApiError as exc:
            if exc.status != 404:
                raise
            upload_id = None  # deployed (and so deleted), or expired: start again
        else:
            if status.get("sealed"):
                return upload_id
            arrived = {rel: int(size) for rel, size in status.get("files", {}).items()}
            if any(arrived.get(rel, 0) > size for rel, size in sizes.items()):
                upload_id, arrived = None, {}  # not the same bytes after all
    if upload_id is None:
        upload_id = await client.create_upload()
        records.put(src, client.url, listing, upload_id)
    fingerprints = dict(zip((rel for rel, _ in files),
                            await asyncio.gather(*(asyncio.to_thread(_fingerprint, p) for _, p in files))))
    total = sum(sizes.values())
    done = sum(min(arrived.get(rel, 0), size) for rel, size in sizes.items())
    print(f"  sending {len(files)} files to the platform ({upload_id}{', resuming' if done else ''})",
          file=out, flush=True)
    gate = asyncio.Semaphore(CONCURRENT_FILES)
    with tqdm(total=total, initial=done, desc="  sending", unit="B", unit_scale=True, unit_divisor=1024, file=out,
              dynamic_ncols=True) as bar:
        async def send(rel: str, path: Path) -> None:
            async with gate:
                await _send_file(client, upload_id, rel, path, sizes[rel], arrived.get(rel, 0), bar)

        await asyncio.gather(*(send(rel, path) for rel, path in files if arrived.get(rel, 0) < sizes[rel]))
    await client.seal_upload(upload_id, fingerprints)
    return upload_id
