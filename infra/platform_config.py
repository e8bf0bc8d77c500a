"""How ``thaw serve`` stands a platform up: `PlatformConfig`, frozen and validated, no I/O.

Everything a platform owns on a machine is named here, so two platforms run side by side when
they differ in these values: the state directory (its SQLite state store, SSD cache, admin key
file and demo model), the HTTP port, and the Ray namespace (which names the controller, node
stores and workers, and the shared-memory directories through the controller's platform id).

The state directory defaults to ``$THAW_STATE_DIR``, else ``~/.thaw`` — per user, like
``~/.ray``, so ``thaw status`` in any shell finds the platform that ``thaw serve`` started, and
never inside a source checkout where it would be committed by accident. `default_state_dir`
reads the environment; the dataclass itself only validates what it is given.

A platform's controller settings are its `controller.ControllerConfig`, held whole (`controller`),
so each is defined, defaulted and validated once, there; `PlatformConfig.create` takes them flat,
as ``thaw serve`` does. The gateway's configuration (`gateway_config`) is derived here, so the
CLI, the platform and the tests agree on every path.

``--no-auth`` (``auth=False``) makes every caller admin, so it is refused unless the gateway
listens on a loopback address (`LOOPBACK_HOSTS`); the gateway then also answers only requests
addressed to a loopback name (`infra.gateway_access`), which keeps a web page from reaching it
through DNS rebinding.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the controller's config brings storage and torch, which
    from controller import ControllerConfig  # the CLI's other commands reading this module do not need

GIB = 1 << 30
STATE_DIR_ENV = "THAW_STATE_DIR"
STATE_STORE_ENV = "THAW_STATE_STORE"  # thaw serve --state-store's default (a Redis password stays off argv)
DEFAULT_PORT = 8000
ADMIN_KEY_FILE = "admin_key"  # the admin key, mode 0600, for the CLI on this machine
GATEWAY_URL_FILE = "gateway_url"  # where the running platform listens, while it runs
DEMO_MODEL_DIR = "demo-model"
_HOST_RE = re.compile(r"[A-Za-z0-9.:\-\[\]]+")
# Where a no-auth gateway may listen; the same names `infra.gateway_access.LOOPBACK_NAMES` accepts in Host.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_BODY_TIMEOUT_S = 30.0
# --http-proxies -> Ray Serve's proxy_location.
HTTP_PROXY_LOCATIONS = {"every-node": "EveryNode", "head-only": "HeadOnly"}
# How much of `services_resource` the controller and each gateway replica take: a sliver, so a node
# offering 1 of it hosts any number of them.
SERVICES_RESOURCE_AMOUNT = 0.001
_RESOURCE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]{0,99}")


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
    """One platform: its `controller` (a `controller.ControllerConfig`, which defines the state
    directory, state store, namespace, repository, node stores' tiers, worker slots, spares, peer
    streams, slot sharing, engine defaults and timing -- each once, there) and what only the
    platform has: where Ray and the gateway run. Build one from flat settings, as ``thaw serve``
    takes them, with `create`.

    Fields:
        controller: the platform's controller configuration; `state_dir`, `state_store`,
            `namespace` and the repository are read from it.
        ray_address: join this Ray cluster (``ray://...`` or ``host:port``); None: start a
            local Ray for this process and stop it on exit.
        host / port: where the gateway listens (Ray Serve's HTTP proxy).
        auth: False is ``--no-auth``: no keys, everyone is admin (local experiments only; needs
            a loopback `host`).
        admin_key_source: a file holding the admin key to use (`infra.admin_key.import_admin_key`:
            made an admin key if it is not one, never printed); None: one is made on the first
            start and printed. Read by `Platform.start`, not here.
        metrics_token_file: a file holding the Prometheus scrape token that may read
            ``/metrics`` besides the admin key (`infra.metrics_token`); None: the admin key only.
            Needs `auth`. Read by `Platform.start`, not here.
        gateway_body_timeout_s: a request body not complete this long after the request
            arrived gets 408 (so slow bodies cannot hold the gateway's request slots).
        num_cpus: CPUs a local Ray offers; None: all of the machine's.
        num_gateway_replicas: gateway replicas (each with its own routing-table cache).
        state_dir_shared: with `ray_address`, the state directory is one every Ray node sees (one
            machine, or shared storage), so the SQLite state store may be used there. Joining a
            cluster without it needs a Redis state store: the controller may be restarted on
            another node, where a node-local SQLite file is not (or is another, stale one).
        head_only: with `ray_address`, the Ray node ``thaw serve`` runs on hosts the controller,
            the gateway and Serve's proxy but no node store and no model instance (a cluster's
            head, often without GPUs): the models go to the other nodes.
        services_resource: a Ray custom resource the controller and every gateway replica each
            take a sliver of (`SERVICES_RESOURCE_AMOUNT`), so they run only on the nodes started
            with it (``ray start --resources '{"NAME": 1}'``): e.g. a cluster's CPU nodes, not the
            GPU nodes an autoscaler adds and removes. None: any node.
        http_proxies: where Ray Serve runs its HTTP proxy: ``"every-node"`` (Serve's default: a
            load balancer in front reaches the gateway on any node) or ``"head-only"`` (one proxy,
            on the node ``thaw serve`` runs on; the gateway replicas still spread over the
            nodes). Several Ray nodes on one machine need ``"head-only"``: their proxies would
            all bind the same port.
    """

    controller: ControllerConfig
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    auth: bool = True
    metrics_token_file: Path | None = None
    admin_key_source: Path | None = None
    gateway_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    num_cpus: int | None = None
    num_gateway_replicas: int = 1
    state_dir_shared: bool = False
    head_only: bool = False
    services_resource: str | None = None
    http_proxies: str = "every-node"

    @classmethod
    def create(cls, *, state_dir: str | Path, repository_uri: str | None = None,
               repository_endpoint_url: str | None = None, repository_upload_bytes_per_s: float | None = None,
               peer_link_bytes_per_s: float | None = None, slot_sharing: bool = True,
               **settings: Any) -> PlatformConfig:
        """A platform from flat settings: each of `settings` is a field of the platform's own
        (see the class) or of `controller.ControllerConfig`, and goes where it is defined. The
        rest are ``thaw serve``'s shapes of controller settings:

        - `state_dir`: absolute (``~`` expanded); the controller's state directory;
        - `repository_uri` / `repository_endpoint_url`: the repository (a directory or
          ``s3://bucket/prefix``); None: ``state_dir/repository``; `repository_upload_bytes_per_s`: a
          cap on what deploys upload into it (`storage.RepositoryConfig.upload_bytes_per_s`);
        - `peer_link_bytes_per_s`: the rate assumed for streaming a new instance's weights from
          a running one (the `link_bytes_per_s` of `ControllerConfig.peer_stream`); 0: never
          stream; None: the controller's default;
        - `slot_sharing`: slots pass between models on demand (`controller.SlotSharingSettings`
          with its defaults); False: keep-alive is a hard lease (`controller.slot_sharer`).

        Raises ValueError naming the setting; a name neither config has is a TypeError."""
        from controller import ControllerConfig, SlotSharingSettings
        from storage import RepositoryConfig

        if not isinstance(state_dir, (str, Path)) or not str(state_dir):
            raise ValueError(f"PlatformConfig.state_dir must be a path, got {state_dir!r}")
        state_dir = Path(state_dir).expanduser()
        if not state_dir.is_absolute():
            raise ValueError(f"PlatformConfig.state_dir {str(state_dir)!r} must be an absolute path "
                             "(Ray actors do not share the caller's working directory)")
        for name, value in (("repository_uri", repository_uri), ("repository_endpoint_url", repository_endpoint_url)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"PlatformConfig.{name} must be None or a non-empty string, got {value!r}")
        if repository_uri is not None and "://" not in repository_uri \
                and not os.path.isabs(os.path.expanduser(repository_uri)):
            raise ValueError(f"PlatformConfig.repository_uri {repository_uri!r} must be an absolute path "
                             "or s3://bucket/prefix")
        if not isinstance(slot_sharing, bool):
            raise ValueError(f"PlatformConfig.slot_sharing must be True or False, got {slot_sharing!r}")
        value = peer_link_bytes_per_s
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool)
                                  or not math.isfinite(value) or value < 0):
            raise ValueError(f"PlatformConfig.peer_link_bytes_per_s must be a number >= 0 (0: never stream "
                             f"from a peer), got {value!r}")
        if value is not None and "peer_stream" in settings:
            raise ValueError("PlatformConfig.create: pass peer_link_bytes_per_s or peer_stream, not both")
        platform_fields = {f.name for f in dataclasses.fields(cls)} - {"controller"}
        own = {name: settings.pop(name) for name in list(settings) if name in platform_fields}
        repository = RepositoryConfig(uri=repository_uri if repository_uri is not None
                                      else str(state_dir / "repository"), endpoint_url=repository_endpoint_url,
                                      upload_bytes_per_s=repository_upload_bytes_per_s)
        controller = ControllerConfig(state_dir=state_dir, repository=repository,
                                      slot_sharing=SlotSharingSettings() if slot_sharing else None, **settings)
        if value is not None:  # the controller's stream settings, at this rate (0: none)
            stream = controller.peer_stream
            stream = None if value == 0 or stream is None else dataclasses.replace(stream, link_bytes_per_s=value)
            controller = dataclasses.replace(controller, peer_stream=stream)
        return cls(controller=controller, **own)

    def __post_init__(self) -> None:
        from controller import ControllerConfig  # loaded already: the caller built one

        if not isinstance(self.controller, ControllerConfig):
            raise ValueError(f"PlatformConfig.controller must be a controller.ControllerConfig, "
                             f"got {type(self.controller).__name__} (PlatformConfig.create builds one)")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ValueError(f"PlatformConfig.ray_address must be None or a non-empty string, got {self.ray_address!r}")
        if not isinstance(self.host, str) or not _HOST_RE.fullmatch(self.host):
            raise ValueError(f"PlatformConfig.host must be a host name or IP address, got {self.host!r}")
        _int("port", self.port, 1, 65535)
        if not isinstance(self.auth, bool):
            raise ValueError("PlatformConfig.auth must be True or False")
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
        if self.admin_key_source is not None:
            if not isinstance(self.admin_key_source, (str, Path)) or not str(self.admin_key_source):
                raise ValueError(f"PlatformConfig.admin_key_source must be None or a path, got {self.admin_key_source!r}")
            object.__setattr__(self, "admin_key_source", Path(self.admin_key_source))
            if not self.auth:
                raise ValueError("--admin-key-file needs API keys: with --no-auth there is no admin key; drop one "
                                 "of the two")
        value = self.gateway_body_timeout_s
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"PlatformConfig.gateway_body_timeout_s must be a number of seconds > 0, got {value!r}")
        if self.num_cpus is not None:
            _int("num_cpus", self.num_cpus, 1)
        _int("num_gateway_replicas", self.num_gateway_replicas, 1)
        if not isinstance(self.state_dir_shared, bool):
            raise ValueError(f"PlatformConfig.state_dir_shared must be True or False, got {self.state_dir_shared!r}")
        if not isinstance(self.head_only, bool):
            raise ValueError(f"PlatformConfig.head_only must be True or False, got {self.head_only!r}")
        if self.head_only and self.ray_address is None:
            raise ValueError("--head-only needs --address: on a Ray of its own the platform has no other node to put "
                             "models on")
        if self.services_resource is not None and (not isinstance(self.services_resource, str)
                                                   or not _RESOURCE_RE.fullmatch(self.services_resource)):
            raise ValueError(f"PlatformConfig.services_resource must be a Ray resource name (letters, digits, '_', "
                             f"'-', '.', '/'), got {self.services_resource!r}")
        if self.http_proxies not in HTTP_PROXY_LOCATIONS:
            raise ValueError(f"PlatformConfig.http_proxies must be one of {', '.join(HTTP_PROXY_LOCATIONS)}, "
                             f"got {self.http_proxies!r}")
        store = self.controller.state_location
        if self.ray_address is not None and not store.startswith("redis") and not self.state_dir_shared:
            raise ValueError(
                f"joining the Ray cluster at {self.ray_address} with the SQLite state store in {store!r}: the "
                f"controller may restart on another node, where that file is missing or stale. Use Redis "
                f"(--state-store redis://HOST:6379/0), or --state-shared if every node sees {self.state_dir} "
                f"(one machine, or shared storage)")

    # ---- from the controller's configuration -------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.controller.state_dir

    @property
    def namespace(self) -> str:
        """Ray namespace of this platform's actors; also its shared-memory id."""
        return self.controller.namespace

    # ---- derived paths -----------------------------------------------------------------------

    @property
    def state_location(self) -> str:
        """The state store the platform, the gateway and the admin key use."""
        return self.controller.state_location

    @property
    def effective_repository_uri(self) -> str:
        return self.controller.repository.uri

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

    @property
    def services_resources(self) -> dict[str, float]:
        """The Ray custom resources the controller and each gateway replica ask for."""
        return {} if self.services_resource is None else {self.services_resource: SERVICES_RESOURCE_AMOUNT}

    # ---- derived configurations --------------------------------------------------------------

    def gateway_config(self, metrics_token_sha256: str | None = None) -> Any:
        """The `GatewayDeploymentConfig` of this platform's gateway; `metrics_token_sha256` is the
        digest of the token in `metrics_token_file` (`Platform.start` reads it)."""
        from infra.gateway_deployment import GatewayDeploymentConfig

        return GatewayDeploymentConfig(namespace=self.namespace, controller_name=self.controller_name,
                                       replica_resources=self.services_resources,
                                       state_store=self.state_location, auth=self.auth,
                                       num_replicas=self.num_gateway_replicas, http_port=self.port,
                                       body_timeout_s=self.gateway_body_timeout_s,
                                       metrics_token_sha256=metrics_token_sha256)
