"""bf16 projections on the CPU with oneDNN-packed weights (layers/cpu_linear.py): the same bits as
F.linear through every layer kind, the plain copies freed unless shared, and an engine that gives
the same tokens with and without packing."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.layers import cpu_linear
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    ReplicatedLinear, RowParallelLinear)

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not cpu_linear.packing_available(BF16),
                                reason="this CPU build of torch cannot pack bf16 weights for oneDNN")


def _layers():
    return {
        "replicated": ReplicatedLinear(96, 80, bias=True),
        "column": ColumnParallelLinear(96, 160),
        "gate_up": MergedColumnParallelLinear(96, [128, 128]),
        "qkv": QKVParallelLinear(96, 32, 4, 2, bias=True),
        "row": RowParallelLinear(160, 96, bias=True),
    }


def _randomize(module: torch.nn.Module, gen: torch.Generator):
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=gen).to(BF16)
    return module


@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("kind", ["replicated", "column", "gate_up", "qkv", "row"])
def test_packed_projection_has_f_linears_bits(kind, m):
    gen = torch.Generator().manual_seed(m)
    layer = _randomize(_layers()[kind], gen)
    weight, bias = layer.weight.data.clone(), None if layer.bias is None else layer.bias.data.clone()
    x = torch.randn(m, weight.shape[1], generator=gen).to(BF16)
    forward = layer.swiglu if kind == "gate_up" else layer
    expect = forward(x)  # the plain path: F.linear
    assert cpu_linear.pack_linear_weights(layer) == 1
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is freed
    assert torch.equal(layer.library_linear(x, bias), F.linear(x, weight, bias))
    assert torch.equal(forward(x), expect)


class _TiedModel(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(300, 64)
        self.proj = ColumnParallelLinear(64, 64)
        self.lm_head = ParallelLMHead(300, 64)
        if tied:
            self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_packed_and_a_tied_embedding_kept(tied):
    gen = torch.Generator().manual_seed(1)
    model = _randomize(_TiedModel(tied), gen)
    embed, head = model.embed.weight.data.clone(), model.lm_head.weight.data.clone()
    hidden = torch.randn(7, 64, generator=gen).to(BF16)
    ids = torch.tensor([0, 5, 299])
    assert cpu_linear.pack_linear_weights(model) == 2  # proj and lm_head; the embedding is a lookup
    assert torch.equal(model.lm_head(hidden), F.linear(hidden, head))
    assert torch.equal(model.embed(ids), F.embedding(ids, embed))  # still the full table
    assert (model.lm_head.weight.numel() == 0) == (not tied)


def test_fp32_is_not_packed():
    model = ColumnParallelLinear(64, 64)  # fp32: F.linear stays (packed fp32 is not bit-identical)
    assert cpu_linear.pack_linear_weights(model) == 0
    assert model.packed_weight is None and model.weight.numel() == 64 * 64


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied / untied LM head, qkv bias
def test_engine_tokens_equal_without_packing(model_factory, monkeypatch, arch):
    path = model_factory(arch)
    prompts = [[(5 * i + 3 * j) % 400 + 1 for j in range(n)] for i, n in enumerate((3, 17, 60))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    runs = []
    for packing in (True, False):
        if not packing:
            monkeypatch.setattr(cpu_linear, "packing_available", lambda dtype: False)
        with LLM(path, dtype="bfloat16", max_model_len=256, device="cpu") as llm:  # packing is CPU-only
            model = llm.engine.model_runner.model
            assert any(getattr(m, "packed_weight", None) is not None for m in model.modules()) == packing
            runs.append([[o["token_ids"] for o in llm.generate(prompts, p, use_tqdm=False)] for p in params])
    assert runs[0] == runs[1]


def test_a_packed_product_that_disagrees_keeps_the_plain_path(monkeypatch):
    """Start-up checks the packed product against F.linear on a real weight: a oneDNN build whose
    packed product differs (or fails) leaves every layer on F.linear."""
    model = _randomize(ColumnParallelLinear(64, 64), torch.Generator().manual_seed(2))
    real = cpu_linear.packed_linear
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda x, packed, bias: real(x, packed, bias) + 1)
    assert cpu_linear.pack_linear_weights(model) == 0
    assert model.packed_weight is None and model.weight.numel() == 64 * 64

    def broken(x, packed, bias):
        raise RuntimeError("no bf16 kernel")
    monkeypatch.setattr(cpu_linear, "packed_linear", broken)
    assert cpu_linear.pack_linear_weights(model) == 0
