"""float8_e4m3fn in our kernels: the conversion (`to_fp8`) and division by a scale then conversion
(`quantize_to_fp8`: the block-FP8 activations of fp8_quant.py, and the FP8 KV cache the store
kernels write); back to fp16 in the layout a tile was loaded in (`e4m3_to_fp16_as_loaded`: the FP8
KV cache's values in decode attention)."""
import functools
import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# The interpreter's float -> fp8 conversion rounds wrongly (it looks at one bit below the kept
# mantissa and carries into the exponent by OR: 7.75 -> 4.0, 500 -> 256), so under it `to_fp8` first
# rounds to the e4m3 grid in fp32, after which the conversion is exact. The GPU converts directly.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETER = tl.constexpr(_INTERPRETING)


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


def has_e4m3_pair_conversion(device: torch.device) -> bool:
    """Whether `device` converts a pair of e4m3 values to fp16 in one instruction (cvt.rn.f16x2.e4m3x2,
    sm_89 and later): the condition for `e4m3_to_fp16_as_loaded`'s HARDWARE. Never under the interpreter."""
    if device.type != "cuda" or _INTERPRETING:
        return False
    return _converts_e4m3_pairs(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _converts_e4m3_pairs(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@triton.jit
def e4m3_to_fp16_as_loaded(x, HARDWARE: tl.constexpr):
    """float8e4nv -> fp16 (exact), converted in the registers and layout x was loaded in.

    Written as `x.to(tl.float16)` before a tl.dot that takes x as its second operand with the keys
    along its rows (P @ V), Triton moves the conversion after the change into the dot's operand
    layout: the 8-bit tile is then read from shared memory one byte per instruction (128
    ld.shared.b8 a thread for a 64 x 128 tile of 2 warps, sm_90). An opaque conversion (inline asm
    with side effects, which no pass moves) keeps it here: the tile is read in 16-byte vectors,
    converted, and enters the dot as fp16 (ldmatrix.trans), as a 16-bit cache does. Decode over an
    FP8 cache on the H200: 2-13% faster (BENCHMARKS.md; 64 sequences of 1.5-2.5k keys 98.5 -> 85.6 us)."""
    if HARDWARE:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float16)
