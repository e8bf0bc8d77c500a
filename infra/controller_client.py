"""The controller actor as the gateway and the admin API call it: `ControllerClient`.

One small async wrapper over the controller's handle, so that everything in `infra/` that talks
to the controller does it the same way — with a timeout on every call, and with the
controller's deliberate errors (an unknown model, an invalid spec, a conflicting deploy)
raised as themselves rather than inside Ray's wrapper (`wire.call` translates them, as it does
for every Ray caller) — and so tests can swap in a fake with the same coroutines. A controller
that is gone or too slow is `ControllerUnavailable`, which the HTTP layers answer with 503.

A controller that Ray restarts (its process or node died) keeps its actor, so the handle stays
good. One started anew -- a successor on another node, after the old actor was ended -- is another
actor under the same name: given `resolve` (how to find the controller by name), the client looks
it up again after a call finds its actor dead, so the gateway follows a moved controller instead
of answering 503 from then on. The failed call itself is not retried (it may have run).

A deploy runs as a job in the controller (`start_deploy` answers at once with its
`wire.DeployProgress`; `wait_deploy` long-polls it), so no call waits on a conversion or an
upload. What the gateway reads of the models comes typed (`model_records`, `model_record`: the
`wire.ModelRecord` the controller builds); the admin API's calls pass the controller's dicts on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from controller import SlotOutlook
from wire import ActorGoneError, DeployProgress, EngineGauges, GatewayMetricsSnapshot, MigrationReport, ModelRecord, call

logger = logging.getLogger(__name__)


class ControllerUnavailable(Exception):
    """The controller did not answer (dead, restarting, or slower than the timeout)."""


class ControllerClient:
    """Async calls to the controller actor (see the module docstring)."""

    def __init__(self, handle: Any, call_timeout_s: float = 30.0, reporter: str | None = None,
                 resolve: Callable[[], Awaitable[Any]] | None = None) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s!r}")
        self._handle = handle
        self._call_timeout_s = call_timeout_s
        self._resolve = resolve  # finds the controller by name again (see the module docstring)
        self.reporter = reporter  # names this gateway replica in its queue reports

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``method.remote(*args, **kwargs)``, awaited for at most `timeout_s` (default: the client's);
        the controller's own errors (`UnknownModelError`, ...) raised as themselves."""
        try:
            ref = getattr(self._handle, method).remote(*args, **kwargs)
            return await call(ref, timeout_s or self._call_timeout_s)
        except (ActorGoneError, TimeoutError) as exc:  # dead, unreachable for now, or too slow
            if isinstance(exc, ActorGoneError):
                await self._find_successor()
            raise ControllerUnavailable(f"the controller did not answer {method}: {type(exc).__name__}") from exc

    async def _find_successor(self) -> None:
        """After the controller's actor was found dead: the actor now under its name, if any."""
        if self._resolve is None:
            return
        try:
            handle = await self._resolve()
        except Exception as exc:  # noqa: BLE001 - none yet: the next call looks again
            logger.info("no controller to follow yet: %s", exc)
            return
        if handle != self._handle:
            logger.warning("the controller actor was replaced; following the new one")
            self._handle = handle

    # ---- models --------------------------------------------------------------------------

    async def deploy(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("deploy", dict(spec))

    async def update(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("update", dict(spec))

    async def start_deploy(self, spec: Mapping[str, Any], update: bool = False) -> DeployProgress:
        """Starts a deploy (or update) job; answers at once (the work runs in the controller)."""
        return await self._call("start_deploy", dict(spec), update)

    async def deploy_progress(self, deploy_id: str) -> DeployProgress:
        return await self._call("deploy_progress", deploy_id)

    async def wait_deploy(self, deploy_id: str, timeout_s: float) -> DeployProgress:
        """The job's record once finished, or after `timeout_s` (a long poll, so the call's own
        timeout is that plus the client's)."""
        return await self._call("wait_deploy", deploy_id, timeout_s, timeout_s=timeout_s + self._call_timeout_s)

    async def recent_deploys(self) -> list[DeployProgress]:
        return list(await self._call("recent_deploys"))

    # ---- uploads (a deploy's source sent through the admin API) -----------------------------

    async def create_upload(self) -> str:
        return str(await self._call("create_upload"))

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        return int(await self._call("upload_piece", upload_id, path, offset, data))

    async def upload_status(self, upload_id: str) -> dict[str, Any]:
        return dict(await self._call("upload_status", upload_id))

    async def seal_upload(self, upload_id: str, files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        # Hashing the uploaded files takes a while for a large model: longer than a plain call.
        return dict(await self._call("seal_upload", upload_id, {k: dict(v) for k, v in files.items()},
                                     timeout_s=max(self._call_timeout_s, 600.0)))

    async def delete_upload(self, upload_id: str) -> None:
        await self._call("delete_upload", upload_id)

    async def delete(self, model_id: str) -> Any:
        return await self._call("delete", model_id)

    async def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return list(await self._call("list_models", tenant))

    async def get_model(self, model_id: str) -> dict[str, Any]:
        return await self._call("get_model", model_id)

    async def model_records(self) -> list[ModelRecord]:
        """Every deployed model as the gateway reads it, sorted by id."""
        return list(await self._call("model_records"))

    async def model_record(self, model_id: str) -> ModelRecord:
        """One model's record; the controller's `UnknownModelError` (a `LookupError`) when it is not deployed."""
        return await self._call("model_record", model_id)

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]:
        return await self._call("scale", model_id, min_instances=min_instances, max_instances=max_instances)

    # ---- tenants ---------------------------------------------------------------------------

    async def set_tenant_quota(self, tenant: str, quota: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("set_tenant_quota", tenant, dict(quota))

    async def engine_gauges(self) -> list[EngineGauges]:
        """Every ready instance's engine load, as the controller last heard it."""
        return list(await self._call("engine_gauges"))

    async def slot_sharing_counts(self) -> dict[str, int]:
        return {str(name): int(value) for name, value in (await self._call("slot_sharing_counts")).items()}

    async def exchange_gateway_metrics(self, snapshot: GatewayMetricsSnapshot) -> list[GatewayMetricsSnapshot]:
        """Hands this replica's per-request series to the controller; returns its peers' latest."""
        return list(await self._call("exchange_gateway_metrics", snapshot))

    async def tenant_quotas(self) -> dict[str, dict[str, Any]]:
        return dict(await self._call("tenant_quotas"))

    # ---- the gateway's feed ----------------------------------------------------------------

    async def routing_table(self, known_version: int = -1, timeout_s: float = 0.0
                            ) -> tuple[int, Mapping[str, list[Mapping[str, Any]]]]:
        """The table at once when `known_version` is stale, else after a change or `timeout_s`."""
        version, table = await self._call("routing_table", known_version, timeout_s,
                                          timeout_s=timeout_s + self._call_timeout_s)
        return int(version), table

    async def notify_demand(self, model_id: str, num_queued: int, oldest_wait_s: float = 0.0,
                            newest_wait_s: float = 0.0) -> SlotOutlook | None:
        """Reports `num_queued` requests waiting here for the model, the oldest for `oldest_wait_s`
        and the newest for `newest_wait_s`; returns the controller's outlook for the model (None
        when it has none to give)."""
        return await self._call("notify_demand", model_id, num_queued, self.reporter or "gateway",
                                oldest_wait_s=oldest_wait_s, newest_wait_s=newest_wait_s)

    # ---- cluster ---------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return await self._call("status")

    async def drain_node(self, node_id: str) -> Any:
        return await self._call("drain_node", node_id)

    async def undrain_node(self, node_id: str) -> Any:
        return await self._call("undrain_node", node_id)

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> MigrationReport:
        # Longer than a plain call: the controller waits for the migrations (each bounded by its
        # migration_timeout_s).
        return await self._call("migrate", instance_id, request_id, to_node=to_node, to_instance=to_instance,
                                method=method, timeout_s=max(self._call_timeout_s, 120.0))
