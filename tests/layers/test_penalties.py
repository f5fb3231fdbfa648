"""The penalties at the (row, token) pairs that occur against the same arithmetic over the whole
vocabulary."""
import dataclasses

import pytest
import torch

from nanovllm.layers.penalties import PenaltyInputs, apply_penalties_

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _flat(tokens, lens):
    """Zero-padded [P, L] histories as (tokens, row of each), the form PenaltyInputs takes."""
    valid = torch.arange(tokens.shape[1])[None, :] < lens[:, None]
    return tokens[valid], torch.arange(tokens.shape[0])[:, None].expand_as(tokens)[valid]


def _dense_penalties(logits, rows, outputs, out_lens, prompts, prompt_lens, rep, freq, pres):
    """The penalties over the whole [rows, vocab] (the sampler's former form): counts by scatter_add."""
    def counts_of(tokens, lens):
        valid = torch.arange(tokens.shape[1])[None, :] < lens[:, None]
        return torch.zeros(tokens.shape[0], logits.shape[1]).scatter_add_(1, tokens, valid.float())
    x = logits if rows is None else logits.index_select(0, rows)
    counts = counts_of(outputs, out_lens)
    in_output = counts > 0
    if rep is not None:
        seen = in_output | (counts_of(prompts, prompt_lens) > 0)
        penalty = torch.where(seen, rep[:, None], 1.0)
        x = torch.where(x > 0, x / penalty, x * penalty)
    if freq is not None:
        x = x - freq[:, None] * counts
    if pres is not None:
        x = x - pres[:, None] * in_output
    return x if rows is None else logits.index_copy(0, rows, x)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("which", ["all", "repetition", "frequency_presence"])
def test_penalties_at_the_occurring_pairs_equal_the_dense_form(which, device):
    """Many repeats (a 40-token vocabulary), tokens in both prompt and output, empty histories,
    a subset of rows, -inf and zeros: the same values as the whole-vocabulary computation."""
    g = torch.Generator().manual_seed(11)
    batch, rows, vocab = 7, torch.tensor([0, 2, 3, 6]), 40
    logits = torch.randn(batch, vocab, generator=g) * 4
    logits[0, :3] = torch.tensor([float("-inf"), 0.0, -0.0])
    out_lens, prompt_lens = torch.tensor([0, 30, 5, 60]), torch.tensor([3, 0, 25, 9])
    outputs = torch.randint(0, vocab, (4, 60), generator=g) * (torch.arange(60) < out_lens[:, None])
    prompts = torch.randint(0, vocab, (4, 25), generator=g) * (torch.arange(25) < prompt_lens[:, None])
    rep = torch.tensor([1.3, 0.7, 1.0, 2.0]) if which != "frequency_presence" else None
    freq = torch.tensor([0.5, -0.25, 0.0, 1.5]) if which != "repetition" else None
    pres = torch.tensor([-1.0, 0.3, 0.7, 0.0]) if which != "repetition" else None
    p = PenaltyInputs(rows, *_flat(outputs, out_lens), *(_flat(prompts, prompt_lens) if rep is not None else (None, None)),
                      rep, freq, pres)
    on_dev = PenaltyInputs(**{f.name: None if getattr(p, f.name) is None else getattr(p, f.name).to(device)
                              for f in dataclasses.fields(p)})
    ours = apply_penalties_(logits.to(device, copy=True), on_dev).cpu()
    assert torch.equal(ours, _dense_penalties(logits, rows, outputs, out_lens, prompts, prompt_lens, rep, freq, pres))  # (the dense form's x - 0.0 may flip a -0.0's sign)
