"""The PyTorch reference paged attention against dense attention computed from scratch.

Each case builds per-sequence K/V, scatters them into a pool of physical blocks through
`write_kv_cache` with shuffled block tables, then checks every query row against float64
softmax attention over the sequence's contiguous K/V: the paging, the causal mask within a
prefill chunk, GQA head mapping, sliding windows and score soft-capping are all exercised.
"""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, ReferenceAttentionBackend, get_attention_backend
from tests.kernels.paged_cases import make_batch, shuffled_block_tables


def dense_attention(q, k, v, seq_len, scale, window, softcap=None):
    # q: [Q, Hq, D]; k, v: [S, Hkv, D] -> [Q, Hq, D], float64
    q_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q_len):
        pos = seq_len - q_len + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            keys = k[lo : pos + 1, h // group].double()
            scores = keys @ q[i, h].double() * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ v[lo : pos + 1, h // group].double()
    return out


def build_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, gen, extra_blocks=5)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    queries = [torch.randn(q, num_heads, head_dim, generator=gen) for q in query_lens]
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    # Write the whole context at once: metadata for "every token is new" gives every slot.
    full = AttentionMetadata.build(block_tables=tables, query_lens=list(seq_lens), seq_lens=list(seq_lens),
                                   block_size=block_size)
    backend = ReferenceAttentionBackend()
    backend.write_kv_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, full.slot_mapping)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=list(query_lens), seq_lens=list(seq_lens),
                                   block_size=block_size)
    return queries, keys, values, key_cache, value_cache, meta


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size, window, softcap):
    # decode rows (q_len 1), a full prefill, a chunk continuing a cached prefix; odd lengths.
    query_lens = [1, 7, 1, 5, 1, 13]
    seq_lens = [9, 7, 33, 21, 1, 30]
    head_dim = 16
    queries, keys, values, key_cache, value_cache, meta = build_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=block_size + num_heads)
    scale = head_dim ** -0.5
    out = ReferenceAttentionBackend().paged_attention(torch.cat(queries), key_cache, value_cache, meta, scale, window,
                                                      softcap)
    assert out.shape == (sum(query_lens), num_heads, head_dim)
    start = 0
    for q, k, v, s in zip(queries, keys, values, seq_lens):
        expected = dense_attention(q, k, v, s, scale, window, softcap)
        torch.testing.assert_close(out[start : start + q.shape[0]].double(), expected, atol=1e-5, rtol=1e-5)
        start += q.shape[0]


def test_softcap_bounds_the_scores_and_changes_the_result():
    """A cap of 1 on scores of spread ~4: the capped attention is the dense one with scores in
    (-1, 1), far from the uncapped one; a cap must be positive."""
    queries, keys, values, key_cache, value_cache, meta = build_case([1, 6], [12, 6], 4, 2, 16, 4, seed=5)
    query = torch.cat(queries)
    capped = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 1.0, None, 1.0)
    plain = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 1.0, None)
    assert (capped - plain).abs().max() > 0.1
    torch.testing.assert_close(capped[:1].double(), dense_attention(queries[0], keys[0], values[0], 12, 1.0, None, 1.0),
                               atol=1e-5, rtol=1e-5)
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="softcap must be a number > 0 or None"):
            ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 1.0, None, bad)


def test_write_kv_cache_puts_each_token_in_its_slot():
    block_size, num_kv_heads, head_dim = 4, 2, 3
    meta = AttentionMetadata.build(block_tables=[[5, 2], [0]], query_lens=[2, 3], seq_lens=[6, 3],
                                   block_size=block_size)
    # seq 0 writes positions 4, 5 -> block 2 slots 0, 1; seq 1 writes positions 0..2 -> block 0.
    assert meta.slot_mapping.tolist() == [8, 9, 0, 1, 2]
    key = torch.arange(5 * num_kv_heads * head_dim, dtype=torch.float32).view(5, num_kv_heads, head_dim)
    key_cache = torch.zeros(6, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    ReferenceAttentionBackend().write_kv_cache(key, -key, key_cache, value_cache, meta.slot_mapping)
    torch.testing.assert_close(key_cache[2, 0], key[0])
    torch.testing.assert_close(key_cache[2, 1], key[1])
    torch.testing.assert_close(key_cache[0, :3], key[2:])
    torch.testing.assert_close(value_cache[0, :3], -key[2:])
    assert key_cache[1].abs().sum() == 0 and key_cache[5].abs().sum() == 0


def test_metadata_validates_and_slots_are_64_bit():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build(block_tables=[[0]], query_lens=[1], seq_lens=[5], block_size=4)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build(block_tables=[[0, 1]], query_lens=[6], seq_lens=[5], block_size=4)
    # a block id whose slot offset is past 2**31 must survive intact
    big_block = (2**31) // 16 + 7
    meta = AttentionMetadata.build(block_tables=[[big_block]], query_lens=[1], seq_lens=[3], block_size=16)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [big_block * 16 + 2]


def test_backend_selection():
    assert get_attention_backend("cpu", prefer="reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cpu", prefer="nope")


def test_many_decode_rows_grouped_by_length_match_dense():
    # > 8 decode rows: the reference splits them into length groups; every row must still be exact.
    seq_lens = [3, 40, 17, 1, 64, 9, 33, 2, 50, 21, 8, 45, 12, 5]
    query_lens = [1] * len(seq_lens)
    queries, keys, values, key_cache, value_cache, meta = build_case(query_lens, seq_lens, 8, 2, 16, 4, seed=3)
    out = ReferenceAttentionBackend().paged_attention(torch.cat(queries), key_cache, value_cache, meta, 0.25, None)
    for i, (q, k, v, s) in enumerate(zip(queries, keys, values, seq_lens)):
        torch.testing.assert_close(out[i : i + 1].double(), dense_attention(q, k, v, s, 0.25, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)], ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_read_the_steps_own_kv_not_the_cache(backend_name, window, softcap, dtype):
    """Given the step's key/value rows, a prompt prefilled whole attends over them (slices, no gather):
    the same result, and the cache's copy of those rows is never read."""
    backend = get_attention_backend("cpu", prefer=backend_name)
    # sequences: whole prompt (9 of 9), chunk (4 new of 20), decode, whole prompt (17 of 17)
    query_lens, seq_lens = [9, 4, 1, 17], [9, 20, 33, 17]
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, 4, 2, 16, 4, dtype, seed=5)
    flat_k = key_cache.view(-1, 2, 16)
    flat_v = value_cache.view(-1, 2, 16)
    key, value = flat_k[meta.slot_mapping].clone(), flat_v[meta.slot_mapping].clone()  # [T, Hkv, D]: as written
    want = backend.paged_attention(query, key_cache, value_cache, meta, 0.3, window, softcap)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.3, window, softcap, key=key, value=value)
    assert torch.equal(got, want)
    # Spoil the cached copy of the two whole prompts' rows: with the step's rows they are not read.
    whole = torch.cat([torch.arange(0, 9), torch.arange(14, 31)])  # their step rows
    flat_k[meta.slot_mapping[whole]] = 100.0
    flat_v[meta.slot_mapping[whole]] = -100.0
    fresh = get_attention_backend("cpu", prefer=backend_name)  # no per-step plan carried over
    spoiled_read = fresh.paged_attention(query, key_cache, value_cache, meta, 0.3, window, softcap)
    assert not torch.equal(spoiled_read[whole], want[whole])  # the cache copy does matter when read
    got = fresh.paged_attention(query, key_cache, value_cache, meta, 0.3, window, softcap, key=key, value=value)
    assert torch.equal(got[whole], want[whole])
