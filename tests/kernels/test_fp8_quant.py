"""Per-token-group FP8 quantization kernels: bit-exact against the torch reference (the interpreter's
own float -> fp8 conversion is wrong, so kernels/fp8_quant.py rounds to the grid there first; the GPU
runs the hardware conversion these tests then check)."""
import pytest
import torch

from nanovllm.kernels import reference as ref
from nanovllm.kernels.fp8_quant import (QuantizedActivation, fused_add_rms_norm_quant, padded_rows,
                                        per_token_group_quant, silu_and_mul_quant)
from nanovllm.kernels.fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul
from nanovllm.kernels.gemm import SplitKOutput

DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # loads and stores only: bf16 is exact here too


def _assert_quantized(out: QuantizedActivation, x: torch.Tensor):
    """out is exactly the reference quantization of x [M, K]."""
    m, k = x.shape
    q, scale = ref.per_token_group_quant_fp8(x)
    assert out.rows == m and out.data.shape == (padded_rows(m), k) and out.dtype == x.dtype
    assert out.scale.shape == (-(-k // 128), padded_rows(m))
    assert torch.equal(out.data[:m].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out.scale[:, :m].t(), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 64), (3, 128), (5, 200), (2, 1000), (1, 2304)])  # partial groups, many programs
def test_group_quant_matches_reference(m, k, dtype, device, gen):
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)).to(device, dtype)
    x[0, :min(k, 128)] = 0  # an all-zero group: finite scale, zeros
    out = per_token_group_quant(x)
    _assert_quantized(out, x)
    # e4m3 keeps 3 mantissa bits (half a step: 2^-4 relative) down to 2^-6 x the scale, then steps of 2^-9.
    scale = out.scale[:, :m].t().repeat_interleave(128, dim=1)[:, :k]
    err = (out.dequantize().float() - x.float()).abs()
    assert (err <= x.float().abs() * 2 ** -4 + scale * 2 ** -10).all()


def test_rounding_on_the_fp8_grid(device):
    """Every e4m3 value, every midpoint between two (ties to even) and their neighbours, both signs."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    x = torch.cat([x, -x])
    x = torch.cat([x, torch.full((128 - x.numel() % 128,), 448.0)])  # whole groups whose amax is 448: scale 1
    x = x.view(-1, 128).to(device)
    x[:, 0] = 448.0
    _assert_quantized(per_token_group_quant(x), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [64, 200, 1024])
def test_rms_norm_quant_equals_norm_then_quant(n, dtype, device, gen):
    m = 7
    x = torch.randn(m, n, generator=gen).to(device, dtype)
    res = torch.randn(m, n, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
    out, r_none = fused_add_rms_norm_quant(x, None, w)
    assert r_none is None
    _assert_quantized(out, rms_norm(x, w))
    out, r_out = fused_add_rms_norm_quant(x, res, w)
    y, r_expect = fused_add_rms_norm(x, res, w)
    _assert_quantized(out, y)
    assert torch.equal(r_out, r_expect)


def test_rms_norm_quant_sums_split_k_partials(device, gen):
    m, n = 5, 256
    parts = SplitKOutput(torch.randn(4, m, n, generator=gen).to(device), torch.bfloat16)
    res = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    out, r_out = fused_add_rms_norm_quant(parts, res, w)
    y, r_expect = fused_add_rms_norm(parts, res, w)
    _assert_quantized(out, y)
    assert torch.equal(r_out, r_expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("i", [96, 256, 1280])
def test_silu_and_mul_quant_equals_silu_and_mul_then_quant(i, dtype, device, gen):
    x = (torch.randn(6, 2 * i, generator=gen) * 3).to(device, dtype)
    _assert_quantized(silu_and_mul_quant(x), silu_and_mul(x))


def test_empty_batch(device):
    out = per_token_group_quant(torch.empty(0, 256, device=device, dtype=torch.bfloat16))
    assert out.rows == 0 and out.data.shape == (0, 256)
