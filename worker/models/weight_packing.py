"""When a CPU engine pre-packs its linear weights for oneDNN: at load, or after it starts serving.

Why defer: packing (`kernels.cpu_linear`: oneDNN's reorder of every linear weight into its blocked
layout) costs ~0.6 s per GB of linear weights on the developers' 2-core VM, and done at load it
sat on every cold start's path: the coldstart model's (0.98 GB bf16) start from the DRAM tier went
from 0.70 s to 2.27 s when packing arrived (issue #38). Plain weights serve the same requests
(``F.linear``; measured on that model, a 128-token prefill 0.24 s plain against 0.21 s packed), so
an engine whose linear weights are larger than `EngineConfig.cpu_prepack_defer_bytes` starts on the
plain ones and packs one decoder layer (or the head) at a time while nothing waits for it: when
the engine is idle, or after a step when no request waits for its first token. No time to first
token pays for packing; a request that arrives mid-pack waits for at most one layer's reorder,
and running decodes get one layer's reorder added to one inter-token gap per layer.

Smaller models are packed at load (tens of milliseconds), where a request never meets a
half-packed model. Either way a layer's plain weight is released as it is packed
(`LlamaForCausalLM.prepack_layer_for_cpu(release_plain=True)`): the model's weights are views of
the buffer its own load made, so a bf16 model is held once.

Results differ between a plain and a packed layer by float rounding only (another GEMM library's
summation order), as between any two GEMM libraries.
"""

from __future__ import annotations

import logging
import time

from torch import nn

logger = logging.getLogger(__name__)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights packing would reorder: every ``nn.Linear`` of the model, plus the
    embedding matrix when the head is tied to it (the head gets its own packed copy)."""
    total = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        weight = model.embed_tokens.weight
        total += weight.numel() * weight.element_size()
    return total


class WeightPacking:
    """One engine's packing of its loaded model's linear weights (see the module docstring).

    ``defer_above_bytes``: pack at once when the linear weights are at most this many bytes (or
    when None), else leave every layer pending for `pack_next`. Single threaded: the caller (the
    engine's thread) calls `pack_next` between forward passes, never during one."""

    def __init__(self, model: nn.Module, defer_above_bytes: int | None) -> None:
        self._model = model
        self.num_bytes = linear_weight_bytes(model)
        self.deferred = defer_above_bytes is not None and self.num_bytes > defer_above_bytes
        # Decoder layers in order, then the head (`prepack_layer_for_cpu`'s numbering).
        self._pending = list(range(len(model.layers) + 1))
        self.num_packed = 0  # linear modules packed so far
        self.load_s = 0.0  # packing done on the load path
        self.later_s = 0.0  # packing done after the engine started serving
        if not self.deferred:
            start = time.perf_counter()
            while self._pending:
                self._pack(self._pending.pop(0))
            self.load_s = time.perf_counter() - start

    @property
    def done(self) -> bool:
        return not self._pending

    @property
    def num_pending_layers(self) -> int:
        return len(self._pending)

    def pack_next(self) -> int:
        """Packs the next pending layer; returns how many linear modules it swapped (0 when none
        was pending)."""
        if not self._pending:
            return 0
        start = time.perf_counter()
        swapped = self._pack(self._pending.pop(0))
        self.later_s += time.perf_counter() - start
        if not self._pending:
            logger.info("linear weights pre-packed for oneDNN after the start: %d layers, %.2f GB in %.2f s",
                        self.num_packed, self.num_bytes / 1e9, self.later_s)
        return swapped

    def _pack(self, layer: int) -> int:
        swapped = self._model.prepack_layer_for_cpu(layer, release_plain=True)
        self.num_packed += swapped
        return swapped

    @property
    def report(self) -> str:
        """How the weights were (or will be) packed, for the engine's load report."""
        if not self.deferred:
            return f"{self.num_packed} linear layers pre-packed for oneDNN in {self.load_s:.2f} s"
        return (f"linear weights ({self.num_bytes / 1e9:.2f} GB) serve plain and are pre-packed for oneDNN "
                f"layer by layer once serving leaves room")
