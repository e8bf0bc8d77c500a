"""The float32 GEMV kernel (`kernels/cpu_gemv.cpp`) against ``F.linear``: 1-4 rows, sizes that are
and are not multiples of the 16-lane vectors and of the 4-row steps, bias or not, a strided input,
and the inputs it refuses; `PrepackedLinear` takes it for its few-row path."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_extension import try_build_cpu_extension

EXT, WHY = try_build_cpu_extension()
pytestmark = pytest.mark.skipif(EXT is None, reason=f"the CPU extension cannot be built here: {WHY}")
NO_BIAS = torch.empty(0)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(96, 80), (37, 33), (4, 16), (5, 1), (1030, 768)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows, n, k, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen)  # [N, K]
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)  # [M, K]
    got = EXT.linear_gemv(x, weight, bias if bias is not None else NO_BIAS)  # [M, N]
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_an_input_with_a_longer_row_stride_is_read_in_place():
    weight = torch.randn(50, 40)
    wide = torch.randn(2, 100)
    x = wide[:, 7:47]  # [2, 40], row stride 100: a slice of a fused projection's output
    torch.testing.assert_close(EXT.linear_gemv(x, weight, NO_BIAS), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x, weight, bias, message", [
    (torch.randn(5, 8), torch.randn(4, 8), NO_BIAS, "1 to 4 rows"),
    (torch.randn(1, 8), torch.randn(4, 9), NO_BIAS, "must agree on K"),
    (torch.randn(1, 8).double(), torch.randn(4, 8).double(), NO_BIAS, "float32 only"),
    (torch.randn(1, 8), torch.randn(8, 4).t(), NO_BIAS, "rows must be contiguous"),
    (torch.randn(1, 8), torch.randn(4, 8), torch.randn(3), "bias must be float32"),
])
def test_bad_inputs_are_refused_with_the_reason(x, weight, bias, message):
    with pytest.raises(RuntimeError, match=message):
        EXT.linear_gemv(x, weight, bias)


def test_prepacked_linear_takes_the_kernel_for_one_or_two_rows(monkeypatch):
    from kernels import cpu_linear

    calls = []
    monkeypatch.setattr(cpu_linear, "_gemv_kernel", lambda: lambda *a: calls.append(len(a[0])) or EXT.linear_gemv(*a))
    weight, bias = torch.randn(40, 24), torch.randn(40)
    layer = cpu_linear.PrepackedLinear(weight, bias)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert calls == [1, 2]  # three rows and more: the packed weight
    assert cpu_linear.PrepackedLinear(weight, keep_plain_weight=False)._gemv is None
