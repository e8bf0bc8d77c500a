"""The Prometheus scrape token: a secret that opens ``GET /metrics`` and nothing else.

``/metrics`` names every tenant's models and their traffic, so it is not public: it answers the
admin key or this token (`infra.gateway_access`). A scraper should not hold the admin key,
which can deploy and delete models; the token can only read metrics. The operator writes a
random string into a file (``openssl rand -hex 32 > metrics_token``) and passes it to ``thaw
serve --metrics-token-file``; Prometheus sends it as a bearer token (its scrape config's
``authorization: {credentials_file: ...}``).

Only the token's SHA-256 travels to the gateway replicas (Ray Serve keeps a deployment's
arguments in its controller, where a plain secret would outlive the process); presented
tokens are hashed and compared in constant time. The token is a long random secret, so an
unsalted hash is enough: there is nothing to guess from a dictionary.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

MIN_TOKEN_CHARS = 16
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class MetricsToken:
    """A scrape token, held as the hex SHA-256 of the secret."""

    sha256_hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.sha256_hex, str) or not _SHA256_HEX.fullmatch(self.sha256_hex):
            raise ValueError("MetricsToken.sha256_hex must be 64 lowercase hex digits (MetricsToken.from_secret "
                             "makes one from the token itself)")

    @classmethod
    def from_secret(cls, secret: str) -> MetricsToken:
        """The token for `secret` (at least 16 characters, no whitespace: a generated string)."""
        if not isinstance(secret, str) or len(secret) < MIN_TOKEN_CHARS or any(c.isspace() for c in secret):
            raise ValueError(f"the metrics token must be at least {MIN_TOKEN_CHARS} characters with no spaces; "
                             "make one with `openssl rand -hex 32`")
        return cls(_digest(secret))

    def matches(self, presented: str) -> bool:
        """True when `presented` is the secret (constant-time comparison of the digests)."""
        return hmac.compare_digest(_digest(presented), self.sha256_hex)


def read_metrics_token_file(path: Path) -> MetricsToken:
    """The token in `path` (surrounding whitespace and the final newline ignored); `ValueError`
    naming the file when it cannot be read or holds no usable token."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"cannot read the metrics token file {str(path)!r} ({reason}); write a token into it, "
                         "e.g. `openssl rand -hex 32 > FILE`") from None
    try:
        return MetricsToken.from_secret(text.strip())
    except ValueError as exc:
        raise ValueError(f"the metrics token file {str(path)!r}: {exc}") from None


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()
