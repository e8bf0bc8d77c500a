"""The CPU serving backend (C++ decode kernel + reference prefill) against the reference."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import ReferenceAttentionBackend, get_attention_backend
from tests.kernels.paged_cases import make_batch

MIXED = ([1, 9, 1, 21, 1, 1], [37, 9, 16, 50, 70, 1])
DECODE_ONLY = ([1] * 12, [5, 64, 33, 17, 90, 1, 2, 16, 31, 48, 7, 100])


@pytest.fixture(scope="module")
def cpu_backend():
    return get_attention_backend("cpu", prefer="cpu")


@pytest.mark.parametrize("lens", [MIXED, DECODE_ONLY], ids=["mixed", "decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(cpu_backend, lens, num_heads, num_kv_heads, window, block_size):
    query_lens, seq_lens = lens
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, 32,
                                                     block_size, torch.float32, seed=num_heads + block_size)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.2, window)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.2, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [MIXED, DECODE_ONLY], ids=["mixed", "decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("window", [None, 6])
def test_softcap_matches_reference(cpu_backend, lens, num_heads, num_kv_heads, window):
    """Scores of spread ~3 (scale 0.5 over 32 dims) capped at 2: the cap changes the result."""
    query_lens, seq_lens = lens
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, 32, 16,
                                                     torch.float32, seed=num_heads)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    uncapped = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window)
    assert (got - uncapped).abs().max() > 0.1


def test_is_the_default_on_cpu_and_repeated_layers_reuse_the_plan(cpu_backend):
    assert get_attention_backend("cpu").name == "cpu"
    query, key_cache, value_cache, meta = make_batch(*MIXED, 8, 2, 32, 16, torch.float32, seed=1)
    first = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.2)
    # a second "layer" with other caches but the same step metadata: same plan, new values
    again = cpu_backend.paged_attention(query, key_cache * 2, value_cache * 3, meta, 0.2)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache * 2, value_cache * 3, meta, 0.2)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first, again)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 2.0)], ids=["plain", "window", "softcap"])
def test_bfloat16_decode_is_float32_arithmetic_on_bfloat16_storage(cpu_backend, window, softcap):
    """bfloat16 K/V and queries, widened exactly, attended in float32, rounded once at the end:
    the float32 reference on the widened inputs, rounded to bfloat16 (ties aside, bit for bit)."""
    query, key_cache, value_cache, meta = make_batch(*DECODE_ONLY, 8, 2, 32, 16, torch.bfloat16, seed=2)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window, softcap)
    assert got.dtype == torch.bfloat16
    exact = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(),
                                                        meta, 0.5, window, softcap)
    # float32 summation order differs from SDPA's by ~1e-7, so a rounding can land one bfloat16 step away
    torch.testing.assert_close(got, exact.to(torch.bfloat16), atol=1e-6, rtol=2 ** -7)
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99


# Head sizes of real models take the kernel's AVX-512 path (64 and 128; others the portable loops):
# contexts of 1 token, under and over 16 (the vector width, the exp's tail mask) and across blocks.
WIDE_DECODE = ([1] * 7, [1, 15, 16, 17, 40, 129, 300])


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (12, 4), (16, 2), (9, 1)], ids=["mha", "g3", "g8", "g9"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 2.0)], ids=["plain", "window", "softcap"])
def test_model_head_sizes_match_float32_arithmetic(cpu_backend, head_dim, num_heads, num_kv_heads, dtype, window,
                                                   softcap):
    query, key_cache, value_cache, meta = make_batch(*WIDE_DECODE, num_heads, num_kv_heads, head_dim, 16, dtype,
                                                     seed=head_dim + num_heads)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, head_dim ** -0.5, window, softcap)
    exact = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                        head_dim ** -0.5, window, softcap)
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    else:  # one rounding of a float32 result (summation order aside)
        torch.testing.assert_close(got, exact.to(torch.bfloat16), atol=1e-6, rtol=2 ** -7)
        assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("lens", [MIXED, DECODE_ONLY], ids=["mixed", "decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_bfloat16_matches_the_bfloat16_reference(cpu_backend, lens, num_heads, num_kv_heads):
    """Prefill rows take the reference in bfloat16; decode rows the kernel: within bfloat16 rounding."""
    query, key_cache, value_cache, meta = make_batch(*lens, num_heads, num_kv_heads, 32, 16, torch.bfloat16, seed=3)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, 6)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.5, 6)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_float16_falls_back_to_the_reference(cpu_backend):
    query, key_cache, value_cache, meta = make_batch(*MIXED, 8, 2, 32, 16, torch.float16, seed=2)
    got = cpu_backend.paged_attention(query, key_cache, value_cache, meta, 0.2)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.2)
    assert torch.equal(got, want)


def test_unbuildable_kernel_falls_back_with_a_warning(monkeypatch, caplog):
    import kernels.cpu_extension as cpu_extension

    monkeypatch.setattr(cpu_extension, "try_build_cpu_extension", lambda: (None, "no compiler"))
    with caplog.at_level(logging.WARNING):
        assert get_attention_backend("cpu").name == "reference"
    assert "no compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no compiler"):
        get_attention_backend("cpu", prefer="cpu")


@pytest.mark.parametrize("name", ["reference", "cpu", "triton"])
def test_uneven_gqa_groups_are_refused_by_every_backend(name):
    # Triton runs compiled on a GPU where there is one, else in its interpreter on the CPU.
    device = "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"
    query, key_cache, value_cache, meta = make_batch([1, 3], [5, 17], 6, 4, 32, 16, torch.float32, seed=0,
                                                     device=device)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        get_attention_backend(device, prefer=name).paged_attention(query, key_cache, value_cache, meta, 0.2)
