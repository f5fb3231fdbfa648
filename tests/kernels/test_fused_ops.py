"""Fused elementwise kernels vs the plain-torch layers (nanovllm.layers) they replace.

On a CPU-only machine conftest.py selects the Triton interpreter.

Tolerance for 16-bit dtypes: the kernels round at the same points as the layers, so almost every
element is bit-exact; the rest come from the fp32 variance summation order and exp/rsqrt
approximations flipping the rounding of an *intermediate* (the normalised value, the silu) by one
ulp, which the following multiply can turn into up to 2 ulp of the result. So: <= 2 ulp and at
most 1% of elements (or 4) inexact. The interpreter's fp32->bf16 cast truncates instead of rounding to
nearest (every bf16 store is up to 1 ulp low), so there bf16 gets 4 ulp and no inexact count;
fp16 casts are exact in the interpreter.
"""

import pytest
import torch

from nanovllm.kernels import store_kv_cache
from nanovllm.kernels.fused_ops import fused_add_rms_norm, qk_norm_rope, qk_norm_rope_store_kv, rms_norm, silu_and_mul
from nanovllm.layers.activation import silu_and_mul as torch_silu_and_mul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding

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
    q = torch.empty(0, 4, 64, device=device)
    assert qk_norm_rope(q, q[:, :2], torch.empty(0, dtype=torch.long, device=device),
                        torch.zeros(8, 64, device=device))[1].shape == (0, 2, 64)
    cache = torch.zeros(1, 16, 2, 64, device=device)
    assert qk_norm_rope_store_kv(q, q[:, :2], q[:, 2:], torch.empty(0, dtype=torch.long, device=device),
                                 torch.zeros(8, 64, device=device), cache, cache.clone(),
                                 torch.empty(0, dtype=torch.long, device=device)).shape == (0, 4, 64)


def qkv_views(tokens, hq, hkv, dim, dtype, device, gen, with_v=False):
    """q/k(/v) as strided views of a fused qkv projection output, as DecoderAttention makes them."""
    qkv = randn((tokens, (hq + 2 * hkv) * dim), dtype, device, gen, scale=2.0)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k, v = q.unflatten(-1, (hq, dim)), k.unflatten(-1, (hkv, dim)), v.unflatten(-1, (hkv, dim))
    return (q, k, v) if with_v else (q, k)


# (tokens, q heads, kv heads, head_dim)
ROPE_CASES = [(1, 16, 8, 128), (3, 4, 1, 64), (17, 16, 8, 128), (100, 6, 2, 64), (17, 3, 3, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tokens,hq,hkv,dim", ROPE_CASES)
def test_qk_norm_rope(tokens, hq, hkv, dim, qk_norm, dtype, device, gen):
    max_pos = 4096
    rope = RotaryEmbedding(dim, max_pos, theta=1e6)
    q, k = qkv_views(tokens, hq, hkv, dim, dtype, device, gen)
    positions = torch.randperm(max_pos, generator=gen)[:tokens]  # random order, incl. large ones
    q_norm, k_norm = make_norm(dim, dtype, gen), make_norm(dim, dtype, gen)
    qc, kc = q.cpu(), k.cpu()
    if qk_norm:
        qc, kc = q_norm(qc), k_norm(kc)
    expect_q, expect_k = rope(positions, qc, kc)

    weights = dict(q_weight=q_norm.weight.data.to(device), k_weight=k_norm.weight.data.to(device)) if qk_norm else {}
    q_out, k_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    got_q, got_k = qk_norm_rope(q, k, positions.to(device, torch.int32), rope.cos_sin_cache.to(device),
                                eps=1e-6, q_out=q_out, k_out=k_out, **weights)
    assert got_q is q_out and got_k is k_out
    sq, sk = (rope_scale(qc), rope_scale(kc)) if qk_norm else (None, None)
    assert_match(got_q, expect_q, "q", sq)
    assert_match(got_k, expect_k, "k", sk)

    if dtype != torch.float16:
        return  # (interpreter time) the dtype-independent paths below run once per shape
    # Allocated outputs are contiguous; int64 positions.
    got_q, got_k = qk_norm_rope(q, k, positions.to(device), rope.cos_sin_cache.to(device), **weights)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_match(got_q, expect_q, "q (allocated)", sq)
    assert_match(got_k, expect_k, "k (allocated)", sk)


def test_qk_norm_rope_in_place(device, gen):
    # Writing back into the qkv buffer (strided q_out/k_out aliasing the inputs) must leave v alone.
    tokens, hq, hkv, dim, dtype = 9, 4, 2, 64, torch.float16
    rope = RotaryEmbedding(dim, 256, theta=1e4)
    q, k = qkv_views(tokens, hq, hkv, dim, dtype, device, gen)
    qkv = q._base if q._base is not None else q
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    q_norm, k_norm = make_norm(dim, dtype, gen), make_norm(dim, dtype, gen)
    qn, kn = q_norm(q.cpu()), k_norm(k.cpu())
    expect_q, expect_k = rope(positions, qn, kn)
    qk_norm_rope(q, k, positions.to(device), rope.cos_sin_cache.to(device),
                 q_norm.weight.data.to(device), k_norm.weight.data.to(device), q_out=q, k_out=k)
    assert_match(q, expect_q, "q in place", rope_scale(qn))
    assert_match(k, expect_k, "k in place", rope_scale(kn))
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before), "v was overwritten"


# (q heads, kv heads): GQA ratios 1/2/4/8; 3 heads leave masked lanes in a head group, 16 KV
# heads of 128 fill two groups of k programs.
STORE_HEADS = [(3, 3), (32, 16), (8, 2), (8, 1)]
STORE_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _store_cases():
    """Every head layout, dtype and norm setting crossed in full, each of them with every (head_dim,
    block size) pair (block size 64 also takes int64 slots): all the pairs of the five settings,
    a quarter of their product."""
    shapes = [(64, 16), (128, 64), (64, 64), (128, 16)]
    cases = []
    for h, (hq, hkv) in enumerate(STORE_HEADS):
        for d, dtype in enumerate(STORE_DTYPES):
            for n, qk_norm in enumerate((True, False)):
                dim, block_size = shapes[(h + 2 * n + d) % 4]
                cases.append(pytest.param(qk_norm, dim, hq, hkv, block_size, dtype,
                                          id=f"{qk_norm}-{dim}-{hq}-{hkv}-{block_size}-{str(dtype)[6:]}"))
    return cases


@pytest.mark.parametrize("qk_norm, dim, hq, hkv, block_size, dtype", _store_cases())
def test_qk_norm_rope_store_kv(qk_norm, dim, hq, hkv, block_size, dtype, device, gen):
    """The fused launch writes exactly what qk_norm_rope + store_kv_cache write (q and the whole
    cache bit-equal), skipping slot -1 rows (CUDA-graph padding) and leaving other slots alone."""
    tokens, max_pos, num_blocks = 11, 2048, 3
    rope = RotaryEmbedding(dim, max_pos, theta=1e6)
    cos_sin = rope.cos_sin_cache.to(device)
    q, k, v = qkv_views(tokens, hq, hkv, dim, dtype, device, gen, with_v=True)
    positions = torch.randperm(max_pos, generator=gen)[:tokens].to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]  # any order, any block
    slots[[2, 7]] = -1
    slots = slots.to(device, torch.int32 if block_size == 16 else torch.int64)
    weights = {}
    if qk_norm:
        weights = dict(q_weight=make_norm(dim, dtype, gen).weight.data.to(device),
                       k_weight=make_norm(dim, dtype, gen).weight.data.to(device))
    cache_shape = (num_blocks, block_size, hkv, dim)
    k_cache, v_cache = randn(cache_shape, dtype, device, gen), randn(cache_shape, dtype, device, gen)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    k_before, v_before = k.clone(), v.clone()

    expect_q, expect_k = qk_norm_rope(q, k, positions, cos_sin, **weights)
    store_kv_cache(expect_k, v, k_expect, v_expect, slots)
    q_out = poisoned(q.shape, dtype, device)
    got_q = qk_norm_rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_out=q_out, **weights)
    assert got_q is q_out
    assert torch.equal(got_q, expect_q), "q"
    assert torch.equal(k_cache, k_expect), "k cache"
    assert torch.equal(v_cache, v_expect), "v cache"
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "inputs modified"
    # (Implied by the equalities, spelled out:) only the valid slots changed.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0].long()] = True
    flat = k_cache.view(-1, hkv, dim)
    assert torch.equal(flat[~written], k_expect.view(-1, hkv, dim)[~written])


def test_qk_norm_rope_store_kv_promoted_weight(device, gen):
    # fp32 norm weights on fp16 activations: q/k come out fp32 (torch promotion), and the fp16
    # cache gets that fp32 key cast once more, as store_kv_cache would cast it.
    tokens, hq, hkv, dim, block_size = 6, 4, 2, 64, 16
    rope = RotaryEmbedding(dim, 256, theta=1e4)
    cos_sin = rope.cos_sin_cache.to(device)
    q, k, v = qkv_views(tokens, hq, hkv, dim, torch.float16, device, gen, with_v=True)
    positions = torch.randint(0, 256, (tokens,), generator=gen).to(device)
    slots = torch.tensor([5, -1, 0, 31, 17, 2], device=device)
    qw, kw = ((1.0 + 0.5 * torch.randn(dim, generator=gen)).to(device) for _ in range(2))
    k_cache = torch.zeros(2, block_size, hkv, dim, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    expect_q, expect_k = qk_norm_rope(q, k, positions, cos_sin, qw, kw)
    assert expect_q.dtype == torch.float32
    store_kv_cache(expect_k, v, k_expect, v_expect, slots)
    got_q = qk_norm_rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, qw, kw)
    assert torch.equal(got_q, expect_q)
    assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)
