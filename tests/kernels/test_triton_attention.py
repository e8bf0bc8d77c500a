"""The Triton kernels against the PyTorch reference, under Triton's interpreter on CPU
(and compiled on CUDA where available): mixed decode + prefill batches, contexts that are not
multiples of the block size, shuffled physical blocks, GQA ratios 1/4/8, head sizes incl. a
non-power-of-two, sliding windows, score soft-capping, and a KV pool large enough that 32-bit
offsets overflow."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, ReferenceAttentionBackend, get_attention_backend
from tests.kernels.paged_cases import make_batch as _make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def triton_backend():
    return get_attention_backend(DEVICE, prefer="triton")


def make_batch(*args, **kwargs):
    return _make_batch(*args, device=DEVICE, **kwargs)


# Mixed: decodes, a whole prompt, a chunk continuing a cached prefix, odd lengths.
MIXED = ([1, 9, 1, 21, 1], [37, 9, 16, 50, 70])
DECODE_ONLY = ([1, 1, 1, 1, 1, 1], [5, 64, 33, 17, 90, 1])
PREFILL_ONLY = ([19, 40], [19, 71])


@pytest.mark.parametrize("lens", [MIXED, DECODE_ONLY, PREFILL_ONLY], ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_matches_reference(triton_backend, lens, num_heads, num_kv_heads, block_size):
    query_lens, seq_lens = lens
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, 64,
                                                     block_size, torch.float32, seed=block_size + num_heads)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.125)
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_head_sizes(triton_backend, head_dim, dtype):
    query_lens, seq_lens = MIXED
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, 8, 2, head_dim, 16, dtype, seed=5)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(),
                                                       meta, head_dim ** -0.5)
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, head_dim ** -0.5)
    assert got.dtype == dtype
    tol = 2e-2 if dtype is torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(triton_backend, window):
    query_lens, seq_lens = MIXED
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, 4, 2, 64, 16, torch.float32, seed=window)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.125, window)
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.125, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens,window", [(MIXED, None), (PREFILL_ONLY, 7)], ids=["mixed", "prefill-window"])
def test_softcap_matches_reference(triton_backend, lens, window):
    """The mixed kernel (decode-only batches go to the split kernel: tests/kernels/test_triton_decode.py)
    with scores of spread ~4 (scale 0.5 over 64 dims) capped at 2: the cap changes the result."""
    query_lens, seq_lens = lens
    query, key_cache, value_cache, meta = make_batch(query_lens, seq_lens, 8, 2, 64, 16, torch.float32, seed=4)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (got - ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.5, window)
            ).abs().max() > 0.1


def test_softcap_bfloat16(triton_backend):
    query, key_cache, value_cache, meta = make_batch(*MIXED, 8, 2, 64, 16, torch.bfloat16, seed=6)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                       0.5, None, 2.0)
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.5, None, 2.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_write_kv_cache_matches_reference(triton_backend):
    num_kv_heads, head_dim, block_size = 2, 80, 16
    tables = [[3, 0], [5], [1, 4, 2]]
    meta = AttentionMetadata.build(block_tables=tables, query_lens=[4, 1, 20], seq_lens=[20, 9, 40],
                                   block_size=block_size, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(25, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(25, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    caches = [torch.zeros(6, block_size, num_kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    ReferenceAttentionBackend().write_kv_cache(key, value, caches[0], caches[1], meta.slot_mapping)
    triton_backend.write_kv_cache(key, value, caches[2], caches[3], meta.slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].abs().sum() > 0


@pytest.mark.skipif(DEVICE == "cuda", reason="a 4 GiB pool is fine on a GPU but this variant relies on lazy CPU pages")
def test_offsets_past_2_pow_31_elements(triton_backend):
    """A pool of 2**21 + 4 blocks of 16 x 1 x 64 fp16: block 2**21 starts at element 2**31.
    torch.empty only reserves address space, so the pages the kernels touch are all that is
    allocated. With 32-bit offset arithmetic these reads and writes would wrap and land far
    from the right place (or fault)."""
    block_size, head_dim = 16, 64
    num_blocks = 2**21 + 4
    key_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16)
    value_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16)
    assert key_cache.stride(0) * (num_blocks - 1) > 2**31
    high = [2**21 + 2, 2**21 + 1]  # both above the 32-bit boundary
    for b in high + [0]:
        key_cache[b].zero_()
        value_cache[b].zero_()
    meta = AttentionMetadata.build(block_tables=[high + [0]], query_lens=[40], seq_lens=[40],
                                   block_size=block_size)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(40, 1, head_dim, generator=gen).half()
    value = torch.randn(40, 1, head_dim, generator=gen).half()
    query = torch.randn(40, 2, head_dim, generator=gen).half()
    triton_backend.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    assert torch.equal(key_cache[high[0], :], key[:16])
    assert torch.equal(value_cache[high[1], :], value[16:32])
    got = triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.125)
    # the same data in a small pool: the reference's answer
    small_k = torch.zeros(3, block_size, 1, head_dim, dtype=torch.float16)
    small_v = torch.zeros_like(small_k)
    small_meta = AttentionMetadata.build(block_tables=[[0, 1, 2]], query_lens=[40], seq_lens=[40],
                                         block_size=block_size)
    ReferenceAttentionBackend().write_kv_cache(key, value, small_k, small_v, small_meta.slot_mapping)
    want = ReferenceAttentionBackend().paged_attention(query.float(), small_k.float(), small_v.float(),
                                                       small_meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_selection_refuses_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("cpu", prefer="triton")


@pytest.mark.cuda
def test_cuda_default_is_triton():
    assert get_attention_backend("cuda").name == "triton"


@pytest.mark.parametrize("block_size", [8, 24])
def test_unsupported_block_sizes_are_refused(triton_backend, block_size):
    query, key_cache, value_cache, meta = make_batch([1], [5], 4, 2, 64, block_size, torch.float32, seed=0)
    with pytest.raises(ValueError, match="power-of-two block_size >= 16"):
        triton_backend.paged_attention(query, key_cache, value_cache, meta, 0.125)
