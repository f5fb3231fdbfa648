import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.fused_ops import fused_add_rms_norm
from nanovllm.kernels.gemm import (GemmConfig, SplitKOutput, dense_linear, gated_linear, partial_linear, splitk_config,
                                   splitk_linear)

ON_GPU = torch.cuda.is_available()
# The interpreter's bf16 tl.dot is wrong (Known traps): fp16 there, both on the GPU.
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
SHAPES = [(1, 256, 64), (5, 128, 96), (33, 256, 200), (70, 512, 128)]  # (M, K, N): ragged M and N
CONFIGS = [GemmConfig(1, 16, 32, 64), GemmConfig(1, 64, 64, 128, 8), GemmConfig(1, 16, 64, 32, 4, 2)]


def _inputs(m, k, n, dtype, device, gen):
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_dense_equals_the_product(m, k, n, config, dtype, device, gen):
    x, w = _inputs(m, k, n, dtype, device, gen)
    out = dense_linear(x, w, config)
    assert out.shape == (m, n) and out.dtype == dtype
    expect = (x.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(out, expect, atol=2e-3 * k ** 0.5, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gated_equals_silu_and_mul_of_the_product(m, k, n, config, dtype, device, gen):
    x, w = _inputs(m, k, 2 * n, dtype, device, gen)
    out = gated_linear(x, w, config)
    assert out.shape == (m, n) and out.dtype == dtype
    gate_up = (x.float() @ w.float().T).to(dtype).float()  # rounded like a GEMM output
    expect = (F.silu(gate_up[:, :n]) * gate_up[:, n:]).to(dtype)
    torch.testing.assert_close(out, expect, atol=2e-3 * k ** 0.5, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_partials_sum_to_the_product(m, k, n, splits, dtype, device, gen):
    x, w = _inputs(m, k, n, dtype, device, gen)
    out = partial_linear(x, w, GemmConfig(splits, 16, 32, k // splits // 2))
    assert isinstance(out, SplitKOutput) and out.parts.shape == (splits, m, n)
    torch.testing.assert_close(out.parts.sum(0), x.float() @ w.float().T, atol=2e-3 * k ** 0.5, rtol=1e-3)


@pytest.mark.parametrize("m", [1, 17, 40, 100, 150, 200])
def test_partials_with_the_table_configs(m, device, gen):
    """Every tile shape splitk_config picks (BM up to 128, BN 32 to 128, 4 or 8 warps) on a small K."""
    k, n = 512, 160
    x, w = _inputs(m, k, n, DTYPES[0], device, gen)
    config = splitk_config(m, n, k)
    out = partial_linear(x, w, config)
    assert isinstance(out, SplitKOutput) and out.parts.shape == (config.splits, m, n)
    torch.testing.assert_close(out.parts.sum(0), x.float() @ w.float().T, atol=2e-3 * k ** 0.5, rtol=1e-3)


@pytest.mark.parametrize("m", [1, 16, 17, 40, 100, 128, 129])
def test_dense_and_gated_with_the_table_configs(m, device, gen):
    """Every tile shape dense_config picks (16- and 64-row tiles) on a small K; none past its table."""
    from nanovllm.kernels.gemm import dense_config
    k, n = 256, 192
    x, w = _inputs(m, k, 2 * n, DTYPES[0], device, gen)
    if m > 128:
        assert dense_config(m, 2 * n, k) is None and dense_config(m, 2 * n, k, gated=True) is None
        return
    assert (dense_config(m, 2 * n, 4096) is None) == (m > 16)  # wide models: up to 16 rows only
    out = dense_linear(x, w, dense_config(m, 2 * n, k))
    gate_up = (x.float() @ w.float().T).to(x.dtype)
    torch.testing.assert_close(out, gate_up, atol=2e-3 * k ** 0.5, rtol=1e-2)
    out = gated_linear(x, w, dense_config(m, 2 * n, k, gated=True))
    gate_up = gate_up.float()
    expect = (F.silu(gate_up[:, :n]) * gate_up[:, n:]).to(x.dtype)
    torch.testing.assert_close(out, expect, atol=2e-3 * k ** 0.5, rtol=1e-2)


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
    assert splitk_config(256, 1024, 2048) is not None and splitk_config(257, 1024, 2048) is None  # then cuBLAS
    assert splitk_config(16, 4096, 4096) is None  # wide outputs (Qwen3-8B's o_proj): cuBLAS has the tiles
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
