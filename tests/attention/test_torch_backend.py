"""The torch attention backend's decode path (the CPU's): a ragged batch against attention written
out per sequence, and one step's gather layout shared by layers with different caches."""
import math

import pytest
import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Each row's attention over its first lens[i] cached tokens, in float64."""
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = []
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        p = torch.einsum("hd,nhd->hn", q[i].double(), k).mul(scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (9, 3)])
def test_decode_matches_per_sequence_attention_and_layers_share_the_layout(block_size, hq, hkv):
    gen = torch.Generator().manual_seed(block_size + hq)
    lens, d = [1, 17, 300, 5], 32
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), -1).to(torch.int32)
    meta = AttentionMetadata(num_seqs=len(lens), num_decodes=len(lens), slot_mapping=torch.empty(0, dtype=torch.long),
                             query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=1, max_seq_len=max(lens), seq_lens_host=lens)
    backend, scale = TorchAttentionBackend(), 1 / math.sqrt(d)
    for layer in range(2):  # the second layer reuses the first one's gather layout
        caches = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
        q = torch.randn(len(lens), hq, d, generator=gen)
        out = backend.forward(q, None, None, caches[0], caches[1], meta, scale, kv_stored=True)
        assert meta.decode_gather is not None
        torch.testing.assert_close(out.double(), _reference(q, caches[0], caches[1], tables, lens, scale),
                                   atol=1e-5, rtol=1e-5)


def test_fp8_cache_stores_quantized_heads_and_attends_over_their_dequantized_values():
    """An FP8 cache: the store writes k / k_scale (per head, e4m3), decode attends over cache * scale."""
    gen = torch.Generator().manual_seed(7)
    lens, hq, hkv, d, block_size = [3, 20], 4, 2, 32, 16
    num_blocks = 4
    tables = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.25])
    caches = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=torch.float8_e4m3fn)
    backend, scale = TorchAttentionBackend(), 1 / math.sqrt(d)
    slots = torch.cat([tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for i, n in enumerate(lens)])
    k = torch.randn(len(slots), hkv, d, generator=gen) * 3
    v = torch.randn(len(slots), hkv, d, generator=gen)
    backend.store_kv(k, v, caches[0], caches[1], slots, (k_scale, v_scale))
    stored_k = caches[0].view(-1, hkv, d)[slots]
    assert torch.equal(stored_k.view(torch.uint8),
                       (k / k_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    meta = AttentionMetadata(num_seqs=len(lens), num_decodes=len(lens), slot_mapping=slots,
                             query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=1, max_seq_len=max(lens), seq_lens_host=lens)
    q = torch.randn(len(lens), hq, d, generator=gen)
    out = backend.forward(q, None, None, caches[0], caches[1], meta, scale, kv_stored=True,
                          kv_scales=(k_scale, v_scale))
    dequantized = [caches[i].float() * s[:, None] for i, s in enumerate((k_scale, v_scale))]
    torch.testing.assert_close(out.double(), _reference(q, *dequantized, tables, lens, scale), atol=1e-5, rtol=1e-5)
