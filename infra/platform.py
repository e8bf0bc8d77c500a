"""Starting and stopping a whole platform: `Platform`, what ``thaw serve`` runs.

`start` brings up, in order: Ray (a local single-node instance owned by this process and
listening on loopback only, `infra.local_ray`; or an existing cluster joined with
``ray_address``), the admin key (first start only), the controller actor
(which starts the node stores and, as models get traffic, the workers), for ``--demo`` the demo
model deployed as ``demo/tiny`` (through the controller, before the gateway exists), and the
gateway as a Ray Serve application. It returns once the gateway answers ``/readyz``: a probe or a
script that waits for ``/readyz`` (or for the banner) can call the demo model at once. `stop` takes it down in the reverse order: the gateway
first (no new requests), then the controller with its workers and node stores (which removes
their shared memory), then Ray (with Serve) if this process started it.

Nothing here is module-level state: a `Platform` object holds what it started, so tests can
run one in-process, and two platforms with different namespaces, ports and state directories
can share a machine (not a Ray cluster: Ray Serve's HTTP proxy is one per cluster).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.platform_config import HTTP_PROXY_LOCATIONS, PlatformConfig

logger = logging.getLogger(__name__)

DEMO_MODEL_ID = "demo/tiny"


class PlatformError(RuntimeError):
    """The platform could not be started (the message says what to do about it)."""


@dataclass(frozen=True)
class StartedPlatform:
    """What `Platform.start` reports: where it listens, and the new admin key on a first start."""

    url: str
    new_admin_key: str | None
    demo_model_id: str | None


class Platform:
    """One platform started by this process (see the module docstring)."""

    def __init__(self, config: PlatformConfig) -> None:
        self.config = config
        self._owns_ray = False
        self._controller: Any = None
        self._serve_started = False

    # ---- start -------------------------------------------------------------------------------

    def start(self, *, demo: bool = False, reset_admin_key: bool = False, ready_timeout_s: float = 180.0
              ) -> StartedPlatform:
        """Starts everything; on any failure stops what was started and raises `PlatformError`."""
        config = self.config
        metrics_token = self._read_metrics_token()
        if config.ray_address is None:
            _check_port_free(config.host, config.port)
        config.state_dir.mkdir(parents=True, exist_ok=True)
        if "://" not in config.effective_repository_uri:  # a local repository must exist to be pushed to
            Path(config.effective_repository_uri).expanduser().mkdir(parents=True, exist_ok=True)
        new_key = self._prepare_admin_key(reset_admin_key) if config.auth else None
        try:
            self._start_ray()
            self._start_controller(ready_timeout_s)
            # Before the gateway: its /readyz (and so the banner) then means the demo model answers.
            demo_model_id = self._deploy_demo() if demo else None
            self._start_gateway(ready_timeout_s, metrics_token)
        except BaseException:
            self.stop()
            raise
        config.gateway_url_file.write_text(config.url + "\n", encoding="utf-8")
        return StartedPlatform(url=config.url, new_admin_key=new_key, demo_model_id=demo_model_id)

    def _read_metrics_token(self) -> str | None:
        """The digest of the scrape token in ``metrics_token_file`` (read before anything starts)."""
        from infra.metrics_token import read_metrics_token_file

        if self.config.metrics_token_file is None:
            return None
        try:
            return read_metrics_token_file(self.config.metrics_token_file).sha256_hex
        except ValueError as exc:
            raise PlatformError(f"--metrics-token-file: {exc}") from None

    def _prepare_admin_key(self, reset: bool) -> str | None:
        from controller import open_state_store
        from infra.admin_key import ensure_admin_key, import_admin_key, reset_admin_key

        source = self.config.admin_key_source
        if source is not None and reset:
            raise PlatformError("--reset-admin-key makes a new key, --admin-key-file names the one to use: "
                                "give one of the two")
        with open_state_store(self.config.state_location) as store:
            if source is not None:
                try:
                    import_admin_key(store, source, self.config.admin_key_file)
                except ValueError as exc:
                    raise PlatformError(f"--admin-key-file: {exc}") from None
                return None  # the key is the operator's own: never printed
            if reset:
                return reset_admin_key(store, self.config.admin_key_file)
            return ensure_admin_key(store, self.config.admin_key_file)

    def _start_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's Ray (an in-process test, a notebook): use it, leave it running
        options: dict[str, Any] = {"namespace": self.config.namespace, "include_dashboard": False,
                                   "logging_level": logging.WARNING, "log_to_driver": False}
        if self.config.ray_address is None:
            from infra.local_ray import init_local_ray

            init_local_ray(num_cpus=self.config.num_cpus, **options)  # nobody else joins it: loopback only
        else:
            ray.init(address=self.config.ray_address, **options)
        self._owns_ray = True

    def _start_controller(self, timeout_s: float) -> None:
        import ray

        from controller import get_controller, start_controller

        config = self.config
        try:
            get_controller(config.controller_name, namespace=config.namespace)
        except ValueError:
            pass
        else:
            raise PlatformError(f"a Thaw controller already runs in Ray namespace {config.namespace!r} (another "
                                "`thaw serve`?); stop it first, or pass --namespace to start a second platform")
        controller_config = config.controller
        if config.head_only:  # this Ray node runs the platform's services, the others its models
            node_id = ray.get_runtime_context().get_node_id()
            controller_config = dataclasses.replace(
                controller_config, excluded_ray_node_ids=(*controller_config.excluded_ray_node_ids, node_id))
        options = {"resources": config.services_resources} if config.services_resources else {}
        self._controller = start_controller(controller_config, name=config.controller_name, **options)
        try:
            ray.get(self._controller.ping.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlatformError(f"the controller did not start within {timeout_s:g} s") from None
        except ray.exceptions.RayError as exc:
            raise PlatformError(f"the controller failed to start: {exc}") from None

    def _start_gateway(self, timeout_s: float, metrics_token_sha256: str | None) -> None:
        from ray import serve

        from infra.gateway_deployment import gateway_application

        config = self.config
        serve.start(proxy_location=HTTP_PROXY_LOCATIONS[config.http_proxies],
                    http_options={"host": config.host, "port": config.port})
        self._serve_started = True
        serve.run(gateway_application(config.gateway_config(metrics_token_sha256)), name=config.gateway_app_name,
                  route_prefix="/")
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """Polls ``/readyz`` (deadline) until the gateway says the controller is reachable."""
        url = f"{self.config.url}/readyz"
        deadline = time.monotonic() + timeout_s
        last_error = "no answer"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last_error = f"HTTP {exc.code}"
            except OSError as exc:
                last_error = str(exc)
            time.sleep(0.1)  # a poll interval, bounded by the deadline
        raise PlatformError(f"the gateway at {self.config.url} was not ready within {timeout_s:g} s ({last_error}); "
                            f"is port {self.config.port} free?")

    def _deploy_demo(self) -> str:
        """Writes the demo model into the state directory if missing and deploys it as ``demo/tiny``."""
        import ray

        from worker import write_demo_model

        model_dir = self.config.demo_model_dir
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, overwrite=True)
        # A GPU node's slots are its GPUs and a CPU model never lands there: on a cluster of GPU
        # nodes only (a GPU machine on its own), the demo asks for one.
        from controller.ray_cluster_client import live_ray_nodes

        alive = live_ray_nodes(ray.nodes())
        on_gpu = bool(alive) and all(node.num_gpus > 0 for node in alive)
        spec = demo_spec(model_dir, num_gpus=1 if on_gpu else 0)
        ray.get(self._controller.deploy.remote(spec))
        return DEMO_MODEL_ID

    # ---- stop --------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stops what `start` started (idempotent; each step runs even if an earlier one failed)."""
        import ray

        if self._serve_started:
            self._serve_started = False
            try:
                from ray import serve

                # Only this platform's app: Serve itself goes with a Ray this process owns, and on a
                # shared cluster it may serve other applications.
                serve.delete(self.config.gateway_app_name)
            except Exception:  # noqa: BLE001 - keep stopping the rest
                logger.exception("stopping the gateway failed")
        if self._controller is not None:
            from controller import stop_controller

            controller, self._controller = self._controller, None
            try:
                stop_controller(controller, stop_workers=True, timeout_s=timeout_s)
            except Exception:  # noqa: BLE001
                logger.exception("stopping the controller failed")
        self.config.gateway_url_file.unlink(missing_ok=True)
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


def _check_port_free(host: str, port: int) -> None:
    """Fails at once when the gateway's port is taken, rather than after a start-up timeout."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PlatformError(f"cannot listen on {host}:{port} ({exc.strerror}); pass --port with a free port "
                                "(another `thaw serve`?)") from None


def demo_spec(model_dir: Path, num_gpus: int = 0) -> dict[str, Any]:
    """The demo model's spec: scale to zero (its first request is a cold start from the node's
    tiers, well under a second for this model), kept warm 5 minutes after use, and its slot given
    to another model with waiting requests meanwhile. `min_instances: 1` would pin the only slot
    of a default 2-core node, and a second deployed model could never run beside it. `num_gpus`:
    1 where every node is a GPU node (a CPU model is placed on CPU nodes only)."""
    tenant, name = DEMO_MODEL_ID.split("/")
    spec = {"tenant": tenant, "name": name, "source": str(model_dir),
            "autoscaling": {"min_instances": 0, "max_instances": 1, "keep_alive_s": 300.0}}
    if num_gpus:
        spec["resources"] = {"num_gpus": num_gpus}
    return spec
