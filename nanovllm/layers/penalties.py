"""Repetition, frequency and presence penalties (HF's and vLLM's definitions) on a batch's logits,
computed at the (row, token) pairs that occur in the rows' histories rather than over the
vocabulary."""
from dataclasses import dataclass

import torch


@dataclass
class PenaltyInputs:
    """Token histories of the rows that use penalties, as zero-padded [P, L] tensors with lengths."""
    rows: torch.Tensor | None              # [P] rows of the batch, None: all rows
    output_tokens: torch.Tensor            # [P, Lo] int64 generated tokens
    output_lens: torch.Tensor              # [P] int64
    prompt_tokens: torch.Tensor | None     # [P, Lp] int64; only when some row has a repetition penalty
    prompt_lens: torch.Tensor | None
    repetition: torch.Tensor | None        # [P] float32, 1.0 = off; None when no row uses it
    frequency: torch.Tensor | None         # [P] float32, 0.0 = off
    presence: torch.Tensor | None          # [P] float32, 0.0 = off


def _occurrences(tokens: torch.Tensor, lens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each row's first lens[i] tokens of the zero-padded [P, L] tokens; the padding becomes
    vocab_size (a spare column)."""
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lens[:, None]
    return torch.where(valid, tokens, vocab_size)


def apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt and output), then frequency and presence (over the output).
    Computed at the (row, token) pairs that occur, a few thousand per row against a vocabulary of
    ~10^5: nothing of [rows, vocab] size beyond one copy of the logits, and no host sync. The same
    float operations as over the whole vocabulary, so the same values. Out of place: the caller's
    logits stay intact (they may be the raw logits logprobs need)."""
    batch, vocab_size = logits.shape
    device = logits.device
    # The padding reads and writes a spare column. A pair that occurs several times is written once
    # per occurrence, with the same value each time.
    x = torch.empty(batch, vocab_size + 1, dtype=logits.dtype, device=device)
    x[:, :vocab_size] = logits
    tokens = _occurrences(p.output_tokens, p.output_lens, vocab_size)
    if p.repetition is not None:
        tokens = torch.cat([tokens, _occurrences(p.prompt_tokens, p.prompt_lens, vocab_size)], dim=1)
    num_rows, width = tokens.shape
    output = tokens[:, :p.output_tokens.shape[1]].sort(dim=1).values
    count = torch.searchsorted(output, tokens, right=True) - torch.searchsorted(output, tokens)  # in the output
    rows = (torch.arange(num_rows, device=device) if p.rows is None else p.rows)[:, None].expand(num_rows, width)
    value = x[rows, tokens]
    if p.repetition is not None:
        value = torch.where(value > 0, value / p.repetition[:, None], value * p.repetition[:, None])
    if p.frequency is not None:
        value = value - p.frequency[:, None] * count.to(value.dtype)
    if p.presence is not None:
        value = value - p.presence[:, None] * (count > 0)
    x[rows, tokens] = value
    return x[:, :vocab_size]
