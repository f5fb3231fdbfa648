"""Elementwise activation math shared by several kernels (a @triton.jit helper, inlined into each).

`silu_mul` is the one definition of SwiGLU's rounding: `fused_ops._silu_and_mul_kernel` applies it
to whole rows, `splitk_gemm._splitk_kernel` (gated) to the A tiles of down_proj as it loads them.
Both must give the same bits, so the math lives only here. It is a module of its own because
fused_ops imports splitk_gemm (for `SplitKOutput`): neither can hold it for the other.
"""
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """``F.silu(gate) * up`` in gate's (16-bit or fp32) dtype, rounded as torch eager rounds it.

    F.silu computes x / (1 + exp(-x)) in fp32 and rounds to the dtype (div_rn: the IEEE division
    torch does; Triton's "/" is approximate); then ``silu * up`` in the dtype = the exact fp32
    product of two 16-bit values, rounded once. Launch with enable_fp_fusion=False (no FMA
    contraction around it), as both callers do.
    """
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(dtype)
