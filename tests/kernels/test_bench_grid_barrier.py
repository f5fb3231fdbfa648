"""scripts/bench_grid_barrier.py's kernels compute what they time: each stage's partials sum to the
stage's product. The persistent kernel's barrier needs every program resident at once, which the
interpreter (programs one after another) cannot give: it runs on a GPU only."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_grid_barrier as study  # noqa: E402


def _inputs(device, rows=16):
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's tl.dot: no bf16
    ws = (torch.randn(study.COPIES, study.N, study.K, generator=g) * 0.02).to(device, dt)
    a = torch.randn(2, rows, study.K, generator=g).to(device, dt)
    out = torch.zeros(2, study.K // study.KS, rows, study.N, dtype=torch.float32, device=device)
    return ws, a, out


@pytest.mark.parametrize("pre", [False, True])
def test_stage_kernels_compute_each_stage(pre, device):
    ws, a, out = _inputs(device)
    study.run_kernels(ws, a, out, 3, pre, 16)
    for r in (1, 2):  # the last two stages' outputs are still there
        torch.testing.assert_close(out[r % 2].sum(0), a[r % 2].float() @ ws[r].float().T, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grid barrier needs all programs resident (GPU)")
@pytest.mark.parametrize("pre,poll_load", [(False, False), (True, False), (True, True)])
def test_persistent_kernel_computes_each_stage(pre, poll_load, device):
    ws, a, out = _inputs(device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    study.run_persistent(ws, a, out, counter, 3, pre, 16, poll_load=poll_load)
    assert counter.item() == 3 * study.PROGRAMS
    for r in (1, 2):
        torch.testing.assert_close(out[r % 2].sum(0), a[r % 2].float() @ ws[r].float().T, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grid barrier needs all programs resident (GPU)")
@pytest.mark.parametrize("poll_load", [False, True])
def test_barriers_alone_count_every_arrival(poll_load, device):
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    study._barriers_kernel[(132,)](counter, ROUNDS=5, POLL_LOAD=poll_load)
    assert counter.item() == 5 * 132
