"""Repetition, frequency and presence penalties (HF's and vLLM's definitions) on a batch's logits,
computed at the (row, token) pairs that occur in the rows' histories rather than over the
vocabulary."""
from dataclasses import dataclass

import torch


@dataclass
class PenaltyInputs:
    """Token histories of the rows that use penalties, flattened: every history's tokens one after
    the other, each with the index of its row among the penalised rows (0..P-1)."""
    rows: torch.Tensor | None              # [P] rows of the batch, None: all rows
    output_tokens: torch.Tensor            # [No] int64 generated tokens
    output_rows: torch.Tensor              # [No] int64
    prompt_tokens: torch.Tensor | None     # [Np] int64; only when some row has a repetition penalty
    prompt_rows: torch.Tensor | None       # [Np] int64
    repetition: torch.Tensor | None        # [P] float32, 1.0 = off; None when no row uses it
    frequency: torch.Tensor | None         # [P] float32, 0.0 = off
    presence: torch.Tensor | None          # [P] float32, 0.0 = off


def apply_penalties_(x: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt and output), then frequency and presence (over the output).
    Computed at the (row, token) pairs that occur, a few thousand per row against a vocabulary of
    ~10^5: nothing of [rows, vocab] size beyond one copy of the logits, and no host sync. The same
    float operations as over the whole vocabulary, so the same values. In place on x [B, V]: the
    caller passes a copy where the logits must stay (the raw logits logprobs need)."""
    vocab_size = x.shape[1]
    tokens, local = p.output_tokens, p.output_rows
    if p.repetition is not None:
        tokens, local = torch.cat([tokens, p.prompt_tokens]), torch.cat([local, p.prompt_rows])
    rows = local if p.rows is None else p.rows[local]
    # A pair that occurs several times is written once per occurrence, with the same value each time.
    value = x[rows, tokens]
    if p.repetition is not None:
        value = torch.where(value > 0, value / p.repetition[local], value * p.repetition[local])
    if p.frequency is not None or p.presence is not None:
        # How often each pair occurs in the output: the width of its run among the sorted output pairs.
        output = (p.output_rows * vocab_size + p.output_tokens).sort().values
        keys = local * vocab_size + tokens
        count = torch.searchsorted(output, keys, right=True) - torch.searchsorted(output, keys)
        if p.frequency is not None:
            value = value - p.frequency[local] * count.to(value.dtype)
        if p.presence is not None:
            value = value - p.presence[local] * (count > 0)
    x[rows, tokens] = value
    return x
