import pytest
import torch

from attention_dtypes import DTYPES, ON_GPU, TOL
from nanovllm.kernels import paged_prefill_attention
from nanovllm.kernels import reference as ref


def _run_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
              gen, max_query_len=None, **kernel_args):
    """q_lens[b] new tokens of a sequence with seq_lens[b] keys in total (prefix = difference)."""
    k_cache, v_cache, block_tables = ref.random_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, generator=gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # q as a non-contiguous view (rows of a fused qkv output).
    qkv = torch.randn(cu[-1], 2 * num_q_heads, head_dim, generator=gen).to(device, dtype)
    q = qkv[:, num_q_heads:]
    scale = head_dim ** -0.5
    max_query_len = max_query_len or max(q_lens)

    out = torch.full((cu[-1], num_q_heads, head_dim), float("nan"), dtype=dtype, device=device)
    res = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_t, block_tables,
                                  max_query_len, scale, out=out, **kernel_args)
    assert res is out
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_t,
                                         block_tables, max_query_len, scale)
    assert not out.isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expect.float(), atol=tol, rtol=tol)


def _scale(lens):
    """GPU: stretch the CPU-sized layouts towards long contexts."""
    return [n * 12 for n in lens] if ON_GPU else lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,block_size",
    [
        (4, 4, 64, 16),  # MHA, key tiles span several cache blocks
        (4, 2, 128, 64),  # GQA 2
        (8, 1, 64, 256),  # GQA 8
    ],
)
def test_prefill_mixed_batch(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                             gen):
    """Plain prefill, chunked prefill / prefix hit, decode rows and an empty row together."""
    q_lens = _scale([150, 1, 37, 0, 20, 1])
    seq_lens = _scale([150, 90, 300, 0, 20, 1])
    seq_lens[1] = q_lens[1] + seq_lens[1]  # decode row with a long context
    _run_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
              gen)


def test_prefill_gqa4_prefix_hits(device, gen):
    """Prefix-cache hits whose cached part ends mid-block, mid-tile and right at tile edges
    (62/63/64/65: off-by-one errors in the masked/unmasked key-tile split show up here)."""
    q_lens = _scale([23, 64, 5, 40, 33, 1])
    seq_lens = [q + p for q, p in zip(q_lens, [17, 62, 63, 64, 65, 250])]
    _run_case(q_lens, seq_lens, 8, 2, 64, 16, torch.float16, device, gen)


def test_prefill_random_layouts(device, gen):
    """Seeded random prefixes and chunk lengths (GQA 2, fp32 on CPU for tight checks)."""
    dtype = torch.float32 if not ON_GPU else torch.float16
    num = 12 if ON_GPU else 6
    q_lens = torch.randint(1, 1000 if ON_GPU else 90, (num,), generator=gen).tolist()
    prefixes = torch.randint(0, 3000 if ON_GPU else 200, (num,), generator=gen).tolist()
    seq_lens = [q + p for q, p in zip(q_lens, prefixes)]
    _run_case(q_lens, seq_lens, 4, 2, 64, 16, dtype, device, gen)


def test_prefill_decode_only_rows(device, gen):
    """max_query_len 1: the small-tile configuration (one token x group rows), with
    contexts at key-tile boundaries."""
    seq_lens = [1, 63, 64, 65, 127, 128, 129, 200]
    _run_case([1] * len(seq_lens), seq_lens, 8, 2, 64, 16, torch.float16, device, gen)


def test_prefill_odd_shapes(device, gen):
    """head_dim not a power of two and a GQA group that does not divide the row tile."""
    dtype = torch.float32 if not ON_GPU else torch.float16
    _run_case([70, 3], [70, 40], 6, 2, 80, 16, dtype, device, gen)


def test_prefill_max_query_len_overestimate(device, gen):
    """A larger max_query_len than needed (e.g. a padded hint) only adds empty programs."""
    _run_case([9, 30], [9, 45], 4, 2, 64, 64, torch.float16, device, gen, max_query_len=200)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,config", [
    (4, 2, 128, 64, None),  # the table's tiles (BLOCK_N 64: one tile per cache block)
    (8, 4, 64, 256, (64, 64, 4, 3)),
    (4, 2, 64, 128, (256, 64, 16, 3)),  # the long-prompt tiles
    (2, 2, 64, 128, (16, 64, 4, 3)),  # decode-like rows
])
def test_prefill_kv_through_descriptors(num_q_heads, num_kv_heads, head_dim, block_size, config, dtype, device, gen):
    """K/V tiles as TMA boxes (one cache block per key tile): plain prompts, prefix hits ending mid-tile
    and decode rows; the slots past each sequence hold NaN, which the masked tiles must not let through."""
    q_lens = _scale([150, 1, 37, 20, 1, 64])
    seq_lens = [q + p for q, p in zip(q_lens, _scale([0, 90, 263, 0, 5, 65]))]
    _run_case(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
              _config=config, _kv_desc=True)
