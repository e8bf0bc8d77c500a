"""The cluster state store: a Redis server (``redis://host:port/db``).

Why this shape:
- One hash per kind of record under a key prefix (``thaw:model_specs``, ``thaw:workers``, ...):
  listing is one HGETALL, and the prefix (``?prefix=`` in the URL) lets two platforms share a
  server without seeing each other.
- Multi-key changes are MULTI/EXEC transactions; the ones that must check before they write
  (a key or a quota for an existing tenant; deleting a tenant with all its keys and its quota)
  WATCH what they read and retry if it changed, so none can leave a key or a quota without its
  tenant.
- The server is pinged when the store opens, so a wrong address fails at start-up with the
  address in the message, not at the first deploy. Later Redis failures surface as
  `StateStoreError` with the same address, never a bare socket error.
- Its persistence is checked then too (``CONFIG GET appendonly`` / ``save``): a server that keeps
  the data only in memory loses it on restart -- API keys and their revocations (a revoked key
  must stay revoked), tenants, deployed models -- so that is a logged warning naming the setting
  to change. A server that refuses CONFIG (a managed service, an ACL) gets a softer note.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from controller.model_spec import ModelSpec, validate_name
from controller.state_store import (
    SCHEMA_VERSION,
    ApiKeyRecord,
    StateStore,
    StateStoreError,
    WorkerRecord,
    check_desired_instances,
    check_model_id,
    redact_url,
)
from controller.tenant_quota import TenantQuota

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "thaw"
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_MAX_WATCH_RETRIES = 50
T = TypeVar("T")


def log_persistence(client: redis.Redis, shown: str) -> None:
    """Warn if the server at `shown` persists nothing (no append-only file, no snapshot schedule);
    a note if it will not say (CONFIG refused)."""
    try:
        appendonly = client.config_get("appendonly").get("appendonly")
        save = client.config_get("save").get("save")
    except redis.ResponseError as exc:  # CONFIG renamed away, or not allowed to this user
        logger.info("could not check whether Redis at %s persists its data (CONFIG GET refused: %s); make sure it "
                    "does (appendonly yes, or a save schedule): without it a restart of Redis loses API keys and "
                    "their revocations, tenants and deployed models", shown, exc)
        return
    if appendonly != "yes" and not save:
        logger.warning("Redis at %s does not persist its data (appendonly no, save \"\"): a restart of Redis loses "
                       "API keys and their revocations, tenants and deployed models. Turn persistence on: "
                       "appendonly yes in redis.conf (or CONFIG SET appendonly yes, then CONFIG REWRITE), which "
                       "keeps every write; a save schedule (e.g. save 60 1) keeps what was written until its last "
                       "snapshot", shown)


class RedisStateStore(StateStore):
    """State in a Redis database, under keys starting with ``<prefix>:``."""

    def __init__(self, client: redis.Redis, prefix: str = DEFAULT_PREFIX, display_url: str = "redis") -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise StateStoreError(f"invalid Redis key prefix {prefix!r}: letters, digits, '_', '.', ':', '-'")
        self._client = client
        self._url = display_url
        self._closed = False
        self._specs = f"{prefix}:model_specs"
        self._deploys = f"{prefix}:model_deploys"
        self._tenants = f"{prefix}:tenants"
        self._api_keys = f"{prefix}:api_keys"
        self._quotas = f"{prefix}:tenant_quotas"
        self._desired = f"{prefix}:desired_instances"
        self._workers = f"{prefix}:workers"
        self._schema = f"{prefix}:schema_version"
        self._check_schema()

    @classmethod
    def from_url(cls, url: str, connect_timeout_s: float = 2.0, timeout_s: float = 5.0) -> RedisStateStore:
        """Connect to ``redis[s]://[[user]:password@]host[:port][/db][?prefix=NAME]`` and ping it."""
        shown = redact_url(url)
        try:
            parts = urlsplit(url)
            port = parts.port or 6379
        except ValueError as exc:
            raise StateStoreError(f"invalid Redis URL {shown!r}: {exc}") from None
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise StateStoreError(f"invalid Redis URL {shown!r}: expected redis://host:port/db")
        db_text = parts.path.lstrip("/") or "0"
        if not db_text.isdigit():
            raise StateStoreError(f"invalid Redis URL {shown!r}: the database must be a number, got {db_text!r}")
        query = parse_qs(parts.query)
        unknown = sorted(set(query) - {"prefix"})
        if unknown:
            raise StateStoreError(f"invalid Redis URL {shown!r}: unknown option(s) {', '.join(unknown)}")
        prefix = query.get("prefix", [DEFAULT_PREFIX])[-1]
        client = redis.Redis(
            host=parts.hostname,
            port=port,
            db=int(db_text),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            ssl=parts.scheme == "rediss",
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
            decode_responses=True,
            # One quick retry rides over a dropped idle connection; more would only delay
            # the error for a server that is really gone.
            retry=Retry(NoBackoff(), 1),
        )
        try:
            client.ping()
        except redis.RedisError as exc:
            client.close()
            raise StateStoreError(f"cannot reach Redis at {shown}: {exc}") from exc
        log_persistence(client, shown)
        try:
            return cls(client, prefix, shown)
        except BaseException:
            client.close()
            raise

    def __repr__(self) -> str:
        return f"RedisStateStore({self._url!r})"

    @contextmanager
    def _errors(self) -> Iterator[None]:
        # redis-py reconnects on demand, so a closed client would quietly open new sockets.
        if self._closed:
            raise StateStoreError(f"the state store at {self._url} is closed")
        try:
            yield
        except redis.RedisError as exc:
            raise StateStoreError(f"Redis at {self._url}: {exc}") from exc

    def _watched(self, keys: tuple[str, ...], body: Callable[[redis.client.Pipeline], T]) -> T:
        """Run `body` as an optimistic transaction over `keys`, retrying if they change."""
        with self._errors(), self._client.pipeline() as pipe:
            for _ in range(_MAX_WATCH_RETRIES):
                try:
                    pipe.watch(*keys)
                    return body(pipe)
                except redis.WatchError:
                    continue
                finally:
                    pipe.reset()
        raise StateStoreError(f"Redis at {self._url}: too much contention on {', '.join(keys)}")

    def _check_schema(self) -> None:
        with self._errors():
            self._client.set(self._schema, SCHEMA_VERSION, nx=True)
            stored = self._client.get(self._schema)
        if stored is None or not stored.isdigit():
            raise StateStoreError(f"Redis at {self._url}: {self._schema} holds {stored!r}, not a schema version")
        if int(stored) > SCHEMA_VERSION:
            raise StateStoreError(
                f"Redis at {self._url} has state schema version {stored}, newer than this Thaw's "
                f"({SCHEMA_VERSION}); upgrade Thaw or use another ?prefix="
            )

    def close(self) -> None:
        self._closed = True
        self._client.close()

    # --- model specs ---------------------------------------------------------------------

    def put_model_spec(self, spec: ModelSpec) -> None:
        with self._errors():
            self._client.hset(self._specs, spec.model_id, json.dumps(spec.to_dict(), sort_keys=True))

    def get_model_spec(self, model_id: str) -> ModelSpec | None:
        with self._errors():
            raw = self._client.hget(self._specs, check_model_id(model_id))
        return ModelSpec.from_dict(json.loads(raw)) if raw is not None else None

    def list_model_specs(self, tenant: str | None = None) -> list[ModelSpec]:
        if tenant is not None:
            validate_name("tenant", tenant)
        with self._errors():
            raw = self._client.hgetall(self._specs)
        specs = [ModelSpec.from_dict(json.loads(raw[model_id])) for model_id in sorted(raw)]
        return [spec for spec in specs if tenant is None or spec.tenant == tenant]

    def delete_model_spec(self, model_id: str) -> bool:
        check_model_id(model_id)
        with self._errors(), self._client.pipeline(transaction=True) as pipe:
            pipe.hdel(self._specs, model_id)
            pipe.hdel(self._desired, model_id)
            pipe.hdel(self._deploys, model_id)
            num_deleted, _, _ = pipe.execute()
        return num_deleted > 0

    def set_deployed_s(self, model_id: str, deployed_s: float) -> None:
        with self._errors():
            self._client.hset(self._deploys, check_model_id(model_id), repr(float(deployed_s)))

    def list_deployed_s(self) -> dict[str, float]:
        with self._errors():
            raw = self._client.hgetall(self._deploys)
        return {model_id: float(value) for model_id, value in raw.items()}

    # --- tenants and API keys ------------------------------------------------------------

    def add_tenant(self, tenant: str) -> bool:
        validate_name("tenant", tenant)
        with self._errors():
            return bool(self._client.hsetnx(self._tenants, tenant, repr(time.time())))

    def list_tenants(self) -> list[str]:
        with self._errors():
            return sorted(self._client.hkeys(self._tenants))

    def delete_tenant(self, tenant: str) -> bool:
        validate_name("tenant", tenant)

        def body(pipe: redis.client.Pipeline) -> bool:
            key_ids = [key_id for key_id, raw in pipe.hgetall(self._api_keys).items()
                       if json.loads(raw)["tenant"] == tenant]
            pipe.multi()
            if key_ids:
                pipe.hdel(self._api_keys, *key_ids)
            pipe.hdel(self._quotas, tenant)
            pipe.hdel(self._tenants, tenant)
            return pipe.execute()[-1] > 0

        return self._watched((self._api_keys, self._tenants), body)

    def set_tenant_quota(self, tenant: str, quota: TenantQuota) -> None:
        validate_name("tenant", tenant)

        def body(pipe: redis.client.Pipeline) -> None:
            if not pipe.hexists(self._tenants, tenant):
                raise StateStoreError(f"no tenant '{tenant}'; add it before setting its quota")
            pipe.multi()
            if quota.unlimited:
                pipe.hdel(self._quotas, tenant)
            else:
                pipe.hset(self._quotas, tenant, json.dumps(quota.to_dict(), sort_keys=True))
            pipe.execute()

        self._watched((self._tenants,), body)

    def get_tenant_quota(self, tenant: str) -> TenantQuota:
        with self._errors():
            raw = self._client.hget(self._quotas, validate_name("tenant", tenant))
        return TenantQuota.from_dict(json.loads(raw)) if raw is not None else TenantQuota()

    def list_tenant_quotas(self) -> dict[str, TenantQuota]:
        with self._errors():
            raw = self._client.hgetall(self._quotas)
        return {tenant: TenantQuota.from_dict(json.loads(raw[tenant])) for tenant in sorted(raw)}

    def _insert_api_key(self, record: ApiKeyRecord) -> None:
        def body(pipe: redis.client.Pipeline) -> None:
            if not pipe.hexists(self._tenants, record.tenant):
                raise StateStoreError(f"no tenant '{record.tenant}'; add it before creating its keys")
            pipe.multi()
            pipe.hset(self._api_keys, record.key_id, json.dumps(record.to_dict()))
            pipe.execute()

        self._watched((self._tenants,), body)

    def _get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._errors():
            raw = self._client.hget(self._api_keys, key_id)
        return ApiKeyRecord(**json.loads(raw)) if raw is not None else None

    def list_api_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        if tenant is not None:
            validate_name("tenant", tenant)
        with self._errors():
            raw = self._client.hgetall(self._api_keys)
        records = [ApiKeyRecord(**json.loads(raw[key_id])) for key_id in sorted(raw)]
        return [record for record in records if tenant is None or record.tenant == tenant]

    def revoke_api_key(self, key_id: str) -> bool:
        with self._errors():
            return self._client.hdel(self._api_keys, key_id) > 0

    # --- desired instance counts ---------------------------------------------------------

    def set_desired_instances(self, model_id: str, num_instances: int) -> None:
        check_model_id(model_id)
        check_desired_instances(num_instances)
        with self._errors():
            self._client.hset(self._desired, model_id, num_instances)

    def get_desired_instances(self, model_id: str) -> int | None:
        with self._errors():
            raw = self._client.hget(self._desired, check_model_id(model_id))
        return int(raw) if raw is not None else None

    def list_desired_instances(self) -> dict[str, int]:
        with self._errors():
            raw = self._client.hgetall(self._desired)
        return {model_id: int(raw[model_id]) for model_id in sorted(raw)}

    # --- worker registry -----------------------------------------------------------------

    def put_worker(self, record: WorkerRecord) -> None:
        with self._errors():
            self._client.hset(self._workers, record.instance_id, json.dumps(record.to_dict()))

    def get_worker(self, instance_id: str) -> WorkerRecord | None:
        with self._errors():
            raw = self._client.hget(self._workers, instance_id)
        return WorkerRecord(**json.loads(raw)) if raw is not None else None

    def list_workers(self, model_id: str | None = None) -> list[WorkerRecord]:
        if model_id is not None:
            check_model_id(model_id)
        with self._errors():
            raw = self._client.hgetall(self._workers)
        records = [WorkerRecord(**json.loads(raw[instance_id])) for instance_id in sorted(raw)]
        return [record for record in records if model_id is None or record.model_id == model_id]

    def delete_worker(self, instance_id: str) -> bool:
        with self._errors():
            return self._client.hdel(self._workers, instance_id) > 0

