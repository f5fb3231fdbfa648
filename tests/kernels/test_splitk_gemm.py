import pytest
import torch

from nanovllm.kernels.fused_ops import fused_add_rms_norm, silu_and_mul
from nanovllm.kernels.splitk_gemm import SplitKOutput, splitk_config, splitk_linear
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.linear import RowParallelLinear

ON_GPU = torch.cuda.is_available()
# The interpreter's bf16 tl.dot is wrong (Known traps): fp16 there, both on the GPU.
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 2048, 1024), (5, 3072, 1024), (33, 1024, 96), (70, 512, 200),
                                   (128, 2048, 1024)])
def test_splitk_partials_sum_to_the_product(m, k, n, dtype, device, gen):
    if not ON_GPU and m * n * k > 20_000_000:
        pytest.skip("large shape: GPU only")
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    out = splitk_linear(x, w)
    assert isinstance(out, SplitKOutput) and out.parts.shape[0] > 1 and out.shape == (m, n)
    expect = x.float() @ w.float().T
    torch.testing.assert_close(out.parts.sum(0), expect, atol=2e-3 * k ** 0.5, rtol=1e-3)
    assert out.sum().dtype == dtype


def test_splitk_config_limits():
    assert splitk_config(256, 1024, 2048) is None  # large batches: cuBLAS
    assert splitk_config(16, 1024, 100) is None  # K does not split into 128-wide slices
    splits, bm, bn, bk, _, _ = splitk_config(8, 1024, 3072)
    assert 3072 % (splits * bk) == 0 and splits > 1 and bm == 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_sums_partials(dtype, device, gen):
    """The norm fed with partials equals the norm fed with their sum rounded to the dtype."""
    m, k, n = 6, 1024, 256
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    residual = torch.randn(m, n, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
    parts = splitk_linear(x, w)
    y, r = fused_add_rms_norm(parts, residual, weight, 1e-6)
    y_ref, r_ref = fused_add_rms_norm(parts.sum(), residual, weight, 1e-6)
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)


def _gate_up(m, i, dtype, device, gen):
    """A gate_up output [m, 2i] with a padded row stride and a wide range (silu's tails)."""
    return (torch.randn(m, 2 * i + 16, generator=gen) * 4).to(device, dtype)[:, :2 * i]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,i,n", [(1, 3072, 1024), (7, 1024, 96), (33, 512, 200), (65, 1024, 64),
                                   (128, 1024, 96)])
def test_gated_splitk_is_silu_and_mul_then_splitk(m, i, n, dtype, device, gen):
    """SiLU-and-mul fused into the A-load: the partials are those of silu_and_mul + split-K,
    bit for bit (same A operand, same tiles, same accumulation order)."""
    gate_up = _gate_up(m, i, dtype, device, gen)
    w = (torch.randn(n, i, generator=gen) * 0.05).to(device, dtype)
    out = splitk_linear(gate_up, w, gated=True)
    a = silu_and_mul(gate_up)
    ref = splitk_linear(a, w)
    assert isinstance(out, SplitKOutput) and out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.parts, ref.parts, atol=0, rtol=0)
    expect = a.float() @ w.float().T  # fp32 product of the rounded A operand
    torch.testing.assert_close(out.parts.sum(0), expect, atol=2e-3 * i ** 0.5, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_splitk_a_operand_is_silu_and_mul(dtype, device, gen):
    """With an identity weight each output is one A element times 1 (exact in any order): the
    A operand the kernel builds equals silu_and_mul's output exactly."""
    m, i = 5, 512
    gate_up = _gate_up(m, i, dtype, device, gen)
    out = splitk_linear(gate_up, torch.eye(i, dtype=dtype, device=device), gated=True)
    assert torch.equal(out.sum(), silu_and_mul(gate_up))


def test_gated_splitk_declines_large_batches(device, gen):
    gate_up = _gate_up(256, 512, torch.float16, device, gen)
    assert splitk_linear(gate_up, torch.zeros(64, 512, dtype=torch.float16, device=device), gated=True) is None


@pytest.mark.parametrize("m", [3, 200])
def test_row_parallel_forward_gated(m, device, gen):
    """down_proj.forward_gated(gate_up) == down_proj(silu_and_mul(gate_up)): split-K partials for a
    decode batch on the GPU, the unfused path (a plain tensor) on the CPU and for large batches."""
    dtype = torch.float16
    i, n = 512, 128
    layer = RowParallelLinear(i, n).to(device, dtype)
    layer.weight.data = (torch.randn(n, i, generator=gen) * 0.05).to(device, dtype)
    gate_up = _gate_up(m, i, dtype, device, gen)
    got = layer.forward_gated(gate_up, partials_ok=True)
    expect = layer(SiluAndMul()(gate_up), partials_ok=True)  # the model's unfused path
    assert type(got) is type(expect)
    assert isinstance(got, SplitKOutput) == (device.type == "cuda" and m <= 128)
    if isinstance(got, SplitKOutput):
        torch.testing.assert_close(got.parts, expect.parts, atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, expect, atol=0, rtol=0)
        torch.testing.assert_close(layer.forward_gated(gate_up), expect, atol=0, rtol=0)
