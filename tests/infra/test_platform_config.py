"""`PlatformConfig`'s safety checks (issue 19, items 3, 4 and 10): ``--no-auth`` only on a
loopback host, a metrics token only with keys, and what the gateway is told."""

from __future__ import annotations

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
        PlatformConfig(state_dir=STATE, auth=False, host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_no_auth_is_fine_on_loopback_and_keys_anywhere(host):
    assert PlatformConfig(state_dir=STATE, auth=False, host=host).host == host
    assert PlatformConfig(state_dir=STATE, host="0.0.0.0").auth


def test_the_metrics_token_needs_keys_and_the_gateway_gets_port_timeout_and_digest():
    with pytest.raises(ValueError, match="--metrics-token-file needs API keys"):
        PlatformConfig(state_dir=STATE, auth=False, metrics_token_file=STATE / "token")
    config = PlatformConfig(state_dir=STATE, port=8123, metrics_token_file=str(STATE / "token"),
                            gateway_body_timeout_s=5.0)
    assert config.metrics_token_file == STATE / "token"
    gateway = config.gateway_config("ab" * 32)
    assert (gateway.http_port, gateway.body_timeout_s, gateway.metrics_token_sha256) == (8123, 5.0, "ab" * 32)
    with pytest.raises(ValueError, match="gateway_body_timeout_s must be a number of seconds > 0"):
        PlatformConfig(state_dir=STATE, gateway_body_timeout_s=0)


def test_defaults_agree_with_the_gateway():
    assert LOOPBACK_HOSTS == LOOPBACK_NAMES
    assert PlatformConfig(state_dir=STATE).gateway_body_timeout_s == DEFAULT_BODY_TIMEOUT_S
    assert PlatformConfig(state_dir=STATE).gateway_config().body_timeout_s == DEFAULT_BODY_TIMEOUT_S
