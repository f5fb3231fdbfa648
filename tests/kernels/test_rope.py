"""The per-head q/k RMSNorm + rotary kernels (kernels/rope.py) vs the plain-torch layers (RMSNorm,
RotaryEmbedding), alone and storing into the paged cache (vs qk_norm_rope + store_kv_cache); the
tolerances are elementwise_checks.py's. On a CPU-only machine conftest.py selects the Triton interpreter.
"""

import pytest
import torch

from elementwise_checks import DTYPES, ON_GPU, assert_match, make_norm, poisoned, randn, rope_scale
from nanovllm.kernels import store_kv_cache
from nanovllm.kernels.rope import qk_norm_rope, qk_norm_rope_store_kv
from nanovllm.layers.rotary import RotaryEmbedding


def test_empty_batch(device):
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
