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
