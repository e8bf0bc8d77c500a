"""The admin API, its client and the ``thaw`` admin commands, over real HTTP.

uvicorn serves the gateway app with the admin router mounted, over a real SQLite state store
(tenants, hashed keys, the admin key) and an in-memory controller that raises the real
controller's errors; the client side is `AdminClient` (aiohttp) and the ``thaw`` console script
as a subprocess. The same routes over the real controller on Ray are in test_platform_e2e.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn

from controller import (InvalidMigrationError, InvalidSpecError, MigrationConflictError, ModelAlreadyDeployedError,
                        ModelSpec, SpecError, TenantQuota, UnknownInstanceError, UnknownModelError, UnknownTenantError,
                        open_state_store)
from controller import DeployConflictError, UnknownDeployError
from controller.deploy_jobs import deploy_error_message
from controller.upload_area import UploadArea
from infra.source_upload import PIECE_BYTES, ResumeRecords, _listing_key
from wire import DeployProgress
from infra.admin_api import build_admin_router
from infra.admin_client import AdminApiError, AdminClient, resolve_endpoint
from infra.admin_key import ADMIN_TENANT, AdminKeyAuth, ensure_admin_key, read_key_file, reset_admin_key
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
        outcome = {"status": "migrated", "method": method, "stop_s": 0.002, "total_s": 0.05, "error": None,
                   "num_blocks_copied": 3, "num_tokens_at_stop": 40}
        return {"source": "i-1", "destination": "i-2", "node_id": "node1", "method": method,
                "outcomes": [{"request_id": r, **outcome} for r in ([request_id] if request_id else ["r1", "r2"])]}


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


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    state_dir = tmp_path_factory.mktemp("admin-state")
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


def test_the_admin_key_is_made_once_stored_hashed_and_can_be_reset(tmp_path):
    with open_state_store(str(tmp_path) + "/") as store:
        key = ensure_admin_key(store, tmp_path / "admin_key")
        assert key.startswith("thaw_") and ensure_admin_key(store, tmp_path / "admin_key") is None
        assert read_key_file(tmp_path / "admin_key") == key
        assert stat.S_IMODE((tmp_path / "admin_key").stat().st_mode) == 0o600
        records = store.list_api_keys(ADMIN_TENANT)
        assert len(records) == 1 and key.split("_", 2)[2] not in repr(records[0].to_dict())  # only a hash is kept
        assert store.verify_api_key(key) == ADMIN_TENANT
        new = reset_admin_key(store, tmp_path / "admin_key")
        assert new != key and store.verify_api_key(key) is None and store.verify_api_key(new) == ADMIN_TENANT
        assert read_key_file(tmp_path / "admin_key") == new


def test_an_admin_key_kept_elsewhere_is_imported_on_every_start_and_copied_for_the_cli(tmp_path):
    from controller import new_api_key
    from infra.admin_key import import_admin_key

    secret_file = tmp_path / "secret" / "admin-key"  # a mounted Kubernetes Secret, say
    secret_file.parent.mkdir()
    key = new_api_key()
    secret_file.write_text(key + "\n")
    with open_state_store(str(tmp_path) + "/") as store:
        assert import_admin_key(store, secret_file, tmp_path / "state" / "admin_key") is True
        assert store.verify_api_key(key) == ADMIN_TENANT and read_key_file(tmp_path / "state" / "admin_key") == key
        assert ensure_admin_key(store, tmp_path / "state" / "admin_key") is None  # the platform has its admin key
        (tmp_path / "state" / "admin_key").unlink()  # a new pod: the state directory is empty again
        assert import_admin_key(store, secret_file, tmp_path / "state" / "admin_key") is False
        assert read_key_file(tmp_path / "state" / "admin_key") == key
        tenant_key = (store.add_tenant("acme"), store.create_api_key("acme"))[1]
        secret_file.write_text(tenant_key)
        with pytest.raises(ValueError, match=f"{secret_file}: the key's id .* is taken"):
            import_admin_key(store, secret_file, None)
        secret_file.write_text("")
        with pytest.raises(ValueError, match="is empty or missing: put an admin key in it"):
            import_admin_key(store, secret_file, None)


def test_endpoint_resolution_order(tmp_path):
    (tmp_path / "gateway_url").write_text("http://10.0.0.1:9000\n")
    (tmp_path / "admin_key").write_text("from-file\n")
    assert resolve_endpoint(None, None, tmp_path, {}) == ("http://10.0.0.1:9000", "from-file")
    env = {"THAW_URL": "http://env:1/", "THAW_ADMIN_KEY": "from-env"}
    assert resolve_endpoint(None, None, tmp_path, env) == ("http://env:1", "from-env")
    assert resolve_endpoint("http://flag:2", "from-flag", tmp_path, env) == ("http://flag:2", "from-flag")
    assert resolve_endpoint(None, None, tmp_path / "none", {}) == ("http://127.0.0.1:8000", None)


def test_admin_routes_need_the_admin_key(server):
    for key, status in ((None, 401), ("thaw_0123456789abcdef_" + "x" * 43, 401)):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.list_models(), key=key)
        assert info.value.status == status
    server.store.add_tenant("outsider")
    tenant_key = server.store.create_api_key("outsider")
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.status(), key=tenant_key)
    assert info.value.status == 403 and "admin key" in info.value.message
    assert server.call(lambda c: c.status())["routing_version"] == 3


def test_models_deploy_get_update_scale_delete(server):
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy({"tenant": "acme", "name": "bad", "source": "/m", "autoscaling": {"max_instances": 0}}))
    assert info.value.status == 400 and info.value.param == "autoscaling.max_instances"
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy(spec(f"{ADMIN_TENANT}/m")))
    assert info.value.status == 400 and "reserved" in info.value.message
    deployed = server.call(lambda c: c.deploy(spec("acme/m")))
    assert deployed["name"] == "m" and "acme" in server.store.list_tenants()  # the tenant came with the model
    assert server.call(lambda c: c.deploy(spec("acme/m"))) == deployed  # the same spec again: fine
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.deploy(spec("acme/m", max_instances=3)))
    assert info.value.status == 409 and "update" in info.value.message
    updated = server.call(lambda c: c.update(spec("acme/m", max_instances=3)))
    assert updated["autoscaling"]["max_instances"] == 3
    assert server.call(lambda c: c.get_model("acme/m"))["spec"]["autoscaling"]["max_instances"] == 3
    scaled = server.call(lambda c: c.scale("acme/m", 0, 2))
    assert (scaled["autoscaling"]["min_instances"], scaled["autoscaling"]["max_instances"]) == (0, 2)
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.scale("acme/m", 3, None))
    assert info.value.status == 400 and info.value.param == "autoscaling.max_instances"
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.get_model("acme/missing"))
    assert info.value.status == 404 and "acme/missing" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.get_model("Acme/m"))
    assert info.value.status == 400 and info.value.param == "tenant"
    assert [s["name"] for s in server.call(lambda c: c.list_models("acme"))] == ["m"]
    assert server.call(lambda c: c.delete("acme/m")) == {"deleted": "acme/m"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete("acme/m"))
    assert info.value.status == 404


def test_an_unsafe_source_is_400_on_source_and_a_lost_deploy_race_is_409(server):
    # What the controller raises for a source dir with a symlink out of it, and for the loser of
    # two racing deploys of one name (tests/controller/test_controller.py shows it does).
    unsafe = InvalidSpecError("source", "/models/unsafe: 'model.safetensors' is a symlink to /other/model.safetensors, "
                                        "outside the directory; copy the real files into the directory")
    raced = DeployConflictError("acme/raced", "another deploy or update of it is in progress; wait for it to "
                                              "finish (thaw list shows the result), then try again")
    server.controller.refusals = {"/models/unsafe": unsafe, "/models/raced": raced}
    try:
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy({**spec("acme/unsafe"), "source": "/models/unsafe"}))
        assert (info.value.status, info.value.param, info.value.message) == (400, "source", str(unsafe))
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy({**spec("acme/raced"), "source": "/models/raced"}))
        assert (info.value.status, info.value.message) == (409, str(raced))
        result = server.thaw("deploy", "--name", "acme/unsafe", "--source", "/models/unsafe")
        assert result.returncode == 2 and "is a symlink to /other/model.safetensors" in result.stderr
        result = server.thaw("deploy", "--name", "acme/raced", "--source", "/models/raced")
        assert result.returncode == 1 and "another deploy or update of it is in progress" in result.stderr
    finally:
        server.controller.refusals = {}
    assert "acme/unsafe" not in server.controller.specs and "acme/raced" not in server.controller.specs


def test_a_deploy_job_answers_at_once_and_the_cli_follows_it_to_the_end(server):
    big = [("checking", 0, 0), ("converting", 0, 4_000_000), ("converting", 2_000_000, 4_000_000),
           ("uploading", 1_000_000, 8_000_000), ("uploading", 8_000_000, 8_000_000), ("registering", 0, 0)]
    server.controller.scripted = {"/models/big": big}
    try:
        started = server.call(lambda c: c.start_deploy({**spec("acme/big"), "source": "/models/big"}))
        assert (started.state.value, started.stage.value, started.model_id) == ("running", "checking", "acme/big")
        assert server.call(lambda c: c.deploy_status(started.deploy_id)) == started  # no wait: as it is
        step = server.call(lambda c: c.deploy_status(started.deploy_id, wait_s=2.5))
        assert (step.stage.value, step.num_bytes_total) == ("converting", 4_000_000)
        assert server.controller.waits[-1] == (started.deploy_id, 2.5)
        assert [r.deploy_id for r in server.call(lambda c: c.list_deploys())][-1] == started.deploy_id
        for wait_s, param in (("31", "wait_s"), ("-1", "wait_s"), ("nan", "wait_s")):
            with pytest.raises(AdminApiError) as info:
                server.call(lambda c: c._request("GET", f"/admin/deploys/{started.deploy_id}", params={"wait_s": wait_s}))
            assert (info.value.status, info.value.param) == (400, param), wait_s
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.deploy_status("d-none"))
        assert info.value.status == 404 and "no deploy 'd-none'" in info.value.message

        # The CLI: starts the job, draws each stage's bar from the long polls, waits for the end.
        result = server.thaw("deploy", "--name", "acme/big2", "--source", "/models/big")
        assert result.returncode == 0, result.stderr
        assert "deploying acme/big2 (d-" in result.stderr and "acme/big2 deployed in" in result.stderr
        assert "converting" in result.stderr and "uploading" in result.stderr and "registering ..." in result.stderr
        assert "7.63M/7.63M" in result.stderr  # the upload's bar, in tqdm's units (MiB), ran to its end
        assert "acme/big2" in server.controller.specs

        result = server.thaw("deploy", "--name", "acme/big3", "--source", "/models/big", "--no-wait")
        assert result.returncode == 0 and "started as d-" in result.stderr and "thaw deploys d-" in result.stderr
        deploy_id = result.stderr.split("started as ")[1].split(";")[0]
        listing = server.thaw("deploys")
        assert listing.returncode == 0 and deploy_id in listing.stdout and "acme/big3" in listing.stdout
        one = server.thaw("deploys", deploy_id, "--wait", "--json")
        assert one.returncode == 0 and json.loads(one.stdout)[0]["state"] == "succeeded"
    finally:
        server.controller.scripted = {}


def test_a_failed_deploy_job_exits_with_its_reason(server):
    unsafe = InvalidSpecError("source", "/models/gone is not a directory on the controller's machine")
    server.controller.refusals = {"/models/gone": unsafe}
    try:
        result = server.thaw("deploy", "--name", "acme/gone", "--source", "/models/gone")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().endswith(f"deploy of acme/gone failed: {unsafe}")
        listing = server.thaw("deploys", "--json")
        failed = [d for d in json.loads(listing.stdout) if d["model_id"] == "acme/gone"]
        assert failed and failed[-1]["state"] == "failed" and failed[-1]["error_field"] == "source"
    finally:
        server.controller.refusals = {}
    assert "acme/gone" not in server.controller.specs


def test_deploy_uploads_a_directory_from_this_machine_and_resumes_an_interrupted_upload(server, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * (PIECE_BYTES // 256 * 2 + 7))  # three pieces
    (src / ".cache").mkdir()
    (src / ".cache" / "lock").write_text("not sent")  # hidden: not part of the model
    result = server.thaw("deploy", "--name", "acme/up", "--source", str(src), "--upload")
    assert result.returncode == 0, result.stderr
    assert "sending 2 files to the platform" in result.stderr and "acme/up deployed in" in result.stderr
    source = server.controller.specs["acme/up"]["source"]
    upload_id = source.removeprefix("upload:")
    status = server.call(lambda c: c.upload_status(upload_id))
    assert status["sealed"] and status["files"] == {"config.json": (src / "config.json").stat().st_size,
                                                    "model.safetensors": (src / "model.safetensors").stat().st_size}
    assert (server.state_dir / "uploads" / upload_id / "model.safetensors").read_bytes() == (
        src / "model.safetensors").read_bytes()
    assert ResumeRecords(server.state_dir).get(src, server.url, _listing_key([])) is None  # forgotten once deployed

    # An upload cut short: one piece of the weights arrived; the CLI's record of it remains.
    from loader import model_dir_files

    records = ResumeRecords(server.state_dir)
    partial = server.call(lambda c: c.create_upload())
    first = (src / "model.safetensors").read_bytes()[:PIECE_BYTES]
    assert server.call(lambda c: c.upload_piece(partial, "model.safetensors", 0, first)) == PIECE_BYTES
    records.put(src, server.url, _listing_key(model_dir_files(src)), partial)
    before = len(server.controller.pieces)
    result = server.thaw("deploy", "--name", "acme/up2", "--source", str(src), "--upload")
    assert result.returncode == 0, result.stderr
    assert f"({partial}, resuming)" in result.stderr
    assert server.controller.specs["acme/up2"]["source"] == f"upload:{partial}"
    sent = server.controller.pieces[before:]
    assert ("model.safetensors", 0, PIECE_BYTES) not in sent  # the arrived piece was not sent again
    assert [(p, o) for p, o, _ in sent if p == "model.safetensors"] == [("model.safetensors", PIECE_BYTES),
                                                                        ("model.safetensors", 2 * PIECE_BYTES)]

    # Over HTTP: a misplaced piece is a 409 naming where to resume; a bad path a 400; an unknown id a 404.
    fresh = server.call(lambda c: c.create_upload())
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_piece(fresh, "config.json", 5, b"x"))
    assert info.value.status == 409 and "send the piece at offset 0, not 5" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_piece(fresh, ".git/config", 0, b"x"))  # (a '..' never leaves the client)
    assert (info.value.status, info.value.param) == (400, "path"), info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.upload_status("f" * 32))
    assert info.value.status == 404 and "upload the directory again" in info.value.message
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.seal_upload(fresh, {"config.json": {"size": 1, "xxh3_64": "0" * 16}}))
    assert (info.value.status, info.value.param) == (400, "files") and "never uploaded" in info.value.message
    assert server.call(lambda c: c.delete_upload(fresh)) == {"deleted": fresh}
    result = server.thaw("deploy", "--name", "acme/up3", "--source", str(tmp_path / "missing"), "--upload")
    assert result.returncode == 2 and "is not a directory on this machine" in result.stderr


def test_migrate_route_validates_and_maps_refusals_to_statuses(server):
    result = server.call(lambda c: c.migrate("i-1", "r1", method="tokens"))
    assert (result["destination"], [o["request_id"] for o in result["outcomes"]]) == ("i-2", ["r1"])
    assert server.controller.migrations[-1] == ("i-1", "r1", None, None, "tokens")
    for kwargs, status, param in ((dict(method="teleport"), 400, "method"),
                                  (dict(to_node="node1", to_instance="i-2"), 400, "to_node"),
                                  (dict(to_node=" "), 400, "to_node"),
                                  (dict(to_node="node7"), 409, None)):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.migrate("i-1", **kwargs))
        assert (info.value.status, info.value.param) == (status, param), kwargs
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.migrate("i-9"))
    assert info.value.status == 404 and "i-9" in info.value.message
    with pytest.raises(AdminApiError) as info:  # a field the API does not know: refused, not ignored
        server.call(lambda c: c._request("POST", "/admin/migrate", {"instance_id": "i-1", "to": "node1"}))
    assert info.value.status == 400


def test_tenants_and_keys(server):
    assert server.call(lambda c: c.create_tenant("beta")) == {"tenant": "beta", "created": True}
    assert server.call(lambda c: c.create_tenant("beta"))["created"] is False
    names = [t["tenant"] for t in server.call(lambda c: c.list_tenants())]
    assert ADMIN_TENANT not in names and "beta" in names
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_tenant(ADMIN_TENANT))
    assert info.value.status == 400
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_tenant("Not Valid"))
    assert info.value.status == 400 and info.value.param == "name" and "lowercase" in info.value.message
    created = server.call(lambda c: c.create_key("beta"))
    key = created["api_key"]
    assert server.store.verify_api_key(key) == "beta" and created["key_id"] in key
    listed = server.call(lambda c: c.list_keys("beta"))
    assert [k["key_id"] for k in listed] == [created["key_id"]] and "api_key" not in listed[0]
    assert all(k["tenant"] != ADMIN_TENANT for k in server.call(lambda c: c.list_keys()))
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.create_key("nobody"))
    assert info.value.status == 404
    # A tenant key sees and calls only its tenant's models; the admin key sees all.
    server.call(lambda c: c.deploy(spec("beta/one")))
    server.call(lambda c: c.deploy(spec("gamma/two")))
    tenant_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in tenant_client.models.list()] == ["beta/one"]
    with pytest.raises(openai.PermissionDeniedError):
        tenant_client.models.retrieve("gamma/two")
    admin_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.admin_key, max_retries=0)
    assert {m.id for m in admin_client.models.list()} >= {"beta/one", "gamma/two"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete_tenant("beta"))
    assert info.value.status == 409 and "beta/one" in info.value.message
    server.call(lambda c: c.delete("beta/one"))
    server.call(lambda c: c.revoke_key(created["key_id"]))
    assert server.store.verify_api_key(key) is None
    with pytest.raises(openai.AuthenticationError):
        tenant_client.models.list()
    assert server.call(lambda c: c.delete_tenant("beta")) == {"deleted": "beta"}
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.delete_tenant("beta"))
    assert info.value.status == 404
    admin_id = server.store.list_api_keys(ADMIN_TENANT)[0].key_id
    with pytest.raises(AdminApiError) as info:  # the admin key cannot be revoked through the API
        server.call(lambda c: c.revoke_key(admin_id))
    assert info.value.status == 404


def test_tenant_quotas_are_set_listed_validated_and_go_with_their_tenant(server):
    server.call(lambda c: c.create_tenant("quota-co"))
    server.call(lambda c: c.create_tenant("free-co"))
    assert server.call(lambda c: c.set_tenant_quota("quota-co", {"max_instances": 2, "max_queued_requests": 50})) == {
        "tenant": "quota-co", "max_instances": 2, "max_queued_requests": 50}
    listed = {t["tenant"]: t for t in server.call(lambda c: c.list_tenants())}
    assert listed["quota-co"] == {"tenant": "quota-co", "max_instances": 2, "max_queued_requests": 50}
    assert listed["free-co"] == {"tenant": "free-co", "max_instances": None, "max_queued_requests": None}
    # A field not named is kept; null lifts one.
    assert server.call(lambda c: c.set_tenant_quota("quota-co", {"max_queued_requests": None})) == {
        "tenant": "quota-co", "max_instances": 2, "max_queued_requests": None}
    assert server.store.get_tenant_quota("quota-co") == TenantQuota(max_instances=2)

    for body, param, message in (
            ({"max_instances": 0}, "max_instances",
             "invalid quota: max_instances: must be an integer >= 1, or null for no limit; got 0"),
            ({"max_queued_requests": "50"}, "max_queued_requests",
             "invalid quota: max_queued_requests: must be an integer >= 1, or null for no limit; got '50'"),
            ({"max_instance": 2}, "max_instance",
             "invalid quota: max_instance: unknown quota field; the fields are max_instances, max_queued_requests"),
            ({}, "max_instances", "give max_instances and/or max_queued_requests (null: no limit)")):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.set_tenant_quota("quota-co", body))
        assert (info.value.status, info.value.param, info.value.message) == (400, param, message), body
    with pytest.raises(AdminApiError) as info:  # not an object at all
        server.call(lambda c: c._request("PUT", "/admin/tenants/quota-co/quota", [2]))
    assert info.value.status == 400
    with pytest.raises(AdminApiError) as info:
        server.call(lambda c: c.set_tenant_quota("nobody", {"max_instances": 1}))
    assert (info.value.status, info.value.message) == (
        404, "tenant 'nobody' does not exist; create it first (thaw tenants create nobody)")
    for tenant, param in ((ADMIN_TENANT, "tenant"), ("Quota-Co", "tenant")):
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.set_tenant_quota(tenant, {"max_instances": 1}))
        assert (info.value.status, info.value.param) == (400, param)
    assert server.store.get_tenant_quota("quota-co") == TenantQuota(max_instances=2)  # refusals changed nothing

    # Deleting the tenant drops its quota from the controller and the store: made again, it has none.
    assert server.call(lambda c: c.delete_tenant("quota-co")) == {"deleted": "quota-co"}
    assert "quota-co" not in server.controller.quotas and server.store.list_tenant_quotas() == {}
    server.call(lambda c: c.create_tenant("quota-co"))
    assert {t["tenant"]: t for t in server.call(lambda c: c.list_tenants())}["quota-co"]["max_instances"] is None


def test_cli_tenant_quota_and_listing(server):
    assert server.thaw("tenants", "create", "cliquota").returncode == 0
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "2", "--max-queued-requests", "50")
    assert (result.returncode, result.stdout) == (0, "tenant cliquota: max_instances=2 max_queued_requests=50\n")
    result = server.thaw("tenants", "ls")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split("  ")[0] == "TENANT" and "MAX INSTANCES" in lines[0] and "MAX QUEUED REQUESTS" in lines[0]
    assert ["cliquota", "2", "50"] in [line.split() for line in lines]
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "none")
    assert (result.returncode, result.stdout) == (
        0, "tenant cliquota: max_instances=unlimited max_queued_requests=50\n")
    assert server.store.get_tenant_quota("cliquota") == TenantQuota(max_queued_requests=50)
    result = server.thaw("tenants", "quota", "cliquota", "--max-queued-requests", "0")  # the server refuses it
    assert result.returncode == 2 and "max_queued_requests: must be an integer >= 1" in result.stderr
    result = server.thaw("tenants", "quota", "cliquota")  # nothing to set: refused before any call
    assert result.returncode == 2 and "--max-instances and/or --max-queued-requests" in result.stderr
    result = server.thaw("tenants", "quota", "cliquota", "--max-instances", "two")
    assert result.returncode == 2 and "expected an integer or 'none'" in result.stderr
    result = server.thaw("tenants", "quota", "nobody-here", "--max-instances", "1")
    assert result.returncode == 1 and "does not exist" in result.stderr
    result = server.thaw("tenants", "ls", "--json")
    assert {"tenant": "cliquota", "max_instances": None, "max_queued_requests": 50} in json.loads(result.stdout)


def test_an_unreachable_controller_is_503_with_retry_after(server):
    server.controller.unavailable = True
    try:
        with pytest.raises(AdminApiError) as info:
            server.call(lambda c: c.status())
        assert info.value.status == 503
        request = urllib.request.Request(f"{server.url}/admin/models",
                                         headers={"Authorization": f"Bearer {server.admin_key}"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=DEADLINE_S)
        assert http.value.code == 503 and http.value.headers["Retry-After"] == "1"
    finally:
        server.controller.unavailable = False


def test_cli_commands_print_tables_and_exit_with_meaningful_codes(server, tmp_path):
    spec_file = tmp_path / "model.yaml"
    spec_file.write_text("tenant: cli\nname: small\nsource: ./weights\nautoscaling:\n  max_instances: 2\n")
    result = server.thaw("deploy", str(spec_file), "--min-instances", "1")
    assert result.returncode == 0, result.stderr
    stored = server.controller.specs["cli/small"]
    assert stored["source"] == str(tmp_path / "weights") and stored["autoscaling"]["min_instances"] == 1
    result = server.thaw("list")
    assert result.returncode == 0 and "cli/small" in result.stdout and "1..2" in result.stdout
    result = server.thaw("status")
    assert result.returncode == 0, result.stderr
    for text in ("MODELS", "acme/m", "INSTANCES", "i-1", "CHECKPOINTS", "acme--m", "dram", "ssd",
                 "LOAD ESTIMATES", "0.12", "1/2"):
        assert text in result.stdout, text
    assert server.thaw("scale", "cli/small", "--max", "3").returncode == 0
    assert server.controller.specs["cli/small"]["autoscaling"]["max_instances"] == 3
    result = server.thaw("scale", "cli/small", "--max", "0")  # the server refuses the value: bad input
    assert result.returncode == 2 and "max_instances" in result.stderr
    result = server.thaw("drain", "node0")
    assert result.returncode == 0 and "i-1" in result.stdout and server.controller.drained == ["node0"]
    assert server.thaw("drain", "node9").returncode == 1
    result = server.thaw("undrain", "node0")
    assert result.returncode == 0 and "node0 takes new instances again" in result.stdout
    assert server.controller.drained == []
    assert server.thaw("undrain", "node9").returncode == 1
    result = server.thaw("migrate", "i-1", "--to-node", "node1")
    assert result.returncode == 0, result.stderr
    assert "2/2 request(s) migrated from i-1 to i-2" in result.stdout and "r2" in result.stdout
    result = server.thaw("migrate", "i-1", "--method", "teleport")  # refused by the CLI itself
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = server.thaw("migrate", "i-1", "--to-node", "node1", "--to-instance", "i-2")
    assert result.returncode == 2 and "not allowed with" in result.stderr
    result = server.thaw("migrate", "i-1", "--to-node", "")  # refused by the server as invalid: bad input
    assert result.returncode == 2 and "to_node" in result.stderr
    result = server.thaw("migrate", "i-9")  # unknown instance: not bad input, a refusal
    assert result.returncode == 1 and "i-9" in result.stderr
    result = server.thaw("tenants", "create", "clitenant")
    assert result.returncode == 0 and "created" in result.stdout
    result = server.thaw("keys", "create", "clitenant")
    assert result.returncode == 0 and server.store.verify_api_key(result.stdout.strip()) == "clitenant"
    result = server.thaw("keys", "ls", "--tenant", "clitenant", "--json")
    assert result.returncode == 0 and '"tenant": "clitenant"' in result.stdout
    result = server.thaw("delete", "cli/small")
    assert result.returncode == 0 and "cli/small" not in server.controller.specs
    result = server.thaw("delete", "cli/small")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "not deployed" in result.stderr
    result = server.thaw("deploy", "--name", "cli/x")  # no --source: refused before any call
    assert result.returncode == 2 and "--source" in result.stderr
    result = server.thaw("status", key=None)  # the key comes from the state directory's admin_key file
    assert result.returncode == 0 and "MODELS" in result.stdout
    result = subprocess.run([THAW, "status", "--url", server.url, "--state", str(tmp_path / "empty")],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k != "THAW_ADMIN_KEY"})
    assert result.returncode == 1 and "no admin key found" in result.stderr
    result = subprocess.run([THAW, "status", "--url", "http://127.0.0.1:9", "--admin-key", "k"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no Thaw gateway answers" in result.stderr
