"""The manifest a repository writes *last* for each model: what makes a push complete.

A push uploads a model's files first and its manifest (``_manifests/<model>.json``) last, so a
listing -- which reads only manifests -- never shows a model whose upload was interrupted, and a
fetch downloads exactly the files the manifest names (never a stale object left beside them).
Each file carries its size and an xxh3_64 of its bytes, so a fetch verifies what it downloaded
whatever the transport did (ranged parts written out of order, a truncated response).

Version 2 adds the push's `revision`: a push uploads its files under a prefix of their own,
``<model>/.revisions/<revision>/``, so a push in progress never touches the files a current
manifest names (nor another push's), and replacing the manifest -- one object, written
conditionally -- is what makes a new version visible. Version 1 manifests (files directly under
``<model>/``, no revision) are still read.

A Hugging Face push is converted to the thaw format once, at push, and only that checkpoint is
stored (it carries what serving needs besides the weights: config, tokenizer, chat templates):
the model's `kind` is then "thaw", its `files` the checkpoint's, and `source` lists the dir as
pushed by size and xxh3_64 alone (nothing of it is uploaded) -- what a re-deploy compares its
source with, so an unchanged model is not pushed again. A dir the converter cannot read is
stored as given (kind "hf"), and node stores convert it on fetch.

Repositories written before stored both: the dir as pushed in `files` and the checkpoint in
`converted` (under ``_thaw/<model>/<revision>/``: names cannot start with ``_``). Those are still
read (node stores copy `converted`); new pushes write no `converted`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from storage.model_name import validate_model_name

MANIFEST_FORMAT = "thaw-repository-manifest"
MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no revision, files directly under <model>/
REVISIONS_DIR = ".revisions"  # hidden: a pushed dir's own files never start with '.'
MODEL_KINDS = ("thaw", "hf")  # a thaw checkpoint (loader format) or a Hugging Face safetensors dir
CONVERTED_PREFIX = "_thaw"  # a Hugging Face push's thaw checkpoint: _thaw/<model>/<revision>/<file>


class ManifestError(ValueError):
    """A manifest object that cannot be parsed or is inconsistent (a repository written by something else)."""


def validate_relative_path(path: str) -> str:
    """A file path inside a model dir: '/'-separated, relative, no '', '.' or '..' segment."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        raise ManifestError(f"file path {path!r} must be a non-empty relative '/'-separated path")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ManifestError(f"file path {path!r} has an empty, '.' or '..' segment")
    return path


_REVISION_RE = re.compile(r"[0-9]{13}-[0-9a-f]{12}")


def new_revision(now_s: float | None = None) -> str:
    """A fresh push revision: its start time in ms (13 digits, so revisions sort by age) and 48
    random bits (two pushes started in the same millisecond still differ)."""
    return f"{int((time.time() if now_s is None else now_s) * 1000):013d}-{uuid.uuid4().hex[:12]}"


def revision_started_s(revision: str) -> float:
    """When the push of `revision` started (Unix time)."""
    return int(revision.split("-", 1)[0]) / 1000


def validate_revision(revision: str) -> str:
    if not isinstance(revision, str) or not _REVISION_RE.fullmatch(revision):
        raise ManifestError(f"revision {revision!r} is not <13 digits>-<12 hex digits>")
    return revision


@dataclass(frozen=True)
class ManifestFile:
    """One file of a model: its path relative to the model dir, size and xxh3_64 (16 hex digits)."""

    path: str
    size: int
    xxh3_64: str

    def __post_init__(self) -> None:
        validate_relative_path(self.path)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise ManifestError(f"file {self.path!r}: size {self.size!r} must be an integer >= 0")
        if not isinstance(self.xxh3_64, str) or not re.fullmatch(r"[0-9a-f]{16}", self.xxh3_64):
            raise ManifestError(f"file {self.path!r}: xxh3_64 {self.xxh3_64!r} is not 16 hex digits")


@dataclass(frozen=True)
class ModelManifest:
    """A complete model in a repository: its name, kind, files, when it was pushed (Unix time),
    the push's revision (where its files are; None: a version 1 manifest, files under ``<model>/``);
    for a thaw checkpoint converted from a Hugging Face dir at push, that dir's fingerprints
    (`source`, not stored); for a Hugging Face push of an older repository, the files of the thaw
    checkpoint stored beside it (`converted`; empty: none, node stores convert on fetch)."""

    model: str
    kind: str
    files: tuple[ManifestFile, ...]
    pushed_at: float
    revision: str | None = None
    converted: tuple[ManifestFile, ...] = ()
    source: tuple[ManifestFile, ...] = ()

    def __post_init__(self) -> None:
        try:
            validate_model_name(self.model)
        except ValueError as exc:
            raise ManifestError(str(exc)) from None
        if self.kind not in MODEL_KINDS:
            raise ManifestError(f"model {self.model!r}: kind {self.kind!r} must be one of {MODEL_KINDS}")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ManifestError(f"model {self.model!r}: a file is listed twice")
        if self.revision is not None:
            validate_revision(self.revision)
        if self.converted:
            if self.kind != "hf" or self.revision is None:
                raise ManifestError(f"model {self.model!r}: only a Hugging Face push with a revision has a "
                                    f"converted checkpoint")
            converted = [f.path for f in self.converted]
            if len(set(converted)) != len(converted):
                raise ManifestError(f"model {self.model!r}: a converted file is listed twice")
        if self.source:
            if self.kind != "thaw" or self.revision is None:
                raise ManifestError(f"model {self.model!r}: only a thaw checkpoint with a revision has a source "
                                    f"it was converted from")
            source = [f.path for f in self.source]
            if len(set(source)) != len(source):
                raise ManifestError(f"model {self.model!r}: a source file is listed twice")

    @property
    def source_files(self) -> tuple[ManifestFile, ...]:
        """The dir as it was pushed: the converted-from source's fingerprints, else the files."""
        return self.source or self.files

    @property
    def files_prefix(self) -> str:
        """The repository key prefix its files are under."""
        if self.revision is None:
            return self.model
        return f"{self.model}/{REVISIONS_DIR}/{self.revision}"

    def object_key(self, path: str) -> str:
        """The repository key of one of its files."""
        return f"{self.files_prefix}/{path}"

    def converted_key(self, path: str) -> str:
        """The repository key of one file of its converted thaw checkpoint."""
        return f"{CONVERTED_PREFIX}/{self.model}/{self.revision}/{path}"

    @property
    def total_bytes(self) -> int:
        """Bytes of the files as pushed."""
        return sum(f.size for f in self.files)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the thaw checkpoint a node store copies (the converted one when there is one)."""
        return sum(f.size for f in self.converted) if self.converted else self.total_bytes

    def to_json(self) -> str:
        data = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION if self.revision else 1, "model": self.model,
                "kind": self.kind, "pushed_at": self.pushed_at}
        if self.revision is not None:
            data["revision"] = self.revision
        data["files"] = [{"path": f.path, "size": f.size, "xxh3_64": f.xxh3_64} for f in self.files]
        if self.converted:  # absent otherwise: a manifest without one reads as it always did
            data["converted"] = [{"path": f.path, "size": f.size, "xxh3_64": f.xxh3_64} for f in self.converted]
        if self.source:
            data["source"] = [{"path": f.path, "size": f.size, "xxh3_64": f.xxh3_64} for f in self.source]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, origin: str) -> ModelManifest:
        try:
            data: Any = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{origin} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{origin} is not a thaw repository manifest")
        version = data.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise ManifestError(f"{origin}: manifest version {version!r} is not supported "
                                f"(this Thaw reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        try:
            files = tuple(ManifestFile(path=f["path"], size=f["size"], xxh3_64=f["xxh3_64"]) for f in data["files"])
            converted = tuple(ManifestFile(path=f["path"], size=f["size"], xxh3_64=f["xxh3_64"])
                              for f in (data.get("converted", ()) if version >= 2 else ()))
            source = tuple(ManifestFile(path=f["path"], size=f["size"], xxh3_64=f["xxh3_64"])
                           for f in (data.get("source", ()) if version >= 2 else ()))
            pushed_at = data["pushed_at"]
            if not isinstance(pushed_at, (int, float)) or isinstance(pushed_at, bool):
                raise ManifestError(f"pushed_at {pushed_at!r} is not a number")
            revision = validate_revision(data["revision"]) if version >= 2 else None  # version 2 has one
            return cls(model=data["model"], kind=data["kind"], files=files, pushed_at=float(pushed_at),
                       revision=revision, converted=converted, source=source)
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{origin}: missing or malformed field {exc}") from None
        except ManifestError as exc:
            raise ManifestError(f"{origin}: {exc}") from None
