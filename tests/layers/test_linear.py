"""Projection layers: on the GPU decode-sized batches take our Triton GEMM (dense, SwiGLU-fused or
split-K partials); every path must equal the plain product."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.gemm import SplitKOutput
from nanovllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def _init(layer, gen):
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
    return layer.to(DEVICE, DTYPE)


def _rows(m, k, gen):
    return torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)


def _close(got, expect, k):
    torch.testing.assert_close(got.float(), expect.float(), atol=3e-3 * k ** 0.5, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 300])  # both sides of the Triton / cuBLAS threshold
def test_column_parallel_equals_the_product(m):
    gen = torch.Generator().manual_seed(m)
    layer = _init(ColumnParallelLinear(256, 384), gen)
    x = _rows(m, 256, gen)
    _close(layer(x), (x.float() @ layer.weight.float().T), 256)


@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_swiglu_equals_silu_of_gate_times_up(m):
    gen = torch.Generator().manual_seed(m)
    layer = _init(MergedColumnParallelLinear(256, [192, 192]), gen)
    x = _rows(m, 256, gen)
    gate_up = F.linear(x, layer.weight).float()
    expect = F.silu(gate_up[:, :192]) * gate_up[:, 192:]
    got = layer.swiglu(x)
    assert got.shape == (m, 192) and got.dtype == DTYPE
    _close(got, expect, 256)


@pytest.mark.parametrize("m", [1, 64, 200])
def test_row_parallel_partials_sum_to_the_product(m):
    gen = torch.Generator().manual_seed(m)
    layer = _init(RowParallelLinear(512, 256), gen)
    x = _rows(m, 512, gen)
    out = layer(x, partials_ok=True)
    if ON_GPU and m <= 128:
        assert isinstance(out, SplitKOutput)
    got = out.sum() if isinstance(out, SplitKOutput) else out
    _close(got, x.float() @ layer.weight.float().T, 512)
