"""Triton kernels for attention over the paged KV cache: one launch per layer for a mixed
batch of decode rows and (chunked) prefill rows, plus the KV-cache write.

Attention kernel layout. A program owns one sequence, one tile of up to ``BLOCK_Q`` of its
new tokens, and one KV head; its ``BLOCK_M = BLOCK_Q * GROUP_P`` query rows are those tokens
times the query heads that share the KV head (GQA/MQA), so K/V are read once per group rather
than once per query head. It walks the sequence's block table over the keys the tile can see
(causal, and the sliding window if any), in flash-attention style: scores for one KV block,
an online softmax in float32, and the running output rescaled as the maximum moves. Decode
rows are simply tiles of one token, so decode and prefill share one code path and one launch.
Gemma 2's score soft-capping is a compile-time switch (``USE_SOFTCAP``), applied to the
natural-log score before the base-2 softmax (see `kernels.triton_decode`).

Decode-only batches (every row one new token) go to the split-KV kernel in
`kernels.triton_decode` instead, which spreads a long context over many programs.

Offsets into the KV pool are computed in 64 bits: ``block_id * stride`` passes 2**31
elements at a few million blocks, well within a large GPU's pool.

This module imports `triton` at import time; `kernels.select` imports it only when asked for
the Triton backend (on CUDA, or explicitly, e.g. under ``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_backend import check_gqa_heads, check_softcap
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_decode import capped_scores, paged_decode_attention, score_scales
from kernels.triton_interpreter import triton_interpreter_enabled


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2; with USE_SOFTCAP, scale / softcap
    cap_log2e,  # softcap * log2(e); ignored unless USE_SOFTCAP
    sliding_window,  # keys with position <= query position - window are hidden; ignored unless USE_WINDOW
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two (80/96/112 are masked)
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens)
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # only for Triton's interpreter, whose bf16 tl.dot is wrong
    PRECISION: tl.constexpr,  # "ieee" for float32 (tf32 would cost ~1e-3 of accuracy), else "tf32" (unused)
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = q_tile * BLOCK_Q
    if tile_start >= q_len:
        return  # this sequence has fewer new tokens than the longest in the batch
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # absolute position of the sequence's first new token

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_P  # [BLOCK_M] query token index within the sequence
    g = rows % GROUP_P
    row_valid = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_P)
    d_valid = d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q_offs = q_rows[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, D]
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = first_pos + tok  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    # Keys this tile can see: [key_lo, key_hi).
    key_hi = first_pos + tl.minimum(tile_start + BLOCK_Q, q_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_pos + tile_start - sliding_window + 1, 0)
    s = tl.arange(0, BLOCK_SIZE)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for j in range(key_lo // BLOCK_SIZE, tl.cdiv(key_hi, BLOCK_SIZE)):
        block_id = tl.load(table_row + j).to(tl.int64)
        k_offs = block_id * stride_kb + s.to(tl.int64)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        v_offs = block_id * stride_vb + s.to(tl.int64)[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=d_valid[None, :], other=0.0)  # [BLOCK_SIZE, D]
        v = tl.load(v_cache_ptr + v_offs, mask=d_valid[None, :], other=0.0)  # [BLOCK_SIZE, D]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_SIZE], float32
        if USE_SOFTCAP:
            scores = capped_scores(scores, cap_log2e)
        k_pos = j * BLOCK_SIZE + s
        visible = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 stays finite.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = q_rows[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # a padding token: no slot
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM_P)
    mask = d < HEAD_DIM
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block_id * stride_kcb + offset * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")


class TritonAttentionBackend:
    """`AttentionBackend` implemented with the Triton kernels above."""

    name = "triton"

    def __init__(self, block_m: int = 64, decode_block_m: int = 16, *, split_decode: bool = True,
                 decode_block_n: int = 64, decode_num_warps: int = 4, decode_num_stages: int = 2,
                 decode_waves: int = 4) -> None:
        # Query rows per program for batches with prefills, and for decode-only batches run by
        # the mixed kernel (where a tile is one token and the rows are the GQA group).
        self.block_m = block_m
        self.decode_block_m = decode_block_m
        # Decode-only batches go to the split-KV kernel (`kernels.triton_decode`) unless turned off:
        # key tokens per iteration, and its launch shape.
        self.split_decode = split_decode
        self.decode_block_n = decode_block_n
        self.decode_num_warps = decode_num_warps
        self.decode_num_stages = decode_num_stages
        self.decode_waves = decode_waves  # programs per SM the split count aims for
        self._num_sms: dict[int, int] = {}

    def num_sms(self, device: torch.device) -> int:
        """The device's SM count (read once per device); 4 under Triton's interpreter, so the
        CPU tests exercise several splits."""
        if device.type != "cuda":
            return 4
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        _check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
        _write_kv_kernel[(num_tokens, num_kv_heads)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        )

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        key: torch.Tensor | None = None,  # [T, Hkv, D], unused: the kernels read the cache in place
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        check_gqa_heads(num_heads, num_kv_heads)
        check_softcap(softcap)
        _check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
        block_size = key_cache.shape[1]
        if block_size < 16 or block_size & (block_size - 1):
            # tl.dot tiles need >= 16 rows; arange needs a power of two.
            raise ValueError(f"the Triton attention kernel needs a power-of-two block_size >= 16, got {block_size}")
        out = torch.empty_like(query)
        if num_tokens == 0:
            return out
        if self.split_decode and metadata.max_query_len == 1:
            return paged_decode_attention(
                query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len,
                scale, sliding_window, softcap, num_sms=self.num_sms(query.device), block_n=self.decode_block_n,
                num_warps=self.decode_num_warps, num_stages=self.decode_num_stages, waves=self.decode_waves,
                dot_in_fp32=query.dtype == torch.bfloat16 and triton_interpreter_enabled(),
            )
        group = num_heads // num_kv_heads
        group_p = triton.next_power_of_2(group)
        block_m = self.decode_block_m if metadata.max_query_len == 1 else self.block_m
        block_q = max(1, block_m // group_p)
        grid = (metadata.num_seqs, triton.cdiv(metadata.max_query_len, block_q), num_kv_heads)
        qk_scale, cap_log2e = score_scales(scale, softcap)
        _paged_attention_kernel[grid](
            out, query, key_cache, value_cache,
            metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            qk_scale, cap_log2e, sliding_window or 0,
            query.stride(0), query.stride(1),
            out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            metadata.block_tables.stride(0),
            GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
            HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=key_cache.shape[1], USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
            DOT_IN_FP32=query.dtype == torch.bfloat16 and triton_interpreter_enabled(),
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )
        return out
