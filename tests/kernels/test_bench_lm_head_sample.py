"""scripts/bench_lm_head_sample.py's fused kernel draws what it is timed against: the same tokens as
the LM head's logits fed to `sample_rows` (temperature and greedy rows, ragged vocabulary tiles)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_lm_head_sample as study  # noqa: E402
from nanovllm.kernels.sample import sample_rows  # noqa: E402


@pytest.mark.parametrize("config", [(16, 128, 64, 4, 3), (16, 64, 32, 4, 2)])
def test_fused_draws_equal_the_two_kernel_path(config, device):
    g = torch.Generator().manual_seed(0)
    m, k, v = 7, 64, 300  # 300: the last vocabulary tile is partial
    # Quarter-integer inputs: every logit is exact in fp32 and fp16, so both paths see the same
    # logits (the interpreter's tl.dot has no bf16: fp16 there) and exact greedy ties test the tie rule.
    dt = torch.bfloat16 if device.type == "cuda" else torch.float16
    hidden = (torch.randint(-2, 3, (m, k), generator=g) * 0.25).to(device, dt)
    weight = (torch.randint(-2, 3, (v, k), generator=g) * 0.25).to(device, dt)
    temps = torch.tensor([0.6, 0.0, 1.0, 0.0, 0.3, 2.0, 0.6], device=device)
    seeds = torch.randint(0, 2**62, (m,), generator=g).to(device)
    offsets = torch.randint(0, 1024, (m,), generator=g).to(device)
    logits = hidden.float() @ weight.float().T
    expect = sample_rows(logits.to(dt), temps, None, seeds=seeds, offsets=offsets)
    out = torch.empty(m, dtype=torch.int64, device=device)
    got = study.fused_draw(hidden, weight, temps, seeds, offsets, out, config)
    assert got.tolist() == expect.tolist()
    greedy = temps == 0
    assert got[greedy].tolist() == logits[greedy].argmax(-1).tolist()  # the lowest of equal maxima


def test_without_noise_every_row_takes_its_argmax(device):
    g = torch.Generator().manual_seed(1)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float16
    hidden = (torch.randint(-2, 3, (5, 64), generator=g) * 0.25).to(device, dt)
    weight = (torch.randint(-2, 3, (200, 64), generator=g) * 0.25).to(device, dt)
    temps = torch.full((5,), 0.6, device=device)
    zeros = torch.zeros(5, dtype=torch.int64, device=device)
    out = torch.empty(5, dtype=torch.int64, device=device)
    got = study.fused_draw(hidden, weight, temps, zeros, zeros, out, (16, 64, 64, 4, 2), noise=False)
    assert got.tolist() == (hidden.float() @ weight.float().T).argmax(-1).tolist()
