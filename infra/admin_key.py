"""The platform's admin key: made on first start, stored only as a hash, recognised by the gateway.

The admin key is an ordinary API key of a reserved tenant, `ADMIN_TENANT`, so it is stored the
way every key is — the state store keeps a salted hash, never the key — and verifying it is the
same single lookup. `AdminKeyAuth` is the gateway's `GatewayAuth` with one addition: a key of
the reserved tenant authenticates as the admin (every model, and the admin API). The reserved
tenant can hold no models and is hidden from the tenant and key listings.

On first start, `ensure_admin_key` creates the key and returns it so ``thaw serve`` prints it
once; it also writes it to the state directory's key file (mode 0600, like a kubeconfig), which
is how the ``thaw`` CLI on the same machine finds it. Lose both and `reset_admin_key` (``thaw
serve --reset-admin-key``) revokes the old key and makes a new one.

Where state outlives the machine (a cluster's Redis) but the state directory does not (a pod
recreated), the key is better kept in a secret store and given to every start: `import_admin_key`
(``thaw serve --admin-key-file``, e.g. a Kubernetes Secret mounted as a file; ``thaw keygen``
makes one) makes the file's key an admin key if it is not one already, and writes it to the state
directory for the CLI. It is never printed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from controller import StateStore
from infra.gateway_auth import GatewayAuth, Principal

ADMIN_TENANT = "thaw-admin"


@dataclass(frozen=True)
class AdminKeyAuth(GatewayAuth):
    """`GatewayAuth` where a key of `ADMIN_TENANT` is the admin."""

    async def authenticate(self, authorization: str | None) -> Principal:
        principal = await super().authenticate(authorization)
        if principal.tenant == ADMIN_TENANT:
            return Principal(tenant=None, is_admin=True)
        return principal


def ensure_admin_key(store: StateStore, key_file: Path | None) -> str | None:
    """Creates the admin key if the platform has none; returns it (to print once), else None."""
    if store.list_api_keys(ADMIN_TENANT):
        return None
    return _new_admin_key(store, key_file)


def reset_admin_key(store: StateStore, key_file: Path | None) -> str:
    """Revokes every admin key and returns a new one (written to `key_file` when given)."""
    for record in store.list_api_keys(ADMIN_TENANT):
        store.revoke_api_key(record.key_id)
    return _new_admin_key(store, key_file)


def import_admin_key(store: StateStore, source: Path, key_file: Path | None) -> bool:
    """Makes the key in `source` an admin key (True if it was not one yet) and copies it to
    `key_file`. Raises `ValueError` naming the file when it holds no usable key."""
    try:
        key = read_key_file(source)
    except OSError as exc:
        raise ValueError(f"cannot read {source}: {exc.strerror}") from None
    if key is None:
        raise ValueError(f"{source} is empty or missing: put an admin key in it (`thaw keygen` makes one)")
    store.add_tenant(ADMIN_TENANT)
    try:
        added = store.import_api_key(ADMIN_TENANT, key)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if key_file is not None and read_key_file(key_file) != key:
        write_key_file(key_file, key)
    return added


def _new_admin_key(store: StateStore, key_file: Path | None) -> str:
    store.add_tenant(ADMIN_TENANT)
    key = store.create_api_key(ADMIN_TENANT)
    if key_file is not None:
        write_key_file(key_file, key)
    return key


def write_key_file(path: Path, key: str) -> None:
    """Writes `key` to `path` readable by its owner only, replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_key_file(path: Path) -> str | None:
    """The key in `path`, or None if there is no such file."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text or None
