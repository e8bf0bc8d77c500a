"""The gateway as a Ray Serve application: `GatewayReplica` and `gateway_application`.

Ray Serve runs the HTTP proxy (on every node, on the configured port) and the replicas; each
replica serves the gateway's FastAPI app (`build_gateway_app`, with the admin router mounted)
over its own `RayGatewayBackend`. The app is built *inside* the replica, after its constructor
has found the controller actor by name and opened the state store: Serve's late-bound ingress
(`serve.ingress()` with no app, and a ``__serve_build_asgi_app__`` method that returns it) calls
the method once the constructor is done. A FastAPI app built on the driver would instead be
pickled into the deployment, with a backend that holds no connection yet and metrics whose
locks do not pickle.

A replica takes no CPU (``num_cpus=0``): on a CPU-only node the CPUs are the model instances'
worker slots, and the gateway only relays tokens. Serve's default ``max_ongoing_requests``
(5 per replica) would queue streams in the proxy; the gateway has its own per-model queue with
a bound and a deadline, so the replica's limit is set high instead, and the replica enforces
it itself: past it a request gets 503 in OpenAI's shape with ``Retry-After``
(`infra.gateway_admission`; Serve is given some headroom above it, since Serve's own refusal is
plain text). Past Serve's limit, requests wait in each proxy's queue, which is bounded too
(``max_queued_requests``; Serve's default is no bound): beyond it the proxy answers 503 with
``Retry-After`` at once, rather than piling up connections the gateway will never get to. Requests that hold a slot without making progress
are cut short by the app itself: a body not complete within ``body_timeout_s`` gets 408, and
an anonymous request is refused before its body is read.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig

from infra.gateway_admission import serve_max_ongoing_requests
from infra.gateway_body_limit import DEFAULT_BODY_TIMEOUT_S
from infra.metrics_token import MetricsToken
from infra.ray_backend_config import RayBackendConfig


@dataclass(frozen=True, kw_only=True)
class GatewayDeploymentConfig:
    """One platform's gateway.

    Fields:
        namespace: Ray namespace of the platform's controller.
        controller_name: the controller actor's name in that namespace.
        state_store: where API keys are verified and tenants kept (the platform's store).
        auth: False is ``--no-auth``: no keys, every caller is admin.
        num_replicas: gateway replicas; each keeps its own routing-table cache and queue.
        max_ongoing_requests: requests one replica serves at once (streams included; health and
            admin routes not counted); past them it answers 503 in OpenAI's shape.
        max_queued_requests: requests each Serve proxy holds waiting for a replica slot (past
            Serve's limit, `serve_max_ongoing_requests`); beyond it the proxy answers 503 with
            Retry-After `retry_after_s` at once.
        retry_after_s: the Retry-After of both 503s.
        body_timeout_s: a request body not complete this long after the request arrived gets 408.
        http_port: the port clients reach the gateway on; with auth off, a request's ``Host``
            must name a loopback address at this port (None: any port).
        metrics_token_sha256: the hex SHA-256 of the metrics scrape token that may read
            ``/metrics`` besides the admin key (`infra.metrics_token`); None: the admin key only.
        controller_wait_s: how long a starting replica waits for the controller actor to exist.
        replica_resources: Ray custom resources each replica asks for (none: any node).
        backend: the routing and queueing settings.
    """

    namespace: str
    controller_name: str
    state_store: str
    auth: bool = True
    num_replicas: int = 1
    max_ongoing_requests: int = 4096
    max_queued_requests: int = 1024
    retry_after_s: float = 1.0
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    http_port: int | None = None
    metrics_token_sha256: str | None = None
    controller_wait_s: float = 60.0
    replica_resources: Mapping[str, float] = field(default_factory=dict)
    backend: RayBackendConfig = field(default_factory=RayBackendConfig)

    def __post_init__(self) -> None:
        for name in ("namespace", "controller_name", "state_store"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"GatewayDeploymentConfig.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.auth, bool):
            raise ValueError("GatewayDeploymentConfig.auth must be True or False")
        for name in ("num_replicas", "max_ongoing_requests", "max_queued_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GatewayDeploymentConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("retry_after_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"GatewayDeploymentConfig.{name} must be a finite number of seconds > 0, "
                                 f"got {value!r}")
        if self.http_port is not None and (isinstance(self.http_port, bool) or not isinstance(self.http_port, int)
                                           or not 0 < self.http_port < 65536):
            raise ValueError(f"GatewayDeploymentConfig.http_port must be None or a port in 1..65535, "
                             f"got {self.http_port!r}")
        if self.metrics_token_sha256 is not None:
            MetricsToken(self.metrics_token_sha256)  # validates the digest's form
            if not self.auth:
                raise ValueError("GatewayDeploymentConfig.metrics_token_sha256 needs auth: without keys, /metrics "
                                 "is open to loopback callers anyway")
        if not isinstance(self.controller_wait_s, (int, float)) or not self.controller_wait_s > 0:
            raise ValueError(f"GatewayDeploymentConfig.controller_wait_s must be > 0, got {self.controller_wait_s!r}")
        if not isinstance(self.replica_resources, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in self.replica_resources.items()):
            raise ValueError(f"GatewayDeploymentConfig.replica_resources must map resource names to amounts > 0, "
                             f"got {self.replica_resources!r}")
        object.__setattr__(self, "replica_resources", dict(self.replica_resources))
        if not isinstance(self.backend, RayBackendConfig):
            raise ValueError("GatewayDeploymentConfig.backend must be a RayBackendConfig")


async def find_controller(name: str, namespace: str, wait_s: float) -> Any:
    """The controller actor's handle, waiting up to `wait_s` for it to be registered (a replica
    may start before the controller has). Raises `RuntimeError` naming what it looked for."""
    import ray

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
        except ValueError:
            if loop.time() >= deadline:
                raise RuntimeError(f"no controller actor {name!r} in namespace {namespace!r} after {wait_s:g} s; "
                                   "start the platform with `thaw serve`") from None
            await asyncio.sleep(0.2)  # a retry interval while the controller registers, not a synchronisation


@serve.ingress()
class GatewayReplica:
    """One gateway replica (see the module docstring)."""

    async def __init__(self, config: GatewayDeploymentConfig) -> None:
        import ray

        from controller import NODE_ID_PREFIX_CHARS, open_state_store
        from infra.controller_client import ControllerClient
        from infra.gateway_metrics import GatewayMetrics, ReplicaIdentity
        from infra.ray_gateway_backend import RayGatewayBackend
        from infra.serving_cluster import RayServingCluster

        self._config = config
        handle = await find_controller(config.controller_name, config.namespace, config.controller_wait_s)
        replica_id = serve.get_replica_context().replica_id.unique_id
        reporter = f"gateway-{replica_id}-{os.getpid()}"
        self._controller = ControllerClient(
            handle, reporter=reporter,
            resolve=lambda: find_controller(config.controller_name, config.namespace, wait_s=1.0))
        self._store = await asyncio.to_thread(open_state_store, config.state_store)
        # Labels this replica's per-request series among its peers' on every replica's /metrics.
        node_id = ray.get_runtime_context().get_node_id()[:NODE_ID_PREFIX_CHARS]
        self._metrics = GatewayMetrics(replica=ReplicaIdentity(replica_id=replica_id, node_id=node_id))
        self._backend = RayGatewayBackend(RayServingCluster(self._controller), config.backend, self._metrics)
        await self._backend.start()

    def __serve_build_asgi_app__(self) -> Any:
        from infra.admin_api import build_admin_router
        from infra.admin_key import AdminKeyAuth
        from infra.gateway_app import build_gateway_app
        from infra.gateway_auth import GatewayAuth

        config = self._config
        if config.auth:
            token = MetricsToken(config.metrics_token_sha256) if config.metrics_token_sha256 is not None else None
            auth: GatewayAuth = AdminKeyAuth(verify_api_key=self._store.verify_api_key, metrics_token=token)
        else:
            auth = GatewayAuth.no_auth()
        app = build_gateway_app(self._backend, auth, self._metrics, body_timeout_s=config.body_timeout_s,
                                http_port=config.http_port, max_ongoing_requests=config.max_ongoing_requests,
                                retry_after_s=config.retry_after_s)
        app.include_router(build_admin_router(self._controller, self._store, auth))
        return app

    async def __del__(self) -> None:
        try:
            await self._backend.close()
        finally:
            self._store.close()


def gateway_deployment(config: GatewayDeploymentConfig) -> serve.Deployment:
    """The gateway's Serve deployment with `config`'s limits (not yet bound to it)."""
    return serve.deployment(
        GatewayReplica, name="gateway", num_replicas=config.num_replicas,
        max_ongoing_requests=serve_max_ongoing_requests(config.max_ongoing_requests),
        max_queued_requests=config.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=config.retry_after_s),
        ray_actor_options={"num_cpus": 0, **({"resources": dict(config.replica_resources)}
                                             if config.replica_resources else {})},
        # The proxy's health check must not wait on the controller; the app's own /readyz does.
        health_check_period_s=10, graceful_shutdown_timeout_s=5,
    )


def gateway_application(config: GatewayDeploymentConfig) -> serve.Application:
    """The gateway deployment, bound to `config`, ready for ``serve.run``."""
    return gateway_deployment(config).bind(config)
