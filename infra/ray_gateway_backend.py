"""`GatewayBackend` over the Ray platform: a cached routing table, least-loaded routing, and a
bounded per-model queue for cold or saturated models.

The request path must never wait on the controller for a warm model, so the backend keeps its
own copy of the controller's routing table (ready instances per model) and of the deployed
models' cards, kept fresh by a background task that long-polls it (`RoutingTableFollower`: a
change comes back at once). A request for a model with a ready instance below its concurrency
cap goes straight to the least-loaded one (the gateway's own in-flight count first, the
controller's last report as tie-break). A model name not in the copy is looked up at the
controller once; a "not found" is remembered for ``unknown_model_ttl_s`` (`NegativeCache`),
until a refresh lists the model.

When no instance can take it (scaled to zero, or all at the cap), the request joins the model's
FIFO queue, bounded by the spec's ``max_queued_requests`` and by its tenant's quota of the same
name over all the tenant's queues here (`TenantQuota`, read from the controller with each refresh;
beyond either: `ModelOverloaded`, 429, naming the limit; another tenant's requests are not
affected), and waits at most ``queue_timeout_s`` from when it joined (then `QueueTimeout`, 503).
While anything waits, a second background task tells the controller the queue length and how long
its oldest request has waited (``notify_demand``, at once on every change and again every second,
since the controller lets a report expire), which is what makes the autoscaler start an instance
without delay; the long poll brings the new instance back the moment it is ready, and every table
change and every finished request hands free slots to the head of the queue. So a cold model's
request waits and then succeeds, rather than failing.

Each report is answered with the model's `SlotOutlook` (loading, its place among the models
waiting for a slot, an estimate, who holds the slots), kept until the queue empties
(`queue_outlooks`). It is what a waiting request hears: about every ``progress_interval_s`` of
waiting, `generate` yields a `QueueProgress` with the outlook's one-line summary (the gateway
sends it to a streaming client as an SSE comment), and a 429 or 503 says why in its message,
with its Retry-After hint taken from the outlook's estimate when there is one. Each wait is
counted in the metrics by the outlook's status when it ended, and by how it ended.

An instance that turns out to be gone (its actor died, it was scaled down between two table
refreshes, it is shutting down) is skipped for a while and the request tried elsewhere. If
tokens were streamed already, the request is *recovered*, not restarted: the next instance
(a ready one, or the first to become ready while the request waits in the model's queue as a
new one would) continues it from the output tokens the client has received, so the client's
stream goes on with no token lost or repeated (greedy output is exactly an unbroken run's).
Up to ``max_attempts`` instances in all; past that the failure is reported in-band. A request
whose instance's engine died in a forward pass the request was in is a suspect (it may be a
poison pill): it is tried on one more instance, and if that one dies on it too it fails with
`RequestFailed` (500) instead of taking down a third; a request that failed alone on an instance
that serves on (`wire.RequestFailedError`) is not retried at all. A stream
that ends with finish reason "suspended" (the controller preempted its instance's slot for
another model) is no failure: the request goes back into its model's queue the same way, with a
fresh queue deadline, and its model's next instance continues it from the tokens the client has;
the client sees a pause (with progress comments while it waits), never an error. (Workers end
their streams "suspended" when they are stopped, too: a stop that raced a request lands here.) A
stream that ends "abort" without this gateway having aborted it is treated as its instance's
death: the client's stream is never cut short with a finish reason it did not cause.

Generation goes through `serving_cluster`, which follows a request live-migrated to another
instance (`migration.follow_generation`) and whose early close ``ray.cancel``s the stream and so
aborts the request on the worker, freeing its KV blocks; `abort` also asks the instance directly,
and releases a request still waiting in a queue. After a live migration the request counts
against its first instance's concurrency cap until it finishes (the gateway is not told where it
went; the controller's load reports are).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from controller import TenantQuota, queued_over_quota
from infra.gateway_backend import (
    BackendUnavailable,
    GenerationChunk,
    InvalidRequest,
    ModelCard,
    ModelNotFound,
    ModelOverloaded,
    Prompt,
    QueueProgress,
    QueueTimeout,
    RequestFailed,
)
from infra.gateway_metrics import GatewayMetrics
from infra.gateway_model_info import ModelInfo, model_info_from_record
from infra.instance_picker import InstancePicker
from infra.instance_replies import gateway_chunk, invalid_request
from infra.negative_cache import NegativeCache
from infra.queue_outlooks import QueueOutlooks
from infra.queue_ticket import QueueTicket, RequestPlace, prune_settled
from infra.ray_backend_config import RayBackendConfig
from infra.routing_table_follower import RoutingTableFollower, RoutingUpdate
from infra.serving_cluster import InstanceGone, InstanceRoute, ServingCluster
from wire import ChatPrompt, FinishReason, InvalidRequestError, RequestFailedError, SamplingParams

__all__ = ["RayBackendConfig", "RayGatewayBackend", "model_info_from_record"]

logger = logging.getLogger(__name__)

# How many more instances a request is tried on after an engine died in a forward pass it was in.
_MAX_SUSPECT_RETRIES = 1


class RayGatewayBackend:
    """The platform's `GatewayBackend` (see the module docstring). Use on one event loop;
    `start` (or the first call) starts the background tasks, `close` stops them."""

    def __init__(self, cluster: ServingCluster, config: RayBackendConfig | None = None,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._cluster = cluster
        self._config = config or RayBackendConfig()
        self._metrics = metrics
        self._clock = clock
        self._follower = RoutingTableFollower(cluster, metrics, self._config.long_poll_s, clock)
        self._routes: dict[str, list[InstanceRoute]] = {}
        self._models: dict[str, ModelInfo] = {}
        self._models_loaded = False
        self._picker = InstancePicker(self._config.max_ongoing_requests_per_instance,
                                      self._config.broken_instance_s, clock)
        self._queues: dict[str, deque[QueueTicket]] = {}
        self._requests: dict[str, RequestPlace] = {}
        self._reported: dict[str, tuple[int, float]] = {}  # model id -> (queue length, when) last told
        self._outlooks = QueueOutlooks(self._config.retry_after_s, self._config.max_retry_after_s)
        self._unknown = NegativeCache(self._config.unknown_model_ttl_s, clock=clock)  # names found not deployed
        self._last_refresh_ok: float | None = None
        self._wake: asyncio.Event | None = None  # set: report demand now
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the background tasks (idempotent) and tries a first refresh at once."""
        self._ensure_started()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._refresh(0.0), self._config.call_timeout_s)

    def _ensure_started(self) -> None:
        if self._closed:
            raise BackendUnavailable("the gateway backend is shut down")
        if not self._tasks or any(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._tasks = [loop.create_task(self._watch_loop(), name="thaw-routing-watch"),
                           loop.create_task(self._demand_loop(), name="thaw-demand-report")]

    async def close(self) -> None:
        """Stops the background tasks and fails every waiting request with `BackendUnavailable`."""
        self._closed = True
        for queue in self._queues.values():
            for ticket in queue:
                if not ticket.future.done():
                    ticket.future.set_exception(BackendUnavailable("the gateway is shutting down",
                                                                   self._config.retry_after_s))
        self._queues.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ---- GatewayBackend --------------------------------------------------------------------

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        self._ensure_started()
        if not self._models_loaded:
            await self._refresh_or_unavailable()
        return [info.card for model_id, info in sorted(self._models.items())
                if tenant is None or info.card.owned_by == tenant]

    async def describe_model(self, model_id: str) -> ModelCard:
        return (await self._info(model_id)).card

    async def is_ready(self) -> bool:
        self._ensure_started()
        if self._last_refresh_ok is None or self._clock() - self._last_refresh_ok > self._config.stale_after_s:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._refresh(0.0), self._config.call_timeout_s)
        return self._last_refresh_ok is not None and self._clock() - self._last_refresh_ok <= self._config.stale_after_s

    async def generate(self, model_id: str, request_id: str, prompt: Prompt,
                       params: SamplingParams) -> AsyncIterator[GenerationChunk | QueueProgress]:
        info = await self._info(model_id)
        payload: Any = prompt if isinstance(prompt, (str, ChatPrompt)) else \
            [dict(p) if isinstance(p, Mapping) else p for p in prompt]
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        request = RequestPlace(model_id)
        self._requests[request_id] = request
        arrival = self._clock()
        sent_token_ids: list[int] = []  # what the client has received: a recovery continues from it
        queue_s: float | None = None
        first = True
        attempt = 0  # instances that failed it; a suspension is no failure and counts none
        num_suspect_deaths = 0  # engines that died in a forward pass it was in
        admissions = 0
        try:
            while attempt < self._config.max_attempts:
                attempt += 1
                admitted = self._admit(info, request, readmitted=admissions > 0)
                admissions += 1
                if isinstance(admitted, QueueTicket):  # in the model's queue: news about every interval
                    try:
                        while not await admitted.wait_a_while(self._config.progress_interval_s):
                            yield QueueProgress(text=self._outlooks.progress_line(model_id))
                    except BaseException:  # cancelled, or closed at a progress record: the client left
                        self._leave_queue(model_id, admitted, "aborted")
                        raise
                    finally:
                        request.ticket = None
                    route = self._end_wait(info, admitted)
                else:
                    route = admitted
                if route is None:  # aborted while it waited
                    yield GenerationChunk(request_id=request_id, text="", token_ids=(), finish_reason=FinishReason.ABORT.value,
                                          num_prompt_tokens=0, num_completion_tokens=len(sent_token_ids),
                                          queue_s=self._clock() - arrival if first else None)
                    return
                if first:
                    queue_s = self._clock() - arrival
                request.route = route
                try:
                    stream = self._cluster.generate(route, request_id, payload, params,
                                                    sent_token_ids=tuple(sent_token_ids))
                    suspended = False
                    async with contextlib.aclosing(stream) as chunks:
                        async for chunk in chunks:
                            sent_token_ids.extend(chunk.token_ids)
                            if chunk.finish_reason == FinishReason.SUSPENDED:  # the slot went to another model
                                suspended = True
                                if chunk.token_ids:
                                    yield gateway_chunk(dataclasses.replace(chunk, finish_reason=None), queue_s)
                                    first, queue_s = False, None
                                break
                            if chunk.finish_reason == FinishReason.ABORT and not request.aborted:
                                # An abort this gateway did not ask for: its instance ended it on
                                # its own (a stop that did not suspend it). Carried on elsewhere
                                # from what the client has, as after a death, not cut short.
                                if chunk.token_ids:
                                    yield gateway_chunk(dataclasses.replace(chunk, finish_reason=None), queue_s)
                                    first, queue_s = False, None
                                raise InstanceGone(f"instance {route.instance_id} ended request {request_id} "
                                                   "without being asked to")
                            yield gateway_chunk(chunk, queue_s)
                            first, queue_s = False, None
                    if not suspended:
                        return
                    # Back in the model's queue with what the client has: its next instance continues
                    # it from there (`recover`). Not a failure: the attempt is given back.
                    self._picker.mark_broken(route)
                    attempt -= 1
                    logger.info("request %s: suspended after %d tokens; it waits for %s's next slot",
                                request_id, len(sent_token_ids), model_id)
                except InstanceGone as exc:
                    self._picker.mark_broken(route)
                    num_suspect_deaths += exc.suspect
                    if num_suspect_deaths > _MAX_SUSPECT_RETRIES:  # a poison pill is not passed on
                        logger.error("request %s: not retried: %d instances died running it: %s",
                                     request_id, num_suspect_deaths, exc)
                        raise RequestFailed(
                            f"model {model_id!r}: this request failed on {num_suspect_deaths} instances and is not "
                            "retried; the failure has been logged") from None
                    if attempt == self._config.max_attempts:
                        # The cause is for the log; the client learns what happened, not how (no
                        # internal exception text in a response body).
                        logger.warning("request %s: giving up after %d instance(s): %s", request_id, attempt, exc)
                        raise BackendUnavailable(
                            f"model {model_id!r}: the instance serving this request failed ({attempt} tried); "
                            "retry later", self._config.retry_after_s) from exc
                    if sent_token_ids:
                        logger.warning("request %s: %s; resuming it on another instance after %d tokens",
                                       request_id, exc, len(sent_token_ids))
                    else:
                        logger.warning("request %s: %s; trying another instance", request_id, exc)
                except InvalidRequestError as exc:
                    raise invalid_request(exc) from None
                except RequestFailedError as exc:  # it failed alone; its instance serves on
                    logger.error("request %s failed on %s: %s", request_id, route.instance_id, exc)
                    raise RequestFailed(f"model {model_id!r} could not complete this request; "
                                        "the failure has been logged") from None
                finally:
                    request.route = None
                    self._release(model_id, route)
        finally:
            del self._requests[request_id]

    async def abort(self, model_id: str, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.model_id != model_id:
            return
        request.aborted = True
        if request.ticket is not None and not request.ticket.future.done():
            request.ticket.future.set_result(None)
        route = request.route
        if route is not None:
            try:
                await self._cluster.abort(route, request_id)
            except Exception as exc:  # noqa: BLE001 - the stream's own close cancels it too
                logger.warning("abort of %s on %s failed: %s", request_id, route.instance_id, exc)

    # ---- models ----------------------------------------------------------------------------

    async def _info(self, model_id: str) -> ModelInfo:
        self._ensure_started()
        info = self._models.get(model_id)
        if info is not None:
            return info
        # Not in the cache: deployed since the last refresh, or not at all. Only this path asks
        # the controller on the request path, and only for a model nobody has served yet; a "no"
        # is remembered briefly, so repeating an unknown name does not cost a call each time.
        if model_id in self._unknown:
            raise ModelNotFound(model_id)
        try:
            record = await self._cluster.get_model(model_id)
        except Exception as exc:  # noqa: BLE001 - an unreachable controller is a 503, not a 500
            logger.warning("looking up model %s at the controller failed: %s: %s", model_id, type(exc).__name__, exc)
            raise BackendUnavailable("the controller is unreachable; retry later", self._config.retry_after_s) from exc
        if record is None:
            self._unknown.add(model_id)
            raise ModelNotFound(model_id)
        info = model_info_from_record(record)
        self._models[model_id] = info
        return info

    # ---- admission -------------------------------------------------------------------------

    def _admit(self, info: ModelInfo, request: RequestPlace, *, readmitted: bool = False) -> InstanceRoute | QueueTicket:
        """A reserved instance for the request if one is free and nobody waits, else its ticket
        in the model's queue (also `request.ticket`); `ModelOverloaded` when the queue is full or
        the tenant is at its queued-request quota. A request `readmitted` (back after a suspension
        or its instance's death, mid-stream) is not new load and is never refused: a 429 there
        would break a stream the client was promised."""
        model_id = info.card.model_id
        queue = self._queues.get(model_id)
        if queue is not None:
            prune_settled(queue)
        if not queue:  # nobody waits: no line to jump
            route = self._pick(model_id)
            if route is not None:
                self._reserve(route)
                return route
            queue = self._queues.setdefault(model_id, deque())
        if readmitted:
            pass
        elif len(queue) >= info.max_queued_requests:
            raise ModelOverloaded(
                f"model {model_id!r} has {len(queue)} requests waiting for an instance, its limit "
                f"(max_queued_requests){self._outlooks.reason(model_id)}; retry later",
                self._outlooks.retry_after_s(model_id))
        tenant = info.card.owned_by
        refusal = None if readmitted else queued_over_quota(tenant, self._follower.quotas.get(tenant, TenantQuota()),
                                                            self._num_queued(tenant))
        if refusal is not None:
            if not queue:
                del self._queues[model_id]
            raise ModelOverloaded(refusal, self._config.retry_after_s)
        loop = asyncio.get_running_loop()
        ticket = QueueTicket(loop.create_future(), self._clock(), loop.time() + info.queue_timeout_s)
        queue.append(ticket)
        request.ticket = ticket
        assert self._wake is not None
        self._wake.set()  # report the new demand now
        return ticket

    def _num_queued(self, tenant: str) -> int:
        """The tenant's requests waiting here, over all its models."""
        return sum(not ticket.future.done() for model_id, queue in self._queues.items()
                   if model_id.partition("/")[0] == tenant for ticket in queue)

    def _end_wait(self, info: ModelInfo, ticket: QueueTicket) -> InstanceRoute | None:
        """Takes a settled or expired ticket out of the queue: the instance it was handed, None
        if the request was aborted; raises what failed it (the model deleted, the gateway
        shutting down), or `QueueTimeout` with the controller's explanation at the deadline."""
        model_id = info.card.model_id
        future = ticket.future
        if not future.done():
            self._leave_queue(model_id, ticket, "timed_out")
            raise QueueTimeout(
                f"no instance of model {model_id!r} became ready within its queue timeout of "
                f"{info.queue_timeout_s:g} s{self._outlooks.reason(model_id)}; retry later",
                self._outlooks.retry_after_s(model_id))
        if future.cancelled() or future.exception() is not None:
            self._leave_queue(model_id, ticket, "failed")
            if future.cancelled():
                raise BackendUnavailable("the request's place in the queue was lost", self._config.retry_after_s)
            raise future.exception()  # type: ignore[misc]
        route = future.result()
        self._leave_queue(model_id, ticket, "served" if route is not None else "aborted")
        return route

    def _leave_queue(self, model_id: str, ticket: QueueTicket, outcome: str) -> None:
        """Removes the ticket from the model's queue (giving back an instance handed to it if the
        request will not use it), tells the controller the queue got shorter, and counts the wait
        by the outlook's status now."""
        queue = self._queues.get(model_id)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(ticket)
        if outcome != "served":  # cancels a pending ticket, gives back an instance handed over just now
            self._abandon(model_id, ticket.future)
        if self._wake is not None:
            self._wake.set()
        if self._metrics is not None:
            self._metrics.record_queue_wait(model_id, self._outlooks.cause(model_id), outcome,
                                            max(0.0, self._clock() - ticket.enqueued_s))

    def _abandon(self, model_id: str, waiter: asyncio.Future[InstanceRoute | None]) -> None:
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None and waiter.result() is not None:
            self._release(model_id, waiter.result())
        elif not waiter.done():
            waiter.cancel()

    def _pick(self, model_id: str) -> InstanceRoute | None:
        return self._picker.pick(self._routes.get(model_id, ()))

    def _reserve(self, route: InstanceRoute) -> None:
        self._picker.reserve(route)

    def _release(self, model_id: str, route: InstanceRoute) -> None:
        self._picker.release(route)
        self._dispatch(model_id)

    def inflight(self) -> dict[str, int]:
        """Requests this gateway has on each instance now (for tests and diagnostics)."""
        return self._picker.inflight()

    def _dispatch(self, model_id: str) -> None:
        """Hands free instance slots to the model's queue, oldest request first."""
        queue = self._queues.get(model_id)
        while queue:
            prune_settled(queue)
            if not queue:
                break
            route = self._pick(model_id)
            if route is None:
                break
            self._reserve(route)
            queue.popleft().future.set_result(route)
        if queue is not None and not queue:
            del self._queues[model_id]
            if self._wake is not None:
                self._wake.set()  # the queue drained: report it

    # ---- the background tasks -------------------------------------------------------------

    async def _refresh_or_unavailable(self) -> None:
        try:
            await asyncio.wait_for(self._refresh(0.0), self._config.call_timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.warning("refreshing the routing table failed: %s: %s", type(exc).__name__, exc)
            raise BackendUnavailable("the controller is unreachable; retry later", self._config.retry_after_s) from exc

    async def _watch_loop(self) -> None:
        """Long-polls the routing table: a change comes back at once, no change after `long_poll_s`."""
        failures = 0
        while not self._closed:
            try:
                await self._refresh(self._config.long_poll_s)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving from the cached table
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    logger.warning("routing table refresh failed (%d in a row): %s", failures, exc)
                await asyncio.sleep(self._config.retry_interval_s)  # a back-off, not a synchronisation

    async def _demand_loop(self) -> None:
        """Reports queue lengths when woken (a queue changed) and every interval while any waits."""
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            try:
                await self._report_demand()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next report repeats it
                logger.warning("reporting queued requests to the controller failed: %s", exc)
            waiting = any(self._queues.values())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._config.demand_report_interval_s if waiting else None)

    async def _refresh(self, timeout_s: float) -> None:
        """One poll of the routing table, waiting up to `timeout_s` for a change
        (`RoutingTableFollower.poll`); applies a changed one, and counts its new instances as cold starts."""
        update = await self._follower.poll(timeout_s)
        first = not self._models_loaded
        if update is not None:
            self._apply(update)
        self._last_refresh_ok = self._clock()
        for model_id in list(self._queues):  # an instance skipped as broken may be usable again by now
            self._dispatch(model_id)
        if update is not None and update.appeared and not first:
            await self._follower.record_cold_starts(update.appeared)

    def _apply(self, update: RoutingUpdate) -> None:
        """Takes a changed routing table and model list; hands new capacity to waiting requests."""
        live = update.instance_ids()
        self._picker.keep_only(live)
        forget = getattr(self._cluster, "forget", None)
        if forget is not None:
            forget(live)
        if self._metrics is not None:
            for model_id in set(self._routes) | set(self._models):
                if model_id not in update.models:
                    self._metrics.forget_model(model_id)
            for model_id in update.models:
                self._metrics.set_instances(model_id, len(update.routes.get(model_id, ())))
        self._routes, self._models, self._models_loaded = update.routes, dict(update.models), True
        self._unknown.discard(update.models)  # deployed after a miss: no longer unknown
        for model_id in list(self._queues):
            if model_id not in update.models:  # deleted while requests waited for it
                self._drop_model(model_id)
            else:
                self._dispatch(model_id)

    def _drop_model(self, model_id: str) -> None:
        """Forgets a deleted model and fails the requests waiting for it with `ModelNotFound`."""
        self._models.pop(model_id, None)
        self._reported.pop(model_id, None)
        self._outlooks.forget(model_id)
        for ticket in self._queues.pop(model_id, ()):
            if not ticket.future.done():
                ticket.future.set_exception(ModelNotFound(model_id))

    async def _report_demand(self) -> None:
        """Tells the controller each queue's length and its oldest request's wait when the length
        changed, and again every ``demand_report_interval_s`` while it is not empty; keeps the
        outlook each answer brings until the queue is empty."""
        now = self._clock()
        for model_id in set(self._queues) | set(self._reported):
            queue = self._queues.get(model_id)
            enqueued = [ticket.enqueued_s for ticket in queue or () if not ticket.future.done()]
            num_queued = len(enqueued)
            last = self._reported.get(model_id)
            if last is None and num_queued == 0:
                continue  # nothing waited, nothing to take back
            if last is not None and last[0] == num_queued and now - last[1] < self._config.demand_report_interval_s:
                continue
            oldest_wait_s = max(0.0, now - min(enqueued)) if enqueued else 0.0
            newest_wait_s = min(oldest_wait_s, max(0.0, now - max(enqueued))) if enqueued else 0.0
            try:
                outlook = await self._cluster.notify_demand(model_id, num_queued, oldest_wait_s=oldest_wait_s,
                                                            newest_wait_s=newest_wait_s)
            except LookupError:  # deleted: the controller knows it no longer
                self._drop_model(model_id)
                continue
            if num_queued == 0:
                self._reported.pop(model_id, None)
                self._outlooks.forget(model_id)
            else:
                self._reported[model_id] = (num_queued, now)
                self._outlooks.update(model_id, outlook)
