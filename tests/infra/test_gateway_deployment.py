"""The gateway's Serve deployment: its queue is bounded (a fast 503 with Retry-After, not an
unbounded pile-up) and its settings are validated (issue 19, item 4). No Ray is started:
`serve.deployment` only builds the description Serve would run."""

from __future__ import annotations

import dataclasses

import pytest

from infra.gateway_deployment import GatewayDeploymentConfig, gateway_deployment
from infra.metrics_token import MetricsToken

CONFIG = GatewayDeploymentConfig(namespace="thaw", controller_name="thaw-controller", state_store="/tmp/state/")


def test_the_deployment_bounds_ongoing_and_queued_requests_and_answers_503_beyond():
    deployment = gateway_deployment(CONFIG)
    assert (deployment.max_ongoing_requests, deployment.max_queued_requests) == (4096 + 512, 1024)
    assert (deployment.backpressure_config.status_code, deployment.backpressure_config.retry_after_s) == (503, 1.0)
    tuned = gateway_deployment(dataclasses.replace(CONFIG, max_ongoing_requests=8, max_queued_requests=2,
                                                   retry_after_s=3.0))
    assert (tuned.max_ongoing_requests, tuned.max_queued_requests) == (8 + 64, 2)  # headroom over the app's bound
    assert tuned.backpressure_config.retry_after_s == 3.0


@pytest.mark.parametrize("field, value, words", [
    ("max_queued_requests", 0, "max_queued_requests must be an integer >= 1"),
    ("max_queued_requests", -1, "max_queued_requests must be an integer >= 1"),  # Serve's "no bound"
    ("body_timeout_s", 0.0, "body_timeout_s must be a finite number of seconds > 0"),
    ("body_timeout_s", float("inf"), "body_timeout_s must be a finite number of seconds > 0"),
    ("retry_after_s", -1.0, "retry_after_s must be a finite number of seconds > 0"),
    ("http_port", 70000, "http_port must be None or a port in 1..65535"),
    ("metrics_token_sha256", "secret-in-the-clear", "64 lowercase hex digits"),
])
def test_bad_settings_are_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(CONFIG, **{field: value})


def test_a_scrape_token_needs_auth():
    digest = MetricsToken.from_secret("0123456789abcdef0123").sha256_hex
    assert dataclasses.replace(CONFIG, metrics_token_sha256=digest).metrics_token_sha256 == digest
    with pytest.raises(ValueError, match="metrics_token_sha256 needs auth"):
        dataclasses.replace(CONFIG, auth=False, metrics_token_sha256=digest)
