"""Pure-PyTorch paged attention: the ground truth for the Triton kernels and the CPU path.

It gathers each sequence's K/V out of the block pool by its block table and calls
``scaled_dot_product_attention``. Decode rows (one query token) are attended in a few
batched calls, grouped by context length so short sequences are not padded to the longest;
prefill rows are attended one sequence at a time so a long prompt never pads a batch of short
ones. Both paths share one mask rule (`_context_mask`), which is the whole definition of
causality and sliding windows here. SDPA has no soft-capping, so a soft-capped layer (Gemma 2)
runs the same calls as explicit matmuls in transformers' eager order (`_softcapped_attention`).

Everything that depends only on the step's batch (which rows go together, the gather
indices, the masks) is a `_StepPlan`, built once per `AttentionMetadata` and reused by every
layer of the forward pass: on CPU, rebuilding it per layer cost as much as the attention.

A prompt prefilled whole in one step has all its keys in the step itself: given the step's
``key``/``value`` rows, such a call reads them (and its queries and output rows) as slices,
without gathering from the block pool what was just written there (on the 100M model in bfloat16
the gathers and row copies were ~19% of a 2,000-token prefill step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_backend import check_gqa_heads, check_softcap
from kernels.attention_metadata import AttentionMetadata


def _context_mask(
    query_pos: torch.Tensor,  # [..., Q] absolute position of each query row
    key_pos: torch.Tensor,  # [K] absolute position of each key slot
    sliding_window: int | None,
) -> torch.Tensor:  # [..., Q, K] bool, True = attend
    """Causality (and the window) is the whole rule: a query at position p sees keys j <= p.

    Padding slots past a sequence's end need no extra term: the last query of a sequence
    sits at seq_len - 1, so every slot it may see holds a real token.
    """
    q = query_pos.unsqueeze(-1)
    mask = key_pos <= q
    if sliding_window is not None:
        mask &= key_pos > q - sliding_window
    return mask


def _softcapped_attention(
    q: torch.Tensor,  # [B, Hq, Q, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, D]
    mask: torch.Tensor | None,  # broadcastable to [B, Hq, Q, L], True = attend; None with is_causal
    is_causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [B, Hq, Q, D]
    """Attention with scores capped at +-softcap, in transformers' eager Gemma 2 order: scale, cap
    (divide, tanh, multiply), mask, softmax in float32 cast back to the query dtype, weighted sum."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, L, D]: query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # a whole prompt: key j is visible to query i iff j <= i
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _length_groups(seq_ids: list[int], seq_lens: tuple[int, ...], max_groups: int = 4) -> list[list[int]]:
    """Splits decode sequences, sorted by context length, into up to ``max_groups`` groups.

    A batched decode pads every sequence to the longest one in its call; with mixed lengths
    that gathers ~1.5x the real context. Equal-count groups of similar lengths cut the padding
    to a few percent for the price of a few more (cheap) attention calls.
    """
    if len(seq_ids) <= 8:
        return [seq_ids] if seq_ids else []
    ordered = sorted(seq_ids, key=lambda b: seq_lens[b])
    size = -(-len(ordered) // max_groups)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


@dataclass(frozen=True)
class SdpaCall:
    """One SDPA call: which output rows, which KV blocks, and the mask (None = causal/full)."""

    rows: torch.Tensor  # [R] int64 output rows
    block_ids: torch.Tensor  # [B * nb] int64 physical blocks, row-major per sequence
    num_seqs: int
    num_keys: int  # keys per sequence after trimming the last block
    mask: torch.Tensor | None  # decode: [B, 1, 1, L]; prefill: [Q, S]; None: plain causal
    is_decode: bool
    # (first, end) step rows of a prefill whose whole context is in this step, else None
    whole_context_rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class _StepPlan:
    calls: tuple[SdpaCall, ...]


def _plan(metadata: AttentionMetadata, block_size: int, sliding_window: int | None,
          device: torch.device, include_decode: bool, exclude: frozenset[int] = frozenset()) -> _StepPlan:
    """The step's SDPA calls; `include_decode` False or `exclude` leave those sequences' rows to
    another path (a subclass's kernels)."""
    tables = metadata.block_tables.long()
    starts = [0]
    for q_len in metadata.query_lens_host:
        starts.append(starts[-1] + q_len)
    calls: list[SdpaCall] = []
    decode_ids = [b for b, q_len in enumerate(metadata.query_lens_host) if q_len == 1 and include_decode]
    for group in _length_groups(decode_ids, metadata.seq_lens_host):
        lens = [metadata.seq_lens_host[b] for b in group]
        num_blocks = -(-max(lens) // block_size)
        ids = torch.tensor(group, device=device)
        key_pos = torch.arange(num_blocks * block_size, device=device)  # [L]
        query_pos = torch.tensor(lens, device=device).unsqueeze(-1) - 1  # [Bd, 1]
        calls.append(SdpaCall(
            rows=torch.tensor([starts[b] for b in group], device=device),
            block_ids=tables[ids, :num_blocks].reshape(-1),
            num_seqs=len(group),
            num_keys=num_blocks * block_size,
            mask=_context_mask(query_pos, key_pos, sliding_window).unsqueeze(1),  # [Bd, 1, 1, L]
            is_decode=True,
        ))
    for b, q_len in enumerate(metadata.query_lens_host):
        if q_len == 1 or b in exclude:
            continue
        seq_len = metadata.seq_lens_host[b]
        num_blocks = -(-seq_len // block_size)
        if q_len == seq_len and sliding_window is None:
            mask = None  # a whole prompt: plain causal attention, SDPA's fastest path
        else:
            key_pos = torch.arange(seq_len, device=device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = _context_mask(query_pos, key_pos, sliding_window)  # [Q, S]
        calls.append(SdpaCall(
            rows=torch.arange(starts[b], starts[b + 1], device=device),
            block_ids=tables[b, :num_blocks],
            num_seqs=1,
            num_keys=seq_len,
            mask=mask,
            is_decode=False,
            whole_context_rows=(starts[b], starts[b + 1]) if q_len == seq_len else None,
        ))
    return _StepPlan(tuple(calls))


class ReferenceAttentionBackend:
    """Reference implementation of `AttentionBackend` for any device PyTorch supports."""

    name = "reference"

    def __init__(self) -> None:
        # The plan of the step in progress: (metadata it was built for, window) -> plan.
        # Holding the metadata keeps its identity unique while it is cached.
        self._plan_metadata: AttentionMetadata | None = None
        self._plans: dict[tuple, object] = {}

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        num_tokens = key.shape[0]
        row = key_cache.shape[-2] * key_cache.shape[-1]
        flat_k = key_cache.view(-1, row)  # [num_slots, Hkv * D]: 2-D row copies are the fast path
        flat_v = value_cache.view(-1, row)
        flat_k.index_copy_(0, slot_mapping, key.reshape(num_tokens, row).to(key_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, value.reshape(num_tokens, row).to(value_cache.dtype))

    def _cached(self, metadata: AttentionMetadata, key: tuple, build):
        """Per-step memo: ``build()`` once per (metadata, key), reused by every layer."""
        if self._plan_metadata is not metadata:
            self._plan_metadata, self._plans = metadata, {}
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def _plan_for(self, metadata: AttentionMetadata, block_size: int, sliding_window: int | None,
                  device: torch.device, include_decode: bool = True, exclude: frozenset[int] = frozenset(),
                  ) -> _StepPlan:
        return self._cached(metadata, ("plan", block_size, sliding_window, include_decode, exclude),
                            lambda: _plan(metadata, block_size, sliding_window, device, include_decode, exclude))

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        key: torch.Tensor | None = None,  # [T, Hkv, D]
        value: torch.Tensor | None = None,  # [T, Hkv, D]
    ) -> torch.Tensor:  # [T, Hq, D]
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        check_gqa_heads(num_heads, num_kv_heads)
        check_softcap(softcap)
        plan = self._plan_for(metadata, key_cache.shape[1], sliding_window, query.device)
        return self._run(plan, query, key_cache, value_cache, scale, softcap, key, value)

    def _run(self, plan: _StepPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             scale: float, softcap: float | None = None, key: torch.Tensor | None = None,
             value: torch.Tensor | None = None,
             ) -> torch.Tensor:  # [T, Hq, D]; rows no call covers are left unset
        out = torch.empty_like(query)
        # The step's own K/V stand in for the cache only where they are what the cache holds.
        step_kv = key is not None and value is not None and key.dtype == key_cache.dtype == value.dtype
        for call in plan.calls:
            if step_kv and call.whole_context_rows is not None:
                first, end = call.whole_context_rows
                keys = key[first:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D], a view
                values = value[first:end].transpose(0, 1).unsqueeze(0)
                q = query[first:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, S, D]
                o = self._attend(q, keys, values, call, scale, softcap)
                out[first:end] = o[0].transpose(0, 1)
                continue
            keys = self._gather(key_cache, call)  # [B, Hkv, L, D]
            values = self._gather(value_cache, call)
            q = query.index_select(0, call.rows)  # [R, Hq, D]
            if call.is_decode:
                q = q.unsqueeze(2)  # [Bd, Hq, 1, D]
            else:
                q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
            o = self._attend(q, keys, values, call, scale, softcap)
            o = o.squeeze(2) if call.is_decode else o[0].transpose(0, 1)  # [R, Hq, D]
            out.index_copy_(0, call.rows, o)
        return out

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: SdpaCall, scale: float,
                softcap: float | None) -> torch.Tensor:  # q: [B, Hq, Q, D]; keys/values: [B, Hkv, L, D]
        is_causal = call.mask is None and not call.is_decode
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if softcap is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=call.mask, is_causal=is_causal,
                                                  scale=scale, enable_gqa=True)  # [B, Hq, Q, D]
        return _softcapped_attention(q, keys, values, call.mask, is_causal, scale, softcap)

    @staticmethod
    def _gather(cache: torch.Tensor, call: SdpaCall) -> torch.Tensor:
        # cache: [num_blocks, bs, Hkv, D] -> [B, Hkv, num_keys, D]
        # Selecting rows of a 2-D view is ~3x faster on CPU than index_select on the 4-D cache
        # (and ~5x faster than advanced indexing): one memcpy per block.
        num_blocks, bs, h, d = cache.shape
        rows = cache.view(num_blocks, bs * h * d).index_select(0, call.block_ids)  # [B * nb, bs * Hkv * D]
        gathered = rows.view(call.num_seqs, -1, h, d)[:, : call.num_keys]  # [B, L, Hkv, D]
        return gathered.transpose(1, 2)
