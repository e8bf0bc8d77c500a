"""The controller's durable state behind one interface, with a SQLite and a Redis backend.

What is kept (everything the controller cannot rebuild from the cluster):
- model specs, by ``tenant/name``;
- tenants and their API keys, stored only as a salted SHA-256 of the secret part;
- tenants' quotas (`TenantQuota`; a tenant without a record has no limits);
- the desired instance count per model (so a restart resumes at the same scale);
- the worker registry, instance id -> model, node, actor name, state, so a restarted
  controller can find the named actors still alive and adopt them instead of starting
  duplicates (the live report always wins over this record; it only says where to look).

`controller.state_location.open_state_store` picks the backend from a URL: a plain path or ``sqlite:///path`` for the
embedded default, ``redis://host:port/db`` (or ``rediss://``) for a cluster. Both backends
implement the same small set of record operations; the API-key scheme lives here, once.

API keys look like ``thaw_<key id>_<secret>``. The key id is public and indexes the record,
so verifying is one lookup, not a scan; the secret is 32 random bytes, hashed with a per-key
salt. A fast hash is enough for secrets of that entropy (a slow KDF protects guessable
passwords, which these are not); the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

from controller.model_spec import ModelSpec, parse_model_id, validate_name
from controller.tenant_quota import TenantQuota
from wire import InstanceState

SCHEMA_VERSION = 1
# The phases the controller records (`ManagedInstance.phase`); the store keeps their values.
WORKER_STATES = (InstanceState.LOADING, InstanceState.READY, InstanceState.ASLEEP, InstanceState.STOPPING)
# Read as LOADING: what stores written before the one spelling (wire.InstanceState) call it.
_LEGACY_LOADING = "starting"
_API_KEY_RE = re.compile(r"thaw_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")


class StateStoreError(RuntimeError):
    """The state store cannot be opened or used: bad URL, unreachable server, newer schema,
    or a request that breaks its integrity (an API key for a tenant that does not exist)."""


@dataclass(frozen=True, kw_only=True)
class WorkerRecord:
    """One model instance the controller started: enough to find its actor again."""

    instance_id: str
    model_id: str
    node_id: str
    actor_name: str
    state: InstanceState = InstanceState.LOADING

    def __post_init__(self) -> None:
        for name in ("instance_id", "node_id", "actor_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        parse_model_id(self.model_id)
        state = InstanceState.LOADING if self.state == _LEGACY_LOADING else self.state
        if state not in WORKER_STATES:
            raise ValueError(f"state must be one of {', '.join(s.value for s in WORKER_STATES)}, got {self.state!r}")
        object.__setattr__(self, "state", InstanceState(state))  # a stored value read back: the enum

    def to_dict(self) -> dict[str, str]:
        return {
            "instance_id": self.instance_id, "model_id": self.model_id, "node_id": self.node_id,
            "actor_name": self.actor_name, "state": self.state.value,
        }


@dataclass(frozen=True, kw_only=True)
class ApiKeyRecord:
    """A stored API key: never the key itself, only its salted hash."""

    key_id: str
    tenant: str
    salt_hex: str
    hash_hex: str
    created_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "key_id": self.key_id, "tenant": self.tenant, "salt_hex": self.salt_hex,
            "hash_hex": self.hash_hex, "created_s": self.created_s,
        }


def hash_api_secret(secret: str, salt: bytes) -> str:
    """SHA-256 of salt + secret, hex."""
    return hashlib.sha256(salt + secret.encode("utf-8")).hexdigest()


class StateStore(ABC):
    """Durable controller state. Each method is one transaction; every backend is safe to
    share between threads. Use as a context manager or call `close`."""

    # --- record operations each backend implements --------------------------------------

    @abstractmethod
    def put_model_spec(self, spec: ModelSpec) -> None:
        """Insert or replace the spec stored under ``spec.model_id``."""

    @abstractmethod
    def get_model_spec(self, model_id: str) -> ModelSpec | None: ...

    @abstractmethod
    def list_model_specs(self, tenant: str | None = None) -> list[ModelSpec]:
        """All specs (of one tenant when given), sorted by model id."""

    @abstractmethod
    def set_deployed_s(self, model_id: str, deployed_s: float) -> None:
        """Records when the model was deployed (Unix time; `/v1/models`' ``created``). Kept until
        the model is deleted; an update does not change it."""

    @abstractmethod
    def list_deployed_s(self) -> dict[str, float]:
        """Model id -> deploy time, for the models whose deploy time was recorded."""

    @abstractmethod
    def delete_model_spec(self, model_id: str) -> bool:
        """Remove the spec and its desired count; True if it existed. Worker records stay:
        the controller still has to stop those workers."""

    @abstractmethod
    def add_tenant(self, tenant: str) -> bool:
        """Create a tenant; True if new, False if it already existed."""

    @abstractmethod
    def list_tenants(self) -> list[str]:
        """Tenant names, sorted."""

    @abstractmethod
    def delete_tenant(self, tenant: str) -> bool:
        """Remove a tenant, all its API keys (so none outlives it) and its quota; True if it
        existed. Its model specs are left to the registry, which decides what deleting a tenant
        means."""

    @abstractmethod
    def set_tenant_quota(self, tenant: str, quota: TenantQuota) -> None:
        """Replace the tenant's quota (an unlimited one removes its record); raise
        `StateStoreError` if the tenant does not exist."""

    @abstractmethod
    def get_tenant_quota(self, tenant: str) -> TenantQuota:
        """The tenant's quota; unlimited when none was set (or the tenant does not exist)."""

    @abstractmethod
    def list_tenant_quotas(self) -> dict[str, TenantQuota]:
        """tenant -> quota, for the tenants that have a limit, sorted by tenant."""

    @abstractmethod
    def _insert_api_key(self, record: ApiKeyRecord) -> None:
        """Store a new key record; raise `StateStoreError` if its tenant does not exist."""

    @abstractmethod
    def _get_api_key(self, key_id: str) -> ApiKeyRecord | None: ...

    @abstractmethod
    def list_api_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        """Key records (hashes only), sorted by key id."""

    @abstractmethod
    def revoke_api_key(self, key_id: str) -> bool:
        """Delete a key; True if it existed."""

    @abstractmethod
    def set_desired_instances(self, model_id: str, num_instances: int) -> None: ...

    @abstractmethod
    def get_desired_instances(self, model_id: str) -> int | None: ...

    @abstractmethod
    def list_desired_instances(self) -> dict[str, int]: ...

    @abstractmethod
    def put_worker(self, record: WorkerRecord) -> None:
        """Insert or replace the record of ``record.instance_id``."""

    @abstractmethod
    def get_worker(self, instance_id: str) -> WorkerRecord | None: ...

    @abstractmethod
    def list_workers(self, model_id: str | None = None) -> list[WorkerRecord]:
        """Worker records (of one model when given), sorted by instance id."""

    @abstractmethod
    def delete_worker(self, instance_id: str) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    # --- shared logic --------------------------------------------------------------------

    def create_api_key(self, tenant: str) -> str:
        """Make a new key for `tenant` and return it; this is the only time it is visible."""
        key = new_api_key()
        self.import_api_key(tenant, key)
        return key

    def import_api_key(self, tenant: str, api_key: str) -> bool:
        """Makes `api_key` (made elsewhere, e.g. by `new_api_key`, kept in a secret store) a key of
        `tenant`; True if it was added, False if it is that tenant's already. Only its hash is
        stored, as for `create_api_key`. Raises `ValueError` for a malformed key, or one whose id
        another key (or another tenant) holds."""
        validate_name("tenant", tenant)
        match = _API_KEY_RE.fullmatch(api_key) if isinstance(api_key, str) else None
        if match is None:
            raise ValueError("an API key must look like thaw_<16 hex digits>_<43 URL-safe characters> "
                             "(`thaw keygen` makes one)")
        owner = self.verify_api_key(api_key)
        if owner == tenant:
            return False
        if owner is not None or self._get_api_key(match.group(1)) is not None:
            raise ValueError(f"the key's id {match.group(1)} is taken by another key; make a new one (`thaw keygen`)")
        salt = secrets.token_bytes(16)
        self._insert_api_key(ApiKeyRecord(
            key_id=match.group(1), tenant=tenant, salt_hex=salt.hex(),
            hash_hex=hash_api_secret(match.group(2), salt), created_s=time.time(),
        ))
        return True

    def verify_api_key(self, api_key: str) -> str | None:
        """The tenant a key belongs to, or None for a malformed, unknown or revoked key."""
        match = _API_KEY_RE.fullmatch(api_key) if isinstance(api_key, str) else None
        if match is None:
            return None
        record = self._get_api_key(match.group(1))
        if record is None:
            return None
        expected = hash_api_secret(match.group(2), bytes.fromhex(record.salt_hex))
        return record.tenant if hmac.compare_digest(expected, record.hash_hex) else None

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def new_api_key() -> str:
    """A fresh API key in the platform's form, ``thaw_<key id>_<secret>``, stored nowhere."""
    return f"thaw_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


def check_model_id(model_id: str) -> str:
    """Validate a ``tenant/name`` id at the store's edge; raise `ValueError` (a `SpecError`)."""
    parse_model_id(model_id)
    return model_id


def check_desired_instances(num_instances: int) -> int:
    if not isinstance(num_instances, int) or isinstance(num_instances, bool) or num_instances < 0:
        raise ValueError(f"num_instances must be an integer >= 0, got {num_instances!r}")
    return num_instances


def redact_url(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
