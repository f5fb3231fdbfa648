"""The top-p draw's kernel against the torch sampler's path (full sort, nucleus mask, Gumbel-max)."""
import pytest
import torch

from nanovllm.kernels.sample import SampleConfig
from nanovllm.kernels.sample_top_p import sample_top_p_rows
from nanovllm.layers.sampler import _gumbel, _min_p, _top_k_top_p, row_keys
from test_sample_top_k import _distinct_logits, _metadata, check_top_p_prefix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(logits, temps, top_p, keys, min_p=None):
    """The torch sampler's draw: greedy rows the argmax, random rows the Gumbel-max over the nucleus
    of logits / T (after min-p, where given)."""
    x = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    filtered = x.clone() if min_p is None else _min_p(x.clone(), min_p)
    nucleus = _top_k_top_p(filtered, None, top_p, 0)
    ids = torch.arange(x.shape[1]).expand_as(x)
    return torch.where(temps > 0, (nucleus + _gumbel(keys, ids)).argmax(-1), x.argmax(-1))


def _check(got, expected, logits, temps, keys):
    if DEVICE != "cuda":
        assert torch.equal(got, expected)
        return
    # Approximate logs on the GPU: a row may take a token whose score ties the best to ~1e-5.
    x = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
    scores = x + _gumbel(keys, torch.arange(x.shape[1]).expand_as(x))
    for row in (got != expected).nonzero().flatten().tolist():
        a, b = scores[row, expected[row]].item(), scores[row, got[row]].item()
        assert temps[row] > 0 and abs(a - b) <= 1e-5 * max(1.0, abs(a)), (row, a, b)


def _cases():
    """The two kernels' settings, each crossed in full: the first draw's (vocabulary, dtype, chunking),
    and the nucleus kernel's compile-time switches (test_first, min_p) at each vocabulary, each switch
    on every dtype too (the nucleus kernel reads the logits in their dtype). The whole cross product
    of both is four times as many interpreter runs and adds no path."""
    switches = [(True, False), (True, True), (False, False), (False, True)]
    cases = []
    for v, vocab in enumerate((300, 3001)):
        for d, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
            for c, chunks in enumerate(("default", "many")):
                test_first, min_p = switches[(2 * d + c + 2 * v) % 4]
                cases.append(pytest.param(dtype, vocab, chunks, test_first, min_p,
                                          id=f"{vocab}-{str(dtype)[6:]}-{chunks}-test_first={test_first}-"
                                             f"min_p={min_p}"))
    return cases


@pytest.mark.parametrize("dtype, vocab, chunks, test_first, min_p", _cases())
def test_draws_the_torch_samplers_tokens(dtype, vocab, chunks, test_first, min_p):
    gen = torch.Generator().manual_seed(vocab)
    rows = 20
    # Distinct values (scaled by a power of two: still distinct), so that the ranking needs no tie rule.
    logits = _distinct_logits(rows, vocab, gen, dtype) * 0.125
    logits = logits.to(dtype)
    temps = torch.rand(rows, generator=gen) + 0.5
    temps[::7] = 0.0
    top_p = torch.tensor([0.01, 0.3, 0.5, 0.9, 0.99, 1.0] * 4)[:rows]
    keys = row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(0, 900, (rows,), generator=gen))
    # min-p on most rows (0 = off on some), strong enough to cut where top-p would not.
    min_ps = torch.tensor([0.0, 0.05, 0.3, 0.6, 0.9] * 4)[:rows] if min_p else None
    expected = _reference(logits, temps, top_p, keys, min_ps)
    # "many": the first draw over 128-logit tiles, each row cut into several chunks.
    config = SampleConfig(64, 128, 4, False, False) if chunks == "many" else None
    log_min_p = None if min_ps is None else torch.log(min_ps).to(DEVICE)
    got = sample_top_p_rows(*(t.to(DEVICE) for t in (logits, temps, top_p, keys)), config=config,
                            test_first=test_first, log_min_p=log_min_p).cpu()
    _check(got, expected, logits, temps, keys)


def test_nucleus_and_ties():
    """`check_top_p_prefix`'s nuclei; and ten equal logits (the rest far below) with top_p 0.5: the
    nucleus is the five lowest ids."""
    check_top_p_prefix(sample_top_p_rows)
    rows, vocab = 32, 200
    keys = row_keys(torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    tied = torch.full((rows, vocab), -30.0)
    tied[:, 100:110] = 1.0
    got = sample_top_p_rows(tied.half().to(DEVICE), torch.ones(rows, device=DEVICE), torch.full((rows,), 0.5, device=DEVICE),
                            keys.to(DEVICE)).cpu()
    assert set(got.tolist()) <= set(range(100, 105)) and len(set(got.tolist())) > 1


def test_sampler_picks_the_kernel_draw_for_its_filters():
    from nanovllm.layers.filter_kernels import _draw_split, _draw_top_k, _draw_top_p, filter_kernel_draw
    from nanovllm.sampling_params import SamplingParams as SP
    pick = lambda params: filter_kernel_draw(torch.bfloat16, _metadata(params))  # noqa: E731
    assert pick([SP(top_p=0.9), SP(), SP(temperature=0.0)]) is _draw_top_p
    assert pick([SP(top_k=20, top_p=0.9), SP(temperature=0.0)]) is _draw_top_k
    assert pick([SP(top_k=500, top_p=0.9)]) is _draw_top_k  # top-p ranked by bisection past k = 128
    assert pick([SP(top_k=2000, top_p=0.9)]) is None  # top-k past the top-k kernels' bound
    assert pick([SP(top_p=0.9), SP(top_k=20)]) is _draw_split  # a random row without top-k beside a top-k one
    assert pick([SP(), SP(top_k=20, min_p=0.2), SP(temperature=0.0)]) is _draw_split
    assert pick([SP(), SP(top_k=200)]) is _draw_split
    assert pick([SP(), SP(top_k=2000)]) is None
    assert pick([SP(top_p=0.9, min_p=0.1)]) is _draw_top_p
    assert pick([SP(min_p=0.1), SP()]) is _draw_top_p
    assert pick([SP(top_k=5, min_p=0.1)]) is _draw_top_k
    assert pick([SP(top_p=0.9, frequency_penalty=0.5)]) is _draw_top_p  # on the float32 logits
    assert pick([SP(top_p=0.9, min_tokens=2, stop_token_ids=[3])]) is _draw_top_p
    assert pick([SP(top_k=20, repetition_penalty=1.2)]) is _draw_top_k
    assert pick([SP(), SP(temperature=0.0)]) is None  # no filter: the plain draw


def test_sampler_kernel_draw_equals_the_torch_path_on_a_mixed_batch():
    """Greedy rows, plain random rows and top-p rows in one batch, some with penalties or bans: the
    kernel's tokens (the other rows given top_p = 1) are the torch path's."""
    from nanovllm.layers.filter_kernels import _draw_top_p
    from nanovllm.layers.sampler import Sampler, draw_with_kernels
    from nanovllm.sampling_params import SamplingParams as SP
    logits = _distinct_logits(18, 3001, torch.Generator().manual_seed(9), torch.bfloat16) * 0.125
    best = logits.float().argmax(-1).tolist()
    params = [SP(temperature=0.0), SP(temperature=0.7, top_p=0.3), SP(temperature=1.3),
              SP(temperature=1.1, top_p=0.95), SP(temperature=0.0, top_p=0.5)] * 2
    # Penalties and min_tokens bans too: the kernel then draws from the float32 logits they leave.
    params += [SP(temperature=0.0, repetition_penalty=1.5, min_tokens=3, stop_token_ids=[best[10]]),
               SP(temperature=0.9, top_p=0.6, presence_penalty=2.0, frequency_penalty=0.5),
               SP(temperature=0.8, top_p=0.9, min_tokens=2, stop_token_ids=[best[12]]),
               SP(temperature=0.0, min_tokens=2, stop_token_ids=[best[13]]), SP(temperature=0.7, top_p=0.8)]
    params += [SP(temperature=1.2, min_p=0.5), SP(temperature=1.1, top_p=0.9, min_p=0.7), SP(temperature=0.9)]
    meta = _metadata(params)
    assert meta.filter_rows is not None and meta.penalties is not None and meta.banned_ids is not None
    assert meta.min_p_rows is not None
    expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids  # the torch path, on the CPU
    got = draw_with_kernels(_draw_top_p, logits.to(DEVICE), meta, meta.row_keys).cpu()
    assert torch.equal(got, expected) and got[10] != best[10] and got[13] != best[13]


def test_split_draw_equals_the_torch_path():
    """Rows with a top_k (and top-p, min-p, bans, penalties) beside plain, top-p and greedy rows:
    the two kernels' tokens, each on its rows, are the torch path's."""
    from nanovllm.layers.filter_kernels import _draw_split, filter_kernel_draw
    from nanovllm.layers.sampler import Sampler, draw_with_kernels
    from nanovllm.sampling_params import SamplingParams as SP
    logits = _distinct_logits(12, 3001, torch.Generator().manual_seed(13), torch.bfloat16) * 0.125
    params = [SP(temperature=0.8, top_k=30), SP(temperature=1.1), SP(temperature=0.0),
              SP(temperature=0.9, top_p=0.7), SP(temperature=1.2, top_k=100, top_p=0.9, min_p=0.3),
              SP(temperature=1.0, min_p=0.5)] * 2
    params[7] = SP(temperature=0.9, top_p=0.8, presence_penalty=1.5, min_tokens=3, stop_token_ids=[5])
    meta = _metadata(params)
    assert filter_kernel_draw(torch.bfloat16, meta) is _draw_split
    expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids
    got = draw_with_kernels(_draw_split, logits.to(DEVICE), meta, meta.row_keys).cpu()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_random_batches_draw_the_torch_paths_tokens(ties):
    """Random batches of random sampling settings (greedy, temperature, top-k, top-p, min-p,
    penalties, min_tokens bans), dtypes and vocabularies: whichever kernel draw serves a batch gives
    the torch path's tokens. Tied: a dozen distinct logits per row (a flat bf16 distribution's runs
    of equal values), so equal logits straddle the top-k and top-p cuts: both paths order them by
    lowest id."""
    import random

    from nanovllm.layers.filter_kernels import filter_kernel_draw
    from nanovllm.layers.sampler import Sampler, draw_with_kernels, processed_logits
    from nanovllm.sampling_params import SamplingParams as SP
    rng = random.Random(0)
    drawn = set()
    for case in range(40 if ties else 60):
        vocab, rows = rng.choice([130, 257, 1000, 2500]), rng.randint(1, 6)
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        gen = torch.Generator().manual_seed(case)
        if ties:
            logits = (torch.randint(-6, 6, (rows, vocab), generator=gen) * rng.choice([0.25, 0.5])).to(dtype)
        else:
            logits = _distinct_logits(rows, vocab, gen, dtype) * rng.choice([0.0625, 0.5])
        params = []
        for _ in range(rows):
            kw = {"temperature": rng.choice([0.0, 0.3, 1.0, 1.5])}
            if rng.random() < 0.5:
                kw["top_k"] = rng.choice([1, 7, 50, 128, 300, 1000])
            if rng.random() < 0.5:
                kw["top_p"] = rng.choice([0.05, 0.5, 0.9])
            if rng.random() < 0.3:
                kw["min_p"] = rng.choice([0.01, 0.2, 0.6])
            if rng.random() < 0.2:
                kw["repetition_penalty"] = 1.3
            if rng.random() < 0.15:
                kw.update(min_tokens=3, stop_token_ids=[rng.randrange(vocab)])
            params.append(SP(**kw))
        meta = _metadata(params)
        draw = filter_kernel_draw(dtype, meta)
        if draw is None:
            continue
        drawn.add(draw.__name__)
        expected = Sampler().sample(logits, _metadata(params, "cpu")).token_ids
        got = draw_with_kernels(draw, logits.to(DEVICE), meta, meta.row_keys).cpu()
        if DEVICE != "cuda":
            assert torch.equal(got, expected), (case, params)
            continue
        # Approximate logs on the GPU: a row may take a token whose score ties the best to ~1e-5.
        cpu_meta = _metadata(params, "cpu")
        temps = cpu_meta.temperatures
        x = processed_logits(logits, cpu_meta) / torch.where(temps > 0, temps, 1.0)[:, None]
        scores = x + _gumbel(cpu_meta.row_keys, torch.arange(vocab).expand(rows, vocab))
        for row in (got != expected).nonzero().flatten().tolist():
            a, b = scores[row, expected[row]].item(), scores[row, got[row]].item()
            assert temps[row] > 0 and abs(a - b) <= 1e-5 * max(1.0, abs(a)), (case, row, a, b)
    assert drawn == {"_draw_top_k", "_draw_top_p", "_draw_split"}
