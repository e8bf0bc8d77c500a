"""`MetricsToken`: only a digest is held, the secret matches and nothing else does, and the
token file's problems are named."""

from __future__ import annotations

import hashlib

import pytest

from infra.gateway_auth import GatewayAuth
from infra.metrics_token import MetricsToken, read_metrics_token_file

SECRET = "0123456789abcdef0123"


def test_the_token_keeps_only_the_digest_and_matches_the_secret_alone():
    token = MetricsToken.from_secret(SECRET)
    assert token.sha256_hex == hashlib.sha256(SECRET.encode()).hexdigest()
    assert SECRET not in repr(token)
    assert token.matches(SECRET)
    assert not token.matches(SECRET + "x") and not token.matches("") and not token.matches(SECRET.upper())


def test_the_auth_recognises_the_token_in_a_bearer_header_only():
    auth = GatewayAuth(admin_key="admin-key-0123456789", metrics_token=MetricsToken.from_secret(SECRET))
    assert auth.is_metrics_token(f"Bearer {SECRET}") and auth.is_metrics_token(f"bearer  {SECRET} ")
    for header in (None, "", SECRET, f"Basic {SECRET}", "Bearer admin-key-0123456789"):
        assert not auth.is_metrics_token(header), header
    assert not GatewayAuth(admin_key="admin-key-0123456789").is_metrics_token(f"Bearer {SECRET}")


def test_weak_tokens_and_bad_digests_are_refused():
    for weak in ("short", "with space 0123456789", ""):
        with pytest.raises(ValueError, match="at least 16 characters with no spaces; make one with `openssl rand"):
            MetricsToken.from_secret(weak)
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        MetricsToken("ABC")


def test_the_file_is_read_with_its_newline_and_its_problems_named(tmp_path):
    path = tmp_path / "metrics_token"
    path.write_text(f"  {SECRET}\n", encoding="utf-8")
    assert read_metrics_token_file(path).matches(SECRET)
    with pytest.raises(ValueError, match=r"cannot read the metrics token file '.*missing' \(No such file"):
        read_metrics_token_file(tmp_path / "missing")
    path.write_text("short\n", encoding="utf-8")
    with pytest.raises(ValueError, match="file '.*metrics_token': the metrics token must be at least 16"):
        read_metrics_token_file(path)
