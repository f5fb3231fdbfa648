"""The balanced (stream-K) decode schedule against the torch reference: items cut across
programs, programs inside one item, empty sequences, GQA groups wider than one program's tile."""
import pytest
import torch

from attention_dtypes import DTYPES, ON_GPU, TOL
from nanovllm.kernels import reference as ref
from nanovllm.kernels.paged_decode_balanced import paged_decode_attention_balanced


def _check(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen, num_programs):
    k_cache, v_cache, block_tables = ref.random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                                                         generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), 2 * num_q_heads, head_dim, generator=gen).to(device, dtype)[:, :num_q_heads]
    out = torch.full((len(seq_lens), num_q_heads, head_dim), float("nan"), dtype=dtype, device=device)
    scale = head_dim ** -0.5
    paged_decode_attention_balanced(q, k_cache, v_cache, block_tables, seq_lens_t, scale, out=out,
                                    num_programs=num_programs)
    expect = ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_programs", [1, 3, 7, 40])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(4, 2, 64, 16), (8, 1, 128, 64)])
def test_balanced_matches_reference(num_programs, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                    device, gen):
    seq_lens = [1, 0, 300, 64, 129, 17] if not ON_GPU else [1, 0, 4096, 64, 129, 17, 2000, 999] * 3
    out = _check(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen, num_programs)
    assert not out[1].any()  # padding row: zeros


def test_balanced_group_wider_than_a_tile(device, gen):
    """GQA 32 over BLOCK_G 16 (two head blocks per KV head) with an odd head_dim."""
    _check([50, 200, 3], 32, 1, 80, 16, DTYPES[0], device, gen, num_programs=5)


@pytest.mark.skipif(not ON_GPU, reason="the default program count is the GPU's")
def test_balanced_default_programs(device, gen):
    _check([100, 2000, 0, 1, 700] * 20, 16, 8, 128, 256, torch.bfloat16, device, gen, num_programs=None)
