"""The start-up GEMM warm-up: which sizes it meets (worker/gemm_warmup.py)."""
import torch

import nanovllm.worker.gemm_warmup as gemm_warmup
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


def test_token_ladder_is_exhaustive_then_coarse():
    ladder = gemm_warmup.token_ladder(16384)
    assert ladder[:256] == list(range(1, 257))
    assert ladder[256:] == list(range(320, 16385, 64))
    assert gemm_warmup.token_ladder(100) == list(range(1, 101))
    assert gemm_warmup.token_ladder(1000)[-2:] == [960, 1000]  # the largest step itself


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = QKVParallelLinear(8, 4, 2, 1, bias=True)   # [16, 8] with a bias
        self.up = ColumnParallelLinear(8, 16)                  # [16, 8], no bias: another shape key
        self.up_again = ColumnParallelLinear(8, 16)            # same shape: met once
        self.down = RowParallelLinear(16, 8)                   # [8, 16]
        self.lm_head = ParallelLMHead(32, 8)


def test_every_projection_shape_at_every_ladder_count(monkeypatch):
    calls = []

    def linear(x, weight, bias=None):
        assert x.is_contiguous() and x.shape[1] == weight.shape[1]
        calls.append((x.shape[0], tuple(weight.shape), bias is not None))
        return x.new_zeros(x.shape[0], weight.shape[0])
    monkeypatch.setattr(gemm_warmup.F, "linear", linear)
    model = _Toy()
    gemm_warmup.warm_gemms(model, max_tokens=300, max_rows=5, device=torch.device("cpu"), dtype=torch.float32)
    ladder = gemm_warmup.token_ladder(300)
    projections = {((16, 8), True), ((16, 8), False), ((8, 16), False)}
    expect = [(m, shape, bias) for m in ladder for shape, bias in projections]
    expect += [(rows, (32, 8), False) for rows in range(1, 6)]
    assert sorted(calls) == sorted(expect)


def test_really_runs_on_this_device():
    gemm_warmup.warm_gemms(_Toy(), max_tokens=40, max_rows=3, device=torch.device("cpu"), dtype=torch.float32)
