"""float8_e4m3fn in our kernels: the conversion (`to_fp8`) and division by a scale then conversion
(`quantize_to_fp8`: the block-FP8 activations of fp8_quant.py, and the FP8 KV cache the store
kernels write)."""
import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# The interpreter's float -> fp8 conversion rounds wrongly (it looks at one bit below the kept
# mantissa and carries into the exponent by OR: 7.75 -> 4.0, 500 -> 256), so under it `to_fp8` first
# rounds to the e4m3 grid in fp32, after which the conversion is exact. The GPU converts directly.
_INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def to_fp8(x):
    """fp32 values within +-FP8_MAX -> float8e4nv, rounded to nearest even (cvt.rn.satfinite on the
    GPU)."""
    if _INTERPRETER:
        bits = x.to(tl.uint32, bitcast=True)
        # Normal range: keep 3 of the 23 mantissa bits, ties to even (a carry moves into the exponent).
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Subnormals (|x| < 2^-6) are multiples of 2^-9: adding 2^14 rounds there, ties to even.
        sub = (tl.abs(x) + 16384.0) - 16384.0
        sub = tl.where((bits >> 31) == 1, -sub, sub)
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_to_fp8(x, scale):
    """x / scale (IEEE division, as torch divides; scale broadcast to x's shape), clamped to +-448
    and rounded to float8e4nv."""
    q = tl.div_rn(x, tl.broadcast_to(scale, x.shape))
    return to_fp8(tl.minimum(tl.maximum(q, -448.0), 448.0))

