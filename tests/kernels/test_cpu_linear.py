"""`PrepackedLinear` against ``F.linear``: same function, any row count, bias or not."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import PrepackedLinear, cpu_prepack_unavailable_reason, prepack_linear_layers

pytestmark = pytest.mark.skipif(
    cpu_prepack_unavailable_reason(torch.float32, torch.device("cpu")) is not None,
    reason="this torch build cannot pre-pack linear weights",
)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_for_any_row_count(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)  # [N, K]
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)  # [M, K]
    layer = PrepackedLinear(weight, bias, batch_hint=32)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_non_contiguous_input_and_dense_weight_round_trip():
    weight = torch.randn(64, 48)
    layer = PrepackedLinear(weight)
    x = torch.randn(48, 10).t()  # [10, 48], not contiguous
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(layer.dense_weight(), weight)


bf16_packable = pytest.mark.skipif(
    cpu_prepack_unavailable_reason(torch.bfloat16, torch.device("cpu")) is not None,
    reason="oneDNN has no bfloat16 kernels on this CPU",
)


@bf16_packable
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_is_a_float32_accumulated_product_rounded_once(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(torch.bfloat16)  # [N, K]
    bias = torch.randn(96, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 80, generator=gen).to(torch.bfloat16)  # [M, K]
    layer = PrepackedLinear(weight, bias)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # one rounding to bfloat16 of a float32 sum: within 2**-8 relative (plus float32 noise near 0)
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
    # no plain copy is kept: the packed GEMV serves every row count in bfloat16
    assert layer.plain_weight is None
    assert torch.equal(layer.dense_weight(), weight)


def test_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="only float32 and bfloat16"):
        PrepackedLinear(torch.randn(8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        PrepackedLinear(torch.randn(8))
    with pytest.raises(ValueError, match="bias must have shape"):
        PrepackedLinear(torch.randn(8, 4), torch.randn(4))


def test_prepack_linear_layers_swaps_every_linear_and_keeps_the_function():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 16)
    want = model(x)
    assert prepack_linear_layers(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("keep_plain_weight", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_small_batches_use_the_plain_weight_only_when_it_is_kept(rows, keep_plain_weight, monkeypatch):
    weight = torch.randn(40, 24)
    layer = PrepackedLinear(weight, keep_plain_weight=keep_plain_weight)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, 24)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert bool(calls) == (not keep_plain_weight or rows > 2)
    assert (layer.plain_weight is not None) == keep_plain_weight
