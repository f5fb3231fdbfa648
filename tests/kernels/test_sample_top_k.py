"""The top-k / top-p draw's kernels against the torch sampler's candidate draw (`_sample_top_k`)."""
import pytest
import torch

from nanovllm.kernels.sample_top_k import MAX_TOP_K, PAIRWISE_MAX_K, TopKConfig, sample_top_k_rows
from nanovllm.layers.sampler import _gumbel, _sample_top_k, row_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _distinct_logits(rows, vocab, gen, dtype):
    """Every logit of a row distinct (distinct 16-bit patterns of both signs, permuted), so the k best
    are one set whatever the tie rule. float32: fp16's, converted (exactly)."""
    if dtype == torch.float32:
        return _distinct_logits(rows, vocab, gen, torch.float16).float()
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


# The default, and chunks of two 128-logit tiles (each row cut into up to a dozen programs).
CONFIGS = [None, TopKConfig(64, 128, 4)]


# The finish ranks candidates pairwise up to PAIRWISE_MAX_K, by bisection past it (wider lanes, fewer chunks).
MAX_KS = [PAIRWISE_MAX_K, MAX_TOP_K]


def _draw_cases():
    """Every (vocabulary and finish, dtype) pair, each vocabulary and each dtype with both chunkings:
    all the pairs of the three settings, half their product."""
    cases = []
    for v, (vocab, max_top_k, name) in enumerate([(300, PAIRWISE_MAX_K, "300-pairwise"),
                                                  (3001, PAIRWISE_MAX_K, "3001-pairwise"),
                                                  (3001, MAX_TOP_K, "3001-wide")]):
        for d, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
            c = (v + d) % 2
            cases.append(pytest.param(dtype, vocab, CONFIGS[c], max_top_k,
                                      id=f"{name}-{str(dtype)[6:]}-{('default', 'split')[c]}"))
    return cases


@pytest.mark.parametrize("dtype, vocab, config, max_top_k", _draw_cases())
def test_draws_the_torch_samplers_tokens(dtype, vocab, config, max_top_k):
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = _distinct_logits(rows, vocab, gen, dtype)
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[::5] = 0.0
    top_k = torch.randint(1, max_top_k + 1, (rows,), generator=gen)
    top_k[1], top_k[2] = 1, max_top_k
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_p[::3] = 1.0
    if config is not None:
        top_p = None if vocab == 300 else top_p  # also the variant without top-p
    keys = row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(0, 900, (rows,), generator=gen))
    expected = _reference(logits, temps, top_k, top_p, keys)
    dev = [None if t is None else t.to(DEVICE) for t in (logits, temps, top_k, top_p, keys)]
    got = sample_top_k_rows(*dev, max_top_k=max_top_k, config=config).cpu()
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


@pytest.mark.parametrize("max_top_k", MAX_KS, ids=["pairwise", "wide"])
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "split"])
def test_ties_at_the_kth_logit_take_the_lowest_ids(config, max_top_k):
    """Logits 3, 2, 2, 2, 1, ...: with k = 2 the candidates are token 0 and token 1 (the first of the
    tied), so every draw is one of those two; all-equal logits (a tie longer than MAX_CANDIDATES)
    draw among the first k ids, as does a tie of 60 at the end of the row."""
    rows, vocab = 24, 500
    logits = torch.ones(rows, vocab)
    logits[:, 0], logits[:, 1:4] = 3.0, 2.0
    keys = row_keys(torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    args = (torch.full((rows,), 4.0), torch.full((rows,), 2), torch.ones(rows), keys)
    got = sample_top_k_rows(logits.half().to(DEVICE), *(t.to(DEVICE) for t in args), max_top_k=max_top_k, config=config).cpu()
    assert set(got.tolist()) == {0, 1}
    # A tie longer than the kernels' list: the list is rebuilt from the row by bisection, a pass over the
    # row per key bit (the interpreter's slowest path, so fewer rows and a k they all cover).
    flat_rows = 10
    flat = torch.zeros(flat_rows, 3000, dtype=torch.float16, device=DEVICE)
    args = (torch.ones(flat_rows), torch.full((flat_rows,), 3), torch.ones(flat_rows), keys[:flat_rows])
    got = sample_top_k_rows(flat, *(t.to(DEVICE) for t in args), max_top_k=max_top_k, config=config).cpu()
    assert set(got.tolist()) == set(range(3))
    tail = torch.zeros(rows, vocab, dtype=torch.float16)
    tail[:, :5], tail[:, -60:] = 2.0, 1.0
    args = (torch.ones(rows), torch.full((rows,), 9), torch.ones(rows), keys)
    got = sample_top_k_rows(tail.to(DEVICE), *(t.to(DEVICE) for t in args), max_top_k=max_top_k,
                            config=config).cpu()
    drawn = set(got.tolist())
    assert drawn <= set(range(5)) | set(range(vocab - 60, vocab - 56)) and drawn & set(range(vocab - 60, vocab))


def check_top_p_prefix(draw):
    """Tokens with probabilities ~0.5, 0.3, 0.2 (the rest far below): top_p 0.45 keeps only the first,
    0.65 the first two; a greedy row takes the maximum whatever its filters. draw(logits, temps,
    top_p, keys) -> tokens, all on DEVICE."""
    rows, vocab = 32, 200
    logits = torch.full((rows, vocab), -30.0)
    logits[:, 5], logits[:, 9], logits[:, 2] = 0.0, torch.tensor(0.6).log().item(), torch.tensor(0.4).log().item()
    keys = row_keys(torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    temps = torch.ones(rows)
    temps[0] = 0.0
    for top_p, allowed in ((0.45, {5}), (0.65, {5, 9}), (1.0, {5, 9, 2})):
        args = (logits.half(), temps, torch.full((rows,), top_p), keys)
        got = draw(*(t.to(DEVICE) for t in args)).cpu()
        assert got[0] == 5 and set(got.tolist()) == allowed, (top_p, set(got.tolist()))


@pytest.mark.parametrize("max_top_k", MAX_KS, ids=["pairwise", "wide"])
def test_top_p_keeps_the_smallest_prefix_reaching_p(max_top_k):
    """With k = 3, the three tokens of `check_top_p_prefix` are the candidates."""
    check_top_p_prefix(lambda logits, temps, top_p, keys: sample_top_k_rows(
        logits, temps, torch.full_like(keys, 3), top_p, keys, max_top_k))


def _metadata(params, device=DEVICE):
    from nanovllm.engine.sequence import Sequence
    from nanovllm.worker.sampling_inputs import build_sampling_metadata
    seqs = [Sequence([1, 2, 3], p, seed=50 + i) for i, p in enumerate(params)]
    return build_sampling_metadata(seqs, torch.device(device), (), None)


def test_sampler_routes_bounded_top_k_batches_to_the_kernels():
    """Which batches the sampler gives the kernels: random rows all with a top_k up to MAX_TOP_K
    (greedy rows may come along), 16-bit logits, no stage that runs on fp32 logits first."""
    from nanovllm.layers.filter_kernels import top_k_kernel_serves
    from nanovllm.sampling_params import SamplingParams as SP
    serves = lambda params, dtype=torch.bfloat16: top_k_kernel_serves(dtype, _metadata(params))  # noqa: E731
    assert serves([SP(top_k=50), SP(top_k=5, top_p=0.9)])
    assert serves([SP(top_k=50), SP(temperature=0.0)])
    assert serves([SP(top_k=MAX_TOP_K)], torch.float16)
    assert serves([SP(top_k=50)], torch.float32)
    assert not serves([SP(top_k=MAX_TOP_K + 1)])
    assert not serves([SP(top_k=50), SP()])  # a random row without top-k
    assert not serves([SP(top_k=50), SP(top_p=0.9)])  # top-p alone is unbounded
    assert serves([SP(top_k=50, min_p=0.1), SP(top_k=5)])  # min-p comes along
    assert not serves([SP(top_p=0.9, min_p=0.1)])
    assert serves([SP(top_k=50, repetition_penalty=1.2)])  # on the float32 logits the penalties leave
    assert not serves([SP(top_k=50)], torch.float64)
    assert serves([SP(top_k=50, min_tokens=3, stop_token_ids=[7])])  # bans as -inf in a 16-bit copy
    assert not serves([SP(temperature=0.0)])


def test_sampler_kernel_draw_equals_the_torch_path_on_a_mixed_batch():
    """Greedy rows, top-k rows, top-k + top-p rows and rows with min-p as well in one batch: the
    kernels' tokens (rows given to them through `filter_rows` and `min_p_rows`) are the torch path's."""
    from nanovllm.layers.filter_kernels import _draw_top_k
    from nanovllm.layers.sampler import Sampler, draw_with_kernels
    from nanovllm.sampling_params import SamplingParams as SP
    params = [SP(temperature=0.0), SP(temperature=0.7, top_k=40), SP(temperature=1.1, top_k=3, top_p=0.8),
              SP(temperature=0.0, top_k=9), SP(temperature=0.5, top_k=MAX_TOP_K, top_p=0.5),
              SP(temperature=0.9, top_k=60, min_p=0.5), SP(temperature=1.2, top_k=MAX_TOP_K, top_p=0.9, min_p=0.7)] * 3
    meta = _metadata(params)
    assert meta.filter_rows is not None and meta.top_p is not None and meta.min_p_rows is not None
    # Scaled down (by a power of two: still distinct) so that min-p and top-p keep many candidates.
    logits = _distinct_logits(len(params), 3001, torch.Generator().manual_seed(7), torch.bfloat16) * 0.125
    expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids  # the torch path, on the CPU
    got = draw_with_kernels(_draw_top_k, logits.to(DEVICE), meta, meta.row_keys).cpu()
    assert torch.equal(got, expected)
    # min-p binds there: without it, some of those rows draw other tokens.
    no_min_p = [SP(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p) for sp in params]
    assert not torch.equal(Sampler().sample(logits, _metadata(no_min_p, "cpu")).token_ids, expected)


def test_sampler_kernel_draw_applies_min_tokens_bans():
    """A row still under min_tokens cannot draw its stop id: with the row's best token as that id,
    greedy and random rows draw as the torch path does, which is never that token."""
    from nanovllm.layers.filter_kernels import _draw_top_k
    from nanovllm.layers.sampler import Sampler, draw_with_kernels
    from nanovllm.sampling_params import SamplingParams as SP
    logits = _distinct_logits(6, 3001, torch.Generator().manual_seed(8), torch.bfloat16) * 0.125
    best = logits.float().argmax(-1).tolist()
    params = [SP(temperature=0.0 if i % 3 == 0 else 0.8, top_k=(5, 40)[i % 2], top_p=0.9 if i % 2 else 1.0,
                 min_tokens=4, stop_token_ids=[best[i]]) for i in range(6)]
    meta = _metadata(params)
    assert meta.banned_ids is not None
    expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids
    got = draw_with_kernels(_draw_top_k, logits.to(DEVICE), meta, meta.row_keys).cpu()
    assert torch.equal(got, expected) and not (got == torch.tensor(best)).any()


def test_sampler_kernel_draw_with_penalties_on_float32_logits():
    """Penalties leave float32 logits, which the kernels take with 32-bit keys: the torch path's
    tokens, and a penalty that moves a greedy row off its best token moves the kernels' too."""
    from nanovllm.layers.filter_kernels import _draw_top_k
    from nanovllm.layers.sampler import Sampler, draw_with_kernels
    from nanovllm.sampling_params import SamplingParams as SP
    logits = _distinct_logits(8, 3001, torch.Generator().manual_seed(12), torch.bfloat16) * 0.125
    logits[:, 2] = logits.max() + 1  # the prompt's token 2 is every row's best, until penalised
    params = [SP(temperature=0.0 if i % 4 == 0 else 0.9, top_k=(3, 50)[i % 2], top_p=0.8 if i % 3 else 1.0,
                 repetition_penalty=(1.0, 3.0)[i % 2 == 0], frequency_penalty=0.2 * (i % 3),
                 presence_penalty=0.5 if i == 5 else 0.0) for i in range(8)]
    meta = _metadata(params)
    assert meta.penalties is not None
    expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids
    got = draw_with_kernels(_draw_top_k, logits.to(DEVICE), meta, meta.row_keys).cpu()
    assert torch.equal(got, expected) and got[0] != 2 and got[4] != 2
