"""scripts/probe_decode_loads.py's stand-in kernel reads what decode attention reads: through the block
tables, K and V of every cached token of its sequence and head, and with `dots` it runs attention's two
products on them (a constant query, no softmax)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import probe_decode_loads as probe  # noqa: E402


@pytest.mark.parametrize("mode", ["loads", "k-only", "dots"])
def test_stand_in_reads_every_cached_token(mode, device, monkeypatch):
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's tl.dot: no bf16
    monkeypatch.setattr(probe, "PAGE", 64)
    blocks, hkv, d = 12, probe.HKV, probe.D
    # Positive values: no cancellation, so a token missed or read twice moves every sum past the bounds below.
    k = torch.rand(blocks, 64, hkv, d, generator=g).to(device, dt)
    v = torch.rand(blocks, 64, hkv, d, generator=g).to(device, dt)
    tables = torch.randperm(blocks, generator=g).to(device, torch.int32).view(2, 6)
    lens = torch.tensor([300, 130], dtype=torch.int32, device=device)  # ragged last tiles
    out = torch.empty(2 * hkv, dtype=torch.float32, device=device)
    probe.run_stand_in(k, v, tables, lens, out, with_v=mode != "k-only", dots=mode == "dots")
    expect, bound = [], []
    for b in range(2):
        rows = tables[b].long()
        kk = k[rows].reshape(-1, hkv, d)[: lens[b]].float()
        vv = v[rows].reshape(-1, hkv, d)[: lens[b]].float()
        if mode == "dots":
            # 16 query rows of 0.01 (in the cache dtype): each score is 0.01 * the key's sum, rounded to the cache
            # dtype, where the kernel's and this sum's orders may round it one unit apart.
            q = torch.tensor(0.01, dtype=dt).float()
            terms = (q * kk.sum(-1)).to(dt).float()[..., None] * vv
            expect.append(16 * terms.sum(dim=(0, 2)))
            bound.append(16 * terms.sum(dim=(0, 2)) * torch.finfo(dt).eps)
        else:
            total = (kk + vv if mode == "loads" else kk).sum(dim=(0, 2))
            expect.append(total)
            bound.append(total * 1e-5)  # fp32 accumulation orders
    err = (out.view(2, hkv) - torch.stack(expect)).abs()
    assert (err <= torch.stack(bound)).all(), (err, torch.stack(bound))
