"""The CPU serving backend: the reference for prefill rows, a C++ kernel for decode rows.

Decode steps dominate a continuous-batching engine, and on CPU the reference's decode path
spends most of its time copying each sequence's context out of the block pool for SDPA.
`cpu_decode_attention.cpp` reads K/V through the block table instead (float32 or bfloat16 storage,
float32 arithmetic, exact two-pass softmax, parallel over sequence x KV head, Gemma 2's score
soft-capping when asked).
It is part of Thaw's one CPU extension (`cpu_extension.py`: built once, cached in the checkout);
if that cannot be built, `get_attention_backend` says why and the engine uses the reference
everywhere: slower, same results. Prefill chunks that share a cached prefix (a burst behind one
system prompt) attend to it in one call (`cpu_cascade.py`); other prefill rows take the reference.
At head size 64 or 128 those cascades and whole prompts (plain causal attention) go through Thaw's
prefill kernels (`cpu_dense_attention.py`) instead of PyTorch's flash op: in bfloat16 on a CPU with
AVX512-BF16 (prefill attention was about half of a bf16 step in the shared-prefix burst), in
float32 on any AVX-512 CPU (a third of a float32 burst's time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.attention_backend import check_gqa_heads, check_softcap
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_cascade import cascade_available, plan_cascades, run_cascade
from kernels.cpu_dense_attention import dense_attention_for, flash_dense, fused_cascade_for
from kernels.reference import ReferenceAttentionBackend, SdpaCall

logger = logging.getLogger(__name__)

# Storage dtypes the C++ kernel reads (others, e.g. float16, take the reference path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _DecodePlan:
    rows: torch.Tensor  # [Bd] int64 query rows of the decode sequences
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [Bd] int32
    every_row: bool  # every row of the step decodes (rows is 0..T-1): no gather or scatter needed


class CpuAttentionBackend(ReferenceAttentionBackend):
    """`AttentionBackend` for CPU serving; identical results to the reference (tested)."""

    name = "cpu"

    def __init__(self, extension, cascade: bool | None = None, prefill_kernel: bool = True) -> None:
        """`cascade`: prefill chunks behind one cached prefix attend to it together
        (`kernels.cpu_cascade`); None = wherever this PyTorch can. `prefill_kernel`: cascades
        and whole prompts use Thaw's prefill kernels where they were built (False: PyTorch's op)."""
        super().__init__()
        self._ext = extension
        self._cascade = cascade_available() if cascade is None else cascade
        self._prefill_kernel = prefill_kernel
        # (dtype, head size) -> (dense, fused): chosen once, not in every layer of every step.
        self._prefill_paths: dict[tuple[torch.dtype, int], tuple] = {}

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        key: torch.Tensor | None = None,  # [T, Hkv, D]: the step's own rows (see `AttentionBackend`)
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        if query.dtype not in KERNEL_DTYPES or not query.dtype == key_cache.dtype == value_cache.dtype:
            return super().paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                                           key, value)
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        check_gqa_heads(num_heads, num_kv_heads)
        check_softcap(softcap)
        block_size = key_cache.shape[1]
        cascades = ()
        if self._cascade and sliding_window is None and softcap is None:
            group_size = num_heads // num_kv_heads
            cascades = self._cached(metadata, ("cascade", block_size, query.dtype, group_size),
                                    lambda: plan_cascades(metadata, block_size, query.device, dtype=query.dtype,
                                                          group_size=group_size))
        has_decode = 1 in metadata.query_lens_host
        if not cascades and not has_decode:
            return super().paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                                           key, value)
        if has_decode and not cascades:
            decode = self._cached(metadata, ("decode",), lambda: self._decode_plan(metadata))
            if decode.every_row and query.is_contiguous():  # a decode-only step: straight into out
                out = torch.empty_like(query)  # [B, Hq, D]
                self._ext.paged_decode_attention(out, query, key_cache, value_cache, decode.block_tables,
                                                 decode.seq_lens, float(scale), int(sliding_window or 0),
                                                 float(softcap or 0.0))
                return out
        exclude = frozenset().union(*(group.seq_ids for group in cascades))
        prefill = self._plan_for(metadata, block_size, sliding_window, query.device, include_decode=False,
                                 exclude=exclude)
        out = self._run(prefill, query, key_cache, value_cache, scale, softcap, key, value)
        dense, fused = self._prefill_path(query.dtype, query.shape[-1])
        for group in cascades:
            run_cascade(group, query, key_cache, value_cache, scale, out, dense, fused)
        if not has_decode:
            return out
        decode = self._cached(metadata, ("decode",), lambda: self._decode_plan(metadata))
        q = query.index_select(0, decode.rows)  # [Bd, Hq, D], contiguous
        o = torch.empty_like(q)
        # The kernel's "no window" and "no cap" are both 0.
        self._ext.paged_decode_attention(o, q, key_cache, value_cache, decode.block_tables, decode.seq_lens,
                                         float(scale), int(sliding_window or 0), float(softcap or 0.0))
        out.index_copy_(0, decode.rows, o)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: SdpaCall, scale: float,
                softcap: float | None) -> torch.Tensor:  # q: [B, Hq, Q, D]; keys/values: [B, Hkv, L, D]
        """A whole prompt (plain causal attention, one sequence) through the dense kernel where it
        applies; everything else as the reference attends it."""
        whole_prompt = call.mask is None and not call.is_decode and softcap is None
        dense = self._prefill_path(q.dtype, q.shape[-1])[0] if whole_prompt else None
        if dense is None or dense is flash_dense or keys.dtype != q.dtype or q.shape[0] != 1:
            return super()._attend(q, keys, values, call, scale, softcap)
        _, num_heads, num_rows, dim = q.shape
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        # Row g * Q + i of a KV head's folded rows is query i of head g: it sees keys 0..i.
        limits = self._cached_limits(num_rows, group)
        out, _ = dense(q[0].reshape(num_kv_heads, group * num_rows, dim), keys[0], values[0], limits, scale)
        return out.view(1, num_heads, num_rows, dim)  # [Hkv, G*Q, D] is [Hq, Q, D]

    def _prefill_path(self, dtype: torch.dtype, head_size: int) -> tuple:
        """The (dense, fused) attention functions for prefill rows of this dtype and head size
        (`kernels.cpu_dense_attention`); fused is None where only the two-part cascade applies."""
        key = (dtype, head_size)
        if key not in self._prefill_paths:
            self._prefill_paths[key] = (dense_attention_for(self._ext, dtype, head_size, self._prefill_kernel),
                                        fused_cascade_for(self._ext, dtype, head_size, self._prefill_kernel))
        return self._prefill_paths[key]

    def _cached_limits(self, num_rows: int, group: int) -> torch.Tensor:  # [G * Q] int32
        return self._cached(self._plan_metadata, ("causal_limits", num_rows, group),
                            lambda: torch.arange(1, num_rows + 1, dtype=torch.int32).repeat(group))

    @staticmethod
    def _decode_plan(metadata: AttentionMetadata) -> _DecodePlan:
        ids = [b for b, q_len in enumerate(metadata.query_lens_host) if q_len == 1]
        starts = [0]
        for q_len in metadata.query_lens_host:
            starts.append(starts[-1] + q_len)
        index = torch.tensor(ids, device=metadata.block_tables.device)
        return _DecodePlan(
            rows=torch.tensor([starts[b] for b in ids], device=metadata.block_tables.device),
            block_tables=metadata.block_tables.index_select(0, index).to(torch.int32).contiguous(),
            seq_lens=metadata.seq_lens.index_select(0, index).to(torch.int32).contiguous(),
            every_row=len(ids) == len(metadata.query_lens_host),
        )
