"""Checks shared by the elementwise kernels' tests (test_fused_ops.py, test_rope.py): the kernels against
the plain-torch layers they replace.

Tolerance for 16-bit dtypes: the kernels round at the same points as the layers, so almost every
element is bit-exact; the rest come from the fp32 variance summation order and exp/rsqrt
approximations flipping the rounding of an *intermediate* (the normalised value, the silu) by one
ulp, which the following multiply can turn into up to 2 ulp of the result. So: <= 2 ulp and at
most 1% of elements (or 4) inexact. The interpreter's fp32->bf16 cast truncates instead of rounding to
nearest (every bf16 store is up to 1 ulp low), so there bf16 gets 4 ulp and no inexact count;
fp16 casts are exact in the interpreter.
"""
import torch

from nanovllm.layers.layernorm import RMSNorm

ON_GPU = torch.cuda.is_available()  # conftest.py selects the Triton interpreter otherwise
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}
MAX_ULP = {torch.float16: 2, torch.bfloat16: 2 if ON_GPU else 4}


def assert_match(out: torch.Tensor, expect: torch.Tensor, what: str = "", scale: torch.Tensor | None = None):
    """fp32: ~1e-5 relative. fp16/bf16: within MAX_ULP ulp of the reference, and few inexact.

    ``scale``: magnitude of the operands that produced each element, when the kernel rounds an
    intermediate (the q/k norm output feeding rope): a 1-ulp change there shows up as an absolute
    error of ~ulp(operands) in the result, however small the result is after cancellation."""
    assert out.shape == expect.shape and out.dtype == expect.dtype, (out.shape, out.dtype, expect.shape)
    out, expect = out.cpu(), expect.cpu()
    assert not out.isnan().any(), f"{what}: NaN in output (unwritten element / bad mask)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    o, e = out.float(), expect.float()
    # ulp of the larger magnitude: 2^(exponent - mantissa bits), floored at the subnormal spacing.
    mag = torch.maximum(o.abs(), e.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.cpu().float())
    _, exp = torch.frexp(mag)
    ulp = torch.ldexp(torch.ones_like(o), (exp - 1 - MANTISSA[out.dtype]).clamp(min=-24 if out.dtype == torch.float16 else -133))
    err = (o - e).abs() / ulp
    worst = err.max().item()
    inexact = (err > 0).sum().item()
    frac = inexact / err.numel()
    assert worst <= MAX_ULP[out.dtype], f"{what}: {worst:.1f} ulp off (max {MAX_ULP[out.dtype]}), {frac:.2%} inexact"
    if out.dtype == torch.float16 or ON_GPU:
        assert inexact <= max(4, 0.01 * err.numel()), f"{what}: {frac:.2%} of elements inexact"


def check_exact(out, expect, what):
    if out.dtype == torch.bfloat16 and not ON_GPU:
        assert_match(out, expect, what)
    else:
        assert torch.equal(out.cpu(), expect), what


def rope_scale(x: torch.Tensor) -> torch.Tensor:
    """|x1| + |x2| for each output element of rotate-half rope on x [..., D]."""
    x1, x2 = x.float().abs().chunk(2, dim=-1)
    return (x1 + x2).repeat(*([1] * (x.dim() - 1)), 2)


def randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def make_norm(hidden, dtype, gen, eps=1e-6):
    norm = RMSNorm(hidden, eps)
    norm.weight.data = (1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    return norm
