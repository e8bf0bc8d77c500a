"""Cascade attention (prefill chunks sharing a cached prefix) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, ReferenceAttentionBackend
from kernels.cpu_attention import CpuAttentionBackend
from kernels.cpu_cascade import cascade_available, plan_cascades, run_cascade
from kernels.cpu_extension import try_build_cpu_extension

pytestmark = pytest.mark.skipif(not cascade_available(), reason="this PyTorch lacks the CPU flash op with LSE")

BLOCK = 4
PREFIX_BLOCKS = 5  # 20 shared tokens


def shared_prefix_batch(num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0):
    """Five chunks behind one 5-block cached prefix (two of them with private cached context past
    it), a chunk behind another prefix, a whole prompt and a decode row on the shared prefix."""
    gen = torch.Generator().manual_seed(seed)
    # (query_len, seq_len, shares the prefix)
    layout = [(3, 23, True), (1, 30, True), (6, 26, True), (9, 37, True), (2, 22, True), (5, 35, True),
              (4, 30, False), (7, 7, False)]
    prefix = list(range(PREFIX_BLOCKS))
    next_block = PREFIX_BLOCKS
    tables = []
    for _, seq_len, shares in layout:
        own = -(-seq_len // BLOCK) - (PREFIX_BLOCKS if shares else 0)
        tables.append((prefix if shares else []) + list(range(next_block, next_block + own)))
        next_block += own
    perm = torch.randperm(next_block + 2, generator=gen).tolist()  # scatter over the pool
    tables = [[perm[b] for b in table] for table in tables]
    key_cache = torch.randn(next_block + 2, BLOCK, num_kv_heads, 32, generator=gen).to(dtype)
    value_cache = torch.randn(next_block + 2, BLOCK, num_kv_heads, 32, generator=gen).to(dtype)
    query_lens = [q for q, _, _ in layout]
    query = torch.randn(sum(query_lens), num_heads, 32, generator=gen).to(dtype)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=query_lens, seq_lens=[s for _, s, _ in layout],
                                   block_size=BLOCK)
    return query, key_cache, value_cache, meta


def test_plan_groups_the_chunks_that_share_whole_blocks_of_cached_context():
    _, _, _, meta = shared_prefix_batch(4, 2, torch.float32)
    [group] = plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=4, min_prefix_tokens=8)
    # The decode row, the other prefix's chunk and the whole prompt are left out.
    assert sorted(group.seq_ids) == [0, 2, 3, 4, 5] and group.prefix_len == 20
    assert group.prefix_block_ids.tolist() == meta.block_tables[0, :PREFIX_BLOCKS].tolist()
    chunk = group.members[2]  # seq 3: 9 new tokens at 28-36, context 20-36 past the prefix
    assert (chunk.first_row, chunk.end_row, chunk.num_suffix_keys) == (10, 19, 17)
    assert chunk.suffix_mask.shape == (9, 17) and chunk.suffix_mask[0].sum() == 9  # query 28 sees 20..28
    assert plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=6, min_prefix_tokens=8) == ()
    assert plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=4, min_prefix_tokens=24) == ()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_cascade_rows_match_the_reference(dtype, tol, num_heads, num_kv_heads):
    query, key_cache, value_cache, meta = shared_prefix_batch(num_heads, num_kv_heads, dtype, seed=num_heads)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                       0.3)
    [group] = plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=4, min_prefix_tokens=8, dtype=dtype,
                            group_size=num_heads // num_kv_heads)
    out = torch.zeros_like(query)
    run_cascade(group, query, key_cache, value_cache, 0.3, out)
    rows = group.rows
    torch.testing.assert_close(out[rows].float(), want[rows], atol=tol, rtol=tol)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].abs().sum() == 0  # only the group's rows are written


def test_the_backend_attends_every_row_with_and_without_cascades(monkeypatch):
    import kernels.cpu_cascade as cascade_module
    query, key_cache, value_cache, meta = shared_prefix_batch(8, 2, torch.float32, seed=3)
    extension, why_not = try_build_cpu_extension()
    assert extension is not None, why_not
    calls = []
    real = cascade_module.run_cascade
    monkeypatch.setattr("kernels.cpu_attention.run_cascade", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr("kernels.cpu_attention.plan_cascades",
                        lambda m, bs, d, **shape: plan_cascades(m, bs, d, min_members=4, min_prefix_tokens=8,
                                                                **shape))  # tiny batch
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.2)
    with_cascade = CpuAttentionBackend(extension, cascade=True).paged_attention(query, key_cache, value_cache,
                                                                                meta, 0.2)
    assert calls == [1]
    torch.testing.assert_close(with_cascade, want, atol=1e-5, rtol=1e-5)
    without = CpuAttentionBackend(extension, cascade=False).paged_attention(query, key_cache, value_cache, meta, 0.2)
    torch.testing.assert_close(without, want, atol=1e-5, rtol=1e-5)
    assert calls == [1]
    # A sliding window or soft-capping keeps every prefill row on the reference path.
    CpuAttentionBackend(extension, cascade=True).paged_attention(query, key_cache, value_cache, meta, 0.2, 6)
    CpuAttentionBackend(extension, cascade=True).paged_attention(query, key_cache, value_cache, meta, 0.2, None, 2.0)
    assert calls == [1]
