"""The fused CPU element-wise ops against the PyTorch code they replace (the callers' fallbacks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_rms_norm, fused_rope, fused_silu_and_mul
from kernels.cpu_extension import try_build_cpu_extension

pytestmark = pytest.mark.skipif(try_build_cpu_extension()[0] is None, reason="the CPU extension cannot be built here")


def torch_rms_norm(x, weight, eps):  # worker/llama.py's RMSNorm fallback, as transformers computes it
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
