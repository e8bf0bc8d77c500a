"""FallbackLayers with fake sources: layers from the stream until it fails, then from the tier
loader, opened once; a failing fallback is final. (A real killed peer: tests/worker/loading/test_stream_fallback.py.)"""

from __future__ import annotations

import pytest
import torch

from loader import FallbackLayers, LayerReadiness, PeerStreamError


class Source:
    """Layer k is {"w{k}": tensor filled with `value`}; fails with `error` from layer `fail_at` on."""

    def __init__(self, value: float, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.value, self.fail_at, self.error = value, fail_at, error
        self.waited: list[int] = []

    def _check(self, layer: int) -> None:
        if self.fail_at is not None and layer >= self.fail_at:
            raise self.error

    def layer_ready(self, layer: int) -> bool:
        return self.fail_at is None or layer < self.fail_at

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        self.waited.append(layer)
        self._check(layer)
        return {f"w{layer}": torch.full((2,), self.value)}

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        self._check(10**9)
        return {"all": torch.full((2,), self.value)}


def test_layers_come_from_the_stream_until_it_fails_then_from_the_tier_opened_once():
    stream = Source(1.0, fail_at=1, error=PeerStreamError("peer 0 closed the connection", peer_rank=0, layer=1))
    tier = Source(2.0)
    opened = []
    layers = FallbackLayers(stream, lambda: opened.append(1) or tier)
    assert isinstance(layers, LayerReadiness)
    assert layers.layer_ready(0) and not layers.layer_ready(1)
    assert float(layers.wait_layer(-1)["w-1"][0]) == 1.0 and float(layers.wait_layer(0)["w0"][0]) == 1.0
    assert not layers.switched and opened == []
    assert float(layers.wait_layer(1)["w1"][0]) == 2.0  # the stream failed here: the tier serves it
    assert layers.switched and "failed at layer 1" in layers.reason and layers.fallback is tier
    assert float(layers.wait_layer(2)["w2"][0]) == 2.0 and float(layers.wait_all()["all"][0]) == 2.0
    assert opened == [1] and stream.waited == [-1, 0, 1] and tier.waited == [1, 2]
    assert layers.layer_ready(5)  # asked of the tier now


def test_other_stream_errors_are_not_swallowed():
    layers = FallbackLayers(Source(1.0, fail_at=0, error=TimeoutError("layer 0 not in after 1 s")), lambda: Source(2.0))
    with pytest.raises(TimeoutError, match="layer 0"):
        layers.wait_layer(0)
    assert not layers.switched


def test_a_fallback_that_cannot_open_is_final():
    def cannot_open():
        raise FileNotFoundError("the SSD copy is gone")

    layers = FallbackLayers(Source(1.0, fail_at=0, error=PeerStreamError("gone", peer_rank=0, layer=0)), cannot_open)
    for _ in range(2):
        with pytest.raises(FileNotFoundError, match="SSD copy is gone"):
            layers.wait_layer(0)
    assert not layers.layer_ready(0)
    with pytest.raises(FileNotFoundError):
        layers.wait_all()
