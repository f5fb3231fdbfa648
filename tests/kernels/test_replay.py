"""The Triton backend's launch replay (kernels/replay.py): the first layer of a step records its
attention launches on the step's metadata, the other layers replay them with their own q, caches
and output. Every layer's output must equal what it gets from launching as usual (a fresh
metadata per layer), bit for bit: the same kernels run on the same data. On the GPU the later
layers must not go through the wrappers at all; under the interpreter (CPU) nothing is
recorded and every layer launches as usual."""
import pytest
import torch

import nanovllm.attention.triton_backend as triton_backend
from attention_dtypes import ON_GPU
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.triton_backend import TritonAttentionBackend

FP8 = torch.float8_e4m3fn
NUM_LAYERS, HQ, HKV, D = 3, 4, 2, 64


def _meta(query_lens, seq_lens, num_decodes, block_size, num_blocks, gen, device):
    max_blocks = -(-max(seq_lens) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    order = sorted(range(num_decodes), key=lambda i: -seq_lens[i])
    return AttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, slot_mapping=torch.full((qsl[-1],), -1, device=device),
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=tables.to(**i32), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        prefill_query_start_loc=torch.tensor([x - qsl[num_decodes] for x in qsl[num_decodes:]], **i32),
        decode_order=torch.tensor(order, **i32) if num_decodes else None)


CASES = {  # (query lens, context lens, decodes, block size, blocks): the decodes first
    "mixed": ([1, 1, 6, 5], [9, 133, 16, 40], 2, 16, 40),
    "decode": ([1, 1, 1], [200, 7, 64], 3, 16, 40),
    "prefill": ([37, 12], [60, 12], 0, 16, 12),
}
if ON_GPU:  # 256-token pages and a long prompt: the prefill kernel's TMA-descriptor path
    CASES["big pages"] = ([1, 1, 300, 20], [700, 90, 812, 20], 2, 256, 16)


@pytest.mark.parametrize("fp8", [False, True] if ON_GPU else [False])
@pytest.mark.parametrize("case", list(CASES))
def test_replayed_layers_equal_launched_layers(case, fp8, device, gen, monkeypatch):
    query_lens, seq_lens, nd, block_size, num_blocks = CASES[case]
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    shape = (num_blocks, block_size, HKV, D)
    caches = [(torch.randn(shape, generator=gen) * s).to(device, dtype) for s in (1.0, 3.0, 0.5)
              for _ in range(2)]
    layers = [(caches[2 * i], caches[2 * i + 1]) for i in range(NUM_LAYERS)]
    scales = [None] * NUM_LAYERS
    if fp8:
        layers = [(k.to(FP8), v.to(FP8)) for k, v in layers]
        scales = [tuple((0.5 + torch.rand(HKV, generator=gen)).to(device) for _ in range(2)) for _ in layers]
    total = sum(query_lens)
    qs = [torch.randn(total, HQ, D, generator=gen).to(device, dtype) for _ in layers]
    backend = TritonAttentionBackend()
    backend.setup(8, HQ, HKV, D, 1024, device)
    meta_gen = torch.Generator().manual_seed(7)

    def meta():
        meta_gen.manual_seed(7)
        return _meta(query_lens, seq_lens, nd, block_size, num_blocks, meta_gen, device)

    def run(shared):
        outs = []
        for (k, v), q, s in zip(layers, qs, scales):
            out = torch.empty_like(q)
            backend.forward(q, None, None, k, v, shared or meta(), 0.125, kv_stored=True, out=out, kv_scales=s)
            outs.append(out)
        return outs

    expected = run(None)
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        wrapped = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name, lambda *a, _w=wrapped, _n=name, **kw: (calls.append(_n), _w(*a, **kw))[1])
    shared = meta()
    got = run(shared)
    for layer, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"layer {layer} differs from its own launch"
    kinds = (["paged_decode_attention"] if nd else []) + (["paged_prefill_attention"] if nd < len(seq_lens) else [])
    if ON_GPU:
        assert calls == kinds, "only the first layer goes through the wrappers"
        assert all(launches and None not in launches for _, launches in shared.launches.values())
    else:
        assert calls == kinds * NUM_LAYERS, "the interpreter records nothing: every layer launches"
