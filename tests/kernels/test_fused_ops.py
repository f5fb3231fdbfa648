"""Fused elementwise kernels (RMSNorm, the residual add, SiLU-and-mul) vs the plain-torch layers
(nanovllm.layers) they replace; the tolerances are elementwise_checks.py's.

On a CPU-only machine conftest.py selects the Triton interpreter.
"""

import pytest
import torch

from elementwise_checks import DTYPES, assert_match, check_exact, make_norm, poisoned, randn
from nanovllm.kernels.fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul
from nanovllm.layers.activation import silu_and_mul as torch_silu_and_mul
from nanovllm.layers.layernorm import RMSNorm


# (tokens, hidden): odd token counts, power-of-two and padded hidden sizes.
NORM_CASES = [(1, 64), (3, 96), (17, 1024), (100, 96), (100, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_CASES)
def test_rms_norm(tokens, hidden, dtype, device, gen):
    norm = make_norm(hidden, dtype, gen)
    # x as a strided view (row stride > hidden), like a slice of a wider buffer.
    x = randn((tokens, hidden + 32), dtype, "cpu", gen, scale=3.0)[:, :hidden]
    expect = norm(x)
    w = norm.weight.data.to(device)
    out = poisoned((tokens, hidden), dtype, device)
    got = rms_norm(x.to(device), w, norm.eps, out=out)
    assert got is out
    assert_match(got, expect, "rms_norm")
    assert_match(rms_norm(x.to(device), w, norm.eps), expect, "rms_norm (allocated)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_CASES)
def test_fused_add_rms_norm(tokens, hidden, dtype, device, gen):
    norm = make_norm(hidden, dtype, gen)
    x = randn((tokens, hidden), dtype, device, gen, scale=2.0)
    residual = randn((tokens, hidden), dtype, device, gen, scale=4.0)
    expect, expect_res = norm(x.cpu(), residual.cpu())
    w = norm.weight.data.to(device)
    out, res_out = poisoned(x.shape, dtype, device), poisoned(x.shape, dtype, device)
    y, r = fused_add_rms_norm(x, residual, w, norm.eps, out=out, residual_out=res_out)
    assert y is out and r is res_out
    assert_match(y, expect, "y")
    # The new residual is one fp32 add rounded once: exact (but the interpreter truncates to bf16).
    check_exact(r, expect_res, "residual")
    # In place, as the layer wiring may use it: outputs written over the inputs.
    y2, r2 = fused_add_rms_norm(x, residual, w, norm.eps, out=x, residual_out=residual)
    assert y2 is x and r2 is residual
    assert_match(x, expect, "y (in place)")
    check_exact(residual, expect_res, "residual (in place)")


def test_rms_norm_fp32_weight_promotes(device, gen):
    # A fp32 weight on bf16 activations gives fp32 out in torch (type promotion); keep that.
    norm = RMSNorm(96)
    norm.weight.data = torch.randn(96, generator=gen)
    x = randn((5, 96), torch.float16, device, gen)
    expect = norm(x.cpu())
    assert expect.dtype == torch.float32
    assert_match(rms_norm(x, norm.weight.data.to(device), norm.eps), expect, "promoted")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (3, 96), (17, 1536), (100, 96)])
def test_silu_and_mul(tokens, inter, dtype, device, gen):
    # Fused [gate | up] rows with padding (row stride > 2I), wide value range for silu tails.
    x = randn((tokens, 2 * inter + 16), dtype, device, gen, scale=4.0)[:, :2 * inter]
    expect = torch_silu_and_mul(x.cpu())  # the CPU path: plain torch
    out = poisoned((tokens, inter), dtype, device)
    got = silu_and_mul(x, out=out)
    assert got is out
    assert_match(got, expect, "silu_and_mul")
    assert_match(silu_and_mul(x), expect, "silu_and_mul (allocated)")


def test_empty_batch(device):
    x = torch.empty(0, 64, device=device)
    w = torch.ones(64, device=device)
    assert rms_norm(x, w).shape == (0, 64)
    assert fused_add_rms_norm(x, x, w)[1].shape == (0, 64)
    assert silu_and_mul(x).shape == (0, 32)
