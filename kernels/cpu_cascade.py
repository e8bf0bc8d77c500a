"""Cascade attention on CPU: prefill chunks behind one cached prefix read it once, together.

With prefix caching, a burst of requests behind one system prompt prefills only their tails, each
attending to the same cached blocks. Attended one sequence at a time (the reference's prefill
calls), every tail reads the whole prefix again in a small call: on the 100M bench model in
bfloat16, 31 tails of ~40 tokens behind a 1,024-token prefix took ~50 ms of attention per layer at
~80 GFLOP/s. Split in two (FlashInfer's and vLLM's "cascade" attention), the shared part is one
large call -- every tail's queries against the prefix, no mask needed, each KV head's group of
query heads folded into its query rows so K/V are read once per KV head -- and the rest is one
small masked call per tail over its own keys after the prefix. The two partial results merge exactly
by their log-sum-exps (softmax over a union of key sets), in float32.

Where one of Thaw's prefill kernels applies (`kernels.cpu_dense_attention.fused_cascade_for`: bf16
or float32), the two parts are one pass instead: each row's online softmax runs over the shared
prefix and then its own keys, so nothing needs merging (bf16: 8.8 vs 12.7 ms a layer on the shape
above).

Otherwise both calls need the log-sum-exp: `kernels.cpu_dense_attention` gives it, from Thaw's kernels or
PyTorch's private CPU flash-attention op
(`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`); where that op is missing,
`cascade_available` is False and the backend attends each sequence as before (same results up to
rounding: the merge rounds each part once to the query's dtype).

Only plain causal attention takes this path: no sliding window (the prefix might fall outside it)
and no soft-capping (SDPA has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_dense_attention import DenseAttention, FusedCascade, flash_available, flash_dense

# A group worth a cascade: enough tails sharing enough prefix that one large call beats several
# small ones (below these, the extra suffix calls and the merge cost about what they save).
MIN_MEMBERS = 4
MIN_PREFIX_TOKENS = 128


def cascade_available() -> bool:
    """Whether this PyTorch has the CPU flash-attention op that returns the log-sum-exp."""
    return flash_available()


@dataclass(frozen=True)
class CascadeMember:
    """One sequence of a cascade group: its step rows and the keys it has past the shared prefix."""

    seq_id: int
    first_row: int  # its query rows in the step: first_row:end_row
    end_row: int
    suffix_block_ids: torch.Tensor  # [nb] int64: its blocks from the end of the prefix on
    num_suffix_keys: int  # its context past the prefix, this step's tokens included
    suffix_mask: torch.Tensor  # [Q, num_suffix_keys] bool, True = attend (causal over its own tokens)
    # The same as the flash op takes it, built once per step: additive (0 / -inf) in the query's
    # dtype, one copy per query head of a KV head's group (row g * Q + i).
    suffix_bias: torch.Tensor  # [group * Q, num_suffix_keys]
    # The same as row limits (row g * Q + i sees its first limit suffix keys), as the bf16 kernel takes it.
    suffix_limits: torch.Tensor  # [group * Q] int32


@dataclass(frozen=True)
class CascadeGroup:
    """Sequences whose block tables start with the same physical blocks, all of it cached context."""

    prefix_block_ids: torch.Tensor  # [P] int64
    prefix_len: int  # P * block_size tokens
    members: tuple[CascadeMember, ...]
    rows: torch.Tensor  # [R] int64: every member's step rows, member after member
    # For the fused kernel (`FusedCascade`): member i's rows within `rows` and its keys within the
    # members' suffix blocks gathered one after another (whole blocks), and each row's suffix limit.
    member_rows: torch.Tensor  # [M + 1] int32
    member_keys: torch.Tensor  # [M + 1] int32
    row_suffix_limits: torch.Tensor  # [R] int32
    suffix_block_ids: torch.Tensor  # [sum of members' suffix blocks] int64

    @property
    def seq_ids(self) -> frozenset[int]:
        return frozenset(m.seq_id for m in self.members)


def plan_cascades(metadata: AttentionMetadata, block_size: int, device: torch.device,
                  min_members: int = MIN_MEMBERS, min_prefix_tokens: int = MIN_PREFIX_TOKENS, *,
                  dtype: torch.dtype = torch.float32, group_size: int = 1) -> tuple[CascadeGroup, ...]:
    """The step's cascade groups: prefill chunks (more than one query row) with cached context whose
    tables start with the same blocks, at least `min_members` of them sharing at least
    `min_prefix_tokens` tokens of context that precedes every member's queries. `dtype` and
    `group_size` (query heads per KV head) shape the masks as every layer's flash calls take them."""
    candidates = [b for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host))
                  if 1 < q_len < seq_len and seq_len - q_len >= min_prefix_tokens]
    if len(candidates) < min_members:
        return ()
    tables = metadata.block_tables
    by_first_block: dict[int, list[int]] = {}
    for b in candidates:
        by_first_block.setdefault(int(tables[b, 0]), []).append(b)
    starts = [0]
    for q_len in metadata.query_lens_host:
        starts.append(starts[-1] + q_len)
    groups = []
    for seq_ids in by_first_block.values():
        if len(seq_ids) < min_members:
            continue
        # Whole blocks of context before every member's first query, then the common run of ids.
        limit = min((metadata.seq_lens_host[b] - metadata.query_lens_host[b]) // block_size for b in seq_ids)
        rows = tables[seq_ids, :limit]  # [M, limit]
        same = (rows == rows[0]).all(dim=0)  # [limit]
        num_prefix_blocks = int(same.long().cumprod(0).sum()) if limit else 0
        prefix_len = num_prefix_blocks * block_size
        if prefix_len < min_prefix_tokens:
            continue
        members, member_limits = [], []
        for b in seq_ids:
            q_len, seq_len = metadata.query_lens_host[b], metadata.seq_lens_host[b]
            num_suffix = seq_len - prefix_len
            key_pos = torch.arange(prefix_len, seq_len, device=device)  # [S]
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # [Q]
            mask = key_pos <= query_pos.unsqueeze(-1)  # [Q, S]
            limits = mask.sum(-1, dtype=torch.int32)  # [Q]: row i sees its first limits[i] suffix keys
            bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
            members.append(CascadeMember(
                seq_id=b, first_row=starts[b], end_row=starts[b + 1],
                suffix_block_ids=tables[b, num_prefix_blocks:-(-seq_len // block_size)].long(),
                num_suffix_keys=num_suffix,
                suffix_mask=mask,
                suffix_bias=bias.repeat(group_size, 1),  # [G * Q, S]
                suffix_limits=limits.repeat(group_size),  # [G * Q]
            ))
            member_limits.append(limits)
        row_offsets, key_offsets = [0], [0]
        for m in members:
            row_offsets.append(row_offsets[-1] + m.end_row - m.first_row)
            key_offsets.append(key_offsets[-1] + len(m.suffix_block_ids) * block_size)
        groups.append(CascadeGroup(
            prefix_block_ids=tables[seq_ids[0], :num_prefix_blocks].long(),
            prefix_len=prefix_len,
            members=tuple(members),
            rows=torch.cat([torch.arange(m.first_row, m.end_row, device=device) for m in members]),
            member_rows=torch.tensor(row_offsets, dtype=torch.int32),
            member_keys=torch.tensor(key_offsets, dtype=torch.int32),
            row_suffix_limits=torch.cat(member_limits),
            suffix_block_ids=torch.cat([m.suffix_block_ids for m in members]),
        ))
    return tuple(groups)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] cache -> [1, Hkv, num_keys, D] (one row copy per block)."""
    num_blocks, bs, h, d = cache.shape
    rows = cache.view(num_blocks, bs * h * d).index_select(0, block_ids)  # [nb, bs * Hkv * D]
    return rows.view(1, -1, h, d)[:, :num_keys].transpose(1, 2)


def _fold(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[R, Hq, D] -> [1, Hkv, group * R, D]: query head h reads KV head h // group; row g * R + r."""
    rows, num_heads, dim = q.shape
    group = num_heads // num_kv_heads
    return q.view(rows, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * rows, dim)


def run_cascade(
    group: CascadeGroup,
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the group's rows are written
    dense: DenseAttention = flash_dense,
    fused: FusedCascade | None = None,
) -> None:
    """Attends the group's rows: in one pass where `fused` is given, else as two parts merged."""
    if fused is not None:
        _run_fused(group, query, key_cache, value_cache, scale, out, fused)
        return
    num_kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    group_size = num_heads // num_kv_heads
    q = query.index_select(0, group.rows)  # [R, Hq, D]
    num_rows = q.shape[0]
    keys = _gather(key_cache, group.prefix_block_ids, group.prefix_len).to(q.dtype)  # [1, Hkv, P, D]
    values = _gather(value_cache, group.prefix_block_ids, group.prefix_len).to(q.dtype)
    shared, shared_lse = dense(_fold(q, num_kv_heads)[0], keys[0], values[0], None, scale)  # [Hkv, G*R, D]
    shared = shared.reshape(num_kv_heads, group_size, num_rows, dim)  # [Hkv, G, R, D]
    shared_lse = shared_lse.reshape(num_kv_heads, group_size, num_rows)  # [Hkv, G, R] float32
    own = torch.empty_like(shared)
    own_lse = torch.empty_like(shared_lse)
    offset = 0
    for m in group.members:
        q_len = m.end_row - m.first_row
        keys = _gather(key_cache, m.suffix_block_ids, m.num_suffix_keys).to(q.dtype)  # [1, Hkv, S, D]
        values = _gather(value_cache, m.suffix_block_ids, m.num_suffix_keys).to(q.dtype)
        o, lse = dense(_fold(q[offset:offset + q_len], num_kv_heads)[0], keys[0], values[0], m.suffix_limits,
                       scale, m.suffix_bias)  # planned for this dtype and group
        own[:, :, offset:offset + q_len] = o.reshape(num_kv_heads, group_size, q_len, dim)
        own_lse[:, :, offset:offset + q_len] = lse.reshape(num_kv_heads, group_size, q_len)
        offset += q_len
    # softmax over prefix + own keys = each part's softmax weighted by its share of the total mass
    top = torch.maximum(shared_lse, own_lse)
    w_shared = (shared_lse - top).exp_().unsqueeze(-1)  # [Hkv, G, R, 1]
    w_own = (own_lse - top).exp_().unsqueeze(-1)
    merged = (shared.float() * w_shared + own.float() * w_own) / (w_shared + w_own)  # [Hkv, G, R, D]
    out.index_copy_(0, group.rows, merged.permute(2, 0, 1, 3).reshape(num_rows, num_heads, dim).to(out.dtype))


def _run_fused(group: CascadeGroup, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float, out: torch.Tensor, fused: FusedCascade) -> None:
    num_kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    q = query.index_select(0, group.rows)  # [R, Hq, D]
    num_rows = q.shape[0]
    prefix_k = _gather(key_cache, group.prefix_block_ids, group.prefix_len)[0]  # [Hkv, P, D]
    prefix_v = _gather(value_cache, group.prefix_block_ids, group.prefix_len)[0]
    num_suffix = len(group.suffix_block_ids) * key_cache.shape[1]
    suffix_k = _gather(key_cache, group.suffix_block_ids, num_suffix)[0]  # [Hkv, S, D], whole blocks
    suffix_v = _gather(value_cache, group.suffix_block_ids, num_suffix)[0]
    folded = fused(_fold(q, num_kv_heads)[0], prefix_k, prefix_v, suffix_k, suffix_v, group.member_rows,
                   group.member_keys, group.row_suffix_limits, num_heads // num_kv_heads, scale)  # [Hkv, G*R, D]
    rows = folded.view(num_kv_heads, num_heads // num_kv_heads, num_rows, dim).permute(2, 0, 1, 3)  # [R, Hkv, G, D]
    out.index_copy_(0, group.rows, rows.reshape(num_rows, num_heads, dim).to(out.dtype))
