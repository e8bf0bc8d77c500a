"""The admin API: ``/admin/...`` routes behind the admin key, mounted into the gateway's app.

What the ``thaw`` CLI (and any script) operates the platform through:

- models: ``GET/POST /admin/models``, ``GET/PUT/DELETE /admin/models/{tenant}/{name}``,
  ``POST /admin/models/{tenant}/{name}/scale``;
- deploys as jobs: ``POST /admin/deploys`` (``?update=true`` for an update) answers 202 at once
  with the job's `wire.DeployProgress`; ``GET /admin/deploys/{id}`` (``?wait_s=`` long-polls up to
  that many seconds for it to finish) and ``GET /admin/deploys`` say where each stands: stage,
  bytes, rate, ETA, or why it failed. ``POST /admin/models`` and ``PUT /admin/models/...`` run the
  same job and answer when it has finished, however long that takes (no call waits on the
  conversion: each long poll is a short controller call);
- uploads, a deploy's source sent from the caller's machine (`controller.UploadArea`): ``POST
  /admin/uploads`` opens one, ``PUT /admin/uploads/{id}/files/{path}?offset=N`` appends a piece
  (each under the gateway's body limit; a piece for another offset than where the file's bytes
  end is a 409 naming that size, so a client resumes), ``GET /admin/uploads/{id}`` says what has
  arrived, ``POST /admin/uploads/{id}/seal`` checks every file against the caller's sizes and
  xxh3_64 digests, ``DELETE /admin/uploads/{id}`` drops it; a sealed upload deploys as
  ``upload:<id>``;
- the cluster: ``GET /admin/status`` (nodes, tiers, instances, recent decisions),
  ``POST /admin/nodes/{node_id}/drain`` (its requests migrated off), ``POST /admin/nodes/{node_id}/undrain``
  (placement may use it again), ``POST /admin/migrate``;
- tenants and keys: ``GET/POST /admin/tenants`` (the listing shows each tenant's quota),
  ``DELETE /admin/tenants/{tenant}``, ``PUT /admin/tenants/{tenant}/quota``, ``GET /admin/keys``,
  ``POST /admin/tenants/{tenant}/keys``, ``DELETE /admin/keys/{key_id}``.

Model operations go to the controller (through `ControllerClient`), tenants and keys straight to
the state store (the controller has no say in them); a quota is set through the controller, which
enforces it and saves it in the store, and listed from the store. Specs (and quotas) are validated
here with `ModelSpec.from_dict` (`TenantQuota`) before they travel, so a bad field is a 400 naming
it. Errors have the same OpenAI-style body as the rest of the gateway: 400 bad input (``param``
names the field; a deploy whose source directory names files outside itself is a 400 on
``source``), 401 no/unknown key, 403 a key that is not the admin's, 404 unknown
model/tenant/key/instance/node, 409 a conflicting deploy (another spec under that id, or another
deploy or update of it in flight: exactly one of racing deploys wins), a tenant that still has
models or a migration with no destination, 503 the controller not answering.

State-store calls block (SQLite, Redis) and run on a worker thread, never on the loop that
streams everyone's tokens.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations.
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol, TypeVar

import anyio.to_thread
from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from controller import (
    MigrationConflictError, ModelAlreadyDeployedError, ModelSpec, SpecError, StateStore, TenantQuota, UploadOffsetError,
    parse_model_id,
)
from infra.admin_key import ADMIN_TENANT
from infra.controller_client import ControllerUnavailable
from infra.gateway_access import principal_of
from infra.gateway_auth import GatewayAuth, Principal
from infra.openai_errors import OpenAIError, bad_request
from wire import DeployProgress

T = TypeVar("T")


class AdminController(Protocol):
    """What the admin API needs of the controller (`ControllerClient` provides it)."""

    async def start_deploy(self, spec: dict[str, Any], update: bool = False) -> DeployProgress: ...

    async def deploy_progress(self, deploy_id: str) -> DeployProgress: ...

    async def wait_deploy(self, deploy_id: str, timeout_s: float) -> DeployProgress: ...

    async def recent_deploys(self) -> list[DeployProgress]: ...

    async def create_upload(self) -> str: ...

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int: ...

    async def upload_status(self, upload_id: str) -> dict[str, Any]: ...

    async def seal_upload(self, upload_id: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]: ...

    async def delete_upload(self, upload_id: str) -> None: ...

    async def delete(self, model_id: str) -> Any: ...

    async def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    async def get_model(self, model_id: str) -> dict[str, Any]: ...

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]: ...

    async def status(self) -> dict[str, Any]: ...

    async def drain_node(self, node_id: str) -> Any: ...

    async def undrain_node(self, node_id: str) -> Any: ...

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> dict[str, Any]: ...

    async def set_tenant_quota(self, tenant: str, quota: dict[str, Any]) -> dict[str, Any]: ...

    async def tenant_quotas(self) -> dict[str, dict[str, Any]]: ...


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_instances: int | None = None
    max_instances: int | None = None


class MigrateRequest(BaseModel):
    """``POST /admin/migrate``: move one request (``request_id``) or all of an instance's to
    ``to_instance``, to the least-loaded ready instance on ``to_node``, or anywhere (neither)."""

    model_config = ConfigDict(extra="forbid")
    instance_id: str
    request_id: str | None = None
    to_node: str | None = None
    to_instance: str | None = None
    method: Literal["kv", "tokens"] = "kv"


class UploadedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int
    xxh3_64: str


class SealRequest(BaseModel):
    """``POST /admin/uploads/{id}/seal``: every file of the directory with its size and xxh3_64."""

    model_config = ConfigDict(extra="forbid")
    files: dict[str, UploadedFile]


class TenantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


def _not_found(what: str) -> OpenAIError:
    return OpenAIError(404, what, "not_found_error", None, "not_found")


def _conflict(message: str) -> OpenAIError:
    return OpenAIError(409, message, "invalid_request_error", None, "conflict")


_DEPLOY_POLL_S = 10.0  # one long poll of a deploy job that POST /admin/models waits on
MAX_DEPLOY_WAIT_S = 30.0  # the longest ?wait_s a caller may ask of GET /admin/deploys/{id}


def deploy_failure(record: DeployProgress) -> OpenAIError:
    """A failed deploy job as the HTTP answer a synchronous deploy would have given."""
    message = record.error or "the deploy failed"
    if record.error_kind == "invalid":
        return bad_request(message, record.error_field)
    if record.error_kind == "conflict":
        return _conflict(message)
    if record.error_kind == "not_found":
        return _not_found(message)
    return OpenAIError(500, message, "server_error", None, "deploy_failed")


def _forbidden_name(field: str, value: str) -> OpenAIError:
    return bad_request(f"{field}: {value!r} is reserved for the platform's admin key; choose another name", field)


def build_admin_router(controller: AdminController, store: StateStore, auth: GatewayAuth) -> APIRouter:
    """The ``/admin`` routes over `controller` and `store`; every one needs an admin caller."""

    async def require_admin(request: Request) -> Principal:
        # The gateway's AccessGate verified the key already (its Principal rides in the scope);
        # a router mounted without the gate verifies it here.
        principal = principal_of(request) or await auth.authenticate(request.headers.get("authorization"))
        if not principal.is_admin:
            raise OpenAIError(403, "the admin API needs the admin key (printed by `thaw serve` on first start, "
                              "and kept in the state directory's admin_key file)", "permission_error", None,
                              "admin_required")
        return principal

    router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

    async def in_thread(fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args)

    async def call(coroutine: Any) -> Any:
        """Awaits a controller call, turning its deliberate errors into HTTP answers."""
        try:
            return await coroutine
        except ControllerUnavailable as exc:
            raise OpenAIError(503, str(exc), "service_unavailable", None, "controller_unavailable",
                              {"Retry-After": "1"}) from None
        except SpecError as exc:
            raise bad_request(str(exc), exc.field) from None
        except LookupError as exc:  # UnknownModelError, UnknownInstanceError, an unknown node
            raise _not_found(str(exc).strip("'\"")) from None
        except (ModelAlreadyDeployedError, MigrationConflictError, UploadOffsetError) as exc:  # incl. DeployConflictError
            raise _conflict(str(exc)) from None
        except ValueError as exc:  # InvalidSpecError and InvalidMigrationError name the field
            raise bad_request(str(exc), getattr(exc, "field", None)) from None

    def checked_spec(body: dict[str, Any]) -> ModelSpec:
        try:
            spec = ModelSpec.from_dict(body)
        except SpecError as exc:
            raise bad_request(f"invalid model spec: {exc}", exc.field) from None
        if spec.tenant == ADMIN_TENANT:
            raise _forbidden_name("tenant", spec.tenant)
        return spec

    def model_id_of(tenant: str, name: str) -> str:
        model_id = f"{tenant}/{name}"
        try:
            parse_model_id(model_id)
        except SpecError as exc:
            raise bad_request(str(exc), exc.field) from None
        return model_id

    def tenant_of(name: str, field: str = "tenant") -> str:
        try:
            parse_model_id(f"{name}/any")  # a tenant name obeys the rules of a model id's first half
        except SpecError as exc:
            raise bad_request(f"{field}: {exc.reason}", field) from None
        if name == ADMIN_TENANT:
            raise _forbidden_name(field, name)
        return name

    # ---- models ----------------------------------------------------------------------------

    @router.get("/models")
    async def list_models(tenant: str | None = None) -> list[dict[str, Any]]:
        return await call(controller.list_models(tenant))

    async def deployed(spec: ModelSpec, update: bool) -> dict[str, Any]:
        """Runs the deploy job and waits for its end (long polls), answering as a synchronous call would."""
        record = await call(controller.start_deploy(spec.to_dict(), update))
        while not record.finished:
            record = await call(controller.wait_deploy(record.deploy_id, _DEPLOY_POLL_S))
        if record.error is not None:
            raise deploy_failure(record)
        return record.spec or spec.to_dict()

    @router.post("/models", status_code=201)
    async def deploy(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        spec = checked_spec(body)
        result = await deployed(spec, update=False)
        await in_thread(store.add_tenant, spec.tenant)  # deploying for a new tenant creates it
        return result

    # ---- deploys as jobs -------------------------------------------------------------------

    @router.post("/deploys", status_code=202)
    async def start_deploy(body: Annotated[dict[str, Any], Body()], update: bool = False) -> dict[str, Any]:
        """Starts a deploy (``?update=true``: an update) and answers at once with its job."""
        spec = checked_spec(body)  # (the controller adds a new tenant when the deploy succeeds)
        return (await call(controller.start_deploy(spec.to_dict(), update))).to_dict()

    @router.get("/deploys")
    async def list_deploys() -> list[dict[str, Any]]:
        return [record.to_dict() for record in await call(controller.recent_deploys())]

    @router.get("/deploys/{deploy_id}")
    async def get_deploy(deploy_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """The job now, or (``wait_s`` > 0) once it finished or after that many seconds."""
        if not 0 <= wait_s <= MAX_DEPLOY_WAIT_S:  # also refuses nan
            raise bad_request(f"wait_s: must be between 0 and {MAX_DEPLOY_WAIT_S:g} seconds, got {wait_s!r}",
                              "wait_s")
        if wait_s > 0:
            return (await call(controller.wait_deploy(deploy_id, wait_s))).to_dict()
        return (await call(controller.deploy_progress(deploy_id))).to_dict()

    @router.get("/models/{tenant}/{name}")
    async def get_model(tenant: str, name: str) -> dict[str, Any]:
        return await call(controller.get_model(model_id_of(tenant, name)))

    @router.put("/models/{tenant}/{name}")
    async def update(tenant: str, name: str, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        model_id = model_id_of(tenant, name)
        spec = checked_spec({"tenant": tenant, "name": name, **body} if "name" not in body else body)
        if spec.model_id != model_id:
            raise bad_request(f"the spec is for {spec.model_id!r} but the URL names {model_id!r}", "name")
        return await deployed(spec, update=True)

    @router.delete("/models/{tenant}/{name}")
    async def delete(tenant: str, name: str) -> dict[str, Any]:
        model_id = model_id_of(tenant, name)
        await call(controller.delete(model_id))
        return {"deleted": model_id}

    @router.post("/models/{tenant}/{name}/scale")
    async def scale(tenant: str, name: str, body: ScaleRequest) -> dict[str, Any]:
        if body.min_instances is None and body.max_instances is None:
            raise bad_request("give min_instances and/or max_instances", "min_instances")
        return await call(controller.scale(model_id_of(tenant, name), min_instances=body.min_instances,
                                           max_instances=body.max_instances))

    # ---- uploads ---------------------------------------------------------------------------

    @router.post("/uploads", status_code=201)
    async def create_upload() -> dict[str, Any]:
        return {"upload_id": await call(controller.create_upload())}

    @router.put("/uploads/{upload_id}/files/{path:path}")
    async def upload_piece(upload_id: str, path: str, request: Request, offset: int = 0) -> dict[str, Any]:
        """Appends the body to the upload's file `path` at `offset` (where its bytes end)."""
        if offset < 0:
            raise bad_request(f"offset: must be >= 0, got {offset}", "offset")
        data = await request.body()  # bounded by the gateway's body limit (BodyLimit)
        size = await call(controller.upload_piece(upload_id, path, offset, data))
        return {"upload_id": upload_id, "path": path, "size": size}

    @router.get("/uploads/{upload_id}")
    async def upload_status(upload_id: str) -> dict[str, Any]:
        return await call(controller.upload_status(upload_id))

    @router.post("/uploads/{upload_id}/seal")
    async def seal_upload(upload_id: str, body: SealRequest) -> dict[str, Any]:
        return await call(controller.seal_upload(upload_id, {path: entry.model_dump()
                                                             for path, entry in body.files.items()}))

    @router.delete("/uploads/{upload_id}")
    async def delete_upload(upload_id: str) -> dict[str, Any]:
        await call(controller.delete_upload(upload_id))
        return {"deleted": upload_id}

    # ---- the cluster -----------------------------------------------------------------------

    @router.get("/status")
    async def status() -> dict[str, Any]:
        return await call(controller.status())

    @router.post("/nodes/{node_id}/drain")
    async def drain(node_id: str) -> dict[str, Any]:
        result = await call(controller.drain_node(node_id))
        return result if isinstance(result, dict) else {"draining": node_id}

    @router.post("/nodes/{node_id}/undrain")
    async def undrain(node_id: str) -> dict[str, Any]:
        result = await call(controller.undrain_node(node_id))
        return result if isinstance(result, dict) else {"node_id": node_id, "draining": False}

    @router.post("/migrate")
    async def migrate(body: MigrateRequest) -> dict[str, Any]:
        for field in ("instance_id", "request_id", "to_node", "to_instance"):
            value = getattr(body, field)
            if value is not None and not value.strip():
                raise bad_request(f"{field}: must not be empty", field)
        if body.to_node is not None and body.to_instance is not None:
            raise bad_request("to_node: name a destination node or a destination instance, not both", "to_node")
        report = await call(controller.migrate(body.instance_id, body.request_id, to_node=body.to_node,
                                               to_instance=body.to_instance, method=body.method))
        return report.to_dict()  # a `wire.MigrationReport`

    # ---- tenants and keys ------------------------------------------------------------------

    @router.get("/tenants")
    async def list_tenants() -> list[dict[str, Any]]:
        """Each tenant with its quota (null: no limit)."""
        tenants, quotas = await in_thread(lambda: (store.list_tenants(), store.list_tenant_quotas()))
        return [{"tenant": t, **quotas.get(t, TenantQuota()).to_dict()} for t in tenants if t != ADMIN_TENANT]

    @router.post("/tenants", status_code=201)
    async def create_tenant(body: TenantRequest) -> JSONResponse:
        name = tenant_of(body.name, "name")
        created = await in_thread(store.add_tenant, name)
        return JSONResponse({"tenant": name, "created": created}, status_code=201 if created else 200)

    @router.delete("/tenants/{tenant}")
    async def delete_tenant(tenant: str) -> dict[str, Any]:
        tenant = tenant_of(tenant)
        models = await call(controller.list_models(tenant))
        if models:
            ids = ", ".join(sorted(_model_id(m) for m in models))
            raise _conflict(f"tenant {tenant!r} still has models ({ids}); delete them first")
        if tenant in await call(controller.tenant_quotas()):  # the controller forgets it too
            await call(controller.set_tenant_quota(tenant, TenantQuota().to_dict()))
        if not await in_thread(store.delete_tenant, tenant):
            raise _not_found(f"tenant {tenant!r} does not exist")
        return {"deleted": tenant}

    @router.put("/tenants/{tenant}/quota")
    async def set_quota(tenant: str, body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        """Sets the limits the body names (null lifts one); the others are kept."""
        tenant = tenant_of(tenant)
        if not body:
            raise bad_request("give max_instances and/or max_queued_requests (null: no limit)", "max_instances")
        try:
            TenantQuota().updated(body)  # a bad field is the caller's 400 here, before any call
        except SpecError as exc:
            raise bad_request(f"invalid quota: {exc}", exc.field) from None
        quota = await call(controller.set_tenant_quota(tenant, body))
        return {"tenant": tenant, **quota}

    @router.get("/keys")
    async def list_keys(tenant: str | None = None) -> list[dict[str, Any]]:
        if tenant is not None:
            tenant = tenant_of(tenant)  # a malformed name is the caller's 400, not the store's error
        records = await in_thread(store.list_api_keys, tenant)
        return [{"key_id": r.key_id, "tenant": r.tenant, "created_s": r.created_s}
                for r in records if r.tenant != ADMIN_TENANT]

    @router.post("/tenants/{tenant}/keys", status_code=201)
    async def create_key(tenant: str) -> dict[str, Any]:
        tenant = tenant_of(tenant)
        if tenant not in await in_thread(store.list_tenants):
            raise _not_found(f"tenant {tenant!r} does not exist; create it first (POST /admin/tenants)")
        key = await in_thread(store.create_api_key, tenant)
        return {"tenant": tenant, "key_id": key.split("_")[1], "api_key": key,
                "note": "this is the only time the key is shown; it is stored hashed"}

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str) -> dict[str, Any]:
        records = {r.key_id: r for r in await in_thread(store.list_api_keys, None)}
        record = records.get(key_id)
        if record is None or record.tenant == ADMIN_TENANT:
            raise _not_found(f"API key {key_id!r} does not exist")
        await in_thread(store.revoke_api_key, key_id)
        return {"revoked": key_id, "tenant": record.tenant}

    return router


def _model_id(record: dict[str, Any]) -> str:
    spec = record.get("spec", record)
    return str(record.get("model_id") or spec.get("model_id") or f"{spec.get('tenant')}/{spec.get('name')}")
