"""The per-layer readiness interface shared by every way a worker can get its weights.

A worker that starts before all of its weights are in (BlitzScale's layer-wise start) needs only
to ask "is layer k here yet?" and "give me layer k when it is". The SSD/DRAM path
(`ThawCheckpointLoader`) and the peer-streaming path (`LayerStreamReceiver`) both answer these
questions, so the worker is written once against this protocol and does not care which path the
controller chose. Layers are numbered as in the thaw format: -1 the embedding group, 0..N-1 the
decoder layers, N the final norm and head.

The protocol is structural (`typing.Protocol`): `ThawCheckpointLoader` satisfies it without
inheriting from it. It holds only the three waiting methods because that is all both sources
have in common today (the loader knows its layer count as ``loader.index.num_layers``, the
receiver as ``receiver.num_layers``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LayerReadiness(Protocol):
    """Per-layer access to weights that are still arriving.

    Contract, for every implementation: a layer is reported ready only once all of its bytes are in
    (and verified, where the source has checksums); once anything fails, every current and later
    wait raises that error, so a tensor is never handed out from a transfer known to be broken;
    a wait that runs past `timeout_s` raises TimeoutError naming what it waited for.
    """

    def layer_ready(self, layer: int) -> bool:
        """Whether every byte of `layer` is in (False while unknown, and after any failure)."""
        ...

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until `layer` is in; its tensors by name."""
        ...

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Block until every layer is in; all tensors by name, in layer order."""
        ...
