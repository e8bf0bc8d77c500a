"""The admin API served over real HTTP for its tests (`test_admin_tenants_and_keys`,
`test_admin_deploys`, `test_admin_operations`).

`serve_admin_api` runs uvicorn serving the gateway app with the admin router mounted, over a real
SQLite state store (tenants, hashed keys, the admin key) and `FakeController`, an in-memory
controller that raises the real controller's errors; `Server` is the client side: `AdminClient`
(aiohttp) and the ``thaw`` console script as a subprocess. The same routes over the real
controller on Ray are in test_platform_e2e.py. `test_gateway_fuzz` uses `FakeController` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from controller import (InvalidMigrationError, InvalidSpecError, MigrationConflictError, ModelAlreadyDeployedError,
                        ModelSpec, SpecError, TenantQuota, UnknownInstanceError, UnknownModelError, UnknownTenantError,
                        open_state_store)
from controller import DeployConflictError, UnknownDeployError
from controller.deploy_jobs import deploy_error_message
from controller.upload_area import UploadArea
from wire import DeployProgress, MigrationOutcome, MigrationReport
from infra.admin_api import build_admin_router
from infra.admin_client import AdminClient
from infra.admin_key import AdminKeyAuth, ensure_admin_key
from infra.controller_client import ControllerUnavailable
from infra.gateway_app import build_gateway_app
from infra.gateway_backend import ModelCard, ModelNotFound

THAW = str(Path(sys.executable).parent / "thaw")
DEADLINE_S = 20.0
STATUS = {
    "namespace": "thaw", "platform_id": "thaw", "num_ticks": 7, "last_tick_errors": [], "routing_version": 3,
    "models": [{"model_id": "acme/m", "num_desired_instances": 1, "num_ready_instances": 1,
                "num_loading_instances": 0, "num_ongoing_requests": 2, "num_queued_requests": 0,
                "scale_reason": "demand 2 / target 2", "placement_reason": "dram on node0"}],
    "instances": [{"instance_id": "i-1", "model_id": "acme/m", "node_id": "node0", "ray_node_id": "r0",
                   "actor_name": "thaw-worker-i-1", "state": "ready", "tier": "dram", "estimate_s": 0.12,
                   "load_s": 0.2, "num_ongoing_requests": 2, "num_generated_tokens": 10, "last_error": None}],
    "nodes": [{"node_id": "node0", "ray_node_id": "r0", "num_slots": 2, "num_free_slots": 1, "draining": False,
               "store_connected": True, "report_error": None, "reported_at": 0.0, "num_fetches": 1,
               "tiers": [{"tier": "dram", "capacity_bytes": 8_000_000_000, "used_bytes": 1_200_000,
                          "entries": [{"model": "acme--m", "num_bytes": 1_200_000, "last_used_s": 0.0,
                                       "pinned": True, "num_loading": 0, "filling": False}]},
                         {"tier": "ssd", "capacity_bytes": 64_000_000_000, "used_bytes": 1_200_000,
                          "entries": [{"model": "acme--m", "num_bytes": 1_200_000, "last_used_s": 0.0,
                                       "pinned": False, "num_loading": 0, "filling": False}]}],
               "measured_bandwidth": None, "effective_bandwidth": {},
               "placement_bytes_per_s": {"dram_bytes_per_s": 8e9, "ssd_bytes_per_s": 1e9,
                                         "repository_bytes_per_s": 2e8}}],
    "recent_decisions": [{"kind": "placement", "model_id": "acme/m", "instance_id": "i-1", "node_id": "node0",
                          "tier": "dram", "estimate_s": 0.12, "reason": "fastest", "at_s": 0.0,
                          "estimates": [{"node_id": "node0", "tier": "dram", "load_s": 0.12, "wait_s": 0.0,
                                         "ready_s": 0.12, "num_free_slots": 1, "has_room": True}]}],
}


class FakeController:
    """The controller's API in memory, refusing with the controller's own errors; a quota is
    saved in the state store as the real one saves it."""

    def __init__(self, store, upload_root: Path) -> None:
        self.store = store
        self.quotas: dict[str, TenantQuota] = {}
        self.specs: dict[str, dict[str, Any]] = {}
        self.drained: list[str] = []
        self.migrations: list[tuple] = []
        self.unavailable = False
        self.refusals: dict[str, Exception] = {}  # source -> what the real controller raises for it
        self.scripted: dict[str, list[tuple[str, int, int]]] = {}  # source -> a job's running steps
        self.deploys: dict[str, list[DeployProgress]] = {}  # deploy id -> its steps still to show
        self.waits: list[tuple[str, float]] = []
        self.uploads = UploadArea(upload_root)
        self.pieces: list[tuple[str, int, int]] = []

    def _check(self) -> None:
        if self.unavailable:
            raise ControllerUnavailable("the controller did not answer: RayActorError")

    def _model(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.specs:
            raise UnknownModelError(model_id)
        return self.specs[model_id]

    def _deploy_now(self, spec: dict[str, Any], update: bool) -> dict[str, Any]:
        model_id = f"{spec['tenant']}/{spec['name']}"
        if update:
            self._model(model_id)
        elif model_id in self.specs and self.specs[model_id] != spec:
            raise ModelAlreadyDeployedError(model_id)
        self.specs[model_id] = copy.deepcopy(spec)
        return spec

    async def start_deploy(self, spec: dict[str, Any], update: bool = False) -> DeployProgress:
        """As the controller: a conflict is refused at once, a bad source fails the job; a source in
        `scripted` runs through those (stage, done, total) records, one per long poll."""
        self._check()
        model_id = f"{spec['tenant']}/{spec['name']}"
        refusal = self.refusals.get(spec["source"])
        if isinstance(refusal, (DeployConflictError, UnknownModelError)):
            raise refusal
        if update:
            self._model(model_id)
        elif model_id in self.specs and self.specs[model_id] != spec:
            raise ModelAlreadyDeployedError(model_id)
        deploy_id = f"d-{len(self.deploys) + 1}"
        action = "update" if update else "deploy"
        steps = [DeployProgress(deploy_id, model_id, action, "running", stage, done, total, started_s=1.0)
                 for stage, done, total in self.scripted.get(spec["source"], [("checking", 0, 0)])]
        if refusal is not None:
            message, field, kind = deploy_error_message(refusal)
            steps.append(DeployProgress(deploy_id, model_id, action, "failed", steps[-1].stage, started_s=1.0,
                                        finished_s=2.0, error=message, error_field=field, error_kind=kind))
        else:
            steps.append(DeployProgress(deploy_id, model_id, action, "succeeded", "done", started_s=1.0,
                                        finished_s=2.0, spec=self._deploy_now(spec, update)))
        self.deploys[deploy_id] = steps
        return steps[0]

    async def deploy_progress(self, deploy_id: str) -> DeployProgress:
        self._check()
        if deploy_id not in self.deploys:
            raise UnknownDeployError(deploy_id)
        return self.deploys[deploy_id][0]

    async def wait_deploy(self, deploy_id: str, timeout_s: float) -> DeployProgress:
        """The job's next step (each long poll moves it one on)."""
        await self.deploy_progress(deploy_id)
        self.waits.append((deploy_id, timeout_s))
        steps = self.deploys[deploy_id]
        if len(steps) > 1:
            steps.pop(0)
        return steps[0]

    async def recent_deploys(self) -> list[DeployProgress]:
        self._check()
        return [steps[0] for steps in self.deploys.values()]

    # Uploads: the controller's own UploadArea, in the state directory (as the real one keeps them).

    async def create_upload(self) -> str:
        self._check()
        return self.uploads.create()

    async def upload_piece(self, upload_id: str, path: str, offset: int, data: bytes) -> int:
        self._check()
        self.pieces.append((path, offset, len(data)))
        return self.uploads.write(upload_id, path, offset, data)

    async def upload_status(self, upload_id: str) -> dict[str, Any]:
        self._check()
        return self.uploads.status(upload_id)

    async def seal_upload(self, upload_id: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
        self._check()
        return self.uploads.seal(upload_id, files)

    async def delete_upload(self, upload_id: str) -> None:
        self._check()
        self.uploads.delete(upload_id)

    async def delete(self, model_id: str) -> None:
        self._check()
        self._model(model_id)
        del self.specs[model_id]

    async def list_models(self, tenant: str | None = None) -> list[dict[str, Any]]:
        self._check()
        return [s for m, s in sorted(self.specs.items()) if tenant is None or s["tenant"] == tenant]

    async def get_model(self, model_id: str) -> dict[str, Any]:
        self._check()
        return {"model_id": model_id, "spec": self._model(model_id), "instances": []}

    async def scale(self, model_id: str, min_instances: int | None = None,
                    max_instances: int | None = None) -> dict[str, Any]:
        self._check()
        spec = copy.deepcopy(self._model(model_id))
        for key, value in (("min_instances", min_instances), ("max_instances", max_instances)):
            if value is not None:
                spec["autoscaling"][key] = value
        try:
            ModelSpec.from_dict(spec)
        except SpecError as exc:
            raise InvalidSpecError(exc.field, exc.reason) from None
        self.specs[model_id] = spec
        return spec

    async def status(self) -> dict[str, Any]:
        self._check()
        return STATUS

    async def set_tenant_quota(self, tenant: str, quota: dict[str, Any]) -> dict[str, Any]:
        self._check()
        try:
            updated = self.quotas.get(tenant, TenantQuota()).updated(quota)
        except SpecError as exc:
            raise InvalidSpecError(exc.field, exc.reason) from None
        if tenant not in self.store.list_tenants():
            raise UnknownTenantError(tenant)
        self.store.set_tenant_quota(tenant, updated)
        self.quotas[tenant] = updated
        if updated.unlimited:
            del self.quotas[tenant]
        return updated.to_dict()

    async def tenant_quotas(self) -> dict[str, dict[str, Any]]:
        self._check()
        return {tenant: quota.to_dict() for tenant, quota in sorted(self.quotas.items())}

    async def drain_node(self, node_id: str) -> dict[str, Any]:
        self._check()
        if node_id != "node0":
            raise LookupError(f"no node {node_id!r}; nodes: ['node0']")
        self.drained.append(node_id)
        return {"node_id": node_id, "stopping": ["i-1"]}

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        self._check()
        if node_id != "node0":
            raise LookupError(f"no node {node_id!r}; nodes: ['node0']")
        self.drained.remove(node_id)
        return {"node_id": node_id, "draining": False}

    async def migrate(self, instance_id: str, request_id: str | None = None, *, to_node: str | None = None,
                      to_instance: str | None = None, method: str = "kv") -> dict[str, Any]:
        """As the controller answers: i-1 has requests r1 and r2 and one peer, i-2, on node1."""
        self._check()
        self.migrations.append((instance_id, request_id, to_node, to_instance, method))
        if method not in ("kv", "tokens"):
            raise InvalidMigrationError("method", f"must be one of kv, tokens, got {method!r}")
        if instance_id != "i-1":
            raise UnknownInstanceError(instance_id)
        if to_node not in (None, "node1") or to_instance not in (None, "i-2"):
            raise MigrationConflictError("cannot migrate off instance i-1: no ready instance there")
        outcomes = tuple(MigrationOutcome(r, method, "migrated", "i-1", "i-2", num_rounds=1, num_tokens_at_stop=40,
                                          num_tokens_after_stop=0, num_blocks_copied=3, num_bytes_copied=3 << 12,
                                          stop_s=0.002, total_s=0.05)
                         for r in ([request_id] if request_id else ["r1", "r2"]))
        return MigrationReport("i-1", "i-2", "node1", method, outcomes)


class CardsBackend:
    """A gateway backend that only lists the fake controller's models (no generation here)."""

    def __init__(self, controller: FakeController) -> None:
        self._controller = controller

    async def list_models(self, tenant: str | None) -> list[ModelCard]:
        return [ModelCard(model_id=m, owned_by=m.split("/")[0], created_s=0) for m in sorted(self._controller.specs)
                if tenant is None or m.split("/")[0] == tenant]

    async def describe_model(self, model_id: str) -> ModelCard:
        if model_id not in self._controller.specs:
            raise ModelNotFound(model_id)
        return ModelCard(model_id=model_id, owned_by=model_id.split("/")[0], created_s=0)

    def generate(self, *args: Any):
        raise NotImplementedError

    async def abort(self, model_id: str, request_id: str) -> None:
        pass

    async def is_ready(self) -> bool:
        return True


class Server:
    def __init__(self, url: str, admin_key: str, store, controller: FakeController, state_dir: Path) -> None:
        self.url, self.admin_key, self.store, self.controller, self.state_dir = url, admin_key, store, controller, state_dir

    def call(self, action, key: str | None = "admin"):
        async def main():
            async with AdminClient(self.url, self.admin_key if key == "admin" else key, timeout_s=DEADLINE_S) as c:
                return await action(c)

        return asyncio.run(main())

    def thaw(self, *args: str, key: str | None = "admin") -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("THAW_URL", "THAW_ADMIN_KEY", "THAW_STATE_DIR")}
        flags = ["--url", self.url, "--state", str(self.state_dir)]
        if key is not None:
            flags += ["--admin-key", self.admin_key if key == "admin" else key]
        command, *rest = args
        sub = [command] if command not in ("tenants", "keys") else [command, rest.pop(0)]
        return subprocess.run([THAW, *sub, *rest, *flags], capture_output=True, text=True, timeout=60, env=env)


@contextlib.contextmanager
def serve_admin_api(state_dir: Path) -> Iterator[Server]:
    """The gateway app and the admin router over a state store in `state_dir` and a `FakeController`,
    served by uvicorn on a free port until the block ends (each test file's ``server`` fixture)."""
    store = open_state_store(str(state_dir) + "/")
    admin_key = ensure_admin_key(store, state_dir / "admin_key")
    controller = FakeController(store, state_dir / "uploads")
    auth = AdminKeyAuth(verify_api_key=store.verify_api_key)
    app = build_gateway_app(CardsBackend(controller), auth)
    app.include_router(build_admin_router(controller, store, auth))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                break
        except OSError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
    try:
        yield Server(url, admin_key, store, controller, state_dir)
    finally:
        uv.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
        store.close()


def spec(model_id: str, **autoscaling: Any) -> dict[str, Any]:
    tenant, name = model_id.split("/")
    return ModelSpec.from_dict({"tenant": tenant, "name": name, "source": "/models/demo",
                                "autoscaling": autoscaling}).to_dict()
