"""How ``thaw serve`` stands a platform up: `PlatformConfig`, frozen and validated, no I/O.

Everything a platform owns on a machine is named here, so two platforms run side by side when
they differ in these values: the state directory (its SQLite state store, SSD cache, admin key
file and demo model), the HTTP port, and the Ray namespace (which names the controller, node
stores and workers, and the shared-memory directories through the controller's platform id).

The state directory defaults to ``$THAW_STATE_DIR``, else ``~/.thaw`` — per user, like
``~/.ray``, so ``thaw status`` in any shell finds the platform that ``thaw serve`` started, and
never inside a source checkout where it would be committed by accident. `default_state_dir`
reads the environment; the dataclass itself only validates what it is given.

The derived configurations (`controller_config`, `gateway_config`) are built here so the CLI,
the platform and the tests agree on every path.

``--no-auth`` (``auth=False``) makes every caller admin, so it is refused unless the gateway
listens on a loopback address (`LOOPBACK_HOSTS`); the gateway then also answers only requests
addressed to a loopback name (`infra.gateway_access`), which keeps a web page from reaching it
through DNS rebinding.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
STATE_DIR_ENV = "THAW_STATE_DIR"
DEFAULT_PORT = 8000
ADMIN_KEY_FILE = "admin_key"  # the admin key, mode 0600, for the CLI on this machine
GATEWAY_URL_FILE = "gateway_url"  # where the running platform listens, while it runs
DEMO_MODEL_DIR = "demo-model"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}")
_HOST_RE = re.compile(r"[A-Za-z0-9.:\-\[\]]+")
# Where a no-auth gateway may listen; the same names `infra.gateway_access.LOOPBACK_NAMES` accepts in Host.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_BODY_TIMEOUT_S = 30.0


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$THAW_STATE_DIR`` if set, else ``~/.thaw`` (absolute either way)."""
    environ = os.environ if environ is None else environ
    value = environ.get(STATE_DIR_ENV)
    return Path(value).expanduser().absolute() if value else Path.home() / ".thaw"


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"PlatformConfig.{name} must be an integer {bound}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class PlatformConfig:
    """One platform.

    Fields:
        state_dir: absolute directory of this platform's local state (see the module docstring).
        state_store: a state store location (``redis://host:port/db``, ``sqlite:///path``, a
            path); None: SQLite in `state_dir`. A multi-node cluster needs Redis, since every
            gateway replica verifies API keys against it.
        repository_uri: the model repository (a directory or ``s3://bucket/prefix``); None:
            ``state_dir/repository``.
        repository_endpoint_url: S3-compatible endpoint of the repository, if not AWS.
        ray_address: join this Ray cluster (``ray://...`` or ``host:port``); None: start a
            local Ray for this process and stop it on exit.
        host / port: where the gateway listens (Ray Serve's HTTP proxy).
        namespace: Ray namespace of this platform's actors; also its shared-memory id.
        auth: False is ``--no-auth``: no keys, everyone is admin (local experiments only; needs
            a loopback `host`).
        metrics_token_file: a file holding the Prometheus scrape token that may read
            ``/metrics`` besides the admin key (`infra.metrics_token`); None: the admin key only.
            Needs `auth`. Read by `Platform.start`, not here.
        gateway_body_timeout_s: a request body not complete this long after the request
            arrived gets 408 (so slow bodies cannot hold the gateway's request slots).
        num_cpus: CPUs a local Ray offers; None: all of the machine's.
        cpu_worker_slots_per_node: model instances a CPU-only node runs at once.
        ssd_capacity_bytes / dram_capacity_bytes: each node store's tiers.
        calibrate: let node stores measure their bandwidths at start (placement uses them).
        num_gateway_replicas: gateway replicas (each with its own routing-table cache).
        spare_workers_per_node / spare_weight_bytes: model-less worker processes kept started on
            each node, and the memory each faults ahead for a model's weights (see
            `controller.spare_pool`).
        peer_link_bytes_per_s: the rate the controller assumes for streaming a new instance's
            weights from a running one (`controller.PeerStreamSettings`); 0: never stream.
        slot_sharing: slots pass between models on demand (an idle instance evicted for a model
            with waiting requests; past its bounded wait, a busy one preempted); False:
            keep-alive is a hard lease and a waiting model only gets a slot once one is free
            (`controller.slot_sharer`).
        engine_defaults: `worker.EngineConfig` fields every instance starts with.
        reconcile_interval_s: the controller's tick.
    """

    state_dir: Path
    state_store: str | None = None
    repository_uri: str | None = None
    repository_endpoint_url: str | None = None
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    namespace: str = "thaw"
    auth: bool = True
    metrics_token_file: Path | None = None
    gateway_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    num_cpus: int | None = None
    cpu_worker_slots_per_node: int = 1
    ssd_capacity_bytes: int = 64 * GIB
    dram_capacity_bytes: int = 8 * GIB
    calibrate: bool = True
    num_gateway_replicas: int = 1
    spare_workers_per_node: int = 1
    spare_weight_bytes: int = 0
    peer_link_bytes_per_s: float = 1.5e9
    slot_sharing: bool = True
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    reconcile_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.state_dir, (str, Path)) or not str(self.state_dir):
            raise ValueError(f"PlatformConfig.state_dir must be a path, got {self.state_dir!r}")
        state_dir = Path(self.state_dir).expanduser()
        if not state_dir.is_absolute():
            raise ValueError(f"PlatformConfig.state_dir {str(self.state_dir)!r} must be an absolute path "
                             "(Ray actors do not share the caller's working directory)")
        object.__setattr__(self, "state_dir", state_dir)
        for name in ("state_store", "repository_uri", "repository_endpoint_url", "ray_address"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"PlatformConfig.{name} must be None or a non-empty string, got {value!r}")
        if self.repository_uri is not None and "://" not in self.repository_uri \
                and not os.path.isabs(os.path.expanduser(self.repository_uri)):
            raise ValueError(f"PlatformConfig.repository_uri {self.repository_uri!r} must be an absolute path "
                             "or s3://bucket/prefix")
        if not isinstance(self.host, str) or not _HOST_RE.fullmatch(self.host):
            raise ValueError(f"PlatformConfig.host must be a host name or IP address, got {self.host!r}")
        _int("port", self.port, 1, 65535)
        if not isinstance(self.namespace, str) or not _NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(f"PlatformConfig.namespace {self.namespace!r} must be 1-48 letters, digits, '_' or '-', "
                             "starting with a letter or digit")
        for name in ("auth", "calibrate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PlatformConfig.{name} must be True or False")
        if not self.auth and self.host.lower() not in LOOPBACK_HOSTS:
            raise ValueError(f"--no-auth (PlatformConfig.auth=False) makes every caller admin, so the gateway may then "
                             f"listen only on a loopback address: --host must be 127.0.0.1, localhost or ::1, got "
                             f"{self.host!r}; to serve other machines, drop --no-auth and give clients API keys")
        if self.metrics_token_file is not None:
            if not isinstance(self.metrics_token_file, (str, Path)) or not str(self.metrics_token_file):
                raise ValueError(f"PlatformConfig.metrics_token_file must be None or a path, "
                                 f"got {self.metrics_token_file!r}")
            object.__setattr__(self, "metrics_token_file", Path(self.metrics_token_file))
            if not self.auth:
                raise ValueError("--metrics-token-file needs API keys: with --no-auth, /metrics is open to callers "
                                 "on this machine already; drop one of the two")
        value = self.gateway_body_timeout_s
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"PlatformConfig.gateway_body_timeout_s must be a number of seconds > 0, got {value!r}")
        if self.num_cpus is not None:
            _int("num_cpus", self.num_cpus, 1)
        _int("cpu_worker_slots_per_node", self.cpu_worker_slots_per_node, 1)
        _int("ssd_capacity_bytes", self.ssd_capacity_bytes, 1)
        _int("dram_capacity_bytes", self.dram_capacity_bytes, 0)
        _int("num_gateway_replicas", self.num_gateway_replicas, 1)
        _int("spare_workers_per_node", self.spare_workers_per_node, 0)
        _int("spare_weight_bytes", self.spare_weight_bytes, 0)
        if not isinstance(self.engine_defaults, Mapping):
            raise ValueError("PlatformConfig.engine_defaults must be a mapping of worker.EngineConfig fields")
        object.__setattr__(self, "engine_defaults", dict(self.engine_defaults))
        value = self.reconcile_interval_s
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"PlatformConfig.reconcile_interval_s must be a number > 0, got {value!r}")
        if not isinstance(self.slot_sharing, bool):
            raise ValueError(f"PlatformConfig.slot_sharing must be True or False, got {self.slot_sharing!r}")
        value = self.peer_link_bytes_per_s
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"PlatformConfig.peer_link_bytes_per_s must be a number >= 0 (0: never stream "
                             f"from a peer), got {value!r}")

    # ---- derived paths -----------------------------------------------------------------------

    @property
    def state_location(self) -> str:
        """The state store the platform, the gateway and the admin key use."""
        return self.state_store if self.state_store is not None else str(self.state_dir) + "/"

    @property
    def effective_repository_uri(self) -> str:
        return self.repository_uri if self.repository_uri is not None else str(self.state_dir / "repository")

    @property
    def admin_key_file(self) -> Path:
        return self.state_dir / ADMIN_KEY_FILE

    @property
    def gateway_url_file(self) -> Path:
        return self.state_dir / GATEWAY_URL_FILE

    @property
    def demo_model_dir(self) -> Path:
        return self.state_dir / DEMO_MODEL_DIR

    @property
    def url(self) -> str:
        """The gateway's base URL as a client on this machine reaches it."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def controller_name(self) -> str:
        return "thaw-controller"

    @property
    def gateway_app_name(self) -> str:
        return f"{self.namespace}-gateway"

    # ---- derived configurations --------------------------------------------------------------

    def controller_config(self) -> Any:
        """The `controller.ControllerConfig` of this platform (imported here: it brings storage)."""
        from controller import ControllerConfig
        from controller import SlotSharingSettings
        from controller.stream_source_policy import PeerStreamSettings
        from storage import RepositoryConfig

        peer_stream = PeerStreamSettings(link_bytes_per_s=self.peer_link_bytes_per_s) \
            if self.peer_link_bytes_per_s > 0 else None
        return ControllerConfig(
            state_dir=self.state_dir, state_store=self.state_store, namespace=self.namespace,
            repository=RepositoryConfig(uri=self.effective_repository_uri, endpoint_url=self.repository_endpoint_url),
            ssd_capacity_bytes=self.ssd_capacity_bytes, dram_capacity_bytes=self.dram_capacity_bytes,
            calibrate=self.calibrate, cpu_worker_slots_per_node=self.cpu_worker_slots_per_node,
            engine_defaults=self.engine_defaults, reconcile_interval_s=self.reconcile_interval_s,
            spare_workers_per_node=self.spare_workers_per_node, spare_weight_bytes=self.spare_weight_bytes,
            peer_stream=peer_stream, slot_sharing=SlotSharingSettings() if self.slot_sharing else None,
        )

    def gateway_config(self, metrics_token_sha256: str | None = None) -> Any:
        """The `GatewayDeploymentConfig` of this platform's gateway; `metrics_token_sha256` is the
        digest of the token in `metrics_token_file` (`Platform.start` reads it)."""
        from infra.gateway_deployment import GatewayDeploymentConfig

        return GatewayDeploymentConfig(namespace=self.namespace, controller_name=self.controller_name,
                                       state_store=self.state_location, auth=self.auth,
                                       num_replicas=self.num_gateway_replicas, http_port=self.port,
                                       body_timeout_s=self.gateway_body_timeout_s,
                                       metrics_token_sha256=metrics_token_sha256)
