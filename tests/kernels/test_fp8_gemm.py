"""W8A8 block-scaled GEMMs (kernels/fp8_gemm.py) against the dequantize-then-multiply reference:
on the same quantized operands only the fp32 summation order may differ; against the unquantized
activations the error is the activation quantization's (e4m3: ~2-4% of a product's size)."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import reference as ref
from nanovllm.kernels.fp8_gemm import (Fp8GemmConfig, fp8_dense_config, fp8_gated_config, fp8_gated_linear,
                                       fp8_linear, fp8_partial_linear, fp8_splitk_config)
from nanovllm.kernels.fp8_quant import QuantizedActivation, per_token_group_quant
from nanovllm.kernels.gemm import SplitKOutput

ON_GPU = torch.cuda.is_available()
# Under the interpreter the activation dtype only names the output's: fp32 there checks the sums tightly.
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# (M, K, N): partial K and N blocks; K=200 is not 16-byte aligned (masked loads instead of TMA).
SHAPES = [(1, 256, 64), (5, 200, 96), (33, 384, 256), (70, 128, 320)]
CONFIGS = [Fp8GemmConfig(1, 16, 32, 4, 2), Fp8GemmConfig(1, 64, 64, 4, 3), Fp8GemmConfig(1, 16, 128, 4, 2)]


def _weight(n, k, gen, device):
    """A random [n, k] weight in 128x128 blocks of float8_e4m3fn with their fp32 scales."""
    from nanovllm.layers.quantization.fp8 import quantize_weight_blocks
    w, scale = quantize_weight_blocks(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))
    return w.to(device), scale.to(device)


def _activation(m, k, dtype, gen, device) -> tuple[torch.Tensor, QuantizedActivation]:
    x = (torch.randn(m, k, generator=gen) * (1 + 3 * torch.rand(m, 1, generator=gen))).to(device, dtype)
    return x, per_token_group_quant(x)


def _reference(xq: QuantizedActivation, w, ws):
    q, s = xq.data[:xq.rows], xq.scale[:, :xq.rows].t()
    return ref.w8a8_block_matmul(q, s, w, ws, torch.float32)


# The fp32 partial sums: exact sums of exact products under the interpreter; on the GPU the FP8 tensor
# cores add a K block's 128 products keeping only ~14 mantissa bits (why block FP8 rescales in fp32
# after every block), so there they are checked at that precision.
PARTIALS = torch.float32 if not ON_GPU else "fp8 tensor cores"


def _close_to_reference(got, expect, dtype):
    tol = {torch.float32: 1e-5, "fp8 tensor cores": 1e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), expect, rtol=tol, atol=tol * expect.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_dense_equals_the_dequantized_product(m, k, n, config, dtype, device, gen):
    w, ws = _weight(n, k, gen, device)
    x, xq = _activation(m, k, dtype, gen, device)
    out = fp8_linear(xq, w, ws, config)
    assert out.shape == (m, n) and out.dtype == dtype
    _close_to_reference(out, _reference(xq, w, ws), dtype)
    # Against the unquantized activations: the error of 1x128 quantization.
    exact = x.float() @ ref.dequantize_blocks(w, ws).T
    assert (out.float() - exact).norm() <= 0.05 * exact.norm()


@pytest.mark.parametrize("group_m", [1, 2, 3])
def test_every_tile_once_whatever_the_walk(group_m, device, gen):
    # 5 rows of 16-row tiles x 10 columns of tiles: groups of 2 and 3 rows leave a ragged last group.
    m, k, n = 70, 128, 320
    w, ws = _weight(n, k, gen, device)
    _, xq = _activation(m, k, DTYPES[0], gen, device)
    out = fp8_linear(xq, w, ws, Fp8GemmConfig(1, 16, 32, 4, 2, group_m))
    _close_to_reference(out, _reference(xq, w, ws), DTYPES[0])


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("m,k,n", [(1, 512, 64), (9, 1000, 200), (40, 512, 128)])
def test_partials_sum_to_the_product(m, k, n, splits, dtype, device, gen):
    w, ws = _weight(n, k, gen, device)
    _, xq = _activation(m, k, dtype, gen, device)
    out = fp8_partial_linear(xq, w, ws, Fp8GemmConfig(splits, 16, 32, 4, 2))
    assert isinstance(out, SplitKOutput) and out.parts.shape == (splits, m, n) and out.dtype == dtype
    _close_to_reference(out.parts.sum(0), _reference(xq, w, ws), PARTIALS)


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("m,k,inter", [(1, 256, 128), (6, 200, 256), (20, 384, 384)])
@pytest.mark.parametrize("quantize_output,bn", [(False, 64), (True, 128), (True, 32)])
def test_gated_equals_silu_and_mul_of_the_product(m, k, inter, quantize_output, bn, dtype, device, gen):
    """bn=128 with quantize_output: the tile's epilogue quantizes; 32: a quantization pass follows."""
    w, ws = _weight(2 * inter, k, gen, device)
    _, xq = _activation(m, k, dtype, gen, device)
    gate_up = _reference(xq, w, ws).to(dtype).float()  # rounded like a GEMM output
    expect = (F.silu(gate_up[:, :inter]).to(dtype).float() * gate_up[:, inter:]).to(dtype)
    config = Fp8GemmConfig(1, 16, bn, 4, 2)
    out = fp8_gated_linear(xq, w, ws, config, quantize_output)
    if quantize_output:
        assert isinstance(out, QuantizedActivation) and out.shape == (m, inter)
        # The epilogue quantizes its own output (a last-bit difference in a sum can move a value to the
        # next fp8 step): within one e4m3 step of quantizing the reference output.
        got = out.dequantize().float()
        scale = out.scale[:, :m].t().repeat_interleave(128, dim=1)
        assert ((got - expect.float()).abs() <= expect.float().abs() * 2 ** -3 + scale * 2 ** -8).all()
        q, s = ref.per_token_group_quant_fp8(expect)
        assert (out.data[:m].view(torch.uint8) == q.view(torch.uint8)).float().mean() > 0.98
    else:
        assert out.shape == (m, inter) and out.dtype == dtype
        _close_to_reference(out, expect.float(), dtype)


@pytest.mark.parametrize("m", [1, 17, 64, 100, 300])
def test_the_tables_tiles(m, device, gen):
    """Every tile the tables pick (16- and 64-row tiles, split-K, the fallback's), on a small problem."""
    k, n = 512, 256
    dtype = DTYPES[0]
    w, ws = _weight(n, k, gen, device)
    _, xq = _activation(m, k, dtype, gen, device)
    expect = _reference(xq, w, ws)
    _close_to_reference(fp8_linear(xq, w, ws, fp8_dense_config(m, n)), expect, dtype)
    splitk = fp8_splitk_config(m, k)
    assert (splitk is None) == (m > 128)
    if splitk is not None:
        _close_to_reference(fp8_partial_linear(xq, w, ws, splitk).parts.sum(0), expect, PARTIALS)
    gated = fp8_gated_linear(xq, w, ws, fp8_gated_config(m), quantize_output=True)
    assert gated.shape == (m, n // 2)


def test_the_deep_split_k_tiles(device, gen):
    """A decode row over a deep K (down_proj's): the table's 8 slices."""
    m, k, n = 1, 64 * 128, 64
    config = fp8_splitk_config(m, k)
    assert config.splits == 8
    w, ws = _weight(n, k, gen, device)
    _, xq = _activation(m, k, DTYPES[0], gen, device)
    _close_to_reference(fp8_partial_linear(xq, w, ws, config).parts.sum(0), _reference(xq, w, ws), PARTIALS)


@pytest.mark.parametrize("m", [1, 6, 129, 1000])
def test_library_block_scaled_mm_equals_the_reference(m, device, gen):
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales (cuBLASLt, CUDA >= 12.9, sm_90),
    the engine's prefill GEMM where a start-up check finds it, on a row count that needs padding to 4."""
    from nanovllm.kernels.fp8_gemm import library_available, library_scaled_mm
    if not ON_GPU or not library_available(device):
        pytest.skip("needs torch._scaled_mm's block-scaled FP8 (cuBLASLt on sm_90, CUDA >= 12.9)")
    k, n = 512, 384
    w, ws = _weight(n, k, gen, device)
    _, xq = _activation(m, k, torch.bfloat16, gen, device)
    bias = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    out = library_scaled_mm(xq, w, ws, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _close_to_reference(out, _reference(xq, w, ws) + bias.float(), torch.bfloat16)
