"""The fused CPU element-wise ops against the PyTorch code they replace (the callers' fallbacks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_rms_norm, fused_rope, fused_silu_and_mul
from kernels.cpu_fused_ops import fused_add_rms_norm
from kernels.cpu_extension import try_build_cpu_extension

pytestmark = pytest.mark.skipif(try_build_cpu_extension()[0] is None, reason="the CPU extension cannot be built here")


def torch_rms_norm(x, weight, eps):  # worker/models/llama.py's RMSNorm fallback, as transformers computes it
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def torch_rope(x, cos, sin):  # worker/rotary_embedding.apply_rope's fallback
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((torch_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_is_transformers_arithmetic(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 3 * 768, generator=gen) * 3).to(dtype)[:, 768:1536]  # [T, H], a strided slice
    weight = (torch.randn(768, generator=gen) + 1).to(dtype)
    got = fused_rms_norm(x, weight, 1e-6)
    want = torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:  # the mean's sum order differs: last bits
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one bfloat16 step where the float32 norm lands on a rounding boundary
        assert (got == want).float().mean() > 0.99
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_pytorchs_arithmetic(dtype):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(33, 2 * 300, generator=gen) * 4).to(dtype)  # [T, 2I]
    got = fused_silu_and_mul(gate_up)
    gate, up = gate_up.split(300, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (33, 300) and got.dtype == dtype
    # exp's last bit differs from PyTorch's vectorised exp: float32 agrees to ~1 ulp, and the
    # bfloat16 roundings of those agree almost everywhere
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 2 ** -7, atol=1e-6)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_is_apply_ropes_arithmetic_bit_for_bit(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(9, (8 + 2 + 2) * 64, generator=gen).to(dtype)  # a fused projection's output
    q = qkv[:, :512].view(9, 8, 64)  # [T, H, D], row stride 768
    angles = torch.randn(9, rotary_dim // 2, generator=gen) * 40
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, R]
    got = fused_rope(q, cos, sin)
    assert torch.equal(got, torch_rope(q, cos, sin))  # no FMA contraction: PyTorch's two roundings


def test_not_applicable_returns_none():
    x = torch.randn(4, 8, dtype=torch.float16)
    assert fused_rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6) is None
    assert fused_silu_and_mul(x) is None
    assert fused_rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6) is None  # mixed dtypes
    assert fused_rope(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 8)) is None  # cos not [T, 1, R]
    assert fused_silu_and_mul(torch.randn(4, 8, requires_grad=True)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(13, 2 * 768, generator=gen) * 3).to(dtype)[:, :768]  # [T, H], strided
    delta = (torch.randn(13, 768, generator=gen) * 3).to(dtype)
    weight = (torch.randn(768, generator=gen) + 1).to(dtype)
    got_sum, got_normed = fused_add_rms_norm(x, delta, weight, 1e-5)
    want_sum = x + delta
    assert torch.equal(got_sum, want_sum)  # the add rounds to the dtype as PyTorch's does
    # the norm of the rounded sum: exactly what fused_rms_norm gives for it
    assert torch.equal(got_normed, fused_rms_norm(want_sum, weight, 1e-5))
    torch.testing.assert_close(got_normed, torch_rms_norm(want_sum, weight, 1e-5),
                               rtol=1e-6 if dtype == torch.float32 else 2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_where_it_sits_or_its_batch(dtype):
    # A model fed layer by layer (zigzag) normalises the same rows in other batches and at other
    # addresses than one loaded whole: the results must be the same bits.
    gen = torch.Generator().manual_seed(9)
    rows = (torch.randn(40, 771, generator=gen) * 2).to(dtype)  # odd width: no lane-aligned rows
    weight = (torch.randn(771, generator=gen) + 1).to(dtype)
    gate_up = (torch.randn(40, 2 * 333, generator=gen) * 3).to(dtype)
    whole = fused_rms_norm(rows, weight, 1e-6)
    whole_silu = fused_silu_and_mul(gate_up)
    for start in (1, 3, 17):
        part = rows[start:start + 5].clone()  # another address, another batch size
        assert torch.equal(fused_rms_norm(part, weight, 1e-6), whole[start:start + 5])
        assert torch.equal(fused_silu_and_mul(gate_up[start:start + 5].clone()), whole_silu[start:start + 5])
        single = torch.empty(1, 772, dtype=dtype)[:, 1:]  # one element off
        single.copy_(rows[start:start + 1])
        assert torch.equal(fused_rms_norm(single, weight, 1e-6), whole[start:start + 1])


def test_large_calls_split_over_threads_give_the_single_thread_bits():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 1024, generator=gen)).to(torch.bfloat16)  # above the threading threshold
    weight = (torch.randn(1024, generator=gen) + 1).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused_rms_norm(x, weight, 1e-6)
        torch.set_num_threads(2)
        assert torch.equal(fused_rms_norm(x, weight, 1e-6), alone)
    finally:
        torch.set_num_threads(threads)


def test_add_rms_norm_refuses_what_it_does_not_cover():
    x = torch.randn(4, 8)
    assert fused_add_rms_norm(x, torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6) is None
    assert fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6) is None
    assert fused_add_rms_norm(x.half(), x.half(), torch.ones(8).half(), 1e-6) is None
