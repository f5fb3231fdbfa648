"""The top-k candidate draw (rows whose every filter is bounded by top_k) against the full path."""
import pytest
import torch

from nanovllm.layers.sampler import _gumbel, _noise_bits, _sample_top_k, _top_k_top_p, exponential_noise, row_keys


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_candidate_draw_equals_full_vocabulary_draw(ties):
    """The candidate draw (batches whose rows all have a top_k) and the full sort (the others) keep
    the same tokens, also where runs of equal logits straddle the top-k or top-p cut: a request's
    tokens do not depend on which path its batch takes."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 1000
    x = torch.randint(-8, 8, (rows, vocab), generator=g) * 0.25 if ties else torch.randn(rows, vocab, generator=g) * 3
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_candidate_noise_and_draw_equal_the_cpu_and_the_kernel():
    """On the GPU the int32 hash (wrapping products, masked shifts) gives the CPU's bits, the
    candidate draw the CPU's tokens, and both agree with the sampling kernel's full-vocabulary draw
    over the same top-k, apart from rows whose two best scores tie within the kernel's log error."""
    g = torch.Generator().manual_seed(3)
    rows, vocab, k = 256, 20000, 50
    x = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.randint(1, k + 1, (rows,), generator=g)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    offsets = torch.randint(0, 500, (rows,), generator=g)
    keys = row_keys(seeds, offsets)
    ids = torch.randint(0, vocab, (rows, k), generator=g)
    from nanovllm.kernels.sample import sample_rows
    cuda = torch.device("cuda")
    assert torch.equal(_noise_bits(keys.to(cuda), ids.to(cuda)).cpu(), _noise_bits(keys, ids))
    torch.testing.assert_close(_gumbel(keys.to(cuda), ids.to(cuda)).cpu(), _gumbel(keys, ids), rtol=1e-6, atol=1e-6)

    on_cpu = _sample_top_k(x, top_k, None, k, keys)
    on_gpu = _sample_top_k(x.to(cuda), top_k.to(cuda), None, k, keys.to(cuda)).cpu()
    kernel = sample_rows(_top_k_top_p(x.to(cuda), top_k.to(cuda), None, k), torch.ones(rows, device=cuda),
                         keys.to(cuda)).cpu()
    scores = x.double() - exponential_noise(seeds, offsets, vocab).double().log()
    for tokens in (on_gpu, kernel):
        differ = (tokens != on_cpu).nonzero().flatten()
        gaps = (scores[differ, on_cpu[differ]] - scores[differ, tokens[differ]]).abs()
        assert len(differ) <= 2 and bool((gaps < 1e-4).all()), (differ, gaps)


def test_top_candidates_are_a_stable_sorts_first():
    """The first `width` of a descending stable sort (equal logits: lowest id first), with runs of
    equal logits across the cut, rows of one value and -inf."""
    from nanovllm.layers.sampler import _top_candidates
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 3, (6, 50), generator=g).float()
    x[1] = 0.5
    x[2, 10:] = float("-inf")
    for width in (1, 7, 20, 50):
        vals, ids = _top_candidates(x, width)
        ref_vals, ref_ids = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(vals, ref_vals[:, :width]) and torch.equal(ids, ref_ids[:, :width]), width
