"""The manifest a repository writes *last* for each model: what makes a push complete.

A push uploads a model's files first and its manifest (``_manifests/<model>.json``) last, so a
listing -- which reads only manifests -- never shows a model whose upload was interrupted, and a
fetch downloads exactly the files the manifest names (never a stale object left beside them).
Each file carries its size and an xxh3_64 of its bytes, so a fetch verifies what it downloaded
whatever the transport did (ranged parts written out of order, a truncated response).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from storage.model_name import validate_model_name

MANIFEST_FORMAT = "thaw-repository-manifest"
MANIFEST_VERSION = 1
MODEL_KINDS = ("thaw", "hf")  # a thaw checkpoint (loader format) or a Hugging Face safetensors dir


class ManifestError(ValueError):
    """A manifest object that cannot be parsed or is inconsistent (a repository written by something else)."""


def validate_relative_path(path: str) -> str:
    """A file path inside a model dir: '/'-separated, relative, no '', '.' or '..' segment."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        raise ManifestError(f"file path {path!r} must be a non-empty relative '/'-separated path")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ManifestError(f"file path {path!r} has an empty, '.' or '..' segment")
    return path


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
    """A complete model in a repository: its name, kind, files and when it was pushed (Unix time)."""

    model: str
    kind: str
    files: tuple[ManifestFile, ...]
    pushed_at: float

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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps({
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "model": self.model, "kind": self.kind,
            "pushed_at": self.pushed_at,
            "files": [{"path": f.path, "size": f.size, "xxh3_64": f.xxh3_64} for f in self.files],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, origin: str) -> ModelManifest:
        try:
            data: Any = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{origin} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{origin} is not a thaw repository manifest")
        if data.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"{origin}: manifest version {data.get('version')!r} is not supported "
                                f"(this Thaw reads version {MANIFEST_VERSION})")
        try:
            files = tuple(ManifestFile(path=f["path"], size=f["size"], xxh3_64=f["xxh3_64"]) for f in data["files"])
            pushed_at = data["pushed_at"]
            if not isinstance(pushed_at, (int, float)) or isinstance(pushed_at, bool):
                raise ManifestError(f"pushed_at {pushed_at!r} is not a number")
            return cls(model=data["model"], kind=data["kind"], files=files, pushed_at=float(pushed_at))
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{origin}: missing or malformed field {exc}") from None
        except ManifestError as exc:
            raise ManifestError(f"{origin}: {exc}") from None
