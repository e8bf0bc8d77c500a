"""Layers from a running peer, and from the tier loader if the peer goes away: `FallbackLayers`.

Scale-out by streaming (`LayerStreamReceiver`) depends on a peer that may die, stall or be
stopped mid-stream. The new instance must then still come up, from the node's tier (DRAM, SSD or
the repository) like any cold start, without throwing away the layers that did arrive. This wraps
the two behind the one `LayerReadiness` protocol the engine consumes (`worker.loading.layer_gate`):

- layers are taken from the primary (the stream) until a wait on it raises `PeerStreamError`;
- from then on every layer comes from the fallback, opened lazily exactly once (a
  `ThawCheckpointLoader` over the tier's copy: its reads start when it is opened);
- layers already handed out stay valid (the engine holds them; the receiver's buffer lives as long
  as they do), so a stream that failed at layer k costs re-reading only what the engine still
  needs, and the result is the same weights either way;
- an error of the fallback itself is final (raised to every waiter, like any source's).

`switched` and `reason` say whether and why the fallback was taken, for the worker's load report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from loader.layer_readiness import LayerReadiness
from loader.peer_link import PeerStreamError

logger = logging.getLogger(__name__)


class FallbackLayers:
    """`LayerReadiness` over a primary source with a lazily opened fallback (see the module docstring)."""

    def __init__(self, primary: LayerReadiness, open_fallback: Callable[[], LayerReadiness], *,
                 describe_primary: str = "the peer stream") -> None:
        self._primary = primary
        self._open_fallback = open_fallback
        self._describe_primary = describe_primary
        self._lock = threading.Lock()
        self._fallback: LayerReadiness | None = None
        self._fallback_error: BaseException | None = None
        self.reason: str | None = None  # why the fallback was taken (None: it was not)

    @property
    def switched(self) -> bool:
        return self.reason is not None

    @property
    def fallback(self) -> LayerReadiness | None:
        """The fallback source once opened (e.g. to close it when the engine ends)."""
        return self._fallback

    def _switch(self, exc: PeerStreamError) -> LayerReadiness:
        with self._lock:
            if self._fallback_error is not None:
                raise self._fallback_error
            if self._fallback is None:
                self.reason = f"{self._describe_primary} failed at layer {exc.layer}: {exc}"
                logger.warning("falling back to the tier loader: %s", self.reason)
                try:
                    self._fallback = self._open_fallback()
                except BaseException as open_exc:
                    self._fallback_error = open_exc
                    raise
            return self._fallback

    def _source(self) -> LayerReadiness:
        with self._lock:
            if self._fallback_error is not None:
                raise self._fallback_error
            return self._fallback if self._fallback is not None else self._primary

    def layer_ready(self, layer: int) -> bool:
        try:
            source = self._source()
        except BaseException:  # noqa: BLE001 - a failed source has no ready layer
            return False
        return source.layer_ready(layer)  # a failed stream answers False; the next wait switches

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        source = self._source()
        if source is self._primary:
            try:
                return self._primary.wait_layer(layer, timeout_s)
            except PeerStreamError as exc:
                source = self._switch(exc)
        return source.wait_layer(layer, timeout_s)

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        source = self._source()
        if source is self._primary:
            try:
                return self._primary.wait_all(timeout_s)
            except PeerStreamError as exc:
                source = self._switch(exc)
        return source.wait_all(timeout_s)
