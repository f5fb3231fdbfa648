"""The one-kernel top-k / top-p draw against the torch sampler's candidate draw (`_sample_top_k`)."""
import pytest
import torch

from nanovllm.kernels.sample_top_k import MAX_TOP_K, sample_top_k_rows
from nanovllm.layers.sampler import _gumbel, _sample_top_k, row_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _distinct_logits(rows, vocab, gen, dtype):
    """Every logit of a row distinct (distinct 16-bit patterns of both signs, permuted), so the k best
    are one set whatever the tie rule."""
    half = (vocab + 1) // 2
    lo, hi = (0x3C00, 0x4200) if dtype == torch.bfloat16 else (0x2C00, 0x5000)  # ~0.008-32 / 0.06-32
    pos = lo + torch.arange(half, dtype=torch.int32) * max(1, (hi - lo) // half)
    assert int(pos[-1]) < hi
    grid = torch.cat([pos, pos | 0x8000])[:vocab].to(torch.int16).view(dtype)
    return torch.stack([grid[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def _reference(logits, temps, top_k, top_p, keys):
    """The torch sampler's draw: greedy rows the argmax, random rows `_sample_top_k` on logits / T."""
    x = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    drawn = _sample_top_k(x, top_k, top_p, int(top_k.max()), keys)
    return torch.where(temps > 0, drawn, x.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [300, 3001])
def test_draws_the_torch_samplers_tokens(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = _distinct_logits(rows, vocab, gen, dtype)
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[::5] = 0.0
    top_k = torch.randint(1, MAX_TOP_K + 1, (rows,), generator=gen)
    top_k[1], top_k[2] = 1, MAX_TOP_K
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_p[::3] = 1.0
    keys = row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(0, 900, (rows,), generator=gen))
    expected = _reference(logits, temps, top_k, top_p, keys)
    dev = [t.to(DEVICE) for t in (logits, temps, top_k, top_p, keys)]
    got = sample_top_k_rows(*dev).cpu()
    if DEVICE != "cuda":
        assert torch.equal(got, expected)
        return
    # Approximate logs on the GPU: a row may take a kept candidate whose score ties the best to ~1e-5.
    x = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    ids = torch.arange(vocab).expand(rows, vocab)
    scores = x + _gumbel(keys, ids)
    for row in (got != expected).nonzero().flatten().tolist():
        a, b = scores[row, expected[row]].item(), scores[row, got[row]].item()
        assert temps[row] > 0 and abs(a - b) <= 1e-5 * max(1.0, abs(a)), (row, a, b)


def test_ties_at_the_kth_logit_take_the_lowest_ids():
    """Logits 3, 2, 2, 2, 1, ...: with k = 2 the candidates are token 0 and token 1 (the first of the
    tied), so every draw is one of those two; all-equal logits draw among the first k ids."""
    rows, vocab = 64, 500
    logits = torch.ones(rows, vocab)
    logits[:, 0], logits[:, 1:4] = 3.0, 2.0
    keys = row_keys(torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    args = (torch.full((rows,), 4.0), torch.full((rows,), 2), torch.ones(rows), keys)
    got = sample_top_k_rows(logits.half().to(DEVICE), *(t.to(DEVICE) for t in args)).cpu()
    assert set(got.tolist()) == {0, 1}
    flat = torch.zeros(rows, vocab, dtype=torch.float16, device=DEVICE)
    args = (torch.ones(rows), torch.full((rows,), 7), torch.ones(rows), keys)
    got = sample_top_k_rows(flat, *(t.to(DEVICE) for t in args)).cpu()
    assert set(got.tolist()) == set(range(7))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    """Candidates with probabilities ~0.5, 0.3, 0.2 (k = 3): top_p 0.45 keeps only the first, 0.65 the
    first two; a greedy row takes the maximum whatever its filters."""
    rows, vocab = 64, 200
    logits = torch.full((rows, vocab), -30.0)
    logits[:, 5], logits[:, 9], logits[:, 2] = 0.0, float(torch.log(torch.tensor(0.6))), float(torch.log(torch.tensor(0.4)))
    keys = row_keys(torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    temps = torch.ones(rows)
    temps[0] = 0.0
    for top_p, allowed in ((0.45, {5}), (0.65, {5, 9}), (1.0, {5, 9, 2})):
        args = (temps, torch.full((rows,), 3), torch.full((rows,), top_p), keys)
        got = sample_top_k_rows(logits.half().to(DEVICE), *(t.to(DEVICE) for t in args)).cpu()
        assert got[0] == 5 and set(got.tolist()) == allowed, (top_p, set(got.tolist()))
