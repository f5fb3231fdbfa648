"""The top-k candidate draw (rows whose every filter is bounded by top_k) against the full path."""
import torch

from nanovllm.layers.sampler import _gumbel, _sample_top_k, _top_k_top_p, exponential_noise, row_keys


def test_candidate_draw_equals_full_vocabulary_draw():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 1000
    x = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.randint(1, 60, (rows,), generator=g)
    top_p = torch.rand(rows, generator=g) * 0.9 + 0.1
    top_p[::4] = 1.0
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    offsets = torch.randint(0, 500, (rows,), generator=g)
    keys = row_keys(seeds, offsets)
    ours = _sample_top_k(x, top_k, top_p, int(top_k.max()), keys)
    full = _top_k_top_p(x.clone(), top_k, top_p, int(top_k.max()))
    expected = (full - exponential_noise(seeds, offsets, vocab).log()).argmax(-1)
    assert torch.equal(ours, expected)
    assert torch.equal(_gumbel(keys, torch.arange(vocab).expand(rows, vocab)),
                       -exponential_noise(seeds, offsets, vocab).log())


def test_candidate_draw_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    keys = row_keys(torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    tokens = _sample_top_k(logits.expand(n, -1), torch.full((n,), 3), None, 3, keys)
    freq = torch.bincount(tokens, minlength=6).float() / n
    expected = torch.zeros(6)
    expected[:3] = logits[:3].softmax(-1)
    assert (freq - expected).abs().sum() / 2 < 0.02  # total variation
