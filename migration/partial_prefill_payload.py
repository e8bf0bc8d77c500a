"""A half-computed prefill on its way from one instance to another: `PartialPrefillPayload`.

The message of the prefill hand-over (`migration.prefill_handoff`): what the source's
`export_partial_prefill` returns and the helper's `take_over_prefill` takes. In a module of its
own because both sides' endpoint interface (`migration.migration_endpoint`) names it and the
hand-over's driver imports that interface. It carries tensors, so it lives here and not in
`wire` (which imports no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from migration.kv_transport import KVPayload
from worker import RequestSnapshot

__all__ = ["PartialPrefillPayload"]


@dataclass(frozen=True)
class PartialPrefillPayload:
    """`worker.transfer.layer_handoff.PartialPrefill` on its way: the KV as a transport payload.

    hidden: [T, H] the state entering layer ``next_layer`` (None: the pass had not started)."""

    snapshot: RequestSnapshot
    next_layer: int
    hidden: torch.Tensor | None
    kv: KVPayload  # [min(next_layer, N), 2, n, block_size, Hkv, D]
