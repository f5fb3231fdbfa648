"""The FP8 KV cache (float8_e4m3fn holding k / k_scale and v / v_scale per KV head): every kernel that
writes the cache stores exactly the reference's quantization of what it stores in a 16-bit cache, and
the attention kernels, dequantizing in registers, match the reference attention over the dequantized
cache."""
import pytest
import torch
import triton
import triton.language as tl

from attention_dtypes import DTYPES, ON_GPU, TOL
from nanovllm.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from nanovllm.kernels import reference as ref
from nanovllm.kernels.fp8 import e4m3_to_fp16_as_loaded, has_e4m3_pair_conversion
from nanovllm.kernels.rope import qk_norm_rope, qk_norm_rope_store_kv
from nanovllm.kernels.gemm import GemmConfig, dense_linear
from nanovllm.kernels.qkv_rope import QkvRopeConfig, qkv_rope_store_kv
from nanovllm.layers.rotary import RotaryEmbedding

FP8 = torch.float8_e4m3fn


def _scales(hkv, gen, device):
    """Per-head scales around 1 (a checkpoint's), so the division is exercised."""
    return tuple((0.5 + torch.rand(hkv, generator=gen)).to(device) for _ in range(2))


def _bytes(t):
    return t.view(torch.uint8)


def _slots(n, num_slots, gen, device):
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[::5] = -1  # padding rows: never stored
    return slots.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])  # loads and stores only
def test_store_kv_quantizes_with_the_head_scales(dtype, device, gen):
    n, hkv, d, block_size, num_blocks = 23, 3, 80, 16, 4
    key = (torch.randn(n, hkv, d, generator=gen) * 20).to(device, dtype)
    value = torch.randn(n, hkv, d, generator=gen).to(device, dtype)
    slots = _slots(n, num_blocks * block_size, gen, device)
    k_scale, v_scale = _scales(hkv, gen, device)
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    store_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    ok = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(_bytes(flat_k[slots[ok]]), _bytes(ref.quantize_kv_fp8(key[ok], k_scale)))
    assert torch.equal(_bytes(flat_v[slots[ok]]), _bytes(ref.quantize_kv_fp8(value[ok], v_scale)))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[ok].cpu()] = False
    assert not _bytes(flat_k[untouched.to(device)]).any()


def test_rope_store_kv_quantizes_what_it_would_store(device, gen):
    """The q/k norm + rotary kernel's fused store: k normed and rotated, as qk_norm_rope returns it."""
    t, hq, hkv, d, block_size = 9, 4, 2, 64, 16
    dtype = torch.bfloat16
    q = torch.randn(t, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(device, dtype)
    positions = torch.randint(0, 100, (t,), generator=gen).to(device)
    weights = [(1 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype) for _ in range(2)]
    rope = RotaryEmbedding(d, 128, 10000.0).to(device)
    slots = _slots(t, 4 * block_size, gen, device)
    k_scale, v_scale = _scales(hkv, gen, device)
    k_cache = torch.zeros(4, block_size, hkv, d, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    got_q = qk_norm_rope_store_kv(q, k, v, positions, rope.cos_sin_cache, k_cache, v_cache, slots, *weights, 1e-6,
                                  k_scale=k_scale, v_scale=v_scale)
    want_q, want_k = qk_norm_rope(q, k, positions, rope.cos_sin_cache, *weights, 1e-6)
    assert torch.equal(got_q, want_q)
    ok = slots >= 0
    assert torch.equal(_bytes(k_cache.view(-1, hkv, d)[slots[ok]]), _bytes(ref.quantize_kv_fp8(want_k[ok], k_scale)))
    assert torch.equal(_bytes(v_cache.view(-1, hkv, d)[slots[ok]]), _bytes(ref.quantize_kv_fp8(v[ok], v_scale)))


def test_qkv_rope_epilogue_quantizes_what_it_would_store(device, gen):
    """The qkv GEMM with rope and the store in its epilogue: its FP8 cache is the quantization of the
    16-bit cache the same kernel writes (the same k and v, rounded to the activation dtype)."""
    m, hq, hkv, d, kdim, block_size = 7, 2, 2, 64, 256, 16
    dtype = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter's bf16 tl.dot is wrong
    x = torch.randn(m, kdim, generator=gen).to(device, dtype)
    w = (torch.randn((hq + 2 * hkv) * d, kdim, generator=gen) * kdim ** -0.5).to(device, dtype)
    positions = torch.randint(0, 100, (m,), generator=gen).to(device)
    rope = RotaryEmbedding(d, 128, 10000.0).to(device)
    slots = _slots(m, 4 * block_size, gen, device)
    k_scale, v_scale = _scales(hkv, gen, device)
    cache16 = torch.zeros(2, 4, block_size, hkv, d, dtype=dtype, device=device)
    cache8 = torch.zeros(2, 4, block_size, hkv, d, dtype=FP8, device=device)
    config = QkvRopeConfig(16)
    q16 = qkv_rope_store_kv(x, w, hq, hkv, positions, rope.cos_sin_cache, cache16[0], cache16[1], slots,
                            config=config)
    q8 = qkv_rope_store_kv(x, w, hq, hkv, positions, rope.cos_sin_cache, cache8[0], cache8[1], slots, config=config,
                           k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(q8, q16)
    for c8, c16, scale in ((cache8[0], cache16[0], k_scale), (cache8[1], cache16[1], v_scale)):
        assert torch.equal(_bytes(c8), _bytes(ref.quantize_kv_fp8(c16.view(-1, hkv, d), scale).view(c8.shape)))
    # And that k is the unfused pair's (dense GEMM, then the rotary kernel), as test_qkv_rope.py checks.
    qkv = dense_linear(x, w, GemmConfig(1, 16, d, 128))
    _, want_k = qk_norm_rope(qkv[:, :hq * d].unflatten(-1, (hq, d)), qkv[:, hq * d:(hq + hkv) * d].unflatten(-1, (hkv, d)),
                             positions, rope.cos_sin_cache)
    ok = slots >= 0
    assert torch.equal(cache16[0].view(-1, hkv, d)[slots[ok]], want_k[ok])


def _fp8_paged_kv(seq_lens, hkv, d, block_size, gen, device):
    """A random FP8 paged cache with per-head scales, and its dequantized (fp32) twin for the reference."""
    k16, v16, tables = ref.random_paged_kv(seq_lens, hkv, d, block_size, torch.float32, device, generator=gen)
    k_scale, v_scale = _scales(hkv, gen, device)
    k8 = ref.quantize_kv_fp8(k16.view(-1, hkv, d), k_scale).view(k16.shape)
    v8 = ref.quantize_kv_fp8(v16.view(-1, hkv, d), v_scale).view(v16.shape)
    deq = (ref.dequantize_kv_cache(k8, k_scale, torch.float32), ref.dequantize_kv_cache(v8, v_scale, torch.float32))
    return (k8, v8), (k_scale, v_scale), deq, tables


@triton.jit
def _convert_kernel(x_ptr, out_ptr, N: tl.constexpr, HARDWARE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_to_fp16_as_loaded(tl.load(x_ptr + offs), HARDWARE))


def test_e4m3_to_fp16_as_loaded_is_exact(device):
    """Every finite e4m3 value (subnormals, both zeros, +-448) at an even and at an odd position: on
    sm_89+ the inline asm's conversion of packed pairs, each value in its place."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = bits[(bits & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN: the cache never holds them (saturated)
    x = torch.cat([finite, finite[1:], finite[:5]]).view(torch.float8_e4m3fn).to(device)  # 254 + 253 + 5 = 512
    out = torch.empty(512, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](x, out, N=512, HARDWARE=has_e4m3_pair_conversion(x.device))
    assert torch.equal(out.cpu().view(torch.int16), x.cpu().to(torch.float16).view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size,num_splits", [(8, 2, 128, 16, None), (4, 4, 64, 64, 3), (6, 2, 80, 16, 1)])
def test_decode_over_an_fp8_cache(hq, hkv, d, block_size, num_splits, dtype, device, gen):
    seq_lens = [1, 0, 37, 130] + ([4000, 900] if ON_GPU else [])
    (k8, v8), scales, (kd, vd), tables = _fp8_paged_kv(seq_lens, hkv, d, block_size, gen, device)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k8, v8, tables, lens, d ** -0.5, num_splits=num_splits, kv_scales=scales)
    expect = ref.paged_decode_attention(q, kd, vd, tables, lens, d ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_over_an_fp8_cache_with_a_bf16_query(device, gen):
    """A bf16 q runs the dots in fp16 (converted in the kernel; also under the interpreter, whose bf16
    dots are wrong): the reference's result, and q values past fp16's range clamp to it, not NaN."""
    hq, hkv, d, block_size = 8, 2, 64, 16
    seq_lens = [1, 37, 130, 70]
    (k8, v8), scales, (kd, vd), tables = _fp8_paged_kv(seq_lens, hkv, d, block_size, gen, device)
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    q[3] *= 1e6  # far past 65504
    q = q.to(device, torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k8, v8, tables, lens, d ** -0.5, kv_scales=scales)
    expect = ref.paged_decode_attention(q.float().clamp(-65504, 65504), kd, vd, tables, lens, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_desc", [False, True])
def test_prefill_over_an_fp8_cache(kv_desc, dtype, device, gen):
    hq, hkv, d, block_size = 4, 2, 64, 64
    q_lens, seq_lens = [5, 1, 40, 70], [5, 30, 100, 70]
    if ON_GPU:
        q_lens, seq_lens = [n * 12 for n in q_lens], [n * 12 for n in seq_lens]
    (k8, v8), scales, (kd, vd), tables = _fp8_paged_kv(seq_lens, hkv, d, block_size, gen, device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    config = (128, 64, 8, 3) if kv_desc else None
    out = paged_prefill_attention(q, k8, v8, cu, lens, tables, max(q_lens), d ** -0.5, kv_scales=scales,
                                  _config=config, _kv_desc=kv_desc)
    expect = ref.paged_prefill_attention(q, kd, vd, cu, lens, tables, max(q_lens), d ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_an_fp8_cache_needs_its_scales(device):
    cache = torch.zeros(2, 16, 2, 64, dtype=FP8, device=device)
    q = torch.randn(1, 2, 64, device=device)
    with pytest.raises(AssertionError, match="kv_scales"):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=device),
                               torch.ones(1, dtype=torch.int32, device=device), 1.0)
