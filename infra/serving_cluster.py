"""The gateway's only door to Ray: `ServingCluster` (what the backend needs) and `RayServingCluster`.

`RayGatewayBackend` never touches Ray itself: every controller call and every instance stream
goes through this small interface, so the backend's routing, queueing and retry logic is unit
tested against a fake in plain asyncio (house rule, after Ray Serve's wrapper classes), and the
Ray-specific parts — awaiting object refs, resolving named actors, telling Ray's errors apart —
live in one place that the end-to-end tests exercise for real.

What crosses it are the records of `wire/`, the ones the controller and the workers use too: the
routing table (model id -> `wire.InstanceRoute` dicts, the controller's format for it), the
models (`wire.ModelRecord`), the instances' chunks (`GenerationChunk`), the controller's answer
to a queue report (`controller.slot_outlook.SlotOutlook`) and the tenants' quotas (`TenantQuota`).
Ray's errors are translated by `wire`'s helpers, as for every Ray caller, and then told apart
here: what means the instance cannot serve becomes `InstanceGone`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from controller import TenantQuota
from controller import SlotOutlook
from infra.controller_client import ControllerClient
from wire import (ActorGoneError, ActorUnreachableError, EngineDeadError, EngineGauges, GatewayMetricsSnapshot,
                  HostedInstance, InstanceRoute, ModelRecord, Prompt, SamplingParams, call, ray_errors_translated)

__all__ = ["InstanceGone", "InstanceRoute", "RayServingCluster", "RoutingTableData", "ServingCluster"]

RoutingTableData = Mapping[str, list[Mapping[str, Any]]]  # model id -> `InstanceRoute.to_dict()`s


class InstanceGone(Exception):
    """The instance cannot serve (its actor died, it is shutting down, its load failed): the
    request may be tried on another instance (continuing from what was streamed).

    `suspect`: the instance's engine died in a forward pass this request was in, so the request
    may be what killed it (`wire.EngineDeadError.suspect`); the backend tries a suspect on one
    more instance at most. A process that died (killed, node lost) or an instance found gone is
    no evidence against the request."""

    def __init__(self, message: str, *, suspect: bool = False) -> None:
        super().__init__(message)
        self.suspect = suspect


class ServingCluster(Protocol):
    """Controller and instances, as the gateway backend uses them. All methods are coroutines
    (or async iterators) on the caller's loop; none blocks it."""

    async def routing_table(self, known_version: int, timeout_s: float) -> tuple[int, RoutingTableData]:
        """``(version, {model_id: [route dict]})``: at once if `known_version` is not current,
        else after the next change or `timeout_s` (a long poll)."""
        ...

    async def list_models(self) -> list[ModelRecord]:
        """Every deployed model's record (the controller's ``model_records``)."""
        ...

    async def get_model(self, model_id: str) -> ModelRecord | None:
        """One model's record, or None when it is not deployed."""
        ...

    async def slot_sharing_counts(self) -> Mapping[str, int]:
        """The controller's slot-sharing counters (evictions, preemptions, suspensions, ...)."""
        ...

    async def engine_gauges(self) -> Sequence[EngineGauges]:
        """Every ready instance's running/waiting requests and KV-cache use (the controller's view)."""
        ...

    async def tenant_quotas(self) -> Mapping[str, TenantQuota]:
        """tenant -> quota, for the tenants that have a limit (the controller's ``tenant_quotas``)."""
        ...

    async def exchange_gateway_metrics(self, snapshot: GatewayMetricsSnapshot) -> Sequence[GatewayMetricsSnapshot]:
        """Hands this gateway replica's per-request series to the controller; returns the other
        live replicas' latest (`controller.GatewayMetricsBoard`)."""
        ...

    async def notify_demand(self, model_id: str, num_queued: int, oldest_wait_s: float = 0.0,
                            newest_wait_s: float = 0.0) -> SlotOutlook | None:
        """Tells the controller how many requests wait for an instance of the model, and how long
        the oldest and the newest of them have waited; returns where the model stands (None when the controller
        has no outlook for it). Raises `LookupError` when the model is not deployed."""
        ...

    def generate(self, route: InstanceRoute, request_id: str, prompt: Prompt, params: SamplingParams, *,
                 sent_token_ids: Sequence[int] = ()) -> AsyncIterator[Any]:
        """The request's `GenerationChunk`s, started on the instance, and followed to
        wherever it is live-migrated (no chunk lost or repeated); closing early cancels it where
        it is. With ``sent_token_ids`` (a recovery: the tokens the client already has from an
        instance that died) the instance continues the request from there and yields only what
        follows. Raises `InstanceGone` when the instance cannot serve (or take the recovery), and
        the worker's `InvalidRequestError`s and `RequestFailedError` (the request failed alone on
        an instance that serves on) as themselves."""
        ...

    async def abort(self, route: InstanceRoute, request_id: str) -> None:
        """Aborts a running request on its instance (its stream then ends with "abort")."""
        ...


class RayServingCluster:
    """`ServingCluster` over the controller (through `ControllerClient`) and the instances'
    named actors.

    Actor handles of instances are looked up by name once and cached by instance id; the
    lookup (``ray.get_actor`` blocks) runs on a thread, and happens when a route is first
    used — usually right after the routing table announced the instance.

    Streams go through `migration.follow_generation`, so a request live-migrated mid-stream is
    followed to its new instance, which is found by id in the routing table this class saw
    last (re-read once if the instance is newer than that copy).
    """

    def __init__(self, controller: ControllerClient, call_timeout_s: float = 10.0) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s!r}")
        self._controller = controller
        self._call_timeout_s = call_timeout_s
        self._handles: dict[str, Any] = {}
        self._routes: dict[str, InstanceRoute] = {}  # instance id -> route, from the last routing table

    async def routing_table(self, known_version: int, timeout_s: float) -> tuple[int, RoutingTableData]:
        version, table = await self._controller.routing_table(known_version, timeout_s)
        self._remember_routes(table or {})
        return version, table

    def _remember_routes(self, table: RoutingTableData) -> None:
        self._routes = {route.instance_id: route for entries in table.values()
                        for route in map(InstanceRoute.from_dict, entries)}

    async def list_models(self) -> list[ModelRecord]:
        return await self._controller.model_records()

    async def slot_sharing_counts(self) -> dict[str, int]:
        return await self._controller.slot_sharing_counts()

    async def engine_gauges(self) -> list[EngineGauges]:
        return await self._controller.engine_gauges()

    async def exchange_gateway_metrics(self, snapshot: GatewayMetricsSnapshot) -> list[GatewayMetricsSnapshot]:
        return await self._controller.exchange_gateway_metrics(snapshot)

    async def tenant_quotas(self) -> dict[str, TenantQuota]:
        quotas = await self._controller.tenant_quotas()
        return {tenant: TenantQuota.from_dict(quota) for tenant, quota in quotas.items()}

    async def get_model(self, model_id: str) -> ModelRecord | None:
        try:
            return await self._controller.model_record(model_id)
        except LookupError:  # the controller's UnknownModelError
            return None

    async def notify_demand(self, model_id: str, num_queued: int, oldest_wait_s: float = 0.0,
                            newest_wait_s: float = 0.0) -> SlotOutlook | None:
        return await self._controller.notify_demand(model_id, num_queued, oldest_wait_s, newest_wait_s)

    async def _handle(self, route: InstanceRoute) -> Any:
        handle = self._handles.get(route.instance_id)
        if handle is None:
            import ray

            try:
                handle = await asyncio.to_thread(ray.get_actor, route.actor_name, namespace=route.namespace)
            except ValueError as exc:  # no actor of that name: it is gone
                raise InstanceGone(f"instance {route.instance_id} ({route.actor_name}) is gone") from exc
            if route.hosted:  # the actor is the slot host the instance lives in
                handle = HostedInstance(handle, route.instance_id)
            self._handles[route.instance_id] = handle
        return handle

    def forget(self, instance_ids: set[str]) -> None:
        """Drops cached handles of instances no longer in the routing table."""
        for instance_id in [i for i in self._handles if i not in instance_ids]:
            del self._handles[instance_id]

    async def _resolve(self, instance_id: str) -> Any:
        """The handle of the instance a request was migrated to. A migration targets a ready
        instance, so it is in the routing table; if this copy predates it, one fresh read."""
        route = self._routes.get(instance_id)
        if route is None:
            _, table = await asyncio.wait_for(self._controller.routing_table(-1, 0.0), self._call_timeout_s)
            self._remember_routes(table or {})
            route = self._routes.get(instance_id)
        if route is None:
            raise InstanceGone(f"instance {instance_id}, where a request was migrated, is not in the routing table")
        return await self._handle(route)

    async def generate(self, route: InstanceRoute, request_id: str, prompt: Prompt, params: SamplingParams, *,
                       sent_token_ids: Sequence[int] = ()) -> AsyncIterator[Any]:
        from migration import MigrationRefusedError, StreamIdleTimeout, UnknownRequestError, follow_generation
        from worker import InstanceLoadError, SpareWorkerError

        handle = await self._handle(route)
        stream = follow_generation(handle, request_id, prompt, params, resolve=self._resolve,
                                   sent_token_ids=sent_token_ids)
        try:
            # aclosing: when the caller closes this stream early, the open instance stream's own
            # close (ray.cancel of the worker's stream) runs now, not whenever it is collected.
            # ray_errors_translated: the streams `follow_generation` opens itself after a
            # migration (``resume``, ``recover``) may still raise Ray's own errors.
            async with contextlib.aclosing(stream) as chunks:
                with ray_errors_translated():
                    async for chunk in chunks:
                        yield chunk
        except (EngineDeadError, InstanceLoadError, SpareWorkerError, ActorGoneError, ActorUnreachableError) as exc:
            self._handles.pop(route.instance_id, None)
            raise InstanceGone(f"instance {route.instance_id} cannot serve: {type(exc).__name__}: {exc}",
                               suspect=getattr(exc, "suspect", False)) from exc
        except (MigrationRefusedError, UnknownRequestError) as exc:  # cannot take the recovery, or lost track
            raise InstanceGone(f"instance {route.instance_id} cannot continue request {request_id}: {exc}") from exc
        except StreamIdleTimeout as exc:  # quiet with no progress (e.g. frozen by a driver that died): go elsewhere
            self._handles.pop(route.instance_id, None)
            raise InstanceGone(f"instance {route.instance_id}: request {request_id} made no progress: {exc}") from exc

    async def abort(self, route: InstanceRoute, request_id: str) -> None:
        handle = self._handles.get(route.instance_id)
        if handle is not None:
            await call(handle.abort.remote(request_id), self._call_timeout_s)
