"""Dense attention with its log-sum-exp on CPU: Thaw's bf16 kernel where it applies, else PyTorch's.

Prefill attention on CPU comes down to one shape: a KV head's query rows (its GQA group folded into
rows) against contiguous keys and values, each row seeing a prefix of them (all of them, or up to
its own position). Cascade attention needs the log-sum-exp of each row as well, to merge the
prefix part with the tail part. Two implementations answer that one call:

* `flash_dense`: PyTorch's private CPU flash-attention op (the only public-ish op that returns the
  log-sum-exp), per-row limits as an additive mask;
* `kernel_dense`: Thaw's kernels at head size 64 or 128: in bfloat16 `cpu_prefill_attention.cpp`,
  VDPBF16PS tiles on a CPU with AVX512-BF16, ~2.6x the op's rate on the shared-prefix burst's shape
  (476 against 180 GFLOP/s, 31 tails' queries against a 1,024-token prefix, 2 threads); in float32
  `cpu_prefill_attention_f32.cpp`, query rows in vector lanes on any AVX-512 CPU, ~2.8x the op on a
  1,064-token causal prompt (338 against 120 GFLOP/s) and ~1.8x on that burst.

`dense_attention_for` picks one per (dtype, head size); both compute the same softmax up to
rounding (tested against a float32 softmax). Where the kernel applies, a cascade needs no
log-sum-exp merge at all: `fused_cascade_for` gives the kernel's one-pass cascade, each row's
online softmax running over the shared prefix and then over its own keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (q [H, M, D], k [H, N, D], v [H, N, D], limits [M] int32 or None, scale, bias) -> (out [H, M, D],
# lse [H, M] fp32). `bias` [M, N] is the limits as an additive mask in q's dtype, where the caller
# has it built already (the op takes masks that way; the kernel ignores it).
DenseAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]

KERNEL_HEAD_SIZES = (64, 128)


def flash_available() -> bool:
    """Whether this PyTorch has the CPU flash-attention op that returns the log-sum-exp."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def limits_bias(limits: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[M] int32 limits -> [M, N] additive mask (0 where key < limit, -inf elsewhere), as the op takes it."""
    visible = torch.arange(num_keys, device=limits.device) < limits.unsqueeze(-1).long()  # [M, N]
    return torch.zeros(visible.shape, dtype=dtype, device=limits.device).masked_fill_(~visible, float("-inf"))


def flash_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor | None,
                scale: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash op on the dense shape."""
    mask = bias if bias is not None or limits is None else limits_bias(limits, k.shape[1], q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, attn_mask=mask, scale=scale)[:2]
    return out[0], lse[0]  # [H, M, D], [H, M]


def kernel_dense(extension) -> DenseAttention:
    """Thaw's kernel (contiguous bf16 or float32 operands; limits None = every key)."""
    no_limits = torch.empty(0, dtype=torch.int32)

    def attend(q, k, v, limits, scale, bias=None):
        out, lse = extension.dense_prefill_attention(
            q.contiguous(), k.contiguous(), v.contiguous(),
            no_limits if limits is None else limits.to(torch.int32).contiguous(), float(scale))
        return out, lse

    return attend


# (q [Hkv, G*R, D], k_prefix [Hkv, P, D], v_prefix, k_suffix [Hkv, S, D], v_suffix, member_rows [n+1] int32,
# member_keys [n+1] int32, suffix_limits [R] int32, group G, scale) -> out [Hkv, G*R, D]: row g * R + r
# attends to the whole prefix and then to the first suffix_limits[r] keys of its member's suffix
# (member i: rows member_rows[i]:member_rows[i+1], keys member_keys[i]:member_keys[i+1]).
FusedCascade = Callable[..., torch.Tensor]


def kernel_cascade(extension) -> FusedCascade:
    """The kernel's cascade: both parts in one online softmax per row, no merge."""

    def attend(q, k_prefix, v_prefix, k_suffix, v_suffix, member_rows, member_keys, suffix_limits, group, scale):
        return extension.cascade_prefill_attention(
            q.contiguous(), k_prefix.contiguous(), v_prefix.contiguous(), k_suffix.contiguous(),
            v_suffix.contiguous(), member_rows, member_keys, suffix_limits, int(group), float(scale))

    return attend


# The extension's "was this dtype's kernel built" question (the CPU's ISA at build time decides).
_AVAILABLE = {torch.bfloat16: "prefill_attention_available", torch.float32: "prefill_attention_f32_available"}


def kernel_usable(extension, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the extension was built with the prefill kernel for `dtype` (bf16: AVX512-BF16 at
    build time; float32: AVX-512F)."""
    name = _AVAILABLE.get(dtype)
    return extension is not None and name is not None and getattr(extension, name, lambda: False)()


def _kernel_applies(extension, dtype: torch.dtype, head_size: int, use_kernel: bool) -> bool:
    return use_kernel and head_size in KERNEL_HEAD_SIZES and kernel_usable(extension, dtype)


def dense_attention_for(extension, dtype: torch.dtype, head_size: int, use_kernel: bool = True) -> DenseAttention:
    """The kernel for bf16 or float32 at head size 64 or 128 where it was built (and `use_kernel`),
    else the op."""
    return kernel_dense(extension) if _kernel_applies(extension, dtype, head_size, use_kernel) else flash_dense


def fused_cascade_for(extension, dtype: torch.dtype, head_size: int, use_kernel: bool = True) -> FusedCascade | None:
    """The kernel's one-pass cascade where the kernel applies, else None (two parts merged by their
    log-sum-exps, `kernels.cpu_cascade`)."""
    return kernel_cascade(extension) if _kernel_applies(extension, dtype, head_size, use_kernel) else None
