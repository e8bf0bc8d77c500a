"""Where the platform's state lives: a location (a path or URL) opened as its `StateStore`.

Apart from `controller.state_store` (the interface and its records) so that module needs neither
backend: each backend imports the interface, and only this opener imports the backends (no
import cycle, and Redis' client is imported only when a redis:// location is opened).
"""

from __future__ import annotations

import os
from pathlib import Path

from controller.sqlite_state_store import SqliteStateStore
from controller.state_store import StateStore, StateStoreError, redact_url

__all__ = ["DEFAULT_SQLITE_FILE", "open_state_store"]

DEFAULT_SQLITE_FILE = "state.sqlite3"


def open_state_store(location: str | os.PathLike[str]) -> StateStore:
    """Open (creating if needed) the state store at `location`.

    - ``redis://[:password@]host:port/db`` or ``rediss://...``: a Redis server, which must be
      reachable now (checked with a PING; a warning is logged if it persists nothing); optional
      ``?prefix=NAME`` namespaces the keys (default ``thaw``) so two platforms can share one server.
    - ``sqlite:///abs/path.sqlite3`` (everything after ``sqlite://`` is the path) or a plain path:
      a SQLite file. A path to an existing directory, or ending in a separator, means
      ``<dir>/state.sqlite3`` (the state directory); missing parent directories are created.
    """
    text = os.fspath(location)
    if not isinstance(text, str) or not text.strip():
        raise StateStoreError(f"state store location must be a path or URL, got {location!r}")
    scheme = text.split("://", 1)[0].lower() if "://" in text else None
    if scheme in ("redis", "rediss"):
        from controller.redis_state_store import RedisStateStore

        return RedisStateStore.from_url(text)
    if scheme not in (None, "sqlite"):
        raise StateStoreError(
            f"unsupported state store URL {redact_url(text)!r}: use a directory or file path, "
            "sqlite:///path, or redis://host:port/db"
        )
    path_text = text[len("sqlite://"):] if scheme == "sqlite" else text
    if not path_text:
        raise StateStoreError(f"no path in {text!r}; write sqlite:///path/to/state.sqlite3")
    path = Path(path_text).expanduser()
    if path.is_dir() or path_text.endswith(("/", os.sep)):
        path = path / DEFAULT_SQLITE_FILE
    return SqliteStateStore(path)

