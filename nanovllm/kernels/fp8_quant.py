"""Block-FP8 activations: dynamic per-token-group (1 x 128) quantization to float8_e4m3fn, as the
W8A8 block-scaled GEMMs (kernels/fp8_gemm.py) take their input, fused into the kernel that produces
that input where it can be:

- `fused_add_rms_norm_quant` / `rms_norm_quant`: the RMSNorm before qkv and gate_up;
- `silu_and_mul_quant`: SiLU-and-mul before down_proj (prefill-sized batches; decode-sized ones
  quantize in the gated GEMM's epilogue);
- `per_token_group_quant`: any other input (the attention output before o_proj).

Each group of 128 consecutive values of a row gets scale = max(|x|, 1e-10) / 448 and values
x / scale (clamped to +-448, rounded to nearest even): the recipe of vLLM's and SGLang's
`per_token_group_quant_fp8`. The value quantized is the producer's output as it would have been
written in the activation dtype, so a fused kernel equals its unfused pair bit for bit
(tests/kernels/test_fp8_quant.py). Scales are stored column-major, [groups, rows] with rows padded
to a multiple of 4 (`QuantizedActivation`): cuBLAS's 1x128 block-scaled GEMM reads exactly that
layout, and the Triton GEMMs read a tile's scales as one contiguous vector.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import FP8_DTYPE, quantize_to_fp8
from nanovllm.kernels.fused_ops import _launch_opts, _rows, norm_input, rms_norm_row, silu_mul
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

GROUP_SIZE = 128
# An all-zero group gets amax 1e-10 (quantize_groups): a finite scale, and zeros.


def padded_rows(m: int) -> int:
    """Rows of a quantized activation's buffers: cuBLAS wants M % 4 == 0 for 1x128 scales."""
    return -(-m // 4) * 4


class QuantizedActivation(NamedTuple):
    """A [rows, K] activation in block FP8: `data` [padded_rows(rows), K] float8_e4m3fn and `scale`
    [ceil(K / 128), padded_rows(rows)] float32 (value = data * scale of its 128-column group). Rows
    past `rows` are padding with any contents (a GEMM's output rows there are never read)."""
    data: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype  # the activation dtype it stands for: the GEMM's output dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.data.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The plain [rows, K] tensor in `dtype` (for consumers without an FP8 path, and tests)."""
        k = self.data.shape[1]
        scale = self.scale[:, :self.rows].t().repeat_interleave(GROUP_SIZE, dim=1)[:, :k]
        return (self.data[:self.rows].float() * scale).to(self.dtype)


def empty_quantized(m: int, k: int, dtype: torch.dtype, device) -> QuantizedActivation:
    rows = padded_rows(m)
    return QuantizedActivation(torch.empty(rows, k, dtype=FP8_DTYPE, device=device),
                               torch.empty(triton.cdiv(k, GROUP_SIZE), rows, dtype=torch.float32, device=device),
                               m, dtype)


@triton.jit
def quantize_groups(y, ROWS: tl.constexpr, GROUPS: tl.constexpr, GSIZE: tl.constexpr):
    """y [ROWS, GROUPS * GSIZE] fp32 (lanes past a row's end must be 0) -> (fp8 values of y's shape,
    scales [ROWS, GROUPS]): one scale per GSIZE consecutive columns of a row."""
    yg = tl.reshape(y, [ROWS, GROUPS, GSIZE])
    amax = tl.max(tl.abs(yg), axis=2)
    scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full([ROWS, GROUPS], 448.0, tl.float32))
    q = quantize_to_fp8(yg, scale[:, :, None])
    return tl.reshape(q, [ROWS, GROUPS * GSIZE]), scale


def _group_block(k: int, cap: int | None = None) -> tuple[int, int]:
    """(columns per program, group size inside it): whole groups of 128 (a row shorter than 128 is
    one group of next_pow2(k))."""
    block = triton.next_power_of_2(k)
    if cap is not None:
        block = min(block, cap)
    return block, min(block, GROUP_SIZE)


# --------------------------------------------------------------------------------------------
# any input
# --------------------------------------------------------------------------------------------
@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K,
                        BLOCK: tl.constexpr, GSIZE: tl.constexpr):
    pdl_prologue()
    # grid = (rows, cdiv(K, BLOCK)): a program quantizes BLOCK // GSIZE whole groups of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, s = quantize_groups(x[None, :], 1, BLOCK // GSIZE, GSIZE)
    tl.store(q_ptr + row * stride_q + cols[None, :], q, mask=mask[None, :])
    g = tl.program_id(1) * (BLOCK // GSIZE) + tl.arange(0, BLOCK // GSIZE)
    tl.store(s_ptr + g[None, :] * stride_s + row, s, mask=(g < tl.cdiv(K, GSIZE))[None, :])


def per_token_group_quant(x: torch.Tensor, out: QuantizedActivation | None = None) -> QuantizedActivation:
    """x [M, K] (16-bit or fp32, unit stride along K) -> its block-FP8 form."""
    x = _rows(x, x.shape[-1])
    m, k = x.shape
    out = out or empty_quantized(m, k, x.dtype, x.device)
    if m == 0:
        return out
    block, gsize = _group_block(k, 1024)
    _group_quant_kernel[(m, triton.cdiv(k, block))](
        x, out.data, out.scale, x.stride(0), out.data.stride(0), out.scale.stride(0), k,
        BLOCK=block, GSIZE=gsize, **_launch_opts(block), **PDL_LAUNCH)
    return out


# --------------------------------------------------------------------------------------------
# RMSNorm (with the residual add, and split-K partials, as fused_ops.fused_add_rms_norm) + quant
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    stride_x, stride_r, stride_q, stride_s, stride_ro, stride_part, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, GSIZE: tl.constexpr, HAS_RES: tl.constexpr, NUM_PARTS: tl.constexpr,
    OUT_TY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue()
    y = rms_norm_row(x_ptr, res_ptr, res_out_ptr, w, row, cols, mask, stride_x, stride_r, stride_ro, stride_part,
                     eps, N, BLOCK, HAS_RES, NUM_PARTS)
    y = tl.where(mask, y.to(OUT_TY).to(tl.float32), 0.0)  # the value rms_norm would write
    q, s = quantize_groups(y[None, :], 1, BLOCK // GSIZE, GSIZE)
    tl.store(q_ptr + row * stride_q + cols[None, :], q, mask=mask[None, :])
    g = tl.arange(0, BLOCK // GSIZE)
    tl.store(s_ptr + g[None, :] * stride_s + row, s, mask=(g < tl.cdiv(N, GSIZE))[None, :])


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fused_add_rms_norm_quant(x, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6):
    """`fused_ops.fused_add_rms_norm(x, residual, weight, eps)` (or `rms_norm` without a residual) with
    the normalised output in block FP8: returns (QuantizedActivation, new residual or None). x may
    be a `SplitKOutput` (with a residual), whose partials are summed on the way in."""
    x2, shape, dtype, num_parts, stride_part = norm_input(x, residual, weight)
    n = shape[-1]
    y_dtype = torch.promote_types(weight.dtype, dtype)
    rows = x2.shape[0]
    out = empty_quantized(rows, n, y_dtype, x2.device)
    if residual is not None:
        assert residual.shape == shape and residual.dtype == dtype, (residual.shape, residual.dtype)
        r2 = _rows(residual, n)
        r_out = torch.empty(shape, dtype=dtype, device=x2.device)
        ro2 = r_out.view(-1, n)
    else:
        r2, r_out, ro2 = x2, None, x2  # unused (HAS_RES=False): any valid pointers
    if rows == 0:
        return out, r_out
    block, gsize = _group_block(n)
    _rms_norm_quant_kernel[(rows,)](
        x2, r2, weight.contiguous(), out.data, out.scale, ro2,
        x2.stride(0), r2.stride(0), out.data.stride(0), out.scale.stride(0), ro2.stride(0), stride_part, float(eps),
        N=n, BLOCK=block, GSIZE=gsize, HAS_RES=residual is not None, NUM_PARTS=num_parts, OUT_TY=_TL_DTYPES[y_dtype],
        **_launch_opts(block), **PDL_LAUNCH)
    return out, r_out


# --------------------------------------------------------------------------------------------
# SiLU-and-mul + quant
# --------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, I,
                               BLOCK: tl.constexpr, GSIZE: tl.constexpr, DTYPE: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    src = x_ptr + row * stride_x + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(mask, silu_mul(gate, up, DTYPE).to(DTYPE).to(tl.float32), 0.0)  # silu_and_mul's output
    q, s = quantize_groups(y[None, :], 1, BLOCK // GSIZE, GSIZE)
    tl.store(q_ptr + row * stride_q + cols[None, :], q, mask=mask[None, :])
    g = tl.program_id(1) * (BLOCK // GSIZE) + tl.arange(0, BLOCK // GSIZE)
    tl.store(s_ptr + g[None, :] * stride_s + row, s, mask=(g < tl.cdiv(I, GSIZE))[None, :])


def silu_and_mul_quant(x: torch.Tensor) -> QuantizedActivation:
    """`fused_ops.silu_and_mul(x)` ([M, 2I] -> [M, I]) in block FP8."""
    x2 = _rows(x, x.shape[-1])
    m, two_i = x2.shape
    assert two_i % 2 == 0, x.shape
    i = two_i // 2
    out = empty_quantized(m, i, x.dtype, x.device)
    if m == 0 or i == 0:
        return out
    block, gsize = _group_block(i, 1024)
    _silu_and_mul_quant_kernel[(m, triton.cdiv(i, block))](
        x2, out.data, out.scale, x2.stride(0), out.data.stride(0), out.scale.stride(0), i,
        BLOCK=block, GSIZE=gsize, DTYPE=_TL_DTYPES[x.dtype], **_launch_opts(block), **PDL_LAUNCH)
    return out
