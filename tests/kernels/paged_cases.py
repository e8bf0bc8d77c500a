"""Shared builders for kernel tests: sequences scattered over shuffled physical KV blocks."""

from __future__ import annotations

import math

import torch

from kernels import AttentionMetadata


def shuffled_block_tables(seq_lens, block_size, gen, extra_blocks):
    """Block tables for ``seq_lens`` drawn from a shuffled pool; returns (tables, num_blocks)."""
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + extra_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables, cursor = [], 0
    for s in seq_lens:
        n = math.ceil(s / block_size)
        tables.append(physical[cursor : cursor + n])
        cursor += n
    return tables, num_blocks


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, extra_blocks=3,
               device="cpu"):
    """A random query batch over random caches: (query [T,Hq,D], key_cache, value_cache, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, gen, extra_blocks)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata.build(block_tables=tables, query_lens=list(query_lens), seq_lens=list(seq_lens),
                                   block_size=block_size, device=device)
    return query, key_cache, value_cache, meta
