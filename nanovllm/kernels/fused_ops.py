"""Fused elementwise kernels for the decoder layer: RMSNorm (with the residual add) and SiLU-and-mul
(the per-head q/k RMSNorm + rotary embedding, with the same rounding rules, is kernels/rope.py).

Why: a CUDA-graph decode step of a small model is dominated by launches of tiny elementwise
kernels (fp32 casts, pow, mean, rsqrt, mul, chunk/cat for rope, ...). Each function here does
the work of one layer in one launch and reproduces the plain-torch layer math
(``nanovllm/layers/{layernorm,activation}.py``) including *where* results are rounded
to the activation dtype, so nearly every element is bit-identical to the eager path. What is
left: the fp32 summation order of the variance and Triton's rsqrt/exp approximations, which can
flip the rounding of an intermediate (normalised value, silu) by 1 ulp -> <= 2 ulp in the result.

All kernels are launched with ``enable_fp_fusion=False``: torch eager rounds every product
separately, and letting the compiler contract ``a*b - c*d`` into an FMA would change the last
fp32 bit (and occasionally the rounded bf16 result). These kernels are memory bound, so the
lost FMAs cost nothing.

Every function takes optional output buffers (poisoned in tests, reusable under CUDA graphs);
without them outputs come from ``torch.empty``. Aliasing rules are given per function.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.gemm import SplitKOutput


def _launch_opts(block: int) -> dict:
    # ~8 elements per thread (16 B of bf16) per row; more warps only for wide rows.
    return dict(num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False)


# --------------------------------------------------------------------------------------------
# RMSNorm (optionally with the residual add fused in)
# --------------------------------------------------------------------------------------------
@triton.jit
def rms_norm_row(x_ptr, res_ptr, res_out_ptr, w, row, cols, mask, stride_x, stride_r, stride_ro, stride_part, eps,
                 N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, NUM_PARTS: tl.constexpr):
    """One row's RMSNorm (after the residual add, whose sum it stores): returns ``xn * w`` in fp32, for
    the caller to round to the output dtype (`_rms_norm_kernel`; kernels/fp8_quant.py quantizes it)."""
    if NUM_PARTS > 0:
        # The projection's output = the sum of its partials, rounded as a GEMM would round it.
        x = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(NUM_PARTS):
            x += tl.load(x_ptr + s * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # x.float() + residual.float(), the new residual is that fp32 sum rounded once.
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    # variance = mean(x^2) in fp32; div_rn = the IEEE division torch does (Triton's "/" is
    # approximate). div_rn wants two fp32 tensors of one shape, hence keep_dims and tl.full.
    var = tl.div_rn(tl.sum(x * x, axis=0, keep_dims=True), tl.full([1], N, tl.float32))
    # HF order: normalise in fp32, round to the input dtype, THEN multiply by the weight. The
    # product of two 16-bit floats is exact in fp32, so computing it in fp32 and rounding once is
    # exactly torch's bf16/fp16 multiply (it also covers an fp32 weight, which promotes to fp32).
    # (res_ptr has the activation dtype: it is x_ptr itself without a residual, and x_ptr holds
    # fp32 partials with NUM_PARTS > 0.)
    xn = (x * tl.rsqrt(var + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
    return xn * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_r, stride_y, stride_ro,  # row strides; the hidden dim has unit stride
    stride_part,  # NUM_PARTS > 0: x holds that many fp32 split-K partials, this far apart
    eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, NUM_PARTS: tl.constexpr,
):
    # One program per token row; the whole row lives in registers (BLOCK = next_pow2(N)).
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can exceed 2^31 at long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < N  # N is constexpr: when BLOCK == N the mask folds away (vector accesses)
    # The weight is no predecessor's output: read it before the programmatic-launch wait.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue()
    y = rms_norm_row(x_ptr, res_ptr, res_out_ptr, w, row, cols, mask, stride_x, stride_r, stride_ro, stride_part,
                     eps, N, BLOCK, HAS_RES, NUM_PARTS)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride along n (a view whenever possible)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _out_rows(out, shape, dtype, device, n):
    """(the output tensor, its [rows, n] view the kernel writes through)."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    assert out.shape == shape and out.dtype == dtype, (out.shape, out.dtype, shape, dtype)
    rows = out.view(-1, n)  # a view, never a copy (raises otherwise): the kernel writes through it
    assert rows.stride(-1) == 1 or rows.shape[0] == 0
    return out, rows


def norm_input(x, residual, weight):
    """What an RMSNorm kernel reads of x: (x2 [rows, n] (a SplitKOutput's first partial), x's shape,
    its dtype, the number of partials to sum and their stride; 0, 0 for a plain tensor)."""
    num_parts = stride_part = 0
    if isinstance(x, SplitKOutput):
        assert residual is not None and x.parts.is_contiguous()
        num_parts, stride_part = x.parts.shape[0], x.parts.stride(0)
        shape, dtype, x2 = x.shape, x.dtype, x.parts[0]
    else:
        shape, dtype, x2 = x.shape, x.dtype, _rows(x, x.shape[-1])
    assert weight.shape == (shape[-1],), (weight.shape, shape[-1])
    return x2, shape, dtype, num_parts, stride_part


def _rms_norm_launch(x, residual, weight, eps, out, residual_out):
    x2, shape, dtype, num_parts, stride_part = norm_input(x, residual, weight)
    n = shape[-1]
    weight = weight.contiguous()
    # `weight * y` with y in x's dtype: the result has the promoted dtype (== x.dtype in the model).
    y_dtype = torch.promote_types(weight.dtype, dtype)
    y, y2 = _out_rows(out, shape, y_dtype, x2.device, n)
    rows = x2.shape[0]
    if residual is not None:
        assert residual.shape == shape and residual.dtype == dtype, (residual.shape, residual.dtype)
        r2 = _rows(residual, n)
        r_out, ro2 = _out_rows(residual_out, shape, dtype, x2.device, n)
    else:
        r2, r_out, ro2 = x2, None, y2  # unused (HAS_RES=False); any valid pointers
    if rows == 0:
        return y, r_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, y2, ro2,
        x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), stride_part,
        float(eps),
        N=n, BLOCK=block, HAS_RES=residual is not None, NUM_PARTS=num_parts, **_launch_opts(block), **PDL_LAUNCH,
    )
    return y, r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm.forward(x)``: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    x: ``[..., H]`` (any leading shape; the hidden dim must be unit-stride or it is copied).
    weight: ``[H]``. Returns a new tensor of dtype ``promote(x.dtype, weight.dtype)`` (x's dtype
    in the model), or writes into ``out`` (which may alias ``x``: each row is read before written).
    """
    return _rms_norm_launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward(x, residual)``: ``s = x.float() + residual.float()``; returns
    ``(rms_norm(s) as in rms_norm, s.to(x.dtype))``. x may be a `SplitKOutput` (the partials of
    the projection that produced it): they are summed, and rounded to x.dtype, on the way in.

    In place: pass ``out=x, residual_out=residual`` (each program reads its whole row before it
    writes, so aliasing either input is safe). Otherwise new tensors are allocated.
    """
    return _rms_norm_launch(x, residual, weight, eps, out, residual_out)


# --------------------------------------------------------------------------------------------
# SiLU-and-mul (SwiGLU on a fused [gate | up] projection)
# --------------------------------------------------------------------------------------------
@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up for gate/up read from DTYPE values, in fp32 for the caller to round to DTYPE.
    F.silu computes x / (1 + exp(-x)) in fp32 and rounds to the dtype; then `silu * up` in the dtype
    = the exact fp32 product of two 16-bit values rounded once."""
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(DTYPE).to(tl.float32)
    return silu * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, BLOCK: tl.constexpr):
    pdl_prologue()
    # grid = (rows, cdiv(I, BLOCK)): rows on axis 0, whose limit is 2^31-1 (axis 1 allows 65535).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    src = x_ptr + row * stride_x + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, silu_mul(gate, up, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``SiluAndMul``: x ``[..., 2I]`` -> ``F.silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]``.

    Returns a new tensor (x's dtype) or writes into ``out`` (may alias ``x[..., :I]``).
    """
    two_i = x.shape[-1]
    assert two_i % 2 == 0, x.shape
    i = two_i // 2
    shape = (*x.shape[:-1], i)
    y, y2 = _out_rows(out, shape, x.dtype, x.device, i)
    x2 = _rows(x, two_i)
    if x2.shape[0] == 0 or i == 0:
        return y
    block = min(1024, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2, y2, x2.stride(0), y2.stride(0), i, BLOCK=block, **_launch_opts(block), **PDL_LAUNCH,
    )
    return y


__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]
