"""Thaw's bf16 prefill kernel and PyTorch's flash op, on the dense shape, against a float32 softmax;
and the CPU backend routing bf16 cascades and whole prompts through the kernel."""

from __future__ import annotations

import pytest
import torch

from kernels import ReferenceAttentionBackend
from kernels.cpu_attention import CpuAttentionBackend
from kernels.cpu_cascade import plan_cascades, run_cascade
from kernels.cpu_dense_attention import (dense_attention_for, flash_available, flash_dense, fused_cascade_for,
                                         kernel_cascade, kernel_dense, kernel_usable)
from kernels.cpu_extension import try_build_cpu_extension
from tests.kernels.paged_cases import make_batch
from tests.kernels.test_cpu_cascade import BLOCK, shared_prefix_batch

EXT, WHY = try_build_cpu_extension()
needs_kernel = pytest.mark.skipif(not kernel_usable(EXT), reason=f"the bf16 prefill kernel was not built here ({WHY or 'no AVX512-BF16'})")
needs_flash = pytest.mark.skipif(not flash_available(), reason="this PyTorch lacks the CPU flash op with LSE")


def float_softmax(q, k, v, limits, scale):
    """out [H, M, D] and lse [H, M] of a float32 softmax over each row's first `limits` keys."""
    scores = (q.float() @ k.float().transpose(1, 2)) * scale  # [H, M, N]
    if limits is not None:
        visible = torch.arange(k.shape[1]) < limits.long().unsqueeze(-1)  # [M, N]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v.float(), torch.logsumexp(scores, -1)


def case(h, m, n, d, seed, with_limits):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, rows, d, generator=gen).bfloat16() for rows in (m, n, n))
    limits = torch.randint(1, n + 1, (m,), generator=gen, dtype=torch.int32) if with_limits else None
    return q, k, v, limits


# Shapes off every tile edge: rows not a multiple of the 4-row tile or the 64-row task, keys not a
# multiple of the 64-key chunk or even, a single key, both head sizes.
SHAPES = [(1, 1, 1, 64), (2, 37, 53, 64), (4, 130, 200, 128), (3, 257, 129, 64), (1, 5, 64, 128)]


@needs_kernel
@pytest.mark.parametrize("h,m,n,d", SHAPES)
@pytest.mark.parametrize("with_limits", [False, True], ids=["all-keys", "limits"])
def test_the_kernel_matches_a_float32_softmax(h, m, n, d, with_limits):
    q, k, v, limits = case(h, m, n, d, seed=m + n, with_limits=with_limits)
    out, lse = kernel_dense(EXT)(q, k, v, limits, d ** -0.5)
    want, want_lse = float_softmax(q, k, v, limits, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (h, m, d) and lse.shape == (h, m)
    # bf16 output (relative rounding 2^-8 of values up to ~3) and probabilities rounded to bf16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_a_row_with_one_visible_key_gets_exactly_that_value():
    q, k, v, _ = case(2, 6, 70, 64, seed=1, with_limits=False)
    limits = torch.tensor([1, 1, 2, 70, 64, 65], dtype=torch.int32)
    out, lse = kernel_dense(EXT)(q, k, v, limits, 0.125)
    assert torch.equal(out[:, :2], v[:, :1].expand(2, 2, 64))  # softmax over one key is that key's value
    torch.testing.assert_close(lse[:, 0], (q[:, 0].float() * k[:, 0].float()).sum(-1) * 0.125, atol=1e-4, rtol=1e-5)


@needs_kernel
@needs_flash
def test_the_kernel_and_the_flash_op_agree():
    q, k, v, limits = case(4, 300, 400, 64, seed=3, with_limits=True)
    out, lse = kernel_dense(EXT)(q, k, v, limits, 0.125)
    ref, ref_lse = flash_dense(q, k, v, limits, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, lim: (q.float(), k, v, lim), "bfloat16 only"),
    (lambda q, k, v, lim: (q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), lim),
     "head size must be 64 or 128"),
    (lambda q, k, v, lim: (q, k[:, :5].contiguous(), v, lim), "k and v must be"),
    (lambda q, k, v, lim: (q, k, v, torch.zeros(q.shape[1], dtype=torch.int32)), "between 1 and N keys"),
    (lambda q, k, v, lim: (q, k, v, torch.ones(3, dtype=torch.int32)), "limits must be"),
])
def test_the_kernel_refuses_what_it_cannot_attend(bad, message):
    q, k, v, _ = case(2, 8, 16, 64, seed=0, with_limits=False)
    args = bad(q, k, v, torch.empty(0, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=message):
        EXT.dense_prefill_attention(*args, 0.125)


def test_the_kernel_is_chosen_only_where_it_applies():
    if kernel_usable(EXT):
        assert dense_attention_for(EXT, torch.bfloat16, 64) is not flash_dense
        assert dense_attention_for(EXT, torch.bfloat16, 128) is not flash_dense
    for dtype, head in [(torch.float32, 64), (torch.bfloat16, 96), (torch.float16, 64)]:
        assert dense_attention_for(EXT, dtype, head) is flash_dense
    assert dense_attention_for(EXT, torch.bfloat16, 64, use_kernel=False) is flash_dense
    assert dense_attention_for(None, torch.bfloat16, 64) is flash_dense
    assert (fused_cascade_for(EXT, torch.bfloat16, 64) is not None) == kernel_usable(EXT)
    assert fused_cascade_for(EXT, torch.float32, 64) is None and fused_cascade_for(EXT, torch.bfloat16, 32) is None


@needs_kernel
@needs_flash
@pytest.mark.parametrize("fused", [False, True], ids=["two-parts", "one-pass"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_a_cascade_through_the_kernel_matches_the_reference(num_heads, num_kv_heads, fused):
    query, key_cache, value_cache, meta = shared_prefix_batch(num_heads, num_kv_heads, torch.bfloat16, seed=5)
    query = torch.randn(query.shape[0], num_heads, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    key_cache = torch.randn(*key_cache.shape[:3], 64).bfloat16()
    value_cache = torch.randn(*value_cache.shape[:3], 64).bfloat16()
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                       0.125)
    [group] = plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=4, min_prefix_tokens=8,
                            dtype=torch.bfloat16, group_size=num_heads // num_kv_heads)
    out = torch.zeros_like(query)
    run_cascade(group, query, key_cache, value_cache, 0.125, out, kernel_dense(EXT),
                kernel_cascade(EXT) if fused else None)
    torch.testing.assert_close(out[group.rows].float(), want[group.rows], atol=2e-2, rtol=2e-2)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[group.rows] = False
    assert out[others].abs().sum() == 0  # only the group's rows are written


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_backend_attends_whole_bf16_prompts_through_the_kernel(monkeypatch, head_dim):
    # Two whole prompts, a chunk with cached context and a decode row: only the prompts take the kernel.
    query, key_cache, value_cache, meta = make_batch([9, 70, 5, 1], [9, 70, 30, 41], 8, 2, head_dim, 16,
                                                     torch.bfloat16, seed=head_dim)
    calls = []
    real = EXT.dense_prefill_attention

    class Counting:  # the extension, with its prefill kernel's calls counted
        def __getattr__(self, name):
            return getattr(EXT, name)

        def dense_prefill_attention(self, q, *rest):
            calls.append(q.shape)
            return real(q, *rest)

    backend = CpuAttentionBackend(Counting(), cascade=False)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.1)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta, 0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert calls == [(2, 4 * 9, head_dim), (2, 4 * 70, head_dim)]  # [Hkv, group * Q, D] per prompt
    plain = CpuAttentionBackend(Counting(), cascade=False, prefill_kernel=False)
    calls.clear()
    torch.testing.assert_close(plain.paged_attention(query, key_cache, value_cache, meta, 0.1).float(), want,
                               atol=2e-2, rtol=2e-2)
    assert calls == []


@needs_kernel
def test_the_one_pass_cascade_refuses_inconsistent_offsets():
    q, k, v, _ = case(2, 2 * 6, 16, 64, seed=0, with_limits=False)  # group 2, 6 rows
    args = dict(member_rows=torch.tensor([0, 4, 6], dtype=torch.int32),
                member_keys=torch.tensor([0, 8, 16], dtype=torch.int32),
                suffix_limits=torch.tensor([1, 2, 3, 4, 1, 8], dtype=torch.int32))
    kernel_cascade(EXT)(q, k, v, k, v, *args.values(), 2, 0.125)  # consistent: runs
    for name, bad, message in [("suffix_limits", torch.tensor([1, 2, 3, 9, 1, 2], dtype=torch.int32), "past its member"),
                               ("member_rows", torch.tensor([0, 4, 5], dtype=torch.int32), "from 0 to the rows"),
                               ("member_keys", torch.tensor([0, 8, 8, 16], dtype=torch.int32), "one offset per member")]:
        with pytest.raises(RuntimeError, match=message):
            kernel_cascade(EXT)(q, k, v, k, v, *{**args, name: bad}.values(), 2, 0.125)
