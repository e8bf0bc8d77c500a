"""`PlatformConfig`'s safety checks (issue 19, items 3, 4 and 10): ``--no-auth`` only on a
loopback host, a metrics token only with keys, and what the gateway is told."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infra.gateway_access import LOOPBACK_NAMES
from infra.gateway_body_limit import DEFAULT_BODY_TIMEOUT_S
from infra.platform_config import LOOPBACK_HOSTS, PlatformConfig

STATE = Path("/tmp/thaw-state")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "gateway.example"])
def test_no_auth_is_refused_on_a_non_loopback_host(host):
    with pytest.raises(ValueError, match=f"--no-auth .* --host must be 127.0.0.1, localhost or ::1, got '{host}'; "
                                         "to serve other machines, drop --no-auth"):
        PlatformConfig.create(state_dir=STATE, auth=False, host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_no_auth_is_fine_on_loopback_and_keys_anywhere(host):
    assert PlatformConfig.create(state_dir=STATE, auth=False, host=host).host == host
    assert PlatformConfig.create(state_dir=STATE, host="0.0.0.0").auth


def test_the_metrics_token_needs_keys_and_the_gateway_gets_port_timeout_and_digest():
    with pytest.raises(ValueError, match="--metrics-token-file needs API keys"):
        PlatformConfig.create(state_dir=STATE, auth=False, metrics_token_file=STATE / "token")
    config = PlatformConfig.create(state_dir=STATE, port=8123, metrics_token_file=str(STATE / "token"),
                            gateway_body_timeout_s=5.0)
    assert config.metrics_token_file == STATE / "token"
    gateway = config.gateway_config("ab" * 32)
    assert (gateway.http_port, gateway.body_timeout_s, gateway.metrics_token_sha256) == (8123, 5.0, "ab" * 32)
    with pytest.raises(ValueError, match="gateway_body_timeout_s must be a number of seconds > 0"):
        PlatformConfig.create(state_dir=STATE, gateway_body_timeout_s=0)


def test_defaults_agree_with_the_gateway():
    assert LOOPBACK_HOSTS == LOOPBACK_NAMES
    assert PlatformConfig.create(state_dir=STATE).gateway_body_timeout_s == DEFAULT_BODY_TIMEOUT_S
    assert PlatformConfig.create(state_dir=STATE).gateway_config().body_timeout_s == DEFAULT_BODY_TIMEOUT_S


# --- the controller's settings are its ControllerConfig's, defined once (issue 20) -----------------


def test_no_controller_setting_is_declared_twice():
    from dataclasses import fields

    from controller import ControllerConfig

    assert {f.name for f in fields(PlatformConfig)} == {
        "controller", "ray_address", "host", "port", "auth", "metrics_token_file", "gateway_body_timeout_s",
        "num_cpus", "num_gateway_replicas", "state_dir_shared", "head_only", "services_resource", "http_proxies",
        "admin_key_source"}
    assert {f.name for f in fields(PlatformConfig)} & {f.name for f in fields(ControllerConfig)} == set()


def test_create_gives_the_controller_its_own_defaults_and_routes_each_setting_where_it_is_defined():
    from controller import ControllerConfig, SlotSharingSettings
    from storage import RepositoryConfig

    default = PlatformConfig.create(state_dir=STATE)
    assert default.controller == ControllerConfig(state_dir=STATE, repository=RepositoryConfig(f"{STATE}/repository"))
    assert (default.state_dir, default.namespace, default.state_location, default.effective_repository_uri) == (
        STATE, "thaw", f"{STATE}/", f"{STATE}/repository")
    config = PlatformConfig.create(
        state_dir="~/thaw-p2", namespace="p2", state_store="redis://r:6379/0", port=9000, num_cpus=3,
        cpu_worker_slots_per_node=3, dram_capacity_bytes=0, engine_defaults={"block_size": 4},
        repository_uri="s3://bucket/models", repository_endpoint_url="http://s3.local:9000",
        peer_link_bytes_per_s=2e9, slot_sharing=False)
    home = Path("~/thaw-p2").expanduser()
    assert (config.port, config.num_cpus, config.state_dir, config.namespace) == (9000, 3, home, "p2")
    controller = config.controller
    assert (controller.state_dir, controller.namespace, controller.state_store) == (home, "p2", "redis://r:6379/0")
    assert (controller.cpu_worker_slots_per_node, controller.dram_capacity_bytes, controller.engine_defaults) == (
        3, 0, {"block_size": 4})
    assert controller.repository == RepositoryConfig("s3://bucket/models", endpoint_url="http://s3.local:9000")
    assert controller.peer_stream == dataclasses.replace(default.controller.peer_stream, link_bytes_per_s=2e9)
    assert controller.slot_sharing is None
    assert config.state_location == "redis://r:6379/0"
    never = PlatformConfig.create(state_dir=STATE, peer_link_bytes_per_s=0, slot_sharing=True)
    assert (never.controller.peer_stream, never.controller.slot_sharing) == (None, SlotSharingSettings())


def test_create_refuses_bad_settings_naming_them():
    with pytest.raises(ValueError, match="ControllerConfig.cpu_worker_slots_per_node must be an integer >= 1, got 0"):
        PlatformConfig.create(state_dir=STATE, cpu_worker_slots_per_node=0)
    with pytest.raises(ValueError, match="PlatformConfig.state_dir 'relative' must be an absolute path"):
        PlatformConfig.create(state_dir="relative")
    with pytest.raises(ValueError, match="PlatformConfig.repository_uri 'repo' must be an absolute path"):
        PlatformConfig.create(state_dir=STATE, repository_uri="repo")
    with pytest.raises(ValueError, match="PlatformConfig.peer_link_bytes_per_s must be a number >= 0"):
        PlatformConfig.create(state_dir=STATE, peer_link_bytes_per_s=-1.0)
    with pytest.raises(ValueError, match="PlatformConfig.port must be an integer in 1..65535, got 0"):
        PlatformConfig.create(state_dir=STATE, port=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_slots'"):
        PlatformConfig.create(state_dir=STATE, num_slots=2)
    with pytest.raises(ValueError, match="pass peer_link_bytes_per_s or peer_stream, not both"):
        PlatformConfig.create(state_dir=STATE, peer_link_bytes_per_s=1e9, peer_stream=None)
    with pytest.raises(ValueError, match="PlatformConfig.controller must be a controller.ControllerConfig, got dict"):
        PlatformConfig(controller={})


def test_joining_a_cluster_needs_redis_or_a_state_directory_every_node_sees():
    with pytest.raises(ValueError, match=r"joining the Ray cluster at head:6379 with the SQLite state store .*"
                                         r"\(--state-store redis://HOST:6379/0\), or --state-shared"):
        PlatformConfig.create(state_dir=STATE, ray_address="head:6379")
    with pytest.raises(ValueError, match="SQLite state store in 'sqlite:///srv/thaw.db'"):
        PlatformConfig.create(state_dir=STATE, ray_address="head:6379", state_store="sqlite:///srv/thaw.db")
    assert PlatformConfig.create(state_dir=STATE, ray_address="head:6379", state_store="redis://r:6379/0").ray_address
    assert PlatformConfig.create(state_dir=STATE, ray_address="head:6379", state_dir_shared=True).state_dir_shared
    assert PlatformConfig.create(state_dir=STATE).state_dir_shared is False  # a local Ray: SQLite is the default
    with pytest.raises(ValueError, match="state_dir_shared must be True or False"):
        PlatformConfig.create(state_dir=STATE, state_dir_shared="yes")


def test_head_only_needs_a_cluster_and_http_proxies_name_a_serve_proxy_location():
    with pytest.raises(ValueError, match="--head-only needs --address"):
        PlatformConfig.create(state_dir=STATE, head_only=True)
    config = PlatformConfig.create(state_dir=STATE, ray_address="head:6379", state_store="redis://r:6379/0",
                                   head_only=True, http_proxies="head-only")
    assert config.head_only and config.http_proxies == "head-only"
    assert PlatformConfig.create(state_dir=STATE).http_proxies == "every-node"  # Serve's own default
    with pytest.raises(ValueError, match="http_proxies must be one of every-node, head-only, got 'all'"):
        PlatformConfig.create(state_dir=STATE, http_proxies="all")


def test_a_services_resource_places_the_controller_and_every_gateway_replica():
    from infra.gateway_deployment import gateway_deployment
    from infra.platform_config import SERVICES_RESOURCE_AMOUNT

    config = PlatformConfig.create(state_dir=STATE, services_resource="thaw_services", num_gateway_replicas=2)
    assert config.services_resources == {"thaw_services": SERVICES_RESOURCE_AMOUNT}
    options = gateway_deployment(config.gateway_config()).ray_actor_options
    assert options == {"num_cpus": 0, "resources": {"thaw_services": SERVICES_RESOURCE_AMOUNT}}
    assert gateway_deployment(PlatformConfig.create(state_dir=STATE).gateway_config()).ray_actor_options == \
        {"num_cpus": 0}
    with pytest.raises(ValueError, match="services_resource must be a Ray resource name"):
        PlatformConfig.create(state_dir=STATE, services_resource="two words")


def test_an_admin_key_file_needs_keys():
    assert PlatformConfig.create(state_dir=STATE, admin_key_source="/run/secrets/admin").admin_key_source == \
        Path("/run/secrets/admin")
    with pytest.raises(ValueError, match="--admin-key-file needs API keys"):
        PlatformConfig.create(state_dir=STATE, admin_key_source="/run/secrets/admin", auth=False)
