"""The split-KV decode kernel against the PyTorch reference (Triton's interpreter on CPU, compiled
on CUDA): several splits per sequence, an empty split, GQA groups below tl.dot's 16 rows, sliding
windows, score soft-capping, float32 exact to rounding and bf16 within its precision."""

from __future__ import annotations

import pytest
import torch

from kernels import ReferenceAttentionBackend, get_attention_backend
from kernels.triton_decode import choose_num_splits
from tests.kernels.paged_cases import make_batch as _make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(*args, **kwargs):
    return _make_batch(*args, device=DEVICE, **kwargs)


@pytest.fixture(scope="module")
def backend():
    return get_attention_backend(DEVICE, prefer="triton")


def test_splits_fill_two_waves_but_stay_long_enough():
    assert choose_num_splits(1, 8, 32768, 132, 64) == (64, 512)  # 8 programs: 66 wanted, 64 at most
    assert choose_num_splits(1, 8, 32768, 132, 64, waves=2) == (32, 1024)  # 33 wanted, 1024-token splits
    assert choose_num_splits(256, 8, 4096, 132, 64) == (1, 4096)  # 2048 programs already
    assert choose_num_splits(1, 8, 300, 132, 64) == (1, 320)  # too short to split
    splits, tokens = choose_num_splits(2, 2, 1300, 4, 64)
    assert (splits, tokens) == (4, 384) and tokens % 64 == 0 and splits * tokens >= 1300
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 100, 132, 64)


@pytest.mark.parametrize("seq_lens", [[5, 1300], [700, 64, 1], [2049]], ids=["empty-split", "short", "one"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (32, 1)], ids=["mha", "gqa4", "mqa32"])
def test_decode_matches_reference_float32(backend, seq_lens, num_heads, num_kv_heads):
    query, key_cache, value_cache, meta = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 64, 16,
                                                     torch.float32, seed=len(seq_lens) + num_heads)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.125)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 100, 900])
def test_decode_sliding_window_across_splits(backend, window):
    query, key_cache, value_cache, meta = make_batch([1, 1], [1300, 40], 8, 2, 64, 16, torch.float32, seed=window)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.125, window)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.125, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 100])
def test_decode_softcap_across_splits(backend, window):
    """Scores of spread ~4 capped at 2, over several splits: the cap changes the result."""
    query, key_cache, value_cache, meta = make_batch([1, 1], [1300, 40], 8, 2, 64, 16, torch.float32, seed=2)
    want = ReferenceAttentionBackend().paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window, 2.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (got - backend.paged_attention(query, key_cache, value_cache, meta, 0.5, window)).abs().max() > 0.1


def test_decode_softcap_bfloat16(backend):
    query, key_cache, value_cache, meta = make_batch([1, 1, 1], [1100, 17, 600], 8, 2, 64, 16, torch.bfloat16, seed=7)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                       0.5, None, 2.0)
    got = backend.paged_attention(query, key_cache, value_cache, meta, 0.5, None, 2.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_decode_bfloat16(backend, head_dim):
    query, key_cache, value_cache, meta = make_batch([1, 1, 1], [1100, 17, 600], 8, 2, head_dim, 16, torch.bfloat16,
                                                     seed=head_dim)
    want = ReferenceAttentionBackend().paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                                       head_dim ** -0.5)
    got = backend.paged_attention(query, key_cache, value_cache, meta, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_split_and_unsplit_decode_agree(backend):
    """The same decode batch through the split kernel and through the mixed kernel."""
    from kernels.triton_attention import TritonAttentionBackend

    query, key_cache, value_cache, meta = make_batch([1, 1], [1500, 900], 8, 2, 64, 32, torch.float32, seed=3)
    split = backend.paged_attention(query, key_cache, value_cache, meta, 0.1)
    unsplit = TritonAttentionBackend(split_decode=False).paged_attention(query, key_cache, value_cache, meta, 0.1)
    torch.testing.assert_close(split, unsplit, atol=2e-5, rtol=2e-5)
