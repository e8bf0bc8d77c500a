"""Model names as the storage tiers use them: one path segment, safe on every backend.

A model name becomes a directory name in the local repository, the SSD cache and the DRAM cache,
and a key prefix in S3, so a name that is not a single, plain segment could write outside the
store (``..``, ``/``), hide from listings (a leading dot), or collide with the store's own
bookkeeping (``_manifests/``, ``.staging/``: a leading ``_`` or ``.`` is reserved for those).
Checking once, here, lets every backend join names into paths and keys without re-checking.
"""

from __future__ import annotations

import re

MAX_MODEL_NAME_CHARS = 128
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class InvalidModelNameError(ValueError):
    """A model name that is not one plain path segment (see `validate_model_name`)."""


def validate_model_name(name: object) -> str:
    """Return `name` if it is a valid model name, else raise `InvalidModelNameError` saying why.

    Valid: 1..128 characters of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit, without
    ``..`` anywhere (so no segment can ever mean "the parent"). A Hugging Face id such as
    ``acme/llama-8b`` contains a slash and must be mapped first (e.g. ``acme--llama-8b``).
    """
    if not isinstance(name, str):
        raise InvalidModelNameError(f"model name must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise InvalidModelNameError("model name must not be empty")
    if len(name) > MAX_MODEL_NAME_CHARS:
        raise InvalidModelNameError(f"model name {name[:40]!r}... is {len(name)} characters; "
                                    f"the limit is {MAX_MODEL_NAME_CHARS}")
    if "/" in name or "\\" in name:
        mapped = name.replace("/", "--").replace("\\", "--")
        hint = f", e.g. {mapped!r}" if _NAME_PATTERN.fullmatch(mapped) and ".." not in mapped else ""
        raise InvalidModelNameError(f"model name {name!r} contains a path separator; use one segment{hint}")
    if ".." in name:
        raise InvalidModelNameError(f"model name {name!r} contains '..'")
    if not _NAME_PATTERN.fullmatch(name):
        raise InvalidModelNameError(f"model name {name!r} must start with a letter or digit and contain only "
                                    f"letters, digits, '.', '_' and '-'")
    return name
