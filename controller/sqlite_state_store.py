"""The embedded state store: one SQLite file in the state directory.

Why this shape:
- One connection shared by the controller's threads, serialised by a lock: the controller's
  writes are few and small, and one connection keeps every read seeing the latest write.
- Every write is an explicit ``BEGIN IMMEDIATE ... COMMIT``, so a multi-row change (deleting a
  spec and its desired count) is all or nothing, and a crash mid-write leaves the last
  committed state.
- WAL journal and a busy timeout, so a second process (``thaw status`` reading while the
  controller writes) neither blocks the writer nor fails at once.
- The schema version is SQLite's ``user_version``; a file from a newer Thaw is refused rather
  than misread. A table added since (``tenant_quotas``, ``model_deploys``) is created, if missing, at every open
  (`_ADDED_TABLES`): a file from an older Thaw gains it, and an older Thaw opening a newer file
  only ignores it, so purely additive tables need no version bump.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from controller.model_spec import ModelSpec, validate_name
from controller.state_store import (
    SCHEMA_VERSION,
    ApiKeyRecord,
    StateStore,
    StateStoreError,
    WorkerRecord,
    check_desired_instances,
    check_model_id,
)
from controller.tenant_quota import TenantQuota

_SCHEMA_V1 = """
CREATE TABLE model_specs (
    model_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    updated_s REAL NOT NULL
);
CREATE INDEX model_specs_by_tenant ON model_specs (tenant);
CREATE TABLE tenants (
    tenant TEXT PRIMARY KEY,
    created_s REAL NOT NULL
);
CREATE TABLE api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants (tenant) ON DELETE CASCADE,
    salt_hex TEXT NOT NULL,
    hash_hex TEXT NOT NULL,
    created_s REAL NOT NULL
);
CREATE INDEX api_keys_by_tenant ON api_keys (tenant);
CREATE TABLE desired_instances (
    model_id TEXT PRIMARY KEY,
    num_instances INTEGER NOT NULL CHECK (num_instances >= 0)
);
CREATE TABLE workers (
    instance_id TEXT PRIMARY KEY,
    model_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    actor_name TEXT NOT NULL,
    state TEXT NOT NULL
);
CREATE INDEX workers_by_model ON workers (model_id);
"""
# Added after version 1; see the module docstring.
_ADDED_TABLES = """
CREATE TABLE IF NOT EXISTS tenant_quotas (
    tenant TEXT PRIMARY KEY REFERENCES tenants (tenant) ON DELETE CASCADE,
    quota_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS model_deploys (
    model_id TEXT PRIMARY KEY,
    deployed_s REAL NOT NULL
);
"""


class SqliteStateStore(StateStore):
    """State in a SQLite file at `path` (created, with its parent directories, if missing)."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: no implicit transactions; `_write` opens them explicitly.
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except (OSError, sqlite3.Error, StateStoreError) as exc:
            self.close()
            if isinstance(exc, StateStoreError):
                raise
            raise StateStoreError(f"cannot open the SQLite state store at {self.path}: {exc}") from exc

    def __repr__(self) -> str:
        return f"SqliteStateStore({str(self.path)!r})"

    def _migrate(self) -> None:
        with self._write() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StateStoreError(
                    f"{self.path} has state schema version {version}, newer than this Thaw's "
                    f"({SCHEMA_VERSION}); upgrade Thaw or use another state directory"
                )
            if version == 0:
                for statement in filter(str.strip, _SCHEMA_V1.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            for statement in filter(str.strip, _ADDED_TABLES.split(";")):
                conn.execute(statement)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed if the block finishes, rolled back if it raises."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StateStoreError(f"SQLite state store at {self.path}: {exc}") from exc
                raise

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._connection().execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise StateStoreError(f"SQLite state store at {self.path}: {exc}") from exc

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateStoreError(f"the state store at {self.path} is closed")
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # --- model specs ---------------------------------------------------------------------

    def put_model_spec(self, spec: ModelSpec) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO model_specs (model_id, tenant, spec_json, updated_s) VALUES (?, ?, ?, ?)",
                (spec.model_id, spec.tenant, json.dumps(spec.to_dict(), sort_keys=True), time.time()),
            )

    def get_model_spec(self, model_id: str) -> ModelSpec | None:
        rows = self._read("SELECT spec_json FROM model_specs WHERE model_id = ?", (check_model_id(model_id),))
        return ModelSpec.from_dict(json.loads(rows[0][0])) if rows else None

    def list_model_specs(self, tenant: str | None = None) -> list[ModelSpec]:
        if tenant is None:
            rows = self._read("SELECT spec_json FROM model_specs ORDER BY model_id")
        else:
            rows = self._read(
                "SELECT spec_json FROM model_specs WHERE tenant = ? ORDER BY model_id",
                (validate_name("tenant", tenant),),
            )
        return [ModelSpec.from_dict(json.loads(row[0])) for row in rows]

    def delete_model_spec(self, model_id: str) -> bool:
        check_model_id(model_id)
        with self._write() as conn:
            deleted = conn.execute("DELETE FROM model_specs WHERE model_id = ?", (model_id,)).rowcount
            conn.execute("DELETE FROM desired_instances WHERE model_id = ?", (model_id,))
            conn.execute("DELETE FROM model_deploys WHERE model_id = ?", (model_id,))
        return deleted > 0

    def set_deployed_s(self, model_id: str, deployed_s: float) -> None:
        check_model_id(model_id)
        with self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO model_deploys (model_id, deployed_s) VALUES (?, ?)",
                         (model_id, float(deployed_s)))

    def list_deployed_s(self) -> dict[str, float]:
        return {row[0]: float(row[1]) for row in self._read("SELECT model_id, deployed_s FROM model_deploys")}

    # --- tenants and API keys ------------------------------------------------------------

    def add_tenant(self, tenant: str) -> bool:
        validate_name("tenant", tenant)
        with self._write() as conn:
            inserted = conn.execute(
                "INSERT OR IGNORE INTO tenants (tenant, created_s) VALUES (?, ?)", (tenant, time.time())
            ).rowcount
        return inserted > 0

    def list_tenants(self) -> list[str]:
        return [row[0] for row in self._read("SELECT tenant FROM tenants ORDER BY tenant")]

    def delete_tenant(self, tenant: str) -> bool:
        validate_name("tenant", tenant)
        with self._write() as conn:
            # The foreign key cascades too; deleting explicitly keeps that true even if a
            # connection were opened without foreign_keys=ON.
            conn.execute("DELETE FROM api_keys WHERE tenant = ?", (tenant,))
            conn.execute("DELETE FROM tenant_quotas WHERE tenant = ?", (tenant,))
            deleted = conn.execute("DELETE FROM tenants WHERE tenant = ?", (tenant,)).rowcount
        return deleted > 0

    def set_tenant_quota(self, tenant: str, quota: TenantQuota) -> None:
        validate_name("tenant", tenant)
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM tenants WHERE tenant = ?", (tenant,)).fetchone() is None:
                raise StateStoreError(f"no tenant '{tenant}'; add it before setting its quota")
            if quota.unlimited:
                conn.execute("DELETE FROM tenant_quotas WHERE tenant = ?", (tenant,))
            else:
                conn.execute("INSERT OR REPLACE INTO tenant_quotas (tenant, quota_json) VALUES (?, ?)",
                             (tenant, json.dumps(quota.to_dict(), sort_keys=True)))

    def get_tenant_quota(self, tenant: str) -> TenantQuota:
        rows = self._read("SELECT quota_json FROM tenant_quotas WHERE tenant = ?", (validate_name("tenant", tenant),))
        return TenantQuota.from_dict(json.loads(rows[0][0])) if rows else TenantQuota()

    def list_tenant_quotas(self) -> dict[str, TenantQuota]:
        rows = self._read("SELECT tenant, quota_json FROM tenant_quotas ORDER BY tenant")
        return {tenant: TenantQuota.from_dict(json.loads(raw)) for tenant, raw in rows}

    def _insert_api_key(self, record: ApiKeyRecord) -> None:
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM tenants WHERE tenant = ?", (record.tenant,)).fetchone() is None:
                raise StateStoreError(f"no tenant '{record.tenant}'; add it before creating its keys")
            conn.execute(
                "INSERT INTO api_keys (key_id, tenant, salt_hex, hash_hex, created_s) VALUES (?, ?, ?, ?, ?)",
                (record.key_id, record.tenant, record.salt_hex, record.hash_hex, record.created_s),
            )

    def _get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        rows = self._read(
            "SELECT key_id, tenant, salt_hex, hash_hex, created_s FROM api_keys WHERE key_id = ?", (key_id,)
        )
        return _api_key(rows[0]) if rows else None

    def list_api_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        sql = "SELECT key_id, tenant, salt_hex, hash_hex, created_s FROM api_keys"
        if tenant is None:
            rows = self._read(sql + " ORDER BY key_id")
        else:
            rows = self._read(sql + " WHERE tenant = ? ORDER BY key_id", (validate_name("tenant", tenant),))
        return [_api_key(row) for row in rows]

    def revoke_api_key(self, key_id: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM api_keys WHERE key_id = ?", (key_id,)).rowcount > 0

    # --- desired instance counts ---------------------------------------------------------

    def set_desired_instances(self, model_id: str, num_instances: int) -> None:
        check_model_id(model_id)
        check_desired_instances(num_instances)
        with self._write() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO desired_instances (model_id, num_instances) VALUES (?, ?)",
                (model_id, num_instances),
            )

    def get_desired_instances(self, model_id: str) -> int | None:
        rows = self._read(
            "SELECT num_instances FROM desired_instances WHERE model_id = ?", (check_model_id(model_id),)
        )
        return rows[0][0] if rows else None

    def list_desired_instances(self) -> dict[str, int]:
        return dict(self._read("SELECT model_id, num_instances FROM desired_instances ORDER BY model_id"))

    # --- worker registry -----------------------------------------------------------------

    def put_worker(self, record: WorkerRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO workers (instance_id, model_id, node_id, actor_name, state) "
                "VALUES (?, ?, ?, ?, ?)",
                (record.instance_id, record.model_id, record.node_id, record.actor_name, record.state.value),
            )

    def get_worker(self, instance_id: str) -> WorkerRecord | None:
        rows = self._read(
            "SELECT instance_id, model_id, node_id, actor_name, state FROM workers WHERE instance_id = ?",
            (instance_id,),
        )
        return _worker(rows[0]) if rows else None

    def list_workers(self, model_id: str | None = None) -> list[WorkerRecord]:
        sql = "SELECT instance_id, model_id, node_id, actor_name, state FROM workers"
        if model_id is None:
            rows = self._read(sql + " ORDER BY instance_id")
        else:
            rows = self._read(sql + " WHERE model_id = ? ORDER BY instance_id", (check_model_id(model_id),))
        return [_worker(row) for row in rows]

    def delete_worker(self, instance_id: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM workers WHERE instance_id = ?", (instance_id,)).rowcount > 0


def _api_key(row: tuple[Any, ...]) -> ApiKeyRecord:
    key_id, tenant, salt_hex, hash_hex, created_s = row
    return ApiKeyRecord(key_id=key_id, tenant=tenant, salt_hex=salt_hex, hash_hex=hash_hex, created_s=created_s)


def _worker(row: tuple[Any, ...]) -> WorkerRecord:
    instance_id, model_id, node_id, actor_name, state = row
    return WorkerRecord(instance_id=instance_id, model_id=model_id, node_id=node_id, actor_name=actor_name, state=state)
