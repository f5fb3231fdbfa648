"""The sampler on fixed logits: filtered distributions, penalties against HF, bans, seeds, logprobs."""
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.sampling_inputs import build_sampling_metadata

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
DEV = DEVICES[0]
V = 16
DRAWS = 20000
EOS = 3


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(V, generator=g) * 1.5


def _seqs(params: list[SamplingParams], seeds=None, outputs=None, prompt=(5, 6, 7)) -> list[Sequence]:
    seqs = []
    for i, sp in enumerate(params):
        seq = Sequence(list(prompt), sp, seed=i if seeds is None else seeds[i])
        for t in (outputs[i] if outputs else []):
            seq.append_token(t)
        seqs.append(seq)
    return seqs


@pytest.fixture(params=DEVICES, ids=str, autouse=True)
def on_device(request):
    """Every test runs on the CPU, and on the GPU too where there is one (helpers read DEV)."""
    global DEV
    DEV = request.param
    yield DEV


def _sample(logits: torch.Tensor, seqs, eos=()) -> torch.Tensor:
    return Sampler()(logits.to(DEV), build_sampling_metadata(seqs, DEV, eos)).cpu()


def reference_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """vLLM's semantics, one row, in float64 and plain sorting: min_p, top_k, then top_p on what is left."""
    x = logits.double() / temperature
    p = torch.softmax(x, -1)
    keep = torch.ones(V, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= torch.sort(x, descending=True).values[min(top_k, V) - 1]
    q = torch.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        order = torch.argsort(q, descending=True)
        mass_before = torch.cumsum(q[order], 0) - q[order]
        assert (mass_before[1:] - top_p).abs().min() > 1e-3, "p too close to a boundary for a clean test"
        kept = order[mass_before < top_p]
        q = torch.zeros_like(q).index_fill_(0, kept, 1.0) * q
        q /= q.sum()
    return q.float()


def _empirical(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def _check_distribution(tokens, expected, what):
    got = _empirical(tokens)
    assert torch.all(got[expected == 0] == 0), f"{what}: drew tokens outside the support: {got}"
    tv = 0.5 * (got - expected).abs().sum().item()
    assert tv < 0.03, f"{what}: total variation {tv:.4f}\ngot      {got}\nexpected {expected}"


CASES = [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
    dict(top_k=3), dict(top_k=1), dict(top_k=V + 10), dict(top_p=0.62), dict(top_p=1e-6),
    dict(min_p=0.1), dict(temperature=0.7, top_k=6, top_p=0.8),
    dict(temperature=1.3, top_k=8, top_p=0.75, min_p=0.05), dict(min_p=0.2, top_p=0.9),
]


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_filtered_distribution(kw):
    logits = _logits()
    tokens = _sample(logits.expand(DRAWS, V), _seqs([SamplingParams(**kw)] * DRAWS, seeds=range(DRAWS)))
    _check_distribution(tokens, reference_probs(logits, **kw), str(kw))


def test_mixed_batch_rows_follow_their_own_parameters():
    """Filtered and unfiltered rows interleaved: per-row parameters and row subsets line up."""
    logits = _logits()
    kinds = [dict(temperature=0.8, top_k=5, top_p=0.7), dict(), dict(min_p=0.15), dict(temperature=0)]
    params = [SamplingParams(**kinds[i % 4]) for i in range(DRAWS)]
    tokens = _sample(logits.expand(DRAWS, V), _seqs(params, seeds=range(DRAWS)))
    for k, kw in enumerate(kinds[:3]):
        _check_distribution(tokens[k::4], reference_probs(logits, **kw), str(kw))
    assert torch.all(tokens[3::4] == logits.argmax())


def test_greedy_is_argmax_and_ignores_filters():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=2 + i % 3, top_p=0.5, min_p=0.3, seed=i) for i in range(64)]
    assert torch.equal(_sample(logits, _seqs(params)), logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    mine = [SamplingParams(temperature=0.9, top_k=7), SamplingParams(top_p=0.8, min_p=0.05), SamplingParams()]
    alone = _sample(logits[:3], _seqs(mine, seeds=[11, 22, 33], outputs=[[1], [1, 2], []]))
    others = [SamplingParams(temperature=0), SamplingParams(top_p=0.3, repetition_penalty=1.5),
              SamplingParams(temperature=2.0, min_p=0.4, presence_penalty=1.0)]
    order = [4, 0, 5, 2, 3, 1]  # batch rows: others and mine interleaved
    all_params, all_logits = mine + others, torch.cat([logits[:3], logits[3:]])
    seqs = _seqs([all_params[j] for j in order], seeds=[[11, 22, 33, 1, 2, 3][j] for j in order],
                 outputs=[[[1], [1, 2], [], [4], [5, 5], []][j] for j in order])
    mixed = _sample(all_logits[order], seqs)
    for row, j in enumerate(order):
        if j < 3:
            assert mixed[row] == alone[j]


def test_unfiltered_rows_are_untouched_by_filtered_neighbours():
    logits = _logits().expand(4000, V)
    plain = _sample(logits, _seqs([SamplingParams()] * 4000, seeds=range(4000)))
    params = [SamplingParams() if i % 2 else SamplingParams(top_k=2, top_p=0.5, min_p=0.5) for i in range(4000)]
    mixed = _sample(logits, _seqs(params, seeds=range(4000)))
    assert torch.equal(mixed[1::2], plain[1::2])


def test_input_logits_are_not_modified():
    logits = torch.randn(8, V, device=DEV)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                             min_tokens=2, logprobs=2)] * 8
    Sampler().sample(logits, build_sampling_metadata(_seqs(params, outputs=[[1, 2]] * 8), DEV, {EOS}))
    assert torch.equal(logits, before)


# ---- penalties -----------------------------------------------------------------------------
def _histories(num_rows):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (3 + i,), generator=g).tolist() for i in range(num_rows)]
    outputs = [torch.randint(0, V, (i % 5,), generator=g).tolist() for i in range(num_rows)]
    return prompts, outputs


def _penalized(logits, params, prompts, outputs):
    seqs = [Sequence(p, sp, seed=0) for p, sp in zip(prompts, params)]
    for seq, out in zip(seqs, outputs):
        for t in out:
            seq.append_token(t)
    return Sampler().process_logits(logits.to(DEV), build_sampling_metadata(seqs, DEV)).cpu()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    prompts, outputs = _histories(6)
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * 3
    ours = _penalized(logits, [SamplingParams(repetition_penalty=penalty)] * 6, prompts, outputs)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(6):
        ref = hf(torch.tensor([prompts[i] + outputs[i]]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref)


def test_presence_frequency_penalties_match_vllm_formula():
    prompts, outputs = _histories(6)
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(presence_penalty=0.3 * (i - 2), frequency_penalty=0.25 * (3 - i), repetition_penalty=1.2)
              for i in range(6)]
    ours = _penalized(logits, params, prompts, outputs)
    for i, sp in enumerate(params):
        ref = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompts[i] + outputs[i]]), logits[i:i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=V).float()  # output only
        ref = ref - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(ours[i], ref)


def test_penalties_touch_only_their_rows_and_steer_greedy():
    prompts, outputs = _histories(4)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    logits[:, 9] = 10.0  # token 9 dominates...
    outputs = [o + [9] for o in outputs]  # ...and was generated, so a strong penalty must move greedy off it
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0),
              SamplingParams(temperature=0)] * 2
    ours = _penalized(logits, params, prompts, outputs)
    assert torch.equal(ours[1::2], logits[1::2])
    seqs = [Sequence(p, sp, seed=0) for p, sp in zip(prompts, params)]
    for seq, out in zip(seqs, outputs):
        for t in out:
            seq.append_token(t)
    tokens = _sample(logits, seqs)
    assert tokens.tolist()[1::2] == [9, 9] and 9 not in tokens.tolist()[0::2]
    assert torch.equal(tokens, ours.argmax(-1))


def test_penalties_read_in_flight_tokens_from_the_device():
    """With steps overlapped, a sequence's newest output is a placeholder until the host reads it;
    the penalties take it from the previous step's sampled tokens instead."""
    prompts, outputs = _histories(4)
    outputs = [o + [9] for o in outputs]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5)] * 4
    known = _penalized(logits, params, prompts, outputs)
    seqs = []
    for i, (p, sp, out) in enumerate(zip(prompts, params, outputs)):
        seq = Sequence(p, sp, seed=0)
        seq.token_ids += out[:-1] + [-1]  # the placeholder of a token still on the device
        seq.num_pending_tokens = 1
        seqs.append(seq)
    last_sampled = torch.tensor([5, 9, 9, 1, 9, 9], device=DEV)  # the previous step's tokens; rows 1, 2, 4, 5 are ours
    rows = {seqs[0].seq_id: 4, seqs[1].seq_id: 1, seqs[2].seq_id: 2, seqs[3].seq_id: 5}
    meta = build_sampling_metadata(seqs, DEV, last_sampled=last_sampled, last_row_of_seq=rows)
    torch.testing.assert_close(Sampler().process_logits(logits.to(DEV), meta).cpu(), known)


def test_plain_batches_build_no_optional_inputs():
    meta = build_sampling_metadata(_seqs([SamplingParams(), SamplingParams(temperature=0)], outputs=[[1], [2]]),
                                   DEV, {EOS})
    assert (meta.top_k, meta.top_p, meta.min_p, meta.penalties, meta.banned_ids, meta.max_num_logprobs) == (None,) * 6


# ---- min_tokens ----------------------------------------------------------------------------------
def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 50.0
    logits[:, 8] = 40.0
    logits[:, 10] = 30.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[8]),   # 2 outputs: both banned
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8]),   # 2 outputs: free
              SamplingParams(min_tokens=5, ignore_eos=True, stop_token_ids=[8]),  # eos is no stop: allowed
              SamplingParams(temperature=0.5, min_tokens=3)]
    tokens = _sample(logits, _seqs(params, outputs=[[1, 1]] * 4), eos={EOS})
    assert tokens.tolist() == [10, EOS, EOS, 8]


# ---- logprobs ------------------------------------------------------------------------------------
def test_logprobs_are_raw_and_ranked():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9)) * 2
    params = [SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=1.7),
              SamplingParams(logprobs=0, top_k=2), SamplingParams(), SamplingParams(logprobs=5, temperature=0),
              SamplingParams(logprobs=2, min_tokens=4)]
    meta = build_sampling_metadata(_seqs(params, outputs=[[0, 1]] * 5), DEV, {EOS})
    assert meta.max_num_logprobs == 5
    out = Sampler().sample(logits.to(DEV), meta).to_host()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    ref = torch.log_softmax(logits.double(), -1).float()
    ids, values = out.logprob_token_ids, out.logprobs
    assert ids.shape == values.shape == (5, 6)
    assert torch.equal(ids[:, 0], out.token_ids)
    torch.testing.assert_close(values[:, 0], ref.gather(1, out.token_ids[:, None])[:, 0])
    top = ref.topk(5, -1)
    assert torch.equal(ids[:, 1:], top.indices)
    torch.testing.assert_close(values[:, 1:], top.values)
    ranks = (ref > ref.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, ranks)
    lists = out.logprobs_lists()
    assert lists.row(2) == (ids[2].tolist(), values[2].tolist(), int(ranks[2]))


def test_no_logprobs_no_extra_outputs():
    out = Sampler().sample(torch.randn(2, V, device=DEV), build_sampling_metadata(_seqs([SamplingParams()] * 2), DEV))
    assert out.logprobs is None and out.logprobs_lists() is None


def test_exponential_noise_is_exact_and_never_zero_over_every_hash():
    """Every one of the 2^23 values the hash can pick: finite, positive, equal to -log1p(-w) in
    float64. E = 0 (from u rounding to 1) would make its token win however unlikely it is."""
    from nanovllm.layers.sampler import exponential_from_bits
    k = torch.arange(1 << 23, dtype=torch.int64)
    e = exponential_from_bits(k << 9 | 0x1FF)  # the low 9 bits are ignored
    assert torch.equal(e, exponential_from_bits(k << 9))
    w = (k.double() + 0.5) / (1 << 23)
    exact = -torch.log1p(-w)
    assert e.min() > 0 and torch.isfinite(e).all()
    assert ((e.double() - exact).abs() / exact).max() < 1e-6
    assert e.max() < 17


def test_a_dominant_token_is_always_drawn():
    """logit 40 against 0 elsewhere: any other token has probability ~e^-40 * V; no draw over 10^8
    (row, token) noise values may pick one. (With E = 0 possible, the Gumbel form -log(E) of the
    GPU kernel and of the top-k path made ~7 of these rows draw a token at random.)"""
    vocab, rows = 120_000, 250
    logits = torch.zeros(rows, vocab)
    logits[:, 123] = 40.0
    for batch in range(4):
        seeds = [(batch * rows + i) * 7919 for i in range(rows)]
        seqs = _seqs([SamplingParams(temperature=1.0)] * rows, seeds=seeds)
        assert Sampler()(logits.to(DEV), build_sampling_metadata(seqs, DEV, ())).eq(123).all()
