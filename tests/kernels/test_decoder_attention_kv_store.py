"""DecoderAttention with a backend that fuses the K/V store (Triton: the rotary kernel writes k/v
into the paged cache, the backend skips its store) against the plain path (torch backend), on a
mixed batch of decodes, a prefill after a cached prefix and a whole prompt. On a CPU-only
machine conftest.py runs the Triton kernels under the interpreter."""
import pytest
import torch

import nanovllm.attention.triton_backend as triton_backend
from helpers import ARCHS
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.attention.triton_backend import TritonAttentionBackend
from nanovllm.models.llama import DecoderAttention

BLOCK_SIZE, NUM_BLOCKS = 16, 12
QUERY_LENS, SEQ_LENS = [1, 1, 6, 5], [9, 33, 16, 5]  # two decodes first, then two prefills


def _meta(device, gen):
    max_blocks = -(-max(SEQ_LENS) // BLOCK_SIZE)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:len(SEQ_LENS) * max_blocks].view(len(SEQ_LENS), max_blocks)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(QUERY_LENS, SEQ_LENS)])
    rows = torch.repeat_interleave(torch.arange(len(SEQ_LENS)), torch.tensor(QUERY_LENS))
    slots = tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    qsl = [0]
    for q in QUERY_LENS:
        qsl.append(qsl[-1] + q)
    nd = 2
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        num_seqs=len(SEQ_LENS), num_decodes=nd, slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(SEQ_LENS, **i32),
        block_tables=tables.to(**i32), max_query_len=max(QUERY_LENS), max_seq_len=max(SEQ_LENS),
        query_start_loc_host=qsl, seq_lens_host=SEQ_LENS,
        prefill_query_start_loc=torch.tensor([x - qsl[nd] for x in qsl[nd:]], **i32))
    return meta, positions.to(device)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # with and without q/k norm
def test_fused_kv_store_matches_plain_path(arch, device, gen, monkeypatch):
    config = ARCHS[arch]()
    qk_norm = arch == "qwen3"
    layer = DecoderAttention(config, qkv_bias=False, o_bias=False, qk_norm=qk_norm)
    for name, p in layer.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.data = 1.0 + 0.5 * noise if "norm" in name else 0.2 * noise
    layer.to(device)
    meta, positions = _meta(device, gen)
    x = torch.randn(sum(QUERY_LENS), config.hidden_size, generator=gen).to(device)
    shape = (NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
    kv = torch.randn(2, *shape, generator=gen).to(device)  # earlier context: random keys/values

    def run(backend):
        layer.attn.backend = backend
        cache = kv.clone()
        layer.attn.k_cache, layer.attn.v_cache = cache[0], cache[1]
        return layer(positions, x, meta), cache

    expect, expect_cache = run(TorchAttentionBackend())
    fused = TritonAttentionBackend()
    fused.setup(4, layer.num_heads, layer.num_kv_heads, layer.head_dim, 64, device)
    ran = []
    kernel = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention", lambda *a, **kw: (ran.append(1), kernel(*a, **kw))[1])
    assert fused.fuses_kv_store and not TorchAttentionBackend.fuses_kv_store

    def no_store(*args):
        raise AssertionError("the backend stored k/v although the rotary kernel did")
    monkeypatch.setattr(triton_backend, "store_kv_cache", no_store)
    got, got_cache = run(fused)
    # The rope math is the same but not bit-identical (torch vs Triton), nor is the attention.
    torch.testing.assert_close(got_cache[0], expect_cache[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got_cache[1], expect_cache[1]), "values are copied as is"
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    assert ran == [1], "the decode rows go through the split kernel once"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_q_and_output_buffers_as_the_piecewise_graphs_use_them(arch, device, gen):
    """worker/piecewise_graph.py's contract with the layer: with meta.q_out the rotary kernel writes q
    there while the splitter stands in for attention (as in a capture), and attention run afterwards
    on that buffer with `out=` (as at replay) leaves there what the plain layer computes."""
    from dataclasses import replace
    from nanovllm.worker.piecewise_graph import _GraphSplitter
    config = ARCHS[arch]()
    layer = DecoderAttention(config, qkv_bias=False, o_bias=False, qk_norm=arch == "qwen3")
    for name, p in layer.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.data = 1.0 + 0.5 * noise if "norm" in name else 0.2 * noise
    layer.to(device)
    meta, positions = _meta(device, gen)
    t = sum(QUERY_LENS)
    x = torch.randn(t, config.hidden_size, generator=gen).to(device)
    kv = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim, generator=gen).to(device)
    backend = TritonAttentionBackend()
    backend.setup(4, layer.num_heads, layer.num_kv_heads, layer.head_dim, 64, device)

    expect_cache = kv.clone()
    layer.attn.backend, layer.attn.k_cache, layer.attn.v_cache = backend, expect_cache[0], expect_cache[1]
    expect = layer(positions, x, meta)

    q_buf = torch.full((t + 3, layer.num_heads, layer.head_dim), float("nan"), device=device)
    out_buf = torch.full_like(q_buf, float("nan"))
    got_cache = kv.clone()
    layer.attn.backend = _GraphSplitter(out_buf, pool=None)
    layer.attn.k_cache, layer.attn.v_cache = got_cache[0], got_cache[1]
    layer(positions, x, replace(meta, q_out=q_buf[:t]))  # the pieces' part: q and the cache
    assert not q_buf[:t].isnan().any() and q_buf[t:].isnan().all()
    assert torch.equal(got_cache, expect_cache)
    backend.forward(q_buf[:t], None, None, got_cache[0], got_cache[1], meta, layer.attn.scale, kv_stored=True,
                    out=out_buf[:t])  # the eager attention between two pieces
    torch.testing.assert_close(layer.o_proj(out_buf[:t].flatten(-2)), expect, rtol=0, atol=0)
