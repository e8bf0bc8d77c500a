"""Linear layers with weights pre-packed once for oneDNN, for float32 and bfloat16 serving on CPU.

Why: a decode step multiplies a few dozen activation rows by every weight matrix. At that
shape ``F.linear`` (MKL ``sgemm`` on a plain row-major weight) re-packs panels of the weight on
every call and runs far below the machine's GEMM rate: measured on the developers' 2-core VM,
M=8 rows reach 23-65 GFLOP/s and M=32 rows 84-115, against ~190 for large M. oneDNN's inner
product with the weight reordered once into its blocked layout reaches 53-107 at M=8 and
115-134 at M=32 on the same shapes (1.2-2.3x), uses the same memory as the plain weight, and
accepts any number of rows. At M=1-2 and at very large M it is 5-10% slower than
``F.linear``; decode batches of a serving engine live in between, and prefill chunks are few.

What it changes: results differ from ``F.linear`` by float32 rounding only (another
summation order, ~1e-4 absolute on activations of order 10), like any other GEMM library.

At one or two rows (batch-1 decode) a linear layer is one pass over its weight, and Thaw's own
GEMV kernel on the plain layout (`cpu_gemv.cpp`: 4 weight rows streamed at a time, split over
the threads by output rows) is the fastest way through it: a 100M-model float32 decode step took
15.1 ms per token with it, 16.6 with the blocked weight and 35.8 with MKL's ``F.linear`` (which
read the out-of-cache 98 MB head at 8 GB/s, against the kernel's 20.6), measured interleaved in
one engine (2026-11-27). So by default the plain float32 weight is kept too and rows <=
`PLAIN_MAX_ROWS` use it (through ``F.linear`` where the CPU extension cannot be built): the price
is a second copy of every linear weight in host memory (``keep_plain_weight=False`` drops it).

bfloat16 (what checkpoints ship in) goes through oneDNN's bfloat16 inner product (AVX512-BF16 dot
products, AMX tiles where the CPU has them; float32 accumulation, one rounding of the output). On
the developers' AVX512-BF16 VM (no AMX), packed bfloat16 against packed float32 on the 100M
model's shapes: 1.6-2.0x at M=8-32, and against ``F.linear`` in bfloat16 (which has no packed
weight and re-packs on every call) 1.2-2.0x at every M including 1, so no plain copy is kept
for bfloat16. Where oneDNN reports no bfloat16 support (a CPU without AVX512-BF16/AMX) the
layers stay ``nn.Linear`` and say why.

`prepack_linear_layers` swaps every ``nn.Linear`` of a loaded model for a `PrepackedLinear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows the weight layout is tuned for; any row count works. 32 is a typical decode batch.
DEFAULT_BATCH_HINT = 32
# Row counts served from the plain float32 weight when it is kept (measured: M=1-2 plain wins, M>=4 packed).
PLAIN_MAX_ROWS = 2
PREPACK_DTYPES = (torch.float32, torch.bfloat16)
_NO_BIAS = torch.empty(0)  # the GEMV kernel's "no bias"


def _gemv_kernel():
    """The CPU extension's float32 GEMV (`cpu_gemv.cpp`), or None where it cannot be built."""
    from kernels.cpu_extension import try_build_cpu_extension

    ext, _ = try_build_cpu_extension()
    return None if ext is None else ext.linear_gemv


def cpu_prepack_unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when `PrepackedLinear` can serve this dtype/device, else why not (for the log)."""
    if device.type != "cpu":
        return f"device is {device.type}, not cpu"
    if dtype not in PREPACK_DTYPES:
        return f"dtype is {dtype}, only float32 and bfloat16 are pre-packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build lacks the oneDNN linear ops"
    if dtype == torch.bfloat16 and not _onednn_has_bfloat16():
        return "oneDNN has no bfloat16 kernels for this CPU (needs AVX512-BF16 or AMX)"
    return None


def _onednn_has_bfloat16() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


class PrepackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's blocked layout (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,  # weight: [N, K], bias: [N]
                 batch_hint: int = DEFAULT_BATCH_HINT, keep_plain_weight: bool = True) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
        reason = cpu_prepack_unavailable_reason(weight.dtype, weight.device)
        if reason is not None:
            raise ValueError(f"cannot pre-pack this weight: {reason}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # A oneDNN tensor, not a Parameter: it is never trained and state_dict must not
            # try to serialise the opaque layout.
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().contiguous()
        # bfloat16's packed GEMV beats the plain layout even at one row (module docstring).
        keep_plain = keep_plain_weight and weight.dtype == torch.float32
        self.plain_weight = weight.detach().contiguous() if keep_plain else None  # [N, K] or None
        self._gemv = _gemv_kernel() if keep_plain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.plain_weight is not None and x.shape[0] <= PLAIN_MAX_ROWS:
            if self._gemv is not None and x.dim() == 2 and x.stride(-1) == 1:
                return self._gemv(x, self.plain_weight, self.bias if self.bias is not None else _NO_BIAS)
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:  # [N, K]
        """The weight back in plain row-major layout (for code that ships weights elsewhere)."""
        return self.plain_weight if self.plain_weight is not None else self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linear_layers(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT,
                          keep_plain_weight: bool = True) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by a `PrepackedLinear`; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PrepackedLinear(child.weight, child.bias, batch_hint, keep_plain_weight))
                replaced += 1
    return replaced
