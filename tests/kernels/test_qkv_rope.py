"""The qkv projection with the rotary kernel's work in its epilogue (kernels/qkv_rope.py) against the
unfused pair it replaces: our dense GEMM, then qk_norm_rope_store_kv."""
import pytest
import torch

from nanovllm.kernels.rope import qk_norm_rope_store_kv
from nanovllm.kernels.gemm import GemmConfig, dense_linear
from nanovllm.kernels.qkv_rope import QkvRopeConfig, qkv_rope_config, qkv_rope_store_kv
from nanovllm.layers.rotary import RotaryEmbedding

ON_GPU = torch.cuda.is_available()
# The interpreter's bf16 tl.dot is wrong (Known traps): fp16 there, both on the GPU.
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
BLOCK_SIZE, NUM_BLOCKS = 16, 16


def _case(m, hq, hkv, d, k, has_norm, dtype, device, gen):
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=gen) * k ** -0.5).to(device, dtype)
    positions = torch.randint(0, 500, (m,), generator=gen).to(device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:m].to(device)
    slots[1] = -1  # a padding row: nothing stored
    norms = ((1.0 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype),
             (1.0 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype), 1e-6) if has_norm else (None, None, 1e-6)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen).to(device, dtype)
    return x, w, positions, slots, norms, cache


# (m, hq, hkv, d, bm, has_norm): the small shapes with and without q/k norm; the two with several
# 64-row tiles and a partial last one (the interpreter's slowest), one with norm and one without.
CASES = [(m, hq, hkv, d, bm, has_norm) for m, hq, hkv, d, bm in [(5, 4, 2, 64, 16), (20, 2, 1, 128, 16),
                                                                 (40, 4, 4, 64, 32)] for has_norm in (True, False)]
CASES += [(70, 2, 2, 64, 64, False), (200, 2, 1, 64, 64, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,hq,hkv,d,bm,has_norm", CASES)
def test_fused_equals_gemm_then_rotary_kernel(m, hq, hkv, d, bm, has_norm, dtype, device, gen):
    k = 256
    x, w, positions, slots, norms, cache = _case(m, hq, hkv, d, k, has_norm, dtype, device, gen)
    rope = RotaryEmbedding(d, 512, 10000.0).to(device)
    # Unfused: the dense GEMM with the same one-head tiles (same accumulation), then the rotary kernel.
    qkv = dense_linear(x, w, GemmConfig(1, bm, d, 128))
    q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    expect_cache = cache.clone()
    expect_q = qk_norm_rope_store_kv(q.unflatten(-1, (hq, d)), kk.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d)),
                                     positions, rope.cos_sin_cache, expect_cache[0], expect_cache[1], slots, *norms)
    got_cache = cache.clone()
    got_q = qkv_rope_store_kv(x, w, hq, hkv, positions, rope.cos_sin_cache, got_cache[0], got_cache[1], slots,
                              *norms, config=QkvRopeConfig(bm))
    assert got_q.shape == (m, hq, d) and got_q.dtype == expect_q.dtype
    torch.testing.assert_close(got_q, expect_q, atol=0, rtol=0)
    torch.testing.assert_close(got_cache, expect_cache, atol=0, rtol=0)
    # Into a given buffer (the piecewise CUDA graphs' static q): the same q there, nothing past it.
    buf = torch.full((m + 2, hq, d), float("nan"), dtype=expect_q.dtype, device=device)
    out = qkv_rope_store_kv(x, w, hq, hkv, positions, rope.cos_sin_cache, got_cache[0], got_cache[1], slots,
                            *norms, config=QkvRopeConfig(bm), q_out=buf[:m])
    assert out.data_ptr() == buf.data_ptr() and buf[m:].isnan().all()
    torch.testing.assert_close(buf[:m], expect_q, atol=0, rtol=0)


def test_config_table():
    assert qkv_rope_config(1, 1024, 128) is not None and qkv_rope_config(128, 1024, 128) is not None
    assert qkv_rope_config(256, 1024, 128) is not None and qkv_rope_config(257, 1024, 128) is None
    assert qkv_rope_config(64, 1000, 128) is None and qkv_rope_config(64, 1024, 96) is None
    assert qkv_rope_config(64, 1024, 256) is None  # its tiles would not fit in shared memory
    assert qkv_rope_config(1, 4096, 128) is None  # wider models: not measured
