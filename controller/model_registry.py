"""The registry: which models are deployed, with what spec, and what each tenant may hold.

`ModelRegistry` is the controller's durable bookkeeping, split out of `Controller`: deploying
(pushing a local source into the repository once), updating, deleting and scaling models, and
tenants' quotas (`TenantQuota`). Every change is saved in the state store first, then made in
the controller's live `ModelState`s (the dict it shares with the controller), under the
controller's tick lock, so a reconcile tick never sees half of it. What a change means for the
running instances (stopping a deleted model's, dropping stale node copies) goes through the
callbacks the controller passes in, so this module knows nothing of the cluster.

One deploy or update per model at a time: each claims the model id (and the repository name it
pushes to) before its first ``await`` -- the check and the claim run with no suspension point
between them, on the controller's one event loop -- so of two racing deploys exactly one pushes
and wins, and the other is refused at once with `DeployConflictError` (a 409), instead of both
pushing into the same repository model. The repository's own conditional manifest write covers
pushes from outside the controller (``thaw models push``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from controller.control_context import ControlContext
from controller.controller_errors import (DeployConflictError, InvalidSpecError, ModelAlreadyDeployedError,
                                         UnknownModelError, UnknownTenantError)
from controller.controller_status import event_to_dict
from controller.model_source import PublishedModel, publish_source, repository_name, repository_name_for
from controller.model_spec import S3_SOURCE_PREFIX, ModelSpec, SpecError, parse_model_id, validate_name
from controller.model_state import ModelState
from controller.state_store import StateStore
from controller.tenant_quota import TenantQuota
from controller.upload_area import UploadArea, upload_id_of
from controller.usage_meter import UsageMeter
from loader import make_private_dirs
from storage import ModelRepository, PushConflictError, PushProgress, S3Source, S3SourceError, source_client
from wire import DeployStage

logger = logging.getLogger(__name__)

__all__ = ["ModelRegistry", "checked_model_id", "spec_from"]


def spec_from(data: Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """A validated spec; `SpecError` becomes `InvalidSpecError`, which survives pickling."""
    if isinstance(data, ModelSpec):
        return data
    try:
        return ModelSpec.from_dict(data)
    except SpecError as exc:
        raise InvalidSpecError(exc.field, exc.reason) from None
    except TypeError as exc:
        raise InvalidSpecError("spec", str(exc)) from None


def checked_model_id(model_id: str) -> str:
    try:
        parse_model_id(model_id)
    except SpecError as exc:
        raise InvalidSpecError(exc.field, exc.reason) from None
    return model_id


class ModelRegistry:
    """See the module docstring. `models` is the controller's dict of live model states (shared);
    `invalidate_copies(name)` drops the nodes' copies of a repository model whose content changed;
    `stop_instances(model_id)` stops a deleted model's instances (returns their stop tasks);
    `context.wake()` starts a reconcile tick; `usage_meter()` makes a new model's usage meter."""

    def __init__(self, store: StateStore, repository: ModelRepository, models: dict[str, ModelState], *,
                 lock: asyncio.Lock, invalidate_copies: Callable[[str], Awaitable[None]],
                 stop_instances: Callable[[str], list[asyncio.Task]], usage_meter: Callable[[], UsageMeter],
                 context: ControlContext, engine_config: Callable[[ModelSpec], Any] | None = None,
                 uploads: UploadArea | None = None, downloads: Path | None = None) -> None:
        self._store = store
        self._repository = repository
        self._models = models
        self._lock = lock
        self._invalidate_copies = invalidate_copies
        self._stop_instances = stop_instances
        self._usage_meter = usage_meter
        self._record = context.record
        self._wall_clock = context.wall_clock
        self._wake = context.wake
        self._engine_config = engine_config  # a spec's worker.EngineConfig, to check its context fits
        self._uploads = uploads  # where upload:<id> sources are (None: this registry takes none)
        self._downloads = downloads  # where s3:// sources outside the repository are copied (None: refused)
        self._quotas: dict[str, TenantQuota] = {}  # tenants with a limit; the store's copy
        self._publishing: dict[str, str] = {}  # model id -> repository name, of deploys/updates in flight

    def load(self) -> None:
        """The models (with their desired counts) and quotas the state store holds."""
        desired = self._store.list_desired_instances()
        deployed = self._store.list_deployed_s()
        for spec in self._store.list_model_specs():
            self._models[spec.model_id] = ModelState(
                spec, repository_name_for(spec, self._repository.uri),
                desired.get(spec.model_id, spec.autoscaling.min_instances), usage=self._usage_meter(),
                deployed_s=deployed.get(spec.model_id))
        self._quotas = self._store.list_tenant_quotas()
        if self._downloads is not None:  # copies a killed controller's deploys left: no deploy outlives it
            shutil.rmtree(self._downloads, ignore_errors=True)

    # --- models ------------------------------------------------------------------------------

    @staticmethod
    def model_id_of(spec_data: Mapping[str, Any] | ModelSpec) -> str:
        return spec_from(spec_data).model_id

    def begin(self, spec_data: Mapping[str, Any] | ModelSpec, *, update: bool) -> ModelSpec | None:
        """What a deploy (or update) answers at once, before any I/O: the spec validated, the model
        known (update) or not yet deployed differently (deploy), and the claim on its id taken (see
        the module docstring). Returns the spec to pass to `complete`, or None when a deploy has
        nothing to do (the same spec is deployed already). Synchronous on purpose: no other call
        runs between the checks and the claim."""
        spec = spec_from(spec_data)
        if update:
            if spec.model_id not in self._models:
                raise UnknownModelError(spec.model_id)
        else:
            existing = self._models.get(spec.model_id)
            if existing is not None:
                if _same_deploy(existing.spec, spec):
                    return None
                raise ModelAlreadyDeployedError(spec.model_id)
        upload_id = upload_id_of(spec.source)
        if upload_id is not None:
            self._upload_dir(upload_id)  # an unknown or unsealed upload is refused at once
        self._acquire(spec)
        return spec

    def _upload_dir(self, upload_id: str) -> Path:
        if self._uploads is None:
            raise InvalidSpecError("source", "this controller takes no uploads; deploy from a path it can read")
        return self._uploads.path_of(upload_id)

    async def complete(self, spec: ModelSpec, *, update: bool, progress: PushProgress | None = None
                       ) -> dict[str, Any]:
        """The I/O part of a deploy or update that `begin` claimed (the claim is released here, however
        it ends): the checkpoint published (`progress` hears its stages and bytes), then the spec
        saved and made live. Nothing is visible before the spec is saved, so a failure (or a killed
        controller) leaves no half-deployed model. Running instances of an updated model keep serving
        what they loaded; new ones use the new spec and source (no rolling restart)."""
        model_id = spec.model_id
        try:
            published = await self._publish(spec, progress)
            spec = _with_resolved_tool_parser(spec, published)
            if progress is not None:
                progress(DeployStage.REGISTERING, 0, 0)
            async with self._lock:
                if update:
                    state = self._models.get(model_id)
                    if state is None:  # deleted while we were pushing
                        raise UnknownModelError(model_id)
                    self._store.put_model_spec(spec)
                    state.spec, state.repository_name, state.num_bytes = (spec, published.repository_name,
                                                                          published.num_bytes)
                else:
                    self._store.add_tenant(spec.tenant)
                    self._store.put_model_spec(spec)
                    self._store.set_desired_instances(model_id, spec.autoscaling.min_instances)
                    deployed_s = self._wall_clock()
                    self._store.set_deployed_s(model_id, deployed_s)
                    self._models[model_id] = ModelState(spec, published.repository_name,
                                                        spec.autoscaling.min_instances,
                                                        num_bytes=published.num_bytes, usage=self._usage_meter(),
                                                        deployed_s=deployed_s)
        finally:
            self._release(model_id)
        upload_id = upload_id_of(spec.source)
        if upload_id is not None:  # the repository holds it now
            await asyncio.to_thread(self._uploads.delete, upload_id)
        if update:
            detail = f"repository model {published.repository_name}{' (new content pushed)' if published.pushed else ''}"
        else:
            detail = (f"repository model {published.repository_name} "
                      f"({published.num_bytes} bytes{', pushed' if published.pushed else ''})")
        self._record(event_to_dict("updated" if update else "deployed", model_id, detail, self._wall_clock()))
        self._wake()
        return spec.to_dict()

    async def deploy(self, spec_data: Mapping[str, Any] | ModelSpec, progress: PushProgress | None = None
                     ) -> dict[str, Any]:
        """Register a model (pushing a local source into the repository once); returns the stored
        spec. Deploying the same spec again is a no-op; a different one needs `update`."""
        spec = self.begin(spec_data, update=False)
        if spec is None:
            return self.model(spec_from(spec_data).model_id).spec.to_dict()
        return await self.complete(spec, update=False, progress=progress)

    async def update(self, spec_data: Mapping[str, Any] | ModelSpec, progress: PushProgress | None = None
                     ) -> dict[str, Any]:
        """Replace a deployed model's spec (see `complete`)."""
        spec = self.begin(spec_data, update=True)
        assert spec is not None  # an update always has work: begin returns None only for a deploy
        return await self.complete(spec, update=True, progress=progress)

    def _acquire(self, spec: ModelSpec) -> None:
        """Hold the model id for one deploy or update (see the module docstring); `DeployConflictError`
        if another holds it."""
        if spec.model_id in self._publishing:
            raise DeployConflictError(spec.model_id, "another deploy or update of it is in progress; wait for it "
                                                     "to finish (thaw list shows the result), then try again")
        self._publishing[spec.model_id] = repository_name_for(spec, self._repository.uri)

    def _release(self, model_id: str) -> None:
        self._publishing.pop(model_id, None)

    async def _publish(self, spec: ModelSpec, progress: PushProgress | None) -> PublishedModel:
        """Push or find the spec's checkpoint (the caller holds the claim). New content under an
        existing name makes the nodes' cached copies stale: they are dropped, so the next start
        fetches the new one."""
        name = repository_name_for(spec, self._repository.uri)
        if name == repository_name(spec.model_id):  # a local source, pushed under that name
            users = [other.model_id for other in self._models.values()
                     if other.model_id != spec.model_id and other.repository_name == name]
            users += [model_id for model_id, other_name in self._publishing.items()
                      if model_id != spec.model_id and other_name == name]
            if users:
                raise InvalidSpecError("name", f"{spec.model_id!r} maps to repository model {name!r}, which "
                                               f"{users[0]!r} already uses; choose another name")
        upload_id = upload_id_of(spec.source)
        readable = spec if upload_id is None else dataclasses.replace(spec, source=str(self._upload_dir(upload_id)))
        download = None
        if spec.source.startswith(S3_SOURCE_PREFIX) and name == repository_name(spec.model_id):
            download = await self._download(spec, progress)  # a bucket outside the repository
            readable = dataclasses.replace(spec, source=str(download))
        try:
            engine_config = self._engine_config(spec) if self._engine_config is not None else None
            published = await asyncio.to_thread(publish_source, readable, self._repository, engine_config, progress)
        except PushConflictError:
            raise DeployConflictError(spec.model_id, f"repository model {name!r} was pushed or deleted by someone "
                                                     f"else while this call was pushing it; try again") from None
        finally:
            if download is not None:  # the repository holds the model now (or the deploy failed)
                await asyncio.to_thread(shutil.rmtree, download, True)
        if published.replaced:
            await self._invalidate_copies(published.repository_name)
        return published

    async def _download(self, spec: ModelSpec, progress: PushProgress | None) -> Path:
        """An ``s3://`` source outside the repository copied into a fresh private directory under
        the downloads dir (`storage.S3Source`; stage DOWNLOADING), which the caller deletes."""
        if self._downloads is None:
            raise InvalidSpecError("source", f"{spec.source!r} is not in the platform repository "
                                             f"{self._repository.uri} and this controller reads no other bucket")

        def run() -> Path:
            make_private_dirs(self._downloads)
            target = Path(tempfile.mkdtemp(prefix="deploy-", dir=self._downloads))
            try:
                source = S3Source(spec.source, source_client(self._repository))
                source.download(target, None if progress is None else
                                lambda done, total: progress(DeployStage.DOWNLOADING, done, total))
            except S3SourceError as exc:
                shutil.rmtree(target, ignore_errors=True)
                raise InvalidSpecError("source", str(exc)) from None
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            return target

        return await asyncio.to_thread(run)

    async def delete(self, model_id: str) -> None:
        """Remove a model and stop its instances (open requests are aborted). Its repository copy
        and node caches stay until evicted."""
        checked_model_id(model_id)
        async with self._lock:
            if self._models.pop(model_id, None) is None:
                raise UnknownModelError(model_id)
            self._store.delete_model_spec(model_id)
            stops = self._stop_instances(model_id)
        self._record(event_to_dict("deleted", model_id, f"{len(stops)} instances stopped", self._wall_clock()))
        await asyncio.gather(*stops, return_exceptions=True)

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]:
        """Change a model's instance bounds; returns the stored spec."""
        state = self.model(model_id)
        data = state.spec.to_dict()
        changes = {key: value for key, value in (("min_instances", min_instances), ("max_instances", max_instances))
                   if value is not None}
        data["autoscaling"] = {**data["autoscaling"], **changes}
        spec = spec_from(data)
        async with self._lock:
            self._store.put_model_spec(spec)
            state.spec = spec
        self._wake()
        return spec.to_dict()

    def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Stored specs (of one tenant when given), sorted by model id."""
        return [state.spec.to_dict() for model_id, state in sorted(self._models.items())
                if tenant is None or state.spec.tenant == tenant]

    def model(self, model_id: str) -> ModelState:
        """The model's live state; `InvalidSpecError` for a malformed id, `UnknownModelError`."""
        checked_model_id(model_id)
        state = self._models.get(model_id)
        if state is None:
            raise UnknownModelError(model_id)
        return state

    # --- tenants' quotas ---------------------------------------------------------------------

    def quota(self, tenant: str) -> TenantQuota:
        """The tenant's quota (unlimited unless one was set)."""
        return self._quotas.get(tenant, TenantQuota())

    def set_tenant_quota(self, tenant: str, quota: Mapping[str, Any]) -> dict[str, Any]:
        """Change a tenant's quota: the fields `quota` names are set (None lifts that limit), the
        others kept; returns the whole quota. Saved first, then enforced from the next placement
        (``max_instances``) and by the gateways from their next refresh (``max_queued_requests``).
        Raises `InvalidSpecError` naming a bad field, `UnknownTenantError`."""
        try:
            validate_name("tenant", tenant)
            updated = self.quota(tenant).updated(quota)
        except SpecError as exc:
            raise InvalidSpecError(exc.field, exc.reason) from None
        if tenant not in self._store.list_tenants():
            raise UnknownTenantError(tenant)
        self._store.set_tenant_quota(tenant, updated)
        if updated.unlimited:
            self._quotas.pop(tenant, None)
        else:
            self._quotas[tenant] = updated
        self._wake()  # a raised limit may let a waiting model be placed now
        return updated.to_dict()

    def tenant_quotas(self) -> dict[str, dict[str, Any]]:
        """tenant -> quota (`TenantQuota.to_dict`), for the tenants that have a limit."""
        return {tenant: quota.to_dict() for tenant, quota in sorted(self._quotas.items())}


def _with_resolved_tool_parser(spec: ModelSpec, published: PublishedModel) -> ModelSpec:
    """The spec as stored: "auto" replaced by the format found in the model's chat templates (or
    "none"), so the gateway reads it from the record and `thaw models show` tells what was found."""
    if spec.tool_call_parser != "auto":
        return spec
    return dataclasses.replace(spec, tool_call_parser=published.tool_call_format or "none")


def _same_deploy(stored: ModelSpec, asked: ModelSpec) -> bool:
    """Whether deploying `asked` again changes nothing: equal, or equal but for an "auto" tool-call
    parser that the stored spec holds resolved."""
    if asked.tool_call_parser == "auto":
        asked = dataclasses.replace(asked, tool_call_parser=stored.tool_call_parser)
    return stored == asked
