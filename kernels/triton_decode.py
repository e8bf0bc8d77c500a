"""Split-KV ("flash-decoding") Triton kernels for decode-only batches over the paged KV cache.

Why a second kernel: in a decode step every sequence has one new token, so the mixed kernel in
`kernels.triton_attention` launches one program per (sequence, KV head), each walking its whole
context 16 tokens at a time. On an H100 (132 SMs) a batch of 16 sequences of a Llama-3-8B-like
layer (8 KV heads) is 128 programs: too few to keep HBM busy, and each program has only one
16-token block in flight. Measured there (bench/kernels.py, bf16): 23% of peak HBM bandwidth at
batch 16 x 4096 tokens, 1.7% at batch 1 x 32768, while batch 256 reached 78%.

So a decode step is split along the context as well: program (sequence, KV head, split) reads
``split_tokens`` of the context, ``BLOCK_N`` tokens per iteration (several KV blocks gathered
through the block table at once, so more loads are in flight), and keeps an online softmax in
float32 for the group of query heads that share the KV head. With one split the program writes
the normalised output directly; with several it writes its unnormalised partial output, maximum
and sum, and a second small kernel merges the splits (log-sum-exp rescaling). The number of
splits is chosen on the host from the batch's longest context and the GPU's SM count, so the
grid never needs a device-to-host read.

Both Triton attention kernels work in base 2 (``exp2``, with log2(e) folded into the score scale).
Gemma 2's soft-capping, ``softcap * tanh(s / softcap)``, is defined on the natural-log score s, so
under the ``USE_SOFTCAP`` switch the kernels scale q.k by ``scale / softcap``, take the tanh, and only
then multiply by ``softcap * log2(e)`` (`score_scales`, `capped_scores`); without it the kernels
compute exactly what they did before. Triton has no portable tanh (the interpreter lacks
libdevice), so it is ``2 * sigmoid(2x) - 1``, whose error is absolute, about a float32 ulp of 1
(6e-8), times the cap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2e) for the kernels: q.k times qk_scale is the base-2 score without a cap
    (``scale * log2(e)``, cap_log2e unused), or ``scale * q.k / softcap`` with one, which
    `capped_scores` turns into the capped base-2 score."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


@triton.jit
def capped_scores(x, cap_log2e):
    """softcap * tanh(s / softcap) * log2(e), given x = s / softcap (tanh as 2 * sigmoid(2x) - 1)."""
    return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * cap_log2e


@triton.jit
def _decode_split_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e); with USE_SOFTCAP, scale / softcap (see `score_scales`)
    cap_log2e,  # softcap * log2(e); ignored unless USE_SOFTCAP
    sliding_window,
    split_tokens,  # context tokens per split, a multiple of BLOCK_N
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, ROWS: tl.constexpr,  # ROWS = max(GROUP_P, 16): tl.dot's minimum
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1

    g = tl.arange(0, ROWS)
    row_valid = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_P)
    d_valid = d < HEAD_DIM
    q_offs = seq.to(tl.int64) * stride_qt + head.to(tl.int64)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [ROWS, D]
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(q_pos - sliding_window + 1, 0)
    start = tl.maximum(lo, key_lo - key_lo % BLOCK_N)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for first in range(start, hi, BLOCK_N):
        pos = first + n  # [BLOCK_N] key positions
        in_range = pos < hi
        block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = in_range[:, None] & d_valid[None, :]
        k_offs = block_id[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        v_offs = block_id[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
        if USE_SOFTCAP:
            scores = capped_scores(scores, cap_log2e)
        visible = in_range
        if USE_WINDOW:
            visible = visible & (pos >= key_lo)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = seq.to(tl.int64) * stride_ot + head.to(tl.int64)[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        # partials: acc [B, Hq, NUM_SPLITS, D_P], (m, l) [B, Hq, NUM_SPLITS, 2], float32, contiguous
        num_heads = tl.num_programs(1) * GROUP
        row = (seq.to(tl.int64) * num_heads + head.to(tl.int64)) * NUM_SPLITS + split  # [ROWS]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P + d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_P)
    s_valid = s < NUM_SPLITS
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_valid, other=float("-inf"))  # [S]
    l = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_valid, other=0.0)  # [S]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S]; an empty split has m = -inf, so weight 0
    total = tl.sum(l * w, 0)
    d = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM_P + d[None, :], mask=s_valid[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # [D_P]
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int,
                      waves: int = 4, min_split_tokens: int = 256, max_splits: int = 64) -> tuple[int, int]:
    """(num_splits, split_tokens): at least `waves` programs per SM (several resident programs
    per SM hide each one's load latency), but no split shorter than `min_split_tokens` (the merge
    and the per-program start cost more than the parallelism gains on short contexts).
    split_tokens is a multiple of `block_n`."""
    if min(num_seqs, num_kv_heads, max_seq_len, num_sms, block_n, waves) < 1:
        raise ValueError("choose_num_splits needs positive sizes")
    programs = num_seqs * num_kv_heads
    wanted = -(-waves * num_sms // programs)
    by_length = max(1, max_seq_len // min_split_tokens)
    splits = max(1, min(wanted, by_length, max_splits))
    split_tokens = -(-max_seq_len // splits)
    split_tokens = -(-split_tokens // block_n) * block_n
    return -(-max_seq_len // split_tokens), split_tokens


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]: one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_seq_len: int,
    scale: float,  # the softmax scale (natural log)
    sliding_window: int | None,
    softcap: float | None = None,
    *,
    num_sms: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    waves: int = 4,
    dot_in_fp32: bool = False,
) -> torch.Tensor:  # [B, Hq, D]
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = triton.next_power_of_2(head_dim)
    block_n = max(block_n, block_size)
    splits, split_tokens = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, block_n, waves)
    out = torch.empty_like(query)
    if splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, splits, head_dim_p, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused by the kernel
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale, cap_log2e = score_scales(scale, softcap)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        out, part_acc, part_ml, query, key_cache, value_cache, block_tables, seq_lens,
        qk_scale, cap_log2e, sliding_window or 0, split_tokens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        NUM_SPLITS=splits, GROUP=group, GROUP_P=group_p, ROWS=max(group_p, 16),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, DOT_IN_FP32=dot_in_fp32,
        PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        )
    return out
