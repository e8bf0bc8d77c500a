"""What a model directory may make us read: its own files, never anything outside it.

A model directory can come from a tenant (``thaw deploy`` of a local source, ``thaw models
push``), and reading it happens with the platform's rights: a weight_map entry in
``model.safetensors.index.json`` such as ``../../other/model.safetensors`` or ``/abs/path``, or
a symlink to another tenant's checkpoint, would make the converter or the worker read -- and the
repository push copy -- files that are not the tenant's. Every place that reads a model
directory therefore resolves its entries here, once:

- `contained_path` resolves one relative name inside the directory (no absolute path, no ``..``,
  no symlink whose target lies outside);
- `shard_paths` does it for every shard a safetensors index lists;
- `model_dir_files` lists the files a push uploads (hidden entries skipped), refusing any entry
  -- file or directory -- that is a symlink leading outside.

A symlink that stays inside the directory is fine. The refusal (`UnsafeModelDirError`, a
`ValueError`) names the entry and says how to fix the directory; the controller turns it into a
400 on ``source``. No torch here: the repository side imports this without the loader's weight.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_FIX_HINT = ("copy the real files into the directory (e.g. `cp -rL SRC DST`, or `huggingface-cli download "
             "--local-dir DST`) so that it holds everything it names")


class UnsafeModelDirError(ValueError):
    """A model directory names a file outside itself (a weight_map entry or a symlink)."""


def _is_inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def contained_path(model_dir: str | Path, name: object, what: str) -> Path:
    """``model_dir / name`` when `name` is a relative '/'-path that stays inside `model_dir`
    (symlinks along the way resolved); `UnsafeModelDirError` naming `what` otherwise."""
    model_dir = Path(model_dir)
    if (not isinstance(name, str) or not name or name.startswith("/") or "\\" in name
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise UnsafeModelDirError(f"{model_dir}: {what} ({name!r}) is not a relative path inside the directory "
                                  f"(no absolute path, no '..'); name a file in the directory")
    path = model_dir / name
    resolved = path.resolve()
    if not _is_inside(resolved, model_dir.resolve()):
        raise UnsafeModelDirError(f"{model_dir}: {what} ({name!r}) leads to {resolved} through a symlink, outside "
                                  f"the directory; {_FIX_HINT}")
    return path


def shard_paths(model_dir: str | Path, weight_map: object) -> list[Path]:
    """The distinct shard files a safetensors index's ``weight_map`` (tensor -> file) names,
    sorted, each checked with `contained_path` (whether it exists is the caller's check)."""
    model_dir = Path(model_dir)
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"{model_dir / SAFETENSORS_INDEX_FILE}: 'weight_map' must map tensor names to files")
    by_file: dict[str, str] = {}  # file -> the first tensor naming it, for the message
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            contained_path(model_dir, file, f"{SAFETENSORS_INDEX_FILE} weight_map entry {tensor!r}")
        by_file.setdefault(file, tensor)
    return [contained_path(model_dir, file, f"{SAFETENSORS_INDEX_FILE} weight_map entry {by_file[file]!r}")
            for file in sorted(by_file)]


def model_dir_files(model_dir: str | Path) -> list[tuple[str, Path]]:
    """(relative '/'-path, path) of every regular file in `model_dir`, sorted; hidden entries (any
    segment starting with '.', e.g. a Hugging Face ``.cache``) skipped. An entry that is a symlink
    leading outside the directory is refused, as is an index whose weight_map leaves it."""
    model_dir = Path(model_dir)
    root = model_dir.resolve()
    found = []
    for path in sorted(model_dir.rglob("*")):  # rglob does not descend into symlinked directories
        rel = path.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink() and not _is_inside(path.resolve(), root):
            raise UnsafeModelDirError(f"{model_dir}: {rel.as_posix()!r} is a symlink to {path.resolve()}, outside "
                                      f"the directory; {_FIX_HINT}")
        if path.is_dir() and path.is_symlink():
            # Inside the directory: its files are reached under their own path already.
            continue
        if path.is_file():
            found.append((rel.as_posix(), path))
    if any(rel == SAFETENSORS_INDEX_FILE for rel, _ in found):
        index_path = model_dir / SAFETENSORS_INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path} is not a valid safetensors index: {exc!r}") from None
        shard_paths(model_dir, weight_map)
    return found
