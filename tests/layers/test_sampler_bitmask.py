"""The sampler under grammar bitmasks and logit_bias, on every path (plain draw, filters, penalties,
logprobs, bans): masked rows draw from the renormalised allowed set, unmasked rows draw exactly what
they draw without masks in the batch; logit_bias shifts the distribution as OpenAI defines it."""
import numpy as np
import pytest
import torch

from nanovllm.layers.sampler import Sampler
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.grammar_masks import BitmaskBuffers
from nanovllm.worker.sampling_inputs import build_sampling_metadata
from test_sampler import DRAWS, V, _check_distribution, _logits, _seqs, reference_probs

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
ALLOWED = [1, 4, 9, 10]


@pytest.fixture(params=DEVICES, ids=str)
def device(request):
    return request.param


def _masked_sample(logits, seqs, masked: list[int], allowed: list[int], device, eos=()):
    """Sample with row masked[k] under a mask allowing `allowed` (through BitmaskBuffers, as the runner)."""
    buffers = BitmaskBuffers(len(seqs), V, device)
    rows, masks = buffers.host()
    rows[:len(seqs)] = -1
    bits = masks.numpy().view(np.uint32)
    for k, row in enumerate(masked):
        rows[row] = k
        bits[k] = 0
        for t in allowed:
            bits[k, t >> 5] |= np.uint32(1 << (t & 31))
    meta = build_sampling_metadata(seqs, device, eos)
    meta.mask_rows, meta.masks, meta.masked_rows = buffers.send(len(seqs), len(masked))
    return Sampler().sample(logits.to(device), meta)


CASES = [dict(temperature=1.0), dict(temperature=0.6), dict(top_k=2), dict(top_p=0.5), dict(min_p=0.2),
         dict(temperature=1.3, top_k=3, top_p=0.9)]


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_masked_rows_draw_from_the_allowed_tokens(kw, device):
    logits = _logits()
    # Alternate rows masked / free: the masked rows' distribution is the filters' over the allowed set.
    seqs = _seqs([SamplingParams(**kw)] * DRAWS, seeds=range(DRAWS))
    masked = list(range(0, DRAWS, 2))
    tokens = _masked_sample(logits.expand(DRAWS, V).clone(), seqs, masked, ALLOWED, device).token_ids.cpu()
    restricted = logits.clone()
    restricted[[t for t in range(V) if t not in ALLOWED]] = float("-inf")
    _check_distribution(tokens[0::2], reference_probs(restricted, **kw), f"masked {kw}")
    free = Sampler().sample(logits.expand(DRAWS, V).clone().to(device),
                            build_sampling_metadata(seqs, device)).token_ids.cpu()
    assert torch.equal(tokens[1::2], free[1::2])  # unmasked rows: the same tokens as with no mask at all


def test_greedy_penalties_bans_and_logprobs_under_masks(device):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[4]), SamplingParams(temperature=0)]
    seqs = _seqs(params, outputs=[[9], [9, 1], [], [1]])
    out = _masked_sample(logits.clone(), seqs, [0, 1, 2], ALLOWED, device, eos=[1])
    tokens = out.token_ids.cpu()
    x = logits.clone()
    x[:3, [t for t in range(V) if t not in ALLOWED]] = float("-inf")
    assert tokens[0] == x[0].argmax() and tokens[3] == logits[3].argmax()
    assert tokens[1] in ALLOWED and tokens[2] in (9, 10)  # eos (1) and the stop id (4) banned under min_tokens
    # logprobs of the constrained distribution: the allowed tokens' probabilities sum to one.
    lp = out.logprobs.cpu()
    assert torch.allclose(lp[0, 0], torch.log_softmax(x[0], -1)[tokens[0]])
    assert torch.isinf(lp[0, 1:]).sum() == max(0, 3 - len(ALLOWED))


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)])
def test_logit_bias_shifts_the_distribution(kw, device):
    logits = _logits()
    bias = {0: 2.0, 5: -1.5, 11: 100.0}
    seqs = _seqs([SamplingParams(logit_bias=bias, **kw)] * DRAWS, seeds=range(DRAWS))
    tokens = Sampler().sample(logits.expand(DRAWS, V).clone().to(device),
                              build_sampling_metadata(seqs, device)).token_ids.cpu()
    biased = logits.clone()
    for t, b in bias.items():
        biased[t] += b
    _check_distribution(tokens, reference_probs(biased, **kw), f"logit_bias {kw}")
    greedy = _seqs([SamplingParams(temperature=0, logit_bias={7: 100.0}), SamplingParams(temperature=0)])
    got = Sampler().sample(logits.expand(2, V).clone().to(device), build_sampling_metadata(greedy, device)).token_ids
    assert got.tolist() == [7, int(logits.argmax())]
