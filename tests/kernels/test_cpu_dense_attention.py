"""Thaw's prefill kernels (bf16 and float32) and PyTorch's flash op, on the dense shape, against a
float32 (or float64) softmax; and the CPU backend routing cascades and whole prompts through them."""

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
# Both kernels, each skipped where it was not built; with each dtype's tolerance against the exact
# softmax: bf16 rounds its output and probabilities to 8 bits, float32 only its sums.
DTYPES = [pytest.param(torch.bfloat16, 2e-2, id="bf16", marks=needs_kernel),
          pytest.param(torch.float32, 1e-5, id="fp32", marks=pytest.mark.skipif(
              not kernel_usable(EXT, torch.float32), reason=f"the float32 kernel was not built here ({WHY or 'no AVX-512'})"))]
needs_flash = pytest.mark.skipif(not flash_available(), reason="this PyTorch lacks the CPU flash op with LSE")


def float_softmax(q, k, v, limits, scale):
    """out [H, M, D] and lse [H, M] of a float64 softmax over each row's first `limits` keys, in float32."""
    scores = (q.double() @ k.double().transpose(1, 2)) * scale  # [H, M, N]
    if limits is not None:
        visible = torch.arange(k.shape[1]) < limits.long().unsqueeze(-1)  # [M, N]
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1) @ v.double()).float(), torch.logsumexp(scores, -1).float()


def case(h, m, n, d, seed, with_limits, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, rows, d, generator=gen).to(dtype) for rows in (m, n, n))
    limits = torch.randint(1, n + 1, (m,), generator=gen, dtype=torch.int32) if with_limits else None
    return q, k, v, limits


# Shapes off every tile edge: rows not a multiple of the 4-row tile, the 32-row float32 tile or the
# 64-row task, keys not a multiple of the 64-key chunk, the 8-key block or even, a single key, both
# head sizes.
SHAPES = [(1, 1, 1, 64), (2, 37, 53, 64), (4, 130, 200, 128), (3, 257, 129, 64), (1, 5, 64, 128), (2, 33, 7, 64)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("h,m,n,d", SHAPES)
@pytest.mark.parametrize("with_limits", [False, True], ids=["all-keys", "limits"])
def test_the_kernel_matches_an_exact_softmax(h, m, n, d, with_limits, dtype, tol):
    q, k, v, limits = case(h, m, n, d, seed=m + n, with_limits=with_limits, dtype=dtype)
    out, lse = kernel_dense(EXT)(q, k, v, limits, d ** -0.5)
    want, want_lse = float_softmax(q, k, v, limits, d ** -0.5)
    assert out.dtype == dtype and out.shape == (h, m, d) and lse.shape == (h, m) and lse.dtype == torch.float32
    # bf16: output (relative rounding 2^-8 of values up to ~3) and probabilities rounded to bf16
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4 if dtype == torch.bfloat16 else 1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_a_row_with_one_visible_key_gets_exactly_that_value(dtype, tol):
    q, k, v, _ = case(2, 6, 70, 64, seed=1, with_limits=False, dtype=dtype)
    limits = torch.tensor([1, 1, 2, 70, 64, 65], dtype=torch.int32)
    out, lse = kernel_dense(EXT)(q, k, v, limits, 0.125)
    assert torch.equal(out[:, :2], v[:, :1].expand(2, 2, 64))  # softmax over one key is that key's value
    torch.testing.assert_close(lse[:, 0], (q[:, 0].double() * k[:, 0].double()).sum(-1).float() * 0.125,
                               atol=1e-4, rtol=1e-5)


@needs_flash
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_the_kernel_and_the_flash_op_agree(dtype, tol):
    q, k, v, limits = case(4, 300, 400, 64, seed=3, with_limits=True, dtype=dtype)
    out, lse = kernel_dense(EXT)(q, k, v, limits, 0.125)
    ref, ref_lse = flash_dense(q, k, v, limits, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_a_rows_result_does_not_depend_on_its_tile(dtype, tol):
    # The same rows alone and among others (another tile, other lanes): bit for bit the same.
    q, k, v, limits = case(2, 70, 90, 64, seed=4, with_limits=True, dtype=dtype)
    out, lse = kernel_dense(EXT)(q, k, v, limits, 0.125)
    alone, alone_lse = kernel_dense(EXT)(q[:, 37:41].contiguous(), k, v, limits[37:41].contiguous(), 0.125)
    assert torch.equal(alone, out[:, 37:41]) and torch.equal(alone_lse, lse[:, 37:41])


@needs_kernel
@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, lim: (q.half(), k.half(), v.half(), lim), "bfloat16 or float32"),
    (lambda q, k, v, lim: (q.float(), k, v, lim), "q, k, v alike"),
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
    for dtype in (torch.bfloat16, torch.float32):
        for head in (64, 128):
            assert (dense_attention_for(EXT, dtype, head) is not flash_dense) == kernel_usable(EXT, dtype)
            assert (fused_cascade_for(EXT, dtype, head) is not None) == kernel_usable(EXT, dtype)
        assert dense_attention_for(EXT, dtype, 64, use_kernel=False) is flash_dense
        assert dense_attention_for(None, dtype, 64) is flash_dense
    for dtype, head in [(torch.bfloat16, 96), (torch.float32, 32), (torch.float16, 64)]:
        assert dense_attention_for(EXT, dtype, head) is flash_dense
        assert fused_cascade_for(EXT, dtype, head) is None
    assert not kernel_usable(EXT, torch.float16)


@needs_flash
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("fused", [False, True], ids=["two-parts", "one-pass"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_a_cascade_through_the_kernel_matches_the_reference(num_heads, num_kv_heads, fused, dtype, tol):
    query, key_cache, value_cache, meta = shared_prefix_batch(num_heads, num_kv_heads, dtype, seed=5)
    query = torch.randn(query.shape[0], num_heads, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    key_cache = torch.randn(*key_cache.shape[:3], 64).to(dtype)
    value_cache = torch.randn(*value_cache.shape[:3], 64).to(dtype)
    want = ReferenceAttentionBackend().paged_attention(query.double(), key_cache.double(), value_cache.double(),
                                                       meta, 0.125).float()
    [group] = plan_cascades(meta, BLOCK, torch.device("cpu"), min_members=4, min_prefix_tokens=8,
                            dtype=dtype, group_size=num_heads // num_kv_heads)
    out = torch.zeros_like(query)
    run_cascade(group, query, key_cache, value_cache, 0.125, out, kernel_dense(EXT),
                kernel_cascade(EXT) if fused else None)
    torch.testing.assert_close(out[group.rows].float(), want[group.rows], atol=tol, rtol=tol)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[group.rows] = False
    assert out[others].abs().sum() == 0  # only the group's rows are written


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_backend_attends_whole_prompts_through_the_kernel(monkeypatch, head_dim, dtype, tol):
    # Two whole prompts, a chunk with cached context and a decode row: only the prompts take the kernel.
    query, key_cache, value_cache, meta = make_batch([9, 70, 5, 1], [9, 70, 30, 41], 8, 2, head_dim, 16,
                                                     dtype, seed=head_dim)
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
